"""`pagoda k8s-manifests`: Kubernetes manifests for N replicas behind the gateway (issue 13).

    pagoda k8s-manifests --replicas 4 --pipeline-parallel-size 2 --tensor-parallel-size 2 \\
        --gpus --gpu-memory-utilization 0.9 > pagoda.yaml

A replica is one scheduler with its KV service and a StatefulSet of pipeline-stage workers;
the gateway Deployment, in router mode (`--scheduler r0=ADDR,r1=ADDR`), is the router: it
picks a replica per request (gateway/routing.py) from the prefix index the KV services
publish in Redis. The layout is docker-compose.yml's, one copy per replica:

    pagoda-gateway (Deployment, Service :8000 http :50051 grpc, PDB)
    pagoda-redis (Deployment, Service :6379)       prefix index, rate-limit buckets
    pagoda-engine (ConfigMap)                      engine settings as PAGODA_* variables
    per replica rN:
      pagoda-rN-kvcache (Deployment, Service :50060)
      pagoda-rN-scheduler (Deployment, Service :50052)
      pagoda-rN-worker (StatefulSet of P stages, headless Service :50070):
          stage K is pagoda-rN-worker-K.pagoda-rN-worker:50070
    pagoda-backend (PDB over every replica's pods: one disrupted at a time)

With P/D disaggregation (issue 39, `--prefill-replicas N --decode-replicas M`) the replicas are
p0..pN-1 and d0..dM-1 (label pagoda.dev/role: prefill|decode), the same stack each; the gateway
gets the decode schedulers as --scheduler and the prefill ones as --prefill-scheduler (every
KV service publishes to Redis as before: each pool is routed from its own replicas' entries);
the decode KV services and stages take --kv-import-blocks, and decode stage k pulls a prompt's
blocks from prefill stage k (pagoda-pK-worker-k.pagoda-pK-worker:50070).

The operator creates the namespace, the Secrets (the internal token, the API keys) and the
models' PersistentVolumeClaim; nothing secret is ever rendered. docs/deploy.md walks through
it. Pure Python: no torch, no grpc. The options and names: wiring/k8s_options.py; the command
line: wiring/k8s_cli.py."""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from services import settings as shared
from wiring.inference_pool import GATEWAY_HTTP_PORT, MODEL_SERVER, pool_manifests
from wiring.k8s_objects import (
    COMPONENT_LABEL,
    NAME_LABEL,
    UID,
    container_security,
    deployment,
    labels_of,
    object_meta,
    pdb,
    pod_security,
    service,
)
from wiring.k8s_options import (
    API_KEYS_DIR,
    API_KEYS_FILE,
    BACKEND_PDB,
    DECODE,
    ENGINE_CONFIG,
    ENGINE_CONFIG_HASH,
    GATEWAY,
    GATEWAY_GRPC_PORT,
    KV_PORT,
    MODELS_MOUNT,
    REDIS,
    REDIS_PORT,
    REDIS_UID,
    SCHEDULER_PORT,
    WORKER_PORT,
    K8sOptions,
    kvcache_name,
    model_server_name,
    redis_url,
    scheduler_name,
    stage_address,
    worker_name,
)

# --- each container's pagoda arguments ----------------------------------------------------


def _listen(port: int) -> list[str]:
    return [shared.HOST.flag, "0.0.0.0", shared.PORT.flag, str(port)]


def _import_args(options: K8sOptions, replica: str) -> list[str]:
    """A decode replica's KV service and stages: room for the blocks they pull (issue 39)."""
    if options.role_of(replica) != DECODE:
        return []
    return [shared.KV_IMPORT_BLOCKS.flag, str(options.import_blocks)]


def kvcache_args(options: K8sOptions, replica: str) -> list[str]:
    """Every KV service publishes its prefix index (a P/D gateway routes each pool by its own)."""
    return [
        "kvcache",
        *_listen(KV_PORT),
        "--replica-id",
        replica,
        shared.REDIS_URL.flag,
        redis_url(),
        *_import_args(options, replica),
    ]


def scheduler_args(options: K8sOptions, replica: str) -> list[str]:
    stages = ",".join(stage_address(replica, k) for k in range(options.pipeline_parallel_size))
    return [
        "scheduler",
        *_listen(SCHEDULER_PORT),
        shared.MODEL.flag,
        options.model_path,
        "--kvcache",
        f"{kvcache_name(replica)}:{KV_PORT}",
        "--stages",
        stages,
        shared.PIPELINE_PARALLEL_SIZE.flag,
        str(options.pipeline_parallel_size),
    ]


def worker_args(options: K8sOptions, replica: str, stage: int) -> list[str]:
    """What stage `stage`'s pod runs: the StatefulSet's shell command computes this from the
    pod's ordinal (`worker_script`), since all its pods share one spec."""
    n = options.pipeline_parallel_size
    args = [
        "worker",
        *_listen(WORKER_PORT),
        shared.MODEL.flag,
        options.model_path,
        "--stage",
        str(stage),
        "--num-stages",
        str(n),
        *_import_args(options, replica),
    ]
    if stage < n - 1:
        args += ["--next", stage_address(replica, stage + 1)]
    if n > 1 and stage == n - 1:  # the last of several streams sampled tokens to the first
        args += ["--feedback", stage_address(replica, 0)]
    return args


def worker_script(options: K8sOptions, replica: str) -> str:
    """/bin/sh: the stage index from the pod's ordinal (HOSTNAME pagoda-rN-worker-K), then
    `pagoda worker` with --next and --feedback as `worker_args` gives them."""
    n, name, port = options.pipeline_parallel_size, worker_name(replica), WORKER_PORT
    lines = [
        'stage="${HOSTNAME##*-}"',
        'case "$stage" in ""|*[!0-9]*) echo "cannot read the stage from HOSTNAME=$HOSTNAME" >&2; exit 1;; esac',
        f"set -- worker {shared.HOST.flag} 0.0.0.0 {shared.PORT.flag} {port} {shared.MODEL.flag} "
        f'{shlex.quote(options.model_path)} --stage "$stage" --num-stages {n}'
        + "".join(f" {a}" for a in _import_args(options, replica)),
    ]
    if n > 1:
        lines += [
            f'if [ "$stage" -lt {n - 1} ]; then set -- "$@" --next "{name}-$((stage + 1)).{name}:{port}"; fi',
            f'if [ "$stage" -eq {n - 1} ]; then set -- "$@" --feedback "{name}-0.{name}:{port}"; fi',
        ]
    lines.append('exec pagoda "$@"')
    return "\n".join(lines) + "\n"


def _targets(replicas: list[str]) -> str:
    """The gateway's NAME=HOST:PORT,... list of schedulers (gateway/replicas.py parse_targets)."""
    return ",".join(f"{r}={scheduler_name(r)}:{SCHEDULER_PORT}" for r in replicas)


def gateway_args(options: K8sOptions, replica: str | None = None) -> list[str]:
    """The router gateway's arguments, or with `replica` that replica's own gateway's (a model
    server of an InferencePool: one scheduler, no routing)."""
    if replica is None and options.disaggregated:  # requests go to a decode replica once prefilled
        schedulers = _targets(options.decode_names)
        routing = ["--prefill-scheduler", _targets(options.prefill_names), "--routing", options.routing]
    elif replica is None:
        schedulers = _targets(options.replica_names)
        routing = ["--routing", options.routing]
    else:
        schedulers, routing = f"{scheduler_name(replica)}:{SCHEDULER_PORT}", []
    args = [
        "gateway",
        shared.HOST.flag,
        "0.0.0.0",
        "--port",
        str(GATEWAY_HTTP_PORT),
        "--grpc-port",
        str(GATEWAY_GRPC_PORT),
        shared.MODEL.flag,
        options.model_path,
        "--scheduler",
        schedulers,
        *routing,
        shared.REDIS_URL.flag,
        redis_url(),
        "--api-keys-file",
        f"{API_KEYS_DIR}/{API_KEYS_FILE}",
    ]
    if options.served_model_names:
        args += ["--served-model-name", *options.served_model_names]
    return args


# The scheduler's init container: compose's depends_on (service_healthy). A scheduler whose
# pipeline is not up within its start timeout exits, so it starts once the stages have loaded.
WAIT_FOR_HEALTH = """\
import sys, time
from services.grpc_utils import check_health
pending = sys.argv[1:]
while pending:
    pending = [a for a in pending if not check_health(a, timeout_s=2)]
    if pending:
        print("waiting for " + ", ".join(pending), flush=True)
        time.sleep(5)
"""


# --- manifests -----------------------------------------------------------------------------


def _engine_config(options: K8sOptions) -> dict[str, Any]:
    data = {
        shared.NUM_KV_BLOCKS.variable: str(options.num_kv_blocks),
        shared.BLOCK_SIZE.variable: str(options.block_size),
    }
    for name, value in sorted(options.engine.items()):
        data[shared.variable(name)] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(options, ENGINE_CONFIG, {NAME_LABEL: "pagoda", COMPONENT_LABEL: "engine"}),
        "data": data,
    }


def _resources(options: K8sOptions, component: str, gpus: int = 0) -> dict[str, Any]:
    r = options.resources(component)
    limits: dict[str, Any] = {"memory": r.memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    return {"requests": {"cpu": r.cpu, "memory": r.memory}, "limits": limits}


def _grpc_probe(port: int, period_s: int, failures: int) -> dict[str, Any]:
    return {"grpc": {"port": port}, "periodSeconds": period_s, "timeoutSeconds": 3, "failureThreshold": failures}


def _pagoda_env(options: K8sOptions) -> tuple[list[dict], list[dict]]:
    """(env, envFrom) of every pagoda container: the shared secret, the engine settings."""
    token = {
        "name": shared.INTERNAL_TOKEN.variable,
        "valueFrom": {"secretKeyRef": {"name": options.internal_token_secret, "key": options.internal_token_key}},
    }
    return [token], [{"configMapRef": {"name": ENGINE_CONFIG}}]


def _writable(with_models: bool, options: K8sOptions) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the root filesystem is read-only, so the caches (kernels built at
    start, Hugging Face, triton) and temporary files go to emptyDirs; the models read-only."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": "/home/pagoda"}]
    if with_models:
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": options.models_claim, "readOnly": True}}
        )
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    return volumes, mounts


def _pagoda_container(
    options: K8sOptions,
    name: str,
    component: str,
    port: int,
    *,
    args=None,
    command=None,
    mounts: list[dict],
    extra_env=(),
    gpus: int = 0,
) -> dict[str, Any]:
    env, env_from = _pagoda_env(options)
    container: dict[str, Any] = {"name": name, "image": options.image, "imagePullPolicy": options.image_pull_policy}
    if command is not None:
        container["command"] = command
    if args is not None:
        container["args"] = args  # the image's entrypoint is `pagoda`
    container.update(
        {
            "ports": [{"name": "grpc", "containerPort": port}],
            "env": [*env, *extra_env],
            "envFrom": env_from,
            "resources": _resources(options, component, gpus),
            "readinessProbe": _grpc_probe(port, 5, 3),
            "livenessProbe": _grpc_probe(port, 10, 6),
            "securityContext": container_security(),
            "volumeMounts": mounts,
        }
    )
    return container


def _pod_spec(containers: list[dict], volumes: list[dict], uid: int = UID, **extra) -> dict[str, Any]:
    return {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # else a Service's {NAME}_PORT variables could read as PAGODA_* flags
        "securityContext": pod_security(uid),
        **extra,
        "containers": containers,
        "volumes": volumes,
    }


_SINGLETON = {"type": "Recreate"}  # never two schedulers (or KV services) of one replica at once


def _kvcache(options: K8sOptions, replica: str) -> list[dict]:
    labels = labels_of("kvcache", replica, options.role_of(replica))
    volumes, mounts = _writable(False, options)
    container = _pagoda_container(
        options, "kvcache", "kvcache", KV_PORT, args=kvcache_args(options, replica), mounts=mounts
    )
    pod = _pod_spec([container], volumes)
    return [
        deployment(options, kvcache_name(replica), labels, pod, 1, _SINGLETON),
        service(options, kvcache_name(replica), labels, [("grpc", KV_PORT)], not_ready=True),
    ]


def _scheduler(options: K8sOptions, replica: str) -> list[dict]:
    labels = labels_of("scheduler", replica, options.role_of(replica))
    volumes, mounts = _writable(True, options)
    container = _pagoda_container(
        options, "scheduler", "scheduler", SCHEDULER_PORT, args=scheduler_args(options, replica), mounts=mounts
    )
    # its health follows the pipeline's: a stage restarting must not restart the scheduler too
    container["livenessProbe"] = {
        "tcpSocket": {"port": SCHEDULER_PORT},
        "periodSeconds": 10,
        "timeoutSeconds": 3,
        "failureThreshold": 6,
    }
    container["startupProbe"] = {**container["livenessProbe"], "failureThreshold": 30}
    backend = [f"{kvcache_name(replica)}:{KV_PORT}"] + [
        stage_address(replica, k) for k in range(options.pipeline_parallel_size)
    ]
    wait = {
        "name": "wait-for-pipeline",
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["python", "-c", WAIT_FOR_HEALTH, *backend],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [dict(mounts[0])],
    }
    pod = _pod_spec([container], volumes, initContainers=[wait])
    return [
        deployment(options, scheduler_name(replica), labels, pod, 1, _SINGLETON),
        service(options, scheduler_name(replica), labels, [("grpc", SCHEDULER_PORT)], not_ready=True),
    ]


def _workers(options: K8sOptions, replica: str) -> list[dict]:
    labels = labels_of("worker", replica, options.role_of(replica))
    name, tp = worker_name(replica), options.tensor_parallel_size
    volumes, mounts = _writable(True, options)
    f = options.gpu_memory_utilization
    env = [  # how each stage runs, here where the stages are defined (issue 14)
        {"name": shared.TENSOR_PARALLEL_SIZE.variable, "value": str(tp)},  # processes per stage pod
        {"name": shared.GPU_MEMORY_UTILIZATION.variable, "value": "" if f is None else str(f)},  # "": unset
        {"name": shared.DEVICE.variable, "value": "cuda" if options.gpus else "cpu"},
    ]
    if shared.NUM_THREADS.name not in options.engine:
        env.append({"name": shared.NUM_THREADS.variable, "value": str(options.worker_threads)})
    if tp > 1:  # the ranks' collectives (NCCL) need more than a container's 64 MiB /dev/shm
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container = _pagoda_container(
        options,
        "worker",
        "worker",
        WORKER_PORT,
        command=["/bin/sh", "-c", worker_script(options, replica)],
        mounts=mounts,
        extra_env=env,
        gpus=tp if options.gpus else 0,
    )
    # loading the model comes first: the liveness probe waits for this one
    container["startupProbe"] = _grpc_probe(WORKER_PORT, 10, max(1, options.worker_startup_s // 10))
    extra: dict[str, Any] = {}
    if options.gpus:
        extra["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pod = _pod_spec([container], volumes, **extra)
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(options, name, labels),
        "spec": {
            "serviceName": name,
            "replicas": options.pipeline_parallel_size,
            "podManagementPolicy": "Parallel",  # every stage loads at once; none waits for another
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }
    # headless, not-ready addresses published: a stage resolves its neighbours while they load
    return [statefulset, service(options, name, labels, [("grpc", WORKER_PORT)], headless=True, not_ready=True)]


def _gateway(options: K8sOptions, replica: str | None = None) -> list[dict]:
    """The router gateway (Deployment, Service, PDB), or with `replica` that replica's own
    gateway, a model server of the InferencePool (a Deployment of one: the pool selects pods)."""
    labels = labels_of("gateway") if replica is None else labels_of(MODEL_SERVER, replica)
    volumes, mounts = _writable(True, options)
    volumes.append(
        {
            "name": "api-keys",
            "secret": {
                "secretName": options.api_keys_secret,
                "defaultMode": 0o440,
                "items": [{"key": options.api_keys_key, "path": API_KEYS_FILE}],
            },
        }
    )
    mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    container = _pagoda_container(
        options, "gateway", "gateway", GATEWAY_GRPC_PORT, args=gateway_args(options, replica), mounts=mounts
    )
    container["ports"] = [
        {"name": "http", "containerPort": GATEWAY_HTTP_PORT},
        {"name": "grpc", "containerPort": GATEWAY_GRPC_PORT},
    ]
    # ready while it can serve (its health follows the replicas'); alive while its HTTP loop answers
    container["livenessProbe"] = {
        "httpGet": {"path": "/version", "port": GATEWAY_HTTP_PORT},
        "periodSeconds": 10,
        "timeoutSeconds": 3,
        "failureThreshold": 6,
    }
    container["startupProbe"] = {**container["livenessProbe"], "failureThreshold": 30}  # the tokenizer loads
    # the endpoints go before the listeners close; then in-flight requests get --grace-period
    container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(labels)},
        }
    ]
    pod = _pod_spec([container], volumes, terminationGracePeriodSeconds=45, topologySpreadConstraints=spread)
    scrape = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(GATEWAY_HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    if replica is not None:
        return [deployment(options, model_server_name(replica), labels, pod, 1, rolling, scrape)]
    return [
        deployment(options, GATEWAY, labels, pod, options.gateway_replicas, rolling, scrape),
        service(
            options,
            GATEWAY,
            labels,
            [("http", GATEWAY_HTTP_PORT), ("grpc", GATEWAY_GRPC_PORT)],
            service_type=options.gateway_service_type,
        ),
        pdb(options, GATEWAY, {"matchLabels": dict(labels)}, labels),
    ]


def _redis(options: K8sOptions) -> list[dict]:
    labels = labels_of("redis")
    container = {
        "name": "redis",
        "image": options.redis_image,
        "imagePullPolicy": options.image_pull_policy,
        "args": ["redis-server", "--save", "", "--appendonly", "no"],  # nothing to persist
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": _resources(options, "redis"),
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = _pod_spec([container], [{"name": "data", "emptyDir": {}}], uid=REDIS_UID)
    return [
        deployment(options, REDIS, labels, pod, 1, _SINGLETON),
        service(options, REDIS, labels, [("redis", REDIS_PORT)]),
    ]


def render(options: K8sOptions) -> list[dict[str, Any]]:
    """Every manifest of the stack, in the order `kubectl apply` creates them."""
    engine = _engine_config(options)
    out = [engine, *_redis(options)]
    for replica in options.replica_names:
        out += _kvcache(options, replica) + _workers(options, replica) + _scheduler(options, replica)
    if options.inference_pool:  # the extension's endpoint picker routes between the replicas' gateways
        for replica in options.replica_names:
            out += _gateway(options, replica)
        out += pool_manifests(options)
    else:
        out += _gateway(options)
    # a process reads its environment once, at start: a changed setting must replace the pods
    digest = hashlib.sha256(json.dumps(engine["data"], sort_keys=True).encode()).hexdigest()[:16]
    for m in out:
        if m["kind"] in ("Deployment", "StatefulSet") and m["metadata"]["name"] != REDIS:
            m["spec"]["template"]["metadata"].setdefault("annotations", {})[ENGINE_CONFIG_HASH] = digest
    # a replica is down while any of its pods is: evict one backend pod at a time, and none
    # while a replica is already down (with one replica a drain still proceeds, one pod at a time)
    backend = {
        "matchLabels": {NAME_LABEL: "pagoda"},
        "matchExpressions": [
            {"key": COMPONENT_LABEL, "operator": "In", "values": ["kvcache", "scheduler", "worker", MODEL_SERVER]}
        ],
    }
    out.append(pdb(options, BACKEND_PDB, backend, {NAME_LABEL: "pagoda", COMPONENT_LABEL: "backend"}))
    return out


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    """Multi-document YAML, keys in the order written, scripts as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:  # no &id001 anchors: plain, greppable
            return True

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(manifests, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100)
