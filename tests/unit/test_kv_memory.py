"""KV pools sized from memory (issue 14): the arithmetic for a model of known size, the
settings' parsing, and the refusal that says what would fit."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from wiring.flags import byte_size, fraction
from wiring.kv_pool import MemorySetting, pool_from_stages
from worker_svc.execution.memory import blocks_that_fit, kv_block_bytes, size_kv_pool

# the tiny model's shape (wiring.tiny_model defaults): 4 layers, hidden 64, 4 heads of 16,
# 2 KV heads, SwiGLU 176, vocabulary 512, untied embeddings
H, NH, KVH, HD, MLP, V = 64, 4, 2, 16, 176, 512
PER_LAYER = H * NH * HD + 2 * H * KVH * HD + NH * HD * H + 3 * H * MLP + 2 * H  # q, k, v, o, MLP, norms


def test_block_bytes_are_k_and_v_of_every_local_layer():
    assert kv_block_bytes(2, 16, KVH, HD, torch.float32) == 2 * 2 * 16 * KVH * HD * 4 == 8192
    assert kv_block_bytes(40, 16, 8, 128, torch.bfloat16) == 2 * 40 * 16 * 8 * 128 * 2


def test_blocks_that_fit():
    assert blocks_that_fit(1000, 300, 100, 64) == 9
    assert blocks_that_fit(1000, 900, 200, 64) == 0


@pytest.fixture(scope="module")
def stages(model_factory):
    from worker_svc.checkpoints.loader import load_stage

    model_dir = model_factory(arch="llama")
    return [load_stage(model_dir, k, 2, None, "float32", torch.device("cpu")) for k in (0, 1)]


def test_a_pool_from_kv_cache_memory_is_that_many_bytes_of_blocks(stages):
    s = size_kv_pool(stages[0], 16, "torch", None, 3 << 20, 256)
    assert s.block_bytes == 8192 and s.num_blocks == (3 << 20) // 8192 == 384


def test_a_pool_from_utilization_is_the_budget_less_what_is_held_and_the_peak(stages):
    weights = {0: V * H + 2 * PER_LAYER, 1: 2 * PER_LAYER + H + V * H}  # embedding; final norm and lm_head
    for k, stage in enumerate(stages):
        s = size_kv_pool(stage, 16, "torch", 0.05, None, 512)
        assert s.weights_bytes == 4 * weights[k]
        assert s.budget_bytes == int(0.05 * s.total_bytes)
        assert s.baseline_bytes >= s.weights_bytes and s.activation_bytes > 0
        assert s.num_blocks == (s.budget_bytes - s.baseline_bytes - s.activation_bytes) // s.block_bytes > 0


def test_the_parsers():
    assert byte_size("4GiB") == 4 << 30 and byte_size("512MiB") == 512 << 20
    assert byte_size("1.5GB") == 1_500_000_000 and byte_size("1048576") == 1 << 20 and byte_size("") is None
    assert fraction("0.9") == 0.9 and fraction("") is None
    for bad in ("4XB", "-1", "0", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)
    for bad in ("0", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            fraction(bad)


def _info(stage, blocks, total=8 << 30, baseline=512 << 20, activation=64 << 20):
    return SimpleNamespace(
        stage_index=stage,
        num_kv_blocks=blocks,
        kv_block_bytes=1 << 20,
        memory_total_bytes=total,
        memory_baseline_bytes=baseline,
        activation_peak_bytes=activation,
    )


def test_the_pool_is_the_smallest_stage_and_a_shortfall_says_what_would_fit():
    setting = MemorySetting(gpu_memory_utilization=0.5)
    assert pool_from_stages([_info(0, 300), _info(1, 200)], 16, 2048, setting, 2) == 200
    with pytest.raises(ValueError) as err:
        pool_from_stages([_info(0, 300), _info(1, 100)], 16, 2048, setting, 2)
    # 128 blocks needed: 512 MiB + 64 MiB + 128 MiB of 8 GiB, for each of 2 stages
    want = (512 + 64 + 128) / 8192 * 2
    assert "stage 1's memory leaves room for 100 blocks (1600 tokens)" in str(err.value)
    assert f"--gpu-memory-utilization to at least {want:.3f}" in str(err.value)
    assert "--max-model-len to at most 1600" in str(err.value)
    with pytest.raises(ValueError, match=r"--kv-cache-memory to at least 134217728 bytes"):
        pool_from_stages([_info(0, 100)], 16, 2048, MemorySetting(kv_cache_memory=100 << 20), 1)


def test_the_profile_counts_what_a_chunk_late_in_a_long_context_adds():
    from worker_svc.execution.memory import context_extra_bytes
    from worker_svc.kernels.attention import MASK_BUDGET_BYTES

    gathered = 2 * 131072 * KVH * HD * 4  # one layer's K and V for the whole context, float32
    # gathered, SDPA's copy, its expansion to every query head; the mask tile and its float copy
    want = gathered * 2 + gathered * NH // KVH + MASK_BUDGET_BYTES * 5 // 4
    assert context_extra_bytes(131072, NH, KVH, HD, torch.float32) == want


def test_a_fixed_pool_given_with_a_memory_setting_is_checked_against_it(stages, model_factory):
    """As compose runs the stages: every service gets one PAGODA_NUM_KV_BLOCKS, and a memory
    setting makes each stage check at start that those blocks fit."""
    from worker_svc.config import WorkerConfig
    from worker_svc.execution.memory import stage_pool

    model = stages[1]
    block = kv_block_bytes(model.num_local_layers, 16, KVH, HD, torch.float32)
    config = WorkerConfig(
        model=model_factory(arch="llama"), stage=1, num_stages=2, num_kv_blocks=40, kv_cache_memory=50 * block
    )
    blocks, sizing = stage_pool(config, model, "torch")
    assert blocks == sizing.num_blocks == 40
    with pytest.raises(MemoryError, match="--num-kv-blocks 60 does not fit .* room for 50 blocks"):
        stage_pool(
            WorkerConfig(model=config.model, stage=1, num_stages=2, num_kv_blocks=60, kv_cache_memory=50 * block),
            model,
            "torch",
        )
    assert stage_pool(WorkerConfig(model=config.model, stage=1, num_stages=2, num_kv_blocks=60), model, "torch") == (
        60,
        None,
    )


def test_a_container_memory_limit_caps_the_total(tmp_path):
    from worker_svc.execution.memory import cgroup_memory_limit

    assert cgroup_memory_limit(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{8 << 30}\n")
    assert cgroup_memory_limit(tmp_path) == 8 << 30
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1: none
    assert cgroup_memory_limit(tmp_path) is None
