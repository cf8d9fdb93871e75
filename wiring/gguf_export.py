"""`pagoda export-gguf`: a GGUF file from a Hugging Face checkpoint folder, written the way
llama.cpp's converter writes one: `{arch}.*` hyperparameters, a `gpt2` (byte-level BPE)
tokenizer with its merges and chat template, Llama's q/k rows permuted for llama.cpp's
rotary embedding, 2-D weights in a block format (Q8_0, Q4_0, Q4_1, quantized with the `gguf`
package's reference quantizers; the K-quants and Q5_0/Q5_1 with worker_svc/kquants_ref.py, or
"Q4_K_M", llama.cpp's mix of them) and the norms in F32.

Used by the tests (GGUF files of the tiny models) and the quality benchmark (a Q8_0 file of
the real model from its float32 folder); byte-level BPE tokenizers only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of what
    worker_svc/gguf_checkpoint.unpermute_rows does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's type for a weight whose rows are not whole 256-value super-blocks (llama-quant.cpp;
# Q2_K and Q3_K as before IQ4_NL)
KQUANT_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_KQUANT_WRITTEN = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in its _M mixes:
    the first and last eighth, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_type(gguf_name: str, cols: int, qtype: str, num_layers: int) -> str:
    """The type a 2-D weight of `cols` columns is written in for `qtype`: "Q4_K_M" is llama.cpp's
    mix (output.weight Q6_K; attn_v and ffn_down Q6_K in the layers that get more bits, else
    Q4_K; the rest Q4_K), and a K-quant falls back as llama.cpp's does for rows that are not
    whole super-blocks (Q4_K -> Q5_0, Q6_K -> Q8_0, ...); "F32" when even that does not fit."""
    if qtype == "Q4_K_M":
        qtype = "Q4_K"
        parts = gguf_name.split(".")
        if gguf_name == "output.weight" or (parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down")
                                            and _use_more_bits(int(parts[1]), num_layers)):
            qtype = "Q6_K"
    if qtype in KQUANT_FALLBACK and cols % 256:
        qtype = KQUANT_FALLBACK[qtype]
    return qtype if cols % 32 == 0 else "F32"


def _quantize(t: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    if qtype in _KQUANT_WRITTEN:
        import torch

        from worker_svc.kquants_ref import quantize

        return quantize(torch.from_numpy(np.ascontiguousarray(t)), qtype).numpy()
    return gguf.quants.quantize(t, getattr(gguf.GGMLQuantizationType, qtype))


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str = "Q8_0") -> Path:
    """`out` (a .gguf file) from the checkpoint folder `model_dir`; 2-D weights in `qtype`
    (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, "Q4_K_M", F32 or BF16; see `tensor_type`; a
    weight whose rows are not whole blocks of any fitting type stays F32)."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    for t in tok.get("added_tokens", []):
        if t["id"] >= len(tokens):
            tokens.extend([""] * (t["id"] + 1 - len(tokens)))
        tokens[t["id"]] = t["content"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(int(cfg["bos_token_id"]))
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    w.add_add_bos_token(False)
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = tcfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = t.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, kv_heads)
        kind = tensor_type(_gguf_name(name), t.shape[1], qtype, cfg["num_hidden_layers"]) if t.ndim == 2 else "F32"
        if kind != "F32":
            w.add_tensor(_gguf_name(name), _quantize(t, kind), raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
