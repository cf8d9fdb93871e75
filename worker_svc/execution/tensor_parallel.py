"""Tensor parallelism inside a stage: `pagoda worker --tensor-parallel-size T` (issue 14).

A stage of T ranks is T processes. Rank 0 is the stage as the rest of the system knows it:
it speaks the stage's gRPC protocol, keeps the persistent batch, samples (last stage) and
starts ranks 1..T-1 itself (`start_ranks`; they die with it). Every rank holds its share of
each layer (`ModelConfig.shard`: H/T query heads, Hkv/T KV heads, intermediate/T MLP
columns, loaded as slices of the checkpoint's tensors) and a KV pool of the same block
count over its own KV heads. The ranks other than 0 hold no batch state: for each step,
rank 0 broadcasts what the model call reads (`send_step`: block copies, token ids or hidden
states, positions, slot mapping, block table; with KV groups every sub-group's slots and
tables, and the ranks allocate their pools by rank 0's layout, `share_layout`), and every
rank runs its layers with the row-parallel outputs (o_proj, down_proj) summed by an
all-reduce. Ranks other than 0 of the last stage stop after the layers: rank 0 alone
computes logits and samples.

Transport: on the CPU, shared memory for what fits (worker_svc/execution/shm_collectives.py: the
all-reduces of decode-sized tensors and each step's inputs; gloo tells the others a step
has come and carries what is larger); on CUDA the all-reduces and hidden states go over
NCCL and the step's integer layout over gloo. Two groups: the one that carries
plans waits as long as the stage may idle; the compute group's collectives time out after
`COMPUTE_TIMEOUT` (peers run the same step, so only their imbalance is waited for).

Failure is a stage failure. A rank that exits makes rank 0 exit at once (a watcher thread;
`pagoda serve` restarts the stage, the scheduler recovers its requests as after any stage
failure); rank 0's death kills the others (PR_SET_PDEATHSIG); a collective that fails on
rank 0 mid-step leaves the group unusable, so the stage exits then too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.kv_layout import KVLayout
from worker_svc.config import WorkerConfig
from worker_svc.kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)

OP_STEP = 1
_HEADER = 8  # int64s: op, tokens, sequences, block-table width, copies, inputs are ids, in memory, KV groups
COMPUTE_TIMEOUT = timedelta(seconds=300)
IDLE_TIMEOUT = timedelta(days=30)  # ranks wait this long for the next step
STORE_TIMEOUT = timedelta(seconds=120)  # for every rank to join
_LAYOUT_KEY = "pagoda/tp-kv-groups"  # rank 0's KV layout (`KVLayout.spec()`; "": one table)
EXIT_RANK_LOST = 70


@dataclass
class StepInputs:
    """What one step's model call reads, as every rank gets it from rank 0."""

    block_copies: list[tuple[int, int]]
    inputs: torch.Tensor  # token ids [T] (first stage) or hidden states [T, hidden]
    positions: torch.Tensor
    metadata: AttentionMetadata


def step_payload(
    block_copies, positions: torch.Tensor, metadata: AttentionMetadata, ids: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """A step's integer inputs as one int64 tensor, and its layout (tokens, sequences,
    block-table width, copies, KV groups) that `step_from_payload` reads it back by."""
    groups = metadata.num_groups
    tables = metadata.block_tables if groups == 1 else metadata.group_block_tables
    slots = metadata.slot_mapping if groups == 1 else metadata.group_slot_mapping
    parts = [
        torch.tensor(block_copies, dtype=torch.long).reshape(-1),
        positions,
        slots.reshape(-1),
        metadata.query_start_loc,
        metadata.context_lens,
        tables.reshape(-1),
    ]
    if ids is not None:
        parts.append(ids)
    payload = torch.cat([p.to("cpu", torch.long) for p in parts])
    return payload, (positions.numel(), metadata.num_seqs, tables.shape[-1], len(block_copies), groups)


def _payload_sizes(layout: tuple[int, int, int, int, int], ids: bool) -> list[int]:
    tokens, seqs, width, copies, groups = layout
    return [2 * copies, tokens, groups * tokens, seqs + 1, seqs, groups * seqs * width] + ([tokens] if ids else [])


def step_from_payload(
    payload: torch.Tensor, layout: tuple[int, int, int, int, int], ids: bool, device: torch.device
) -> StepInputs:
    """`step_payload` read back on `device` (hidden states, when not ids, are the caller's
    to fill in: `inputs` is an empty tensor then)."""
    tokens, seqs, width, _, groups = layout
    pieces = list(payload.split(_payload_sizes(layout, ids)))
    copy_pairs = pieces[0].view(-1, 2).tolist()
    positions, slots, starts, lens, tables = (p.to(device) for p in pieces[1:6])
    tables, slots = tables.view(groups, seqs, width), slots.view(groups, tokens)
    metadata = AttentionMetadata(
        slot_mapping=slots[0],
        query_start_loc=starts,
        context_lens=lens,
        block_tables=tables[0],
        query_start_loc_list=tuple(pieces[3].tolist()),
        context_lens_list=tuple(pieces[4].tolist()),
        group_block_tables=tables if groups > 1 else None,
        group_slot_mapping=slots if groups > 1 else None,
    )
    inputs = pieces[6].to(device) if ids else torch.empty(0, device=device)
    return StepInputs([tuple(p) for p in copy_pairs], inputs, positions, metadata)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a stage on CUDA takes the r-th device after the stage's own."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TensorParallelGroup:
    """One rank's view of its stage's group: collectives, the step broadcast, and (rank 0)
    the processes of the other ranks."""

    def __init__(self, rank: int, size: int, store: dist.TCPStore, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.store = store
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
        self.ops = dist.group.WORLD
        self.compute = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=COMPUTE_TIMEOUT)
        self._local = False
        self.processes: list[subprocess.Popen] = []  # rank 0: ranks 1..size-1
        self.stopping = False
        self.shm = self._shared_memory() if device.type == "cpu" else None

    def _shared_memory(self):
        """The ranks' shared memory (worker_svc/execution/shm_collectives.py), or None where any rank
        cannot have it (then everything goes through gloo)."""
        from worker_svc.execution import shm_collectives

        shm = None
        try:
            if self.rank == 0:  # created before the others learn where
                if shm_collectives.available():
                    shm = shm_collectives.ShmCollectives(
                        0, self.size, shm_collectives.ShmCollectives.new_path(), create=True
                    )
                self.store.set("pagoda/tp-shm", shm.path if shm else "")
            else:
                path = self.store.get("pagoda/tp-shm").decode()
                if path:
                    shm = shm_collectives.ShmCollectives(self.rank, self.size, path, create=False)
        except OSError as exc:
            log.warning("tensor-parallel rank %d: no shared memory (%s): collectives over gloo", self.rank, exc)
            if self.rank == 0:
                self.store.set("pagoda/tp-shm", "")
        try:
            everyone = self.min_over_ranks(int(shm is not None))  # (also: every rank has mapped it)
        finally:
            if shm is not None and self.rank == 0:
                shm.unlink()  # mapped by all, or given up: the file goes either way
        return shm if everyone else None

    # --- collectives -----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (a layer's row-parallel output): through shared
        memory when the tensor fits its slots, else over the compute group."""
        if not self._local:
            if self.shm is not None and self.shm.fits(x):
                self.shm.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.compute)
        return x

    @contextlib.contextmanager
    def local(self):
        """Collectives off: each rank runs its share alone (the memory profile step: its
        peak is the same, its numbers are not used)."""
        self._local = True
        try:
            yield
        finally:
            self._local = False

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ops)
        return int(t.item())

    # --- steps -----------------------------------------------------------------------------

    def send_step(
        self, block_copies, inputs: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Rank 0: hand one step's model inputs to the other ranks."""
        ids = inputs.dtype == torch.long
        payload, layout = step_payload(block_copies, positions, metadata, inputs if ids else None)
        # through shared memory when it fits: the others read it once the header comes
        in_memory = self.shm is not None and self.shm.put([payload] if ids else [payload, inputs.contiguous()])
        header = torch.tensor([OP_STEP, *layout[:4], int(ids), int(in_memory), layout[4]], dtype=torch.long)
        dist.broadcast(header, 0, group=self.ops)
        if in_memory:
            return
        dist.broadcast(payload, 0, group=self.ops)
        if not ids:
            dist.broadcast(inputs.contiguous(), 0, group=self.compute)

    def recv_step(self, hidden_size: int, dtype: torch.dtype) -> StepInputs:
        """Ranks 1..: the next step's inputs (waits for it)."""
        header = torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self.ops)
        op, tokens, seqs, width, copies, ids, in_memory, groups = header.tolist()
        if op != OP_STEP:
            raise RuntimeError(f"unknown tensor-parallel operation {op}")
        layout = (tokens, seqs, width, copies, max(1, groups))
        size = sum(_payload_sizes(layout, bool(ids)))
        hidden = None
        if in_memory:
            shapes = [((size,), torch.long)] + ([] if ids else [((tokens, hidden_size), dtype)])
            payload, *rest = self.shm.get(shapes)
            hidden = rest[0] if rest else None
        else:
            payload = torch.empty(size, dtype=torch.long)
            dist.broadcast(payload, 0, group=self.ops)
        step = step_from_payload(payload, layout, bool(ids), self.device)
        if hidden is not None:
            step.inputs = hidden.to(self.device)
        elif not ids:
            step.inputs = torch.empty(tokens, hidden_size, dtype=dtype, device=self.device)
            dist.broadcast(step.inputs, 0, group=self.compute)
        return step

    def share_layout(self, layout: KVLayout | None, model_layout: KVLayout) -> KVLayout | None:
        """The stage's KV layout on every rank: rank 0 tells it (its `layout`, None: one
        table), the others take it (waiting until told), as their model's own
        `model_layout` when grouped. Idempotent: a rank may ask again."""
        if self.rank == 0:
            self.store.set(_LAYOUT_KEY, layout.spec() if layout is not None and layout.grouped else "")
            return layout
        self.store.wait([_LAYOUT_KEY], IDLE_TIMEOUT)  # (rank 0 may still be loading)
        spec = self.store.get(_LAYOUT_KEY).decode()
        if not spec:
            return None
        if spec != model_layout.spec():
            raise RuntimeError(f"rank 0's KV groups {spec!r} are not this rank's model's {model_layout.spec()!r}")
        return model_layout

    # --- failure ---------------------------------------------------------------------------

    def abort(self, why: str) -> None:
        """The group cannot be trusted any more (a collective failed mid-step): exit, so that
        the stage is restarted whole. (While the stage stops, its ranks going is expected.)"""
        if self.stopping:
            return
        log.critical("tensor-parallel rank %d: %s; the stage exits to be restarted", self.rank, why)
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)

    def watch(self) -> None:
        """Rank 0: a rank that exits while the stage serves takes the stage down with it."""
        for rank, proc in enumerate(self.processes, start=1):
            threading.Thread(target=self._wait_rank, args=(rank, proc), daemon=True, name=f"tp-rank{rank}").start()

    def _wait_rank(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping:
            self.abort(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Rank 0: stop the other ranks (they hold nothing to save, and ignore SIGTERM so
        that a stop sent to the whole process group reaches rank 0 first)."""
        self.stopping = True
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)


def start_ranks(config: WorkerConfig, device: torch.device) -> TensorParallelGroup:
    """Rank 0: start ranks 1..T-1 as child processes and form the group with them. Cores:
    when this process may run on exactly T x threads cores (`pagoda serve` pinned the stage),
    each rank gets its own threads' worth of them."""
    from services.process import PARENT_ENV

    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    cores = sorted(os.sched_getaffinity(0))
    threads = config.resolved_num_threads
    split = len(cores) == size * threads
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    processes = []
    for rank in range(1, size):
        command = [
            sys.executable,
            "-m",
            "worker_svc.execution.tensor_parallel",
            "--rank",
            str(rank),
            "--store-port",
            str(store.port),
            "--config",
            config.to_json(),
        ]
        if split:
            command += ["--cpus", ",".join(map(str, cores[rank * threads : (rank + 1) * threads]))]
        processes.append(subprocess.Popen(command, env=env))
    if split:
        os.sched_setaffinity(0, cores[:threads])
    group = None
    try:
        watcher = _StartWatch(processes)
        group = TensorParallelGroup(0, size, store, rank_device(device, 0))
        watcher.done()
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    group.processes = processes
    group.watch()
    log.info(
        "stage %d: tensor-parallel ranks 1..%d started (pids %s)", config.stage, size - 1, [p.pid for p in processes]
    )
    return group


class _StartWatch:
    """While the group forms: a rank that exits (it could not load) ends the wait, which
    would otherwise last STORE_TIMEOUT."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self._done = threading.Event()
        for proc in processes:
            threading.Thread(target=self._wait, args=(proc,), daemon=True).start()

    def _wait(self, proc: subprocess.Popen) -> None:
        while not self._done.is_set():
            try:
                code = proc.wait(0.2)
            except subprocess.TimeoutExpired:
                continue
            if not self._done.is_set():
                log.critical("a tensor-parallel rank exited with code %s while the stage started", code)
                logging.shutdown()
                os._exit(EXIT_RANK_LOST)

    def done(self) -> None:
        self._done.set()


def follow(config: WorkerConfig, rank: int, store_port: int) -> None:
    """Ranks 1..T-1: load this rank's share, agree on the pool, then run each step rank 0
    sends until the stage ends."""
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.device import default_attention_backend, resolve_device
    from worker_svc.execution.kv_cache import PagedKVCache
    from worker_svc.execution.memory import stage_pool
    from worker_svc.kernels.cpu_kernels import keep_freed_memory

    torch.set_num_threads(config.resolved_num_threads)
    keep_freed_memory()
    device = rank_device(resolve_device(config.device), rank)
    store = dist.TCPStore("127.0.0.1", store_port, config.tensor_parallel_size, False, timeout=STORE_TIMEOUT)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, store, device)
    model = load_stage(
        config.model,
        config.stage,
        config.num_stages,
        config.layer_partition,
        config.dtype,
        device,
        quantization=config.quantization,
        tp_rank=rank,
        tp_size=config.tensor_parallel_size,
        expert_parallel=config.enable_expert_parallel,
    )
    model.set_reduce(group.all_reduce)
    backend_name = config.attention_backend or default_attention_backend(device)
    from worker_svc.kernels.attention import get_backend

    backend = get_backend(backend_name)
    layout = group.share_layout(None, model.kv_layout)  # rank 0's
    num_blocks, _ = stage_pool(config, model, backend, group, layout)
    mc = model.config
    from worker_svc.execution.memory import kv_pool_dtype

    dtype = next(model.parameters()).dtype
    kv = PagedKVCache(
        model.num_local_layers,
        num_blocks,
        config.block_size,
        mc.num_kv_heads,
        mc.head_dim,
        kv_pool_dtype(config, model),
        device,
        layout=layout,
        layers=range(model.start, model.end),
    )
    log.info(
        "stage %d tensor-parallel rank %d of %d: %d heads, %d KV heads, %d KV %s, %d threads",
        config.stage,
        rank,
        config.tensor_parallel_size,
        mc.num_heads,
        mc.num_kv_heads,
        num_blocks,
        "pages" if layout is not None else "blocks",
        torch.get_num_threads(),
    )
    while True:
        step = group.recv_step(mc.hidden_size, dtype)
        kv.copy_blocks(step.block_copies)
        model(step.inputs, step.positions, kv.pools, step.metadata, backend)


def main(argv: list[str] | None = None) -> int:
    from services.logs import configure_logging
    from services.process import die_with_parent

    p = argparse.ArgumentParser(description="a tensor-parallel rank of a stage (started by its rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--config", required=True, help="the stage's WorkerConfig as JSON")
    p.add_argument("--cpus", default=None, help="cores this rank runs on")
    args = p.parse_args(argv)
    die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 stops this rank (or its death does)
        signal.signal(sig, signal.SIG_IGN)
    config = WorkerConfig.from_json(args.config)
    configure_logging(f"worker-{config.stage}-rank{args.rank}")
    if args.cpus:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    try:
        follow(config, args.rank, args.store_port)
    except Exception as exc:  # noqa: BLE001 - said, then the stage's rank 0 sees this rank go
        log.critical(
            "tensor-parallel rank %d of stage %d stopped: %s: %s", args.rank, config.stage, type(exc).__name__, exc
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
