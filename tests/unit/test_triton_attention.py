"""Triton paged-attention kernels against the torch reference backend.

On the CPU the kernels run under Triton's interpreter (the conftest sets TRITON_INTERPRET=1
before triton is imported), so shapes stay small: contexts under 100 tokens, a few heads,
head dims of 16 to 32. With TRITON_INTERPRET=0 the same tests run compiled on CUDA
(`scripts/gpu_check.py` does so, with `--noconftest`: the file needs nothing from the
conftest but pytest itself); PAGODA_TEST_DEVICE overrides the device. Larger, GPU-sized
cases are in tests/gpu/test_gpu_kernels.py, which reuses `make_batch`.

Batches mix decode tokens, prefill chunks on top of cached context and whole prompts;
blocks are handed out shuffled so that block tables are not contiguous, and the pools hold
random values everywhere, so a kernel that reads a slot it must not see is caught.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from worker_svc.checkpoints.loader import load_stage
from worker_svc.execution.runner import StageRunner
from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend, get_backend

triton_attention = pytest.importorskip("worker_svc.kernels.triton_attention")
DEVICE = torch.device(os.environ.get("PAGODA_TEST_DEVICE") or ("cpu" if triton_attention.interpreting() else "cuda"))
if DEVICE.type == "cpu" and not triton_attention.interpreting():
    pytest.skip("Triton runs on the CPU only under TRITON_INTERPRET=1", allow_module_level=True)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need a CUDA device", allow_module_level=True)

# (num_new_tokens, context_len) per sequence: decodes at block boundaries and off them, a
# chunk on top of cached context, a whole prompt, a chunk longer than one query tile.
MIXED = ((1, 1), (1, 33), (7, 40), (20, 20), (1, 64), (70, 90))
DECODE = ((1, 1), (1, 16), (1, 17), (1, 50), (1, 95))
PREFILL = ((37, 37), (5, 96))

TOLERANCE = {  # (atol, rtol) against the float32 reference
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class Case:
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    chunks: tuple[tuple[int, int], ...]
    sliding_window: int | None = None
    tile_n: int = triton_attention.DEFAULT_TILE_N


CASES = {
    "bs16-gqa1-fp32-mixed": Case(16, 2, 2, 16, torch.float32, MIXED),
    "bs32-gqa1-fp32-mixed": Case(32, 2, 2, 32, torch.float32, MIXED),
    "bs16-gqa4-fp32-mixed": Case(16, 8, 2, 16, torch.float32, MIXED),
    "bs32-gqa4-fp32-decode": Case(32, 4, 1, 32, torch.float32, DECODE),
    "bs16-gqa4-fp16-mixed": Case(16, 4, 1, 32, torch.float16, MIXED),
    "bs32-gqa1-fp16-decode": Case(32, 2, 2, 16, torch.float16, DECODE),
    "bs32-gqa4-fp16-prefill": Case(32, 8, 2, 16, torch.float16, PREFILL),
    "bs16-gqa4-bf16-mixed": Case(16, 4, 1, 16, torch.bfloat16, MIXED),
    "bs16-gqa2-fp32-window": Case(16, 4, 2, 16, torch.float32, MIXED, sliding_window=24),
    "bs32-gqa1-fp16-window-tile16": Case(32, 2, 2, 16, torch.float16, MIXED, 8, tile_n=16),
    "bs16-gqa1-fp32-tile64": Case(16, 2, 2, 16, torch.float32, MIXED, tile_n=64),
    # odd shapes: block size 1, a head dim that is not a power of two, groups of 3
    "bs1-gqa3-d24-fp32": Case(1, 6, 2, 24, torch.float32, ((1, 9), (6, 30), (1, 41))),
}


def make_batch(case: Case, seed: int = 0, device: torch.device = DEVICE):
    """Random pools, new K/V and queries, and the step's metadata (as StageRunner builds it)."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [-(-ctx // bs) for _, ctx in case.chunks]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, starts = [], [], [0]
    for (num_new, ctx), n in zip(case.chunks, needed, strict=True):
        blocks, order = order[:n], order[n:]
        tables.append(blocks)
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(ctx - num_new, ctx))
        starts.append(starts[-1] + num_new)
    num_tokens = starts[-1]
    table = torch.zeros((len(tables), max(needed)), dtype=torch.long)
    for i, blocks in enumerate(tables):
        table[i, : len(blocks)] = torch.tensor(blocks)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device=device, dtype=case.dtype)

    context_lens = tuple(ctx for _, ctx in case.chunks)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        block_tables=table.to(device),
        query_start_loc_list=tuple(starts),
        context_lens_list=context_lens,
    )
    pools = (rand(num_blocks, bs, hkv, d), rand(num_blocks, bs, hkv, d))
    new_kv = (rand(num_tokens, hkv, d), rand(num_tokens, hkv, d))
    return rand(num_tokens, case.num_heads, d), pools, new_kv, metadata


@pytest.mark.parametrize("name", sorted(CASES))
def test_write_kv_matches_reference(name):
    case = CASES[name]
    _, (k_pool, v_pool), (k, v), metadata = make_batch(case)
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    TorchAttentionBackend().write_kv(ref_k, ref_v, k, v, metadata.slot_mapping)
    triton_attention.TritonAttentionBackend().write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
    assert torch.equal(k_pool, ref_k)
    assert torch.equal(v_pool, ref_v)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_reference(name):
    case = CASES[name]
    q, (k_pool, v_pool), (k, v), metadata = make_batch(case, seed=1)
    TorchAttentionBackend().write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
    scale = case.head_dim**-0.5
    backend = triton_attention.TritonAttentionBackend(tile_n=case.tile_n)
    out = backend.forward(q, k_pool, v_pool, metadata, scale, case.sliding_window)
    assert out.dtype == q.dtype and out.shape == q.shape
    # The reference in float32 on the same (rounded) inputs: the kernel upcasts inside.
    ref = TorchAttentionBackend().forward(
        q.float(), k_pool.float(), v_pool.float(), metadata, scale, case.sliding_window
    )
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    if case.dtype != torch.float32:
        # and no worse than the reference run in the input dtype itself, beyond rounding
        ref_lowp = TorchAttentionBackend().forward(q, k_pool, v_pool, metadata, scale, case.sliding_window)
        err, err_lowp = (out.float() - ref).abs().max(), (ref_lowp.float() - ref).abs().max()
        assert err <= err_lowp + atol


SINK_CASES = {
    "bs16-gqa4-fp32-mixed": Case(16, 8, 2, 16, torch.float32, MIXED),
    "bs16-gqa2-fp32-window": Case(16, 4, 2, 16, torch.float32, MIXED, sliding_window=24),
    "bs32-gqa4-bf16-decode": Case(32, 4, 1, 32, torch.bfloat16, DECODE),
}


def reference_with_sinks(q, k_pool, v_pool, metadata, scale, sliding_window, sinks):
    """transformers' gpt_oss eager attention, in float64, one sequence at a time: softmax
    over [scores..., sink], the sink's column dropped."""
    block_size, num_kv_heads, head_dim = k_pool.shape[1:]
    group = q.shape[1] // num_kv_heads
    k_slots, v_slots = k_pool.reshape(-1, num_kv_heads, head_dim), v_pool.reshape(-1, num_kv_heads, head_dim)
    starts, out = metadata.query_start_loc_list, torch.empty(q.shape, dtype=torch.float64)
    for i, ctx in enumerate(metadata.context_lens_list):
        num_new = starts[i + 1] - starts[i]
        pos = torch.arange(ctx)
        slots = metadata.block_tables[i].cpu()[pos // block_size] * block_size + pos % block_size
        k = k_slots.cpu()[slots].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v_slots.cpu()[slots].double().repeat_interleave(group, dim=1)
        qi = q[starts[i] : starts[i + 1]].cpu().double()  # [n, H, D]
        scores = torch.einsum("nhd,chd->hnc", qi, k) * scale
        q_pos = torch.arange(ctx - num_new, ctx)[:, None]
        allowed = pos[None, :] <= q_pos
        if sliding_window is not None:
            allowed &= pos[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = sinks.cpu().double().view(-1, 1, 1).expand(-1, num_new, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[starts[i] : starts[i + 1]] = torch.einsum("hnc,chd->nhd", probs, v)
    return out


@pytest.mark.parametrize("name", sorted(SINK_CASES))
def test_forward_with_sinks_matches_reference(name):
    case = SINK_CASES[name]
    q, (k_pool, v_pool), (k, v), metadata = make_batch(case, seed=2)
    TorchAttentionBackend().write_kv(k_pool, v_pool, k, v, metadata.slot_mapping)
    scale = case.head_dim**-0.5
    # from sinks that take most of a row's weight to ones that take next to none
    sinks = torch.linspace(4.0, -6.0, case.num_heads, device=DEVICE)
    backend = triton_attention.TritonAttentionBackend()
    out = backend.forward(q, k_pool, v_pool, metadata, scale, case.sliding_window, sinks=sinks)
    ref = reference_with_sinks(q, k_pool, v_pool, metadata, scale, case.sliding_window, sinks)
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    plain = backend.forward(q, k_pool, v_pool, metadata, scale, case.sliding_window)
    assert not torch.allclose(out, plain, atol=10 * atol), "the sinks changed nothing: a vacuous test"
    # a sink at -inf takes no weight: the plain softmax, exactly as without sinks
    none = torch.full((case.num_heads,), float("-inf"), device=DEVICE)
    torch.testing.assert_close(
        backend.forward(q, k_pool, v_pool, metadata, scale, case.sliding_window, sinks=none),
        plain,
        atol=atol,
        rtol=rtol,
    )
    with pytest.raises(ValueError, match="one logit per query head"):
        backend.forward(q, k_pool, v_pool, metadata, scale, None, sinks=sinks[:-1])


def test_backend_is_chosen_by_name():
    assert isinstance(get_backend("triton"), triton_attention.TritonAttentionBackend)
    with pytest.raises(ValueError, match="available: cpu, torch, triton"):
        get_backend("flash")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from wiring.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("triton-tiny"), TinyModelSpec(num_layers=2))


def test_runner_greedy_tokens_equal_torch_backend(tiny_model_dir):
    """End to end: the tiny model through StageRunner gives the same greedy tokens."""
    prompts = [[5, 17, 300, 42], list(range(40, 61)), [7]]
    outputs = {}
    for backend in ("torch", "triton"):
        model = load_stage(tiny_model_dir, dtype="float32", device=DEVICE)
        runner = StageRunner(model, num_blocks=16, block_size=16, backend=backend)
        outputs[backend] = _greedy(runner, prompts, new_tokens=6, chunk=8)
    assert outputs["triton"] == outputs["torch"]


def _greedy(runner: StageRunner, prompts: list[list[int]], new_tokens: int, chunk: int):
    """Greedy decoding of all prompts together, prefilling in chunks of `chunk` tokens."""
    greedy = SamplingParams(temperature=0.0)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    tables = [[4 * i + j for j in range(4)] for i in range(len(prompts))]  # 64 slots each
    step = 0
    while any(len(t) - len(p) < new_tokens for t, p in zip(tokens, prompts, strict=True)):
        new, cached = [], []
        for i, t in enumerate(tokens):
            if len(t) - len(prompts[i]) >= new_tokens:
                continue
            n = min(len(t) - computed[i], chunk)
            if computed[i] == 0:  # sent whole once; the stage keeps its tokens and table
                new.append(NewSeq(i, tuple(t), len(prompts[i]), 0, n, tuple(tables[i]), greedy, 0, i))
            else:
                cached.append(CachedSeq(i, n, len(tables[i])))
            computed[i] += n
        result = runner.execute(StepPlan(step, tuple(new), tuple(cached)))
        for seq_id, token in zip(result.sampled_seq_ids, result.sampled.token_ids, strict=True):
            tokens[seq_id].append(token)
        step += 1
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]
