"""`pagoda export-gguf`: a GGUF file from a Hugging Face checkpoint folder, written the way
llama.cpp's convert_hf_to_gguf.py writes one, for every architecture of
worker_svc/models/registry.py:

- `general.architecture` the architecture's GGUF name (Mistral as "llama", as llama.cpp's
  converter writes it); tensor names from its `gguf_layer_tensors` (read backwards);
- `{arch}.*` hyperparameters: `attention.key_length`/`value_length` where the config names a
  `head_dim`, `rope.dimension_count` for Llama and Phi-3, linear rope scaling, the sliding
  window (Gemma 2 and 3, Phi-3: 0 for none), Gemma 2's attention and final soft-caps, Gemma
  3's global-layer rope base and final soft-cap; Phi-3's LongRoPE as llama.cpp writes it
  (`rope_factors_long`/`_short` tensors, `rope.scaling.attn_factor`,
  `rope.scaling.original_context_length`);
- q/k rows permuted for llama.cpp's rotary only where the architecture says llama.cpp does
  (`gguf_permuted_qk`: Llama, Mistral); Gemma's norms (every `*norm.weight`, q/k norms too)
  written as 1 + w (`gguf_norm_offset_stored`); Phi-3's fused `qkv_proj`/`gate_up_proj` as
  its `attn_qkv`/`ffn_up`, unsplit; a tied LM head not written;
- the tokenizer: a `gpt2` (byte-level BPE) one with its merges (llama.cpp's
  `_set_vocab_gpt2`), or a `llama` (SentencePiece-style BPE with byte fallback: Gemma) one
  with scores and piece kinds (`_set_vocab_sentencepiece`), and the chat template;
- 2-D weights in a block format (Q8_0, Q4_0, Q4_1 with the `gguf` package's reference
  quantizers; the K-quants and Q5_0/Q5_1 with worker_svc/weights/kquants_ref.py; or "Q4_K_M",
  llama.cpp's mix of them, see `tensor_type`), norms and 1-D tensors in F32.

What the file cannot say is refused (ValueError naming it): rope scalings other than linear
(and Phi-3's LongRoPE), Gemma layer layouts other than llama.cpp's fixed patterns (every 2nd
layer global for Gemma 2, every 6th for Gemma 3).

Used by the tests (GGUF files of the tiny models) and the quality benchmark (a Q8_0 file of
the real model from its float32 folder).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's converter writes a Mistral checkpoint as a Llama one
_GGUF_ARCH = {"mistral": "llama", "mixtral": "llama"}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
SLIDING, FULL = "sliding_attention", "full_attention"
# llama.cpp's fixed layouts: every `n`-th layer global (llama-model.cpp's set_swa_pattern)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def gguf_tensor_name(name: str, layer_tensors: dict[str, str]) -> str:
    """llama.cpp's name of the checkpoint tensor `name` (an architecture's
    `gguf_layer_tensors` read backwards); ValueError for one it has no name for."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 3)
    inverse = {hf: gguf for gguf, hf in layer_tensors.items()}
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in inverse:
        return f"blk.{parts[2]}.{inverse[parts[3]]}"
    raise ValueError(f"checkpoint tensor {name!r} has no GGUF name")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of what
    worker_svc/gguf_checkpoint.unpermute_rows does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's type for a weight whose rows are not whole 256-value super-blocks (llama-quant.cpp;
# Q2_K and Q3_K as before IQ4_NL)
KQUANT_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_KQUANT_WRITTEN = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "BF16", "F32")


def _use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in its _M mixes:
    the first and last eighth, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def _q4_k_m_type(gguf_name: str, num_layers: int, tied: bool) -> str:
    """llama.cpp's Q4_K_M mix (llama-quant.cpp llama_tensor_get_type): the output weight (the
    token embedding when it is the output too) Q6_K; attn_v and ffn_down Q6_K in the layers
    that get more bits; a fused attn_qkv Q5_K; the rest Q4_K."""
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        return "Q6_K"
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        return "Q4_K"
    if parts[2] == "attn_qkv":
        return "Q5_K"
    if parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and _use_more_bits(int(parts[1]), num_layers):
        return "Q6_K"
    return "Q4_K"


def tensor_type(gguf_name: str, cols: int, qtype: str, num_layers: int, tied: bool = False) -> str:
    """The type a 2-D weight of `cols` columns is written in for `qtype`: "Q4_K_M" is llama.cpp's
    mix (`_q4_k_m_type`; `tied`: the token embedding is the output weight too), and a K-quant
    falls back as llama.cpp's does for rows that are not whole super-blocks (Q4_K -> Q5_0,
    Q6_K -> Q8_0, ...); "F32" when even that does not fit."""
    if "ffn_gate_inp" in gguf_name:  # llama.cpp never quantizes a router
        return "F32"
    if qtype == "Q4_K_M":
        qtype = _q4_k_m_type(gguf_name, num_layers, tied)
    if qtype in KQUANT_FALLBACK and cols % 256:
        qtype = KQUANT_FALLBACK[qtype]
    return qtype if cols % 32 == 0 else "F32"


def _quantize(t: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    if qtype in _KQUANT_WRITTEN:
        import torch

        from worker_svc.weights.kquants_ref import quantize

        return quantize(torch.from_numpy(np.ascontiguousarray(t)), qtype).numpy()
    return gguf.quants.quantize(t, getattr(gguf.GGMLQuantizationType, qtype))


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str = "Q8_0") -> Path:
    """`out` (a .gguf file) from the checkpoint folder `model_dir`; 2-D weights in `qtype`
    (one of QTYPES; see `tensor_type`; a weight whose rows are not whole blocks of any fitting
    type stays F32). ValueError for what a GGUF file cannot say (see the module docstring)."""
    import gguf
    from safetensors.numpy import load_file

    from worker_svc.models.registry import architecture_of_config

    if qtype not in QTYPES:
        raise ValueError(f"GGUF type {qtype!r} is not written; choose one of {', '.join(QTYPES)}")
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = architecture_of_config(cfg, str(model_dir / "config.json"))
    if arch.model_type not in _GGUF_ARCH and not arch.gguf_names:
        raise ValueError(f"{arch.model_type}: not written as GGUF yet")
    name = _GGUF_ARCH.get(arch.model_type) or arch.gguf_names[0]
    tensors = {arch.model_name(n): t for n, t in load_file(str(model_dir / "model.safetensors")).items()}
    _refuse_unwritable(arch.model_type, cfg)
    w = gguf.GGUFWriter(str(out), name)
    w.add_name(model_dir.name)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}", None) or (
        gguf.LlamaFileType.ALL_F32 if qtype == "F32" else None
    )
    if file_type is not None:
        w.add_file_type(int(file_type))
    _write_hparams(w, name, arch.model_type, cfg)
    _write_vocab(w, model_dir, cfg)
    _write_tensors(w, arch, cfg, stack_experts(tensors), qtype)
    for tensor_name, t in _extra_tensors(arch.model_type, cfg).items():
        w.add_tensor(tensor_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _rope(cfg: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """The (global layers') rotary parameters of a transformers 4 or 5 `config.json`:
    `rope_theta`, `rope_type` and the scaling's fields."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params:  # transformers 5, one entry per layer type (Gemma 3)
        params = params[FULL]
    merged = {**(cfg.get("rope_scaling") or {}), **params}
    merged.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    merged["rope_type"] = merged.get("rope_type", merged.get("type")) or "default"
    return merged


def _refuse_unwritable(model_type: str, cfg: dict[str, Any]) -> None:
    """ValueError for a checkpoint whose GGUF file would be read as another model: a rope
    scaling llama.cpp does not write as metadata, Gemma layer layouts or attention scales
    other than llama.cpp's fixed ones."""
    from worker_svc.models.gemma2 import gguf_query_pre_attn_scalar

    rope = _rope(cfg)
    allowed = ("default", "linear", "longrope") if model_type == "phi3" else ("default", "linear")
    if rope["rope_type"] not in allowed:
        raise ValueError(
            f"rope scaling {rope['rope_type']!r} of a {model_type} checkpoint is not written "
            f"to GGUF (written: {', '.join(allowed[1:])})"
        )
    pattern = _GEMMA_PATTERN.get(model_type)
    if not pattern:
        return
    types = cfg.get("layer_types")
    if types and types != [SLIDING if (i + 1) % pattern else FULL for i in range(len(types))]:
        raise ValueError(
            f"{model_type} layer_types {types} are not llama.cpp's layout (every {pattern}th "
            "layer global): a GGUF file cannot say them"
        )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    want = gguf_query_pre_attn_scalar(model_type, {**cfg, "head_dim": head_dim})
    if cfg.get("query_pre_attn_scalar", 256) != want:
        raise ValueError(
            f"{model_type} query_pre_attn_scalar {cfg.get('query_pre_attn_scalar', 256)} is not the "
            f"{want} llama.cpp attends with for this shape: a GGUF file cannot say it"
        )


def _extra_tensors(model_type: str, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter generates beside the checkpoint's: Phi-3's LongRoPE
    factors."""
    rope = _rope(cfg)
    if model_type != "phi3" or rope["rope_type"] != "longrope":
        return {}
    return {
        "rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32),
    }


def _write_hparams(w, name: str, model_type: str, cfg: dict[str, Any]) -> None:
    """The `{arch}.*` hyperparameters (convert_hf_to_gguf.py's TextModel.set_gguf_parameters
    and each model's additions)."""
    import gguf

    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    gemma3 = model_type == "gemma3_text"
    rope = _rope(cfg, 1_000_000.0 if gemma3 else 10000.0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 131072 if gemma3 else 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim") or model_type in ("gemma2", "gemma3_text"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if name in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if model_type in ("gemma2", "gemma3_text"):
        _write_gemma(w, model_type, cfg)
    if model_type == "phi3":
        _write_phi3(w, cfg, rope)
    if model_type in ("qwen3_moe", "mixtral"):  # llama.cpp's MoE keys (Mixtral's expert size: the FFN's)
        w.add_expert_count(int(cfg.get("num_experts") or cfg["num_local_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's experts as llama.cpp writes them: one 3-D tensor per projection
    (`mlp.experts.gate_proj.weight` [experts, rows, columns], named `ffn_gate_exps`), in
    expert order; every other tensor as it is."""
    out: dict[str, np.ndarray] = {}
    from worker_svc.models.base import EXPERT_TENSOR

    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        m = EXPERT_TENSOR.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
    for name, parts in stacks.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"{name}: experts {sorted(parts)} are not 0..{len(parts) - 1}")
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def _write_phi3(w, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    """Phi3MiniModel's additions: the window (0: none), the original context and LongRoPE's
    attention factor (its factors are tensors, `_extra_tensors`)."""
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    original = int(
        rope.get("original_max_position_embeddings")
        or cfg.get("original_max_position_embeddings")
        or cfg.get("max_position_embeddings", 4096)
    )
    w.add_rope_scaling_orig_ctx_len(original)
    if rope["rope_type"] == "longrope":
        scale = cfg.get("max_position_embeddings", original) / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        w.add_rope_scaling_attn_factors(factor)


def _write_gemma(w, model_type: str, cfg: dict[str, Any]) -> None:
    """Gemma2Model's soft-caps and window; Gemma3Model's final soft-cap (it has no attention
    cap) and window (none where every layer is global)."""
    if model_type == "gemma2" and cfg.get("attn_logit_softcapping") is not None:
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window") and cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern")) != 1:
        w.add_sliding_window(int(cfg["sliding_window"]))


def _write_vocab(w, model_dir: Path, cfg: dict[str, Any]) -> None:
    """The tokenizer as llama.cpp's converter writes it: a byte-level BPE (`gpt2`,
    `_set_vocab_gpt2`: tokens, types, merges) or a SentencePiece-style BPE with byte fallback
    (`llama`, `_set_vocab_sentencepiece`: tokens, scores, types, no merges: Gemma, Llama 2,
    Mistral), then the special ids, whether BOS is added, and the chat template."""
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
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    sentencepiece = bool(tok["model"].get("byte_fallback"))
    if sentencepiece:
        _sentencepiece_vocab(w, tokens, special, tok["model"].get("unk_token"))
    else:
        _byte_level_vocab(w, tokens, special, tok["model"]["merges"])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(int(cfg["bos_token_id"]))
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    # (a byte-level vocabulary's BOS is the chat template's business, as llama.cpp writes it)
    w.add_add_bos_token(sentencepiece and bool(tcfg.get("add_bos_token", True)))
    template = tcfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)


def _byte_level_vocab(w, tokens: list[str], special: set[int], merges: list) -> None:
    import gguf

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])


def _sentencepiece_vocab(w, tokens: list[str], special: set[int], unk: str | None) -> None:
    """Pieces in id order with SentencePiece's kinds (byte pieces `<0xXX>` BYTE, the unknown
    piece UNKNOWN, special ones CONTROL) and scores falling with the id, as a BPE model's
    pieces rank (a reader rebuilds the merges from them)."""
    import gguf

    def kind(i: int, t: str) -> int:
        if t == unk:
            return gguf.TokenType.UNKNOWN
        if i in special:
            return gguf.TokenType.CONTROL
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return gguf.TokenType.BYTE
        return gguf.TokenType.NORMAL

    types = [kind(i, t) for i, t in enumerate(tokens)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) if k == gguf.TokenType.NORMAL else 0.0 for i, k in enumerate(types)])
    w.add_token_types(types)
    if unk is not None and unk in tokens:
        w.add_unk_token_id(tokens.index(unk))


def _write_tensors(w, arch, cfg: dict[str, Any], tensors: dict[str, np.ndarray], qtype: str) -> None:
    """Each checkpoint tensor under its GGUF name, permuted / offset as llama.cpp writes it and
    in its type (`tensor_type`); a tied LM head (always Gemma's) is not written."""
    import gguf

    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    tied = bool(cfg.get("tie_word_embeddings", arch.gguf_norm_offset_stored))
    for name, t in tensors.items():
        if name == "lm_head.weight" and (tied or arch.gguf_norm_offset_stored):
            continue
        gname = gguf_tensor_name(name, arch.gguf_layer_tensors)
        t = t.astype(np.float32)
        if arch.gguf_permuted_qk and ".self_attn.q_proj." in name:
            t = _permute(t, heads)
        elif arch.gguf_permuted_qk and ".self_attn.k_proj." in name:
            t = _permute(t, kv_heads)
        if arch.gguf_norm_offset_stored and name.endswith("norm.weight"):
            t = t + np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) scale
        # 2-D weights and stacked experts (3-D: each expert's rows, one after another)
        kind = tensor_type(gname, t.shape[-1], qtype, cfg["num_hidden_layers"], tied) if t.ndim >= 2 else "F32"
        if kind != "F32":
            blocks = _quantize(t.reshape(-1, t.shape[-1]), kind)
            w.add_tensor(
                gname,
                blocks.reshape(*t.shape[:-1], blocks.shape[-1]),
                raw_dtype=getattr(gguf.GGMLQuantizationType, kind),
            )
        else:
            w.add_tensor(gname, t)
