"""The `pagoda` command line: one entry point, a subcommand per service or tool.

Subcommands import what they need lazily, so that `pagoda --help` and the torch-free
services start fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from services import tiny_model

    try:
        spec = tiny_model.spec_from_args(args)
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        out = tiny_model.make_tiny_model(args.out_dir, spec, overwrite=args.overwrite)
    except FileExistsError as exc:
        print(f"error: {exc} (pass --overwrite to replace a model folder)", file=sys.stderr)
        return 1
    print(f"wrote a {spec.arch} model with {spec.num_parameters:,} parameters to {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from services import tiny_model

    model_dir = Path(args.model) if args.model else tiny_model.default_model_dir()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        print(f"error: {model_dir} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    config = json.loads(config_path.read_text())
    print(
        "pagoda serve: would serve\n"
        f"  model:      {model_dir}\n"
        f"  arch:       {', '.join(config.get('architectures', []))}, "
        f"{config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}, "
        f"vocab {config.get('vocab_size')}\n"
        f"  pipeline:   {args.pipeline_parallel_size} stage(s)\n"
        f"  REST:       http://{args.host}:{args.port}/v1 (OpenAI-compatible)\n"
        f"  gRPC:       {args.host}:{args.grpc_port} (pagoda.v1.Generation)\n"
        "The services themselves (gateway, scheduler, KV cache, stage workers) land with the\n"
        "issues that follow the foundation; see docs/plan.md."
    )
    return 0


def _env(name: str, default=None, kind=str):
    """Flag default from `PAGODA_<NAME>`, so a service can be configured by environment."""
    import os

    raw = os.environ.get(f"PAGODA_{name.upper().replace('-', '_')}")
    return default if raw is None else kind(raw)


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
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            layer_partition=args.layer_partition,
            dtype=args.dtype,
            device=args.device,
            num_threads=args.num_threads,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
        )
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        asyncio.run(serve(config, ready_file=args.ready_file))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="Pagoda: an LLM inference server built as gRPC microservices."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write a small random Hugging Face checkpoint, offline")
    p.add_argument("out_dir", type=Path, help="directory to write (created; replaced if it exists)")
    from services import tiny_model

    p.add_argument("--overwrite", action="store_true", help="replace an existing model folder")
    tiny_model.add_cli_arguments(p)
    p.set_defaults(func=_cmd_tiny_model, parser=p)

    p = sub.add_parser("worker", help="serve one pipeline stage (pagoda.v1.StageWorker)")
    p.add_argument("--model", default=_env("model"), required=_env("model") is None,
                   help="checkpoint directory")
    p.add_argument("--stage", type=int, default=_env("stage", 0, int))
    p.add_argument("--num-stages", type=int, default=_env("num_stages", 1, int))
    p.add_argument("--host", default=_env("host", "127.0.0.1"),
                   help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=_env("port", 0, int), help="0 picks a free port")
    p.add_argument("--next", default=_env("next"), help="HOST:PORT of the next stage (not on the last)")
    p.add_argument("--num-kv-blocks", type=int, default=_env("num_kv_blocks", 1024, int))
    p.add_argument("--block-size", type=int, default=_env("block_size", 16, int))
    p.add_argument("--layer-partition", type=_int_list, default=_env("layer_partition", None, _int_list),
                   help="layers per stage, e.g. 3,5 (default: even split)")
    p.add_argument("--dtype", default=_env("dtype", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=_env("device"), help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--num-threads", type=int, default=_env("num_threads", None, int),
                   help="torch intra-op threads (default: cores / num-stages, at least 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 8192, int))
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 256, int))
    p.add_argument("--attention-backend", default=_env("attention_backend", "torch"))
    p.add_argument("--quantization", default=_env("quantization"), choices=[None, "fp8"])
    p.add_argument("--ready-file", help="write the bound port here once serving")
    p.set_defaults(func=_cmd_worker, parser=p)

    p = sub.add_parser("serve", help="serve a model: the whole stack as local processes")
    p.add_argument("--model", help="checkpoint directory (default: the tiny model, made once)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
