"""bench/emulated_table.py's own accounting: CPU per micro-batch per process, the CPU table,
the timeline poll's interval, the config-only model each profile gets."""

from __future__ import annotations

import json
import os
import time

import pytest

from bench.emulated_table import (
    LLAMA2_70B,
    MODEL_SHAPES,
    RECENT_SPANS,
    TIMELINE_POLL_S,
    cpu_per_micro_batch,
    cpu_rows,
    next_poll_s,
    process_cpu_s,
)
from services.device_profile import load_profile


def test_cpu_per_micro_batch_divides_each_process_s_cpu_by_the_micro_batches():
    before = {"scheduler": 1.0, "worker-0": 2.0, "gateway": 0.5}
    after = {"scheduler": 1.5, "worker-0": 2.2, "gateway": 0.5, "worker-1": 0.1}
    got = cpu_per_micro_batch(before, after, 100, 2.0)
    assert got["num_micro_batches"] == 100
    assert got["ms_per_micro_batch"] == pytest.approx(
        {"scheduler": 5.0, "worker-0": 2.0, "gateway": 0.0, "worker-1": 1.0}
    )
    assert got["cores"] == pytest.approx({"scheduler": 0.25, "worker-0": 0.1, "gateway": 0.0, "worker-1": 0.05})
    none = cpu_per_micro_batch(before, after, 0, 0.0)
    assert set(none["ms_per_micro_batch"].values()) == {None} and set(none["cores"].values()) == {None}


def test_the_cpu_table_has_a_row_per_cell_with_the_stages_mean_and_max():
    cell = {
        "cpu": cpu_per_micro_batch(
            {},
            {"gateway": 0.1, "scheduler": 0.2, "kvcache": 0.05, "worker-0": 0.1, "worker-1": 0.3, "client": 0.01},
            100,
            1.0,
        )
    }
    rows = cpu_rows({"cells": {"4": {"async": {"mixed": cell}, "sync": {"mixed": {"qps": 1.0}}}}})
    assert len(rows) == 3  # the header, its rule, the one cell with CPU figures
    assert rows[2] == "| 4 | mixed | async | 100 | - | 1.00 | 2.00 | 0.50 | 2.00 / 3.00 | 0.10 | 0.76 |"
    cell["kv_steps_per_micro_batch"] = 0.25
    assert cpu_rows({"cells": {"4": {"async": {"mixed": cell}}}})[2].startswith("| 4 | mixed | async | 100 | 0.25 |")


def test_process_cpu_s_reads_a_process_s_utime_and_stime():
    t0 = process_cpu_s(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) - t0 == pytest.approx(0.05, abs=0.03)  # (ticks of 10 ms)
    assert process_cpu_s(2**22 + 12345) == 0.0  # no such process


def test_the_timeline_poll_comes_before_a_quarter_of_the_span_buffer_fills():
    lo, hi = TIMELINE_POLL_S
    assert next_poll_s(0, 1.0) == lo  # nothing seen yet: soon
    assert next_poll_s(100, 1.0) == hi  # slow: no more often than needed
    rate = 2000.0  # spans a second (PP=8 at 250 micro-batches a second)
    wait = next_poll_s(int(rate), 1.0)
    assert lo <= wait < hi and wait * rate == pytest.approx(RECENT_SPANS / 4)
    assert next_poll_s(100_000, 1.0) == lo


def test_each_profile_gets_the_model_it_was_made_for(tmp_path):
    from bench.emulated_table import make_config_dir

    for name, shape in MODEL_SHAPES.items():
        profile = load_profile(name)
        assert (shape["hidden_size"], shape["num_hidden_layers"]) == (profile.hidden_size, profile.num_layers)
    folder = make_config_dir(tmp_path / "h200", profile="h200-141gb-llama3-8b-tp1")
    config = json.loads((tmp_path / "h200" / "config.json").read_text())
    assert folder == str(tmp_path / "h200")
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (4096, 32, 128256)
    make_config_dir(tmp_path / "x", 8, "cpu-local")  # a profile of no model: LLaMA-2-70B's shape
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (LLAMA2_70B["hidden_size"], 8)
