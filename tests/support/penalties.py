"""The reference for penalties and logit bias: `transformers` logits, processed as the
definitions say, checked position by position against what Pagoda generated.

Definitions (vLLM's, OpenAI's for presence/frequency): logit bias is added first; then a
token in the prompt or the output so far has its logit divided by `repetition_penalty`
when positive, multiplied when negative; then `frequency_penalty * count` and
`presence_penalty * (count > 0)` are subtracted, counting the output only.
"""

from __future__ import annotations

import torch

from support.reference import TIE_TOLERANCE


def processed(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    *,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    logit_bias=None,
) -> torch.Tensor:
    """One step's scores (float64) after bias and penalties, written from the definitions."""
    scores = logits.double().clone()
    for token, bias in (logit_bias or {}).items():
        scores[int(token)] += bias
    for token in set(prompt) | set(output):
        scores[token] = scores[token] / repetition if scores[token] > 0 else scores[token] * repetition
    for token in set(output):
        scores[token] -= frequency * output.count(token) + presence
    return scores


@torch.inference_mode()
def check_greedy(model, prompt: list[int], got: list[int], **penalties) -> int:
    """Assert that each generated token is the reference's argmax (within the tie tolerance)
    given the prefix Pagoda generated; returns the number of ties taken."""
    ids = torch.tensor([prompt + got])
    logits = model(input_ids=ids).logits[0].float()  # [len, vocab]
    ties = 0
    for i, token in enumerate(got):
        scores = processed(logits[len(prompt) + i - 1], prompt, got[:i], **penalties)
        gap = float(scores.max() - scores[token])
        assert gap <= TIE_TOLERANCE, (
            f"output position {i}: Pagoda gave {token}, the reference {int(scores.argmax())} "
            f"(gap {gap:.3g}) with {penalties}"
        )
        ties += int(scores.argmax()) != token
    return ties
