"""Step-time profiles of an emulated device: what one stage's forward pass would cost.

An emulated stage (`--device emulated:PROFILE`) does everything a real stage does except the
forward pass, which becomes a wait of `DeviceProfile.step_time_s(...)`. A profile is a linear
model of one step of one pipeline stage:

    fixed_s + layer_fraction * (per_step_s
                                + num_prefill_tokens * per_prefill_token_s
                                + num_decode_rows * per_decode_row_s
                                + num_context_tokens * per_context_token_s
                                + (tensor_parallel_size > 1)
                                  * (num_prefill_tokens + num_decode_rows) * allreduce_per_token_s)
    + (last stage) * (last_stage_fixed_s + num_sampled_rows * last_stage_per_row_s)

Every per-* cost is for ALL of the model's layers; a stage holding a share of the layers pays
that share (`layer_fraction`). `fixed_s` is paid once per step by every stage whatever its
share (launching the step); `per_step_s` is paid once per step per layer (reading the layer's
weights, the all-reduces' latency), so a stage pays its share of it. The `last_stage_*` costs
are what only the last stage runs, the final norm, the LM head and sampling: once per step and
per row that samples (a decode row, or a prompt's last chunk). A profile that charges the head
to every stage instead (as the A100's does, in `fixed_s`) leaves them 0.

Profiles are JSON files: the ones shipped with the code live in services/profiles/<name>.json
(read with importlib.resources, so they work from an editable install and a wheel); any other
file is loaded by its path. The form, which `save_profile` writes and `load_profile` reads:

    {"name": str, "source": str, "notes": [str, ...],
     "step": {"fixed_s", "per_step_s", "per_prefill_token_s", "per_decode_row_s",
              "per_context_token_s", "allreduce_per_token_s",
              "last_stage_fixed_s", "last_stage_per_row_s"},        # seconds, >= 0
     "eos_probability": float in [0, 1],
     "tensor_parallel_size": int >= 1,                              # optional, default 1
     "host_compute": bool,                                          # optional, default false
     "kv_transfer_bytes_per_s": float,                              # optional, default 0 (not modelled)
     "model": {"hidden_size": int, "num_layers": int, ...}}         # optional, informational

`kv_transfer_bytes_per_s` is the KV link between two replicas' devices (P/D disaggregation, issue
39): the bytes per second one pipeline stage's devices together move to the same stage of another
replica; an emulated stage's pull of N bytes waits `kv_transfer_time_s(N)` (0 when not modelled).

`per_step_s`, the `last_stage_*` costs and `tensor_parallel_size` may be left out (0.0 and 1); the other keys of "model"
are for readers and are not loaded. Unknown keys elsewhere are refused, so a misspelt cost is
never silently zero. Torch-free and service-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

PROFILES_PACKAGE, PROFILES_DIR = "services", "profiles"
# the costs of one step, in the order the file lists them; per_step_s alone may be left out
STEP_FIELDS = (
    "fixed_s",
    "per_step_s",
    "per_prefill_token_s",
    "per_decode_row_s",
    "per_context_token_s",
    "allreduce_per_token_s",
    "last_stage_fixed_s",
    "last_stage_per_row_s",
)
OPTIONAL_STEP_FIELDS = ("per_step_s", "last_stage_fixed_s", "last_stage_per_row_s")
TOP_LEVEL_KEYS = (
    "name",
    "source",
    "notes",
    "step",
    "eos_probability",
    "tensor_parallel_size",
    "host_compute",
    "kv_transfer_bytes_per_s",
    "model",
)
MODEL_FIELDS = ("hidden_size", "num_layers")


@dataclass(frozen=True)
class DeviceProfile:
    """A linear step-time model of one pipeline stage on one kind of device (see the module doc).

    Invariants (checked at construction): every cost and kv_transfer_bytes_per_s is a finite
    number >= 0, eos_probability is in [0, 1], tensor_parallel_size >= 1, hidden_size and
    num_layers are None or >= 1. Costs are for all of the model's layers; `tensor_parallel_size`
    is the tensor-parallel degree the costs were made for (pass it to `step_time_s` unless
    emulating another degree).
    """

    name: str
    source: str  # where the numbers come from (free text, also in the JSON)
    fixed_s: float  # per step of one stage: launch / kernel-start overhead
    per_prefill_token_s: float  # for ALL of the model's layers; a stage pays layer_fraction of it
    per_decode_row_s: float  # per decode sequence (one new token) in the step, all layers
    per_context_token_s: float  # per context token read by attention (sum over the step), all layers
    allreduce_per_token_s: float  # tensor-parallel all-reduce per token of the step, all layers
    eos_probability: float  # chance a sampled token is EOS (emulated lengths); 0..1
    hidden_size: int | None = None  # the model the profile was made for (informational)
    num_layers: int | None = None
    per_step_s: float = 0.0  # all layers, paid once per step, scaled by layer_fraction
    tensor_parallel_size: int = 1  # the tensor-parallel degree the costs were made for
    last_stage_fixed_s: float = 0.0  # the last stage only, per step: final norm, LM head, sampling
    last_stage_per_row_s: float = 0.0  # the last stage only, per row that samples
    # the device is this machine's own CPU: an emulated step keeps a core busy for its time, as
    # the real stage would, instead of sleeping (the other services meet the same contention)
    host_compute: bool = False
    # P/D: the KV link from one stage's devices (all of them together) to the same stage of
    # another replica, bytes per second; 0: not modelled (an emulated pull costs no time)
    kv_transfer_bytes_per_s: float = 0.0
    notes: tuple[str, ...] = ()  # free-text lines explaining every number

    def __post_init__(self) -> None:
        _check_profile(self)

    def step_time_s(
        self,
        *,
        layer_fraction: float,
        num_prefill_tokens: int,
        num_decode_rows: int,
        num_context_tokens: int,
        tensor_parallel_size: int = 1,
        is_last_stage: bool = False,
        num_sampled_rows: int = 0,
    ) -> float:
        """Seconds one stage's forward pass of one step takes on this device.

        `layer_fraction`: the stage's share of the model's layers, in (0, 1].
        `num_prefill_tokens`: prompt tokens computed in the step (all sequences, all chunks).
        `num_decode_rows`: sequences decoding one token in the step.
        `num_context_tokens`: tokens attention reads, summed over the step's sequences: each
        sequence's length once this step's tokens are in its KV cache (cached + new).
        `tensor_parallel_size`: the stage's tensor-parallel degree; the all-reduce term is paid
        only above 1.
        `is_last_stage`, `num_sampled_rows`: the last stage pays the `last_stage_*` costs, per
        step and per row that samples.
        """
        _check_step_arguments(
            layer_fraction,
            num_prefill_tokens,
            num_decode_rows,
            num_context_tokens,
            tensor_parallel_size,
            num_sampled_rows,
        )
        num_tokens = num_prefill_tokens + num_decode_rows
        allreduce = num_tokens * self.allreduce_per_token_s if tensor_parallel_size > 1 else 0.0
        per_layers = (
            self.per_step_s
            + num_prefill_tokens * self.per_prefill_token_s
            + num_decode_rows * self.per_decode_row_s
            + num_context_tokens * self.per_context_token_s
            + allreduce
        )
        head = (self.last_stage_fixed_s + num_sampled_rows * self.last_stage_per_row_s) if is_last_stage else 0.0
        return self.fixed_s + layer_fraction * per_layers + head

    def kv_transfer_time_s(self, num_bytes: int) -> float:
        """Seconds the KV link takes to move `num_bytes` of one stage's blocks to the same stage
        of another replica (P/D disaggregation); 0 when the profile does not model the link."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        return num_bytes / self.kv_transfer_bytes_per_s if self.kv_transfer_bytes_per_s else 0.0


def _check_profile(profile: DeviceProfile) -> None:
    where = f"device profile {profile.name!r}"
    for field in ("name", "source"):
        if not isinstance(getattr(profile, field), str) or not getattr(profile, field):
            raise ValueError(f"{where}: {field} must be a non-empty string")
    for field in STEP_FIELDS:
        _non_negative(getattr(profile, field), f"{where}: {field}")
    _non_negative(profile.eos_probability, f"{where}: eos_probability")
    _non_negative(profile.kv_transfer_bytes_per_s, f"{where}: kv_transfer_bytes_per_s")
    if profile.eos_probability > 1:
        raise ValueError(f"{where}: eos_probability must be in [0, 1], got {profile.eos_probability}")
    _positive_int(profile.tensor_parallel_size, f"{where}: tensor_parallel_size")
    if not isinstance(profile.host_compute, bool):
        raise ValueError(f"{where}: host_compute must be true or false, got {profile.host_compute!r}")
    for field in MODEL_FIELDS:
        if getattr(profile, field) is not None:
            _positive_int(getattr(profile, field), f"{where}: {field}")
    if not isinstance(profile.notes, tuple) or not all(isinstance(n, str) for n in profile.notes):
        raise ValueError(f"{where}: notes must be a tuple of strings")


def _non_negative(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")


def _positive_int(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")


def _check_step_arguments(
    layer_fraction: float,
    num_prefill_tokens: int,
    num_decode_rows: int,
    num_context_tokens: int,
    tensor_parallel_size: int,
    num_sampled_rows: int,
) -> None:
    if not 0 < layer_fraction <= 1:
        raise ValueError(f"layer_fraction must be in (0, 1], got {layer_fraction}")
    counts = {
        "num_prefill_tokens": num_prefill_tokens,
        "num_decode_rows": num_decode_rows,
        "num_context_tokens": num_context_tokens,
        "num_sampled_rows": num_sampled_rows,
    }
    for what, count in counts.items():
        if count < 0:
            raise ValueError(f"{what} must be >= 0, got {count}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")


# --- files ------------------------------------------------------------------------------------


def _shipped_dir():
    return resources.files(PROFILES_PACKAGE).joinpath(PROFILES_DIR)


def profile_names() -> list[str]:
    """The names of the profiles shipped with the code (services/profiles/<name>.json), sorted."""
    return sorted(entry.name[: -len(".json")] for entry in _shipped_dir().iterdir() if entry.name.endswith(".json"))


def load_profile(spec: str) -> DeviceProfile:
    """A profile by name (a shipped one) or by a path to a JSON file.

    A spec ending in `.json` or holding a path separator is a path; anything else is a name.
    Raises ValueError naming the problem: an unknown name (listing the known ones), a missing
    file, bad JSON, a missing, misspelt or negative field, eos_probability outside [0, 1].
    """
    spec = str(spec)
    if spec.endswith(".json") or "/" in spec or "\\" in spec:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"device profile file {spec!r} does not exist")
        return _parse(path.read_text(encoding="utf-8"), origin=spec)
    known = profile_names()
    if spec not in known:
        raise ValueError(f"unknown device profile {spec!r}; known: {', '.join(known)} (or give a path to a .json file)")
    text = _shipped_dir().joinpath(f"{spec}.json").read_text(encoding="utf-8")
    return _parse(text, origin=f"services/profiles/{spec}.json")


def save_profile(profile: DeviceProfile, path) -> None:
    """Write `profile` as the JSON form `load_profile` reads (creating the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n", encoding="utf-8")


def profile_to_dict(profile: DeviceProfile) -> dict[str, Any]:
    """The JSON form of a profile (see the module doc)."""
    model = {f: getattr(profile, f) for f in MODEL_FIELDS if getattr(profile, f) is not None}
    return {
        "name": profile.name,
        "source": profile.source,
        "notes": list(profile.notes),
        "step": {f: getattr(profile, f) for f in STEP_FIELDS},
        "eos_probability": profile.eos_probability,
        "tensor_parallel_size": profile.tensor_parallel_size,
        "host_compute": profile.host_compute,
        "kv_transfer_bytes_per_s": profile.kv_transfer_bytes_per_s,
        "model": model,
    }


def profile_from_dict(data: Any, origin: str = "device profile") -> DeviceProfile:
    """A profile from its JSON form; ValueError naming the file and the field that is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a profile is a JSON object, got {type(data).__name__}")
    _no_unknown_keys(data, TOP_LEVEL_KEYS, origin)
    for key in ("name", "source", "step", "eos_probability"):
        if key not in data:
            raise ValueError(f"{origin}: missing field {key!r}")
    step = data["step"]
    if not isinstance(step, dict):
        raise ValueError(f"{origin}: 'step' must be an object of {', '.join(STEP_FIELDS)}")
    _no_unknown_keys(step, STEP_FIELDS, f"{origin}: step")
    for key in STEP_FIELDS:
        if key not in step and key not in OPTIONAL_STEP_FIELDS:
            raise ValueError(f"{origin}: missing field 'step.{key}'")
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"{origin}: 'model' must be an object")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ValueError(f"{origin}: 'notes' must be a list of strings")
    try:
        return DeviceProfile(
            name=data["name"],
            source=data["source"],
            notes=tuple(notes),
            eos_probability=data["eos_probability"],
            tensor_parallel_size=data.get("tensor_parallel_size", 1),
            host_compute=data.get("host_compute", False),
            kv_transfer_bytes_per_s=data.get("kv_transfer_bytes_per_s", 0.0),
            hidden_size=model.get("hidden_size"),
            num_layers=model.get("num_layers"),
            **{key: step.get(key, 0.0) for key in STEP_FIELDS},
        )
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from None


def _no_unknown_keys(data: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; expected {', '.join(allowed)}")


def _parse(text: str, origin: str) -> DeviceProfile:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{origin}: not valid JSON ({e})") from None
    return profile_from_dict(data, origin)
