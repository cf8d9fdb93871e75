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
