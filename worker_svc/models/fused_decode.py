"""Decode steps of packed (GGUF) and bfloat16-weight stages in one native call.

A small decode step of a 30-layer model spends more time in per-operation dispatch than in
arithmetic: about 15 torch or ctypes calls a layer, each a few microseconds, and torch's
RMSNorm alone about 50 us a call at one row. `FusedDecoder` runs all of a stage's layers for
a step whose rows are all decodes through `pagoda_decode_layers` (csrc/decode_layers.c),
which calls the same matmul, rotary/K-V-write and attention kernels the module path uses
(through function pointers taken from their loaded libraries), plus its own RMSNorm, SiLU
and residual sums.

It is used only where it computes what the module path computes up to float rounding: a CPU
stage whose every layer has fused packed (or BF16) q/k/v and gate/up products, float32
activations and KV pools, no tensor parallelism, one torch thread (the kernels split rows
over threads only in the module path), and the native kernels present. Everything else
(float32 weights, the exact path; prefill and mixed steps; TP) keeps the module path.
Mixture-of-experts layers (worker_svc/layers/moe.py) run natively when every expert is packed:
the router (float32 or packed) and the top-k, the rows grouped by expert (each active
expert's weights read once a step), the shared expert; gpt-oss's attention sinks are the
attention kernel's.
`PAGODA_FUSED_DECODE=0` turns it off. With KV groups each layer reads its own sub-group's
slots and table out of the step's stacked ones (its `group` and the strides in the shape).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from services.settings import FUSED_DECODE, env_value
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.kernels.block_formats import GGML_TYPES, KERNEL_TYPES
from worker_svc.weights.packed import BF16_GEMM_MIN_ROWS, PackedLinear, PackedParts

log = logging.getLogger(__name__)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_QTYPE_IDS = {name: GGML_TYPES[name][0] for name in (*KERNEL_TYPES, "BF16")}  # ggml's type ids


class _Linear(ctypes.Structure):
    pass


# `next`: the following rows' part in another type (a PackedParts' chain), or NULL
_Linear._fields_ = [
    ("qtype", _I64),
    ("w", _PTR),
    ("bias", _PTR),
    ("n", _I64),
    ("k", _I64),
    ("next", ctypes.POINTER(_Linear)),
]


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", _Linear), ("down", _Linear)]


class _MoE(ctypes.Structure):  # struct pagoda_moe
    _fields_ = [
        ("num_experts", _I64),
        ("top_k", _I64),
        ("renormalize", _I64),
        ("softmax_after_topk", _I64),
        ("router", _Linear),
        ("experts", ctypes.POINTER(_Expert)),
        ("intermediate", _I64),
        ("act", _I64),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
        ("shared", ctypes.POINTER(_Expert)),
        ("shared_intermediate", _I64),
        ("shared_act", _I64),
        ("shared_gate", _Linear),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", _PTR),
        ("norm2", _PTR),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_pool", _PTR),
        ("v_pool", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("post_attn_norm", _PTR),
        ("post_mlp_norm", _PTR),
        ("window", _I64),
        ("softcap", ctypes.c_float),
        ("rope", _I64),
        ("act", _I64),
        ("group", _I64),
        ("act_alpha", ctypes.c_float),
        ("act_limit", ctypes.c_float),
        ("sinks", _PTR),
        ("moe", ctypes.POINTER(_MoE)),
    ]


class _Kernels(ctypes.Structure):
    _fields_ = [
        ("qmm", _PTR),
        ("bf16mm", _PTR),
        ("rope", _PTR),
        ("attn", _PTR),
        ("isa", _I64),
        ("act_bits", _I64),
        ("qscratch", _PTR),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("block_size", _I64),
        ("num_blocks", _I64),
        ("max_blocks", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("group_slots", _I64),
        ("group_tables", _I64),
    ]


def enabled() -> bool:
    return env_value(FUSED_DECODE)


@functools.cache
def _library():
    from worker_svc.kernels.cpu_kernels import SOURCE, build

    lib = ctypes.CDLL(str(build(source=SOURCE.with_name("decode_layers.c"))))
    lib.pagoda_decode_layers.restype = ctypes.c_int
    lib.pagoda_decode_layers.argtypes = [_PTR] * 3 + [_I64, _PTR, _I64] + [_PTR] * 7
    lib.pagoda_decode_scratch_floats.restype = _I64
    lib.pagoda_decode_scratch_floats.argtypes = [_I64] * 5
    lib.pagoda_moe_scratch_floats.restype = _I64
    lib.pagoda_moe_scratch_floats.argtypes = [_I64] * 5
    return lib


def _linear(m: PackedLinear, keep: list[_Linear]) -> _Linear:
    """The native description of `m`; a PackedParts' parts after the first are chained by
    `next` to structures appended to `keep` (which must outlive the table)."""
    parts = list(m.parts) if isinstance(m, PackedParts) else [m]
    chained = None
    for part in reversed(parts[1:]):
        bias = part.bias.data_ptr() if part.bias is not None else None
        node = _Linear(
            _QTYPE_IDS[part.qtype], part.qweight.data_ptr(), bias, part.out_features, part.in_features, chained
        )
        keep.append(node)
        chained = ctypes.pointer(node)
    head = parts[0]
    bias = head.bias.data_ptr() if head.bias is not None else None
    return _Linear(_QTYPE_IDS[head.qtype], head.qweight.data_ptr(), bias, head.out_features, head.in_features, chained)


def _ptr(norm) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _ffn_norms(layer) -> tuple[int, int | None, int | None]:
    """(the norm before the MLP, the norms of the attention's and the MLP's outputs or None):
    a sandwich layer's (Gemma) or a pre-norm layer's."""
    post_mlp = getattr(layer, "post_feedforward_layernorm", None)
    if post_mlp is None:
        return layer.post_attention_layernorm.weight.data_ptr(), None, None
    return (
        layer.pre_feedforward_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(),
        post_mlp.weight.data_ptr(),
    )


def _act(mlp) -> tuple[int, float, float]:
    """(the native kernels' gating kind, alpha, limit) of a gated MLP (worker_svc/layers/mlp.py)."""
    return getattr(mlp, "act_kind", 0 if mlp.silu else 1), getattr(mlp, "alpha", 1.702), getattr(mlp, "limit", 7.0)


def _is_moe(mlp) -> bool:
    return hasattr(mlp, "experts")


def _plain_or_packed(m, keep: list) -> _Linear:
    """A router's description: packed, or float32 weights (qtype 0) as a GGUF file keeps them."""
    if isinstance(m, PackedLinear):
        return _linear(m, keep)
    w = m.weight.detach().contiguous()
    bias = None if m.bias is None else m.bias.detach().float().contiguous()
    keep += [w, bias]  # (the same tensors unless a copy was needed)
    return _Linear(0, w.data_ptr(), None if bias is None else bias.data_ptr(), m.out_features, m.in_features, None)


def _native_linear(m) -> bool:
    """Whether the native step reads `m`: packed, or a float32 linear on the CPU (a router)."""
    if isinstance(m, PackedLinear):
        return True
    return isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"


def _native_mlp(mlp) -> bool:
    """Whether the native step computes `mlp`: a packed gated MLP, or a mixture of packed
    experts with a float32 or packed router (and shared gate)."""
    if not _is_moe(mlp):
        return isinstance(mlp.gate_up_packed, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)
    shared = [] if mlp.shared_expert is None else [mlp.shared_expert]
    return (
        _native_linear(mlp.gate)
        and all(_native_mlp(e) for e in [*mlp.experts, *shared])
        and (mlp.shared_expert_gate is None or _native_linear(mlp.shared_expert_gate))
    )


def _moe(mlp, keep: list) -> _MoE:
    """The native description of a mixture-of-experts MLP; what it points to is appended to
    `keep`, which must outlive it."""
    experts = (_Expert * len(mlp.experts))()
    for i, e in enumerate(mlp.experts):
        experts[i] = _Expert(_linear(e.gate_up_packed, keep), _linear(e.down_proj, keep))
    act, alpha, limit = _act(mlp.experts[0])
    shared, shared_size, shared_act, shared_gate = None, 0, 0, _Linear()
    if mlp.shared_expert is not None:
        s = mlp.shared_expert
        node = _Expert(_linear(s.gate_up_packed, keep), _linear(s.down_proj, keep))
        shared, shared_size, shared_act = ctypes.pointer(node), s.down_proj.in_features, _act(s)[0]
        shared_gate = _plain_or_packed(mlp.shared_expert_gate, keep)
        keep.append(node)
    keep.append(experts)
    return _MoE(
        len(mlp.experts),
        mlp.top_k,
        int(mlp.renormalize),
        int(getattr(mlp, "softmax_after_topk", False)),
        _plain_or_packed(mlp.gate, keep),
        experts,
        mlp.experts[0].down_proj.in_features,
        act,
        alpha,
        limit,
        shared,
        shared_size,
        shared_act,
        shared_gate,
    )


def _moe_dims(layers) -> tuple[int, int, int]:
    """(experts, top k, intermediate size) the MoE scratch is sized for: each the layers' largest
    (0s when no layer is one)."""
    dims = [
        (
            m.num_experts,
            m.top_k,
            max(
                m.experts[0].down_proj.in_features,
                0 if m.shared_expert is None else m.shared_expert.down_proj.in_features,
            ),
        )
        for m in (layer.mlp for layer in layers)
        if _is_moe(m)
    ]
    return tuple(max(d[i] for d in dims) for i in range(3)) if dims else (0, 0, 0)


def _sinks(att, keep: list) -> int | None:
    sinks = getattr(att, "sinks", None)
    if sinks is None:
        return None
    sinks = sinks.detach().float().contiguous()
    keep.append(sinks)
    return sinks.data_ptr()


class FusedDecoder:
    """The native decode step of one stage's layers (see the module docstring); build with
    `FusedDecoder.for_model(model)`, which returns None where it does not apply."""

    def __init__(self, model, kernels, paged) -> None:
        self.model = model
        cfg = model.config
        self.cfg = cfg
        self._quant, self._paged = kernels, paged
        self._lib = _library()
        self._layers = list(model.model.layers.values())
        # bfloat16 weights: at batch 64 the module path (oneDNN's bf16 GEMM above
        # BF16_GEMM_MIN_ROWS rows) took 245 ms a step against 266 here; packed types gain
        # at every batch (Q4_1: 325 ms against 354 at 64, 9 against 20 at 1)
        self._bf16 = any(layer.self_attn.qkv_packed.qtype == "BF16" for layer in self._layers)
        self._table = None  # ctypes array of _Layer, rebuilt when the pools move
        self._chained: list[_Linear] = []  # the parts after the first of PackedParts (pointed to by the table)
        self._pool_ptrs: tuple[int, ...] = ()
        self._scratch = torch.empty(0)
        self._qscratch = torch.empty(0, dtype=torch.uint8)
        # the MoE layers' descriptions (built once: they do not move with the pools) and
        # everything they point to
        self._moe_keep: list = []
        self._moes = [
            ctypes.pointer(_moe(layer.mlp, self._moe_keep)) if _is_moe(layer.mlp) else None for layer in self._layers
        ]
        self._moe_dims = _moe_dims(self._layers)
        fns = kernels.function_addresses()
        # the rope/K-V write and attention kernels by pool dtype (float32, or bfloat16 pools)
        self._kfns = {
            dtype: (
                fns["quant_matmul_f32"],
                fns["bf16_matmul"],
                ctypes.cast(getattr(paged.lib, f"pagoda_rope_write_{suffix}"), _PTR).value,
                ctypes.cast(getattr(paged.lib, f"pagoda_paged_decode_{suffix}"), _PTR).value,
            )
            for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16kv"))
        }

    @classmethod
    def for_model(cls, model) -> FusedDecoder | None:
        from worker_svc.kernels.cpu_kernels import paged_decode
        from worker_svc.kernels.quant_kernels import quant_kernels

        if not enabled() or not model.model.layers:
            return None
        for layer in model.model.layers.values():
            if not layer.native_decode:
                return None
            att = layer.self_attn
            if (
                layer.reduce is not None
                or not _native_mlp(layer.mlp)
                or not all(isinstance(p, PackedLinear) for p in (att.qkv_packed, att.o_proj))
                or layer.input_layernorm.weight.dtype != torch.float32
                or layer.input_layernorm.weight.device.type != "cpu"
            ):
                return None
        quant, paged = quant_kernels(), paged_decode()
        if quant is None or paged is None:
            return None
        return cls(model, quant, paged)

    def applies(
        self, h: torch.Tensor, metadata: AttentionMetadata, kv_pools: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> bool:
        """Whether this step can go through the native call: every row a decode, float32
        activations, float32 or bfloat16 pools, one torch thread."""
        decodes, _ = metadata.split_rows()
        if self._bf16 and h.shape[0] > BF16_GEMM_MIN_ROWS:  # oneDNN's bf16 GEMM is faster there
            return False
        return (
            len(decodes) == metadata.num_seqs == h.shape[0]
            and h.dtype == torch.float32
            and kv_pools[0][0].dtype in self._kfns
            and torch.get_num_threads() == 1
        )

    def _layer_table(self, kv_pools):
        ptrs = tuple(p.data_ptr() for kv in kv_pools for p in kv)
        if ptrs != self._pool_ptrs:
            table = (_Layer * len(self._layers))()
            chained: list = []
            for i, layer in enumerate(self._layers):
                table[i] = self._layer(i, layer, kv_pools[i], chained)
            self._table, self._pool_ptrs, self._chained = table, ptrs, chained
        return self._table

    def _layer(self, i: int, layer, kv: tuple[torch.Tensor, torch.Tensor], keep: list) -> _Layer:
        """Layer `i`'s native description over its pools `kv`; what it points to (but the MoE
        description) is appended to `keep`."""
        att, mlp = layer.self_attn, layer.mlp
        norm2, post_attn, post_mlp = _ffn_norms(layer)
        moe = self._moes[i]
        gate_up, down = (
            (_Linear(), _Linear()) if moe else (_linear(mlp.gate_up_packed, keep), _linear(mlp.down_proj, keep))
        )
        act, alpha, limit = (0, 0.0, 0.0) if moe else _act(mlp)
        return _Layer(
            layer.input_layernorm.weight.data_ptr(),
            norm2,
            _linear(att.qkv_packed, keep),
            _linear(att.o_proj, keep),
            gate_up,
            down,
            kv[0].data_ptr(),
            kv[1].data_ptr(),
            _ptr(att.q_norm),
            _ptr(att.k_norm),
            post_attn,
            post_mlp,
            att.sliding_window or 0,
            att.softcap or 0.0,
            self.model.rope_index(i),
            act,
            self.model.kv_group_of(i),
            alpha,
            limit,
            _sinks(att, keep),
            moe,
        )

    def forward(
        self,
        h: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The stage's layers over decode rows `h`; `ropes`: cos/sin per kind of layer
        (`StageModel.rope_index`)."""
        cfg = self.cfg
        T = h.shape[0]
        h = h.contiguous().clone()
        cos = torch.stack([c.reshape(T, cfg.head_dim) for c, _ in ropes]).contiguous()
        sin = torch.stack([s.reshape(T, cfg.head_dim) for _, s in ropes]).contiguous()
        num_blocks, block_size = kv_pools[0][0].shape[:2]
        tables, slots, group_slots, group_tables = _tables(metadata)
        qkv = cfg.q_size + 2 * cfg.kv_size
        need = self._lib.pagoda_decode_scratch_floats(T, cfg.hidden_size, qkv, cfg.q_size, cfg.intermediate_size)
        if self._moe_dims[0]:  # (after the dense scratch)
            need += self._lib.pagoda_moe_scratch_floats(T, cfg.hidden_size, *self._moe_dims)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.q_size, self._moe_dims[2])
        qneed = self._quant.scratch_bytes(T, widest)
        if self._qscratch.numel() < qneed + 64:
            self._qscratch = torch.empty(qneed + 64, dtype=torch.uint8)
        kernels = _Kernels(
            *self._kfns[kv_pools[0][0].dtype],
            self._quant.isa_id,
            self._quant.act_bits,
            self._qscratch.data_ptr() + (-self._qscratch.data_ptr()) % 64,
        )
        shape = _Shape(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            block_size,
            num_blocks,
            tables.shape[-1],
            cfg.rms_norm_eps,
            self._layers[0].self_attn.scale,
            group_slots,
            group_tables,
        )
        rows = metadata.query_start_loc[:-1].contiguous()
        ctx = metadata.context_lens.contiguous()
        table = self._layer_table(kv_pools)
        rc = self._lib.pagoda_decode_layers(
            ctypes.byref(kernels),
            ctypes.byref(shape),
            table,
            len(self._layers),
            h.data_ptr(),
            T,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            rows.data_ptr(),
            tables.data_ptr(),
            ctx.data_ptr(),
            self._scratch.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"native decode step failed (code {rc})")
        return h


def _tables(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(tables, slots, elements between sub-groups' slots, between their tables): a grouped
    step's stacked ones, or the one table with strides 0 (every layer reads it)."""
    if metadata.group_block_tables is None:
        return metadata.block_tables.contiguous(), metadata.slot_mapping.contiguous(), 0, 0
    tables, slots = metadata.group_block_tables.contiguous(), metadata.group_slot_mapping.contiguous()
    return tables, slots, slots.shape[1], tables.shape[1] * tables.shape[2]
