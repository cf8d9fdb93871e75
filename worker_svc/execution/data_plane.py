"""A stage's data plane (issue 37): the channel its hidden states take to the next stage.

The control plane (plans, results) is protobuf over gRPC; the activations take the fastest
channel the two stages share, chosen when the sender connects (`--stage-channel`):

- "shm": a shared-memory ring of the pair (worker_svc/execution/stage_ring.py), on one
  host. The sender offers it (`OpenDataPlane`) before it opens the Forward stream; the
  micro-batch then carries a `HiddenRef` (ring, slot, sequence number, dtype, shape), never
  the bytes. A hand-off larger than a slot still goes in the message.
- "nccl": torch.distributed point-to-point between the two stages
  (worker_svc/execution/p2p_link.py): NCCL between GPUs, gloo between CPU stages (how the
  protocol is tested here). The message carries a `HiddenRef` naming the link.
- "grpc": the bytes in the message (`MicroBatch.hidden_states`), across hosts, and the
  fallback whenever the ring cannot be made or mapped (another host, no /dev/shm, a
  receiver set to grpc or too old to know the call).
- "auto" (the default): on a GPU nccl where the receiver takes it (another GPU), then shm,
  then grpc; on the CPU shm, then grpc. "shm" and "nccl" insist: a refused offer fails the
  hand-off (UNAVAILABLE, with the reason) instead of falling back.

`DataPlaneOut` is the sender's side (one per stage but the last), `DataPlaneIn` the
receiver's (every stage but the first). Both report the channel in use (StageStats,
StageLoadInfo.data_channel).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import torch

from services.pb import worker_pb2
from worker_svc.checkpoints.convert import dtype_from_pb, dtype_to_pb, tensor_from_pb, tensor_to_pb
from worker_svc.errors import InvalidPlanError
from worker_svc.execution import stage_ring
from worker_svc.execution.p2p_link import LinkError, RecvLink, SendLink, backend_for
from worker_svc.execution.stage_ring import RingFullError, RingReader, RingRef, RingWriter

log = logging.getLogger(__name__)
CHANNELS = ("auto", "shm", "nccl", "grpc")
RING_WAIT_S = 60.0  # a ring full this long: the next stage stopped reading (a hung stage)
_RING_PATH = re.compile(r"/dev/shm/pagoda-pp-\d+-[0-9a-f]+")


def _check_setting(setting: str) -> None:
    if setting not in CHANNELS:
        raise ValueError(f"stage_channel: must be one of {', '.join(CHANNELS)}, got {setting!r}")


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

    def __init__(
        self,
        setting: str,
        stage: int,
        slot_bytes: int,
        num_slots: int = stage_ring.DEFAULT_NUM_SLOTS,
        wait_s: float = RING_WAIT_S,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
    ) -> None:
        _check_setting(setting)
        self.setting, self.stage, self.slot_bytes, self.num_slots = setting, stage, slot_bytes, num_slots
        self.wait_s, self.device, self.host = wait_s, torch.device(device), host
        self.ring: RingWriter | None = None
        self.link: SendLink | None = None
        self.channel = ""  # "shm", "nccl" ("gloo" on CPUs) or "grpc" once connected
        self.num_full_waits = 0
        self.num_shm_sent = 0
        self.num_grpc_sent = 0
        self.num_p2p_sent = 0

    async def connect(self, stub, timeout_s: float = 5.0) -> None:
        """Offer the channels the setting allows, fastest first, on a new connection; grpc
        when every one is refused. DataPlaneError when the one insisted on is refused."""
        self.drop()
        if self.setting == "nccl" or (self.setting == "auto" and self.device.type == "cuda"):
            why = await self._offer_link(stub, max(timeout_s, 35.0))
            if not why:
                self.channel = self.link.backend
                log.info("hidden states to the next stage go point-to-point (%s)", self.link.backend)
                return
            if self.setting == "nccl":
                raise DataPlaneError(f"the point-to-point channel to the next stage was refused: {why}")
            log.info("no point-to-point channel to the next stage: %s", why)
        why = "--stage-channel grpc" if self.setting == "grpc" else await self._offer(stub, timeout_s)
        self.channel = "grpc" if why else "shm"
        if why and self.setting == "shm":
            raise DataPlaneError(f"the shared-memory channel to the next stage was refused: {why}")
        if why:
            log.info("hidden states to the next stage go over gRPC: %s", why)
        else:
            log.info(
                "hidden states to the next stage go through shared memory (%d slots of %d bytes)",
                self.num_slots,
                self.slot_bytes,
            )

    async def _offer(self, stub, timeout_s: float) -> str:
        """The reason the ring was not taken, or "" when it was."""
        if not stage_ring.available():
            return "no shared memory here (x86-64 with /dev/shm)"
        try:
            ring = RingWriter(self.num_slots, self.slot_bytes)
        except (OSError, ValueError) as exc:
            return f"no ring of {self.num_slots} x {self.slot_bytes} bytes: {exc}"
        offer = worker_pb2.DataPlaneOffer(
            sender_stage=self.stage,
            channel=worker_pb2.DATA_CHANNEL_SHM,
            path=ring.path,
            token=ring.token,
            ring_id=ring.ring_id,
            num_slots=ring.num_slots,
            slot_bytes=ring.slot_bytes,
        )
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

    async def _offer_link(self, stub, timeout_s: float) -> str:
        """The reason the link was not made, or "" when it was (both sides joined its group)."""
        try:
            link = SendLink(self.host, self.device)
        except (RuntimeError, OSError) as exc:
            return f"no store for a point-to-point group: {exc}"
        joined = asyncio.wrap_future(link.join())
        offer = worker_pb2.DataPlaneOffer(
            sender_stage=self.stage,
            channel=worker_pb2.DATA_CHANNEL_NCCL,
            ring_id=link.link_id,
            store_address=link.address,
            backend=link.backend,
            device=str(self.device),
            hostname=socket.gethostname(),
        )
        try:
            reply = await stub.OpenDataPlane(offer, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            reply = worker_pb2.DataPlaneReply(reason=f"the next stage answered with {exc.code().name}: {exc.details()}")
        if reply.channel != worker_pb2.DATA_CHANNEL_NCCL:
            link.close()  # its group never forms: the thread waiting for it ends with the store's timeout
            return reply.reason or "the next stage refused it"
        try:
            await asyncio.wait_for(joined, timeout_s)
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: BLE001 - the group's own errors
            link.close()
            return f"the point-to-point group did not form: {exc}"
        self.link = link
        return ""

    def drop(self) -> None:
        """The connection ended: its ring or link goes with it (a reference lost in the
        stream would hold its slot forever, or unpair sends and receives); the next
        connection offers a new one."""
        self.ring = None
        if self.link is not None:
            self.link.close()
        self.link = None
        self.channel = ""

    def pack(self, t: torch.Tensor, mb: worker_pb2.MicroBatch) -> torch.Tensor | None:
        """Compute thread: `t` into a free ring slot (a reference in `mb`) or into `mb` itself.
        Returns the tensor while `place` may still need it (in the ring, or waiting for a slot)."""
        ring = self.ring
        if (ring is None and not self.channel) or self.link is not None:
            return t  # not connected yet, or the link's send follows the message: `place`
        if ring is None or not ring.fits(t):
            tensor_to_pb(t, mb.hidden_states)
            return None
        ref = ring.try_write(t.contiguous())
        if ref is not None:
            ref_to_pb(ref, mb.hidden_ref)
        return t

    def placed(self, t: torch.Tensor | None, mb: worker_pb2.MicroBatch) -> bool:
        """The step thread: whether `pack` left nothing for `place` to do (the hidden states
        in this ring's slot, or in the message); counted as sent when so."""
        ring = self.ring
        if self.link is not None:
            return False
        if t is None:
            self.num_grpc_sent += 1
            return True
        if ring is not None and mb.HasField("hidden_ref") and mb.hidden_ref.ring_id == ring.ring_id:
            self.num_shm_sent += 1
            return True
        return False

    async def place(self, t: torch.Tensor | None, mb: worker_pb2.MicroBatch) -> None:
        """Event loop, on the connection the message goes out on: what `pack` left undone (a
        full ring: wait for a slot), or done on a connection since dropped (again, here)."""
        ring, link = self.ring, self.link
        if t is not None:
            if link is not None:
                mb.ClearField("hidden_ref")
                ref, sent = link.send(t)  # posted now; it completes when the receiver takes it
                sent.add_done_callback(_log_failed_send)
                ref_to_pb(ref, mb.hidden_ref)
            elif mb.HasField("hidden_ref") and ring is not None and mb.hidden_ref.ring_id == ring.ring_id:
                pass
            elif ring is not None and ring.fits(t):
                mb.ClearField("hidden_ref")
                ref_to_pb(await self._write_when_free(ring, t.contiguous()), mb.hidden_ref)
            else:
                mb.ClearField("hidden_ref")
                tensor_to_pb(t, mb.hidden_states)
        if link is not None and t is not None:
            self.num_p2p_sent += 1
        elif mb.HasField("hidden_ref"):
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
                raise RingFullError(
                    f"the next stage released no slot of its ring ({ring.num_slots} slots) "
                    f"within {self.wait_s:.0f} s: it stopped reading"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5e-3)


def _log_failed_send(sent: Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("%s", sent.exception())


class DataPlaneIn:
    """The receiver's side: the ring or link the previous stage offered (the newest one: a
    restarted or reconnected sender offers anew, which replaces the old), and a step's hidden
    states from a micro-batch."""

    def __init__(self, setting: str, device: torch.device | str = "cpu") -> None:
        _check_setting(setting)
        self.setting, self.device = setting, torch.device(device)
        self.ring: RingReader | None = None
        self.link: RecvLink | None = None
        self.channel = ""  # how the last micro-batch's hidden states came

    async def accept(self, offer: worker_pb2.DataPlaneOffer) -> worker_pb2.DataPlaneReply:
        if offer.channel == worker_pb2.DATA_CHANNEL_NCCL:
            why = self._link_refusal(offer) or await self._join(offer)
        else:
            why = self._ring_refusal(offer) or self._map(offer)
        if why:
            log.info("refused stage %d's offer: %s", offer.sender_stage, why)
            return worker_pb2.DataPlaneReply(channel=worker_pb2.DATA_CHANNEL_GRPC, reason=why)
        log.info(
            "stage %d hands hidden states on %s",
            offer.sender_stage,
            f"point-to-point ({offer.backend})"
            if self.link
            else f"through shared memory ({offer.num_slots} slots of {offer.slot_bytes} bytes)",
        )
        return worker_pb2.DataPlaneReply(channel=offer.channel)

    def _map(self, offer: worker_pb2.DataPlaneOffer) -> str:
        try:
            ring = RingReader(offer.path, offer.ring_id, offer.token, offer.num_slots, offer.slot_bytes)
        except (OSError, ValueError) as exc:
            return f"could not map {offer.path}: {exc}"
        self._close_link()
        self.ring = ring
        return ""

    async def _join(self, offer: worker_pb2.DataPlaneOffer) -> str:
        try:
            link = RecvLink(offer.ring_id, offer.store_address, offer.backend, self.device)
            await asyncio.wrap_future(link.join())
        except (RuntimeError, OSError, ValueError) as exc:
            return f"could not join the point-to-point group at {offer.store_address}: {exc}"
        self._close_link()
        self.ring, self.link = None, link
        return ""

    def _close_link(self) -> None:
        if self.link is not None:
            self.link.close()
        self.link = None

    def _ring_refusal(self, offer: worker_pb2.DataPlaneOffer) -> str:
        if self.setting in ("grpc", "nccl"):
            return f"this stage is set to --stage-channel {self.setting}"
        if offer.channel != worker_pb2.DATA_CHANNEL_SHM:
            return f"channel {offer.channel} is not one this stage takes"
        if not stage_ring.available():
            return "no shared memory here (x86-64 with /dev/shm)"
        if not _RING_PATH.fullmatch(offer.path):
            return f"{offer.path!r} is not a stage ring's file"
        return ""

    def _link_refusal(self, offer: worker_pb2.DataPlaneOffer) -> str:
        if self.setting in ("grpc", "shm"):
            return f"this stage is set to --stage-channel {self.setting}"
        if offer.backend != backend_for(self.device):
            return f"a {offer.backend} group needs {'GPUs' if offer.backend == 'nccl' else 'CPUs'}, this stage is on {self.device}"
        if (
            offer.backend == "nccl"
            and offer.hostname == socket.gethostname()
            and torch.device(offer.device) == self.device
        ):
            return f"both stages are on {self.device}: NCCL needs a GPU per rank"
        return ""

    def hidden(self, mb: worker_pb2.MicroBatch) -> tuple[torch.Tensor | Future, Callable[[], None] | None]:
        """The micro-batch's hidden states and, when they lie in the ring (read in place), the
        call that hands the slot back once the step is done; from a link, a Future of them
        (their receive posted now, in arrival order). InvalidPlanError when absent or not
        where the reference says."""
        if mb.HasField("hidden_ref"):
            ref = ref_from_pb(mb.hidden_ref)
            if self.link is not None and ref.ring_id == self.link.link_id:
                try:
                    received = self.link.recv(ref)
                except LinkError as exc:
                    raise InvalidPlanError(f"micro-batch {mb.micro_batch_id}: {exc}") from None
                self.channel = self.link.backend
                return received, None
            return self._view(mb, ref)
        if mb.HasField("hidden_states"):
            self.channel = "grpc"
            return tensor_from_pb(mb.hidden_states), None
        raise InvalidPlanError(f"micro-batch {mb.micro_batch_id}: no hidden states")

    def _view(self, mb: worker_pb2.MicroBatch, ref: RingRef) -> tuple[torch.Tensor, Callable[[], None]]:
        ring = self.ring
        if ring is None:
            raise InvalidPlanError(
                f"micro-batch {mb.micro_batch_id}: hidden states in ring {ref.ring_id}, but this stage took no ring"
            )
        try:
            t = ring.view(ref)
        except ValueError as exc:
            raise InvalidPlanError(f"micro-batch {mb.micro_batch_id}: {exc}") from None
        self.channel = "shm"
        return t, lambda: ring.release(ref)


def received(hidden: torch.Tensor | Future | None, timeout_s: float = 60.0) -> torch.Tensor | None:
    """A step's hidden states once here (compute thread): a link's Future waited for;
    DataPlaneError when the receive failed."""
    if not isinstance(hidden, Future):
        return hidden
    try:
        return hidden.result(timeout=timeout_s)
    except LinkError as exc:
        raise DataPlaneError(str(exc)) from None
    except TimeoutError:
        raise DataPlaneError(f"the previous stage sent no hidden states within {timeout_s:.0f} s") from None
