"""Hugging Face `transformers` as the correctness reference, with the project's tie rule.

Greedy output through Pagoda must equal `transformers`' greedy `generate`. Where Pagoda's
token differs, transformers' logit for Pagoda's token must be within `TIE_TOLERANCE` of
its maximum at that step; the comparison then continues by re-running transformers from
Pagoda's prefix. `compare` reports how many such tie divergences a sequence took.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TIE_TOLERANCE = 1e-4


@dataclass
class Comparison:
    tie_divergences: int


class HFReference:
    def __init__(self, model_dir: str | Path, gguf_file: str | Path | None = None, **config: Any) -> None:
        """`gguf_file`: transformers reads (and dequantizes) that GGUF file instead; `config`:
        fields its GGUF reader does not take from the file, or (a folder) what `from_pretrained`
        is told (stated where used)."""
        from transformers import AutoModelForCausalLM

        if gguf_file is not None:
            gguf_file = Path(gguf_file)
            self.model = AutoModelForCausalLM.from_pretrained(
                str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32, **config
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **config)
        self.model.eval()
        self._cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation and the raw logits of each step (cached)."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            self._cache[key] = (tokens, [step[0].float() for step in out.logits])
        return self._cache[key]

    def compare(self, prompt: list[int], got: list[int], tolerance: float = TIE_TOLERANCE) -> Comparison:
        """Assert `got` is transformers' greedy continuation of `prompt` under the tie rule,
        with ties within `tolerance` (a path whose logits are known to move by more than
        float32 rounding, such as packed weights' integer kernels, states its own)."""
        divergences = 0
        prefix = list(prompt)
        i = 0
        while i < len(got):
            want, logits = self.greedy(prefix, len(got) - i)
            for j, (g, w) in enumerate(zip(got[i:], want, strict=True)):
                if g == w:
                    continue
                step = logits[j]
                gap = float(step.max() - step[g])
                assert gap <= tolerance, (
                    f"prompt of {len(prompt)} tokens, output position {i + j}: Pagoda gave {g}, "
                    f"transformers {w}; logit gap {gap:.3g} > {tolerance}"
                )
                divergences += 1
                prefix = prefix + got[i : i + j + 1]
                i += j + 1
                break
            else:
                return Comparison(divergences)
        return Comparison(divergences)
