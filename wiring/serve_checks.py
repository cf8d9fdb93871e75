"""What `pagoda serve` settles before it starts anything: the checkpoint folder to serve
(`served_model_dir`), the sampling defaults in words, and the checks that refuse what would
make the stack die after starting (`check_start`: wiring/preflight.py's checks, and the
services' configs, made of `pagoda serve`'s arguments). `Refused` carries the one line
`pagoda serve` prints before exiting with code 2."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from wiring.flags import config_values, service_settings
from wiring.kv_pool import kv_offload_in_blocks, model_kv_groups
from wiring.launcher import port_taken


class Refused(Exception):
    """`pagoda serve` cannot start as asked: the message is printed, the exit code is 2."""


def served_model_dir(args: argparse.Namespace) -> str:
    """The checkpoint folder to serve (a folder as given; a GGUF file's prepared folder; no
    model: the default one); sets the served names as vLLM does when none are given."""
    from gateway.config import default_model_names
    from wiring.model_source import resolve_model

    if args.model_tag:
        if args.model and args.model != args.model_tag:
            raise Refused(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    try:
        folder, names = resolve_model(args.model, log=lambda line: print(line, flush=True))
    except (ValueError, OSError) as exc:
        raise Refused(str(exc)) from exc
    model_dir = str(folder)
    if not args.served_model_name:  # as vLLM: the --model string as given (and the folder's name)
        args.served_model_name = list(dict.fromkeys(names or default_model_names(args.model)))
    if not (Path(model_dir) / "config.json").is_file():
        raise Refused(f"{model_dir} is not a checkpoint directory (no config.json) or a GGUF file")
    return model_dir


def describe_sampling_defaults(args: argparse.Namespace, model_dir: str) -> str:
    """What a request that leaves sampling fields out gets (--generation-config), in words."""
    from services.generation_config import sampling_defaults

    try:
        return sampling_defaults(model_dir, args.generation_config, args.override_generation_config).describe()
    except ValueError as exc:
        raise Refused(str(exc)) from exc


DEFAULT_IMPORT_BLOCKS = 512  # a decode replica's room for pulled blocks not yet loaded


def check_start(args: argparse.Namespace, model_dir: str) -> list[str]:
    """What would make the stack die after starting, refused before anything starts
    (wiring/preflight.py); returns what to say before starting (a max_model_len lowered to
    what the pool holds, more stage processes than cores)."""
    for name, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if port and port_taken(args.host, port):  # (it would start all, then die as the gateway)
            raise Refused(f"{name} {port} is taken on {args.host}: stop what holds it or choose another port")
    if not 1 <= args.replicas <= 64:
        raise Refused(f"--replicas must be 1..64, got {args.replicas}")
    args.replica_roles = replica_roles(args)
    args.replicas = len(args.replica_roles)
    try:
        if args.decode_replicas and "," in model_kv_groups(model_dir):
            raise ValueError("P/D disaggregation needs one KV group (this model has sliding-window sub-groups)")
        _check_kv_offload(args, model_dir)
        return _check_model_and_settings(args, model_dir)
    except ValueError as exc:
        raise Refused(str(exc)) from exc


def replica_roles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, role) of every replica: r0, r1 ... ("" role: aggregated), or with P/D
    disaggregation p0 ... ("prefill") then d0 ... ("decode"). Refused: what P/D cannot serve."""
    n, m = getattr(args, "prefill_replicas", 0), getattr(args, "decode_replicas", 0)
    if not n and not m:
        return [(f"r{r}", "") for r in range(args.replicas)]
    if not (1 <= n <= 32 and 1 <= m <= 32):
        raise Refused(f"--prefill-replicas and --decode-replicas go together, 1..32 each; got {n} and {m}")
    if args.replicas != 1:
        raise Refused("--replicas with --prefill-replicas/--decode-replicas: give the two pools' sizes only")
    if args.tensor_parallel_size > 1:
        raise Refused("P/D disaggregation moves KV blocks stage by stage: it needs --tensor-parallel-size 1")
    if not args.enable_prefix_caching:
        raise Refused(
            "P/D disaggregation: the decode side finds pulled blocks as prefix hits: drop --no-prefix-caching"
        )
    if not args.kv_import_blocks:
        args.kv_import_blocks = DEFAULT_IMPORT_BLOCKS
    return [(f"p{i}", "prefill") for i in range(n)] + [(f"d{i}", "decode") for i in range(m)]


def _check_kv_offload(args: argparse.Namespace, model_dir: str) -> None:
    """A KV tier needs prefix caching, one process per stage and one KV group; ValueError.
    `args.kv_offload` becomes the block form every service takes."""
    from services.kv_offload import GIB, parse_kv_offload
    from wiring.preflight import machine_memory_bytes

    if parse_kv_offload(args.kv_offload) is None:
        return
    spec = parse_kv_offload(args.kv_offload)
    if not spec.in_blocks and spec.host * GIB > 0.8 * machine_memory_bytes():  # (a slab filled mid-serving)
        raise ValueError(
            f"--kv-offload host:{spec.host:g} GiB is over 80% of this machine's memory "
            f"({machine_memory_bytes() / GIB:.1f} GiB), beside the pool and the weights: give less"
        )
    args.kv_offload = kv_offload_in_blocks(
        args.kv_offload, model_dir, args.block_size, getattr(args, "kv_cache_dtype", "auto")
    )
    if not args.enable_prefix_caching:
        raise ValueError("--kv-offload keeps evicted prefixes: it needs prefix caching (drop --no-prefix-caching)")
    if args.tensor_parallel_size > 1:
        raise ValueError("--kv-offload: a KV tier needs --tensor-parallel-size 1")
    if "," in model_kv_groups(model_dir):
        raise ValueError("--kv-offload: a KV tier needs one KV group (this model has sliding-window sub-groups)")


def _check_model_and_settings(args: argparse.Namespace, model_dir: str) -> list[str]:
    """The checkpoint, the tokenizers, the services' configs and the shape of the stack
    against each other; lowers `args.max_model_len` to what a fixed pool holds when it was
    not given. ValueError in one line."""
    from wiring import preflight
    from worker_svc.config import emulated_profile_spec

    emulated = emulated_profile_spec(args.device) is not None  # no weights loaded, nothing computed
    checkpoint = preflight.read_checkpoint(model_dir, weights=not emulated)
    preflight.check_tokenizers(model_dir, args.tokenizer)
    if args.chat_template is not None:
        preflight.read_chat_template(args.chat_template)
    _check_configs(args, model_dir)
    preflight.check_draft_model(args.speculative_config, checkpoint.config, model_dir)
    preflight.check_lora_modules(args.lora_modules, args.max_lora_rank)
    pp, tp = args.pipeline_parallel_size, args.tensor_parallel_size
    preflight.check_stages(checkpoint.config, pp, tp, args.enable_expert_parallel)
    memory = args.num_kv_blocks is None and bool(args.gpu_memory_utilization or args.kv_cache_memory)
    args.max_model_len, note = preflight.serve_max_model_len(
        args.max_model_len,
        checkpoint.config.max_position_embeddings,
        preflight.fixed_pool(args.num_kv_blocks, memory),
        args.block_size,
        args.num_kv_blocks is not None,
    )
    if memory and args.gpu_memory_utilization and preflight.on_the_cpu(args.device):
        preflight.check_memory_fraction(
            args.gpu_memory_utilization,
            checkpoint.least_weight_bytes(args.quantization),
            pp * tp,
            preflight.machine_memory_bytes(),
        )
    warning = "" if emulated else preflight.cores_warning(pp, tp, args.replicas, preflight.usable_cores())
    return [line for line in (note, warning) if line]


def _check_configs(args: argparse.Namespace, model_dir: str) -> None:
    """The scheduler's, a stage's and the gateway's configs as they will be made of these
    flags (each service would refuse a bad value only once started); ValueError naming the flag."""
    from gateway.config import ApiKey, GatewayConfig, load_api_keys
    from scheduler_svc.config import SchedulerConfig
    from worker_svc.config import WorkerConfig

    keys = load_api_keys(args.api_keys_file) if args.api_keys_file else {}
    keys.update({key: ApiKey() for key in args.api_key or () if key not in keys})
    for service, make in (
        ("scheduler", SchedulerConfig),
        ("worker", partial(WorkerConfig, num_stages=1)),
        ("gateway", partial(GatewayConfig, scheduler_address="127.0.0.1:1", api_keys=keys)),
    ):
        settings = service_settings(service)
        try:
            make(**{**config_values(settings, args), "model": model_dir})
        except ValueError as exc:
            field, _, reason = str(exc).partition(": ")
            flag = next((b.setting.flag for b in settings if b.field == field and b.setting.command_line), field)
            raise ValueError(f"{flag}: {reason}") from None
