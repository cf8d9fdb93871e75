"""The sampler's data: the rows it is given (`SampleRow`), what it answers (`SamplerOutput`)
and what it keeps of each sequence between steps (`SequenceSamplerState`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.sampling import SamplingParams, is_int

_MAX_SEED = 2**64 - 1
_MAX_COUNTER = 2**32 - 1


@dataclass(frozen=True)
class SampleRow:
    """One row of the logits to sample from: which sequence, with what parameters, at which step.

    output_position counts the tokens this choice has generated so far, so it is the index of the
    token being sampled. entropy_seed stands in for params.seed when that is None; the caller draws
    it once per sequence (e.g. from os.urandom at admission) and keeps it across preemption.

    history: (prompt token ids, output token ids so far) for a sequence whose params use
    penalties or structured output, on its first row; it (re)starts the sampler's state of
    that sequence (its grammar's state is rebuilt from the output), whose later outputs the
    sampler records itself.
    """

    seq_id: int
    params: SamplingParams
    choice_index: int
    output_position: int
    entropy_seed: int
    history: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if (
            type(self.seq_id) is type(self.choice_index) is type(self.output_position) is type(self.entropy_seed) is int
            and 0 <= self.choice_index <= _MAX_COUNTER
            and 0 <= self.output_position <= _MAX_COUNTER
            and 0 <= self.entropy_seed <= _MAX_SEED
            and self.history is None
            and type(self.params) is SamplingParams
        ):
            return  # (every row a runner makes: the checks below, in one test)
        if not is_int(self.seq_id):
            raise ValueError(f"seq_id must be an int, got {self.seq_id!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if not is_int(self.choice_index) or not 0 <= self.choice_index <= _MAX_COUNTER:
            raise ValueError(f"choice_index must be an int in [0, 2**32 - 1], got {self.choice_index!r}")
        if not is_int(self.output_position) or not 0 <= self.output_position <= _MAX_COUNTER:
            raise ValueError(f"output_position must be an int in [0, 2**32 - 1], got {self.output_position!r}")
        if not is_int(self.entropy_seed) or not 0 <= self.entropy_seed <= _MAX_SEED:
            raise ValueError(f"entropy_seed must be an int in [0, 2**64 - 1], got {self.entropy_seed!r}")
        if self.history is not None and len(self.history[1]) != self.output_position:
            raise ValueError(
                f"history holds {len(self.history[1])} output tokens at output_position {self.output_position}"
            )

    @property
    def effective_seed(self) -> int:
        return self.entropy_seed if self.params.seed is None else self.params.seed


@dataclass(frozen=True)
class SamplerOutput:
    """Per token, in row order: the sampled token, its logprob under the raw (unmodified) logits
    (None where the row asked for no logprobs: not computed), and the top-N raw logprobs as
    (token_id, logprob) sorted descending, or None where none were asked. `counts`: how many
    tokens each row gave (a verify row: its accepted drafts and one more), None for one each."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    counts: list[int] | None = None

    def per_row(self) -> list[list[int]]:
        """The token ids, grouped by row."""
        if self.counts is None:
            return [[t] for t in self.token_ids]
        out, i = [], 0
        for n in self.counts:
            out.append(self.token_ids[i : i + n])
            i += n
        return out


@dataclass
class SequenceSamplerState:
    """What the sampler remembers about one sequence between steps, until it is released.

    output_token_ids holds its output tokens: the history it was created with (if any) and
    every token sampled for it since; prompt_token_ids the prompt's, when penalties need it.
    key_prefix caches the hash lanes folded over (seed, choice_index) so that a step only folds in
    its output position; key_source records which (seed, choice_index) they were folded from.

    Invariants: output_token_counts == Counter(output_token_ids) and
    prompt_token_id_set == set(prompt_token_ids), so a step's penalties cost the number of
    distinct tokens, not the length of the history. Change the history only through
    reset_history() and append_output(), which keep them.
    """

    seq_id: int
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: tuple[int, ...] = ()
    has_history: bool = False
    key_source: tuple[int, int] | None = None
    key_prefix: tuple[int, int] = (0, 0)
    matcher: object | None = None  # structured output: the grammar's state (llguidance)
    output_token_counts: Counter[int] = field(init=False, repr=False)
    prompt_token_id_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.output_token_counts = Counter(self.output_token_ids)
        self.prompt_token_id_set = frozenset(self.prompt_token_ids)

    def reset_history(self, prompt_token_ids: Iterable[int], output_token_ids: Iterable[int]) -> None:
        """(Re)starts the history, e.g. for a sequence re-admitted after preemption."""
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids = list(output_token_ids)
        self.prompt_token_id_set = frozenset(self.prompt_token_ids)
        self.output_token_counts = Counter(self.output_token_ids)
        self.has_history = True

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.output_token_counts[token_id] += 1
