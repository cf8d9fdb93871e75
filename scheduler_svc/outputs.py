"""What a client of the engine receives: a request's outputs, one per step that gave it
tokens, and the last one with its totals; how a consumer that fell behind gets them.

The engine (`scheduler_svc.engine`) keeps one `LiveRequest` for each request it has not
ended yet: the request and the queue its outputs go out through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.core.request import FinishReason, Request
from services.pooling import Embedding


@dataclass
class ChoiceDelta:
    index: int
    token_ids: list[int]
    logprobs: list
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[ChoiceDelta]
    finished: bool = False
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: tuple[str, str] | None = None  # (grpc status name, message)
    timeline: list[dict] = field(default_factory=list)
    # on the request's first output, when prompt_logprobs was asked: per prompt token after
    # the first, (token id, logprob, rank, [(id, logprob) most likely first])
    prompt_logprobs: list | None = None
    # on a pooling request's last output, when it finished: its pooled vector
    embedding: Embedding | None = None
    # on the last output of a request whose KV is held for a decode replica (P/D): (its
    # sequence id, how many of its first blocks may be pulled)
    kv_export: tuple[int, int] | None = None


class OutputSink(Protocol):
    """Where a request's outputs go as the engine makes them: an asyncio.Queue that a task
    reads (`stream_outputs`), or a consumer that takes each at once (put_nowait must not
    block or raise)."""

    def put_nowait(self, out: RequestOutput) -> None: ...


@dataclass
class LiveRequest:
    request: Request
    outputs: OutputSink
    failures: int = 0  # micro-batches of it that failed on a stage


def final_output(
    request: Request, aborted: bool, timeline: list[dict], error: tuple[str, str] | None = None
) -> RequestOutput:
    """The request's last output, with its totals; an abort ends each choice still going
    with ABORT."""
    deltas = []
    if aborted:
        deltas = [
            ChoiceDelta(s.index, [], [], FinishReason.ABORT)
            for s in request.sequences
            if s.finish_reason in (None, FinishReason.ABORT)
        ]
    return RequestOutput(
        request.request_id,
        deltas,
        finished=True,
        num_prompt_tokens=len(request.prompt),
        num_completion_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        error=error,
        timeline=timeline,
    )


async def stream_outputs(live: LiveRequest, abort: Callable[[str], object]) -> AsyncIterator[RequestOutput]:
    """The request's outputs until its last; a consumer that goes away (the client cancelled)
    `abort`s the request if it still runs."""
    try:
        held: RequestOutput | None = None
        while True:
            out, held = (held, None) if held is not None else (await live.outputs.get(), None)
            # a consumer that fell behind gets the steps it missed as one output, not one
            # message per token (an error goes out on its own, after the tokens before it)
            while not out.finished and not live.outputs.empty():
                later = live.outputs.get_nowait()
                if later.error is not None:
                    held = later
                    break
                out = merge_outputs(out, later)
            yield out
            if out.finished:
                return
    finally:
        if live.request.state.is_live:
            abort(live.request.request_id)


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: each choice's tokens in order."""
    by_index = {d.index: d for d in first.deltas}
    for d in then.deltas:
        mine = by_index.get(d.index)
        if mine is None:
            first.deltas.append(d)
            by_index[d.index] = d
            continue
        mine.token_ids = mine.token_ids + d.token_ids
        mine.logprobs = mine.logprobs + d.logprobs
        if d.finish_reason is not None:
            mine.finish_reason, mine.stop_token_id = d.finish_reason, d.stop_token_id
    if first.prompt_logprobs is None:
        first.prompt_logprobs = then.prompt_logprobs
    if then.finished:
        first.finished = True
        first.num_prompt_tokens, first.num_completion_tokens = then.num_prompt_tokens, then.num_completion_tokens
        first.num_cached_tokens, first.num_preemptions = then.num_cached_tokens, then.num_preemptions
        first.error, first.timeline, first.embedding = then.error, then.timeline, then.embedding
    return first
