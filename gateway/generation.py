"""A generation as the front doors see it: the validated request (`GenerationParams`), what
streams back (`ChoiceDelta` with its `TokenLogprob`s, then one `Finished` with its `Usage`)
and the scheduler's refusal (`GenerationError`). `TextGenerator` (gateway/core.py) makes
them; the REST and gRPC front doors and the formatters read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from gateway.chat_parsing import ReplyParsing
from gateway.tools import ToolCalling
from services.sampling import SamplingOptions


class GenerationError(Exception):
    """The scheduler refused or failed a request: carries its gRPC status for the HTTP mapping."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class GenerationParams:
    """A request as the front doors validated it: its sampling, in the one type every layer
    shares (`SamplingOptions`; `max_tokens` None = the rest of the context), and what only
    the gateway acts on (stop strings, detokenization, routing)."""

    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions(max_tokens=None))
    stop: tuple[str, ...] = ()
    priority: int = 0
    tenant: str = ""
    debug_timeline: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # max_tokens 0: the prompt is computed (and scored when asked); the one token the engine
    # samples after it is not returned
    prompt_only: bool = False
    # chat with tools: how the output becomes tool calls (gateway.tools)
    tool_calling: ToolCalling | None = None
    # chat replies read by the server's parsers (auto tool calls, reasoning): their markers
    # are decoded even when they are special tokens (gateway.chat_parsing)
    reply_parsing: ReplyParsing | None = None
    # routing across replicas: requests with one session key go to one replica (`user`, or
    # the x-session-id header)
    session: str = ""
    lora_name: str = ""  # multi-LoRA: the adapter it runs under ("": the base model)


class TopToken(NamedTuple):
    """One of the likeliest tokens at a position. `token` is its decode on its own (U+FFFD where
    it holds only part of a character, special tokens spelled out); `token_bytes` the bytes it
    stands for, None where they are the UTF-8 of `token`."""

    token_id: int
    token: str
    logprob: float
    token_bytes: bytes | None = None


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the likeliest alternatives, most likely first
    (plain `(token_id, token, logprob)` tuples become `TopToken`s). `token` and `token_bytes`
    as in `TopToken`."""

    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: list[TopToken] = field(default_factory=list)
    token_bytes: bytes | None = None
    rank: int | None = None  # 1-based, where the scheduler sent it (prompt tokens)

    def __post_init__(self) -> None:
        self.top = [TopToken(*t) for t in self.top]


@dataclass
class ChoiceDelta:
    """New text of one choice; `finish_reason` set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's stop_reason: the stop string, or the requested stop token id (stop_token_ids),
    # that ended the choice; None for the model's EOS and for any other end
    stop_reason: str | int | None = None
    # on each choice's first delta when params.sampling.prompt_logprobs was set: one entry per prompt
    # token, the first with logprob None (nothing precedes it)
    prompt_logprobs: list[TokenLogprob] | None = None
    # the stop token that ended the choice, EOS included (the public gRPC API reports it)
    stop_token_id: int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Finished:
    """The end of a request's stream."""

    usage: Usage
    timeline: list = field(default_factory=list)
