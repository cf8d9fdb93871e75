"""PEFT LoRA adapters for the tiny test models, and peft's merged model as the reference.

`make_adapter` builds an adapter with `peft` itself (`LoraConfig`, `get_peft_model`) and
writes it with `save_pretrained(..., safe_serialization=True)`, as a trained adapter is
published. peft starts B at zero (an adapter that changes nothing); here A and B are both
random, B scaled so that each adapted module's delta has a standard deviation of about
`delta_std` on unit inputs, large enough that every adapter moves the logits well past the
comparisons' tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch


def make_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int,
    target_modules: Sequence[str] | str,
    lora_alpha: float = 16,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    delta_std: float = 0.3,
    safe_serialization: bool = True,
) -> str:
    """A random LoRA adapter of the checkpoint in `model_dir`, saved by peft in `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=target_modules if isinstance(target_modules, str)
        else list(target_modules), use_rslora=use_rslora, rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {}, lora_dropout=0.0, bias="none",
    )  # fmt: skip
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "default" not in getattr(module, "lora_A", {}):
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight  # [r, in], [out, r]
            rank, scaling = a.shape[0], module.scaling["default"]
            a.copy_(torch.randn(a.shape, generator=generator) / math.sqrt(a.shape[1]))
            b.copy_(torch.randn(b.shape, generator=generator) * delta_std / (math.sqrt(rank) * scaling))
    model.save_pretrained(str(out_dir), safe_serialization=safe_serialization)
    return str(out_dir)


def merged_model(model_dir: str | Path, adapter_dir: str | Path | None = None):
    """transformers' float32 model of `model_dir`, with the adapter merged into its weights
    by peft (`merge_and_unload`) when one is given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


@torch.inference_mode()
def reference_logits(model, tokens: Sequence[int]) -> torch.Tensor:
    """The model's logits at every position of one sequence: [len(tokens), vocab], float32."""
    return model(torch.tensor([list(tokens)])).logits[0].float()


@torch.inference_mode()
def check_greedy(model, prompt: Sequence[int], got: Sequence[int], tie: float = 1e-4) -> None:
    """`got` is the model's greedy continuation of `prompt`, but where the model's top two
    logits are within `tie` (then either token is right, and it continues from `got`'s)."""
    tokens = list(prompt)
    for j, g in enumerate(got):
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
        want = int(logits.argmax())
        assert g == want or float(logits.max() - logits[g]) <= tie, (list(prompt), j, g, want)
        tokens.append(g)


@torch.inference_mode()
def pooled_last(model, prompt: Sequence[int]) -> torch.Tensor:
    """The model's final hidden state (after the final norm) at the prompt's last token,
    L2-normalized: `/v1/embeddings`' LAST pooling."""
    hidden = model(torch.tensor([list(prompt)]), output_hidden_states=True).hidden_states[-1][0]
    return torch.nn.functional.normalize(hidden[-1].float(), dim=-1)
