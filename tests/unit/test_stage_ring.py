"""The data plane's channels (issue 37). The shared-memory ring of a stage pair (worker_svc/execution/stage_ring.py) and the data plane
around it (worker_svc/execution/data_plane.py): hand-offs read in place with the bits written;
a full ring holds the writer back (back-pressure) and loses nothing; a writer that nobody
reads from gets a clear error, not a hang; a reader never takes a slot that is not published
with the number it was told; the file is gone once both sides map it; offers a receiver
cannot or must not take fall back to gRPC. The point-to-point link (the NCCL channel's
protocol, on gloo here): hand-offs pair up in order, a broken pairing is an error."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from services.pb import worker_pb2
from worker_svc.errors import InvalidPlanError
from worker_svc.execution import stage_ring
from worker_svc.execution.data_plane import DataPlaneError, DataPlaneIn, DataPlaneOut, received, ref_to_pb
from worker_svc.execution.stage_ring import RingFullError, RingReader, RingWriter

pytestmark = pytest.mark.skipif(not stage_ring.available(), reason="needs x86-64 and /dev/shm")
SLOT = 4096


def pair(num_slots: int = 3) -> tuple[RingWriter, RingReader]:
    w = RingWriter(num_slots, SLOT)
    r = RingReader(w.path, w.ring_id, w.token, num_slots, SLOT)
    w.unlink()
    assert not os.path.exists(w.path)
    return w, r


def test_hand_offs_are_read_in_place_with_the_bits_written():
    w, r = pair()
    g = torch.Generator().manual_seed(0)
    for i, (shape, dtype) in enumerate(
        [((1, 64), torch.float32), ((16, 64), torch.bfloat16), ((0, 64), torch.float32), ((7, 100), torch.float16)] * 5
    ):
        x = torch.randn(shape, generator=g).to(dtype)
        ref = w.try_write(x)
        assert ref is not None and ref.seq == i + 1
        got = r.view(ref)
        assert got.dtype == dtype and torch.equal(got, x)
        if x.numel():  # in place: the slot's memory, not a copy
            assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        r.release(ref)
        w.check()
    assert w.num_free() == 3


def test_a_full_ring_refuses_until_a_slot_comes_back_in_any_order():
    w, r = pair(3)
    refs = [w.try_write(torch.full((4,), float(i))) for i in range(3)]
    assert all(refs) and w.num_free() == 0
    assert w.try_write(torch.ones(4)) is None  # nothing overwritten
    r.release(refs[1])  # a failed micro-batch in the middle releases its own slot
    ref = w.try_write(torch.full((4,), 9.0))
    assert ref is not None and ref.slot == refs[1].slot
    assert torch.equal(r.view(refs[0]), torch.zeros(4)) and torch.equal(r.view(refs[2]), torch.full((4,), 2.0))
    w.check()


def test_a_reader_takes_only_a_slot_published_with_the_number_it_was_told():
    w, r = pair(2)
    ref = w.try_write(torch.ones(8))
    stale = stage_ring.RingRef(ref.ring_id, ref.slot, ref.seq + 1, torch.float32, (8,))
    with pytest.raises(ValueError, match="holds message 1"):  # its data not published yet: half written
        r.view(stale)
    r.release(ref)
    with pytest.raises(ValueError, match="released"):
        r.view(ref)
    with pytest.raises(ValueError, match="out of range"):
        r.view(stage_ring.RingRef(ref.ring_id, 5, 1, torch.float32, (8,)))
    with pytest.raises(ValueError, match="do not fit"):
        r.view(stage_ring.RingRef(ref.ring_id, 0, 1, torch.float32, (SLOT,)))
    with pytest.raises(ValueError, match="ring 7"):
        r.view(stage_ring.RingRef(7, 0, 1, torch.float32, (8,)))


def test_a_reader_checks_it_mapped_the_offered_memory():
    w = RingWriter(2, SLOT)
    try:
        with pytest.raises(ValueError, match="token"):
            RingReader(w.path, w.ring_id, b"x" * 16, 2, SLOT)
        with pytest.raises(ValueError, match="not the offered ring"):
            RingReader(w.path, w.ring_id, w.token, 1, SLOT)
    finally:
        w.unlink()


def test_a_full_ring_holds_the_writer_back_and_loses_nothing():
    """Ten hand-offs through two slots, the reader slower than the writer: the writer waits
    for each slot (counted), every tensor arrives whole and in order."""
    out = DataPlaneOut("auto", 0, SLOT, num_slots=2, wait_s=10)
    out.ring = writer = RingWriter(2, SLOT)
    inbound = DataPlaneIn("auto")
    inbound.ring = RingReader(writer.path, writer.ring_id, writer.token, 2, SLOT)
    writer.unlink()
    sent = [torch.full((3, 5), float(i)) for i in range(10)]
    got: list[torch.Tensor] = []

    async def go():
        queue: asyncio.Queue = asyncio.Queue()

        async def reader():
            for _ in sent:
                mb = await queue.get()
                await asyncio.sleep(0.01)  # a slower stage
                t, release = inbound.hidden(mb)
                got.append(t.clone())
                release()

        task = asyncio.create_task(reader())
        for t in sent:
            mb = worker_pb2.MicroBatch()
            kept = out.pack(t, mb)
            await out.place(kept, mb)
            assert mb.HasField("hidden_ref") and not mb.HasField("hidden_states")
            await queue.put(mb)
        await asyncio.wait_for(task, 10)

    asyncio.run(go())
    assert len(got) == len(sent) and all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
    assert out.num_full_waits >= 5 and out.num_shm_sent == 10 and writer.num_free() == 2
    assert inbound.channel == "shm"


def test_a_ring_nobody_reads_is_an_error_after_the_wait_not_a_hang():
    out = DataPlaneOut("auto", 0, SLOT, num_slots=1, wait_s=0.2)
    out.ring = RingWriter(1, SLOT)
    out.ring.unlink()
    first = worker_pb2.MicroBatch()
    out.pack(torch.ones(4), first)
    second = worker_pb2.MicroBatch()
    kept = out.pack(torch.ones(4), second)
    assert not second.HasField("hidden_ref")  # full: left to the sender loop
    with pytest.raises(RingFullError, match="stopped reading"):
        asyncio.run(out.place(kept, second))
    out.drop()
    with pytest.raises(DataPlaneError):  # the ring dropped with its stream while waiting
        out.ring = ring = RingWriter(1, SLOT)
        ring.unlink()
        out.pack(torch.ones(4), worker_pb2.MicroBatch())

        async def drop_soon():
            asyncio.get_running_loop().call_later(0.05, out.drop)
            out.ring = ring
            await out._write_when_free(ring, torch.ones(4))

        asyncio.run(drop_soon())


def test_what_does_not_fit_a_slot_and_a_dropped_ring_go_in_the_message():
    out = DataPlaneOut("auto", 0, SLOT, num_slots=2)
    out.ring = ring = RingWriter(2, SLOT)
    ring.unlink()
    big = torch.ones(SLOT // 4 + 1)
    mb = worker_pb2.MicroBatch()
    assert out.pack(big, mb) is None and mb.HasField("hidden_states")
    mb = worker_pb2.MicroBatch()
    kept = out.pack(torch.ones(4), mb)
    assert mb.HasField("hidden_ref")
    out.drop()  # the stream broke: the message goes on the next connection, in itself
    asyncio.run(out.place(kept, mb))
    assert not mb.HasField("hidden_ref") and mb.HasField("hidden_states")
    assert (out.num_shm_sent, out.num_grpc_sent) == (0, 1)
    t, release = DataPlaneIn("auto").hidden(mb)
    assert release is None and torch.equal(t, torch.ones(4))


def test_offers_a_receiver_cannot_or_must_not_take_fall_back_to_grpc():
    w = RingWriter(2, SLOT)
    try:
        offer = worker_pb2.DataPlaneOffer(
            sender_stage=0,
            channel=worker_pb2.DATA_CHANNEL_SHM,
            path=w.path,
            token=w.token,
            ring_id=w.ring_id,
            num_slots=2,
            slot_bytes=SLOT,
        )
        refused = asyncio.run(DataPlaneIn("grpc").accept(offer))
        assert refused.channel == worker_pb2.DATA_CHANNEL_GRPC and "grpc" in refused.reason
        odd = worker_pb2.DataPlaneOffer()
        odd.CopyFrom(offer)
        odd.path = "/etc/passwd"
        assert "not a stage ring" in asyncio.run(DataPlaneIn("auto").accept(odd)).reason
        odd.path, odd.token = offer.path, b"y" * 16
        assert "token" in asyncio.run(DataPlaneIn("auto").accept(odd)).reason
        inbound = DataPlaneIn("auto")
        assert asyncio.run(inbound.accept(offer)).channel == worker_pb2.DATA_CHANNEL_SHM
    finally:
        w.unlink()
    ref = w.try_write(torch.arange(6, dtype=torch.float32))
    mb = worker_pb2.MicroBatch(micro_batch_id=3)
    ref_to_pb(ref, mb.hidden_ref)
    t, release = inbound.hidden(mb)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))
    release()
    with pytest.raises(InvalidPlanError, match="micro-batch 3: ring slot"):  # read twice
        inbound.hidden(mb)
    with pytest.raises(InvalidPlanError, match="took no ring"):
        DataPlaneIn("auto").hidden(mb)
    with pytest.raises(InvalidPlanError, match="no hidden states"):
        inbound.hidden(worker_pb2.MicroBatch())


def test_a_channel_setting_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="stage_channel"):
        DataPlaneOut("nccl-please", 0, SLOT)
    with pytest.raises(ValueError, match="stage_channel"):
        DataPlaneIn("fast")


class LoopbackStub:
    """The next stage's OpenDataPlane, called in this process."""

    def __init__(self, inbound: DataPlaneIn) -> None:
        self.inbound = inbound

    async def OpenDataPlane(self, offer, timeout=None):
        return await self.inbound.accept(offer)


def test_the_point_to_point_link_hands_off_in_order_on_gloo():
    """The NCCL channel's protocol with gloo (CPU): the offer forms a group of two, each
    hand-off is a reference in the message and a send the receiver pairs with a receive."""
    out, inbound = DataPlaneOut("nccl", 0, SLOT), DataPlaneIn("auto")
    sent = [torch.randn(r, 32) for r in (1, 16, 64, 3)] + [torch.randn(2, 8).to(torch.bfloat16)]

    async def go():
        await out.connect(LoopbackStub(inbound), timeout_s=20)
        got = []
        for t in sent:
            mb = worker_pb2.MicroBatch()
            await out.place(out.pack(t, mb), mb)
            assert mb.HasField("hidden_ref") and not mb.HasField("hidden_states")
            future, release = inbound.hidden(mb)
            assert release is None
            got.append(await asyncio.get_running_loop().run_in_executor(None, received, future))
        skipped = worker_pb2.MicroBatch(micro_batch_id=9)
        await out.place(out.pack(torch.ones(2, 2), skipped), skipped)  # lost on its way
        lost = worker_pb2.MicroBatch(micro_batch_id=10)
        await out.place(out.pack(torch.ones(2, 2), lost), lost)
        with pytest.raises(InvalidPlanError, match="micro-batch 10: hand-off 7 .* expected 6"):
            inbound.hidden(lost)
        link = inbound.link  # the two sends no receive paired: taken here, so that no send
        for _ in range(2):  # is left blocked in gloo when the process exits (that aborts it)
            drain = stage_ring.RingRef(link.link_id, 0, 0, torch.float32, (2, 2))
            link._thread.submit(link._recv, drain).result(timeout=20)
        return got

    got = asyncio.run(go())
    assert out.channel == "gloo" and inbound.channel == "gloo" and out.num_p2p_sent == len(sent) + 2
    assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
    out.drop()
    inbound._close_link()


def test_point_to_point_offers_follow_the_settings():
    async def go(sender: str, receiver: str):
        out = DataPlaneOut(sender, 0, SLOT)
        try:
            await out.connect(LoopbackStub(DataPlaneIn(receiver)), timeout_s=20)
        except DataPlaneError as exc:
            return str(exc)
        channel = out.channel
        out.drop()
        return channel

    assert asyncio.run(go("auto", "auto")) == "shm"  # on the CPU no link is offered unasked
    assert "set to --stage-channel shm" in asyncio.run(go("nccl", "shm"))
    assert "set to --stage-channel nccl" in asyncio.run(go("shm", "nccl"))
    assert asyncio.run(go("grpc", "nccl")) == "grpc"
    offer = worker_pb2.DataPlaneOffer(channel=worker_pb2.DATA_CHANNEL_NCCL, backend="nccl", device="cuda:0")
    assert "needs GPUs" in asyncio.run(DataPlaneIn("auto").accept(offer)).reason
    assert received(None) is None


def test_a_stage_too_old_to_know_the_offer_gets_its_hidden_states_in_the_message():
    """Mixed versions: an older next stage answers OpenDataPlane with UNIMPLEMENTED; the
    sender falls back to the message (hidden_states, field 16) and says why."""
    import grpc

    class OldStage:
        async def OpenDataPlane(self, offer, timeout=None):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Method not found!"
            )

    out = DataPlaneOut("auto", 0, SLOT)
    asyncio.run(out.connect(OldStage()))
    assert out.channel == "grpc" and out.ring is None
    mb = worker_pb2.MicroBatch()
    assert out.pack(torch.ones(3), mb) is None and mb.HasField("hidden_states")
    with pytest.raises(DataPlaneError, match="UNIMPLEMENTED"):
        asyncio.run(DataPlaneOut("shm", 0, SLOT).connect(OldStage()))
