"""The draft model of speculative decoding: K greedy draft tokens per sequence.

vLLM's `{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}`. The last
pipeline stage holds a small checkpoint with the target's tokenizer and, after each step,
asks `DraftProposer.propose` for the next K tokens of the sequences it sampled; the target
then verifies them.

The draft model is loaded whole (one stage: every layer, embedding and LM head) by
`load_stage` and runs with a KV pool of its own (`PagedKVCache`) and a private block pool.
Like vLLM's v1 core it keeps, per sequence, only the token ids whose K/V it has computed
and catches up to what the caller knows:

    propose -> (per sequence) keep the longest common prefix of computed and known tokens
            -> one batched forward over every sequence's missing positions (the prefill
               chunk; its last row gives the first draft)
            -> K-1 batched single-token steps, each feeding the previous draft

Drafts it fed itself keep their K/V, so the next call reuses them where the target
accepted them; a rejected draft's positions are computed again, their slots overwritten.
Running out of blocks is not an error: the least recently used sequences' state is dropped
(recomputed when they come back), and a sequence that cannot fit at all gets no drafts.
It runs on the caller's thread and starts none of its own.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker_svc.checkpoints.loader import load_stage
from worker_svc.checkpoints.stage_setup import TORCH_DTYPES
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.kernels.attention import AttentionBackend, AttentionMetadata, get_backend
from worker_svc.kernels.attention_metadata import paged_layout

log = logging.getLogger(__name__)


class DraftBlockPool:
    """The draft KV pool's block ids: a FIFO free list.

    Invariant (checked by `DraftProposer.check_integrity`): every id in `[0, num_blocks)`
    is either free or held by exactly one sequence.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> tuple[int, ...]:
        return tuple(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` block ids, oldest freed first; None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: Iterable[int]) -> None:
        self._free.extend(block_ids)


@dataclass
class _DraftSeq:
    """One sequence's state: `computed[p]` is the token whose K/V sits at position `p`, in
    block `block_ids[p // block_size]`. Blocks may run past `computed` (room reserved for
    this call's positions)."""

    block_ids: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Request:
    """One sequence's ask within a `propose` call, validated and capped."""

    index: int  # its place in the call's results
    seq_id: int
    tokens: list[int]  # all known token ids (prompt + output)
    num_drafts: int  # k, capped so that no draft lands at a position >= max_model_len
    common: int  # tokens whose K/V the state held at validation (common prefix with `tokens`)

    @property
    def num_positions(self) -> int:
        """Positions whose K/V this call needs: the known tokens and every draft but the last
        (which is proposed, never fed)."""
        return len(self.tokens) + self.num_drafts - 1


@dataclass
class _Chunk:
    """One sequence's rows in one forward: `tokens` at positions `start, start + 1, ...`."""

    seq: _DraftSeq
    start: int
    tokens: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class DraftProposer:
    """Greedy drafts from a small model with its own KV pool; one owner thread.

    Invariants: free blocks + blocks held by sequences == `num_blocks`, no block held
    twice, and each sequence's blocks cover its computed positions (`check_integrity`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        num_speculative_tokens: int,
        *,
        max_model_len: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | AttentionBackend = "torch",
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be positive, got {num_speculative_tokens}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.model = load_stage(model_dir, 0, 1, dtype=_dtype_name(dtype), device=device)
        config = self.model.config
        self.device = next(self.model.parameters()).device
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.kv_cache = PagedKVCache(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            next(self.model.parameters()).dtype,
            self.device,
        )
        self.blocks = DraftBlockPool(num_blocks)
        self._seqs: OrderedDict[int, _DraftSeq] = OrderedDict()  # least recently used first
        self.num_forward_tokens = 0  # rows run through the draft model, all calls together
        log.info(
            "draft model %s: %d layers, vocab %d, %d speculative tokens, %d KV blocks of %d",
            model_dir,
            config.num_layers,
            config.vocab_size,
            num_speculative_tokens,
            num_blocks,
            block_size,
        )

    @property
    def vocab_size(self) -> int:
        """The draft's vocabulary size: the caller checks it equals the target's."""
        return self.model.config.vocab_size

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def cached_seq_ids(self) -> tuple[int, ...]:
        """Sequences holding state, least recently used first (the eviction order)."""
        return tuple(self._seqs)

    def computed_tokens(self, seq_id: int) -> tuple[int, ...]:
        """The token ids whose K/V the draft holds for `seq_id` (empty when it holds none)."""
        seq = self._seqs.get(seq_id)
        return () if seq is None else tuple(seq.computed)

    # ------------------------------------------------------------------ the public calls

    def propose(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each (seq_id, all known token ids (prompt + output), k): the draft model's k greedy
        next tokens (k <= num_speculative_tokens; k == 0 -> ()), batched over the sequences.

        Fewer than k where the drafts would reach `max_model_len`; none for a sequence whose
        positions do not fit in the whole pool. ValueError (nothing changed) for a malformed
        request: a repeated seq_id, k out of range, no tokens, a token id outside the vocabulary.
        """
        requests = self._requests(seqs)
        out: list[tuple[int, ...]] = [()] * len(seqs)
        for r in requests:  # used now: evicted after sequences that are not in this call
            if r.seq_id in self._seqs:
                self._seqs.move_to_end(r.seq_id)
        for group in self._groups(requests):
            for r, drafts in zip(group, self._run_group(group), strict=True):
                out[r.index] = drafts
        return out

    def release(self, seq_ids: Iterable[int]) -> None:
        """Drop these sequences' state and free their blocks; unknown ids are ignored."""
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None:
                self.blocks.free(seq.block_ids)

    def reset(self) -> None:
        """Drop every sequence's state."""
        self.release(list(self._seqs))

    def check_integrity(self) -> None:
        """AssertionError unless free + held blocks are exactly the pool, none held twice,
        and each sequence's blocks cover its computed positions."""
        held = [b for s in self._seqs.values() for b in s.block_ids]
        every = sorted(held + list(self.blocks.free_ids()))
        assert every == list(range(self.num_blocks)), f"blocks lost or held twice: {every}"
        for seq_id, s in self._seqs.items():
            assert len(s.computed) <= len(s.block_ids) * self.block_size, f"seq {seq_id}: blocks short"

    # ------------------------------------------------------------------ validation and planning

    def _requests(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> list[_Request]:
        """The call's sequences that get drafts, validated whole before any state changes."""
        requests, seen = [], set()
        for index, (seq_id, known, k) in enumerate(seqs):
            if seq_id in seen:
                raise ValueError(f"propose: seq_id {seq_id} appears twice")
            seen.add(seq_id)
            if not 0 <= k <= self.num_speculative_tokens:
                raise ValueError(
                    f"propose: seq {seq_id} asks for {k} drafts, not in [0, {self.num_speculative_tokens}]"
                )
            tokens = list(known)
            if not tokens:
                raise ValueError(f"propose: seq {seq_id} has no tokens")
            seq = self._seqs.get(seq_id)
            common = 0 if seq is None else _common_prefix(seq.computed, tokens)
            self._check_token_ids(seq_id, tokens[common:])
            num_drafts = min(k, self.max_model_len - len(tokens))
            if num_drafts > 0:
                requests.append(_Request(index, seq_id, tokens, num_drafts, common))
        return requests

    def _check_token_ids(self, seq_id: int, tokens: list[int]) -> None:
        """Tokens the draft has not computed must be in its vocabulary (those it has were)."""
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            bad = next(t for t in tokens if not 0 <= t < self.vocab_size)
            raise ValueError(
                f"propose: seq {seq_id} has token id {bad}, outside the draft's vocabulary of {self.vocab_size}"
            )

    def _blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def _groups(self, requests: list[_Request]) -> Iterator[list[_Request]]:
        """The requests in order, in groups whose blocks fit in the pool together. A sequence
        that cannot fit alone is dropped (its state released): it gets no drafts."""
        group: list[_Request] = []
        group_blocks = 0
        for r in requests:
            need = self._blocks_for(r.num_positions)
            if need > self.num_blocks:
                self.release([r.seq_id])
                continue
            if group and group_blocks + need > self.num_blocks:
                yield group
                group, group_blocks = [], 0
            group.append(r)
            group_blocks += need
        if group:
            yield group

    def _reserve(self, group: list[_Request]) -> list[_DraftSeq]:
        """Each member's state cut to what it keeps and given the blocks this call needs,
        evicting the least recently used other sequences for room (always enough: a group's
        blocks fit in the pool)."""
        members = {r.seq_id for r in group}
        states = []
        for r in group:
            seq = self._seqs.setdefault(r.seq_id, _DraftSeq())
            # a member evicted since validation starts over; the last known token is
            # always run, for the logits that give the first draft
            keep = min(r.common, len(seq.computed), len(r.tokens) - 1)
            del seq.computed[keep:]
            need = self._blocks_for(r.num_positions)
            self.blocks.free(seq.block_ids[need:])
            del seq.block_ids[need:]
            states.append(seq)
        missing = sum(self._blocks_for(r.num_positions) - len(s.block_ids) for r, s in zip(group, states, strict=True))
        while self.blocks.num_free < missing:
            victim = next(seq_id for seq_id in self._seqs if seq_id not in members)
            self.release([victim])
        for r, seq in zip(group, states, strict=True):
            seq.block_ids += self.blocks.allocate(self._blocks_for(r.num_positions) - len(seq.block_ids))
        return states

    # ------------------------------------------------------------------ running the model

    def _run_group(self, group: list[_Request]) -> list[tuple[int, ...]]:
        """The group's drafts: one forward over the catch-up chunks, then single-token steps."""
        states = self._reserve(group)
        chunks = [
            _Chunk(seq, len(seq.computed), r.tokens[len(seq.computed) :]) for r, seq in zip(group, states, strict=True)
        ]
        drafts = [[token] for token in self._forward(chunks)]
        for step in range(1, max(r.num_drafts for r in group)):
            live = [i for i, r in enumerate(group) if r.num_drafts > step]
            steps = [_Chunk(states[i], len(states[i].computed), [drafts[i][-1]]) for i in live]
            for i, token in zip(live, self._forward(steps), strict=True):
                drafts[i].append(token)
        return [tuple(d) for d in drafts]

    def _forward(self, chunks: list[_Chunk]) -> list[int]:
        """Run the chunks as one flattened batch, record their tokens as computed, and return
        each chunk's greedy next token (argmax of its last row; ties to the lowest id)."""
        metadata, positions = self._metadata(chunks)
        inputs = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long, device=self.device)
        last_rows = torch.tensor(metadata.query_start_loc_list[1:], dtype=torch.long, device=self.device) - 1
        logits = self.model(inputs, positions, self.kv_cache.pools, metadata, self.backend, last_rows)
        for c in chunks:
            c.seq.computed += c.tokens
        self.num_forward_tokens += inputs.shape[0]
        return logits.argmax(dim=-1).tolist()  # [num_chunks]; argmax takes the first maximum

    def _metadata(self, chunks: list[_Chunk]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The flattened batch's layout (as the stage's) and positions."""
        return paged_layout([(c.start, c.end, c.seq.block_ids) for c in chunks], self.block_size, self.device)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the target accepted every draft fed): one C compare
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _dtype_name(dtype: torch.dtype | str) -> str:
    """The loader's name for a dtype ("auto" and names pass through)."""
    if isinstance(dtype, str):
        return dtype
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)} or 'auto', got {dtype}")


def drafter_for(
    speculative_config: str | None,
    *,
    is_last: bool,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str | AttentionBackend,
) -> DraftProposer | None:
    """The last stage's draft model when `--speculative-config` names one (method
    draft_model), else None. Its vocabulary must be the target's (ValueError)."""
    from services.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative_config)
    if spec is None or spec.method != "draft_model" or not is_last:
        return None
    drafter = DraftProposer(
        spec.model,
        spec.num_speculative_tokens,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
        device=device,
        backend=backend,
    )
    if drafter.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocabulary ({drafter.vocab_size}) is "
            f"not the target's ({vocab_size})"
        )
    return drafter
