"""The stage worker's configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass
from functools import partial

from services import settings as shared
from services.defaults import NUM_KV_BLOCKS
from services.settings import uses

ATTENTION_BACKENDS = ("cpu", "torch", "triton")  # worker_svc.kernels.attention.get_backend
# load-time weight quantization (worker_svc/weights/quantization.py)
QUANTIZATION_METHODS = ("fp8", "int8")
# the KV pools' dtype (vLLM's --kv-cache-dtype): auto = the stage's activation dtype
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# `--device emulated:PROFILE`: the forward pass is a wait the profile predicts (worker_svc/execution/emulated.py)
EMULATED_PREFIX = "emulated:"

_setting = partial(shared.declare, "worker")
_passed = partial(_setting, serve="pass")  # `pagoda serve` takes it and passes it to every stage


@dataclass(frozen=True)
class WorkerConfig:
    """What `pagoda worker` was started with. Derived values are properties. Each field that
    is a setting carries its declaration (services/settings.py): the flags are made from it."""

    model: str = uses(shared.MODEL, MISSING)
    stage: int = _setting(0, "this stage's index in the pipeline", "int", group="parallelism")
    num_stages: int = _setting(1, "stages in the pipeline", "int", group="parallelism")
    host: str = uses(shared.HOST)
    port: int = uses(shared.PORT)
    next_address: str | None = _setting(
        None, "HOST:PORT of the next stage (not on the last)", name="next", group="network"
    )
    # last stage of several: the first stage's address, to stream sampled tokens to
    feedback_address: str | None = _setting(
        None,
        "last stage of several: HOST:PORT of the first stage, which then gets each sampled token "
        "straight from here, not through the scheduler",
        name="feedback",
        group="network",
    )
    # the KV pool: this many blocks (checked against a memory setting when one is given too),
    # or (None) sized from memory by one of the two settings after them (worker_svc.execution.memory),
    # or NUM_KV_BLOCKS when neither is given
    num_kv_blocks: int | None = uses(shared.NUM_KV_BLOCKS)
    block_size: int = uses(shared.BLOCK_SIZE)
    gpu_memory_utilization: float | None = uses(
        shared.GPU_MEMORY_UTILIZATION
    )  # of the device's memory (system memory on the CPU)
    kv_cache_memory: int | None = uses(shared.KV_CACHE_MEMORY)  # bytes for the KV pool itself
    kv_offload: str = uses(shared.KV_OFFLOAD)  # the KV tier below the pool, in blocks
    kv_import_blocks: int = uses(shared.KV_IMPORT_BLOCKS)  # P/D: room for pulled blocks (issue 39)
    max_model_len: int | None = uses(shared.MAX_MODEL_LEN)  # the longest context (counted in the memory profile)
    speculative_config: str | None = uses(shared.SPECULATIVE_CONFIG)  # the last stage's draft model
    layer_partition: tuple[int, ...] | None = _setting(
        None, "layers per stage, e.g. 3,5 (default: even split)", "int_list", group="parallelism"
    )
    dtype: str = _passed(
        "auto",
        "the weights' dtype (auto: the checkpoint's; a float32 one as bfloat16 "
        "on a CPU with AVX-512 BF16; a GGUF file's own types)",
        choices=DTYPES,
        group="model",
    )
    device: str | None = uses(shared.DEVICE)
    num_threads: int | None = uses(shared.NUM_THREADS)
    max_num_batched_tokens: int = uses(shared.MAX_NUM_BATCHED_TOKENS)
    max_num_seqs: int = uses(shared.MAX_NUM_SEQS)
    # None: triton on CUDA, cpu (native decode kernel) on the CPU
    attention_backend: str | None = _passed(
        None,
        "default: triton on CUDA, cpu (a native decode kernel; torch prefill) on the CPU; torch: the reference",
        choices=ATTENTION_BACKENDS,
        group="device",
    )
    quantization: str | None = _passed(
        None,
        "fp8: linear-layer weights in float8_e4m3fn; int8 (CPU): int8 weights; both with one scale "
        "per output channel, quantized at load from any float checkpoint",
        choices=QUANTIZATION_METHODS,
        group="model",
    )
    kv_cache_dtype: str = _passed(
        "auto",
        "the KV pools' dtype: auto (the activations': float32 for GGUF and CPU bfloat16 stages), "
        "float32, or bfloat16 (half the bytes; CPU kernels)",
        choices=KV_CACHE_DTYPES,
        group="cache",
    )
    # processes this stage runs on (worker_svc/execution/tensor_parallel.py): heads and MLP columns split
    tensor_parallel_size: int = uses(shared.TENSOR_PARALLEL_SIZE)
    enable_expert_parallel: bool = uses(shared.ENABLE_EXPERT_PARALLEL)
    # multi-LoRA: this stage's adapter slots (worker_svc/weights/lora.py)
    enable_lora: bool = uses(shared.ENABLE_LORA)
    lora_modules: tuple[str, ...] = uses(shared.LORA_MODULES, ())
    max_loras: int = uses(shared.MAX_LORAS)
    max_lora_rank: int = uses(shared.MAX_LORA_RANK)
    # the data plane (worker_svc/execution/data_plane.py): how hidden states go to the next stage
    stage_channel: str = _passed(
        "auto",
        "how hidden states go from stage to stage: shm (a shared-memory ring per stage pair, one "
        "host: the message carries a reference), nccl (torch.distributed point-to-point: NCCL between "
        "GPUs, gloo between CPU stages), grpc (in the message: across hosts), auto (nccl on GPUs, then "
        "shm, where the next stage takes it, else grpc)",
        choices=("auto", "shm", "nccl", "grpc"),
        group="network",
    )

    def __post_init__(self) -> None:
        self._check_pipeline()
        self._check_sizes()
        self._check_choices()
        self._check_emulated()
        self._check_lora()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")

    def _check_lora(self) -> None:
        modules = shared.lora_modules(self.lora_modules)
        if modules and not self.enable_lora:
            raise ValueError("lora_modules: given without --enable-lora")
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError(
                f"max_loras and max_lora_rank: must be positive, got {self.max_loras}, {self.max_lora_rank}"
            )
        if len(modules) > self.max_loras:
            raise ValueError(f"lora_modules: {len(modules)} adapters for max_loras {self.max_loras}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora: not served with tensor_parallel_size > 1 yet")

    def _check_pipeline(self) -> None:
        """This stage's place in the pipeline and the addresses that go with it."""
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage: must be in [0, num_stages={self.num_stages}), got {self.stage}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: must be 1..8, got {self.num_stages}")
        is_last = self.stage == self.num_stages - 1
        if is_last and self.next_address:
            raise ValueError("next_address: the last stage has no next stage")
        if self.feedback_address and (not is_last or self.num_stages == 1):
            raise ValueError("feedback_address: only the last stage of several streams tokens to the first")
        if not is_last and not self.next_address:
            raise ValueError(f"next_address: stage {self.stage} of {self.num_stages} needs --next")

    def _check_sizes(self) -> None:
        """Counts, memory settings and process and thread numbers."""
        for name in ("num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ValueError("gpu_memory_utilization and kv_cache_memory: give one of them")
        if not 1 <= self.tensor_parallel_size <= 8:
            raise ValueError(f"tensor_parallel_size: must be 1..8, got {self.tensor_parallel_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be positive, got {self.num_threads}")

    def _check_choices(self) -> None:
        """Settings that name one of a fixed set."""
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.stage_channel not in ("auto", "shm", "nccl", "grpc"):
            raise ValueError(f"stage_channel: must be one of auto, shm, nccl, grpc, got {self.stage_channel!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}"
            )

    def _check_emulated(self) -> None:
        """An emulated device names a profile that loads, and takes only the settings that
        mean something without weights or device memory."""
        spec = self.emulated_profile
        if spec is None:
            return
        if not spec:
            raise ValueError(
                f"device: {EMULATED_PREFIX}PROFILE needs a profile (a shipped name or a JSON "
                "file), e.g. emulated:a100-80gb-llama2-70b-tp8"
            )
        if self.gpu_memory_utilization is not None:
            raise ValueError(
                "gpu_memory_utilization: an emulated device has no memory to take a fraction "
                "of; size its pool with num_kv_blocks or kv_cache_memory"
            )
        if self.quantization is not None:
            raise ValueError("quantization: an emulated device loads no weights to quantize")
        from services.device_profile import load_profile

        try:
            load_profile(spec)
        except ValueError as exc:
            raise ValueError(f"device: {exc}") from None

    @property
    def emulated_profile(self) -> str | None:
        """`--device emulated:PROFILE`: the profile (a shipped name or a JSON file); None
        for a real device."""
        return emulated_profile_spec(self.device)

    @property
    def has_memory_setting(self) -> bool:
        """A memory setting is given: it sizes the pool, or (with --num-kv-blocks, as where
        the pool is fixed for every service, e.g. compose) the stage checks that many fit."""
        return self.gpu_memory_utilization is not None or self.kv_cache_memory is not None

    @property
    def fixed_num_kv_blocks(self) -> int:
        """The pool's size when not sized from memory."""
        return self.num_kv_blocks if self.num_kv_blocks is not None else NUM_KV_BLOCKS

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def resolved_num_threads(self) -> int:
        """Intra-op threads: the flag, else the machine's cores but one (left to the scheduler,
        gateway and KV service) divided among the local stages' processes (tensor-parallel
        ranks each count)."""
        if self.num_threads is not None:
            return self.num_threads
        return max(1, ((os.cpu_count() or 1) - 1) // (self.num_stages * self.tensor_parallel_size))

    @property
    def step_threads(self) -> tuple[int, int] | None:
        """(small steps, large steps) threads (worker_svc/runner.LARGE_STEP_TOKENS), or None
        for `resolved_num_threads` on every step: with no --num-threads and no tensor
        parallelism, a large step (a prefill chunk) also takes the core left to the services,
        which wait on it (2 cores, one stage: 1 and 2)."""
        if self.num_threads is not None or self.tensor_parallel_size > 1:
            return None
        small = self.resolved_num_threads
        large = max(small, (os.cpu_count() or 1) // self.num_stages)
        return (small, large) if large > small else None

    def to_json(self) -> str:
        """The configuration as JSON (how a stage hands it to its tensor-parallel ranks)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        raw = json.loads(text)
        for name in ("layer_partition", "lora_modules"):  # (JSON has lists only)
            if raw.get(name) is not None:
                raw[name] = tuple(raw[name])
        return cls(**raw)

    def max_message_bytes(self, hidden_size: int) -> int:
        """The largest micro-batch message this configuration allows, with headroom.

        Hidden states of max_num_batched_tokens tokens in float32, plus per-token ids,
        positions and slots, plus block tables of max_num_seqs sequences of full length.
        """
        per_token = hidden_size * 4 + 32
        tables = self.max_num_seqs * 64 * 1024
        return self.max_num_batched_tokens * per_token + tables + (4 << 20)


def emulated_profile_spec(device: str | None) -> str | None:
    """`emulated:PROFILE` -> PROFILE; None for a real device (cpu, cuda, cuda:N, None)."""
    if device is None or not device.startswith(EMULATED_PREFIX):
        return None
    return device[len(EMULATED_PREFIX) :]


# what `pagoda worker` takes: the config's settings, then where it reports
SETTINGS = shared.settings_of(WorkerConfig, shared.METRICS_PORT, shared.READY_FILE, shared.INTERNAL_TOKEN)
