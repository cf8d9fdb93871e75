"""A stage's persistent batch: every sequence's state, kept across steps and updated by diffs.

The scheduler sends a sequence whole once (`NewSeq`) and afterwards only what changed
(`CachedSeq`); this is where a stage keeps the rest (vLLM's persistent batch). `apply`
validates a whole `StepPlan` against the state before it changes anything, so a malformed
plan fails alone and leaves the stage as it was.

Invariants of each `SeqState`: `num_computed <= len(token_ids)` on the first and last stage
(they hold every known token: the first stage from the plans, the last stage from the plans
and its own samples); the block table covers positions `0 ... num_computed - 1`. A pooling
sequence (`services.pooling`) holds only its prompt and is never sampled; with mean pooling
the last stage keeps the sum of what it computed so far (`pooled_sum`), so it starts at
position 0.

Speculative decoding: a verify step's row also computes draft tokens after the known ones
(`CachedSeq.draft_token_ids`, never added to the known tokens here). After it, every stage
but the last stands past the drafts (`num_computed` may then exceed the known tokens on the
first stage); the last stage, which verified them, stands after the drafts it accepted and
appends them with the token it sampled after them. The next step of the sequence names
where it starts (`CachedSeq.start`), which computes the rejected drafts' positions again.

KV groups (services/kv_layout.py, `StageShape.kv_windows` of more than one sub-group): a
table's entries are tuples of one page per sub-group, and the checks that a table covers a
step count entries. A sliding sub-group's page may be `NULL_PAGE` only where its window has
left it (a block wholly before the step's `start - window + 1`): a page the step writes or
reads is always a real one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.kv_layout import NULL_PAGE, first_needed_block
from services.pooling import PoolingType
from services.sampling import SamplingParams
from services.step import NewSeq, PromptScoring, StepPlan
from worker_svc.errors import InvalidPlanError

MAX_PROMPT_NUM_TOP = 20


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    num_computed: int
    block_ids: list  # one entry per block: a block id, or with KV groups a tuple of pages
    sampling: SamplingParams
    choice_index: int
    entropy_seed: int
    request_id: str = ""
    trace_context: str = ""
    pooling: PoolingType | None = None
    lora_name: str = ""  # multi-LoRA: the adapter it runs under ("": the base model)
    # mean pooling, last stage: the sum of the final norm's output over the positions
    # computed so far (the runner's float32 tensor); dropped with the state
    pooled_sum: object = None
    # KV groups: the runner's tensor of `block_ids` (attention_metadata.entry_table), made
    # when first needed and dropped whenever the table changes
    table: object = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(slots=True)
class Row:
    """One sequence's share of a step: `num_tokens` tokens at positions `start ...`. On the
    last stage: `sample`, it samples; `pools`, it is a pooling sequence's (never sampled),
    and `pool_done`, this step completes its prompt, so its vector comes back."""

    state: SeqState
    start: int
    num_tokens: int
    sample: bool
    prompt_scoring: PromptScoring | None = None
    pools: bool = False
    pool_done: bool = False
    drafts: tuple[int, ...] = ()  # a verify step: its last len(drafts) positions are drafts

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens

    @property
    def known_end(self) -> int:
        """Where its known tokens end in this step (before the drafts): it samples there."""
        return self.context_len - len(self.drafts)

    def input_ids(self) -> list[int]:
        """The token ids this row computes (the first stage embeds them)."""
        return self.state.token_ids[self.start : self.known_end] + list(self.drafts)

    @property
    def seq_id(self) -> int:
        return self.state.seq_id


@dataclass(frozen=True)
class StageShape:
    """What a plan is checked against."""

    is_first: bool
    is_last: bool
    num_blocks: int
    block_size: int
    max_positions: int
    vocab_size: int
    kv_windows: tuple[int, ...] = (0,)  # the KV sub-groups' windows (0: full); one: no groups

    @property
    def grouped(self) -> bool:
        return len(self.kv_windows) > 1


class PersistentBatch:
    """The sequences a stage holds, by id. Owned by the stage's compute thread."""

    def __init__(self, shape: StageShape) -> None:
        self.shape = shape
        self.seqs: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def apply(self, plan: StepPlan) -> list[Row]:
        """Validate the plan whole, then apply it; returns the step's rows in token order."""
        self.validate(plan)
        if plan.reset:
            self.seqs.clear()
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        shape, rows = self.shape, []
        for n in plan.new_seqs:
            state = SeqState(
                n.seq_id,
                list(n.token_ids),
                n.prompt_len,
                n.num_computed,
                list(n.block_ids),
                n.sampling,
                n.choice_index,
                n.entropy_seed,
                n.request_id,
                n.trace_context,
                n.pooling,
                n.lora_name,
            )
            self.seqs[n.seq_id] = state
            rows.append(self._row(state, n.num_scheduled, n.prompt_scoring))
        for c in plan.cached_seqs:
            state = self.seqs[c.seq_id]
            if c.block_ids or c.block_offset < len(state.block_ids):
                del state.block_ids[c.block_offset :]
                state.block_ids.extend(c.block_ids)
                state.table = None
            if c.start >= 0:  # back to where the accepted tokens end (after a verify step)
                state.num_computed = c.start
            if c.new_token_ids and not shape.is_last:  # they end where this step's known tokens end
                end = state.num_computed + c.num_scheduled - len(c.draft_token_ids)
                known = len(state.token_ids) - (end - len(c.new_token_ids))
                state.token_ids.extend(c.new_token_ids[known:])  # (some may have come by feedback)
            rows.append(self._row(state, c.num_scheduled, c.prompt_scoring, c.draft_token_ids))
        return rows

    def _row(
        self, state: SeqState, num_tokens: int, scoring: PromptScoring | None, drafts: tuple[int, ...] = ()
    ) -> Row:
        start = state.num_computed
        end = start + num_tokens
        state.num_computed = end
        done = self.shape.is_last and end - len(drafts) == len(state.token_ids)
        pools = self.shape.is_last and state.pooling is not None
        return Row(state, start, num_tokens, done and not pools, scoring, pools, done and pools, drafts)

    def awaiting(self, plan: StepPlan) -> set[int]:
        """Sequences this step computes further than the tokens this stage knows: a
        placeholder step's input, sampled by the last stage and not fed here yet."""
        if plan.reset:
            return set()
        out = set()
        for c in plan.cached_seqs:
            state = self.seqs.get(c.seq_id)
            if state is None or c.new_token_ids:
                continue
            start = c.start if c.start >= 0 else state.num_computed
            if start + c.num_scheduled - len(c.draft_token_ids) > len(state.token_ids):
                out.add(c.seq_id)
        return out - set(plan.finished_seq_ids)

    def feed(self, tokens: Iterable[tuple[int, int, int]]) -> int:
        """Appends (seq_id, position, token) sampled by the last stage where the token is the
        next one this stage lacks; stale ones (a sequence since dropped, or a position it
        knows) are ignored. Returns how many were appended."""
        n = 0
        for seq_id, position, token in tokens:
            state = self.seqs.get(seq_id)
            if state is not None and len(state.token_ids) == position and 0 <= token < self.shape.vocab_size:
                state.token_ids.append(token)
                n += 1
        return n

    def record_sampled(self, rows: list[Row], token_ids: list[list[int]]) -> None:
        """The last stage appends what it sampled, per sampling row (a verify step's row: its
        accepted drafts, then the token after them): the next step's input. A verify step's
        sequence then stands after its accepted drafts."""
        for row, tokens in zip((r for r in rows if r.sample), token_ids, strict=True):
            row.state.token_ids.extend(tokens)
            if row.drafts:
                row.state.num_computed = row.known_end + len(tokens) - 1

    # --- validation ----------------------------------------------------------------------

    def validate(self, plan: StepPlan) -> None:
        """Raise InvalidPlanError for anything malformed or inconsistent with the state."""
        shape = self.shape
        step = f"step {plan.step_id}"
        if not plan.new_seqs and not plan.cached_seqs:
            raise InvalidPlanError(f"{step}: no sequences")
        finished = set(plan.finished_seq_ids)
        seen: set[int] = set()
        for n in plan.new_seqs:
            where = f"{step}, sequence {n.seq_id}"
            if n.seq_id in seen:
                raise InvalidPlanError(f"{where}: appears twice")
            seen.add(n.seq_id)
            self._check_new(where, n)
        for c in plan.cached_seqs:
            where = f"{step}, sequence {c.seq_id}"
            if c.seq_id in seen:
                raise InvalidPlanError(f"{where}: appears twice")
            seen.add(c.seq_id)
            state = None if plan.reset or c.seq_id in finished else self.seqs.get(c.seq_id)
            if state is None:
                raise InvalidPlanError(f"{where}: not held by this stage (send it as a new sequence)")
            if not 0 <= c.block_offset <= len(state.block_ids):
                raise InvalidPlanError(
                    f"{where}: block_offset {c.block_offset} beyond its {len(state.block_ids)} blocks"
                )
            start = self._check_speculation(where, state, c)
            num_tokens = len(state.token_ids)
            if c.new_token_ids and not shape.is_last:
                if shape.is_first and any(not 0 <= t < shape.vocab_size for t in c.new_token_ids):
                    raise InvalidPlanError(f"{where}: token id outside [0, {shape.vocab_size})")
                # a step's new tokens are the last known ones it computes: positions end - len ... end - 1
                end = start + c.num_scheduled - len(c.draft_token_ids)
                first = end - len(c.new_token_ids)
                if not 0 <= first <= num_tokens or (
                    state.token_ids[first:end] != list(c.new_token_ids[: num_tokens - first])
                ):
                    raise InvalidPlanError(
                        f"{where}: new tokens for positions {first}..{end - 1} do not continue the "
                        f"{num_tokens} this stage knows"
                    )
                num_tokens = max(num_tokens, end)
            self._check_step(
                where,
                start,
                c.num_scheduled,
                num_tokens + len(c.draft_token_ids),
                c.block_offset + len(c.block_ids),
                c.prompt_scoring,
            )
            if c.block_ids:  # (a decode step's usually come with none)
                self._check_block_ids(where, start, c.block_offset, c.block_ids)
        for src, dst in plan.block_copies:
            if not (0 <= src < shape.num_blocks and 0 <= dst < shape.num_blocks) or src == dst:
                raise InvalidPlanError(f"{step}: block copy {src}->{dst} invalid for {shape.num_blocks} blocks")

    def _check_speculation(self, where: str, state: SeqState, c) -> int:
        """A cached sequence's `start` and draft tokens against its state; returns where its
        step starts. Its known tokens must end where its drafts begin: the last stage samples
        (verifies) from there."""
        shape = self.shape
        if not -1 <= c.start <= state.num_computed:
            raise InvalidPlanError(f"{where}: start {c.start} beyond the {state.num_computed} positions computed")
        start = c.start if c.start >= 0 else state.num_computed
        drafts = c.draft_token_ids
        if not drafts:
            return start
        if state.pooling is not None:
            raise InvalidPlanError(f"{where}: a pooling sequence takes no draft tokens")
        if len(drafts) >= c.num_scheduled:
            raise InvalidPlanError(
                f"{where}: {len(drafts)} draft tokens in a step of {c.num_scheduled}: "
                "a verify step computes at least one known token before them"
            )
        if any(not 0 <= t < shape.vocab_size for t in drafts):
            raise InvalidPlanError(f"{where}: draft token id outside [0, {shape.vocab_size})")
        known_end = start + c.num_scheduled - len(drafts)
        num_known = len(state.token_ids) if shape.is_last or not c.new_token_ids else known_end
        if (shape.is_first or shape.is_last) and known_end != num_known:
            raise InvalidPlanError(f"{where}: drafts after position {known_end - 1}, but it knows {num_known} tokens")
        return start

    def _check_new(self, where: str, n: NewSeq) -> None:
        shape = self.shape
        if not 0 <= n.prompt_len <= len(n.token_ids) or not n.prompt_len:
            raise InvalidPlanError(f"{where}: prompt_len {n.prompt_len} with {len(n.token_ids)} tokens")
        if shape.is_first and any(not 0 <= t < shape.vocab_size for t in n.token_ids):
            raise InvalidPlanError(f"{where}: token id outside [0, {shape.vocab_size})")
        if n.pooling is not None and n.prompt_len != len(n.token_ids):
            raise InvalidPlanError(
                f"{where}: a pooling sequence's tokens are its prompt ({n.prompt_len}), got {len(n.token_ids)}"
            )
        if n.pooling is not None and n.pooling.needs_every_position and n.num_computed:
            raise InvalidPlanError(
                f"{where}: {n.pooling.value} pooling computes every position, yet {n.num_computed} come computed"
            )
        self._check_step(where, n.num_computed, n.num_scheduled, len(n.token_ids), len(n.block_ids), n.prompt_scoring)
        self._check_block_ids(where, n.num_computed, 0, n.block_ids)

    def _check_step(
        self, where: str, start: int, num_tokens: int, num_known: int, table_len: int, scoring: PromptScoring | None
    ) -> None:
        """One sequence's step; `table_len` the table's length (entries) after this step."""
        shape = self.shape
        end = start + num_tokens
        if num_tokens < 1 or start < 0:
            raise InvalidPlanError(f"{where}: {num_tokens} tokens from position {start}: need at least one")
        if end > shape.max_positions:
            raise InvalidPlanError(f"{where}: context {end} exceeds max_position_embeddings {shape.max_positions}")
        if (shape.is_first or shape.is_last) and end > num_known:
            raise InvalidPlanError(f"{where}: computes up to position {end - 1} but knows {num_known} tokens")
        needed = -(-end // shape.block_size)
        if table_len < needed:
            raise InvalidPlanError(f"{where}: block table has {table_len} blocks, context needs {needed}")
        if scoring is not None and (
            not scoring.targets
            or scoring.first_position < start
            or scoring.first_position + len(scoring.targets) > end
            or not 0 <= scoring.num_top <= MAX_PROMPT_NUM_TOP
            or any(not 0 <= t < shape.vocab_size for t in scoring.targets)
        ):
            raise InvalidPlanError(
                f"{where}: prompt scoring of {len(scoring.targets)} targets from position "
                f"{scoring.first_position} (top {scoring.num_top}) does not fit its new tokens "
                f"{start}..{end - 1} and vocabulary"
            )

    def _check_block_ids(self, where: str, start: int, offset: int, block_ids) -> None:
        """The table entries received now, from index `offset` on (those held were checked
        when they came), for a step from position `start`."""
        shape = self.shape
        if shape.grouped:
            self._check_entries(where, start, offset, block_ids)
            return
        for b in block_ids:
            try:
                ok = 0 <= b < shape.num_blocks
            except TypeError:  # (a grouped table's entry sent to a stage that does not group)
                ok = False
            if not ok:
                raise InvalidPlanError(f"{where}: block id {b!r} out of range [0, {shape.num_blocks})")

    def _check_entries(self, where: str, start: int, offset: int, entries) -> None:
        """KV groups: each entry one page per sub-group, each a page of the pool, or NULL in
        a sliding sub-group whose window has left that block."""
        shape = self.shape
        windows = shape.kv_windows
        # sub-group g may hold NULL in entries before gone[g] (never a full one: gone is 0)
        gone = [first_needed_block(start, w, shape.block_size) if w else 0 for w in windows]
        for k, entry in enumerate(entries, start=offset):
            if not isinstance(entry, tuple | list) or len(entry) != len(windows):
                raise InvalidPlanError(
                    f"{where}: block table entry {k} is {entry!r}: want one page id per KV sub-group ({len(windows)})"
                )
            for g, page in enumerate(entry):
                if not isinstance(page, int) or not (
                    0 <= page < shape.num_blocks or (page == NULL_PAGE and k < gone[g])
                ):
                    raise InvalidPlanError(
                        f"{where}: block table entry {k}, KV sub-group {g} (window {windows[g] or 'full'}): page "
                        f"{page!r} out of range [0, {shape.num_blocks})"
                        + (" (NULL only where the window has left the block)" if page == NULL_PAGE else "")
                    )
