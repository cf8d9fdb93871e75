"""The last stage's sampler: masks, temperature, top-k, top-p, min-p, counter-based seeds, logprobs.

Flow of one call, vectorised over the rows of a micro-batch, each row with its own parameters:

    raw logits -> log_softmax (reported logprobs)
               -> logit bias (added)
               -> min_tokens masks (stop / EOS ids set to -inf)
               -> penalties (vLLM's order: repetition over prompt + output, then frequency
                  and presence over the output)
               -> greedy rows: argmax (ties: lowest id)
               -> other rows: / temperature -> top-k -> top-p -> min-p -> exponential race

The masks and filters are logit_filters.py. Randomness is counter-based (counter_rng.py). A
sampled row draws one uniform per vocabulary entry from a stateless 32-bit integer hash of
(seed, choice_index, output_position, token_id) and picks
argmax_i (log p_i - log E_i) with E_i = -log U_i, i.e. argmax_i p_i / E_i with E_i ~ Exp(1):
the winner of an exponential race, which is token i with probability p_i. Nothing else enters the
draw, so a seeded choice gives the same token whatever batch or row it lands in, whatever the
pipeline split, and after preemption and recompute. The hash uses only int64 shifts, xors, masks and
products that stay below 2**63, so CPU and CUDA produce the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from worker_svc.errors import InvalidPlanError
from worker_svc.execution.counter_rng import key_prefix, position_key
from worker_svc.execution.logit_filters import (
    apply_logit_bias,
    apply_min_tokens_masks,
    apply_penalties,
    argmax,
    row_logprobs,
    sample_filtered,
)
from worker_svc.execution.sampler_types import SamplerOutput, SampleRow, SequenceSamplerState
from worker_svc.execution.structured import GrammarBank


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

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[tuple[int, ...]] | None = None
    ) -> SamplerOutput:
        """logits: [num_rows, vocab_size], any float dtype, on any device; one SampleRow per row.

        `drafts` (speculative decoding): per row, draft tokens to verify; a row with k of them
        has k + 1 logits rows, one per position from its last known token on (`verify`)."""
        num_logits = len(rows) + (sum(len(d) for d in drafts) if drafts else 0)
        if logits.dim() != 2 or logits.shape[0] != num_logits:
            raise InvalidPlanError(f"sampler got logits of shape {tuple(logits.shape)} for {num_logits} rows")
        seq_ids = [row.seq_id for row in rows]
        if len(set(seq_ids)) != len(seq_ids):
            repeated = sorted({seq_id for seq_id in seq_ids if seq_ids.count(seq_id) > 1})
            raise InvalidPlanError(f"sequences appear twice in one sampling batch: {repeated}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])

        for row in rows:
            state = self._states.get(row.seq_id)
            if row.params.needs_history and row.history is None and (state is None or not state.has_history):
                raise InvalidPlanError(
                    f"sequence {row.seq_id}: penalties and structured output need its history on its first sampling row"
                )
            if row.params.structured is not None and self.grammars is None:
                raise InvalidPlanError(f"sequence {row.seq_id}: this stage has no structured output")
        states = [self._state_for(row) for row in rows]
        logits = logits.float()  # [num_logits, vocab]
        if drafts and any(drafts):
            return self._verify(logits, rows, states, drafts)
        token_ids = self._draw(logits, rows, states)
        token_list = token_ids.tolist()
        self._record(rows, states, [[t] for t in token_list])
        token_logprobs, top_logprobs = row_logprobs(logits, rows, token_ids)
        return SamplerOutput(token_ids=token_list, logprobs=token_logprobs, top_logprobs=top_logprobs)

    def _draw(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], states: Sequence[SequenceSamplerState]
    ) -> torch.Tensor:
        """One token per row of float32 logits ([rows]): the masks, then greedy or sampled."""
        if all(_plain_greedy(row, state) for row, state in zip(rows, states, strict=True)):
            return argmax(logits)  # (no mask to apply, nothing to draw)
        masked = apply_logit_bias(logits, rows)
        masked = apply_min_tokens_masks(masked, rows)
        masked = apply_penalties(masked, rows, states)
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        if constrained:
            masked = self._apply_grammars(
                logits, masked, [rows[i] for i in constrained], [states[i] for i in constrained], constrained
            )
        token_ids = argmax(masked)  # [num_rows]; greedy rows keep this (ties: lowest id)

        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if sampled:
            keys = [_row_key(states[i], rows[i]) for i in sampled]
            index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            drawn = sample_filtered(masked.index_select(0, index), [rows[i].params for i in sampled], keys)
            token_ids = token_ids.index_copy(0, index, drawn)
        return token_ids

    @staticmethod
    def _record(
        rows: Sequence[SampleRow], states: Sequence[SequenceSamplerState], tokens: Sequence[Sequence[int]]
    ) -> None:
        """Each row's new output tokens join its history (and advance its grammar)."""
        for row, state, row_tokens in zip(rows, states, tokens, strict=True):
            for token_id in row_tokens:
                state.append_output(token_id)
                if state.matcher is not None and not GrammarBank.advance(
                    state.matcher, token_id, row.params.eos_token_ids
                ):
                    state.matcher = None  # cannot happen under the mask; never wedge the sequence

    def _verify(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        states: Sequence[SequenceSamplerState],
        drafts: Sequence[tuple[int, ...]],
    ) -> SamplerOutput:
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
            sub_rows = [
                replace(
                    rows[i], output_position=rows[i].output_position + j, history=rows[i].history if j == 0 else None
                )
                for i in active
            ]
            index = torch.tensor([firsts[i] + j for i in active], dtype=torch.long, device=logits.device)
            drawn = self._draw(logits.index_select(0, index), sub_rows, [states[i] for i in active]).tolist()
            self._record(sub_rows, [states[i] for i in active], [[t] for t in drawn])
            for i, t in zip(active, drawn, strict=True):
                tokens[i].append(t)
            active = [i for i, t in zip(active, drawn, strict=True) if j < len(drafts[i]) and t == drafts[i][j]]
            j += 1
        return self._verified_output(logits, rows, firsts, tokens)

    def _verify_at_once(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        states: Sequence[SequenceSamplerState],
        drafts: Sequence[tuple[int, ...]],
        firsts: list[int],
        which: list[int],
        tokens: list[list[int]],
    ) -> None:
        """Rows whose draws depend on nothing but their output position: every position of
        each in one pass; each keeps its samples up to the first that differs from its draft."""
        virtual, virtual_states, index = [], [], []
        for i in which:
            for j in range(len(drafts[i]) + 1):
                virtual.append(replace(rows[i], output_position=rows[i].output_position + j, history=None))
                virtual_states.append(states[i])
                index.append(firsts[i] + j)
        drawn = self._draw(
            logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device)), virtual, virtual_states
        ).tolist()
        at = 0
        for i in which:
            mine = drawn[at : at + len(drafts[i]) + 1]
            at += len(mine)
            keep = 0
            while keep < len(drafts[i]) and mine[keep] == drafts[i][keep]:
                keep += 1
            tokens[i].extend(mine[: keep + 1])
        self._record([rows[i] for i in which], [states[i] for i in which], [tokens[i] for i in which])

    @staticmethod
    def _verified_output(
        logits: torch.Tensor, rows: Sequence[SampleRow], firsts: list[int], tokens: list[list[int]]
    ) -> SamplerOutput:
        """The emitted tokens, flat in row order, with the logprobs of those that ask."""
        flat_rows, index, flat = [], [], []
        for row, first, row_tokens in zip(rows, firsts, tokens, strict=True):
            for j, t in enumerate(row_tokens):
                flat_rows.append(row)
                index.append(first + j)
                flat.append(t)
        picked = logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))
        token_logprobs, top_logprobs = row_logprobs(
            picked, flat_rows, torch.tensor(flat, dtype=torch.long, device=logits.device)
        )
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

    def _apply_grammars(
        self,
        logits: torch.Tensor,
        masked: torch.Tensor,
        rows: Sequence[SampleRow],
        states: Sequence[SequenceSamplerState],
        where: list[int],
    ) -> torch.Tensor:
        """Structured output: tokens a row's grammar does not allow go to -inf, last of the
        masks. Where the grammar and the other masks leave nothing between them (its only way
        on is EOS while min_tokens holds EOS back), the grammar wins."""
        bitmask = self.grammars.bitmask(
            [s.matcher for s in states], [r.params.eos_token_ids for r in rows], logits.shape[1]
        )
        index = torch.tensor(where, dtype=torch.long, device=logits.device)
        sub = masked.index_select(0, index)  # a copy: masked in place
        self.grammars.apply(sub, bitmask)
        stuck = torch.isneginf(sub).all(dim=1, keepdim=True)
        if bool(stuck.any()):
            unmasked = logits.index_select(0, index)
            self.grammars.apply(unmasked, bitmask)
            sub = torch.where(stuck, unmasked, sub)
        return masked.index_copy(0, index, sub)


def _plain_greedy(row: SampleRow, state: SequenceSamplerState) -> bool:
    """A greedy row no mask changes: its token is the argmax of its raw logits."""
    p = row.params
    return (
        p.is_greedy
        and not p.logit_bias
        and not p.uses_penalties
        and state.matcher is None
        and (row.output_position >= p.min_tokens or not p.min_tokens_masked_ids)
    )


def _row_key(state: SequenceSamplerState, row: SampleRow) -> tuple[int, int]:
    source = (row.effective_seed, row.choice_index)
    if state.key_source != source:
        state.key_source = source
        state.key_prefix = key_prefix(*source)
    return position_key(state.key_prefix, row.output_position)
