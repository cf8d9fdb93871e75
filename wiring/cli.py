"""The `pagoda` command line: one entry point, a subcommand per service or tool.

Subcommands import what they need lazily, so that `pagoda --help` and the torch-free
services start fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from wiring.flags import add_settings, check_tensor_parallel, config_values, service_settings


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
    how = (
        f"trained for {args.train_steps} steps (loss {trained['first_loss']:.2f} -> "
        f"{trained['final_loss']:.2f}, held-out {trained['held_out_loss']:.2f})"
        if trained
        else "random"
    )
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
    "simulate-routing": (
        "bench.simulate_routing",
        "replay a shared-prefix workload against 4-128 simulated replicas per routing policy",
    ),
    "eval-quality": (
        "bench.quality",
        "perplexity, KL divergence from float32 and same-top rate per weight format, beside llama.cpp",
    ),
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


def _cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from services.logs import configure_logging
    from worker_svc.config import WorkerConfig
    from worker_svc.errors import CheckpointError
    from worker_svc.server import serve

    configure_logging(f"worker-{args.stage}")
    try:
        config = WorkerConfig(**config_values(service_settings("worker"), args))
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
        config = KVCacheConfig(**config_values(service_settings("kvcache"), args))
    except ValueError as exc:
        args.parser.error(str(exc))
    asyncio.run(serve(config, ready_file=args.ready_file, metrics_port=args.metrics_port))
    return 0


def scheduler_config_from_args(args: argparse.Namespace, model: str):
    from scheduler_svc.config import SchedulerConfig
    from services.settings import TRACE_FILE, TRACE_SCHEDULER, env_value

    settings = {**config_values(service_settings("scheduler"), args), "model": model}
    if args.max_model_len is None:  # the flag unset: the checkpoint's
        from wiring.kv_pool import model_max_len

        settings["max_model_len"] = model_max_len(model)
    trace_file = env_value(TRACE_FILE) if env_value(TRACE_SCHEDULER) else None
    return SchedulerConfig(trace_file=trace_file, **settings)


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
            args.parser.error(
                f"--stages lists {len(stages)} stages, --pipeline-parallel-size is {config.pipeline_parallel_size}"
            )

    async def run() -> None:  # (a gRPC client is made inside the event loop that uses it)
        await serve(
            config,
            args.host,
            args.port,
            args.kvcache,
            kv_client(config, args.kvcache),
            stages,
            ready_file=args.ready_file,
            metrics_port=args.metrics_port,
        )

    asyncio.run(run())
    return 0


def kv_client(config, kv_address: str):
    """The scheduler's KV client: the KV manager embedded in its process for "in-process"
    (one process less), else a gRPC client of the KV service at `kv_address`."""
    if kv_address == "in-process":
        from kvcache_svc.client import InProcessKVCacheClient
        from kvcache_svc.core import KVCacheManager
        from kvcache_svc.core.tier import tier_for
        from services.defaults import NUM_KV_BLOCKS
        from services.kv_layout import parse_spec

        return InProcessKVCacheClient(
            KVCacheManager(
                config.num_kv_blocks or NUM_KV_BLOCKS,
                config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                group_windows=parse_spec(config.kv_groups),
                tier=tier_for(config.kv_offload),
            )
        )
    from services.kv_client import GrpcKVCacheClient

    return GrpcKVCacheClient(kv_address)


def _cmd_gateway(args: argparse.Namespace) -> int:
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.server import serve
    from services.logs import configure_logging

    configure_logging("gateway")
    from wiring.kv_pool import model_max_len

    values = config_values(service_settings("gateway"), args)
    values["max_model_len"] = args.max_model_len or model_max_len(args.model)
    try:
        if args.chat_template is not None:  # the tokenizer's folder again, with this template
            from wiring.model_source import tokenizer_with_template
            from wiring.preflight import read_chat_template

            values["chat_template"] = read_chat_template(args.chat_template)
            values["tokenizer"] = str(tokenizer_with_template(args.tokenizer or args.model, values["chat_template"]))
        config = GatewayConfig(**values, api_keys=_api_keys(args))
    except (ValueError, OSError) as exc:
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


def version() -> str:
    """The installed package's version ("unknown" when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pagoda")
    except PackageNotFoundError:
        return "unknown"


class Parser(argparse.ArgumentParser):
    """argparse's parser, refusing in one line. A subcommand's refusal is not preceded by its
    usage (`pagoda serve`'s is dozens of lines that hide the error); a flag no subcommand knows
    is refused by the subcommand given it, naming the flag meant (argparse leaves it to the
    top level, whose usage says nothing of the subcommand's flags)."""

    def error(self, message: str) -> NoReturn:
        if self._subparsers is not None:  # `pagoda` itself: its usage is the list of subcommands
            super().error(message)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = getattr(parsed, "parser", self)  # (each subcommand's, `set_defaults`)
            parser.error(unrecognized(parser, extras))
        return parsed


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """Arguments `parser` does not take, each flag with the closest one it does (a mistyped
    `--max-model-length`: "did you mean --max-model-len?")."""
    import difflib

    known = [o for o in parser._option_string_actions if o.startswith("--")]
    flags = [a for a in extras if a.startswith("-")] or list(extras)  # (not the values after them)
    said = []
    for arg in flags:
        meant = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1) if arg.startswith("-") else []
        said.append(f"{arg} (did you mean {meant[0]}?)" if meant else arg)
    return (
        f"unrecognized argument{'s' if len(said) > 1 else ''} {', '.join(said)}; `{parser.prog} --help` lists the flags"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagoda", description="Pagoda: an LLM inference server built as gRPC microservices.")
    parser.add_argument("--version", action="version", version=f"pagoda {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tiny_model_command(sub)
    _add_export_gguf_command(sub)
    _add_service_commands(sub)
    _add_tool_commands(sub)
    _add_k8s_manifests_command(sub)
    _add_serve_command(sub)
    return parser


def _add_tiny_model_command(sub) -> None:
    p = sub.add_parser("tiny-model", help="write a small Hugging Face checkpoint (random or briefly trained), offline")
    p.add_argument("out_dir", type=Path, help="directory to write (created; replaced if it exists)")
    from wiring import tiny_model

    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder")
    p.add_argument(
        "--train-steps",
        type=int,
        default=0,
        metavar="N",
        help="train the model for N steps on its tokenizer's text (needs torch; default 0: random weights)",
    )
    tiny_model.add_cli_arguments(p)
    p.set_defaults(func=_cmd_tiny_model, parser=p)


def _add_export_gguf_command(sub) -> None:
    from wiring.gguf_export import QTYPES

    p = sub.add_parser(
        "export-gguf", help="write a GGUF file (Q8_0, Q4_K_M, ... as llama.cpp writes it) from a checkpoint folder"
    )
    p.add_argument(
        "model_dir",
        type=Path,
        help="a checkpoint folder (safetensors) of a served architecture "
        "(Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3)",
    )
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument(
        "--type",
        dest="qtype",
        default="Q8_0",
        choices=QTYPES,
        help="the 2-D weights' format (default Q8_0; Q4_K_M: llama.cpp's mix of Q4_K and Q6_K; norms stay F32)",
    )
    p.set_defaults(func=_cmd_export_gguf, parser=p)


# what each service's subcommand runs and says it does; its flags are its settings (services/settings.py)
SERVICE_COMMANDS = {
    "worker": (_cmd_worker, "serve one pipeline stage (pagoda.v1.StageWorker)"),
    "kvcache": (_cmd_kvcache, "serve the KV-cache manager (pagoda.v1.KVCache)"),
    "scheduler": (_cmd_scheduler, "serve the scheduler (pagoda.v1.Scheduler)"),
    "gateway": (_cmd_gateway, "serve the REST (OpenAI-compatible) and gRPC front door"),
}


def _add_service_commands(sub) -> None:
    for name, (func, service_help) in SERVICE_COMMANDS.items():
        p = sub.add_parser(name, help=service_help)
        add_settings(p, service_settings(name))
        p.set_defaults(func=func, parser=p)


def _add_tool_commands(sub) -> None:
    for name, (_, tool_help) in TOOLS.items():
        p = sub.add_parser(name, help=tool_help, add_help=False, prefix_chars="\0")
        p.add_argument("tool_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_cmd_tool, tool=name, parser=p)


def _add_k8s_manifests_command(sub) -> None:
    p = sub.add_parser("k8s-manifests", help="Kubernetes manifests for N replicas (docs/deploy.md)")
    from wiring import k8s_cli

    k8s_cli.add_arguments(p)
    p.set_defaults(func=k8s_cli.run, parser=p)


def _add_serve_command(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model: the whole stack as local processes",
        usage="%(prog)s [MODEL] [options]  (the options by section below)",
    )
    from wiring import serve

    serve.add_arguments(p)
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
