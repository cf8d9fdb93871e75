"""Every setting of every service, declared once: its flag, its variable, its default, its owner.

A `Setting` is one value a user gives Pagoda (its form: services/settings_schema.py). Its name
is the config field's, the flag `--<name-with-dashes>` of each subcommand in `services`, and
the variable `PAGODA_<NAME>` that gives that flag's default. Each service's config dataclass
carries its settings as field metadata: `declare` for a setting of its own, `uses` for one of
the shared settings below (declared here because two or more services take them, or because
`pagoda serve`, the launcher and the Kubernetes renderer set them for a service). `settings_of`
lists a config's settings with the process settings its subcommand takes besides (where it
listens, its neighbours, its ready file). Here too: the switches read from the environment
only, and the one reader of a PAGODA_* variable (`env_text`, `env_value`).

Everything else is generated from these declarations by the wiring (`wiring/flags.py`): each
subcommand's flags and their `PAGODA_*` defaults, the configs built from the parsed flags,
and what `pagoda serve` passes on to each service; the compose file and the Kubernetes
manifests are checked against them (`tests/unit/test_settings_schema.py`). Values come from
`services/defaults.py`. This module is the public entry: the schema's names are imported
from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from services import defaults

# the schema's form (services/settings_schema.py), re-exported: callers import it from here
from services.settings_schema import (  # noqa: F401
    GROUPS,
    KINDS,
    SAME,
    SERVE_MODES,
    SERVICES,
    Bound,
    Setting,
    declare,
    settings_of,
    uses,
    variable,
)

# --- the shared settings --------------------------------------------------------------------
# Two or more services take them, or `pagoda serve`, the launcher and the Kubernetes renderer
# set them for a service (so they write them by these names).

# where each process listens and what it tells
HOST = Setting(
    "host",
    "address to bind (default loopback; beyond it the gateway requires API keys); `pagoda serve`: the gateway's",
    default="127.0.0.1",
    services=SERVICES,
    serve="pass",
    passed_to=("gateway",),
    group="network",
)
PORT = Setting(
    "port", "0 picks a free port", "port", default=0, services=("worker", "kvcache", "scheduler"), group="network"
)
METRICS_PORT = Setting(
    "metrics_port",
    "serve Prometheus metrics on this port (off by default)",
    "nonzero_port",
    services=("worker", "kvcache", "scheduler"),
    group="supervision",
)
READY_FILE = Setting(
    "ready_file",
    "write the bound port here once serving",
    env=False,
    services=("worker", "kvcache", "scheduler"),
    group="supervision",
)
INTERNAL_TOKEN = Setting(
    "internal_token",
    "the stack's secret: every internal call carries it (services/grpc_utils.py)",
    command_line=False,
    services=SERVICES,
    serve="own",
)

# the checkpoint and the KV layout: one for the whole stack
MODEL = Setting(
    "model",
    "checkpoint directory or GGUF file (`pagoda serve`: default SmolLM2-135M-Instruct, fetched once)",
    required=True,
    owner="worker",
    services=("worker", "scheduler", "gateway"),
    serve="own",
    group="model",
)
BLOCK_SIZE = Setting(
    "block_size",
    "KV slots per block: one for the KV service, every stage and the scheduler",
    "int",
    default=defaults.BLOCK_SIZE,
    owner="kvcache",
    services=("worker", "kvcache", "scheduler"),
    serve="own",
    group="cache",
)
NUM_KV_BLOCKS = Setting(
    "num_kv_blocks",
    "KV blocks in the pool: one number for the KV service, every stage and the scheduler (default: "
    "a stage and `pagoda serve` size it from --gpu-memory-utilization or --kv-cache-memory when "
    f"given, else {defaults.NUM_KV_BLOCKS}; a stage given both checks at start that the blocks fit; "
    "the scheduler takes the KV service's)",
    "int",
    metavar="N",
    aliases=("--num-blocks",),
    owner="kvcache",
    services=("worker", "kvcache", "scheduler"),
    serve="own",
    group="cache",
)
KV_GROUPS = Setting(
    "kv_groups",
    "KV groups of a hybrid model (full-attention and sliding-window layers, "
    "services/kv_layout.py): each sub-group's window, full ones (0) first, e.g. 0,512,512; "
    "empty: one table for all layers (`pagoda serve` derives it from the model; a stage "
    "derives its own and the scheduler checks they agree)",
    "str",
    default="",
    metavar="WINDOWS",
    owner="kvcache",
    services=("kvcache", "scheduler"),
    serve="own",
    group="cache",
)
KV_OFFLOAD = Setting(
    "kv_offload",
    "a KV tier below the pool (services/kv_offload.py): prefixes evicted from it are kept in host "
    "memory, then on disk, and loaded instead of recomputed: host:GiB[,disk:PATH:GiB] (`pagoda "
    "serve`), or in blocks of the pipeline, host:512b[,disk:PATH:4096b] (every service alike); "
    "needs prefix caching, one KV group and tensor parallelism 1",
    "str",
    default="",
    metavar="host:SIZE[,disk:PATH:SIZE]",
    owner="kvcache",
    services=("worker", "kvcache", "scheduler"),
    serve="pass",
    group="cache",
)
KV_IMPORT_BLOCKS = Setting(
    "kv_import_blocks",
    "P/D disaggregation (issue 39), on a decode replica: room for this many blocks pulled from a "
    "prefill replica and not yet loaded into the pool (host memory, taken as blocks arrive, given "
    "back when loaded or after a while); 0: no import (a prompt is computed here). Needs prefix "
    "caching, one KV group and tensor parallelism 1 (`pagoda serve --decode-replicas` sets it)",
    "int",
    default=0,
    metavar="N",
    owner="kvcache",
    services=("worker", "kvcache"),
    serve="own",
    group="cache",
)
ENABLE_PREFIX_CACHING = Setting(
    "enable_prefix_caching",
    "share KV blocks of common prefixes (the KV service caches, the scheduler plans with it)",
    "bool",
    default=True,
    aliases=("--no-prefix-caching",),
    owner="kvcache",
    services=("kvcache", "scheduler"),
    serve="pass",
    group="cache",
)

# what one step and one sequence may hold: the scheduler plans within them, a stage takes them
MAX_MODEL_LEN = Setting(
    "max_model_len",
    "the longest context, prompt and output (default: the model's max_position_embeddings, "
    f"else {defaults.MAX_MODEL_LEN}; `pagoda serve` lowers it to what a fixed pool (--num-kv-blocks) holds, and "
    "refuses a larger one given, or one past the model's positions); a stage's memory profile counts what a "
    "prefill chunk there needs",
    "int",
    metavar="TOKENS",
    owner="scheduler",
    services=("worker", "scheduler", "gateway"),
    serve="pass",
    group="model",
)
MAX_NUM_BATCHED_TOKENS = Setting(
    "max_num_batched_tokens",
    "most tokens in one step (a stage's message limit and memory profile)",
    "int",
    default=defaults.MAX_NUM_BATCHED_TOKENS,
    owner="scheduler",
    services=("worker", "scheduler"),
    serve="pass",
    group="scheduler",
)
MAX_NUM_SEQS = Setting(
    "max_num_seqs",
    "most sequences running at once (a stage's message limit)",
    "int",
    default=defaults.MAX_NUM_SEQS,
    owner="scheduler",
    services=("worker", "scheduler"),
    serve="pass",
    group="scheduler",
)

# the stack's shape and the stages' resources
PIPELINE_PARALLEL_SIZE = Setting(
    "pipeline_parallel_size",
    "pipeline stages, each a process holding a slice of the model's layers: 1..8 "
    "and at most the model's layers (on one machine each stage wants cores of its own)",
    "int",
    default=1,
    metavar="N",
    aliases=("-pp",),
    owner="scheduler",
    services=("scheduler",),
    serve="own",
    group="parallelism",
)
TENSOR_PARALLEL_SIZE = Setting(
    "tensor_parallel_size",
    "processes per stage, each holding 1/T of every layer's attention heads, "
    "KV heads and MLP columns (torch.distributed: gloo on the CPU, NCCL on CUDA); T must divide them "
    "(default 1)",
    "int",
    default=1,
    metavar="T",
    aliases=("-tp",),
    owner="worker",
    services=("worker",),
    serve="own",
    group="parallelism",
)
ENABLE_EXPERT_PARALLEL = Setting(
    "enable_expert_parallel",
    "mixture-of-experts models under tensor parallelism: each rank holds 1/T of "
    "the experts whole instead of 1/T of every expert's columns (as vLLM's flag); the stage's all-reduce "
    "sums the experts' outputs as it sums the MLP's",
    "switch",
    default=False,
    owner="worker",
    services=("worker",),
    serve="pass",
    group="parallelism",
)
GPU_MEMORY_UTILIZATION = Setting(
    "gpu_memory_utilization",
    "size the KV pool from memory: the fraction of the device's memory a "
    "stage may use (on the CPU, of the system's memory), weights and peak activations included (as "
    "vLLM); `pagoda serve`: the stages of this machine share it equally (without --num-kv-blocks)",
    "fraction",
    metavar="F",
    owner="worker",
    services=("worker",),
    serve="own",
    group="cache",
)
KV_CACHE_MEMORY = Setting(
    "kv_cache_memory",
    "size the KV pool from memory: bytes for each stage's pool itself, e.g. 4GiB "
    "(as vLLM-cpu's KV space; `pagoda serve`: without --num-kv-blocks)",
    "size",
    metavar="BYTES",
    owner="worker",
    services=("worker",),
    serve="own",
    group="cache",
)
NUM_THREADS = Setting(
    "num_threads",
    "torch intra-op threads per stage process (default: the cores but one, divided "
    "among the stages' processes; `pagoda serve` also gives steps of 128 tokens or more every core "
    "divided among the stages)",
    "int",
    owner="worker",
    services=("worker",),
    serve="own",
    group="device",
)
DEVICE = Setting(
    "device",
    "every stage's device: cpu, cuda or cuda:N (default: cuda when present), or "
    "emulated:PROFILE (no weights loaded: the forward pass is a wait the device profile "
    "predicts, tokens are pseudo-random; services/profiles/ or a JSON file)",
    owner="worker",
    services=("worker",),
    serve="pass",
    group="device",
)

# Redis: the replicas' prefix index (the KV services publish it, the gateway routes by it) and
# the gateway's rate-limit buckets
REDIS_URL = Setting(
    "redis_url",
    "redis://host:port/db: the gateway keeps rate-limit buckets there, shared by every "
    "gateway replica (fails open when Redis is down; default: in its process), and reads the "
    "replicas' prefix index, which each KV service publishes there (kvcache_svc/publisher.py); "
    "`pagoda serve --replicas N` starts a private redis-server when none is given and one is "
    "installed",
    metavar="URL",
    owner="gateway",
    services=("kvcache", "gateway"),
    serve="own",
    group="parallelism",
)

# speculative decoding: the scheduler proposes n-gram drafts and plans verify steps; the last
# stage holds a draft model (services/speculative.py)
SPECULATIVE_CONFIG = Setting(
    "speculative_config",
    'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
    '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": '
    '"draft_model", "model": PATH, "num_speculative_tokens": K} (a smaller checkpoint of the same '
    "tokenizer, run on the last stage); greedy output is unchanged, sampled output keeps its distribution",
    metavar="JSON",
    owner="scheduler",
    services=("worker", "scheduler"),
    serve="pass",
    group="speculative",
)

# multi-LoRA: every stage holds the adapters for its layers (worker_svc/weights/lora.py); the gateway
# takes a request's `model` as an adapter's name
ENABLE_LORA = Setting(
    "enable_lora",
    "serve LoRA adapters over the base model (PEFT folders; a request's `model` names one)",
    "switch",
    default=False,
    owner="worker",
    services=("worker", "gateway"),
    serve="pass",
    group="lora",
)
LORA_MODULES = Setting(
    "lora_modules",
    "adapters loaded at start, as vLLM's: NAME=PATH ... (a PEFT folder: "
    "adapter_config.json and adapter_model.safetensors)",
    "names",
    metavar="NAME=PATH",
    owner="worker",
    services=("worker", "gateway"),
    serve="pass",
    group="lora",
)
MAX_LORAS = Setting(
    "max_loras",
    "adapters held at once (each stage's slots)",
    "int",
    default=4,
    owner="worker",
    services=("worker", "gateway"),
    serve="pass",
    group="lora",
)
MAX_LORA_RANK = Setting(
    "max_lora_rank",
    "the largest adapter rank taken",
    "int",
    default=16,
    owner="worker",
    services=("worker",),
    serve="pass",
    group="lora",
)
ALLOW_RUNTIME_LORA_UPDATING = Setting(
    "allow_runtime_lora_updating",
    "take /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING; with API keys, only from a key granted admin)",
    "switch",
    default=False,
    owner="gateway",
    services=("gateway",),
    serve="pass",
    group="lora",
)


def lora_modules(entries) -> dict[str, str]:
    """`NAME=PATH ...` as {name: path}; ValueError naming the entry that is not one."""
    out: dict[str, str] = {}
    for entry in entries or ():
        name, sep, path = str(entry).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {entry!r} is not NAME=PATH")
        if name in out:
            raise ValueError(f"lora_modules: {name!r} given twice")
        out[name.strip()] = path.strip()
    return out


# --- switches read from the environment only ---------------------------------------------------
# What they change lies where no config reaches (a native kernel, the checkpoint loader, the log
# and trace set-up, a benchmark), so they have no flag: their variable only, read through
# `env_value` when used (a test's monkeypatch.setenv takes effect), the one place a PAGODA_*
# variable is read. Each process inherits them from the one that started it (`pagoda serve`,
# the launcher); each subcommand's `--help` lists those its processes read.


def _switch(
    name: str,
    help: str,
    kind: str = "str",
    default: object = None,
    *,
    owner: str | None = None,
    services: tuple[str, ...] = (),
) -> Setting:
    return Setting(name, help, kind, default, command_line=False, owner=owner, services=services)


# the stage's CPU paths (worker_svc/kernels/, worker_svc/weights/packed.py, the loader)
CPU_KERNELS = _switch(
    "cpu_kernels",
    "build and run the native C kernels (paged attention, packed products, "
    "the fused decode step); 0: torch's products only",
    "bool",
    True,
    owner="worker",
    services=("worker",),
)
FUSED_DECODE = _switch(
    "fused_decode",
    "run a CPU decode step's layers in one native call (worker_svc/models/fused_decode.py); 0: layer by layer",
    "bool",
    True,
    owner="worker",
    services=("worker",),
)
TUNE_MALLOC = _switch(
    "tune_malloc",
    "make glibc's malloc keep freed activations for the next step "
    "(worker_svc/kernels/cpu_kernels.py); 0: leave malloc alone",
    "bool",
    True,
    owner="worker",
    services=("worker",),
)
PACKED_BF16 = _switch(
    "packed_bf16",
    "on the CPU, bfloat16 is bfloat16 weights with float32 activations on the "
    "native kernels; 0: torch's bfloat16 modules (bfloat16 activations, as GPUs run it)",
    "bool",
    True,
    owner="worker",
    services=("worker",),
)
PACKED_PREFILL_GEMM = _switch(
    "packed_prefill_gemm",
    "Q8_0/Q4_0/Q4_1 products of many rows (prefills) dequantize "
    "the weights for a GEMM (worker_svc/weights/packed.py); 0: prefills too on the "
    "integer kernels",
    "bool",
    True,
    owner="worker",
    services=("worker",),
)
CPU_ISA = _switch(
    "cpu_isa",
    "cap Pagoda's native kernels at scalar, avx2 or avx512 (beside oneDNN's "
    "ONEDNN_MAX_CPU_ISA and torch's ATEN_CPU_CAPABILITY; default: the widest the CPU runs)",
    owner="worker",
    services=("worker",),
)
CPU_PATHS = _switch(
    "cpu_paths",
    "force CPU paths, e.g. packed_prefill=integer,bf16_prefill=native "
    "(worker_svc/kernels/cpu_features.py; tests and benchmarks)",
    owner="worker",
    services=("worker",),
)
PACKED_ACT_BITS = _switch(
    "packed_act_bits",
    "activation precision of the packed integer products: 8 (llama.cpp's) or 16",
    default="16",
    owner="worker",
    services=("worker",),
)
AUTO_DTYPE = _switch(
    "auto_dtype",
    "float32: --dtype auto keeps a float32 checkpoint float32 (default: "
    "bfloat16 on a CPU with BF16 units; the tests set it)",
    owner="worker",
    services=("worker",),
)
CACHE_DIR = _switch(
    "cache_dir",
    "Pagoda's cache: the fetched default model, prepared GGUF folders, built "
    "kernels and their calibration (default: $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda)",
    services=("worker", "scheduler", "gateway"),
)

# the scheduler's decision trace (scheduler_svc/observer.py)
TRACE_SCHEDULER = _switch(
    "trace_scheduler",
    "write every scheduler decision as a JSON line (to PAGODA_TRACE_FILE)",
    "bool",
    False,
    owner="scheduler",
    services=("scheduler",),
)
TRACE_FILE = _switch(
    "trace_file",
    "the file PAGODA_TRACE_SCHEDULER writes",
    default="pagoda-scheduler-trace.jsonl",
    owner="scheduler",
    services=("scheduler",),
)

# every process's logs and spans (services/logs.py, services/telemetry.py)
LOG_LEVEL = _switch("log_level", "DEBUG, INFO, WARNING or ERROR", default="INFO", services=SERVICES)
_TRACED = ("worker", "scheduler", "gateway")  # (the KV service makes no spans)
OTLP_ENDPOINT = _switch(
    "otlp_endpoint",
    "export spans to this OTLP gRPC endpoint (default: OTEL_EXPORTER_OTLP_ENDPOINT; neither: no tracing)",
    services=_TRACED,
)
SPANS_FILE = _switch("spans_file", "append every span to this file as a JSON line", services=_TRACED)
DIE_WITH_PARENT = _switch(
    "die_with_parent",
    "set by the launcher in a service's environment: the pid of the process it must not outlive (services/process.py)",
    services=SERVICES,
)

# the benchmarks' own (bench/)
ANCHOR = _switch("anchor", "bench.vs_vllm's folder of the anchor model (default: ~/.cache/pagoda-anchor)")

SWITCHES = (
    CPU_KERNELS,
    FUSED_DECODE,
    TUNE_MALLOC,
    PACKED_BF16,
    PACKED_PREFILL_GEMM,
    CPU_ISA,
    CPU_PATHS,
    PACKED_ACT_BITS,
    AUTO_DTYPE,
    CACHE_DIR,
    TRACE_SCHEDULER,
    TRACE_FILE,
    LOG_LEVEL,
    OTLP_ENDPOINT,
    SPANS_FILE,
    DIE_WITH_PARENT,
    ANCHOR,
)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    """The one reading of a yes/no setting (a switch, a bool flag's variable): 1/true/yes/on or
    0/false/no/off, any case; ValueError otherwise."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")


def switches_of(service: str) -> tuple[Setting, ...]:
    """The switches a service's processes read."""
    return tuple(s for s in SWITCHES if service in s.services)


def env_text(setting: Setting, environ: Mapping[str, str] | None = None) -> str | None:
    """The setting's variable as this process has it (`environ`: instead of the process's),
    None when unset: the one read of a PAGODA_* variable."""
    return (os.environ if environ is None else environ).get(setting.variable)


def env_value(setting: Setting, environ: Mapping[str, str] | None = None):
    """A switch's value, read now: its default when its variable is unset or empty; a "bool"
    read by `parse_bool` (ValueError naming the variable otherwise), a "str" as it is."""
    if setting.kind not in ("bool", "str"):
        raise ValueError(f"setting {setting.name}: a {setting.kind} setting is read from its flag")
    raw = env_text(setting, environ)
    if raw is None or not raw.strip():
        return setting.default
    if setting.kind == "str":
        return raw
    try:
        return parse_bool(raw)
    except ValueError as exc:
        raise ValueError(f"{setting.variable}: {exc}") from None


def cache_root() -> Path:
    """Pagoda's cache folder: PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda."""
    root = env_value(CACHE_DIR)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pagoda"
