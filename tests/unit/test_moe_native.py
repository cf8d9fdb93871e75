"""The native decode step's mixture of experts (worker_svc/models/fused_decode.py,
csrc/decode_layers.c) and the paged decode kernel's attention sinks (csrc/paged_decode.c).

A tiny Qwen3-MoE-shaped stage (a MoE layer, then a dense one) with Q8_0 or Q4_K weights (the
router float32, as GGUF files keep it) decodes through the native call and through the layer
modules: the logits agree for batches 1, 7 and 64, with and without a shared expert. The
router variants and gating kinds the module path may not have yet (gpt-oss: the softmax over
the top k's logits, router and expert biases, the clamped SwiGLU) are checked against a
float64 formula of the block in place of the MoE module. Sinks: the kernel against a torch
softmax over [scores, sink] with the sink's column dropped."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from worker_svc.kernels import cpu_kernels
from worker_svc.kernels.quant_kernels import quant_kernels
from worker_svc.model_config import ModelConfig, MoEConfig
from worker_svc.models.fused_decode import FusedDecoder
from worker_svc.models.stage import StageModel
from worker_svc.weights.packed import PackedLinear

kernel = cpu_kernels.paged_decode()
pytestmark = pytest.mark.skipif(kernel is None or quant_kernels() is None, reason="no native kernels")

HIDDEN, EXPERT, SHARED, NUM_EXPERTS, TOP_K = 256, 256, 256, 16, 4


def _quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype == "Q8_0":
        import gguf

        return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0))
    from worker_svc.weights.kquants_ref import quantize

    return quantize(w, qtype)


def _tiny(qtype: str, shared: int, seed: int = 0) -> StageModel:
    """Layer 0 a mixture of 16 experts (top 4, renormalised), layer 1 dense; random weights,
    every linear but the router and the shared expert's gate packed as `qtype`."""
    moe = MoEConfig(NUM_EXPERTS, TOP_K, EXPERT, True, shared, (True, False))
    config = ModelConfig(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        512,
        HIDDEN,
        512,
        2,
        4,
        2,
        64,
        1e-6,
        2048,
        True,
        False,
        qk_norm=True,
        moe=moe,
    )
    model = StageModel(config, 0, 2, True, True)
    model.model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    for name, p in model.model.named_parameters():
        if "norm" in name:
            p.data = 1 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    for name, m in list(model.model.layers.named_modules()):
        if type(m) is nn.Linear and not name.endswith(("mlp.gate", "shared_expert_gate")):
            parent, _, child = name.rpartition(".")
            packed = PackedLinear(_quantize(m.weight.detach(), qtype), qtype, m.in_features)
            setattr(model.model.layers.get_submodule(parent), child, packed)
    model.eval()
    model.fuse_projections()
    assert model.fused_decode is not None
    return model


def _decode_logits(model: StageModel, batch: int, steps: int = 2) -> list[torch.Tensor]:
    """Logits of `steps` decode steps of `batch` greedy sequences after their prefill (prompts
    of 3 to 20 tokens), through the stage's runner with the native CPU backend."""
    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.execution.runner import StageRunner

    runner = StageRunner(model, 2 * batch, 16, "cpu")
    g = torch.Generator().manual_seed(batch)
    prompts = [tuple(torch.randint(5, 500, (3 + i % 18,), generator=g).tolist()) for i in range(batch)]
    greedy = SamplingParams(temperature=0.0)
    runner.execute(
        StepPlan(
            1,
            new_seqs=tuple(NewSeq(i, p, len(p), 0, len(p), (2 * i, 2 * i + 1), greedy) for i, p in enumerate(prompts)),
        )
    )
    captured = []
    original = model.forward
    model.forward = lambda *a, **kw: captured.append(original(*a, **kw).clone()) or captured[-1]
    try:
        for k in range(steps):
            runner.execute(StepPlan(2 + k, cached_seqs=tuple(CachedSeq(i, 1, 2) for i in range(batch))))
    finally:
        del model.forward
    return captured


def _native_and_modules(model: StageModel, batch: int) -> tuple[list, list]:
    """(the logits through the native step, counted, and through the modules)."""
    fused, calls = model.fused_decode, []
    native = fused.forward
    fused.forward = lambda *a: calls.append(1) or native(*a)
    got = _decode_logits(model, batch)
    assert len(calls) == 2  # every decode step went through the native call
    model.fused_decode = None
    want = _decode_logits(model, batch)
    model.fused_decode = fused
    return got, want


def _assert_close(got: list, want: list, tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max()
        assert ((a - b).abs().max() / scale).item() < tol, ((a - b).abs().max(), scale)


@pytest.fixture(scope="module")
def models():
    built = {}

    def make(qtype: str, shared: int) -> StageModel:
        if (qtype, shared) not in built:
            built[qtype, shared] = _tiny(qtype, shared)
        return built[qtype, shared]

    return make


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("shared", [0, SHARED])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_native_moe_step_equals_the_module_path(models, qtype, shared, batch):
    model = models(qtype, shared)
    assert model.model.layers["0"].native_decode
    got, want = _native_and_modules(model, batch)
    _assert_close(got, want, 1e-4)
    if batch == 64:  # the rows spread over most experts
        x = torch.randn(64, HIDDEN)
        assert len(set(model.model.layers["0"].mlp.route(x)[1].flatten().tolist())) >= 12


def _reference_moe(block, x: torch.Tensor) -> torch.Tensor:
    """The block's formula, each row on its own in float64 over the dequantized weights."""

    def weight(m):
        return (m.dequantized() if isinstance(m, PackedLinear) else m.weight).double()

    def bias(m):
        return 0.0 if m.bias is None else m.bias.double()

    def expert(mlp, row):
        gu = row @ weight(mlp.gate_up_packed).T + bias(mlp.gate_up_packed)
        g, u = gu.chunk(2)
        kind = getattr(mlp, "act_kind", 0)
        if kind == 2:
            g, u = g.clamp(max=mlp.limit), u.clamp(-mlp.limit, mlp.limit)
            a = (u + 1) * g * torch.sigmoid(mlp.alpha * g)
        else:
            a = (torch.nn.functional.silu(g) if kind == 0 else torch.nn.functional.gelu(g, approximate="tanh")) * u
        return a @ weight(mlp.down_proj).T + bias(mlp.down_proj)

    out = []
    for row in x.double():
        logits = row @ weight(block.gate).T + bias(block.gate)
        if block.softmax_after_topk:
            top, experts = torch.topk(logits, block.top_k)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, experts = torch.topk(torch.softmax(logits, dim=-1), block.top_k)
            weights = weights / weights.sum() if block.renormalize else weights
        acc = sum(w * expert(block.experts[e], row) for w, e in zip(weights, experts.tolist(), strict=True))
        if block.shared_expert is not None:
            acc = acc + torch.sigmoid(row @ weight(block.shared_expert_gate).T) * expert(block.shared_expert, row)
        out.append(acc)
    return torch.stack(out).to(x.dtype)


def _set_variant(block, router: str, act: int) -> None:
    """Router "renorm", "plain" (no renormalisation) or "topk-softmax" (gpt-oss: with a router
    bias and biases on the experts' products); every expert's gating `act` (2: limit 0.5, so
    that the clamps bite)."""
    g = torch.Generator().manual_seed(act)
    block.renormalize = router == "renorm"
    block.softmax_after_topk = router == "topk-softmax"
    if router == "topk-softmax":
        gate = nn.Linear(HIDDEN, NUM_EXPERTS, bias=True)
        gate.weight.data = block.gate.weight.data.clone()
        gate.bias.data = 0.3 * torch.randn(NUM_EXPERTS, generator=g)
        block.gate = gate
    for e in block.experts:
        e.act_kind, e.alpha, e.limit = act, 1.702, 0.5
        if router == "topk-softmax":
            e.gate_up_packed.bias = 0.1 * torch.randn(2 * EXPERT, generator=g)
            e.down_proj.bias = 0.1 * torch.randn(HIDDEN, generator=g)


VARIANTS = [
    ("plain", 1, SHARED, 7),
    ("renorm", 2, 0, 64),
    ("topk-softmax", 2, 0, 1),
    ("topk-softmax", 2, 0, 7),
    ("topk-softmax", 0, SHARED, 64),
    ("plain", 0, 0, 64),
    ("renorm", 1, 0, 1),
]


@pytest.mark.parametrize(("router", "act", "shared", "batch"), VARIANTS)
def test_native_router_variants_and_gating_equal_the_formula(router, act, shared, batch):
    """The module path with the MoE block replaced by its float64 formula: the native step
    routes and gates as the formula says (the packed products' quantized activations keep
    it within ~1e-4)."""
    model = _tiny("Q8_0", shared, seed=1 + act)
    block = model.model.layers["0"].mlp
    _set_variant(block, router, act)
    model.fused_decode = FusedDecoder.for_model(model)  # reads the block's new attributes
    block.forward = lambda x, lora=None: _reference_moe(block, x)
    got, want = _native_and_modules(model, batch)
    _assert_close(got, want, 1e-3)


def _sink_reference(q, k_pool, v_pool, tables, ctx_lens, scale, window, sinks) -> torch.Tensor:
    """Each sequence's attention over its keys in float64: softmax over [scores, sink], the
    sink's column dropped (transformers' gpt_oss eager attention)."""
    heads, d = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[2]
    out = []
    for i, ctx in enumerate(ctx_lens.tolist()):
        first = max(0, ctx - window) if window else 0
        slots = [
            tables[i, t // k_pool.shape[1]].item() * k_pool.shape[1] + t % k_pool.shape[1] for t in range(first, ctx)
        ]
        k = k_pool.reshape(-1, k_pool.shape[2], d)[slots].double().repeat_interleave(group, dim=1)
        v = v_pool.reshape(-1, v_pool.shape[2], d)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * scale  # [heads, ctx]
        probs = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=1), dim=1)[:, :-1]
        out.append(torch.einsum("ht,thd->hd", probs, v))
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks_equal_a_torch_reference(kv_dtype, window):
    torch.manual_seed(3)
    heads, kv_heads, d, block_size, num_blocks = 8, 2, 32, 4, 64
    ctx_lens = torch.tensor([1, 5, 13, 30], dtype=torch.long)
    tables = torch.randperm(num_blocks)[: 4 * 8].view(4, 8).contiguous()
    k_pool = torch.randn(num_blocks, block_size, kv_heads, d).to(kv_dtype)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, d).to(kv_dtype)
    q = torch.randn(4, heads, d)
    sinks = torch.randn(heads) * 2
    sinks[0] = 30.0  # a sink that outweighs every key: the max of the softmax is the sink's
    rows = torch.arange(4)
    out = torch.empty_like(q)
    kernel(q, k_pool, v_pool, out, rows, tables, ctx_lens, d**-0.5, window, sinks=sinks)
    want = _sink_reference(q, k_pool, v_pool, tables, ctx_lens, d**-0.5, window, sinks)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    plain = torch.empty_like(q)
    kernel(q, k_pool, v_pool, plain, rows, tables, ctx_lens, d**-0.5, window)
    no_sink = _sink_reference(q, k_pool, v_pool, tables, ctx_lens, d**-0.5, window, torch.full((heads,), -math.inf))
    torch.testing.assert_close(plain.double(), no_sink, rtol=1e-5, atol=1e-5)  # None: the plain softmax
    assert out[:, 0].abs().max() < 1e-6  # all of head 0's weight went to its sink
