"""P/D disaggregation in the scheduler (issue 39): the prefill side says what it holds, the
decode side has its stages pull it before the request is queued.

Prefill replica: a request sent with `kv_export` keeps its finished prompt's KV held
(core/exports.py); its last response carries a `KVTransfer` naming this replica's stages, the
held sequence and how many of its blocks may be pulled (`export_to_pb`).

Decode replica (its KV service and stages started with --kv-import-blocks): a request sent with
`kv_import` first runs `KVImporter.run`: the KV service names the blocks it lacks
(`import_plan`: neither in its pool's prefix cache nor in its tier), every stage pulls its
layers' part of them from the same stage of the prefill replica (`StageWorker.PullBlocks`), and
once all have them the KV service adds their keys to its tier's import level (`commit_import`).
The request is then queued as any other: its admission finds those blocks as tier hits, loads
them into pool blocks and computes only the rest of the prompt. Anything failing on the way
(the prefill replica gone, a checksum, no room) drops whatever a stage kept (`forget_import`)
and the prompt is computed here: never an error, never a leak.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from scheduler_svc.core.request import Request
from services.kv_client import ImportPlan, KVCacheClient
from services.pb import scheduler_pb2

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 30.0
# how long a request waits for room in the import level (blocks pulled for requests ahead of it
# are loaded as those are admitted) before its prompt is computed here instead
ROOM_WAIT_S = 30.0
ROOM_POLL_S = (0.02, 0.25)  # the first and the longest wait between two asks of the KV service


def export_to_pb(
    exported: tuple[int, int] | None, stage_addresses: list[str], block_size: int, last: scheduler_pb2.GenerateResponse
) -> None:
    """A held prompt's `KVTransfer`, on its request's last response."""
    if exported is None or not stage_addresses:
        return
    seq_id, num_blocks = exported
    t = last.kv_export
    t.stage_addresses.extend(stage_addresses)
    t.seq_id, t.num_blocks, t.block_size = seq_id, num_blocks, block_size


@dataclass
class ImportStats:
    """The decode side's transfers, cumulative (GetStats, /metrics)."""

    num_requests: int = 0  # requests that came with a KVTransfer
    num_imported: int = 0  # ... whose blocks were pulled (or all found here already)
    num_failed: int = 0  # ... whose pull failed (computed here)
    num_blocks: int = 0  # blocks pulled, every stage's part together
    num_bytes: int = 0
    pull_s: float = 0.0  # time spent pulling (the requests' own wait)
    num_waited: int = 0  # requests that waited for room in the import level first


def disaggregation_to_pb(exports, imports: ImportStats, out: scheduler_pb2.DisaggregationStats) -> None:
    """GetStats' P/D counters: `exports` the planner's HeldExports, `imports` the importer's."""
    out.num_held, out.num_exports = len(exports), exports.num_exports
    out.num_released, out.num_expired = exports.num_released, exports.num_expired
    out.num_import_requests, out.num_imported = imports.num_requests, imports.num_imported
    out.num_import_failures, out.num_imported_blocks = imports.num_failed, imports.num_blocks
    out.num_imported_bytes, out.import_seconds = imports.num_bytes, imports.pull_s


class KVImporter:
    """Runs a decode replica's pulls (`run`); `transport` is the scheduler's gRPC transport."""

    def __init__(self, kv: KVCacheClient, transport, block_size: int, namespace: str | None) -> None:
        self.kv, self.transport, self.block_size, self.namespace = kv, transport, block_size, namespace
        self.stats = ImportStats()
        self._pulling = 0  # blocks being pulled now: not in the import level yet, its room taken
        self._room_turn = asyncio.Lock()  # requests short of room wait their turn, in arrival order

    def skip_reason(self, request: Request, transfer: scheduler_pb2.KVTransfer) -> str:
        """Why `transfer` cannot serve `request` here ("" when it can)."""
        stages = getattr(self.transport, "addresses", None)
        if stages is None:
            return "this scheduler's stages are in-process"
        if len(transfer.stage_addresses) != len(stages):
            return f"{len(transfer.stage_addresses)} prefill stages, {len(stages)} here"
        if transfer.block_size != self.block_size:
            return f"block size {transfer.block_size}, {self.block_size} here"
        if request.lora_name:
            return "a LoRA adapter's prefix keys differ per replica"
        return ""

    async def run(self, request: Request, transfer: scheduler_pb2.KVTransfer) -> int:
        """Pull what the prefill replica holds of `request`'s prompt; the number of its leading
        blocks this replica now has without computing them (0 after any failure)."""
        self.stats.num_requests += 1
        why = self.skip_reason(request, transfer)
        if why:
            log.info("request %s: KV not imported (%s): its prompt is computed here", request.request_id, why)
            self.stats.num_failed += 1
            return 0
        keys: list[bytes] = []
        began, reserved = time.perf_counter(), 0
        try:
            plan = await self._plan_with_room(request, transfer)
            if plan is None:
                raise RuntimeError(f"no room in the import level within {ROOM_WAIT_S:.0f} s")
            indices, keys, present, reserved = plan.indices, plan.keys, plan.num_present, len(plan.indices)
            if indices:
                await self._pull(transfer, indices, keys)
                await self.kv.commit_import(keys)
        except (Exception, asyncio.CancelledError) as exc:
            self.stats.num_failed += 1
            if keys:  # (shielded: a cancelled request still cleans up)
                await asyncio.shield(self._forget(keys))
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.warning("request %s: KV import failed (%s): its prompt is computed here", request.request_id, exc)
            return 0
        finally:
            self._pulling -= reserved
        self.stats.num_imported += 1
        self.stats.pull_s += time.perf_counter() - began
        return present + len(indices)

    async def _plan_with_room(self, request: Request, transfer: scheduler_pb2.KVTransfer) -> ImportPlan | None:
        """The blocks to pull, their room taken (`_pulling`), once the import level has it beside
        what it holds and what is being pulled; None after ROOM_WAIT_S. A burst of long prompts
        waits its turn instead of overflowing the stages' import areas into recomputation: one
        request at a time asks again, less often the longer it waits."""
        deadline = time.monotonic() + ROOM_WAIT_S
        plan = await self._plan_if_room(request, transfer)
        if plan is not None:
            return plan
        self.stats.num_waited += 1
        try:
            await asyncio.wait_for(self._room_turn.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None
        try:
            pause = ROOM_POLL_S[0]
            while time.monotonic() < deadline:
                await asyncio.sleep(pause)
                plan = await self._plan_if_room(request, transfer)
                if plan is not None:
                    return plan
                pause = min(2 * pause, ROOM_POLL_S[1])
            return None
        finally:
            self._room_turn.release()

    async def _plan_if_room(self, request: Request, transfer: scheduler_pb2.KVTransfer) -> ImportPlan | None:
        plan = await self.kv.import_plan(self.namespace, request.prompt, transfer.num_blocks)
        need = len(plan.indices)
        if need and plan.capacity and plan.num_held + self._pulling + need > plan.capacity:
            return None
        self._pulling += need
        return plan

    async def _pull(self, transfer: scheduler_pb2.KVTransfer, indices: list[int], keys: list[bytes]) -> None:
        replies = await self.transport.pull_blocks(
            list(transfer.stage_addresses), transfer.seq_id, indices, keys, PULL_TIMEOUT_S
        )
        failed = [f"stage {i}: {r}" for i, r in enumerate(replies) if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError("; ".join(failed))
        self.stats.num_blocks += len(indices)
        self.stats.num_bytes += sum(r.num_bytes for r in replies)

    async def _forget(self, keys: list[bytes]) -> None:
        try:
            await self.kv.forget_import(keys)
        except Exception as exc:  # noqa: BLE001 - the stages' copies expire on their own
            log.warning("forgetting %d imported keys failed: %s", len(keys), exc)
