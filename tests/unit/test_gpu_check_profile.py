"""scripts/gpu_check.py's profile part, on a stand-in device (the CPU, a toy model): it times
Pagoda's own stage runner, fits the step model and writes a profile the emulated device reads.
The numbers are the CPU's and mean nothing; the file's format is what is checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from services.device_profile import load_profile

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_the_profile_part_writes_a_profile_the_emulated_device_reads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its parts beside it, as when run as a script
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setenv("OUT", str(tmp_path))
    figures = gpu_check.part_profile(smoke=True)
    path = Path(figures["profile_path"])
    assert path.parent == tmp_path and path.name == "cpu-stand-in-llama-tiny.json"
    profile = load_profile(str(path))
    data = json.loads(path.read_text())
    assert data["name"] == profile.name and "gpu_check.py" in profile.source
    costs = (profile.fixed_s, profile.per_prefill_token_s, profile.per_decode_row_s, profile.per_context_token_s)
    assert all(c >= 0 for c in costs) and sum(costs) > 0
    assert figures["num_points"] == len([n for n in profile.notes if "measured" in n]) > 4
    assert profile.step_time_s(layer_fraction=1.0, num_prefill_tokens=16, num_decode_rows=0, num_context_tokens=16) > 0
