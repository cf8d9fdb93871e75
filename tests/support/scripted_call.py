"""A scripted `Scheduler.Generate` call for gateway tests that stand in for the scheduler's
stub: it yields its responses, then raises its error (if any); `done()` and `cancel()` as a
grpc.aio call has them."""

from __future__ import annotations


class ScriptedCall:
    def __init__(self, responses, error: Exception | None = None) -> None:
        self.responses, self.error, self._done = responses, error, False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for resp in self.responses:
            yield resp
        self._done = True
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True


def script_scheduler(generator, stub) -> None:
    """Puts a scripted scheduler `stub` where the TextGenerator's one scheduler replica keeps
    its connection's stub (the gateway has no hook of its own for tests)."""
    generator._replicas.replicas[0].stub = stub
