"""Collectives of a stage's tensor-parallel ranks through shared memory (CPU, one host).

gloo's all-reduce over loopback costs milliseconds between two processes on a small machine
(`bench/tp_collectives.py`, figures in docs/benchmarks.md), and a decode step makes
two per layer. The ranks of a stage share a host, so they can meet in
memory instead, as vLLM-cpu's tensor parallelism does (its shared-memory all-reduce):

- `all_reduce(x)`: each rank copies its partial into its slot of the current buffer
  (two, alternating), publishes the operation's number in its flag, waits until every
  flag has reached that number, then sums the slots in rank order (so every rank gets the
  same bits). A rank reuses a buffer two operations later, by when every rank has left
  the operation that read it (it published the number of the next one).
- `put` / `get`: rank 0 writes a step's inputs in the payload area before it tells the
  others (one small gloo broadcast, on which idle ranks block without spinning); they read
  them from there. Rank 0 writes the next step's only after every rank joined this step's
  first all-reduce, i.e. after they read it.

Waits spin with `sched_yield` (a peer in the same step arrives within microseconds to
milliseconds) and give up after `timeout_s`. Stores to the flags follow the data they
publish; x86's memory model keeps that order for readers (other architectures: gloo).
Tensors larger than a slot go through gloo; the decision depends only on the tensor's
size, so every rank takes the same path.

The memory is a file in /dev/shm that rank 0 creates and unlinks once every rank has
mapped it: nothing is left behind, however the processes end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import time
from pathlib import Path

import torch

SLOT_BYTES = 4 << 20  # the largest all-reduce through memory: 4 MiB (decode batches)
PAYLOAD_BYTES = 16 << 20  # a step's inputs (its hidden states included) up to this size
_FLAGS = 64  # int64 flags, one per rank (at most 8 ranks), in one cache line


def available() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def new_path(kind: str) -> str:
    """A fresh file name in /dev/shm for `kind` ("tp": these collectives, "pp": a stage pair's
    ring, worker_svc/execution/stage_ring.py); files of processes that are gone (killed between
    creating and unlinking theirs) are removed first."""
    for stale in Path("/dev/shm").glob(f"pagoda-{kind}-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale.unlink(missing_ok=True)
    return f"/dev/shm/pagoda-{kind}-{os.getpid()}-{secrets.token_hex(6)}"


def map_file(path: str, total: int, create: bool, reserve: bool = False) -> mmap.mmap:
    """Map `total` bytes of the file at `path`, creating it (exclusively, owner-only) when
    `create`; `reserve`: take its memory now (posix_fallocate), so that a /dev/shm too small
    fails here with OSError instead of with SIGBUS at the first write past its room."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, total)
            if reserve:
                os.posix_fallocate(fd, 0, total)
        elif os.fstat(fd).st_size < total:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, fewer than {total}")
        return mmap.mmap(fd, total)
    finally:
        os.close(fd)


class ShmCollectives:
    def __init__(self, rank: int, size: int, path: str, create: bool, timeout_s: float = 300.0) -> None:
        self.rank, self.size, self.path, self.timeout_s = rank, size, path, timeout_s
        self.total = _FLAGS + 2 * size * SLOT_BYTES + PAYLOAD_BYTES
        self._map = map_file(path, self.total, create)
        self._flag_list = memoryview(self._map)[: 8 * size].cast("q")  # int64 flags, read in place
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=_FLAGS, count=2 * size * SLOT_BYTES)
        self._payload = torch.frombuffer(
            self._map, dtype=torch.uint8, offset=_FLAGS + 2 * size * SLOT_BYTES, count=PAYLOAD_BYTES
        )
        self.seq = 0
        self._views: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def new_path() -> str:
        return new_path("tp")

    def unlink(self) -> None:
        """Rank 0, once every rank has mapped it: the memory lives until the last unmaps."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # --- all-reduce ------------------------------------------------------------------------

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` over the ranks in place (the caller checked `fits`)."""
        self.seq += 1
        parity = self.seq & 1
        key = (parity, x.dtype, tuple(x.shape))
        slots = self._views.get(key)
        if slots is None:  # the views of a shape are made once (a step reuses a few shapes)
            if len(self._views) > 256:
                self._views.clear()
            nbytes, first = x.numel() * x.element_size(), parity * self.size
            slots = self._views[key] = [
                self._slots[(first + r) * SLOT_BYTES : (first + r) * SLOT_BYTES + nbytes].view(x.dtype).view(x.shape)
                for r in range(self.size)
            ]
        slots[self.rank].copy_(x)
        self._flag_list[self.rank] = self.seq  # after the data: a reader that sees it sees them
        self._wait(self.seq)
        torch.add(slots[0], slots[1], out=x)
        for r in range(2, self.size):
            x.add_(slots[r])

    def _wait(self, seq: int) -> None:
        flags, deadline = self._flag_list, None
        while min(flags) < seq:
            os.sched_yield()
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel ranks did not all reach all-reduce {seq} within "
                    f"{self.timeout_s:.0f} s (flags {flags.tolist()})"
                )

    # --- a step's inputs ---------------------------------------------------------------------

    def put(self, parts: list[torch.Tensor]) -> bool:
        """Rank 0: write these tensors one after the other in the payload area; False when
        they do not fit (then they go through gloo)."""
        sizes = [p.numel() * p.element_size() for p in parts]
        if sum(sizes) > PAYLOAD_BYTES:
            return False
        offset = 0
        for p, n in zip(parts, sizes, strict=True):
            self._payload[offset : offset + n].view(p.dtype).view(p.shape).copy_(p)
            offset += n
        return True

    def get(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """The other ranks: copies of what rank 0 `put`, by shape and dtype."""
        out, offset = [], 0
        for shape, dtype in shapes:
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            out.append(self._payload[offset : offset + n].view(dtype).view(shape).clone())
            offset += n
        return out
