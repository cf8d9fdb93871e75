"""Paged attention over a flattened, variable-length batch.

A batch mixes prefill chunks and single decode tokens of several sequences, with no
padding: sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`, and after
this step its KV holds `context_lens[i]` tokens, the last `num_new` of them being this
step's (so the chunk attends causally within itself and fully over the cached context).
Its KV lives in the blocks `block_tables[i]`: token t of the sequence is in block
`block_tables[i][t // block_size]`, offset `t % block_size`.

`TorchAttentionBackend` is the reference; `CpuAttentionBackend` (the CPU default) runs
decode rows through a native kernel that reads the pools in place; the Triton backend (GPU)
implements the same two methods (`write_kv`, `forward`).

Soft-capped scores (Gemma 2's `softcap`: cap * tanh(score / cap) before the softmax) are
computed by the torch backend with explicit products (`_attend`; SDPA has no soft-capping);
the CPU backend's native decode kernel caps its scores itself (its prefill rows take the torch
path), the Triton backend refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.config import ATTENTION_BACKENDS
from worker_svc.kernels.attention_metadata import AttentionBackend, AttentionMetadata

# the most a prefill chunk's attention mask may take (its queries go in tiles under it)
MASK_BUDGET_BYTES = 64 << 20
# the pool dtypes the native CPU kernels read and write under float32 activations
# (`--kv-cache-dtype`: float32, or bfloat16 for half the bytes)
KV_POOL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _DecodeGroup:
    """Single-token rows attended together: their K/V gathered into one padded batch."""

    token_rows: torch.Tensor  # [n] rows of q / out
    tables: torch.Tensor  # [n * blocks]: each row's blocks, padded (padding masked out), flat
    max_ctx: int
    # [n, 1, 1, max_ctx] additive float32 mask (0 = attend, -inf = padding); None: attend to
    # all. (On CPU an additive mask runs faster in SDPA than a boolean one: 0.13 vs 0.19 ms.)
    keep: torch.Tensor | None


class TorchAttentionBackend:
    """Plain torch paged attention, the reference and the CPU path.

    Decode rows (one new token) go in groups, shortest contexts first: each group's blocks are
    gathered into a padded [n, kv_heads, max_ctx, head_dim] batch and one SDPA call (GQA
    without repeating K/V) attends over it, padding masked. A group holds at most
    `DECODE_GROUP_MAX_ELEMENTS` padded K elements, so that its gathered K/V stay in cache.
    Prefill chunks go one sequence at a time (causal within the chunk).
    """

    name = "torch"

    # Measured on CPU, one thread, float32 (64 decode rows): groups of <= 262,144 elements
    # (1 MiB of K) run 1.3-2x faster than one SDPA call per sequence and 1.5x faster than
    # one padded batch of all rows, from tiny (ctx 64, d 16) to 25M-model shapes (ctx 600,
    # d 64): bench/attention.py.
    DECODE_GROUP_MAX_ELEMENTS = 262_144  # rows x longest context x kv heads x head dim

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # pools: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_pool.dtype))
        v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_pool.dtype))

    def forward(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim] -> out: same shape; sinks: [num_heads] or None
        head_dim = q.shape[2]
        block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
        out = torch.empty_like(q)
        groups, prefills = self._plan(metadata, block_size, num_kv_heads * head_dim, sliding_window)
        for g in groups:
            # index_select over whole blocks: several times faster on CPU than advanced indexing
            n = g.token_rows.shape[0]
            blocks = g.tables.shape[0] // n
            k = k_pool.index_select(0, g.tables).view(n, blocks * block_size, num_kv_heads, head_dim)
            v = v_pool.index_select(0, g.tables).view(n, blocks * block_size, num_kv_heads, head_dim)
            k, v = k[:, : g.max_ctx].to(q.dtype), v[:, : g.max_ctx].to(q.dtype)  # a bfloat16 pool widens
            o = _attend(
                q[g.token_rows].unsqueeze(2),  # [n, heads, 1, d]
                k.transpose(1, 2),  # [n, kv_heads, max_ctx, d]
                v.transpose(1, 2),
                None if g.keep is None else g.keep.to(q.dtype),
                False,
                scale,
                softcap,
                sinks,
            )
            out[g.token_rows] = o.squeeze(2)
        self._prefill(q, k_pool, v_pool, metadata, prefills, scale, sliding_window, out, softcap, sinks)
        return out

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        metadata: AttentionMetadata,
        prefills: list[int],
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Rows with several new tokens, one sequence at a time (causal within the chunk)."""
        head_dim = q.shape[2]
        block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
        starts = metadata.query_start_loc_list
        for i in prefills:
            ctx = metadata.context_lens_list[i]
            q_start, q_end = starts[i], starts[i + 1]
            num_blocks = -(-ctx // block_size)
            blocks = metadata.block_tables[i, :num_blocks]
            k = k_pool.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx].to(q.dtype)  # [ctx, kv_heads, d]
            v = v_pool.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx].to(q.dtype)
            num_new = q_end - q_start
            # a whole prompt in one chunk: plain causal attention, no mask to build. Batched
            # (4-D) inputs: on CPU, SDPA runs its fused kernel only for those (1.8x faster)
            causal = num_new == ctx and num_new > 1 and (sliding_window is None or ctx <= sliding_window)
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
            # a chunk after others attends to the whole context through a [queries, ctx] mask:
            # queries in tiles, so that the mask (and SDPA's use of it) stays within
            # MASK_BUDGET_BYTES however long the context (a 2048-token chunk at 128K would need 1 GiB)
            tile = num_new if causal else max(1, min(num_new, MASK_BUDGET_BYTES // (4 * ctx)))
            for t in range(0, num_new, tile):
                rows = min(tile, num_new - t)
                o = _attend(
                    q[q_start + t : q_start + t + rows].transpose(0, 1)[None],  # [1, heads, rows, d]
                    keys,
                    values,
                    None if causal else _mask(rows, ctx, sliding_window, q.device, first=ctx - num_new + t),
                    causal,
                    scale,
                    softcap,
                    sinks,
                )
                out[q_start + t : q_start + t + rows] = o[0].transpose(0, 1)

    def _plan(
        self, metadata: AttentionMetadata, block_size: int, kv_width: int, sliding_window: int | None
    ) -> tuple[list[_DecodeGroup], list[int]]:
        """The step's decode groups and prefill rows: made by the first layer, reused by the
        others (every layer of a step has the same layout)."""
        key = ("torch", block_size, kv_width, sliding_window)
        planned = metadata.derived.get(key)
        if planned is not None:
            return planned
        ctx_lens = metadata.context_lens_list
        decodes, prefills = metadata.split_rows()
        decodes = sorted(decodes, key=lambda i: ctx_lens[i])
        groups, run = [], []
        for i in decodes:  # ascending contexts: a group's longest is its last
            if run and ctx_lens[i] * (len(run) + 1) * kv_width > self.DECODE_GROUP_MAX_ELEMENTS:
                groups.append(self._group(run, metadata, block_size, sliding_window))
                run = []
            run.append(i)
        if run:
            groups.append(self._group(run, metadata, block_size, sliding_window))
        metadata.derived[key] = (groups, prefills)
        return groups, prefills

    @staticmethod
    def _group(
        rows: list[int], metadata: AttentionMetadata, block_size: int, sliding_window: int | None
    ) -> _DecodeGroup:
        device = metadata.block_tables.device
        ctx_list = [metadata.context_lens_list[i] for i in rows]
        max_ctx = ctx_list[-1]
        index = torch.tensor(rows, dtype=torch.long, device=device)
        tables = metadata.block_tables[index, : -(-max_ctx // block_size)].reshape(-1)
        token_rows = torch.tensor([metadata.query_start_loc_list[i] for i in rows], dtype=torch.long, device=device)
        keep = None
        if ctx_list[0] != max_ctx or (sliding_window is not None and max_ctx > sliding_window):
            ctx = torch.tensor(ctx_list, device=device)[:, None]
            pos = torch.arange(max_ctx, device=device)[None, :]
            keep = pos < ctx
            if sliding_window is not None:
                keep &= pos > ctx - 1 - sliding_window
            keep = torch.zeros(keep.shape, device=device).masked_fill_(~keep, float("-inf"))[:, None, None, :]
        return _DecodeGroup(token_rows, tables, max_ctx, keep)


@dataclass(frozen=True)
class _DecodeRows:
    """The step's decode rows as the native kernel takes them (made once, used by every layer)."""

    rows: torch.Tensor  # [n] int64: each sequence's query row
    tables: torch.Tensor  # [n, max_blocks] int64, contiguous
    ctx_lens: torch.Tensor  # [n] int64
    prefills: list[int]


class CpuAttentionBackend(TorchAttentionBackend):
    """The CPU path: decode rows through the native paged kernel (`csrc/paged_decode.c`),
    which reads K/V straight from the pools through the block tables, with no gathered
    copy; prefill chunks as the torch backend computes them. Falls back to the torch
    backend whole when the kernel is not available or the tensors are not float32 on the
    CPU. A 64-sequence decode step of the anchor model (bench/attention.py):
    see docs/benchmarks.md."""

    name = "cpu"

    def __init__(self) -> None:
        from worker_svc.kernels.cpu_kernels import paged_decode

        self.kernel = paged_decode()

    def forward(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            self.kernel is None
            or q.device.type != "cpu"
            or q.dtype != torch.float32
            or k_pool.dtype not in KV_POOL_DTYPES
            or v_pool.dtype != k_pool.dtype
        ):
            return super().forward(q, k_pool, v_pool, metadata, scale, sliding_window, softcap, sinks)
        decode = self._decode_rows(metadata)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # rows may be apart, heads not
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        if decode.rows.shape[0]:
            self.kernel(
                q,
                k_pool,
                v_pool,
                out,
                decode.rows,
                decode.tables,
                decode.ctx_lens,
                scale,
                sliding_window,
                softcap,
                sinks=sinks,
            )
        self._prefill(q, k_pool, v_pool, metadata, decode.prefills, scale, sliding_window, out, softcap, sinks)
        return out

    def rope_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> bool:
        """Rotate q and k of the fused `qkv` rows in place and write K/V to the pools, in
        one native call; False (nothing done) when the kernel or the layouts do not allow
        it, and the caller does it with torch (worker_svc/models/stage.py)."""
        if (
            self.kernel is None
            or qkv.device.type != "cpu"
            or not qkv.is_contiguous()
            or not qkv.dtype == cos.dtype == sin.dtype == torch.float32
            or k_pool.dtype not in KV_POOL_DTYPES
            or v_pool.dtype != k_pool.dtype
            or not (cos.is_contiguous() and sin.is_contiguous() and slot_mapping.is_contiguous())
            or cos.shape[-1] % 2
        ):
            return False
        self.kernel.rope_write(qkv, cos, sin, slot_mapping, k_pool, v_pool, num_heads)
        return True

    @staticmethod
    def _decode_rows(metadata: AttentionMetadata) -> _DecodeRows:
        planned = metadata.derived.get("cpu")
        if planned is not None:
            return planned
        starts = metadata.query_start_loc_list
        decodes, prefills = metadata.split_rows()
        if len(decodes) == metadata.num_seqs:  # all decodes: the step's own tensors
            rows = metadata.query_start_loc[:-1].contiguous()
            tables, ctx_lens = metadata.block_tables.contiguous(), metadata.context_lens.contiguous()
        else:
            index = torch.tensor(decodes, dtype=torch.long)
            rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long)
            tables = metadata.block_tables.index_select(0, index).contiguous()
            ctx_lens = metadata.context_lens.index_select(0, index).contiguous()
        planned = _DecodeRows(rows, tables, ctx_lens, prefills)
        metadata.derived["cpu"] = planned
        return planned


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [b, H, n, D] over k, v [b, Hkv, ctx, D] (GQA: H a multiple of Hkv)
    under `mask` (boolean, True = attend; or additive float) or `causal`; soft-capped scores
    as transformers' eager attention computes them when `softcap` is set; `sinks` [H]: one
    more logit a head in the softmax's denominator, whose weight is dropped (gpt-oss)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, ctx = q.shape[2], k.shape[2]
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(q.dtype), v)


def _mask(
    num_new: int, ctx: int, sliding_window: int | None, device: torch.device, first: int | None = None
) -> torch.Tensor | None:
    """Boolean [num_new, ctx] mask (True = attend) for queries at positions `first ...`
    (default: the context's last `num_new`): causal, windowed if asked."""
    first = ctx - num_new if first is None else first
    if num_new == 1 and first == ctx - 1 and (sliding_window is None or ctx <= sliding_window):
        return None
    q_pos = torch.arange(first, first + num_new, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


BACKEND_NAMES = ATTENTION_BACKENDS


def get_backend(name: str) -> AttentionBackend:
    """The attention backend named by configuration: `cpu` (native decode kernel, torch
    prefill), `torch` (the reference) or `triton` (GPU)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "triton":
        # Imported only when chosen: importing triton fixes interpreter vs compiled mode.
        try:
            from worker_svc.kernels.triton_attention import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention backend 'triton' needs the triton package: {exc}") from exc
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
