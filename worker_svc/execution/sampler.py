"""The last stage's sampler: masks, temperature, top-k, top-p, min-p, counter-based seeds, logprobs.

Flow of one call, vectorised over the rows of a micro-batch, each row with its own parameters:

    raw logits -> log_softmax (reported logprobs)
               -> logit bias (added)
               -> min_tokens masks (stop / EOS ids set to -inf)
               -> penalties (vLLM's order: repetition over prompt + output, then frequency
                  and presence over the output)
               -> greedy rows: argmax (ties: lowest id)
               -> other rows: / temperature -> top-k -> top-p -> min-p -> exponential race

Randomness is counter-based. A sampled row draws one uniform per vocabulary entry from a stateless
32-bit integer hash of (seed, choice_index, output_position, token_id) and picks
argmax_i (log p_i - log E_i) with E_i = -log U_i, i.e. argmax_i p_i / E_i with E_i ~ Exp(1):
the winner of an exponential race, which is token i with probability p_i. Nothing else enters the
draw, so a seeded choice gives the same token whatever batch or row it lands in, whatever the
pipeline split, and after preemption and recompute. The hash uses only int64 shifts, xors, masks and
products that stay below 2**63, so CPU and CUDA produce the same bits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain, repeat

import torch

from services.sampling import GREEDY_TEMPERATURE, SamplingParams, is_int
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.structured import GrammarBank

_MASK32 = 0xFFFFFFFF
_MAX_SEED = 2**64 - 1
_MAX_COUNTER = 2**32 - 1
_GREEDY_TEMPERATURE = GREEDY_TEMPERATURE
# lowbias32 (Chris Wellons' hash prospector): a 32-bit bijection with good avalanche.
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B
# Two independent lanes of 32 bits each give every (seed, choice, position) a 64-bit key.
_LANE_IVS = (0x9E3779B9, 0x85EBCA77)
# Turns 32 random bits into a uniform in (0, 1): (bits + 0.5) / 2**32, exact in float64.
_INV_2_32 = 2.0**-32


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
        if (type(self.seq_id) is type(self.choice_index) is type(self.output_position) is type(self.entropy_seed) is int
                and 0 <= self.choice_index <= _MAX_COUNTER and 0 <= self.output_position <= _MAX_COUNTER
                and 0 <= self.entropy_seed <= _MAX_SEED and self.history is None
                and type(self.params) is SamplingParams):
            return  # (every row a runner makes: the checks below, in one test)
        if not is_int(self.seq_id):
            raise ValueError(f"seq_id must be an int, got {self.seq_id!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if not is_int(self.choice_index) or not 0 <= self.choice_index <= _MAX_COUNTER:
            raise ValueError(
                f"choice_index must be an int in [0, 2**32 - 1], got {self.choice_index!r}"
            )
        if not is_int(self.output_position) or not 0 <= self.output_position <= _MAX_COUNTER:
            raise ValueError(
                f"output_position must be an int in [0, 2**32 - 1], got {self.output_position!r}"
            )
        if not is_int(self.entropy_seed) or not 0 <= self.entropy_seed <= _MAX_SEED:
            raise ValueError(
                f"entropy_seed must be an int in [0, 2**64 - 1], got {self.entropy_seed!r}"
            )
        if self.history is not None and len(self.history[1]) != self.output_position:
            raise ValueError(
                f"history holds {len(self.history[1])} output tokens at output_position "
                f"{self.output_position}"
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
            out.append(self.token_ids[i:i + n])
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


class Sampler:
    """Samples one token per row on the last stage and keeps per-sequence state.

    State is created the first time a seq_id is sampled and dropped by release(); the caller releases
    every sequence that finished or was preempted. A row's draw depends only on its
    (seed, choice_index, output_position), never on the rest of the batch.
    """

    def __init__(self, grammars: GrammarBank | None = None) -> None:
        self._states: dict[int, SequenceSamplerState] = {}
        self.grammars = grammars  # structured output (None: refused)

    @property
    def num_live_states(self) -> int:
        return len(self._states)

    @property
    def live_seq_ids(self) -> tuple[int, ...]:
        return tuple(self._states)

    def state(self, seq_id: int) -> SequenceSamplerState | None:
        return self._states.get(seq_id)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Drops the state of these sequences; ids without state (never sampled) are ignored."""
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow],
               drafts: Sequence[tuple[int, ...]] | None = None) -> SamplerOutput:
        """logits: [num_rows, vocab_size], any float dtype, on any device; one SampleRow per row.

        `drafts` (speculative decoding): per row, draft tokens to verify; a row with k of them
        has k + 1 logits rows, one per position from its last known token on (`verify`)."""
        num_logits = len(rows) + (sum(len(d) for d in drafts) if drafts else 0)
        if logits.dim() != 2 or logits.shape[0] != num_logits:
            raise InvalidPlanError(
                f"sampler got logits of shape {tuple(logits.shape)} for {num_logits} rows"
            )
        seq_ids = [row.seq_id for row in rows]
        if len(set(seq_ids)) != len(seq_ids):
            repeated = sorted({seq_id for seq_id in seq_ids if seq_ids.count(seq_id) > 1})
            raise InvalidPlanError(f"sequences appear twice in one sampling batch: {repeated}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])

        for row in rows:
            state = self._states.get(row.seq_id)
            if row.params.needs_history and row.history is None and (
                    state is None or not state.has_history):
                raise InvalidPlanError(f"sequence {row.seq_id}: penalties and structured output "
                                       "need its history on its first sampling row")
            if row.params.structured is not None and self.grammars is None:
                raise InvalidPlanError(f"sequence {row.seq_id}: this stage has no structured output")
        states = [self._state_for(row) for row in rows]
        logits = logits.float()  # [num_logits, vocab]
        if drafts and any(drafts):
            return self._verify(logits, rows, states, drafts)
        token_ids = self._draw(logits, rows, states)
        token_list = token_ids.tolist()
        self._record(rows, states, [[t] for t in token_list])
        token_logprobs, top_logprobs = _logprobs(logits, rows, token_ids)
        return SamplerOutput(token_ids=token_list, logprobs=token_logprobs, top_logprobs=top_logprobs)

    def _draw(self, logits: torch.Tensor, rows: Sequence[SampleRow],
              states: Sequence[SequenceSamplerState]) -> torch.Tensor:
        """One token per row of float32 logits ([rows]): the masks, then greedy or sampled."""
        if all(_plain_greedy(row, state) for row, state in zip(rows, states, strict=True)):
            return _argmax(logits)  # (no mask to apply, nothing to draw)
        masked = _apply_logit_bias(logits, rows)
        masked = _apply_min_tokens_masks(masked, rows)
        masked = _apply_penalties(masked, rows, states)
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        if constrained:
            masked = self._apply_grammars(logits, masked, [rows[i] for i in constrained],
                                          [states[i] for i in constrained], constrained)
        token_ids = _argmax(masked)  # [num_rows]; greedy rows keep this (ties: lowest id)

        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if sampled:
            keys = [_row_key(states[i], rows[i]) for i in sampled]
            index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            drawn = _sample_filtered(
                masked.index_select(0, index), [rows[i].params for i in sampled], keys
            )
            token_ids = token_ids.index_copy(0, index, drawn)
        return token_ids

    @staticmethod
    def _record(rows: Sequence[SampleRow], states: Sequence[SequenceSamplerState],
                tokens: Sequence[Sequence[int]]) -> None:
        """Each row's new output tokens join its history (and advance its grammar)."""
        for row, state, row_tokens in zip(rows, states, tokens, strict=True):
            for token_id in row_tokens:
                state.append_output(token_id)
                if state.matcher is not None and not GrammarBank.advance(
                        state.matcher, token_id, row.params.eos_token_ids):
                    state.matcher = None  # cannot happen under the mask; never wedge the sequence

    def _verify(self, logits: torch.Tensor, rows: Sequence[SampleRow],
                states: Sequence[SequenceSamplerState], drafts: Sequence[tuple[int, ...]]) -> SamplerOutput:
        """Speculative decoding's verification: each row samples at every position of its
        drafts and after them, exactly as it would have one step at a time (the same masks,
        the same counter-based draw at each output position), keeps the drafts up to the
        first that differs from its sample there, and ends with that sample (or the one after
        the last draft).

        A draft is a point mass (n-gram lookup, a greedy draft model), so keeping it exactly
        when the target's own draw equals it is rejection sampling: accepted with probability
        p(draft), and otherwise the token comes from p without the draft, renormalized. The
        output is the target's distribution, and with a seed the same tokens as without
        speculation.

        Rows without history (no penalties, no grammar) draw every position in one pass;
        the others go position by position, their state advanced by the drafts they keep."""
        firsts, at = [], 0
        for d in drafts:
            firsts.append(at)
            at += len(d) + 1
        tokens: list[list[int]] = [[] for _ in rows]
        simple = [i for i, row in enumerate(rows) if not row.params.needs_history]
        if simple:
            self._verify_at_once(logits, rows, states, drafts, firsts, simple, tokens)
        stepped = [i for i, row in enumerate(rows) if row.params.needs_history]
        active, j = stepped, 0
        while active:
            sub_rows = [replace(rows[i], output_position=rows[i].output_position + j,
                                history=rows[i].history if j == 0 else None) for i in active]
            index = torch.tensor([firsts[i] + j for i in active], dtype=torch.long, device=logits.device)
            drawn = self._draw(logits.index_select(0, index), sub_rows, [states[i] for i in active]).tolist()
            self._record(sub_rows, [states[i] for i in active], [[t] for t in drawn])
            for i, t in zip(active, drawn, strict=True):
                tokens[i].append(t)
            active = [i for i, t in zip(active, drawn, strict=True) if j < len(drafts[i]) and t == drafts[i][j]]
            j += 1
        return self._verified_output(logits, rows, firsts, tokens)

    def _verify_at_once(self, logits: torch.Tensor, rows: Sequence[SampleRow],
                        states: Sequence[SequenceSamplerState], drafts: Sequence[tuple[int, ...]],
                        firsts: list[int], which: list[int], tokens: list[list[int]]) -> None:
        """Rows whose draws depend on nothing but their output position: every position of
        each in one pass; each keeps its samples up to the first that differs from its draft."""
        virtual, virtual_states, index = [], [], []
        for i in which:
            for j in range(len(drafts[i]) + 1):
                virtual.append(replace(rows[i], output_position=rows[i].output_position + j, history=None))
                virtual_states.append(states[i])
                index.append(firsts[i] + j)
        drawn = self._draw(logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device)),
                           virtual, virtual_states).tolist()
        at = 0
        for i in which:
            mine = drawn[at:at + len(drafts[i]) + 1]
            at += len(mine)
            keep = 0
            while keep < len(drafts[i]) and mine[keep] == drafts[i][keep]:
                keep += 1
            tokens[i].extend(mine[:keep + 1])
        self._record([rows[i] for i in which], [states[i] for i in which], [tokens[i] for i in which])

    @staticmethod
    def _verified_output(logits: torch.Tensor, rows: Sequence[SampleRow], firsts: list[int],
                         tokens: list[list[int]]) -> SamplerOutput:
        """The emitted tokens, flat in row order, with the logprobs of those that ask."""
        flat_rows, index, flat = [], [], []
        for row, first, row_tokens in zip(rows, firsts, tokens, strict=True):
            for j, t in enumerate(row_tokens):
                flat_rows.append(row)
                index.append(first + j)
                flat.append(t)
        picked = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
        token_logprobs, top_logprobs = _logprobs(picked, flat_rows,
                                                 torch.tensor(flat, dtype=torch.long, device=logits.device))
        return SamplerOutput(flat, token_logprobs, top_logprobs, [len(t) for t in tokens])

    def _state_for(self, row: SampleRow) -> SequenceSamplerState:
        state = self._states.get(row.seq_id)
        if state is None:
            state = SequenceSamplerState(seq_id=row.seq_id)
            self._states[row.seq_id] = state
        if row.history is not None:
            state.reset_history(*row.history)
            if row.params.structured is not None:
                state.matcher = self.grammars.matcher(row.params.structured, row.history[1])
        return state

    def _apply_grammars(self, logits: torch.Tensor, masked: torch.Tensor, rows: Sequence[SampleRow],
                        states: Sequence[SequenceSamplerState], where: list[int]) -> torch.Tensor:
        """Structured output: tokens a row's grammar does not allow go to -inf, last of the
        masks. Where the grammar and the other masks leave nothing between them (its only way
        on is EOS while min_tokens holds EOS back), the grammar wins."""
        bitmask = self.grammars.bitmask([s.matcher for s in states], [r.params.eos_token_ids for r in rows],
                                        logits.shape[1])
        index = torch.tensor(where, dtype=torch.long, device=logits.device)
        sub = masked.index_select(0, index)  # a copy: masked in place
        self.grammars.apply(sub, bitmask)
        stuck = torch.isneginf(sub).all(dim=1, keepdim=True)
        if bool(stuck.any()):
            unmasked = logits.index_select(0, index)
            self.grammars.apply(unmasked, bitmask)
            sub = torch.where(stuck, unmasked, sub)
        return masked.index_copy(0, index, sub)


def _logprobs(logits: torch.Tensor, rows: Sequence[SampleRow], token_ids: torch.Tensor,
              ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per row, the sampled token's logprob under the raw logits and the top ones, only for
    the rows that ask (a vocabulary-wide pass per row); None for the others."""
    asking = [i for i, row in enumerate(rows) if row.params.num_logprobs is not None]
    token_logprobs: list[float | None] = [None] * len(rows)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if asking:
        index = torch.tensor(asking, dtype=torch.long, device=logits.device)
        raw_logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)  # [asking, vocab]
        picked = raw_logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
        tops = _top_logprobs(raw_logprobs, [rows[i] for i in asking])
        for i, logprob, top in zip(asking, picked.tolist(), tops, strict=True):
            token_logprobs[i], top_logprobs[i] = logprob, top
    return token_logprobs, top_logprobs


def _plain_greedy(row: SampleRow, state: SequenceSamplerState) -> bool:
    """A greedy row no mask changes: its token is the argmax of its raw logits."""
    p = row.params
    return (p.is_greedy and not p.logit_bias and not p.uses_penalties and state.matcher is None
            and (row.output_position >= p.min_tokens or not p.min_tokens_masked_ids))


# ---------------------------------------------------------------------------------------------
# Masks and filters


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Adds each row's logit bias (ids beyond the vocabulary are skipped)."""
    vocab_size = logits.shape[1]
    row_index, token_index, values = [], [], []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            if token_id < vocab_size:
                row_index.append(i)
                token_index.append(token_id)
                values.append(bias)
    if not row_index:
        return logits
    biased = logits.clone()
    device = logits.device
    biased.index_put_((torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)),
                      torch.tensor(values, device=device), accumulate=True)
    return biased


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow],
                     states: Sequence[SequenceSamplerState]) -> torch.Tensor:
    """vLLM's penalties. Repetition (tokens in the prompt or the output so far): a positive
    logit is divided by the penalty, a negative one multiplied. Then, over the output only:
    logit -= frequency_penalty * count + presence_penalty * (count > 0).

    The per-row token counts come from each state's running Counter and reach the device as one
    flattened (row, token, count) table, the prompt tokens as one (row, token) table: host work
    and copies scale with the distinct tokens of the penalised rows, not their histories.
    """
    penalised = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not penalised:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    index = torch.tensor(penalised, dtype=torch.long, device=device)
    sub = logits.index_select(0, index)  # [p, vocab]
    params = [rows[i].params for i in penalised]

    output_counts = [states[i].output_token_counts for i in penalised]
    table = _row_token_table(
        [len(c) for c in output_counts],
        chain.from_iterable(c.keys() for c in output_counts),
        vocab_size,
        chain.from_iterable(c.values() for c in output_counts),
    ).to(device)  # [3, entries]: row, token id, count; each (row, token) at most once
    counts = torch.zeros_like(sub)  # [p, vocab]
    if table.shape[1]:
        counts.index_put_((table[0], table[1]), table[2].to(counts.dtype))

    # Only repetition reads the prompt, so rows without it skip their prompt tokens.
    prompt_sets = [states[i].prompt_token_id_set if p.repetition_penalty != 1.0 else frozenset()
                   for i, p in zip(penalised, params, strict=True)]
    prompt = _row_token_table(
        [len(t) for t in prompt_sets], chain.from_iterable(prompt_sets), vocab_size
    ).to(device)  # [2, entries]: row, token id
    seen = counts > 0  # [p, vocab]
    if prompt.shape[1]:
        seen.index_put_((prompt[0], prompt[1]), torch.ones((), dtype=torch.bool, device=device))

    factors = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
        device=device,
    )  # [p, 3]
    repetition, frequency, presence = factors[:, 0:1], factors[:, 1:2], factors[:, 2:3]
    penalty = torch.where(seen, repetition, torch.ones_like(repetition))
    sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    return logits.index_copy(0, index, sub)


def _row_token_table(num_per_row: Sequence[int], token_ids: Iterable[int], vocab_size: int,
                     *columns: Iterable[int]) -> torch.Tensor:
    """[2 + len(columns), entries] int64 on the CPU: row index, token id, then the extra columns,
    num_per_row[j] entries for row j in the order given; entries whose token id is outside the
    vocabulary are dropped."""
    row_ids = list(chain.from_iterable(repeat(j, n) for j, n in enumerate(num_per_row)))
    table = torch.tensor([row_ids, list(token_ids), *(list(c) for c in columns)], dtype=torch.long)
    if table.shape[1] and int(table[1].max()) >= vocab_size:
        table = table[:, table[1] < vocab_size]
    return table


def _apply_min_tokens_masks(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Sets stop (and EOS, unless ignored) ids to -inf in rows that have not reached min_tokens.

    Ids beyond the vocabulary are skipped. A row that would be left with nothing to sample keeps
    its logits unmasked rather than produce NaN.
    """
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if row.output_position < row.params.min_tokens:
            for token_id in row.params.min_tokens_masked_ids:
                if token_id < vocab_size:
                    row_index.append(i)
                    token_index.append(token_id)
    if not row_index:
        return logits
    masked = logits.clone()
    masked[
        torch.tensor(row_index, device=logits.device),
        torch.tensor(token_index, device=logits.device),
    ] = float("-inf")
    nothing_left = torch.isneginf(masked).all(dim=-1, keepdim=True)  # [num_rows, 1]
    return torch.where(nothing_left, logits, masked)


def _sample_filtered(
    logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (vLLM's order), then the exponential race; [rows] token ids."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = logits / temperature  # [rows, vocab]

    top_k = [min(p.top_k, vocab_size) if p.top_k else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)

    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); renormalisation does not change it.
        log_min_p = torch.tensor(
            [math.log(m) if m > 0 else -math.inf for m in min_p], device=device
        )
        max_scaled = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled - max_scaled < log_min_p.unsqueeze(1), float("-inf"))

    # argmax_i p_i / E_i == argmax_i (x_i - log E_i): softmax's normaliser is the same for all i.
    log_exponential = _log_exponential_noise(keys, vocab_size, device)  # [rows, vocab]
    return (scaled - log_exponential).argmax(dim=-1)


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keeps each row's k highest tokens, then the smallest prefix of those whose probability sums to
    at least top_p (always the top token). Equal logits rank by lower id, so exactly k survive top-k."""
    num_rows, vocab_size = scaled.shape
    device = scaled.device
    sorted_scaled, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)  # [rows, vocab]
    rank = torch.arange(vocab_size, device=device).unsqueeze(0)  # [1, vocab]
    keep_sorted = rank < torch.tensor(top_k, device=device).unsqueeze(1)  # [rows, vocab]
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_scaled.masked_fill(~keep_sorted, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive prefix sum; exactly 0 at rank 0
        top_p_t = torch.tensor(top_p, device=device).unsqueeze(1)
        # Rows with top_p == 1 skip the test, so float rounding in the cumsum cannot drop a token.
        keep_sorted &= (mass_before < top_p_t) | (top_p_t >= 1.0)
    keep = torch.empty_like(keep_sorted).scatter_(1, sorted_ids, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, the lowest on ties (and NaN counted largest), as
    `argmax` gives it; on the CPU in float32 through the native kernel when it is built (torch's
    argmax does not vectorise: 0.55 ms for 64 x 8,192 against 0.05 ms)."""
    from worker_svc.kernels.cpu_kernels import paged_decode

    kernel = paged_decode() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is None or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    return kernel.argmax(logits.contiguous())


def _top_logprobs(
    raw_logprobs: torch.Tensor, rows: Sequence[SampleRow]
) -> list[list[tuple[int, float]] | None]:
    wanted = [row.params.num_logprobs for row in rows]
    most = max((n for n in wanted if n is not None), default=0)
    most = min(most, raw_logprobs.shape[1])
    if most == 0:
        return [None if n is None else [] for n in wanted]
    values, ids = torch.topk(raw_logprobs, most, dim=-1, sorted=True)  # [rows, most]
    values_list, ids_list = values.tolist(), ids.tolist()
    return [
        None if n is None else list(zip(ids_list[i][:n], values_list[i][:n], strict=True))
        for i, n in enumerate(wanted)
    ]


# ---------------------------------------------------------------------------------------------
# Counter-based randomness


def _mix32_int(x: int) -> int:
    """lowbias32 on a Python int in [0, 2**32); the reference for _mix32."""
    x ^= x >> 16
    x = (x * _MIX_MUL_1) & _MASK32
    x ^= x >> 15
    x = (x * _MIX_MUL_2) & _MASK32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), exactly: the constant is split in 16-bit
    halves so every intermediate stays below 2**49 (no signed overflow on any device)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on int64 values in [0, 2**32). Shifts of non-negative values are
    logical, so torch's arithmetic right shift is harmless here."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL_2)
    return x ^ (x >> 16)


def _key_prefix(seed: int, choice_index: int) -> tuple[int, int]:
    words = (seed & _MASK32, seed >> 32, choice_index)
    lanes = []
    for lane in _LANE_IVS:
        for word in words:
            lane = _mix32_int(lane ^ word)
        lanes.append(lane)
    return lanes[0], lanes[1]


def row_key(seed: int, choice_index: int, output_position: int) -> tuple[int, int]:
    """The two 32-bit hash keys of one draw: each lane folds seed (as two 32-bit words),
    choice_index and output_position through lowbias32 from its own starting value."""
    prefix = _key_prefix(seed, choice_index)
    return _mix32_int(prefix[0] ^ output_position), _mix32_int(prefix[1] ^ output_position)


def _row_key(state: SequenceSamplerState, row: SampleRow) -> tuple[int, int]:
    source = (row.effective_seed, row.choice_index)
    if state.key_source != source:
        state.key_source = source
        state.key_prefix = _key_prefix(*source)
    lane_a, lane_b = state.key_prefix
    return _mix32_int(lane_a ^ row.output_position), _mix32_int(lane_b ^ row.output_position)


def uniform_bits(
    keys: Sequence[tuple[int, int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[rows, vocab] int64 in [0, 2**32): the random word of each (row key, token id).

    bits = mix(mix(token_id ^ key_a) ^ key_b), a keyed two-round hash of the token id.
    """
    key_a = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=device).unsqueeze(1)
    key_b = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=device).unsqueeze(1)
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0)
    return _mix32(_mix32(token_ids ^ key_a) ^ key_b)


def _log_exponential_noise(
    keys: Sequence[tuple[int, int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[rows, vocab] float32 log E with E = -log U ~ Exp(1), U = (bits + 0.5) / 2**32 in (0, 1).

    Computed in float64 so that U keeps all 32 bits and never rounds to 0 or 1.
    """
    u = (uniform_bits(keys, vocab_size, device).double() + 0.5) * _INV_2_32
    return torch.log(-torch.log(u)).float()
