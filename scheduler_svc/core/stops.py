"""What a step's sampled tokens do to a sequence: they join its output up to the first that
finishes it. A stop token (the request's, or end-of-sequence unless ignored) finishes it once
`min_tokens` were generated; `max_tokens` and the context length finish it whatever the token.
"""

from __future__ import annotations

from scheduler_svc.core.request import FinishReason, Sequence


def append_sampled(seq: Sequence, sampled: list[tuple[int, object]], max_model_len: int) -> tuple[list[int], list]:
    """A step's tokens (several after a verify step) join the sequence's output, up to the
    first that finishes it; returns the tokens and logprobs taken."""
    new_tokens, new_logprobs = [], []
    for token, logprob in sampled:
        seq.output.append(token)
        seq.logprobs.append(logprob)
        new_tokens.append(token)
        new_logprobs.append(logprob)
        reason = finish_reason(seq, token, max_model_len)
        if reason is not None:
            seq.finish_reason = reason
            if reason == FinishReason.STOP:
                seq.stop_token_id = token
            break
    return new_tokens, new_logprobs


def finish_reason(seq: Sequence, token: int, max_model_len: int) -> FinishReason | None:
    """Why the sequence ends with `token` just appended, or None."""
    options = seq.request.options
    if len(seq.output) > options.min_tokens:  # stops are masked before min_tokens
        if token in options.stop_token_ids:
            return FinishReason.STOP
        if not options.ignore_eos and token in seq.request.eos_token_ids:
            return FinishReason.STOP
    if len(seq.output) >= options.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
