"""What the stages hold of each sequence, as the plans sent so far told them.

Stages keep a sequence's state across steps (`services.step`): the first plan that names a
sequence sends it whole (`NewSeq`), later ones only what changed against what the stages hold
(`CachedSeq`: blocks appended or replaced, and, with several stages and no feedback, the tokens
the first stage does not know yet, since it does not sample). Block tables are not diffed here:
the KV service answers in the plan's form and each sequence keeps what the stages were not
sent yet (`Sequence.take_answer`), which goes out with its next step. A sequence the planner dropped
is released in the next plan; after a reset the next plan drops everything first.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler_svc.core.request import Request, Sequence, sampling_params
from services.step import CachedSeq, NewSeq, PromptScoring


class StageView:
    """The planner's view of the stages' state: what the next plan must send and release.

    Invariants (`check_integrity`, between plans):
    - `on_stages[seq_id]` is the number of blocks in the table the last plan naming that id
      left the stages with (they hold its state until a plan releases it);
    - `stage_tokens` is None when the first stage learns tokens without the plans (one
      stage, or feedback); otherwise it maps exactly the ids in `on_stages` to how many of
      their tokens the first stage knows;
    - `release_all` (the next plan resets the stages first, as at the start) means nothing
      is held yet;
    - a sequence id is released once: `pending_released` has no repeats;
    - `positions` maps exactly the ids in `on_stages` to where their last step sent ends:
      where the stages stand (a verify step's sequence: the first stages stand there, past
      its drafts; its next step names the position it starts at when that is before).
    """

    def __init__(self, track_tokens: bool) -> None:
        self.on_stages: dict[int, int] = {}
        self.positions: dict[int, int] = {}
        self.stage_tokens: dict[int, int] | None = {} if track_tokens else None
        self.pending_released: list[int] = []
        # the stages may hold state from an earlier scheduler: the first plan resets them
        self.release_all = True

    def __repr__(self) -> str:  # all of it: tests compare snapshots of the planner
        return f"StageView({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    @property
    def holds_any(self) -> bool:
        return bool(self.on_stages)

    def track_tokens(self, on: bool) -> None:
        """Whether plans carry the tokens the first stage lacks; only while nothing is held."""
        if self.on_stages:
            raise RuntimeError("track_tokens: only before the stages hold any state")
        self.stage_tokens = {} if on else None

    def send(self, seq: Sequence, start: int, num_tokens: int, drafts: tuple[int, ...] = ()) -> NewSeq | CachedSeq:
        """This step of a sequence as the stages get it (tokens `start ... start + num_tokens
        - 1`, on its current block table, the last `len(drafts)` of them drafts to verify);
        the stages hold it from then on."""
        scoring = prompt_scoring(seq, start, start + num_tokens)
        held = self.on_stages.get(seq.seq_id)
        block_offset, block_ids = seq.take_unsent_blocks()
        if held is None:
            if block_offset:
                raise RuntimeError(f"sequence {seq.seq_id}: new to the stages, yet its table comes as a diff")
            entry: NewSeq | CachedSeq = _new_seq(seq, start, num_tokens, block_ids, scoring)
        else:
            if block_offset > held:
                raise RuntimeError(f"sequence {seq.seq_id}: keeps {block_offset} of the {held} blocks the stages hold")
            entry = self._cached_seq(seq, block_offset, block_ids, num_tokens, scoring)
            moved = start if self.positions[seq.seq_id] != start else -1
            if drafts or moved >= 0:
                entry = replace(entry, draft_token_ids=drafts, start=moved)
        if drafts and held is None:
            raise RuntimeError(f"sequence {seq.seq_id}: drafts for a sequence new to the stages")
        self.on_stages[seq.seq_id] = seq.num_blocks
        self.positions[seq.seq_id] = start + num_tokens
        if self.stage_tokens is not None:
            self.stage_tokens[seq.seq_id] = seq.num_tokens
        return entry

    def release(self, seq_id: int) -> None:
        """The stages drop this sequence's state in the next plan."""
        self.pending_released.append(seq_id)

    def take_releases(self) -> tuple[tuple[int, ...], bool]:
        """What the plan being sent releases: (sequence ids, whether it resets the stages
        first); they are no longer held."""
        released, release_all = tuple(self.pending_released), self.release_all
        for seq_id in released:
            self.on_stages.pop(seq_id, None)
            self.positions.pop(seq_id, None)
            if self.stage_tokens is not None:
                self.stage_tokens.pop(seq_id, None)
        self.pending_released, self.release_all = [], False
        return released, release_all

    def reset(self) -> None:
        """The stages are to drop everything: the next plan resets them."""
        self.pending_released.clear()
        self.release_all = True
        self.on_stages.clear()
        self.positions.clear()
        if self.stage_tokens is not None:
            self.stage_tokens.clear()

    def _cached_seq(
        self, seq: Sequence, block_offset: int, block_ids: tuple[int, ...], n: int, scoring: PromptScoring | None
    ) -> CachedSeq:
        new_tokens: tuple[int, ...] = ()
        if self.stage_tokens is not None:  # the first stage does not sample: send what it lacks
            known = self.stage_tokens[seq.seq_id]
            if known < seq.num_tokens:
                new_tokens = tuple(seq.tokens(known, seq.num_tokens))
        return CachedSeq(seq.seq_id, n, block_offset, block_ids, new_tokens, scoring)

    def check_integrity(self) -> None:
        assert self.positions.keys() == self.on_stages.keys(), (self.positions, self.on_stages)
        if self.stage_tokens is not None:
            assert self.stage_tokens.keys() == self.on_stages.keys(), (self.stage_tokens, self.on_stages)
        assert not (self.release_all and self.on_stages), self.on_stages
        assert len(self.pending_released) == len(set(self.pending_released)), self.pending_released


def _new_seq(seq: Sequence, start: int, n: int, block_ids: tuple[int, ...], scoring: PromptScoring | None) -> NewSeq:
    request = seq.request
    return NewSeq(
        seq.seq_id,
        tuple(seq.all_tokens()),
        len(request.prompt),
        start,
        n,
        block_ids,
        sampling_params(request.options, tuple(request.eos_token_ids)),
        seq.index,
        seq.entropy_seed,
        request.request_id,
        request.trace_context,
        scoring,
        request.pooling,
        request.lora_name,
    )


def prompt_scoring(seq: Sequence, start: int, end: int) -> PromptScoring | None:
    """The prompt positions of this chunk not scored yet (each predicts the next)."""
    if not scores_prompt(seq):
        return None
    request = seq.request
    first = max(start, len(request.prompt_logprobs))
    last = min(end, len(request.prompt) - 1)
    if first >= last:
        return None
    return PromptScoring(first, tuple(request.prompt[first + 1 : last + 1]), request.options.prompt_logprobs)


def scores_prompt(seq: Sequence) -> bool:
    """Whether this sequence still scores prompt positions (SamplingOptions.prompt_logprobs):
    then every position must be computed, so it keeps out of the prefix cache."""
    return scores_prompt_of(seq.request, seq.index)


def scores_prompt_of(request: Request, index: int) -> bool:
    """`scores_prompt` for choice `index` of a request, made or not yet."""
    return (
        request.options.prompt_logprobs is not None
        and index == 0
        and len(request.prompt_logprobs) < len(request.prompt) - 1
    )


def skips_prefix_cache(request: Request, index: int) -> bool:
    """Whether choice `index` of a request must compute every prompt position, so keeps out
    of the prefix cache: it scores the prompt, or pools over all of it (mean pooling; the
    last position, all last-token pooling needs, is computed even on a whole-prompt hit)."""
    return scores_prompt_of(request, index) or (request.pooling is not None and request.pooling.needs_every_position)
