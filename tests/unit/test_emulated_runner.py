"""The emulated device (`--device emulated:PROFILE`, worker_svc/execution/emulated.py): a stage whose
forward pass is a wait of the profile's step time and whose samples are pseudo-random.

Step time per step shape, the wait spending no CPU, deterministic sampling per (seed,
choice, position), the EOS rate, ignore_eos and min_tokens, logprobs, the stage's reports
(LoadInfo, Health, metrics) and the gateway's (health, dashboard, /metrics)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import replace

import pytest
import torch

from services.device_profile import DeviceProfile
from services.pb import common_pb2, scheduler_pb2
from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, PromptScoring, StepPlan
from worker_svc.config import WorkerConfig
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.batch import Row, SeqState
from worker_svc.execution.emulated import (
    NEVER_LOGPROB,
    EmulatedDistribution,
    EmulatedRunner,
    EmulatedSampler,
    EmulatedSlice,
    StepShape,
    build_emulated_runner,
    compute_for,
    emulated_tensor_parallel_size,
)
from worker_svc.models.registry import read_config

PROFILE = "a100-80gb-llama2-70b-tp8"
VOCAB = 32000
EOS = 2

# LLaMA-2-70B's shape with 4 layers: what travels between stages is the real hidden size
LLAMA2_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
}


def profile(eos_probability: float = 0.25, tp: int = 1) -> DeviceProfile:
    return DeviceProfile(
        name="test-device",
        source="made up for the tests",
        fixed_s=1e-3,
        per_prefill_token_s=1e-4,
        per_decode_row_s=2e-4,
        per_context_token_s=1e-6,
        allreduce_per_token_s=5e-5,
        eos_probability=eos_probability,
        per_step_s=4e-3,
        tensor_parallel_size=tp,
    )


def runner(
    stage: int,
    num_stages: int,
    eos_probability: float = 0.25,
    dtype=torch.bfloat16,
    sleeps: list[float] | None = None,
    layers: int = 4,
) -> EmulatedRunner:
    config = read_config({**LLAMA2_70B_CONFIG, "num_hidden_layers": layers})
    per = layers // num_stages
    model = EmulatedSlice(config, stage * per, (stage + 1) * per, stage == 0, stage == num_stages - 1)
    sleep = (lambda s: sleeps.append(s)) if sleeps is not None else time.sleep
    return EmulatedRunner(model, profile(eos_probability), 64, 16, dtype, sleep=sleep)


def params(**fields) -> SamplingParams:
    return SamplingParams(eos_token_ids=(EOS,), **fields)


def new_seq(seq_id: int, prompt_len: int, blocks: tuple[int, ...], **fields) -> NewSeq:
    return NewSeq(
        seq_id=seq_id,
        token_ids=tuple(range(3, 3 + prompt_len)),
        prompt_len=prompt_len,
        num_computed=0,
        num_scheduled=prompt_len,
        block_ids=blocks,
        sampling=fields.pop("sampling", params()),
        entropy_seed=fields.pop("seed", 1000 + seq_id),
        **fields,
    )


def row(start: int, num_tokens: int, prompt_len: int) -> Row:
    state = SeqState(1, list(range(prompt_len + 4)), prompt_len, start + num_tokens, [0, 1, 2], params(), 0, 0)
    return Row(state, start, num_tokens, sample=True)


# --- step time -------------------------------------------------------------------------


def test_step_shape_counts_prefill_tokens_decode_rows_and_context():
    rows = [
        row(0, 8, 8),  # a whole prompt
        row(8, 1, 8),  # a decode (one token past its prompt)
        row(4, 1, 8),  # a prompt's last token after a prefix hit: prefill, not decode
        row(0, 10, 8),
    ]  # recompute of prompt and output after a preemption
    assert StepShape.of(rows) == StepShape(
        num_prefill_tokens=8 + 1 + 10, num_decode_rows=1, num_context_tokens=8 + 9 + 5 + 10, num_sampled_rows=4
    )


def test_each_step_waits_the_profiles_time_for_its_shape_on_this_stages_layers():
    sleeps: list[float] = []
    first = runner(0, 2, sleeps=sleeps)  # 2 of 4 layers
    p = profile()
    prefill = StepPlan(1, new_seqs=(new_seq(1, 20, (0, 1)), new_seq(2, 5, (2,))))
    first.execute(prefill)
    assert sleeps[-1] == pytest.approx(
        p.step_time_s(layer_fraction=0.5, num_prefill_tokens=25, num_decode_rows=0, num_context_tokens=25)
    )
    # the first stage is told each sequence's next token (no feedback here): a decode step
    decode = StepPlan(2, cached_seqs=(CachedSeq(1, 1, 2, new_token_ids=(7,)), CachedSeq(2, 1, 1, new_token_ids=(9,))))
    first.execute(decode)
    assert sleeps[-1] == pytest.approx(
        p.step_time_s(layer_fraction=0.5, num_prefill_tokens=0, num_decode_rows=2, num_context_tokens=21 + 6)
    )
    assert first.emulated_s == pytest.approx(sum(sleeps))


def test_only_the_last_stage_pays_the_last_stage_costs_per_sampled_row():
    costs = {"last_stage_fixed_s": 2e-3, "last_stage_per_row_s": 5e-4}
    p = replace(profile(), **costs)
    prefill = StepPlan(1, new_seqs=(new_seq(1, 20, (0, 1)), new_seq(2, 5, (2,))))
    waits = {}
    for stage in (0, 1):
        sleeps: list[float] = []
        r = runner(stage, 2, sleeps=sleeps)
        r.profile = p
        r.execute(prefill, None if stage == 0 else torch.zeros(25, r.model.config.hidden_size, dtype=torch.bfloat16))
        waits[stage] = sleeps[-1]
    plain = p.step_time_s(layer_fraction=0.5, num_prefill_tokens=25, num_decode_rows=0, num_context_tokens=25)
    assert waits[0] == pytest.approx(plain)  # the first stage samples nothing
    assert waits[1] == pytest.approx(plain + 2e-3 + 2 * 5e-4)  # two prompts sample their next token


def test_the_tensor_parallel_size_is_the_flags_or_else_the_profiles():
    assert emulated_tensor_parallel_size(1, profile(tp=8)) == 8
    assert emulated_tensor_parallel_size(4, profile(tp=8)) == 4
    assert emulated_tensor_parallel_size(1, profile(tp=1)) == 1


def test_the_wait_sleeps_without_spending_cpu():
    """The forward pass is `time.sleep` on the compute thread: wall time passes, the thread's
    CPU time hardly moves (the GIL is released meanwhile)."""
    stage = runner(0, 1)
    stage.profile = DeviceProfile(
        name="slow",
        source="test",
        fixed_s=0.2,
        per_prefill_token_s=0.0,
        per_decode_row_s=0.0,
        per_context_token_s=0.0,
        allreduce_per_token_s=0.0,
        eos_probability=0.0,
    )
    wall, cpu = time.perf_counter(), time.thread_time()
    result = stage.execute(StepPlan(1, new_seqs=(new_seq(1, 4, (0,)),)))
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.2 and result.compute_ns >= 0.2e9
    assert cpu < 0.05, f"the emulated step spent {cpu * 1e3:.1f} ms of CPU in {wall * 1e3:.0f} ms"


# --- what the stage hands on -----------------------------------------------------------


def test_a_middle_stage_hands_on_zeros_of_the_models_hidden_size_in_its_dtype():
    sleeps: list[float] = []
    middle = runner(1, 4, sleeps=sleeps)
    hidden = torch.zeros(25, 8192, dtype=torch.bfloat16)
    out = middle.execute(StepPlan(1, new_seqs=(new_seq(1, 20, (0, 1)), new_seq(2, 5, (2,)))), hidden)
    assert out.hidden.shape == (25, 8192) and out.hidden.dtype == torch.bfloat16
    assert not out.hidden.any() and out.sampled is None
    assert set(middle.batch.seqs) == {1, 2} and middle.batch.seqs[1].block_ids == [0, 1]


def test_plans_are_validated_as_on_a_real_stage():
    middle = runner(1, 4, sleeps=[])
    with pytest.raises(InvalidPlanError, match="hidden states of shape"):
        middle.execute(StepPlan(1, new_seqs=(new_seq(1, 20, (0, 1)),)), torch.zeros(20, 4096))
    first = runner(0, 4, sleeps=[])
    with pytest.raises(InvalidPlanError, match="block table has 1 blocks"):
        first.execute(StepPlan(1, new_seqs=(new_seq(1, 20, (0,)),)))
    with pytest.raises(InvalidPlanError, match="out of range"):
        first.execute(StepPlan(1, new_seqs=(new_seq(1, 4, (64,)),)))
    assert len(first.batch) == 0  # nothing applied


def test_the_last_stage_samples_appends_and_reports_pooled_and_scored_rows():
    last = runner(1, 2, sleeps=[])
    hidden = torch.zeros(9, 8192, dtype=torch.bfloat16)
    plan = StepPlan(
        1,
        new_seqs=(
            new_seq(1, 5, (0,), sampling=params(num_logprobs=2)),
            new_seq(2, 4, (1,), prompt_scoring=PromptScoring(1, (4, 5, 6), 2)),
        ),
    )
    out = last.execute(plan, hidden)
    assert out.sampled_seq_ids == (1, 2)
    tokens = out.sampled.token_ids
    assert [len(last.batch.seqs[s].token_ids) for s in (1, 2)] == [6, 5]
    assert [last.batch.seqs[s].token_ids[-1] for s in (1, 2)] == tokens
    dist = EmulatedDistribution.of(VOCAB, (EOS,), 0.25)
    assert out.sampled.logprobs[0] == pytest.approx(dist.logprob(tokens[0])) and out.sampled.logprobs[1] is None
    assert out.sampled.top_logprobs[0] == [(EOS, math.log(0.25)), (0, math.log(0.75 / (VOCAB - 1)))]
    (scored,) = out.prompt_logprobs
    assert scored.seq_id == 2 and [p.token_id for p in scored.positions] == [4, 5, 6]
    assert all(p.rank == 2 and p.logprob == pytest.approx(math.log(0.75 / (VOCAB - 1))) for p in scored.positions)


# --- sampling --------------------------------------------------------------------------


def test_the_same_seed_choice_and_position_draw_the_same_token_whatever_the_batch():
    sampler = EmulatedSampler(VOCAB, 0.1)
    p = params()
    draws = [sampler.draw(p, 42, 0, position) for position in range(64)]
    assert draws == [sampler.draw(p, 42, 0, position) for position in range(64)]
    assert draws != [sampler.draw(p, 43, 0, position) for position in range(64)]
    assert draws != [sampler.draw(p, 42, 1, position) for position in range(64)]
    # a request's seed (with its prompt) wins over the sequence's entropy seed; the batch
    # around it does not count, nor does the sequence id
    alone, crowded = runner(0, 1, sleeps=[]), runner(0, 1, sleeps=[])
    seeded = params(seed=7)
    a = alone.execute(StepPlan(1, new_seqs=(new_seq(1, 4, (0,), sampling=seeded, seed=1),)))
    b = crowded.execute(StepPlan(1, new_seqs=(new_seq(5, 3, (1,)), new_seq(9, 4, (0,), sampling=seeded, seed=2))))
    assert a.sampled.token_ids[0] == b.sampled.token_ids[1]
    for step in range(2, 6):  # decodes on: the same tokens
        a = alone.execute(StepPlan(step, cached_seqs=(CachedSeq(1, 1, 1),)))
        b = crowded.execute(StepPlan(step, cached_seqs=(CachedSeq(9, 1, 1), CachedSeq(5, 1, 1))))
        assert a.sampled.token_ids[0] == b.sampled.token_ids[0]
    assert alone.batch.seqs[1].token_ids == crowded.batch.seqs[9].token_ids


def test_requests_that_share_a_seed_but_not_a_prompt_draw_different_tokens():
    stage = runner(0, 1, sleeps=[])
    seeded = params(seed=7)
    first = new_seq(1, 4, (0,), sampling=seeded)
    other = NewSeq(2, (3, 4, 5, 99), 4, 0, 4, (1,), seeded)  # the same seed, another prompt
    stage.execute(StepPlan(1, new_seqs=(first, other, new_seq(3, 4, (2,), sampling=seeded))))
    for step in range(2, 10):
        stage.execute(StepPlan(step, cached_seqs=tuple(CachedSeq(s, 1, 1) for s in (1, 2, 3))))
    outputs = [stage.batch.seqs[s].token_ids[4:] for s in (1, 2, 3)]
    assert outputs[0] == outputs[2] != outputs[1] and len(outputs[0]) == 9
    stage.execute(StepPlan(10, cached_seqs=(CachedSeq(3, 1, 1),), finished_seq_ids=(1, 2)))
    assert set(stage.sampler._seeds) == {3}


def test_eos_comes_at_the_profiles_rate_and_other_tokens_uniformly_without_eos():
    sampler = EmulatedSampler(16, 0.2)
    p = SamplingParams(eos_token_ids=(2, 5))
    draws = [sampler.draw(p, seed, 0, position) for seed in range(200) for position in range(100)]
    eos = sum(t in (2, 5) for t in draws)
    assert abs(eos / len(draws) - 0.2) < 0.015
    others = [t for t in draws if t not in (2, 5)]
    counts = [others.count(t) for t in range(16) if t not in (2, 5)]
    assert len(counts) == 14 and min(counts) > 0.85 * len(others) / 14 and max(counts) < 1.15 * len(others) / 14
    assert 0.35 < sum(t == 2 for t in draws) / eos < 0.65  # both EOS ids


def test_ignore_eos_and_min_tokens_keep_eos_and_stop_ids_out():
    sampler = EmulatedSampler(16, 0.9)
    ignore = params(ignore_eos=True)
    assert all(sampler.draw(ignore, seed, 0, 5) != EOS for seed in range(500))
    early = params(min_tokens=3, stop_token_ids=(7,))
    assert all(sampler.draw(early, seed, 0, position) not in (EOS, 7) for seed in range(200) for position in range(3))
    assert sum(sampler.draw(early, seed, 0, 3) == EOS for seed in range(200)) > 150  # from min_tokens on


def test_the_distribution_ranks_and_tops_tokens():
    dist = EmulatedDistribution.of(100, (2, 1, 500), 0.5)  # ids outside the vocabulary are dropped
    assert dist.eos_token_ids == (1, 2)
    assert dist.logprob(1) == pytest.approx(math.log(0.25)) and dist.logprob(3) == pytest.approx(math.log(0.5 / 98))
    assert dist.rank(2) == 1 and dist.rank(50) == 3
    assert [t for t, _ in dist.top(4)] == [1, 2, 0, 3]
    rare = EmulatedDistribution.of(100, (2,), 0.0)
    assert rare.logprob(2) == NEVER_LOGPROB and rare.rank(2) == 100 and rare.top(2)[0][0] == 0


# --- configuration and reports ---------------------------------------------------------


def _config_only_model(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B_CONFIG))
    return str(tmp_path)


def test_the_device_names_a_profile_that_loads_and_takes_only_what_means_something(tmp_path):
    model = _config_only_model(tmp_path)
    assert WorkerConfig(model=model, device=f"emulated:{PROFILE}").emulated_profile == PROFILE
    assert WorkerConfig(model=model, device="cpu").emulated_profile is None
    with pytest.raises(ValueError, match="^device: unknown device profile 'nope'"):
        WorkerConfig(model=model, device="emulated:nope")
    with pytest.raises(ValueError, match="^device: emulated:PROFILE needs a profile"):
        WorkerConfig(model=model, device="emulated:")
    with pytest.raises(ValueError, match="^gpu_memory_utilization: an emulated device"):
        WorkerConfig(model=model, device=f"emulated:{PROFILE}", gpu_memory_utilization=0.5)


def test_a_config_json_is_the_whole_model(tmp_path):
    """No weights, no KV tensors: a LLaMA-2-70B-shaped stage builds in an instant."""
    model = _config_only_model(tmp_path)
    common = dict(model=model, num_stages=2, device=f"emulated:{PROFILE}")
    first = build_emulated_runner(WorkerConfig(stage=0, next_address="127.0.0.1:1", **common), sleep=lambda s: None)
    assert (first.model.start, first.model.end, first.dtype) == (0, 2, torch.bfloat16)
    assert first.device_name == f"emulated:{PROFILE}" and first.weights_bytes == 0
    assert first.tensor_parallel_size == 8  # the profile's
    # one block: K and V x 2 layers x 16 slots x 1 KV head (8 over 8 ranks) x 128 x 2 bytes
    assert first.kv_block_bytes == 2 * 2 * 16 * 1 * 128 * 2
    sized = build_emulated_runner(WorkerConfig(stage=1, kv_cache_memory=first.kv_block_bytes * 100, **common))
    assert sized.num_blocks == 100 and sized.sampler is not None


def test_a_profile_of_this_machines_cpu_computes_for_the_step_instead_of_sleeping(tmp_path):
    model = _config_only_model(tmp_path)
    cpu = build_emulated_runner(WorkerConfig(model=model, device="emulated:cpu-local", num_kv_blocks=8))
    a100 = build_emulated_runner(WorkerConfig(model=model, device=f"emulated:{PROFILE}", num_kv_blocks=8))
    assert cpu.profile.host_compute and cpu._sleep is compute_for
    assert not a100.profile.host_compute and a100._sleep is time.sleep


def test_the_stage_reports_its_emulated_device(tmp_path):
    from worker_svc.server import StageService

    model = _config_only_model(tmp_path)
    config = WorkerConfig(model=model, device=f"emulated:{PROFILE}", num_kv_blocks=32)
    service = StageService(config, build_emulated_runner(config))
    info = service.load_info()
    assert info.device == f"emulated:{PROFILE}" and info.hidden_size == 8192 and info.weights_bytes == 0
    assert info.dtype == common_pb2.DTYPE_BFLOAT16 and info.num_kv_blocks == 32
    health = asyncio.run(service.Health(None, None))
    assert health.device == f"emulated:{PROFILE}"
    samples = {s[0]: s for s in service.stats.metric_samples()}
    assert samples["pagoda:device_info"][3:] == (1.0, {"device": f"emulated:{PROFILE}"})


def test_stage_metrics_carry_a_samples_own_labels():
    from prometheus_client import CollectorRegistry, generate_latest

    from services.metrics import StatsCollector

    registry = CollectorRegistry()
    registry.register(
        StatsCollector(
            lambda: [
                ("pagoda:stage_tokens", "t", "counter", 3.0),
                ("pagoda:device_info", "d", "gauge", 1.0, {"device": "emulated:x"}),
            ],
            {"stage": "1"},
        )
    )
    text = generate_latest(registry).decode()
    assert metric(text, "pagoda:device_info") == [({"device": "emulated:x", "stage": "1"}, 1.0)]
    assert metric(text, "pagoda:stage_tokens_total") == [({"stage": "1"}, 3.0)]


def metric(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """A Prometheus text's samples of `name`: (labels, value) in order."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            out.append((dict(pair.split("=", 1) for pair in labels.split(",")), float(value)))
    return [({k: v.strip('"') for k, v in labels.items()}, value) for labels, value in out]


def _stats(*devices: str) -> scheduler_pb2.GetStatsResponse:
    stats = scheduler_pb2.GetStatsResponse(
        health=common_pb2.HEALTH_STATUS_SERVING, kv_health=common_pb2.HEALTH_STATUS_SERVING
    )
    for k, device in enumerate(devices):
        stats.stages.add(stage_index=k).load_info.device = device
    return stats


def test_the_gateway_says_emulated_in_health_dashboard_and_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway import dashboard
    from gateway.metrics import EngineView
    from gateway.replicas import emulated_device

    device = f"emulated:{PROFILE}"
    assert emulated_device(_stats("cpu", "cpu")) == ""
    assert emulated_device(_stats(device, device)) == device
    state = dashboard.state(_stats(device, device), "m")
    assert state["device"] == device and [s["device"] for s in state["stages"]] == [device, device]
    view = EngineView("m")
    view.stats = _stats(device, device)
    registry = CollectorRegistry()
    registry.register(view)
    text = generate_latest(registry).decode()
    assert metric(text, "pagoda:device_info") == [
        ({"model_name": "m", "stage": str(k), "device": device}, 1.0) for k in range(2)
    ]


def test_bench_tables_name_the_device():
    from bench.arms import EngineSettings

    emulated = EngineSettings(device=f"emulated:{PROFILE}")
    assert emulated.device_label == f"emulated:{PROFILE}" and EngineSettings().device_label == "cpu"
    assert emulated.describe().endswith(f", device emulated:{PROFILE}")
    flags = emulated.service_flags()["worker"]
    assert flags[flags.index("--device") + 1] == f"emulated:{PROFILE}"
    assert "--device" not in EngineSettings().service_flags()["worker"]


# --- pagoda serve's checks before it starts anything -----------------------------------


def test_serve_takes_a_config_only_model_for_an_emulated_device_and_refuses_a_bad_one(
    capsys, monkeypatch, tmp_path, model_factory
):
    """No weights are needed when the stages are emulated (and only then); an unknown profile
    and a memory fraction are refused naming the flag, before anything starts."""
    import os

    from wiring import preflight
    from wiring.cli import main

    for name in [
        n for n in os.environ if n.startswith("PAGODA_") and n not in ("PAGODA_INTERNAL_TOKEN", "PAGODA_AUTO_DTYPE")
    ]:
        monkeypatch.delenv(name)
    import shutil
    from pathlib import Path

    model = _config_only_model(tmp_path)
    for tokenizer_file in Path(model_factory(arch="llama")).glob("tokenizer*"):
        shutil.copy(tokenizer_file, tmp_path)
    with pytest.raises(ValueError, match="no weights"):
        preflight.read_checkpoint(model)
    assert preflight.read_checkpoint(model, weights=False).config.hidden_size == 8192

    def refused(*flags: str) -> str:
        code = main(["serve", model, "--port", "0", "--grpc-port", "0", *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        return err

    assert "no weights" in refused("--device", "cpu")
    assert refused("--device", "emulated:nope").startswith("error: --device: unknown device profile 'nope'")
    assert "--gpu-memory-utilization: an emulated device has no memory" in refused(
        "--device", f"emulated:{PROFILE}", "--gpu-memory-utilization", "0.5"
    )
