"""Triton paged attention: the GPU implementation of `AttentionBackend`.

Same contract as `TorchAttentionBackend` (see worker_svc/kernels/attention.py): a flattened batch
mixing decode tokens and prefill chunks, each sequence's query rows attending causally
within its chunk and fully over its cached context (or the last `sliding_window` tokens),
with grouped-query attention, K/V read straight out of the paged pools
`[num_blocks, block_size, num_kv_heads, head_dim]`; optional attention sinks (gpt-oss: a
learned logit per head in the softmax's denominator only).

Kernel layout. One program serves `BLOCK_Q` consecutive query tokens of one sequence and
one KV head, with all `group = num_heads // num_kv_heads` query heads that share it, so a
KV tile is loaded once per group: the program's `BLOCK_M = BLOCK_Q * group` query rows are
(token, head) pairs. Programs find their sequence by binary search over `query_start_loc`
(sequence i's tiles start at program `query_start_loc[i] // BLOCK_Q + i`), so the launch
needs no per-step host-side table; programs past a sequence's last tile exit at once. The
context is walked in tiles of `TILE_N` tokens, each token's slot gathered through the block
table, so any block size works (1, 16, 32, ...). Softmax is online, in float32; inputs of
every dtype are upcast to float32 inside the kernel (bfloat16 arithmetic is wrong in
Triton's CPU interpreter), and the dots run as TF32 for half-precision inputs (exact for
them: TF32 holds every float16 and bfloat16 value) and as IEEE float32 for float32 inputs.

On the CPU, Triton runs only through its interpreter (`TRITON_INTERPRET=1`, set before
triton is imported); the backend notices which mode the kernels were built in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from worker_svc.kernels.attention_metadata import AttentionMetadata

# Context tokens per inner-loop step. 32 keeps a head-dim-128 program's K and V tiles, their
# float32 copies and two pipeline stages well inside the shared memory of any CUDA GPU
# Triton supports, while a decode program still has 16 KiB of KV in flight per stage.
DEFAULT_TILE_N = 32
_MIN_DOT = 16  # tl.dot on the GPU wants every dimension >= 16
_PREFILL_BLOCK_M = 64  # query rows per program when the step holds prefill chunks


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_pool_slot,
    stride_pool_head,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)  # int64; negative = padding token, nothing to write
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        dst = slot * stride_pool_slot + h * stride_pool_head + d
        k = tl.load(k_ptr + token * stride_k_tok + h * stride_k_head + d, mask=mask)
        tl.store(k_pool_ptr + dst, k, mask=mask)
        v = tl.load(v_ptr + token * stride_v_tok + h * stride_v_head + d, mask=mask)
        tl.store(v_pool_ptr + dst, v, mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence i whose tiles hold program `pid`: the last i with qsl[i] // BLOCK_Q + i <= pid."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    n_start,
    kv_end,
    q_pos,
    k_pool_ptr,
    v_pool_ptr,
    table_row_ptr,
    block_size,
    kv_head,
    stride_pool_slot,
    stride_pool_head,
    sliding_window,
    scale_log2e,
    offs_d,
    d_mask,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over context tokens [n_start, n_start + TILE_N)."""
    offs_n = n_start + tl.arange(0, TILE_N)
    n_valid = offs_n < kv_end
    block = tl.load(table_row_ptr + offs_n // block_size, mask=n_valid, other=0)
    slot = block * block_size + offs_n % block_size  # [TILE_N] int64
    kv_off = slot * stride_pool_slot + kv_head * stride_pool_head
    # K^T tile: [D, TILE_N]
    k_mask = d_mask[:, None] & n_valid[None, :]
    k = tl.load(k_pool_ptr + kv_off[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
    s = tl.dot(q, k.to(tl.float32), input_precision=DOT_PRECISION) * scale_log2e
    allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
    if USE_WINDOW:
        allowed = allowed & (offs_n[None, :] > q_pos[:, None] - sliding_window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing to attend to yet keep m = -inf; subtract 0 there instead (no NaN).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_mask = n_valid[:, None] & d_mask[None, :]
    v = tl.load(v_pool_ptr + kv_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_context(
    acc, m_i, l_i, q, kv_start, kv_end, q_pos, k_pool_ptr, v_pool_ptr,
    table_row_ptr, block_size, kv_head, stride_pool_slot, stride_pool_head,
    sliding_window, scale_log2e, offs_d, d_mask,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Online softmax over context positions [kv_start, kv_end), one TILE_N tile at a time."""
    if INTERPRET:
        # The interpreter's range() cannot take runtime bounds under numpy >= 2.3
        # (scalars are 1-element arrays); a while loop works in both worlds, but only a
        # for loop gets software-pipelined when compiled.
        n_start = kv_start
        while n_start < kv_end:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, n_start, kv_end, q_pos, k_pool_ptr, v_pool_ptr,
                table_row_ptr, block_size, kv_head, stride_pool_slot, stride_pool_head,
                sliding_window, scale_log2e, offs_d, d_mask,
                TILE_N, USE_WINDOW, DOT_PRECISION,
            )  # fmt: skip
            n_start += TILE_N
    else:
        for n_start in range(kv_start, kv_end, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, n_start, kv_end, q_pos, k_pool_ptr, v_pool_ptr,
                table_row_ptr, block_size, kv_head, stride_pool_slot, stride_pool_head,
                sliding_window, scale_log2e, offs_d, d_mask,
                TILE_N, USE_WINDOW, DOT_PRECISION,
            )  # fmt: skip
    return acc, m_i, l_i


# Runtime values that vary from step to step are not specialised on, so that one compiled
# kernel serves every batch of a model.
@triton.jit(do_not_specialize=["num_seqs", "sliding_window", "stride_table_seq"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    sinks_ptr, scale_log2e, num_seqs, block_size, sliding_window, head_dim,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_pool_slot, stride_pool_head,
    stride_table_seq,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < num_new:
        ctx = tl.load(context_lens_ptr + seq)
        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # token index within the chunk
        head = kv_head * GROUP + offs_m % GROUP
        row_valid = (q_idx < num_new) & (offs_m < BLOCK_Q * GROUP)
        q_pos = ctx - num_new + q_idx  # absolute position of each row's token
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = offs_d < head_dim
        q_off = (q_start + q_idx) * stride_q_tok + head * stride_q_head
        q_mask = row_valid[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
        q = q.to(tl.float32)

        if HAS_SINKS:
            # The sink joins as one more key whose value is zero: the running max starts
            # at its logit (in exp2 units) and the denominator at its weight, exp2(0) = 1.
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        # Context this tile of queries can see: up to its last token, and with a sliding
        # window from its first token's window start.
        last_q = tl.minimum((q_tile + 1) * BLOCK_Q, num_new) - 1
        kv_end = ctx - num_new + last_q + 1
        kv_start = kv_end * 0
        if USE_WINDOW:
            first_pos = ctx - num_new + q_tile * BLOCK_Q
            kv_start = tl.maximum(first_pos - sliding_window + 1, 0) // TILE_N * TILE_N
        table_row_ptr = block_tables_ptr + seq * stride_table_seq
        acc, m_i, l_i = _attend_context(
            acc, m_i, l_i, q, kv_start, kv_end, q_pos, k_pool_ptr, v_pool_ptr,
            table_row_ptr, block_size, kv_head, stride_pool_slot, stride_pool_head,
            sliding_window, scale_log2e, offs_d, d_mask,
            TILE_N, USE_WINDOW, DOT_PRECISION, INTERPRET,
        )  # fmt: skip
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + q_idx) * stride_o_tok + head * stride_o_head
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return isinstance(_paged_attention_kernel, InterpretedFunction)


class TritonAttentionBackend:
    """Paged attention in Triton kernels; numerically the torch reference's contract.

    Tensors must live on a CUDA device, or on the CPU when the kernels run under Triton's
    interpreter. Launch parameters depend only on the step's layout, so they are worked
    out once per `AttentionMetadata` (the runner builds one per step and reuses it for
    every layer).
    """

    name = "triton"

    def __init__(self, tile_n: int = DEFAULT_TILE_N) -> None:
        if tile_n < _MIN_DOT or tile_n & (tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= {_MIN_DOT}, got {tile_n}")
        self.tile_n = tile_n
        self.interpret = interpreting()
        self._last: tuple[AttentionMetadata, int] | None = None  # (metadata, longest chunk)

    def _check_device(self, t: torch.Tensor) -> None:
        if not self.interpret and t.device.type != "cuda":
            raise ValueError(
                f"the triton attention backend needs CUDA tensors, got {t.device}; on the CPU "
                "use the torch backend, or set TRITON_INTERPRET=1 before triton is imported"
            )

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # pools: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        self._check_device(k_pool)
        num_tokens = k.shape[0]
        if num_tokens == 0:
            return
        _, _, num_kv_heads, head_dim = k_pool.shape
        k, v = _unit_last_stride(k.to(k_pool.dtype)), _unit_last_stride(v.to(v_pool.dtype))
        k_slots, v_slots = _slots_view(k_pool), _slots_view(v_pool)
        _write_kv_kernel[(num_tokens,)](
            k, v, k_slots, v_slots, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_slots.stride(0), k_slots.stride(1),
            num_kv_heads, head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip

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
        """`sinks` [num_heads] (gpt-oss): one learned logit per head that joins each row's
        softmax denominator (its column then dropped), as transformers' eager attention."""
        if softcap is not None:
            raise ValueError(
                "attention logit soft-capping (Gemma 2) is not supported by the triton "
                "attention backend; use --attention-backend torch"
            )
        # q: [num_tokens, num_heads, head_dim] -> out: same shape
        self._check_device(q)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_pool.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
        group = num_heads // num_kv_heads
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks {tuple(sinks.shape)}: one logit per query head, ({num_heads},)")
        q = _unit_last_stride(q)
        out = torch.empty_like(q)
        if num_tokens == 0:
            return out
        max_chunk = self._longest_chunk(metadata)
        # Decode-only steps take the smallest tile tl.dot allows; prefill chunks larger ones.
        block_m = max(_MIN_DOT if max_chunk == 1 else _PREFILL_BLOCK_M, triton.next_power_of_2(group))
        block_q = block_m // group
        k_slots, v_slots = _slots_view(k_pool), _slots_view(v_pool)
        grid = (num_tokens // block_q + metadata.num_seqs, num_kv_heads)
        _paged_attention_kernel[grid](
            out, q, k_slots, v_slots,
            metadata.block_tables, metadata.query_start_loc, metadata.context_lens,
            q if sinks is None else sinks.float().contiguous(),  # (q: a pointer never read)
            scale * 1.4426950408889634,  # log2(e): the kernel works in exp2
            metadata.num_seqs, k_pool.shape[1], sliding_window or 0, head_dim,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_slots.stride(0), k_slots.stride(1), metadata.block_tables.stride(0),
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            HEAD_DIM_PAD=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
            TILE_N=self.tile_n,
            USE_WINDOW=sliding_window is not None,
            HAS_SINKS=sinks is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            INTERPRET=self.interpret,
            num_warps=8 if block_m >= _PREFILL_BLOCK_M else 4,
            num_stages=2,
        )  # fmt: skip
        return out

    def _longest_chunk(self, metadata: AttentionMetadata) -> int:
        if self._last is None or self._last[0] is not metadata:
            starts = metadata.query_start_loc_list
            longest = max(b - a for a, b in zip(starts, starts[1:], strict=False))
            self._last = (metadata, longest)
        return self._last[1]


def _slots_view(pool: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> [num_slots, Hkv, D], sharing storage."""
    if not pool.is_contiguous():
        raise ValueError("KV pools must be contiguous")
    return pool.view(-1, pool.shape[2], pool.shape[3])


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
