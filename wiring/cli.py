"""The `pagoda` command line: one entry point, a subcommand per service or tool.

Subcommands import what they need lazily, so that `pagoda --help` and the torch-free
services start fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from services.defaults import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, NUM_KV_BLOCKS, ROUTING_POLICIES
from wiring.flags import (
    GPU_MEMORY_HELP,
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_MEMORY_HELP,
    PARSERS,
    STALL_HELP,
    TENSOR_PARALLEL_HELP,
    byte_size,
    check_tensor_parallel,
    env_default,
    fraction,
    names,
    optional_limit,
    parse_bool,
)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from wiring import tiny_model

    try:
        spec = tiny_model.spec_from_args(args)
    except ValueError as exc:
        args.parser.error(str(exc))
    finish, trained = None, {}
    if args.train_steps:
        from wiring.tiny_train import TrainingRecipe, train_tiny_model

        try:
            recipe = TrainingRecipe(steps=args.train_steps, seed=spec.seed)
        except ValueError as exc:
            args.parser.error(f"--train-steps: {exc}")

        def finish(path: Path) -> None:
            trained.update(train_tiny_model(path, recipe))

    try:
        out = tiny_model.make_tiny_model(args.out_dir, spec, overwrite=args.overwrite, finish=finish)
    except FileExistsError as exc:
        print(f"error: {exc} (pass --overwrite to replace a model folder)", file=sys.stderr)
        return 1
    how = (f"trained for {args.train_steps} steps (loss {trained['first_loss']:.2f} -> "
           f"{trained['final_loss']:.2f}, held-out {trained['held_out_loss']:.2f})"
           if trained else "random")
    print(f"wrote a {spec.arch} model with {spec.num_parameters:,} parameters ({how}) to {out}")
    return 0


def _cmd_export_gguf(args: argparse.Namespace) -> int:
    from wiring.gguf_export import write_gguf

    try:
        out = write_gguf(args.model_dir, args.out, args.qtype)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size:,} bytes, {args.qtype})")
    return 0


# Tools on the floor above (bench/) run as programs of their own: the wiring floor names them
# and passes the arguments on, it never imports them (`pagoda bench --help` is the tool's help).
TOOLS = {
    "bench": ("bench.cli", "benchmarks against the baselines (JSON, Markdown, plots)"),
    "simulate-routing": ("bench.simulate_routing",
                         "replay a shared-prefix workload against 4-128 simulated replicas per routing policy"),
    "eval-quality": ("bench.quality",
                     "perplexity, KL divergence from float32 and same-top rate per weight format, beside llama.cpp"),
}


def _cmd_tool(args: argparse.Namespace) -> int:
    import subprocess

    module = TOOLS[args.tool][0]
    return subprocess.call([sys.executable, "-m", module, *args.tool_args])


def _cmd_serve(args: argparse.Namespace) -> int:
    from wiring import serve

    return serve.run(args)


def _api_keys(args: argparse.Namespace) -> dict:
    """The gateway's keys: --api-keys-file's grants, plus each --api-key with the defaults."""
    from gateway.config import ApiKey, load_api_keys

    keys = load_api_keys(args.api_keys_file) if args.api_keys_file else {}
    for key in args.api_key or ():
        keys.setdefault(key, ApiKey())
    return keys


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from services.logs import configure_logging
    from worker_svc.config import WorkerConfig
    from worker_svc.errors import CheckpointError
    from worker_svc.server import serve

    configure_logging(f"worker-{args.stage}")
    try:
        config = WorkerConfig(
            model=args.model,
            stage=args.stage,
            num_stages=args.num_stages,
            host=args.host,
            port=args.port,
            next_address=args.next,
            feedback_address=args.feedback,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.max_model_len,
            layer_partition=args.layer_partition,
            dtype=args.dtype,
            device=args.device,
            num_threads=args.num_threads,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        check_tensor_parallel(config.model, config.tensor_parallel_size)
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        asyncio.run(serve(config, ready_file=args.ready_file, metrics_port=args.metrics_port))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # no KV block fits in the memory setting
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_kvcache(args: argparse.Namespace) -> int:
    import asyncio

    from kvcache_svc.config import KVCacheConfig
    from kvcache_svc.server import serve
    from services.logs import configure_logging

    configure_logging("kvcache")
    try:
        config = KVCacheConfig(
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            watermark=args.watermark,
            enable_prefix_caching=args.enable_prefix_caching,
            host=args.host,
            port=args.port,
            events_kept=args.events_kept,
            replica_id=args.replica_id,
            redis_url=args.redis_url or "",
        )
    except ValueError as exc:
        args.parser.error(str(exc))
    asyncio.run(serve(config, ready_file=args.ready_file, metrics_port=args.metrics_port))
    return 0


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every engine setting (`SchedulerConfig`'s fields that carry an `EngineArg`) as a
    kebab-case flag with a PAGODA_* default: generated, so the flag, the variable and the
    field cannot drift apart."""
    from scheduler_svc.config import engine_args

    for name, arg, default in engine_args():
        flag = "--" + name.replace("_", "-")
        value = env_default(name, default, PARSERS[arg.kind])
        if arg.kind in ("bool", "auto_bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=arg.help)
        elif arg.kind == "switch":
            p.add_argument(flag, action="store_true", default=value, help=arg.help)
        else:
            p.add_argument(flag, type=PARSERS[arg.kind], choices=arg.choices, default=value, help=arg.help)


def scheduler_config_from_args(args: argparse.Namespace, model: str):
    import os

    from scheduler_svc.config import SchedulerConfig, engine_args

    settings = {name: getattr(args, name) for name, _, _ in engine_args()}
    if settings["max_model_len"] is None:
        from wiring.launcher import model_max_len

        settings["max_model_len"] = model_max_len(model)
    trace_file = None
    if os.environ.get("PAGODA_TRACE_SCHEDULER") == "1":
        trace_file = os.environ.get("PAGODA_TRACE_FILE") or "pagoda-scheduler-trace.jsonl"
    return SchedulerConfig(model=model, trace_file=trace_file, **settings)


def _cmd_scheduler(args: argparse.Namespace) -> int:
    import asyncio

    from scheduler_svc.server import serve
    from services.logs import configure_logging

    configure_logging("scheduler")
    stages = [a for a in (args.stages or "").split(",") if a]
    if not stages:
        args.parser.error("--stages: at least one HOST:PORT is needed")
    try:
        config = scheduler_config_from_args(args, args.model)
    except ValueError as exc:
        args.parser.error(str(exc))
    if len(stages) != config.pipeline_parallel_size:
        if args.pipeline_parallel_size == 1:
            from dataclasses import replace

            config = replace(config, pipeline_parallel_size=len(stages))
        else:
            args.parser.error(f"--stages lists {len(stages)} stages, --pipeline-parallel-size is "
                              f"{config.pipeline_parallel_size}")
    asyncio.run(serve(config, args.host, args.port, args.kvcache, stages, ready_file=args.ready_file,
                      metrics_port=args.metrics_port))
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.server import serve
    from services.logs import configure_logging

    configure_logging("gateway")
    from wiring.launcher import model_max_len

    max_model_len = args.max_model_len or model_max_len(args.model)
    try:
        config = GatewayConfig(
            model=args.model,
            scheduler_address=args.scheduler,
            routing=args.routing,
            served_model_names=tuple(args.served_model_name or ()),
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            api_keys=_api_keys(args),
            max_body_bytes=args.max_body_bytes,
            max_model_len=max_model_len,
            grace_period_s=args.grace_period,
            stream_stall_timeout_s=args.stream_stall_timeout,
            metrics_require_key=args.metrics_require_key,
            rate_limit_rpm=args.rate_limit_rpm,
            rate_limit_tpm=args.rate_limit_tpm,
            redis_url=args.redis_url or "",
        )
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        asyncio.run(serve(config))
    except ValueError as exc:  # the model directory has no usable tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="Pagoda: an LLM inference server built as gRPC microservices."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tiny_model_command(sub)
    _add_export_gguf_command(sub)
    _add_worker_command(sub)
    _add_kvcache_command(sub)
    _add_scheduler_command(sub)
    _add_gateway_command(sub)
    _add_tool_commands(sub)
    _add_k8s_manifests_command(sub)
    _add_serve_command(sub)
    return parser


def _add_tiny_model_command(sub) -> None:
    p = sub.add_parser("tiny-model", help="write a small Hugging Face checkpoint (random or briefly trained), offline")
    p.add_argument("out_dir", type=Path, help="directory to write (created; replaced if it exists)")
    from wiring import tiny_model

    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder")
    p.add_argument("--train-steps", type=int, default=0, metavar="N",
                   help="train the model for N steps on its tokenizer's text (needs torch; "
                        "default 0: random weights)")
    tiny_model.add_cli_arguments(p)
    p.set_defaults(func=_cmd_tiny_model, parser=p)


def _add_export_gguf_command(sub) -> None:
    p = sub.add_parser("export-gguf", help="write a GGUF file (Q8_0, Q4_0, Q4_1, BF16 or F32) from a checkpoint folder")
    p.add_argument("model_dir", type=Path, help="a Llama, Mistral or Qwen2 checkpoint folder (safetensors)")
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--type", dest="qtype", default="Q8_0", choices=("Q8_0", "Q4_0", "Q4_1", "BF16", "F32"),
                   help="the 2-D weights' format (default Q8_0; norms stay F32)")
    p.set_defaults(func=_cmd_export_gguf, parser=p)


def _add_worker_command(sub) -> None:
    from worker_svc.config import (  # (no torch: the settings only)
        KV_CACHE_DTYPES,
        QUANTIZATION_METHODS,
    )

    p = sub.add_parser("worker", help="serve one pipeline stage (pagoda.v1.StageWorker)")
    p.add_argument("--model", default=env_default("model"), required=env_default("model") is None,
                   help="checkpoint directory")
    p.add_argument("--stage", type=int, default=env_default("stage", 0, int))
    p.add_argument("--num-stages", type=int, default=env_default("num_stages", 1, int))
    p.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=env_default("port", 0, int), help="0 picks a free port")
    p.add_argument("--next", default=env_default("next"), help="HOST:PORT of the next stage (not on the last)")
    p.add_argument("--feedback", default=env_default("feedback"),
                   help="last stage of several: HOST:PORT of the first stage, which then gets each "
                        "sampled token straight from here, not through the scheduler")
    p.add_argument("--num-kv-blocks", type=int, default=env_default("num_kv_blocks", None, int),
                   help=f"blocks in the KV pool (default: sized from a memory setting below, else {NUM_KV_BLOCKS}; "
                        "given with a memory setting, the stage checks at start that they fit in it)")
    p.add_argument("--block-size", type=int, default=env_default("block_size", BLOCK_SIZE, int))
    p.add_argument("--gpu-memory-utilization", type=fraction, metavar="F",
                   default=env_default("gpu_memory_utilization", None, fraction), help=GPU_MEMORY_HELP)
    p.add_argument("--kv-cache-memory", type=byte_size, metavar="BYTES",
                   default=env_default("kv_cache_memory", None, byte_size), help=KV_CACHE_MEMORY_HELP)
    p.add_argument("--max-model-len", type=int, default=env_default("max_model_len", None, int),
                   help="the longest context: the memory profile counts what a prefill chunk there needs")
    p.add_argument("--layer-partition", type=_int_list, default=env_default("layer_partition", None, _int_list),
                   help="layers per stage, e.g. 3,5 (default: even split)")
    p.add_argument("--tensor-parallel-size", type=int, default=env_default("tensor_parallel_size", 1, int),
                   metavar="T", help=TENSOR_PARALLEL_HELP)
    p.add_argument("--dtype", default=env_default("dtype", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=env_default("device"), help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--num-threads", type=int, default=env_default("num_threads", None, int),
                   help="torch intra-op threads (default: cores / num-stages, at least 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=env_default("max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS, int))
    p.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", 256, int))
    p.add_argument("--attention-backend", default=env_default("attention_backend"),
                   choices=["cpu", "torch", "triton"],
                   help="default: triton on CUDA, cpu (a native decode kernel; torch prefill) on the "
                        "CPU; torch: the reference")
    p.add_argument("--quantization", default=env_default("quantization"), choices=[None, *QUANTIZATION_METHODS])
    p.add_argument("--kv-cache-dtype", default=env_default("kv_cache_dtype", "auto"), choices=KV_CACHE_DTYPES,
                   help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", None, int),
                   help="serve Prometheus metrics on this port (off by default)")
    p.add_argument("--ready-file", help="write the bound port here once serving")
    p.set_defaults(func=_cmd_worker, parser=p)


def _add_kvcache_command(sub) -> None:
    p = sub.add_parser("kvcache", help="serve the KV-cache manager (pagoda.v1.KVCache)")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=env_default("port", 0, int), help="0 picks a free port")
    # one flag name for the pool on every service (--num-blocks: the old spelling, kept working)
    p.add_argument("--num-kv-blocks", "--num-blocks", dest="num_blocks", type=int,
                   default=env_default("num_kv_blocks", NUM_KV_BLOCKS, int),
                   help="KV blocks in the pool, as every stage's and the scheduler's --num-kv-blocks")
    p.add_argument("--block-size", type=int, default=env_default("block_size", BLOCK_SIZE, int),
                   help="slots per block: the workers' --block-size")
    p.add_argument("--watermark", type=float, default=env_default("watermark", 0.01, float),
                   help="fraction of blocks a new sequence must leave free")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=env_default("enable_prefix_caching", True, parse_bool),
                   help="turn the prefix cache off")
    p.add_argument("--events-kept", type=int, default=env_default("events_kept", 65_536, int),
                   help="KV events kept for SubscribeEvents subscribers that reconnect")
    p.add_argument("--replica-id", default=env_default("replica_id", "r0"),
                   help="this replica's name in the prefix index (routers: gateway --scheduler NAME=...)")
    p.add_argument("--redis-url", default=env_default("redis_url"),
                   help="keep this replica's prefix-cache index in Redis for routers "
                        "(kvcache_svc/publisher.py)")
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", None, int),
                   help="serve Prometheus metrics on this port (off by default)")
    p.add_argument("--ready-file", help="write the bound port here once serving")
    p.set_defaults(func=_cmd_kvcache, parser=p)


def _add_scheduler_command(sub) -> None:
    p = sub.add_parser("scheduler", help="serve the scheduler (pagoda.v1.Scheduler)")
    p.add_argument("--model", default=env_default("model"), required=env_default("model") is None,
                   help="checkpoint directory (for its tokenizer's EOS ids and max length)")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_default("port", 0, int))
    p.add_argument("--kvcache", default=env_default("kvcache"), required=env_default("kvcache") is None,
                   help="HOST:PORT of the KV-cache service, or 'in-process' to embed the KV manager")
    p.add_argument("--stages", default=env_default("stages"), required=env_default("stages") is None,
                   help="HOST:PORT of every stage worker, in order, comma-separated")
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", None, int),
                   help="serve Prometheus metrics on this port (off by default)")
    p.add_argument("--ready-file", help="write the bound port here once serving")
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_scheduler, parser=p)


def _add_gateway_command(sub) -> None:
    p = sub.add_parser("gateway", help="serve the REST (OpenAI-compatible) and gRPC front door")
    p.add_argument("--model", default=env_default("model"), required=env_default("model") is None,
                   help="checkpoint directory (its tokenizer, chat template and max length)")
    p.add_argument("--scheduler", default=env_default("scheduler"), required=env_default("scheduler") is None,
                   help="HOST:PORT of the scheduler; or several replicas' schedulers, "
                        "NAME=HOST:PORT,NAME=HOST:PORT,... (the names their KV services publish "
                        "as --replica-id), and this gateway routes among them")
    p.add_argument("--routing", default=env_default("routing", "prefix"), choices=ROUTING_POLICIES,
                   help="with several replicas: prefix (the replica holding most of the prompt's "
                        "prefix, weighed against load; needs --redis-url, else by load), "
                        "least-loaded or round-robin (default prefix)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", default=env_default("served_model_name", None, names),
                   help="the names clients may send as `model`, the first reported in responses "
                        "(default: the --model string, and the directory's name)")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="address to bind (default loopback; beyond it API keys are required)")
    p.add_argument("--port", type=int, default=env_default("port", 8000, int), help="REST port")
    p.add_argument("--grpc-port", type=int, default=env_default("grpc_port", 50051, int),
                   help="gRPC port (pagoda.v1.Generation, health, reflection)")
    p.add_argument("--api-keys-file", default=env_default("api_keys_file"),
                   help='JSON {"<key>": {"tenant": "...", "priority": 0}}; without it, no keys')
    p.add_argument("--metrics-require-key", action="store_true",
                   default=env_default("metrics_require_key", False, lambda v: v.strip().lower() in ("1", "true", "yes")),
                   help="with API keys, /metrics needs one too (default: open to scrapers, as /health)")
    p.add_argument("--api-key", nargs="+", metavar="KEY", default=env_default("api_key", None, names),
                   help="keys clients send as `Authorization: Bearer KEY`, as vLLM's --api-key "
                        "(default tenant and priority; beside --api-keys-file)")
    p.add_argument("--max-model-len", type=int, default=env_default("max_model_len", None, int),
                   help="default: the model's max_position_embeddings")
    p.add_argument("--max-body-bytes", type=int, default=env_default("max_body_bytes", 4 * 1024 * 1024, int),
                   help="largest request body (REST) and request message (gRPC), bytes")
    p.add_argument("--grace-period", type=float, default=env_default("grace_period", 30.0, float),
                   help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--stream-stall-timeout", type=float, default=env_default("stream_stall_timeout", 30.0, float),
                   metavar="SECONDS", help=STALL_HELP)
    p.add_argument("--rate-limit-rpm", type=optional_limit,
                   default=env_default("rate_limit_rpm", None, optional_limit), metavar="N",
                   help="requests per minute per API key without its own requests_per_minute "
                        "(without keys: for all anonymous use); default: unlimited")
    p.add_argument("--rate-limit-tpm", type=optional_limit,
                   default=env_default("rate_limit_tpm", None, optional_limit), metavar="N",
                   help="tokens (prompt + max_tokens) per minute per API key without its own "
                        "tokens_per_minute; default: unlimited")
    p.add_argument("--redis-url", default=env_default("redis_url"), metavar="URL",
                   help="redis://host:port/db: keep rate-limit buckets in Redis, shared by every "
                        "gateway replica using it (fails open when Redis is down; default: "
                        "in this process), and read the replicas' prefix index there")
    p.set_defaults(func=_cmd_gateway, parser=p)


def _add_tool_commands(sub) -> None:
    for name, (_, tool_help) in TOOLS.items():
        p = sub.add_parser(name, help=tool_help, add_help=False, prefix_chars="\0")
        p.add_argument("tool_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_cmd_tool, tool=name, parser=p)


def _add_k8s_manifests_command(sub) -> None:
    p = sub.add_parser("k8s-manifests", help="Kubernetes manifests for N replicas (docs/deploy.md)")
    from wiring import k8s

    k8s.add_arguments(p)
    p.set_defaults(func=k8s.run, parser=p)


def _add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="serve a model: the whole stack as local processes")
    from wiring import serve

    serve.add_arguments(p, env_default)
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_serve, parser=p)


def main(argv: Sequence[str] | None = None) -> int:
    from services.process import die_with_parent

    die_with_parent()  # a service `pagoda serve` started: it never outlives it
    args = build_parser().parse_args(argv)
    model = getattr(args, "model", None)
    if args.func is not _cmd_serve and isinstance(model, str) and model:
        from wiring.model_source import is_gguf, prepare_gguf

        if is_gguf(model):  # a service given a GGUF file serves its prepared folder
            try:
                args.model = str(prepare_gguf(model))
            except (ValueError, OSError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
    return int(args.func(args) or 0)



if __name__ == "__main__":
    sys.exit(main())
