"""A stage's data plane (issue 37): the channel its hidden states take to the next stage.

The control plane (plans, results) is protobuf over gRPC; the activations take the fastest
channel the two stages share, chosen when the sender connects (`--stage-channel`):

- "shm": a shared-memory ring of the pair (worker_svc/execution/stage_ring.py), on one
  host. The sender offers it (`OpenDataPlane`) before it opens the Forward stream; the
  micro-batch then carries a `HiddenRef` (ring, slot, sequence number, dtype, shape), never
  the bytes. A hand-off larger than a slot still goes in the message.
- "grpc": the bytes in the message (`MicroBatch.hidden_states`), across hosts, and the
  fallback whenever the ring cannot be made or mapped (another host, no /dev/shm, a
  receiver set to grpc or too old to know the call).
- "auto" (the default): shm where the receiver takes it, else grpc. "shm" insists: a
  refused offer fails the hand-off (UNAVAILABLE, with the reason) instead of falling back.

`DataPlaneOut` is the sender's side (one per stage but the last), `DataPlaneIn` the
receiver's (every stage but the first). Both report the channel in use (StageStats,
StageLoadInfo.data_channel).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import grpc
import torch

from services.pb import worker_pb2
from worker_svc.checkpoints.convert import dtype_from_pb, dtype_to_pb, tensor_from_pb, tensor_to_pb
from worker_svc.errors import InvalidPlanError
from worker_svc.execution import stage_ring
from worker_svc.execution.stage_ring import RingFullError, RingReader, RingRef, RingWriter

log = logging.getLogger(__name__)
CHANNELS = ("auto", "shm", "grpc")
RING_WAIT_S = 60.0  # a ring full this long: the next stage stopped reading (a hung stage)
_RING_PATH = re.compile(r"/dev/shm/pagoda-pp-\d+-[0-9a-f]+")


class DataPlaneError(Exception):
    """The hand-off cannot take the channel it must (a refused offer under "shm", a ring
    dropped with its stream): the micro-batch fails with UNAVAILABLE."""


def ref_to_pb(ref: RingRef, out: worker_pb2.HiddenRef) -> None:
    out.ring_id, out.slot, out.seq, out.dtype = ref.ring_id, ref.slot, ref.seq, dtype_to_pb(ref.dtype)
    del out.shape[:]
    out.shape.extend(ref.shape)


def ref_from_pb(msg: worker_pb2.HiddenRef) -> RingRef:
    return RingRef(msg.ring_id, msg.slot, msg.seq, dtype_from_pb(msg.dtype), tuple(msg.shape))


class DataPlaneOut:
    """The sender's channel to the next stage. `ring` is set while an offer was taken on the
    current connection; `pack` (compute thread) and `place` (event loop) put a step's hidden
    states into the ring or the message."""

    def __init__(self, setting: str, stage: int, slot_bytes: int,
                 num_slots: int = stage_ring.DEFAULT_NUM_SLOTS, wait_s: float = RING_WAIT_S) -> None:
        if setting not in CHANNELS:
            raise ValueError(f"stage_channel: must be one of {', '.join(CHANNELS)}, got {setting!r}")
        self.setting, self.stage, self.slot_bytes, self.num_slots = setting, stage, slot_bytes, num_slots
        self.wait_s = wait_s
        self.ring: RingWriter | None = None
        self.channel = ""  # "shm" or "grpc" once connected
        self.num_full_waits = 0
        self.num_shm_sent = 0
        self.num_grpc_sent = 0

    async def connect(self, stub, timeout_s: float = 5.0) -> None:
        """Offer the ring (unless set to grpc) on a new connection; grpc when refused.
        DataPlaneError when refused under "shm"."""
        self.drop()
        why = "--stage-channel grpc" if self.setting == "grpc" else await self._offer(stub, timeout_s)
        self.channel = "grpc" if why else "shm"
        if why and self.setting == "shm":
            raise DataPlaneError(f"the shared-memory channel to the next stage was refused: {why}")
        if why:
            log.info("hidden states to the next stage go over gRPC: %s", why)
        else:
            log.info("hidden states to the next stage go through shared memory (%d slots of %d bytes)",
                     self.num_slots, self.slot_bytes)

    async def _offer(self, stub, timeout_s: float) -> str:
        """The reason the ring was not taken, or "" when it was."""
        if not stage_ring.available():
            return "no shared memory here (x86-64 with /dev/shm)"
        try:
            ring = RingWriter(self.num_slots, self.slot_bytes)
        except (OSError, ValueError) as exc:
            return f"no ring of {self.num_slots} x {self.slot_bytes} bytes: {exc}"
        offer = worker_pb2.DataPlaneOffer(
            sender_stage=self.stage, channel=worker_pb2.DATA_CHANNEL_SHM, path=ring.path, token=ring.token,
            ring_id=ring.ring_id, num_slots=ring.num_slots, slot_bytes=ring.slot_bytes)
        try:
            reply = await stub.OpenDataPlane(offer, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"the next stage answered the offer with {exc.code().name}: {exc.details()}"
        finally:
            ring.unlink()  # mapped by both sides now (or never will be)
        if reply.channel != worker_pb2.DATA_CHANNEL_SHM:
            return reply.reason or "the next stage refused it"
        self.ring = ring
        return ""

    def drop(self) -> None:
        """The connection ended: its ring goes with it (a reference lost in the stream would
        hold its slot forever); the next connection offers a new one."""
        self.ring = None
        self.channel = ""

    def pack(self, t: torch.Tensor, mb: worker_pb2.MicroBatch) -> torch.Tensor | None:
        """Compute thread: `t` into a free ring slot (a reference in `mb`) or into `mb` itself.
        Returns the tensor while `place` may still need it (in the ring, or waiting for a slot)."""
        ring = self.ring
        if ring is None and not self.channel:
            return t  # not connected yet: `place` puts it where the connection says
        if ring is None or not ring.fits(t):
            tensor_to_pb(t, mb.hidden_states)
            return None
        ref = ring.try_write(t.contiguous())
        if ref is not None:
            ref_to_pb(ref, mb.hidden_ref)
        return t

    async def place(self, t: torch.Tensor | None, mb: worker_pb2.MicroBatch) -> None:
        """Event loop, on the connection the message goes out on: what `pack` left undone (a
        full ring: wait for a slot), or done on a connection since dropped (again, here)."""
        ring = self.ring
        if t is not None:
            if mb.HasField("hidden_ref") and ring is not None and mb.hidden_ref.ring_id == ring.ring_id:
                pass
            elif ring is not None and ring.fits(t):
                mb.ClearField("hidden_ref")
                ref_to_pb(await self._write_when_free(ring, t.contiguous()), mb.hidden_ref)
            else:
                mb.ClearField("hidden_ref")
                tensor_to_pb(t, mb.hidden_states)
        if mb.HasField("hidden_ref"):
            self.num_shm_sent += 1
        else:
            self.num_grpc_sent += 1

    async def _write_when_free(self, ring: RingWriter, t: torch.Tensor) -> RingRef:
        """Back-pressure: wait until the receiver releases a slot (polling, 50 us to 5 ms);
        RingFullError after `wait_s`, DataPlaneError when the ring is dropped meanwhile."""
        deadline, delay, waited = time.monotonic() + self.wait_s, 50e-6, False
        while True:
            ref = ring.try_write(t)
            if ref is not None:
                return ref
            if ring is not self.ring:
                raise DataPlaneError("the stream to the next stage broke while its ring was full")
            if not waited:
                self.num_full_waits, waited = self.num_full_waits + 1, True
            if time.monotonic() > deadline:
                raise RingFullError(f"the next stage released no slot of its ring ({ring.num_slots} slots) "
                                    f"within {self.wait_s:.0f} s: it stopped reading")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5e-3)


class DataPlaneIn:
    """The receiver's side: the ring the previous stage offered (the newest one: a restarted
    or reconnected sender offers a new ring, which replaces the old), and a step's hidden
    states from a micro-batch."""

    def __init__(self, setting: str) -> None:
        if setting not in CHANNELS:
            raise ValueError(f"stage_channel: must be one of {', '.join(CHANNELS)}, got {setting!r}")
        self.setting = setting
        self.ring: RingReader | None = None
        self.channel = ""  # how the last micro-batch's hidden states came

    def accept(self, offer: worker_pb2.DataPlaneOffer) -> worker_pb2.DataPlaneReply:
        why = self._refusal(offer)
        if why is None:
            try:
                self.ring = RingReader(offer.path, offer.ring_id, offer.token, offer.num_slots, offer.slot_bytes)
            except (OSError, ValueError) as exc:
                why = f"could not map {offer.path}: {exc}"
        if why is not None:
            log.info("refused stage %d's shared-memory ring: %s", offer.sender_stage, why)
            return worker_pb2.DataPlaneReply(channel=worker_pb2.DATA_CHANNEL_GRPC, reason=why)
        log.info("stage %d hands hidden states on through shared memory (%d slots of %d bytes)",
                 offer.sender_stage, offer.num_slots, offer.slot_bytes)
        return worker_pb2.DataPlaneReply(channel=worker_pb2.DATA_CHANNEL_SHM)

    def _refusal(self, offer: worker_pb2.DataPlaneOffer) -> str | None:
        if self.setting == "grpc":
            return "this stage is set to --stage-channel grpc"
        if offer.channel != worker_pb2.DATA_CHANNEL_SHM:
            return f"channel {offer.channel} is not offered by shared memory"
        if not stage_ring.available():
            return "no shared memory here (x86-64 with /dev/shm)"
        if not _RING_PATH.fullmatch(offer.path):
            return f"{offer.path!r} is not a stage ring's file"
        return None

    def hidden(self, mb: worker_pb2.MicroBatch) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The micro-batch's hidden states and, when they lie in the ring (read in place), the
        call that hands the slot back once the step is done. InvalidPlanError when absent or
        not where the reference says."""
        if mb.HasField("hidden_ref"):
            ring = self.ring
            ref = ref_from_pb(mb.hidden_ref)
            if ring is None:
                raise InvalidPlanError(f"micro-batch {mb.micro_batch_id}: hidden states in ring {ref.ring_id}, "
                                       "but this stage took no ring")
            try:
                t = ring.view(ref)
            except ValueError as exc:
                raise InvalidPlanError(f"micro-batch {mb.micro_batch_id}: {exc}") from None
            self.channel = "shm"
            return t, lambda: ring.release(ref)
        if mb.HasField("hidden_states"):
            self.channel = "grpc"
            return tensor_from_pb(mb.hidden_states), None
        raise InvalidPlanError(f"micro-batch {mb.micro_batch_id}: no hidden states")
