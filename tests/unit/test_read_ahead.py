"""The gateway's read-ahead of scheduler responses (gateway.read_ahead): a client's
pace decides how much is held for it, and a client that stops reading for good has its
request closed downstream (issue 16: slow consumers)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.read_ahead import ConsumerStalled, read_ahead


class Source:
    """An async iterator of `n` items made as fast as they are taken (or failing after
    `fail_after`), recording how far it got and whether it was closed."""

    def __init__(self, n: int, fail_after: int | None = None) -> None:
        self.n, self.fail_after = n, fail_after
        self.made = 0
        self.closed = False

    async def items(self):
        try:
            for i in range(self.n):
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("source failed")
                self.made += 1
                yield i
                await asyncio.sleep(0)
        finally:
            self.closed = True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_items_pass_in_order_and_the_source_error_comes_after_them():
    async def go():
        got = []
        src = Source(10, fail_after=7)
        with pytest.raises(RuntimeError, match="source failed"):
            async for x in read_ahead(src.items(), 3, 1.0):
                got.append(x)
        return got, src.closed

    got, closed = run(go())
    assert got == list(range(7)) and closed


def test_a_consumer_that_stops_reading_is_cut_off_and_its_source_closed():
    async def go():
        src = Source(1000)
        it = read_ahead(src.items(), 4, 0.3)
        first = await anext(it)
        await asyncio.sleep(1.0)  # reads nothing while the buffer is full
        made_while_stalled, closed_while_stalled = src.made, src.closed
        rest = []
        with pytest.raises(ConsumerStalled):
            async for x in it:
                rest.append(x)
        return first, made_while_stalled, closed_while_stalled, rest

    first, made, closed, rest = run(go())
    assert first == 0
    assert closed, "the source is closed at the stall, not when the client comes back"
    assert made <= 1 + 4 + 1  # taken, buffered, and the one waiting for room
    assert rest == list(range(1, 1 + len(rest))) and len(rest) == 4  # what was buffered, in order


def test_a_slow_but_steady_consumer_gets_everything():
    async def go():
        src = Source(30)
        got = []
        async for x in read_ahead(src.items(), 2, 0.5):
            got.append(x)
            await asyncio.sleep(0.02)  # slower than the source, never stalled for 0.5 s
        return got

    assert run(go()) == list(range(30))


def test_no_stall_timeout_waits_for_ever_and_closing_closes_the_source():
    async def go():
        src = Source(100)
        it = read_ahead(src.items(), 2, 0)
        await anext(it)
        await asyncio.sleep(0.3)
        still_open = not src.closed
        await it.aclose()
        return still_open, src.closed

    assert run(go()) == (True, True)


def test_an_empty_source_and_a_waiting_consumer_end_cleanly():
    async def go():
        async def slow_empty():
            await asyncio.sleep(0.1)
            return
            yield  # pragma: no cover - an async generator with no items

        return [x async for x in read_ahead(slow_empty(), 2, 1.0)]

    assert run(go()) == []
