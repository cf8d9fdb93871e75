"""Admission: one check of a request's sampling against the model's and the server's limits,
for every door a request comes in by (the gateway's REST and gRPC front doors, the
scheduler's server, and its engine, which `LLM.generate` enters by directly).

`SamplingOptions` checks each value on its own; `admit` checks what depends on the prompt,
the model and the configuration: the context left for max_tokens, n, logprobs, token ids
inside the vocabulary, and whether the request could ever fit in the KV pool. Each door
names the field its own way (`AdmissionError.field`, `.index`).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.defaults import BLOCK_SIZE
from services.sampling import SamplingOptions


@dataclass(frozen=True)
class Limits:
    """What a request is admitted against; a door sets what it knows (0 or None: not checked)."""

    max_model_len: int
    vocab_size: int = 0  # token ids (stop_token_ids, logit_bias) must be below it
    max_n: int | None = None  # choices per request (the gateway's max_n, the scheduler's max_num_seqs)
    max_logprobs: int | None = None  # alternatives per position (logprobs, prompt_logprobs)
    num_kv_blocks: int = 0  # the KV pool a request's blocks must fit in at once
    block_size: int = BLOCK_SIZE


class AdmissionError(ValueError):
    """A request refused: `field` ("prompt", or the `SamplingOptions` field), `index` (the
    token id's position in a list field, or None) and `reason`. `context_length`: what it
    exceeds is the model's context (the REST API's code context_length_exceeded)."""

    def __init__(self, field: str, reason: str, index: int | None = None,
                 context_length: bool = False) -> None:
        self.field, self.reason, self.index, self.context_length = field, reason, index, context_length
        self.path = field if index is None else f"{field}[{index}]"
        super().__init__(f"{self.path}: {reason}")


def kv_blocks_needed(prompt_len: int, n: int, max_tokens: int, block_size: int) -> int:
    """The most KV blocks a request can hold at once. One choice: its whole context. Several:
    the prompt's blocks (shared), and each choice's output plus its copy of the prompt's
    partial last block."""
    if n == 1:
        return -(-(prompt_len + max_tokens) // block_size)
    return -(-prompt_len // block_size) + n * (-(-max_tokens // block_size) + 1)


def admit(options: SamplingOptions, limits: Limits, num_prompt_tokens: int) -> SamplingOptions:
    """The request's options as admitted, `max_tokens` None resolved to the rest of the context
    (the scheduler keeps that; the gateway sends None on). AdmissionError naming the field."""
    _check_counts(options, limits)
    _check_token_ids(options, limits.vocab_size)
    room = limits.max_model_len - num_prompt_tokens
    if room < 1:
        raise AdmissionError("prompt", f"{num_prompt_tokens} tokens leave no room to generate under "
                                       f"max_model_len={limits.max_model_len}", context_length=True)
    if options.max_tokens is not None and options.max_tokens > room:
        raise AdmissionError("max_tokens", f"{num_prompt_tokens} prompt tokens + {options.max_tokens} "
                                           f"exceed max_model_len={limits.max_model_len}; ask for at most "
                                           f"{room}", context_length=True)
    options = options.resolve_max_tokens(room)
    if limits.num_kv_blocks:
        needed = kv_blocks_needed(num_prompt_tokens, options.n, options.max_tokens, limits.block_size)
        if needed > limits.num_kv_blocks:  # it could never run: it would wait forever
            raise AdmissionError("max_tokens", f"{num_prompt_tokens} prompt tokens and {options.n} x "
                                               f"{options.max_tokens} output tokens need up to {needed} KV "
                                               f"blocks; the pool has {limits.num_kv_blocks}")
    return options


def _check_counts(options: SamplingOptions, limits: Limits) -> None:
    if limits.max_n is not None and options.n > limits.max_n:
        raise AdmissionError("n", f"at most {limits.max_n}, got {options.n}")
    if limits.max_logprobs is not None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(options, name)
            if value is not None and value > limits.max_logprobs:
                raise AdmissionError(name, f"at most {limits.max_logprobs}, got {value}")


def _check_token_ids(options: SamplingOptions, vocab_size: int) -> None:
    if not vocab_size:
        return
    for i, token_id in enumerate(options.stop_token_ids):
        if token_id >= vocab_size:
            raise AdmissionError("stop_token_ids", f"token id {token_id} is outside the vocabulary "
                                                   f"of {vocab_size} tokens", index=i)
    for token_id, _ in options.logit_bias:
        if token_id >= vocab_size:
            raise AdmissionError("logit_bias", f"token id {token_id} is outside the vocabulary of "
                                               f"{vocab_size} tokens")
