"""The `pagoda` command line, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def pagoda(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wiring.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_tiny_model_command(tmp_path):
    out = tmp_path / "m"
    done = pagoda("tiny-model", str(out), "--arch", "qwen2", "--num-layers", "2")
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_hidden_layers"] == 2
    again = pagoda("tiny-model", str(out))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    bad = pagoda("tiny-model", str(tmp_path / "x"), "--num-heads", "3")
    assert bad.returncode == 2 and "num_heads" in bad.stderr


def test_serve_refuses_a_directory_without_a_checkpoint(tmp_path):
    done = pagoda("serve", "--model", str(tmp_path))
    assert done.returncode == 2 and "no config.json" in done.stderr


def test_serve_passes_engine_settings_to_the_scheduler():
    from wiring.cli import build_parser
    from wiring.serve import engine_flags

    args = build_parser().parse_args(
        [
            "serve",
            "--no-async-scheduling",
            "--max-num-seqs",
            "7",
            "--tenant-weights",
            "a=3,b=1",
            "--scheduler-policy",
            "hybrid",
        ]
    )
    flags = engine_flags(args)
    assert "--no-async-scheduling" in flags and flags[flags.index("--max-num-seqs") + 1] == "7"
    assert flags[flags.index("--tenant-weights") + 1] == "a=3.0,b=1.0"
    sched = build_parser().parse_args(["scheduler", "--model", "m", "--kvcache", "x:1", "--stages", "y:2", *flags])
    assert sched.async_scheduling is False and sched.max_num_seqs == 7 and sched.scheduler_policy == "hybrid"


def test_serve_passes_device_settings_to_every_worker():
    from wiring.cli import build_parser
    from wiring.serve import worker_flags

    args = build_parser().parse_args(
        [
            "serve",
            "--dtype",
            "bfloat16",
            "--device",
            "cuda:1",
            "--quantization",
            "fp8",
            "--attention-backend",
            "triton",
            "--kv-cache-dtype",
            "bfloat16",
        ]
    )
    flags = worker_flags(args)
    worker = build_parser().parse_args(["worker", "--model", "m", *flags])
    assert (worker.dtype, worker.device, worker.quantization, worker.attention_backend, worker.kv_cache_dtype) == (
        "bfloat16",
        "cuda:1",
        "fp8",
        "triton",
        "bfloat16",
    )
    assert worker_flags(build_parser().parse_args(["serve"])) == []


def test_serve_gives_the_stages_the_schedulers_token_budget():
    """A stage refuses a plan over its max_num_batched_tokens: with one larger than the
    default the scheduler's plans must still fit every stage."""
    from scheduler_svc.config import SchedulerConfig
    from wiring.cli import build_parser
    from wiring.serve import worker_flags
    from worker_svc.config import WorkerConfig

    assert WorkerConfig(model="m").max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "16384"])
    worker = build_parser().parse_args(["worker", "--model", "m", *worker_flags(args)])
    assert worker.max_num_batched_tokens == 16384


def test_async_scheduling_is_auto_unless_set():
    from wiring.cli import build_parser
    from wiring.flags import _bool_or_auto
    from wiring.serve import engine_flags

    assert engine_flags(build_parser().parse_args(["serve"])).count("--async-scheduling") == 0
    assert "--no-async-scheduling" not in engine_flags(build_parser().parse_args(["serve"]))
    assert [_bool_or_auto(v) for v in ("", "auto", "AUTO", "1", "off")] == [None, None, None, True, False]
    done = pagoda("scheduler", "--help", env={"PAGODA_ASYNC_SCHEDULING": "sometimes"})
    assert done.returncode != 0 and "true, false or auto" in done.stderr


def test_stages_get_cores_of_their_own_when_the_machine_has_enough():
    from wiring.launcher import cpu_plan, default_threads_per_stage

    assert cpu_plan(1, 1, [0, 1]) == ({0}, [{1}])
    assert cpu_plan(2, 1, [0, 1]) is None  # 2 stages and the services need 3 cores
    assert cpu_plan(2, 3, range(8)) == ({0}, [{1, 2, 3}, {4, 5, 6}])
    assert cpu_plan(1, 1, [4, 7]) == ({4}, [{7}])  # the cores this process may use
    import os

    n = os.cpu_count() or 1
    assert default_threads_per_stage(1) == max(1, n - 1)


def test_large_steps_take_the_services_core_unless_threads_are_given(monkeypatch, model_factory):
    """With no --num-threads a stage runs small steps on the cores but one and steps of
    LARGE_STEP_TOKENS tokens or more on all of them; a thread count given, or tensor
    parallelism, fixes one count for every step."""
    import torch

    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.config import WorkerConfig
    from worker_svc.execution.runner import LARGE_STEP_TOKENS

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert WorkerConfig(model="m").step_threads == (1, 2)
    assert WorkerConfig(model="m", num_threads=1).step_threads is None
    assert WorkerConfig(model="m", num_stages=2, next_address="x:1").step_threads is None  # 1 core each
    assert WorkerConfig(model="m", tensor_parallel_size=2).step_threads is None
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert WorkerConfig(model="m", num_stages=2, next_address="x:1").step_threads == (7, 8)

    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution.runner import StageRunner

    return_to = torch.get_num_threads()
    try:
        seen = []
        runner = StageRunner(load_stage(model_factory()), 32, 16, "cpu", step_threads=(1, 2))
        forward = runner.model.forward
        runner.model.forward = lambda *a, **k: (seen.append(torch.get_num_threads()), forward(*a, **k))[1]
        greedy = SamplingParams(temperature=0.0)
        prompt = tuple(range(5, 5 + LARGE_STEP_TOKENS))
        runner.execute(StepPlan(1, new_seqs=(NewSeq(0, prompt, len(prompt), 0, len(prompt), tuple(range(9)), greedy),)))
        runner.execute(StepPlan(2, cached_seqs=(CachedSeq(0, 1, 9),)))
        assert seen == [2, 1]
    finally:
        torch.set_num_threads(return_to)


def test_serve_pins_cores_unless_told_not_to():
    from wiring.cli import build_parser

    assert build_parser().parse_args(["serve"]).cpu_affinity is True
    assert build_parser().parse_args(["serve", "--no-cpu-affinity"]).cpu_affinity is False


def test_serve_takes_the_model_as_vllm_serve_does_and_several_served_names(monkeypatch, tmp_path):
    from wiring.cli import build_parser, main

    args = build_parser().parse_args(["serve", "/models/qwen", "--served-model-name", "a", "b"])
    assert args.model_tag == "/models/qwen" and args.served_model_name == ["a", "b"]
    gateway = build_parser().parse_args(
        ["gateway", "--model", "m", "--scheduler", "s:1", "--served-model-name", "x", "y"]
    )
    assert gateway.served_model_name == ["x", "y"]
    monkeypatch.setenv("PAGODA_SERVED_MODEL_NAME", "one, two")
    assert build_parser().parse_args(["serve"]).served_model_name == ["one", "two"]
    # one model, given once
    assert main(["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b")]) == 2


def test_api_keys_from_flags_as_vllm_and_from_the_keys_file(tmp_path, monkeypatch):
    import json

    from gateway.config import ApiKey
    from wiring.cli import _api_keys, build_parser

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-file": {"tenant": "a", "priority": 2}}))
    args = build_parser().parse_args(
        ["gateway", "--model", "m", "--scheduler", "s:1", "--api-key", "sk-1", "sk-file", "--api-keys-file", str(keys)]
    )
    assert _api_keys(args) == {"sk-file": ApiKey("a", 2), "sk-1": ApiKey()}  # the file's grant kept
    monkeypatch.setenv("PAGODA_API_KEY", "sk-env")
    args = build_parser().parse_args(["gateway", "--model", "m", "--scheduler", "s:1"])
    assert _api_keys(args) == {"sk-env": ApiKey()}
    assert build_parser().parse_args(["serve", "--api-key", "k"]).api_key == ["k"]


def test_restarts_are_counted_in_a_window_and_backed_off():
    """Issue 16, defect 6: the supervisor gave up for good once a service had died 4 times in
    the server's life. Deaths count within a sliding window; restarts back off."""
    import pytest

    from wiring.launcher import RestartBudget

    budget = RestartBudget(max_restarts=3, window_s=100.0)
    assert budget.ready(0.0)  # the first death: at once
    budget.restarted()
    assert not budget.ready(10.0) and budget.backoff_s == 1.0  # the second: after 1 s
    assert budget.ready(11.0)
    budget.restarted()
    assert not budget.ready(20.0) and budget.backoff_s == 2.0 and budget.ready(22.0)
    budget.restarted()
    with pytest.raises(RuntimeError, match="died 4 times in 100 s"):
        budget.ready(30.0)  # a fourth within the window
    # a server that loses a service now and then keeps going
    budget = RestartBudget(max_restarts=3, window_s=100.0)
    for k in range(20):
        budget.ready(k * 60.0)
        assert budget.ready(k * 60.0 + 1.0)  # (two deaths in any 100 s: a 1 s backoff)
        budget.restarted()
    assert len(budget.deaths) == 2  # those within the last 100 s


def test_serve_refuses_a_taken_port_naming_it(tmp_path, capsys):
    """Issue 16, defect 11: a taken port gave `ready`, then "the gateway keeps dying"."""
    import socket

    from wiring.cli import main
    from wiring.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", str(model), "--port", str(port), "--log-dir", str(tmp_path / "logs")]) == 2
    assert f"--port {port} is taken" in capsys.readouterr().err


def test_free_ports_are_never_ones_the_kernel_hands_out_and_never_repeat():
    """A port chosen now is bound by its service later, after others started: the kernel's
    bind(0) (a TP stage's TCPStore, gloo) and outgoing connections must not be able to take it
    meanwhile (CI saw a scheduler's port taken so)."""
    import socket

    from wiring.launcher import _ephemeral_low, free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    taken = [socket.socket() for _ in range(50)]  # what bind(0) hands out meanwhile
    try:
        for s in taken:
            s.bind(("127.0.0.1", 0))
        assert not {s.getsockname()[1] for s in taken} & set(ports)
    finally:
        for s in taken:
            s.close()
