"""The stage's step thread: the one thread that touches the stage's tensors.

Micro-batches are posted to it as they are decoded (`post`: no future, no event-loop round
trip), and between them whatever else must run there — LoRA loads, KV block reads for P/D —
through `submit`, as on any executor (`loop.run_in_executor(thread, ...)`), in the order
posted. A job's exception is its future's; a posted job must catch its own (the compute loop
does): one that escapes ends the thread, and `on_death` says so.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

log = logging.getLogger(__name__)
_STOP = object()


class StepThread(Executor):
    def __init__(self, name: str, on_death: Callable[[BaseException], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.on_death = on_death
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable, *args) -> None:
        """Runs `fn(*args)` on the thread after what was posted before; nothing comes back."""
        self._jobs.put((None, fn, args))

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        if self._stopped:
            raise RuntimeError("the step thread is shut down")
        future: Future = Future()
        self._jobs.put((future, fn, (args, kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._stopped = True
        if cancel_futures:
            while True:
                try:
                    future, _, _ = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if future is not None:
                    future.cancel()
        self._jobs.put(_STOP)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args = job
            if future is None:
                try:
                    fn(*args)
                except BaseException as exc:  # a posted job's escape: the thread ends
                    log.critical("the step thread died: %s", exc)
                    if self.on_death is not None:
                        self.on_death(exc)
                    raise
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args[0], **args[1]))
            except BaseException as exc:  # noqa: BLE001 - the future carries it to the caller
                future.set_exception(exc)
