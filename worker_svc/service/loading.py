"""The runner a stage serves: its weights loaded on its device and its KV pool sized and
allocated, or an emulated device (worker_svc/execution/emulated.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.kv_offload import parse_kv_offload
from services.settings import lora_modules
from worker_svc.config import WorkerConfig
from worker_svc.execution.drafter import drafter_for
from worker_svc.execution.kv_tier import KVTierStore
from worker_svc.execution.kv_tier_files import process_folder_name, sweep_dead_folders
from worker_svc.execution.runner import StageRunner
from worker_svc.weights.lora import bank_for


def load_runner(config: WorkerConfig):
    """(runner, how its pool was sized or None, its tensor-parallel group or None): the stage's
    weights loaded on its device, its KV pool sized and allocated."""
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.device import default_attention_backend, resolve_device
    from worker_svc.execution.memory import kv_pool_dtype, stage_pool
    from worker_svc.kernels.cpu_kernels import keep_freed_memory

    torch.set_num_threads(config.resolved_num_threads)
    keep_freed_memory()
    device = resolve_device(config.device)
    group = None
    if config.tensor_parallel_size > 1:  # ranks 1..T-1 start now and load beside this one
        from worker_svc.execution.tensor_parallel import start_ranks

        group = start_ranks(config, device)
    model = load_stage(
        config.model,
        config.stage,
        config.num_stages,
        config.layer_partition,
        config.dtype,
        device,
        quantization=config.quantization,
        tp_size=config.tensor_parallel_size,
        expert_parallel=config.enable_expert_parallel,
    )
    if group is not None:
        model.set_reduce(group.all_reduce)
    backend = config.attention_backend or default_attention_backend(device)
    layout = model.kv_layout if model.kv_layout.grouped else None  # KV groups: services/kv_layout.py
    if group is not None:
        layout = group.share_layout(layout, model.kv_layout)
    num_blocks, sizing = stage_pool(config, model, backend, group, layout)
    drafter = drafter_for(
        config.speculative_config,
        is_last=config.is_last,
        vocab_size=model.config.vocab_size,
        max_model_len=config.max_model_len or model.config.max_position_embeddings,
        num_blocks=num_blocks,
        block_size=config.block_size,
        dtype=next(model.parameters()).dtype,
        device=device,
        backend=backend,
    )
    lora = bank_for(
        model,
        enable=config.enable_lora,
        modules=lora_modules(config.lora_modules),
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
    )
    runner = StageRunner(
        model,
        num_blocks,
        config.block_size,
        backend,
        kv_dtype=kv_pool_dtype(config, model),
        tp=group,
        step_threads=config.step_threads,
        drafter=drafter,
        lora=lora,
        layout=layout,
    )
    attach_kv_tier(runner, config)
    return runner, sizing, group


def emulated_runner(config: WorkerConfig):
    """The stage on an emulated device (worker_svc/execution/emulated.py): config.json only, no weights,
    no KV tensors, no tensor-parallel ranks (the profile models them); one thread, for the
    zeros it hands on and the wire."""
    from worker_svc.execution.emulated import build_emulated_runner

    torch.set_num_threads(1)
    return build_emulated_runner(config)


def attach_kv_tier(runner: StageRunner, config: WorkerConfig) -> None:
    """The stage's part of the KV tier (`--kv-offload`, in blocks of the pipeline: `pagoda serve`
    converts GiB), bounded by the same block counts as the KV manager's index, and its import
    area (`--kv-import-blocks`, P/D disaggregation's decode side; with no --kv-offload, a store
    of no host and no disk blocks). ValueError when the stage cannot hold one (tensor
    parallelism, KV groups)."""
    offload = parse_kv_offload(config.kv_offload)
    if offload is None and not config.kv_import_blocks:
        return
    what = "kv_offload: a KV tier" if offload is not None else "kv_import_blocks: an import area"
    if config.tensor_parallel_size > 1:
        raise ValueError(f"{what} needs --tensor-parallel-size 1")
    if runner.num_kv_groups > 1:
        raise ValueError(f"{what} needs one KV group (this model has sliding-window sub-groups)")
    disk_path = offload.disk_path if offload is not None else ""
    if disk_path:  # the folders of stage processes killed before they cleaned up
        sweep_dead_folders(Path(disk_path))
    runner.kv_tier = KVTierStore(
        runner.kv_cache,
        offload.host_blocks if offload is not None else 0,
        disk_path or None,
        offload.disk_blocks if disk_path else 0,
        name=process_folder_name(config.stage, config.num_stages),
        import_blocks=config.kv_import_blocks,
    )
