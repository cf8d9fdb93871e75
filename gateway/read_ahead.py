"""A request's scheduler responses read ahead of its client, within bounds: the client's pace,
not the scheduler's, decides how much the gateway holds, and a client that stops reading for
good has its request aborted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class ConsumerStalled(Exception):
    """The client read nothing while its request's read-ahead stayed full for the stall
    timeout: the request was aborted downstream (its blocks freed)."""


_WAKE = object()


async def read_ahead(source: AsyncIterator[T], capacity: int, stall_s: float) -> AsyncIterator[T]:
    """`source`'s items, read into a buffer of at most `capacity` ahead of the consumer, so
    that the consumer's pace, not the source's, decides how much is held. When the buffer
    stays full for `stall_s` seconds (0: never) the source is closed at once (cancelling
    the call behind it) and, once the consumer has taken what the buffer holds,
    ConsumerStalled is raised. The source's own error is raised in its place in the order.
    Closing this iterator closes the source."""
    queue: asyncio.Queue = asyncio.Queue(capacity)
    outcome: list[BaseException | None] = []  # set when the source is done: None, or why not

    async def pump() -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    if queue.full() and stall_s:
                        try:
                            await asyncio.wait_for(queue.put(item), stall_s)
                        except TimeoutError:
                            outcome.append(ConsumerStalled())
                            return  # leaving the block closes the source
                    else:
                        await queue.put(item)
            outcome.append(None)
        except Exception as exc:  # the consumer raises it after the items before it
            outcome.append(exc)
        finally:
            if not queue.full():  # a consumer waiting on an empty queue wakes up
                queue.put_nowait(_WAKE)

    task = asyncio.create_task(pump())
    try:
        while True:
            if queue.empty() and outcome:
                if outcome[0] is not None:
                    raise outcome[0]
                return
            item = await queue.get()
            if item is not _WAKE:
                yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
