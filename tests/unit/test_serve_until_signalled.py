"""`serve_until_signalled`, the end of every server's main: the ready file (whole or absent,
written once the server is ready), SIGTERM/SIGINT, a second signal, and a stop the server
asks for itself."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.grpc_utils import serve_until_signalled, write_ready_file


def test_write_ready_file_writes_the_port_whole_and_leaves_nothing_beside_it(tmp_path):
    ready = tmp_path / "ready"
    ready.write_text("stale")
    write_ready_file(str(ready), 50051)
    assert ready.read_text() == "50051\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ready"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_it_after_the_ready_file_is_written(tmp_path, sig):
    ready = tmp_path / "ready"
    seen: list[bool] = []

    async def starting() -> None:
        await asyncio.sleep(0.01)
        seen.append(ready.exists())  # not ready before `starting` is done

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: seen.append(ready.read_text() == "1234\n"))
        loop.call_later(0.1, os.kill, os.getpid(), sig)
        return await asyncio.wait_for(serve_until_signalled(port=1234, ready_file=str(ready), starting=starting()), 5)

    assert asyncio.run(main()) is True
    assert seen == [False, True]


def test_the_servers_own_stop_ends_it_without_a_signal():
    async def main() -> bool:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.02, stop.set)  # e.g. a stage's fatal error
        return await asyncio.wait_for(serve_until_signalled(stop=stop), 5)

    assert asyncio.run(main()) is True


def test_a_second_signal_calls_on_second_signal():
    calls: list[str] = []

    async def main() -> bool:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def starting() -> None:  # signalled twice while still starting
            os.kill(os.getpid(), signal.SIGINT)
            while not stop.is_set():
                await asyncio.sleep(0.01)
            assert calls == []
            os.kill(os.getpid(), signal.SIGTERM)
            while not calls:
                await asyncio.sleep(0.01)

        loop.call_later(5, stop.set)  # (a bound, should the signals go astray)
        return await serve_until_signalled(stop=stop, on_second_signal=lambda: calls.append("now"), starting=starting())

    assert asyncio.run(main()) is True
    assert calls == ["now"]


def test_a_task_that_ends_first_ends_it_unstopped(tmp_path):
    async def main() -> tuple[bool, bool]:
        stop = asyncio.Event()
        until = asyncio.ensure_future(asyncio.sleep(0.02))  # e.g. a REST server that could not start
        stopped = await asyncio.wait_for(serve_until_signalled(stop=stop, until=until), 5)
        return stopped, stop.is_set()

    assert asyncio.run(main()) == (False, False)


def test_a_ready_file_needs_a_port(tmp_path):
    with pytest.raises(ValueError, match="port"):
        asyncio.run(serve_until_signalled(ready_file=str(tmp_path / "ready")))
    assert not (tmp_path / "ready").exists()


def test_sigusr1_logs_every_task_and_serves_on(caplog):
    """`kill -USR1` on a service: what each of its asyncio tasks waits on, in the log."""

    async def waiting_for_something() -> None:
        await asyncio.Event().wait()

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        waiter = asyncio.create_task(waiting_for_something(), name="the-waiter")
        loop.call_later(0.05, os.kill, os.getpid(), signal.SIGUSR1)
        loop.call_later(0.2, stop.set)
        stopped = await asyncio.wait_for(serve_until_signalled(stop=stop), 5)
        waiter.cancel()
        return stopped

    with caplog.at_level("WARNING", logger="services.grpc_utils"):
        assert asyncio.run(main()) is True
    dumped = "\n".join(r.getMessage() for r in caplog.records if "SIGUSR1" in r.getMessage())
    assert "waiting_for_something" in dumped and "the-waiter" in dumped
