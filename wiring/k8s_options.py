"""What `pagoda k8s-manifests` deploys (wiring/k8s.py renders it): the options, checked when
made (`K8sOptions`, a container's `Resources`), and the stack's fixed names, ports and
addresses, which the manifests, the containers' arguments and the tests all use. Pure Python."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.defaults import BLOCK_SIZE, NUM_KV_BLOCKS, ROUTING_POLICIES
from services.settings import parse_bool

KV_PORT = 50060
SCHEDULER_PORT = 50052
WORKER_PORT = 50070
GATEWAY_GRPC_PORT = 50051
REDIS_PORT = 6379
REDIS_UID = 999  # redis:7-alpine's redis user
MODELS_MOUNT = "/models"
API_KEYS_DIR = "/run/secrets/pagoda"
API_KEYS_FILE = "api-keys.json"
ENGINE_CONFIG = "pagoda-engine"
REDIS = "pagoda-redis"
GATEWAY = "pagoda-gateway"
BACKEND_PDB = "pagoda-backend"
ENGINE_CONFIG_HASH = "pagoda.dev/engine-config-hash"  # pods restart when the ConfigMap changes
COMPONENTS = ("gateway", "scheduler", "kvcache", "worker", "redis")
PREFILL, DECODE = "prefill", "decode"  # the replicas' roles with P/D disaggregation (issue 39)
DEFAULT_KV_IMPORT_BLOCKS = 512  # a decode replica's room for pulled blocks, unless --kv-import-blocks
# Flags the manifests set themselves, per component: not engine settings (--set).
RESERVED_SETTINGS = frozenset(
    {
        "host",
        "port",
        "grpc_port",
        "model",
        "stage",
        "num_stages",
        "next",
        "feedback",
        "kvcache",
        "stages",
        "scheduler",
        "pipeline_parallel_size",
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "num_kv_blocks",
        "num_blocks",
        "block_size",
        "redis_url",
        "replica_id",
        "routing",
        "api_keys_file",
        "api_key",
        "internal_token",
        "device",
        "served_model_name",
        "ready_file",
        "kv_import_blocks",
        "prefill_scheduler",
    }
)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SETTING = re.compile(r"[a-z][a-z0-9_]*")
_CPU = re.compile(r"(\d+(\.\d+)?|\d+m)")
_MEMORY = re.compile(r"\d+(\.\d+)?([kMGTPE]|[KMGTPE]i)?")


def _millicores(cpu: str) -> int:
    return int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)


@dataclass(frozen=True)
class Resources:
    """A container's requests: cpu ("4", "500m") and memory ("16Gi"); memory is its limit too."""

    cpu: str
    memory: str

    def __post_init__(self) -> None:
        if not _CPU.fullmatch(self.cpu) or _millicores(self.cpu) < 1:
            raise ValueError(f"cpu: expected a quantity such as 4, 2.5 or 500m, got {self.cpu!r}")
        if not _MEMORY.fullmatch(self.memory) or float(re.match(r"[\d.]+", self.memory)[0]) <= 0:
            raise ValueError(f"memory: expected a quantity such as 16Gi or 512Mi, got {self.memory!r}")


DEFAULT_REQUESTS = {
    "gateway": Resources("1", "2Gi"),  # the tokenizer, detokenizing every stream
    "scheduler": Resources("1", "2Gi"),
    "kvcache": Resources("500m", "1Gi"),
    "worker": Resources("4", "16Gi"),  # per stage pod, its tensor-parallel ranks included
    "redis": Resources("100m", "256Mi"),
}


@dataclass(frozen=True)
class K8sOptions:
    """What to deploy. Every replica is the same: P stage pods of T processes each."""

    replicas: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None: the pool is num_kv_blocks, unchecked
    gpus: bool = False  # stage pods get nvidia.com/gpu: T and PAGODA_DEVICE=cuda
    model_path: str = "/models/model"  # the checkpoint folder, inside the models volume
    models_claim: str = "pagoda-models"
    namespace: str = "pagoda"
    image: str = "pagoda:local"
    image_pull_policy: str = "IfNotPresent"
    gateway_replicas: int = 2
    gateway_service_type: str = "ClusterIP"
    routing: str = "prefix"
    served_model_names: tuple[str, ...] = ()
    # the KV layout: one for the KV service, every stage and the scheduler of a replica
    num_kv_blocks: int = NUM_KV_BLOCKS
    block_size: int = BLOCK_SIZE
    engine: Mapping[str, object] = field(default_factory=dict)  # other PAGODA_* settings
    requests: Mapping[str, Resources] = field(default_factory=dict)  # over DEFAULT_REQUESTS
    internal_token_secret: str = "pagoda-internal-token"
    internal_token_key: str = "token"
    api_keys_secret: str = "pagoda-api-keys"
    api_keys_key: str = API_KEYS_FILE
    redis_image: str = "redis:7-alpine"
    shm_size: str = "1Gi"  # /dev/shm of a stage pod with T > 1 (NCCL, torch.distributed)
    worker_startup_s: int = 1800  # how long a stage may take to load before it is restarted
    # an InferencePool of this name (wiring/inference_pool.py): each replica its own gateway, the
    # extension's endpoint picker routing between them; "" : Pagoda's router gateway
    inference_pool: str = ""
    objectives: tuple[tuple[str, int], ...] = ()  # InferenceObjectives: (name, priority)
    # P/D disaggregation (issue 39): prefill replicas p0.., decode replicas d0.. instead of r0..;
    # 0 and 0: every replica does both. kv_import_blocks: the decode replicas' room for pulled
    # blocks (None: DEFAULT_KV_IMPORT_BLOCKS)
    prefill_replicas: int = 0
    decode_replicas: int = 0
    kv_import_blocks: int | None = None

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_names()
        self._check_choices()
        self._check_disaggregation()

    def _check_sizes(self) -> None:
        for name in (
            "replicas",
            "pipeline_parallel_size",
            "tensor_parallel_size",
            "gateway_replicas",
            "num_kv_blocks",
            "block_size",
            "worker_startup_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.replicas > 100:
            raise ValueError(f"replicas: at most 100 (names r0..r99), got {self.replicas}")
        if self.pipeline_parallel_size > 8:  # SchedulerConfig's limit
            raise ValueError(f"pipeline_parallel_size: must be 1..8, got {self.pipeline_parallel_size}")
        f = self.gpu_memory_utilization
        if f is not None and not (isinstance(f, (int, float)) and 0 < f <= 1):
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1] or None, got {f!r}")

    def _check_names(self) -> None:
        path = self.model_path
        if posixpath.normpath(path) != path or not path.startswith(MODELS_MOUNT + "/"):
            raise ValueError(
                f"model_path: must be a normalized path under {MODELS_MOUNT}/ (the models "
                f"volume's mount), e.g. {MODELS_MOUNT}/Meta-Llama-3.1-8B-Instruct; got {path!r}"
            )
        for name in ("models_claim", "internal_token_secret", "api_keys_secret"):
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", getattr(self, name)):
                raise ValueError(
                    f"{name}: must be a Kubernetes object name (lower case, digits, '-', '.'), "
                    f"got {getattr(self, name)!r}"
                )
        if not _DNS_LABEL.fullmatch(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"namespace: must be a DNS label (lower case, digits, '-'), got {self.namespace!r}")
        for name in ("internal_token_key", "api_keys_key"):
            if not re.fullmatch(r"[-._a-zA-Z0-9]+", getattr(self, name)):
                raise ValueError(f"{name}: must be a Secret key ([-._a-zA-Z0-9]+), got {getattr(self, name)!r}")
        for name in ("image", "redis_image"):
            if not getattr(self, name) or any(c.isspace() for c in getattr(self, name)):
                raise ValueError(f"{name}: must be an image reference without spaces, got {getattr(self, name)!r}")

    def _check_choices(self) -> None:
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError(f"image_pull_policy: Always, IfNotPresent or Never, got {self.image_pull_policy!r}")
        if self.gateway_service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
            raise ValueError(
                f"gateway_service_type: ClusterIP, NodePort or LoadBalancer, got {self.gateway_service_type!r}"
            )
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if any(not n or any(c.isspace() or c == "," for c in n) for n in self.served_model_names):
            raise ValueError(f"served_model_names: names without spaces or commas, got {self.served_model_names!r}")
        for name, value in self.engine.items():
            if not _SETTING.fullmatch(name):
                raise ValueError(f"engine setting {name!r}: expected a snake_case name such as max_num_seqs")
            if name in RESERVED_SETTINGS:
                raise ValueError(
                    f"engine setting {name!r}: set by the manifests themselves; use its own "
                    "option (e.g. --num-kv-blocks, --tensor-parallel-size, --gpus)"
                )
            if value is None or isinstance(value, (dict, list, tuple)):
                raise ValueError(f"engine setting {name!r}: expected a string, number or boolean, got {value!r}")
        unknown = set(self.requests) - set(COMPONENTS)
        if unknown:
            raise ValueError(
                f"requests: unknown component(s) {', '.join(sorted(unknown))}; expected {', '.join(COMPONENTS)}"
            )
        if not _MEMORY.fullmatch(self.shm_size):
            raise ValueError(f"shm_size: expected a quantity such as 1Gi, got {self.shm_size!r}")
        for name in (self.inference_pool, *(n for n, _ in self.objectives)):
            if name and (not _DNS_LABEL.fullmatch(name) or len(name) > 50):
                raise ValueError(
                    f"inference pool or objective name: a DNS label of at most 50 characters, got {name!r}"
                )
        if self.objectives and not self.inference_pool:
            raise ValueError("objectives: need --inference-pool (an InferenceObjective names its pool)")

    def _check_disaggregation(self) -> None:
        """Prefill and decode pools: both or neither, instead of --replicas, split alike (the
        decode stage k pulls from the prefill stage k), one process per stage, prefix caching
        on and one KV group (a decode replica imports into its prefix cache)."""
        p, d, n = self.prefill_replicas, self.decode_replicas, self.kv_import_blocks
        for name, value in (("prefill_replicas", p), ("decode_replicas", d), ("kv_import_blocks", n)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        if not (p or d):
            if n is not None:
                raise ValueError("kv_import_blocks: only for decode replicas (--prefill-replicas, --decode-replicas)")
            return
        if not (p and d):
            raise ValueError("prefill_replicas and decode_replicas: give both (at least one of each) or neither")
        if max(p, d) > 100:
            raise ValueError(f"prefill_replicas, decode_replicas: at most 100 each, got {p} and {d}")
        if self.replicas != 1:
            raise ValueError("replicas: not with prefill_replicas and decode_replicas (those are the replicas)")
        if n is not None and n < 1:
            raise ValueError(f"kv_import_blocks: must be a positive integer, got {n}")
        if self.tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size: prefill/decode replicas need 1 (blocks move stage to stage, "
                f"one process each), got {self.tensor_parallel_size}"
            )
        if self.inference_pool:
            raise ValueError(
                "inference_pool: not with prefill/decode replicas (one InferencePool per role is not "
                "rendered); serve them behind Pagoda's router gateway"
            )
        caching = self.engine.get("enable_prefix_caching", True)
        try:
            caching = caching if isinstance(caching, bool) else parse_bool(str(caching))
        except ValueError as exc:
            raise ValueError(f"engine setting 'enable_prefix_caching': {exc}") from None
        if not caching:
            raise ValueError(
                "enable_prefix_caching: prefill/decode replicas need it (a decode replica imports "
                "a prompt's blocks into its prefix cache)"
            )
        if "," in str(self.engine.get("kv_groups", "")):
            raise ValueError("kv_groups: prefill/decode replicas need one KV group (no sliding-window sub-groups)")

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode replicas (issue 39) rather than replicas that do both."""
        return self.prefill_replicas > 0

    @property
    def prefill_names(self) -> list[str]:
        return [f"p{i}" for i in range(self.prefill_replicas)]

    @property
    def decode_names(self) -> list[str]:
        return [f"d{i}" for i in range(self.decode_replicas)]

    @property
    def replica_names(self) -> list[str]:
        """Every replica's stack: r0..rN-1, or the prefill then the decode replicas."""
        if self.disaggregated:
            return self.prefill_names + self.decode_names
        return [f"r{i}" for i in range(self.replicas)]

    def role_of(self, replica: str) -> str | None:
        """PREFILL, DECODE, or None for a replica that does both."""
        return {"p": PREFILL, "d": DECODE}.get(replica[0]) if self.disaggregated else None

    @property
    def import_blocks(self) -> int:
        """The decode replicas' --kv-import-blocks."""
        return DEFAULT_KV_IMPORT_BLOCKS if self.kv_import_blocks is None else self.kv_import_blocks

    def resources(self, component: str) -> Resources:
        return self.requests.get(component, DEFAULT_REQUESTS[component])

    @property
    def worker_threads(self) -> int:
        """torch threads per stage process: the stage pod's cores over its ranks (the worker's
        own default divides the node's cores, not the pod's)."""
        return max(1, _millicores(self.resources("worker").cpu) // 1000 // self.tensor_parallel_size)


# --- names and addresses -------------------------------------------------------------------


def kvcache_name(replica: str) -> str:
    return f"pagoda-{replica}-kvcache"


def model_server_name(replica: str) -> str:
    """A replica's own gateway (an InferencePool's model server)."""
    return f"pagoda-{replica}-gateway"


def scheduler_name(replica: str) -> str:
    return f"pagoda-{replica}-scheduler"


def worker_name(replica: str) -> str:
    """The stage StatefulSet and its headless Service: pod K is stage K."""
    return f"pagoda-{replica}-worker"


def stage_address(replica: str, stage: int) -> str:
    return f"{worker_name(replica)}-{stage}.{worker_name(replica)}:{WORKER_PORT}"


def redis_url() -> str:
    return f"redis://{REDIS}:{REDIS_PORT}/0"
