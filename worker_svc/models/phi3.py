"""Phi-3 / Phi-3.5 / Phi-4 (dense, full rotary): Llama's layer, whose checkpoint holds q, k
and v in one `qkv_proj` and gate and up in one `gate_up_proj` (llama.cpp: `attn_qkv`,
`ffn_up`); the loader reads each part's rows, so the layer, its fusing, tensor parallelism
and LoRA see q/k/v and gate/up as everywhere else. LongRoPE scaling
(worker_svc/layers/rotary.py); the window of `sliding_window` on every layer."""

from __future__ import annotations

from worker_svc.models.base import LLAMA_GGUF_LAYER_TENSORS, Architecture


class Phi3(Architecture):
    model_type = "phi3"
    hf_names = ("Phi3ForCausalLM",)
    gguf_names = ("phi3",)
    fused_tensors = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }
    gguf_layer_tensors = {
        **{
            k: v
            for k, v in LLAMA_GGUF_LAYER_TENSORS.items()
            if not k.startswith(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"))
        },
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    }
