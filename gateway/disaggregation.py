"""P/D disaggregation at the gateway (issue 39): a prompt is computed on a prefill replica,
then decoded on a decode replica that pulls its KV blocks instead of computing them.

`pagoda gateway --scheduler d0=HOST:PORT,... --prefill-scheduler p0=HOST:PORT,...`: the
`--scheduler` replicas decode, routed by load (what they hold matters little: the prompt's
blocks are pulled), the `--prefill-scheduler` ones prefill, routed by `--routing` (by default
prefix: the prefill replica holding most of the prompt computes least).
For a request whose prompt has at least `min_prompt_tokens` tokens (and no prompt logprobs,
LoRA adapter or pooling, which the decode side computes itself), `PrefillPool.prefill` sends
the prompt to a prefill replica with max_tokens 1 and `kv_export`: that scheduler computes it
and holds its blocks, answering with a `KVTransfer`. The request then goes to a decode replica
with that transfer as `kv_import` (scheduler_svc/kv_transfer.py); once the decode replica has
answered (or failed), `release` tells the prefill replica to let the blocks go (an Abort of the
finished request; the prefill side also lets go by itself after 30 s).

Anything failing on the prefill side (no prefill replica, an error, a replica killed mid-way)
sends the request to the decode replicas without a transfer: they compute the prompt. Greedy
output is the same either way (the decode side computes the prompt's last block and samples).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from gateway.replicas import Replica, ReplicaSet
from gateway.routing import NoReplica
from services.pb import scheduler_pb2

log = logging.getLogger(__name__)

PREFILL_TIMEOUT_S = 600.0  # a prompt's prefill, queueing included
MIN_PROMPT_TOKENS = 33  # two full blocks of 16 to pull and one token computed: shorter prompts decode alone


@dataclass
class PrefillStats:
    num_prefilled: int = 0  # requests whose prompt a prefill replica computed and holds
    num_local: int = 0  # requests sent to a decode replica alone (short prompt, logprobs, LoRA)
    num_failed: int = 0  # prefills that failed: the decode side computed the prompt
    num_released: int = 0


class PrefillPool:
    """The prefill replicas (a `ReplicaSet` routed by prefix) and the calls P/D makes of them."""

    def __init__(
        self,
        targets: Sequence[tuple[str, str]],
        routing: str = "prefix",
        redis_url: str = "",
        min_prompt_tokens: int = MIN_PROMPT_TOKENS,
    ) -> None:
        self.replicas = ReplicaSet(targets, routing, redis_url)
        self.min_prompt_tokens = min_prompt_tokens
        self.stats = PrefillStats()

    def start(self) -> None:
        self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()

    def wanted(self, request: scheduler_pb2.GenerateRequest) -> bool:
        """Whether `request`'s prompt is computed on a prefill replica."""
        sp = request.sampling_params
        wanted = (
            len(request.prompt_token_ids) >= self.min_prompt_tokens
            and not request.lora_name
            and not request.pooling
            and not sp.HasField("prompt_logprobs")
        )
        if not wanted:
            self.stats.num_local += 1
        return wanted

    async def prefill(
        self, request: scheduler_pb2.GenerateRequest, metadata, session: str = ""
    ) -> tuple[Replica, scheduler_pb2.KVTransfer] | None:
        """Compute `request`'s prompt on a prefill replica, which then holds its blocks:
        (that replica, the transfer for the decode side), or None when that failed."""
        try:
            replica, _ = await self.replicas.pick(request.prompt_token_ids, session or None)
        except NoReplica as exc:
            self.stats.num_failed += 1
            log.info("request %s: no prefill replica (%s): decoded alone", request.request_id, exc)
            return None
        prefill = scheduler_pb2.GenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            priority=request.priority,
            tenant=request.tenant,
            arrival_time_ns=request.arrival_time_ns,
            kv_export=True,
        )
        prefill.trace_context.CopyFrom(request.trace_context)
        prefill.sampling_params.max_tokens = 1
        prefill.sampling_params.temperature = 0.0
        prefill.sampling_params.ignore_eos = True
        transfer = None
        try:
            with self.replicas.in_flight(replica):
                async for resp in replica.connect().Generate(prefill, metadata=metadata, timeout=PREFILL_TIMEOUT_S):
                    if resp.HasField("kv_export"):
                        transfer = resp.kv_export
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.replicas.mark_down(replica, f"UNAVAILABLE: {exc.details()}")
            log.info(
                "request %s: prefill on %s failed (%s: %s): decoded alone",
                request.request_id,
                replica.name,
                exc.code().name,
                exc.details(),
            )
        if transfer is None:
            self.stats.num_failed += 1
            return None
        if not transfer.num_blocks:  # (nothing to pull after all: let go at once)
            await self.release(replica, request.request_id)
            return None
        self.stats.num_prefilled += 1
        return replica, transfer

    async def release(self, replica: Replica, request_id: str) -> None:
        """The decode side has what it needs (or gave up): the prefill replica lets go."""
        try:
            await replica.connect().Abort(scheduler_pb2.AbortRequest(request_id=request_id), timeout=2.0)
            self.stats.num_released += 1
        except grpc.aio.AioRpcError as exc:  # its hold ends by itself
            log.info("releasing %s on %s: %s", request_id, replica.name, exc.code().name)
