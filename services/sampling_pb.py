"""Writing the sampling fields every layer sends (`pagoda.v1.SamplingParams`, `TopLogprobs`):
the gateway to the scheduler, the scheduler to the stages, a test driver to a stage. One
place, so that the layers encode them alike."""

from __future__ import annotations

from collections.abc import Iterable


def set_penalties(params, presence_penalty: float, frequency_penalty: float,
                  repetition_penalty: float, logit_bias: Iterable[tuple[int, float]]) -> None:
    """Penalties and logit bias into a `SamplingParams` message; repetition_penalty 1.0 (off)
    stays unset, as the field's absence means."""
    params.presence_penalty = presence_penalty
    params.frequency_penalty = frequency_penalty
    if repetition_penalty != 1.0:
        params.repetition_penalty = repetition_penalty
    params.logit_bias.update(dict(logit_bias))


def set_top_logprobs(entry, token_id: int, logprob: float, rank: int,
                     top: Iterable[tuple[int, float]]) -> None:
    """One position into a `TopLogprobs` message: the token (with its rank) and the
    alternatives, most likely first (ranks 1, 2, ...)."""
    entry.sampled.token_id, entry.sampled.logprob, entry.sampled.rank = token_id, logprob, rank
    for r, (tid, lp) in enumerate(top, start=1):
        entry.top.add(token_id=tid, logprob=lp, rank=r)
