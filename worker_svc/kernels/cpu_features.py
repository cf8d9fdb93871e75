"""What this CPU can run, and which path each of a stage's products takes on it.

`cpu_features()` reads the processor's model and flags once (`/proc/cpuinfo`) and lowers them
to the narrowest of the ISA caps the process was started with, so that a wider machine can
stand in for a narrower one (an AVX2-only CPU emulated on an AVX-512 one):

    ONEDNN_MAX_CPU_ISA   oneDNN's cap (AVX2, AVX512_CORE, AVX512_CORE_BF16, ...)
    ATEN_CPU_CAPABILITY  torch's own vectorised kernels (default, avx2, avx512)
    PAGODA_CPU_ISA       Pagoda's native kernels (scalar, avx2, avx512)

`CpuPaths.choose(features)` then names a path per kind of product (docs/cpu-paths.md):

- `bf16_gemm`: whether oneDNN's bfloat16 GEMM may run at all. Only with BF16 units (AVX-512
  BF16 or AMX): without them oneDNN emulates bfloat16 products in float32 code with
  conversions on every load (measured 7.2 GFLOP/s against float32's 57 on an AVX2-only
  EPYC, one thread: a 2,048-token prefill step past a minute, the cause of issue 34's
  livelock).
- `packed_prefill` (a Q8_0/Q4_0/Q4_1 product of many rows): "bf16-gemm" (weights dequantized
  to bfloat16, oneDNN's bfloat16 GEMM) with BF16 units, else "f32-gemm" (dequantized to
  float32, float32 GEMM) or "integer" (the native integer kernels on the packed blocks),
  whichever a start-up calibration found faster on this CPU (cached per CPU model).
- `bf16_prefill` (bfloat16 weights, many rows): "bf16-gemm" with BF16 units, else "f32-gemm"
  (the weights widened to float32 once, the float32 GEMM: 2.6 ms against the native widening
  kernel's 5.4 at 128 x 576 x 1,536 on an AVX2-capped EPYC); "native" (that kernel) forced.
- `march`: the `-march` the native C kernels are built with (`native`, or the cap's level).

`PAGODA_CPU_PATHS` forces paths for tests and benchmarks (`packed_prefill=integer,...`); a
forced path needing a unit the CPU lacks is refused at start.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace

from services.settings import CPU_ISA, CPU_PATHS, env_value

log = logging.getLogger(__name__)

PATHS_ENV = CPU_PATHS.variable
# levels, narrowest first; a feature belongs to the first level that has it
LEVELS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
_LEVEL_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# every cap's value -> the widest level it allows
_ONEDNN_CAPS = {
    "SSE41": "scalar",
    "AVX": "scalar",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512_vnni",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
    "AVX512_CORE_AMX": "amx",
    "AVX10_1_512_AMX": "amx",
    "AVX512_CORE_AMX_FP16": "amx",
    "AVX10_1_512_AMX_FP16": "amx",
    "ALL": "amx",
    "DEFAULT": "amx",
}
_ATEN_CAPS = {"default": "scalar", "avx2": "avx2", "avx512": "amx"}  # avx512: no cap on oneDNN's units
_PAGODA_CAPS = {"scalar": "scalar", "avx2": "avx2", "avx512": "amx"}
_CAP_ENVS = (
    ("ONEDNN_MAX_CPU_ISA", _ONEDNN_CAPS),
    ("ATEN_CPU_CAPABILITY", _ATEN_CAPS),
    (CPU_ISA.variable, _PAGODA_CAPS),
)
PACKED_PREFILL = ("bf16-gemm", "f32-gemm", "integer")
BF16_PREFILL = ("bf16-gemm", "f32-gemm", "native")


@dataclass(frozen=True)
class CpuFeatures:
    """The processor (`model_name`, `family`, `model`), its own flags (`host_flags`) and the
    level a cap left it (`level`, one of LEVELS); `caps` names the variables that lowered it."""

    model_name: str
    family: int
    model: int
    host_flags: frozenset[str]
    level: str
    caps: tuple[str, ...] = ()

    @classmethod
    def from_cpuinfo(cls, text: str, environ: dict[str, str] | None = None) -> CpuFeatures:
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and "flags" in fields:
                break  # the first processor's block is enough
        flags = frozenset(fields.get("flags", "").split())
        host = host_level(flags)
        level, caps = _capped(host, _process_caps() if environ is None else environ)
        return cls(
            fields.get("model name", "unknown CPU"),
            _int(fields.get("cpu family")),
            _int(fields.get("model")),
            flags,
            level,
            caps,
        )

    @property
    def host_level(self) -> str:
        return host_level(self.host_flags)

    def has(self, level: str) -> bool:
        """Whether the capped CPU runs `level` (one of LEVELS)."""
        return LEVELS.index(level) <= LEVELS.index(self.level)

    @property
    def bf16_units(self) -> bool:
        return (
            self.has("avx512_bf16")
            and "avx512_bf16" in self.host_flags
            or (self.has("amx") and "amx_bf16" in self.host_flags)
        )

    @property
    def isa_flags(self) -> tuple[str, ...]:
        """The flags that matter here and that the cap leaves, widest last."""
        names = [f for lvl in LEVELS[1:] if self.has(lvl) for f in _LEVEL_FLAGS[lvl] if f in self.host_flags]
        return tuple(names)

    def describe(self) -> str:
        capped = f" (host {self.host_level}, capped by {', '.join(self.caps)})" if self.caps else ""
        return (
            f"{self.model_name} (family {self.family} model {self.model}): {self.level}{capped}; "
            f"flags {' '.join(self.isa_flags) or 'none'}"
        )


def host_level(flags: frozenset[str]) -> str:
    level = "scalar"
    for name in LEVELS[1:]:
        if not all(f in flags for f in _LEVEL_FLAGS[name]) and name != "amx":
            break
        if name == "amx" and not ("amx_tile" in flags and "amx_bf16" in flags):
            break
        level = name
    return level


def _capped(host: str, environ) -> tuple[str, tuple[str, ...]]:
    level, caps = host, []
    for var, table in _CAP_ENVS:
        value = environ.get(var, "").strip()
        if not value:
            continue
        cap = table.get(value.upper() if table is _ONEDNN_CAPS else value.lower())
        if cap is None:
            log.warning("%s=%r is not a value this knows (%s): ignored", var, value, ", ".join(table))
            continue
        if LEVELS.index(cap) < LEVELS.index(host):
            level = min(level, cap, key=LEVELS.index)
            caps.append(f"{var}={value}")
    return level, tuple(caps)


def _process_caps() -> dict[str, str]:
    """The caps this process was started with: oneDNN's and torch's own variables (read to know
    which units their products will use) and Pagoda's setting."""
    return {
        "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        CPU_ISA.variable: env_value(CPU_ISA) or "",
    }


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU, capped by its environment (read once)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    return CpuFeatures.from_cpuinfo(text)


@dataclass(frozen=True)
class CpuPaths:
    """The path each kind of product takes (see the module's docstring). Invariant: no path
    needs a unit the CPU (as capped) lacks: `check(features)` raises otherwise."""

    bf16_gemm: bool
    packed_prefill: str
    bf16_prefill: str
    march: str
    forced: tuple[str, ...] = ()

    @classmethod
    def choose(cls, features: CpuFeatures, calibrated: str | None = None, forced: str | None = None) -> CpuPaths:
        """The paths for `features`: `calibrated` is the faster packed prefill path without
        BF16 units ("f32-gemm" unless a calibration found "integer" faster); `forced` a
        PAGODA_CPU_PATHS value."""
        units = features.bf16_units
        paths = cls(
            bf16_gemm=units,
            packed_prefill="bf16-gemm" if units else (calibrated or "f32-gemm"),
            bf16_prefill="bf16-gemm" if units else "f32-gemm",
            march=march(features),
        )
        if forced:
            paths = paths.forcing(forced)
        paths.check(features)
        return paths

    def forcing(self, spec: str) -> CpuPaths:
        changes: dict[str, object] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, _, value = item.partition("=")
            key, value = key.strip(), value.strip()
            allowed = {"packed_prefill": PACKED_PREFILL, "bf16_prefill": BF16_PREFILL}.get(key)
            if allowed is None or value not in allowed:
                raise ValueError(
                    f"{PATHS_ENV}: {item!r}: expected packed_prefill=({'|'.join(PACKED_PREFILL)}) "
                    f"or bf16_prefill=({'|'.join(BF16_PREFILL)})"
                )
            changes[key] = value
        return replace(self, **changes, forced=tuple(sorted(changes)))

    def check(self, features: CpuFeatures) -> None:
        needs_units = self.packed_prefill == "bf16-gemm" or self.bf16_prefill == "bf16-gemm" or self.bf16_gemm
        if needs_units and not features.bf16_units:
            raise ValueError(
                f"a bfloat16 GEMM needs BF16 units (AVX-512 BF16 or AMX), which this CPU lacks ({features.describe()})"
            )

    def describe(self) -> str:
        forced = f" (forced: {', '.join(self.forced)})" if self.forced else ""
        return (
            f"packed prefill {self.packed_prefill}, bf16 prefill {self.bf16_prefill}, "
            f"bf16 gemm {'yes' if self.bf16_gemm else 'no'}, kernels -march={self.march}{forced}"
        )


def march(features: CpuFeatures) -> str:
    """The -march the native kernels are built with for `features`."""
    if not features.caps:
        return "native"
    if features.has("avx512"):
        return "native"  # a cap above AVX-512 F changes no compiled instruction of ours
    return "x86-64-v3" if features.has("avx2") else "x86-64-v2"
