"""Shared-memory collectives of a stage's tensor-parallel ranks (worker_svc/execution/shm_collectives.py):
two ranks (threads here, processes in the stack) reduce many tensors of mixed shapes and
dtypes in a row, reusing the alternating buffers, and get the same bits as each other and as
the sum in rank order; a step's inputs travel through the payload area; a missing peer is a
timeout, not a hang; the file is gone once every rank has mapped it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from worker_svc.execution import shm_collectives
from worker_svc.execution.shm_collectives import SLOT_BYTES, ShmCollectives

pytestmark = pytest.mark.skipif(not shm_collectives.available(), reason="needs x86-64 and /dev/shm")


def pair():
    path = ShmCollectives.new_path()
    a = ShmCollectives(0, 2, path, create=True, timeout_s=20)
    b = ShmCollectives(1, 2, path, create=False, timeout_s=20)
    a.unlink()
    assert not os.path.exists(path)
    return a, b


def test_two_ranks_reduce_many_tensors_to_the_same_bits():
    a, b = pair()
    g = torch.Generator().manual_seed(0)
    shapes = [
        ((1, 64), torch.float32),
        ((7, 256), torch.float32),
        ((3, 64), torch.bfloat16),
        ((64, 1024), torch.float32),
    ] * 25
    inputs = [[torch.randn(s, generator=g).to(d) for s, d in shapes] for _ in range(2)]
    outputs: list[list[torch.Tensor]] = [[], []]

    def run(rank, shm):
        for x in inputs[rank]:
            y = x.clone()
            assert shm.fits(y)
            shm.all_reduce(y)
            outputs[rank].append(y)

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for x0, x1, y0, y1 in zip(inputs[0], inputs[1], outputs[0], outputs[1], strict=True):
        assert torch.equal(y0, y1)
        assert torch.equal(y0, x0 + x1)


def test_what_does_not_fit_is_left_to_gloo():
    a, _ = pair()
    assert not a.fits(torch.empty(SLOT_BYTES // 4 + 1))
    assert not a.fits(torch.empty(8, 8).t())  # not contiguous


def test_a_step_s_inputs_travel_through_the_payload_area():
    a, b = pair()
    ids = torch.arange(100, dtype=torch.long)
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    assert a.put([ids, hidden])
    got_ids, got_hidden = b.get([((100,), torch.long), ((5, 64), torch.bfloat16)])
    assert torch.equal(got_ids, ids) and torch.equal(got_hidden, hidden)
    assert not a.put([torch.empty(shm_collectives.PAYLOAD_BYTES // 8 + 1, dtype=torch.long)])


def test_a_missing_peer_is_a_timeout():
    path = ShmCollectives.new_path()
    a = ShmCollectives(0, 2, path, create=True, timeout_s=0.3)
    a.unlink()
    with pytest.raises(TimeoutError, match="did not all reach all-reduce 1"):
        a.all_reduce(torch.ones(4))


def test_files_of_processes_that_are_gone_are_removed():
    stale = "/dev/shm/pagoda-tp-999999999-abc"
    open(stale, "wb").close()
    mine = ShmCollectives.new_path()
    assert not os.path.exists(stale) and f"-{os.getpid()}-" in mine
