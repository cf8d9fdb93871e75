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

    def __init__(self, field: str, reason: str, index: int | None = None, context_length: bool = False) -> None:
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


def max_tokens_that_fit(prompt_len: int, n: int, num_blocks: int, block_size: int) -> int:
    """The most output tokens each choice may ask for with every block of the request in a pool
    of `num_blocks` at once (`kv_blocks_needed`'s inverse); below 1: not even one fits."""
    if n == 1:
        return num_blocks * block_size - prompt_len
    return ((num_blocks - -(-prompt_len // block_size)) // n - 1) * block_size


def admit(options: SamplingOptions, limits: Limits, num_prompt_tokens: int) -> SamplingOptions:
    """The request's options as admitted, `max_tokens` None resolved to the rest of the context
    (the scheduler keeps that; the gateway sends None on), or to what the KV pool holds when
    that is less. AdmissionError naming the field."""
    _check_counts(options, limits)
    _check_token_ids(options, limits.vocab_size)
    room = limits.max_model_len - num_prompt_tokens
    if room < 1:
        raise AdmissionError(
            "prompt",
            f"{num_prompt_tokens} tokens leave no room to generate under max_model_len={limits.max_model_len}",
            context_length=True,
        )
    if options.max_tokens is not None and options.max_tokens > room:
        raise AdmissionError(
            "max_tokens",
            f"{num_prompt_tokens} prompt tokens + {options.max_tokens} "
            f"exceed max_model_len={limits.max_model_len}; ask for at most "
            f"{room}",
            context_length=True,
        )
    if limits.num_kv_blocks:  # a request that could never run would wait forever
        return _fit_in_pool(options, limits, num_prompt_tokens, room)
    return options.resolve_max_tokens(room)


def admit_pooling(options: SamplingOptions, limits: Limits, num_prompt_tokens: int) -> SamplingOptions:
    """A pooling (embedding) request's options as admitted (`services.pooling`): one choice,
    and a prompt of at most max_model_len tokens (nothing is generated after it) whose blocks
    fit the KV pool at once. Nothing is sampled, so the rest of `options` is dropped: the
    result asks for one token, which is never sampled. AdmissionError naming the field."""
    if options.n != 1:
        raise AdmissionError("n", f"a pooling (embedding) request has one choice, got {options.n}")
    if num_prompt_tokens > limits.max_model_len:
        raise AdmissionError(
            "prompt", f"{num_prompt_tokens} tokens exceed max_model_len={limits.max_model_len}", context_length=True
        )
    needed = -(-num_prompt_tokens // limits.block_size)
    if limits.num_kv_blocks and needed > limits.num_kv_blocks:
        raise AdmissionError(
            "prompt",
            f"the prompt's {num_prompt_tokens} tokens need {needed} KV blocks of "
            f"{limits.block_size} tokens; the pool has {limits.num_kv_blocks}",
            context_length=True,
        )
    return SamplingOptions(n=1, max_tokens=1)


def _fit_in_pool(options: SamplingOptions, limits: Limits, num_prompt_tokens: int, room: int) -> SamplingOptions:
    """The options when the request fits in the KV pool at once; AdmissionError naming what
    does not fit: the prompt itself, its n choices, or the max_tokens asked for."""
    blocks, block_size, n = limits.num_kv_blocks, limits.block_size, options.n
    fit = max_tokens_that_fit(num_prompt_tokens, n, blocks, block_size)
    if fit < 1:
        least = kv_blocks_needed(num_prompt_tokens, n, 1, block_size)
        pool = f"the pool has {blocks} ({blocks * block_size} tokens)"
        if max_tokens_that_fit(num_prompt_tokens, 1, blocks, block_size) >= 1:
            raise AdmissionError(
                "n", f"{n} choices of the prompt's {num_prompt_tokens} tokens need at least {least} KV blocks; {pool}"
            )
        raise AdmissionError(
            "prompt",
            f"the prompt's {num_prompt_tokens} tokens need {least} KV blocks of "
            f"{block_size} tokens with one token to generate; {pool}",
            context_length=True,
        )
    if options.max_tokens is None:  # the rest of the context, as far as the pool holds it
        return options.resolve_max_tokens(min(room, fit))
    if options.max_tokens > fit:
        needed = kv_blocks_needed(num_prompt_tokens, n, options.max_tokens, block_size)
        raise AdmissionError(
            "max_tokens",
            f"{num_prompt_tokens} prompt tokens and {n} x {options.max_tokens} "
            f"output tokens need up to {needed} KV blocks; the pool has "
            f"{blocks}: ask for at most {fit}",
        )
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
            raise AdmissionError(
                "stop_token_ids", f"token id {token_id} is outside the vocabulary of {vocab_size} tokens", index=i
            )
    for token_id, _ in options.logit_bias:
        if token_id >= vocab_size:
            raise AdmissionError("logit_bias", f"token id {token_id} is outside the vocabulary of {vocab_size} tokens")
