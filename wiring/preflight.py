"""What `pagoda serve` checks before it starts anything (issue 28).

A setting that would make the stack die after starting (a stage's usage text after 47 s, a
memory refusal after a minute) or start in a shape that cannot serve (a pool that does not
hold one sequence) is refused at once, in one line naming the flag and the numbers. Read
from the checkpoint's files (config.json, tokenizer.json, the weight files' names and sizes)
and the machine (cores, memory); no torch, nothing started. `pagoda serve` turns a
ValueError from here into `error: ...` and exit code 2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from services import settings as shared
from services.defaults import NUM_KV_BLOCKS
from worker_svc.errors import CheckpointError
from worker_svc.model_config import ModelConfig
from worker_svc.models.registry import load_config

# A CPU stage's process before any weight: Python, torch and the worker (about 235 MiB
# measured); a floor, so that the memory check refuses only what cannot start.
STAGE_PROCESS_BYTES = 200 << 20
MIB = 1 << 20
_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder as serve reads it before starting: its architecture (a
    worker_svc ModelConfig) and the least its weights take in memory."""

    config: ModelConfig
    weight_bytes: int  # the weight files' tensors (a GGUF file's packed tensors)
    packed: bool  # the folder stands for a GGUF file: its weights stay as the file holds them

    def least_weight_bytes(self, quantization: str | None) -> int:
        """The least the weights take as a stage holds them: a float32 checkpoint may be
        served as bfloat16 (`--dtype auto` on some CPUs), any float one quantized to a byte."""
        if self.packed:
            return self.weight_bytes
        stored = _BYTES_PER_PARAM.get(self.config.torch_dtype, 4)
        served = 1 if quantization else 2
        return self.weight_bytes * min(served, stored) // stored


def read_checkpoint(model_dir: str | Path, weights: bool = True) -> Checkpoint:
    """The folder's config.json as the stages read it (architecture, fields, rope) and its
    weight files (not with `weights` False: emulated stages load none, so config.json is the
    whole model); ValueError in one line saying what is missing or not served."""
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a checkpoint directory (no config.json) or a GGUF file")
    try:
        config = load_config(folder)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    weight_bytes, packed = _weights(folder) if weights else (0, False)
    return Checkpoint(config, weight_bytes, packed)


def _weights(folder: Path) -> tuple[int, bool]:
    """(the weight files' bytes, whether they are a GGUF file's): safetensors files, a
    sharded index's files, or a prepared GGUF folder's record; ValueError otherwise."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index: {exc}") from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ValueError(f"{index} lists {', '.join(missing[:3])}, not in the folder")
        return sum((folder / f).stat().st_size for f in files), False
    if (folder / "model.safetensors").is_file():
        return (folder / "model.safetensors").stat().st_size, False
    # (it imports torch: only for a folder without safetensors)
    from worker_svc.checkpoints.gguf_checkpoint import GGUF_SOURCE_FILE

    record = folder / GGUF_SOURCE_FILE
    if record.is_file():
        try:
            return int(json.loads(record.read_text())["tensor_bytes"]), True
        except (OSError, ValueError, KeyError, TypeError):
            return 0, True
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickled:
        raise ValueError(
            f"{folder}: the weights are pickled ({', '.join(pickled[:3])}), which Pagoda never "
            "loads: convert them to safetensors (transformers: "
            "model.save_pretrained(dir, safe_serialization=True))"
        )
    raise ValueError(f"{folder}: no weights: no model.safetensors or model.safetensors.index.json")


def check_tokenizers(model_dir: str | Path, tokenizer_dir: str | None) -> None:
    """The tokenizers the stack reads load: the gateway's (--tokenizer's folder, else the
    model's) and the model's own, whose stop tokens the scheduler reads."""
    from services.text import Tokenizer

    for folder in dict.fromkeys([tokenizer_dir or str(model_dir), str(model_dir)]):
        try:
            Tokenizer(folder)
        except ValueError as exc:
            why = (
                " (the scheduler reads the model's stop tokens from it, --tokenizer or not)"
                if tokenizer_dir and folder != tokenizer_dir
                else ""
            )
            raise ValueError(f"{exc}{why}") from None


def read_chat_template(value: str) -> str:
    """--chat-template's template: the file it names, else the text itself when it is one
    (it holds a `{`); ValueError when it is neither, or does not compile."""
    from services.text.chat import compile_chat_template

    flag = "--chat-template"
    path = Path(value).expanduser()
    if path.is_file():
        try:
            source, origin = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag} {value}: cannot read it: {exc}") from None
    elif "{" in value:
        source, origin = value, flag
    else:
        raise ValueError(f"{flag} {value}: no such file (nor a template: it holds no '{{')")
    compile_chat_template(source, origin=origin)  # ChatTemplateError, a ValueError, naming the line
    return source


def check_stages(
    config: ModelConfig, pipeline_parallel_size: int, tensor_parallel_size: int, expert_parallel: bool = False
) -> None:
    """Every stage holds at least one layer; T ranks divide the heads, KV heads and MLP (the
    experts, under expert parallelism)."""
    pp, layers = pipeline_parallel_size, config.num_layers
    if pp > layers:
        raise ValueError(
            f"{shared.PIPELINE_PARALLEL_SIZE.flag} {pp}: the model has {layers} layers "
            f"(num_hidden_layers) and each stage holds at least one: give at most {layers}"
        )
    if expert_parallel and config.moe is None:
        raise ValueError(f"{shared.ENABLE_EXPERT_PARALLEL.flag}: {config.architecture} has no experts")
    # ValueError naming what does not divide, and what would
    config.shard(tensor_parallel_size, 0 if expert_parallel else None)


def serve_max_model_len(
    given: int | None, positions: int, num_kv_blocks: int | None, block_size: int, pool_given: bool
) -> tuple[int | None, str]:
    """(the max_model_len to serve, a note to print or ""). None leaves it to the services
    (the model's positions). `num_kv_blocks` None: the pool is sized from memory (the stages
    check it). ValueError when --max-model-len is past the model's positions, or when it does
    not fit in a fixed pool; without --max-model-len a pool that holds fewer tokens than the
    model's positions lowers it to what the pool holds, and says so."""
    mml, blocks_flag = shared.MAX_MODEL_LEN.flag, shared.NUM_KV_BLOCKS.flag
    if given is not None and given > positions:
        raise ValueError(
            f"{mml} {given} is above the model's max_position_embeddings ({positions}, config.json): "
            f"its stages compute no position past it; give at most {positions}, or leave it out"
        )
    if num_kv_blocks is None:
        return given, ""
    capacity, want = num_kv_blocks * block_size, given if given is not None else positions
    if want <= capacity:
        return given, ""
    pool = f"{blocks_flag} {num_kv_blocks}" if pool_given else f"the default pool of {num_kv_blocks} blocks"
    holds = f"{pool} x {shared.BLOCK_SIZE.flag} {block_size} holds {capacity} tokens"
    if given is not None:
        raise ValueError(
            f"{mml} {given} is larger than the KV cache can hold: {holds}, one sequence of {given} "
            f"needs {-(-given // block_size)} blocks; raise {blocks_flag} to at least "
            f"{-(-given // block_size)} or lower {mml} to at most {capacity}"
        )
    return capacity, (
        f"max_model_len {capacity}, not the model's {positions}: {holds} (give {mml}, or "
        f"{blocks_flag} {-(-positions // block_size)} for the whole context)"
    )


def fixed_pool(num_kv_blocks: int | None, memory_setting: bool) -> int | None:
    """The pool's size when not sized from memory: as given, else the default."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    return None if memory_setting else NUM_KV_BLOCKS


def machine_memory_bytes() -> int:
    """The system's memory, or the container's limit when lower (as a CPU stage counts it,
    worker_svc/execution/memory.py `total_memory`)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < min(physical, 1 << 60):
            return int(text)
        break
    return physical


def check_memory_fraction(fraction: float, weight_bytes: int, num_processes: int, total_bytes: int) -> None:
    """On the CPU, --gpu-memory-utilization F is F of the machine's memory for every stage
    together (serve shares it equally): refused when it cannot even hold the weights and the
    stages' processes, before any activation or KV block (a stage would find so only after
    loading and profiling, a minute on 2 cores)."""
    need = weight_bytes + num_processes * STAGE_PROCESS_BYTES
    budget = fraction * total_bytes
    if budget >= need:
        return
    least = math.ceil(need / total_bytes * 1000) / 1000
    raise ValueError(
        f"{shared.GPU_MEMORY_UTILIZATION.flag} {fraction} gives the stages {budget / MIB:.0f} MiB of "
        f"{total_bytes / MIB:.0f} MiB (this machine's memory), less than the weights ({weight_bytes / MIB:.0f} MiB, "
        f"from the checkpoint's files) and {num_processes} stage process(es) (about {STAGE_PROCESS_BYTES // MIB} "
        f"MiB each) take before any KV block: give more than {least} (or size the pool with "
        f"{shared.KV_CACHE_MEMORY.flag} / {shared.NUM_KV_BLOCKS.flag})"
    )


def on_the_cpu(device: str | None) -> bool:
    """Whether the stages run on the CPU: --device cpu, or no device given and no GPU here."""
    if device is not None:
        return device == "cpu"
    return not Path("/dev/nvidia0").exists() and not Path("/dev/kfd").exists()


def cores_warning(pipeline_parallel_size: int, tensor_parallel_size: int, replicas: int, num_cores: int) -> str:
    """A warning when the stage processes outnumber the cores they run on ("": none): they
    take turns on the cores (PP=3 on 2 cores served 3-4x slower than one stage)."""
    processes = pipeline_parallel_size * tensor_parallel_size * replicas
    if processes <= num_cores:
        return ""
    shape = " x ".join(
        f"{flag} {n}"
        for flag, n in (
            (shared.PIPELINE_PARALLEL_SIZE.flag, pipeline_parallel_size),
            (shared.TENSOR_PARALLEL_SIZE.flag, tensor_parallel_size),
            ("--replicas", replicas),
        )
        if n > 1
    )
    return (
        f"warning: {processes} stage processes ({shape}) on {num_cores} core(s): they take turns on the "
        f"cores and serve several times slower than one stage would (stages add no compute on one "
        f"machine); use at most {num_cores} stage process(es), e.g. {shared.PIPELINE_PARALLEL_SIZE.flag} 1, "
        f"so that each gets a core of its own (--cpu-affinity pins them; {shared.NUM_THREADS.flag} sets "
        f"their threads)"
    )


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def check_draft_model(speculative_config: str | None, target: ModelConfig, target_dir: str | Path) -> None:
    """--speculative-config's draft model (method draft_model) exists and shares the target's
    vocabulary, read from its config.json (the last stage would find so only after loading
    both models). A file there (a GGUF file) is left to the stage."""
    from services.speculative import SpeculativeConfig

    flag = shared.SPECULATIVE_CONFIG.flag
    spec = SpeculativeConfig.parse(speculative_config)
    if spec is None or spec.method != "draft_model":
        return
    draft_dir = Path(spec.model)
    if not draft_dir.exists():
        raise ValueError(
            f"{flag}: the draft model {spec.model} does not exist (speculative_config.model: a checkpoint folder)"
        )
    if not draft_dir.is_dir():
        return
    try:
        draft = load_config(draft_dir)
    except CheckpointError as exc:
        raise ValueError(f"{flag}: the draft model: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{flag}: the draft model's vocabulary ({draft.vocab_size}, {draft_dir / 'config.json'}) "
            f"is not the target's ({target.vocab_size}, {Path(target_dir) / 'config.json'}): a draft "
            "must share the target's tokenizer"
        )


ADAPTER_CONFIG = "adapter_config.json"  # (worker_svc/weights/lora.py's CONFIG_FILE: a PEFT folder's)


def check_lora_modules(lora_modules, max_lora_rank: int) -> None:
    """Each --lora-modules adapter is a PEFT folder whose rank --max-lora-rank takes, read from
    its adapter_config.json (a stage would refuse it only after loading the model)."""
    for name, path in shared.lora_modules(lora_modules).items():
        where = f"{shared.LORA_MODULES.flag} {name}={path}"
        config = Path(path) / ADAPTER_CONFIG
        rank = _adapter_rank(config, where)
        if rank > max_lora_rank:
            flag = shared.MAX_LORA_RANK.flag
            raise ValueError(
                f"{where}: LoRA rank {rank} ({config}) is above {flag} {max_lora_rank}: raise {flag} to at least {rank}"
            )


def _adapter_rank(config: Path, where: str) -> int:
    """An adapter's largest rank, as a stage reads it (r and rank_pattern: worker_svc/weights/lora.py)."""
    if not config.is_file():
        raise ValueError(f"{where}: no {ADAPTER_CONFIG} there (not a PEFT adapter folder)")
    try:
        raw = json.loads(config.read_text())
        return max([int(raw["r"]), *(int(r) for r in (raw.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: {config} does not give the adapter's rank (r, rank_pattern): {exc!r}") from None
