"""Point-to-point hand-offs between two stages with torch.distributed (issue 37's GPU channel):
NCCL between the stages' GPUs, as vLLM's pipeline sends its intermediate tensors; gloo
between CPU stages, which is how the protocol is tested without a GPU.

A link is a process group of two, rank 0 the sending stage, rank 1 the receiving one, made
without a global world (each stage is its own process, already in its own tensor-parallel
group): the sender hosts a TCPStore and offers its address (`OpenDataPlane`); both sides
build the group against it at once (its construction waits for the other). Then:

- the sender writes the micro-batch (with a `HiddenRef`: the link, a sequence number, dtype
  and shape) on the Forward stream and posts the tensor's `send` on the link's one thread;
- the receiver, as each reference arrives and in arrival order (whatever becomes of the
  plan, so that sends and receives stay paired), posts a `recv` into a new tensor on the
  link's one thread; the step waits for it before computing.

Sends and receives pair up in order (one thread each side, one stream of references), which
the sequence number checks. A link belongs to one Forward stream: when the stream breaks,
both sides drop it (a pending operation fails within the group's timeout) and the next
connection offers a new one.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.execution.stage_ring import RingRef

TIMEOUT = timedelta(seconds=30)  # building the group; an operation whose peer is gone


class LinkError(RuntimeError):
    """A hand-off on the link failed (its peer went away, or the pairing broke)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _group(backend: str, store: dist.Store, rank: int, device: torch.device):
    """A two-rank group on `store`, outside any default group (blocks until both ranks join)."""
    if backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


class _Thread:
    """One daemon thread running calls in order: an operation whose peer is gone blocks it
    until the group's timeout, never the process's exit."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)


class _Link:
    def __init__(self, link_id: int, backend: str, device: torch.device) -> None:
        self.link_id, self.backend, self.device = link_id, backend, device
        self.group = None
        self.store = None  # the sender's TCPStore (the receiver's lives in its group)
        self._thread = _Thread(f"p2p-{link_id}")
        self.seq = 0

    def close(self) -> None:
        """Let go of the group (and the store) on the link's own thread, after its queued
        operations: torch's c10d objects must not outlive the process's last moments (a store's
        thread destroyed at interpreter exit aborts it)."""
        self._thread.submit(self._release)
        self._thread.close()

    def _release(self) -> None:
        self.group = None
        self.store = None


class SendLink(_Link):
    """Rank 0: hosts the store; `join()` (the group) runs beside the offer's call."""

    _ids = itertools.count(1)

    def __init__(self, host: str, device: torch.device) -> None:
        super().__init__((os.getpid() << 20) + next(self._ids), backend_for(device), device)
        self.store = dist.TCPStore(host, 0, 2, True, wait_for_workers=False, timeout=TIMEOUT)
        self.address = f"{advertised(host)}:{self.store.port}"

    def join(self) -> Future:
        return self._thread.submit(self._join)

    def _join(self) -> None:
        self.group = _group(self.backend, dist.PrefixStore(f"link-{self.link_id}/", self.store), 0, self.device)

    def send(self, t: torch.Tensor) -> tuple[RingRef, Future]:
        """Post `t`'s send (after every earlier one); its reference for the message."""
        self.seq += 1
        ref = RingRef(self.link_id, 0, self.seq, t.dtype, tuple(t.shape))
        t = t.to(self.device).contiguous()
        return ref, self._thread.submit(self._send, t)

    def _send(self, t: torch.Tensor) -> None:
        try:
            self.group.send([t], 1, 0).wait()
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise their own kinds
            raise LinkError(f"send to the next stage failed: {exc}") from exc


class RecvLink(_Link):
    """Rank 1: joins the sender's store."""

    def __init__(self, link_id: int, address: str, backend: str, device: torch.device) -> None:
        super().__init__(link_id, backend, device)
        self.address = address

    def join(self) -> Future:
        """Connect to the store and join the group, on the link's thread (never the event loop's)."""
        return self._thread.submit(self._join)

    def _join(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address {self.address!r} is not HOST:PORT")
        store = dist.TCPStore(host, int(port), 2, False, timeout=TIMEOUT)
        self.group = _group(self.backend, dist.PrefixStore(f"link-{self.link_id}/", store), 1, self.device)

    def recv(self, ref: RingRef) -> Future:
        """Post the receive of the reference's tensor (after every earlier one)."""
        self.seq += 1
        if ref.seq != self.seq:
            raise LinkError(f"hand-off {ref.seq} on link {self.link_id}, expected {self.seq}: the pairing broke")
        return self._thread.submit(self._recv, ref)

    def _recv(self, ref: RingRef) -> torch.Tensor:
        t = torch.empty(ref.shape, dtype=ref.dtype, device=self.device)
        try:
            self.group.recv([t], 0, 0).wait()
        except Exception as exc:  # noqa: BLE001
            raise LinkError(f"receive from the previous stage failed: {exc}") from exc
        return t


def advertised(host: str) -> str:
    """The address the next stage reaches this one at: the bind address, or this host's name
    when bound to every interface."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host
