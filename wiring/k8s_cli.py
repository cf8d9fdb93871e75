"""`pagoda k8s-manifests`'s command line: the arguments, in groups (the stack's shape, the
model, the cluster, the InferencePool), the `K8sOptions` they make, and `run`, which writes
the manifests wiring/k8s.py renders. Pure Python: no torch, no grpc."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services import settings as shared
from services.defaults import ROUTING_POLICIES
from wiring.k8s import render, to_yaml
from wiring.k8s_options import API_KEYS_FILE, COMPONENTS, DEFAULT_KV_IMPORT_BLOCKS, MODELS_MOUNT, K8sOptions, Resources


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. max_num_seqs=64), got {text!r}")
    return name.strip().replace("-", "_"), value


def _requests(text: str) -> tuple[str, Resources]:
    component, sep, rest = text.partition("=")
    cpu, sep2, memory = rest.partition(",")
    if not sep or not sep2:
        raise argparse.ArgumentTypeError(f"expected COMPONENT=CPU,MEMORY (e.g. worker=8,32Gi), got {text!r}")
    try:
        return component.strip(), Resources(cpu.strip(), memory.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _objective(text: str) -> tuple[str, int]:
    name, sep, priority = text.partition("=")
    try:
        return name.strip(), int(priority) if sep else 0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=PRIORITY (e.g. interactive=10), got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, in the order `--help` lists them; each default is `K8sOptions`'."""
    d = K8sOptions()
    _add_shape_arguments(p, d)
    _add_disaggregation_arguments(p)
    _add_model_arguments(p, d)
    _add_cluster_arguments(p, d)
    _add_inference_pool_arguments(p)
    p.add_argument("--out", "-o", type=Path, help="write the YAML here (default: stdout)")


def _add_shape_arguments(p: argparse.ArgumentParser, d: K8sOptions) -> None:
    """The stack's shape: replicas, stage pods and their processes, the KV pool, engine settings."""
    p.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help=f"replicas (a scheduler, a KV service and its stages each), named r0..rN-1 "
        f"(default: {d.replicas}); not with --prefill-replicas and --decode-replicas",
    )
    p.add_argument(
        shared.PIPELINE_PARALLEL_SIZE.flag,
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        metavar="P",
        help="stage pods per replica",
    )
    p.add_argument(
        shared.TENSOR_PARALLEL_SIZE.flag,
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        metavar="T",
        help="processes per stage pod (with --gpus: T GPUs per stage pod)",
    )
    p.add_argument(
        shared.GPU_MEMORY_UTILIZATION.flag,
        type=float,
        metavar="F",
        help="fraction of a stage's device memory it may use; each stage checks at start "
        "that --num-kv-blocks fit in it (default: unset)",
    )
    p.add_argument("--gpus", action="store_true", help="stage pods ask for nvidia.com/gpu and run on CUDA")
    p.add_argument(
        shared.NUM_KV_BLOCKS.flag,
        type=int,
        default=d.num_kv_blocks,
        metavar="N",
        help="KV blocks per stage pool, the same for the KV service, stages and scheduler",
    )
    p.add_argument(shared.BLOCK_SIZE.flag, type=int, default=d.block_size, help="KV slots per block")
    p.add_argument(
        "--set",
        dest="engine",
        action="append",
        type=_setting,
        default=[],
        metavar="NAME=VALUE",
        help="another engine setting, as PAGODA_<NAME> in the ConfigMap (e.g. max_num_seqs=64, "
        "max_model_len=32768, dtype=bfloat16); repeatable",
    )


def _add_disaggregation_arguments(p: argparse.ArgumentParser) -> None:
    """P/D disaggregation (issue 39): prefill replicas and decode replicas instead of --replicas."""
    p.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="N",
        help="P/D disaggregation: N replicas that compute prompts, named p0..pN-1 (with --decode-replicas)",
    )
    p.add_argument(
        "--decode-replicas",
        type=int,
        default=0,
        metavar="M",
        help="P/D disaggregation: M replicas that generate, named d0..dM-1, pulling each prompt's "
        "KV blocks from the prefill replica that computed it (with --prefill-replicas)",
    )
    p.add_argument(
        shared.KV_IMPORT_BLOCKS.flag,
        type=int,
        metavar="N",
        help=f"the decode replicas' room for pulled blocks not yet in their pool (default: {DEFAULT_KV_IMPORT_BLOCKS})",
    )


def _add_model_arguments(p: argparse.ArgumentParser, d: K8sOptions) -> None:
    """Where the checkpoint is, and the names clients ask for it by."""
    p.add_argument(
        "--model-path",
        default=d.model_path,
        help=f"the checkpoint folder inside the pods (the models volume is at {MODELS_MOUNT})",
    )
    p.add_argument("--models-claim", default=d.models_claim, help="the PersistentVolumeClaim holding the models")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="the names clients send as `model` (default: the model path and folder name)",
    )


def _add_cluster_arguments(p: argparse.ArgumentParser, d: K8sOptions) -> None:
    """The cluster's side: namespace, image, the gateway, the pods' requests, the Secrets."""
    p.add_argument("--namespace", "-n", default=d.namespace)
    p.add_argument("--image", default=d.image, help="the Pagoda image (the Dockerfile's), pushed where nodes pull")
    p.add_argument("--image-pull-policy", default=d.image_pull_policy, choices=["Always", "IfNotPresent", "Never"])
    p.add_argument("--gateway-replicas", type=int, default=d.gateway_replicas, metavar="N")
    p.add_argument(
        "--gateway-service-type", default=d.gateway_service_type, choices=["ClusterIP", "NodePort", "LoadBalancer"]
    )
    p.add_argument(
        "--routing",
        default=d.routing,
        choices=ROUTING_POLICIES,
        help="how the gateway picks a replica (default: prefix)",
    )
    p.add_argument(
        "--requests",
        action="append",
        type=_requests,
        default=[],
        metavar="COMPONENT=CPU,MEMORY",
        help=f"a component's cpu and memory ({', '.join(COMPONENTS)}); memory is the limit "
        "too; repeatable, e.g. worker=8,32Gi",
    )
    p.add_argument(
        "--internal-token-secret",
        default=d.internal_token_secret,
        help="the Secret holding PAGODA_INTERNAL_TOKEN under key 'token'",
    )
    p.add_argument(
        "--api-keys-secret",
        default=d.api_keys_secret,
        help=f"the Secret holding the gateway's keys file under key '{API_KEYS_FILE}'",
    )
    p.add_argument(
        "--worker-startup-timeout",
        type=int,
        default=d.worker_startup_s,
        metavar="SECONDS",
        help="how long a stage may take to load the model before it is restarted",
    )


def _add_inference_pool_arguments(p: argparse.ArgumentParser) -> None:
    """Serving as an InferencePool (wiring/inference_pool.py) instead of the router gateway."""
    p.add_argument(
        "--inference-pool",
        default="",
        metavar="NAME",
        help="serve as an InferencePool of the Gateway API Inference Extension: each replica its "
        "own gateway, the extension's endpoint picker (rendered too) routing between them "
        "(docs/deploy.md); default: Pagoda's router gateway",
    )
    p.add_argument(
        "--inference-objective",
        dest="objectives",
        action="append",
        type=_objective,
        default=[],
        metavar="NAME=PRIORITY",
        help="an InferenceObjective of the pool (requests name it in the "
        "x-gateway-inference-objective header; higher priority is served first); repeatable",
    )


def options_from_args(args: argparse.Namespace) -> K8sOptions:
    """The options the flags give; ValueError naming the flag or field that is wrong."""
    if args.replicas is not None and (args.prefill_replicas or args.decode_replicas):
        raise ValueError("--replicas: not with --prefill-replicas and --decode-replicas (those are the replicas)")
    return K8sOptions(
        replicas=1 if args.replicas is None else args.replicas,
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
        kv_import_blocks=args.kv_import_blocks,
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpus=args.gpus,
        model_path=args.model_path,
        models_claim=args.models_claim,
        namespace=args.namespace,
        image=args.image,
        image_pull_policy=args.image_pull_policy,
        gateway_replicas=args.gateway_replicas,
        gateway_service_type=args.gateway_service_type,
        routing=args.routing,
        served_model_names=tuple(args.served_model_name),
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        engine=dict(args.engine),
        requests=dict(args.requests),
        internal_token_secret=args.internal_token_secret,
        api_keys_secret=args.api_keys_secret,
        worker_startup_s=args.worker_startup_timeout,
        inference_pool=args.inference_pool,
        objectives=tuple(args.objectives),
    )


def _header(options: K8sOptions) -> str:
    f = options.gpu_memory_utilization
    replicas = (
        f"{options.prefill_replicas} prefill + {options.decode_replicas} decode replica(s)"
        if options.disaggregated
        else f"{options.replicas} replica(s)"
    )
    return (
        f"# Pagoda on Kubernetes (pagoda k8s-manifests; docs/deploy.md): {replicas} of "
        f"{options.pipeline_parallel_size} stage pod(s) x {options.tensor_parallel_size} process(es)"
        f"{', GPUs' if options.gpus else ', CPU'}"
        f"{f', gpu_memory_utilization {f}' if f is not None else ''}, in namespace {options.namespace}.\n"
        f"# Create first: Secret {options.internal_token_secret} (key {options.internal_token_key}), "
        f"Secret {options.api_keys_secret} (key {options.api_keys_key}), PVC {options.models_claim} "
        f"(the checkpoint at {options.model_path}).\n"
    )


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    manifests = render(options)
    text = _header(options) + to_yaml(manifests)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {len(manifests)} manifests to {args.out}", file=sys.stderr)
    return 0
