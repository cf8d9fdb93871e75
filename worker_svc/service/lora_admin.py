"""Loading and unloading LoRA adapters on a stage, between steps."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

import grpc

from services.pb import worker_pb2
from worker_svc.execution.runner import StageRunner
from worker_svc.weights.lora import LoraBankFullError, load_adapter

log = logging.getLogger(__name__)


class LoraAdmin:
    """Applies adapter loads and unloads on the compute thread (`executor`): a step never sees a
    slot half written."""

    def __init__(self, runner, executor: Executor) -> None:
        self.runner = runner
        self.executor = executor
        self.bank = runner.lora if isinstance(runner, StageRunner) else None  # None: LoRA off (or emulated)

    def adapters(self) -> list[worker_pb2.LoraAdapterInfo]:
        """The LoRA adapters this stage holds (none with LoRA off)."""
        return [
            worker_pb2.LoraAdapterInfo(lora_name=h.name, lora_path=h.folder, load_id=h.load_id)
            for h in (self.bank.held if self.bank is not None else ())
        ]

    async def call(self, context, what: str, name: str, path: str, load_id: int = 0) -> worker_pb2.LoraAdapterReply:
        """`what` is "load" or "unload". A full bank is FAILED_PRECONDITION: retrying does not
        free a slot."""
        if self.bank is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is off on this stage (--enable-lora)")
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: required")
        apply = self._unload if what == "unload" else self._load
        failed = await asyncio.get_running_loop().run_in_executor(self.executor, apply, name, path, load_id)
        if failed is not None:
            await context.abort(*failed)
        log.info("LoRA adapter %r %sed; held: %s", name, what, list(self.bank.names))
        return worker_pb2.LoraAdapterReply(lora_names=list(self.bank.names), lora_adapters=self.adapters())

    def _unload(self, name: str, path: str, load_id: int) -> tuple[grpc.StatusCode, str] | None:
        if self.bank.slot_of(name) is None:
            return grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter {name!r} is loaded"
        self.bank.remove(name)
        return None

    def _load(self, name: str, path: str, load_id: int) -> tuple[grpc.StatusCode, str] | None:
        bank, model = self.bank, self.runner.model
        if bank.slot_of(name) is not None:
            return grpc.StatusCode.ALREADY_EXISTS, f"lora_name: an adapter {name!r} is loaded already"
        try:
            bank.add(name, load_adapter(path, model.config, model.start, model.end, max_rank=bank.max_rank), load_id)
        except LoraBankFullError as exc:
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except (ValueError, OSError) as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {exc}"
        return None
