"""A shared-memory ring of one stage pair: hidden states handed from stage K to stage K+1 on
one host without going through protobuf (issue 37's data plane).

The sender (stage K) creates the ring, a file in /dev/shm, and offers it over the gRPC
connection it already holds (`OpenDataPlane`); the receiver maps it and checks the random
token the sender wrote in its header (so it mapped the sender's memory, not a namesake), then
the sender unlinks the file: nothing is left behind however the processes end
(worker_svc/execution/shm_collectives.py does the same for tensor-parallel ranks).

Layout: a header page (magic, token, sizes), one 64-byte control line per slot
(`published`, `released`: int64 message numbers), then `num_slots` data slots of
`slot_bytes`, page-aligned. A slot is free when `released == published`.

- `RingWriter.try_write(t)` claims a free slot, copies `t` into it, then stores the slot's
  new `published` number (after the data: x86 keeps stores in order, so a reader that sees
  the number sees the bytes) and returns a `RingRef` for the micro-batch message; None when
  every slot is taken. The sender waits (polls, with a timeout) instead of growing the ring:
  back-pressure on the faster stage.
- `RingReader.view(ref)` checks the slot holds that number and returns the tensor in place
  (no copy); `release(ref)` hands the slot back once the step that read it is done. Slots
  are released in any order (a failed micro-batch releases its own), and the writer never
  touches a slot that is not released, so a reader never sees a half-written one.

A ring belongs to one connection: when the stream to the next stage breaks, the sender drops
it (slots whose references were lost with the stream would never come back) and offers a new
one with the next connection; a restarted stage maps a new ring too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import secrets
import struct
import threading
from dataclasses import dataclass

import torch

from worker_svc.execution import shm_collectives

MAGIC = 0x314752_414447_50  # arbitrary, versioned by its last digit
_HEADER_BYTES = 4096
_LINE = 64  # one control line per slot: published, released (int64), padded
_PAGE = 4096
_HEADER = struct.Struct("<qqq16s")  # magic, num_slots, slot_bytes, token
DEFAULT_NUM_SLOTS = 4  # micro-batches in flight between two stages seldom pass 4; a fifth waits
MAX_SLOT_BYTES = 16 << 20  # larger hand-offs (long prefills of wide models) go over gRPC


def available() -> bool:
    """The ring relies on x86's store order (as shm_collectives) and on /dev/shm."""
    return shm_collectives.available()


def slot_bytes_for(max_tokens: int, hidden_size: int, max_slot_bytes: int = MAX_SLOT_BYTES) -> int:
    """A slot that holds `max_tokens` rows of float32 hidden states, page-rounded, at most
    `max_slot_bytes` (larger steps go over gRPC)."""
    want = max_tokens * hidden_size * 4
    return min(-(-want // _PAGE) * _PAGE, max_slot_bytes)


@dataclass(frozen=True)
class RingRef:
    """Where one hand-off lies: `slot` holds message `seq` of ring `ring_id`."""

    ring_id: int
    slot: int
    seq: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class RingFullError(TimeoutError):
    """The receiver released no slot within the timeout: it stopped reading."""


class _Ring:
    """The mapping both sides share (header, control lines, slots)."""

    def __init__(self, path: str, num_slots: int, slot_bytes: int, create: bool) -> None:
        if num_slots < 1 or slot_bytes < 1 or slot_bytes % _PAGE:
            raise ValueError(f"a ring needs slots (got {num_slots}) of whole pages (got {slot_bytes} bytes)")
        self.path, self.num_slots, self.slot_bytes = path, num_slots, slot_bytes
        self._data_offset = -(-(_HEADER_BYTES + num_slots * _LINE) // _PAGE) * _PAGE
        self.total_bytes = self._data_offset + num_slots * slot_bytes
        self._map = shm_collectives.map_file(path, self.total_bytes, create, reserve=create)
        # [published, released, pad x6] per slot, read and written in place
        self._lines = memoryview(self._map)[_HEADER_BYTES : _HEADER_BYTES + num_slots * _LINE].cast("q")
        self._bytes = torch.frombuffer(
            self._map, dtype=torch.uint8, offset=self._data_offset, count=num_slots * slot_bytes
        )
        self._views: dict[tuple, torch.Tensor] = {}  # a step reuses a few shapes: views made once

    def published(self, slot: int) -> int:
        return self._lines[slot * 8]

    def released(self, slot: int) -> int:
        return self._lines[slot * 8 + 1]

    def slot_tensor(self, slot: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
        key = (slot, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            start = slot * self.slot_bytes
            view = self._views[key] = self._bytes[start : start + nbytes].view(dtype).view(shape)
        return view

    def check(self) -> None:
        """Every slot's numbers make sense: released <= published, both >= 0."""
        for s in range(self.num_slots):
            assert 0 <= self.released(s) <= self.published(s), (s, self.released(s), self.published(s))


class RingWriter(_Ring):
    """The sender's side: creates the file (the receiver maps it, then the sender unlinks it).
    `try_write` is called from the compute thread and from the event loop: a lock makes each
    claim of a slot whole."""

    _ids = itertools.count(1)

    def __init__(self, num_slots: int, slot_bytes: int, path: str | None = None) -> None:
        path = path or shm_collectives.new_path("pp")
        try:
            super().__init__(path, num_slots, slot_bytes, create=True)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        self.token = secrets.token_bytes(16)
        self.ring_id = (os.getpid() << 20) + next(self._ids)
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, num_slots, slot_bytes, self.token)
        self._seq = 0
        self._lock = threading.Lock()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes  # (a GPU's copied out by `try_write`)

    def num_free(self) -> int:
        return sum(self.released(s) == self.published(s) for s in range(self.num_slots))

    def try_write(self, t: torch.Tensor) -> RingRef | None:
        """Copy `t` (on the CPU, at most a slot) into a free slot and publish it; None when
        every slot is taken (the receiver has not released them yet)."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            slot = next((s for s in range(self.num_slots) if self.released(s) == self.published(s)), None)
            if slot is None:
                return None
            self._seq += 1
            seq = self._seq
            if nbytes:
                self.slot_tensor(slot, t.dtype, tuple(t.shape), nbytes).copy_(t)
            self._lines[slot * 8] = seq  # after the data: a reader that sees it sees them
        return RingRef(self.ring_id, slot, seq, t.dtype, tuple(t.shape))


class RingReader(_Ring):
    """The receiver's side: maps the sender's file and checks its header."""

    def __init__(self, path: str, ring_id: int, token: bytes, num_slots: int, slot_bytes: int) -> None:
        super().__init__(path, num_slots, slot_bytes, create=False)
        self.ring_id = ring_id
        magic, slots, size, found = _HEADER.unpack(self._map[: _HEADER.size])
        if magic != MAGIC or slots != num_slots or size != slot_bytes:
            raise ValueError(f"{path} is not the offered ring (magic {magic:#x}, {slots} slots of {size} bytes)")
        if found != token:
            raise ValueError(f"{path}: its token is not the offered one (another host's or process's file)")

    def view(self, ref: RingRef) -> torch.Tensor:
        """The hand-off's tensor, in place in its slot (valid until `release`). ValueError when
        the reference does not name a published slot of this ring that holds it."""
        if ref.ring_id != self.ring_id:
            raise ValueError(f"hidden states in ring {ref.ring_id}, this stage maps ring {self.ring_id}")
        if not 0 <= ref.slot < self.num_slots:
            raise ValueError(f"ring slot {ref.slot} out of range [0, {self.num_slots})")
        if any(d < 0 for d in ref.shape) or ref.nbytes > self.slot_bytes:
            raise ValueError(f"hidden states of shape {list(ref.shape)} do not fit a {self.slot_bytes}-byte slot")
        published = self.published(ref.slot)
        if published != ref.seq or self.released(ref.slot) == published:
            raise ValueError(
                f"ring slot {ref.slot} holds message {published} "
                f"({'released' if self.released(ref.slot) == published else 'unread'}), "
                f"not message {ref.seq}"
            )
        return self.slot_tensor(ref.slot, ref.dtype, ref.shape, ref.nbytes)

    def release(self, ref: RingRef) -> None:
        """The step that read the slot is done with it: the writer may reuse it."""
        if self.published(ref.slot) == ref.seq:
            self._lines[ref.slot * 8 + 1] = ref.seq
