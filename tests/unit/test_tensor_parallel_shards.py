"""Tensor parallelism's arithmetic (issue 14): what a rank holds of the checkpoint, which
shapes are refused, and how a stage's KV memory is shared by its ranks. The ranks running
together over gloo are tested end to end (tests/e2e/test_tensor_parallel.py)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from wiring.launcher import pagoda_command
from worker_svc.checkpoints.loader import load_stage
from worker_svc.checkpoints.shards import shard_dim
from worker_svc.config import WorkerConfig
from worker_svc.execution.memory import kv_block_bytes, size_kv_pool
from worker_svc.models.registry import load_config


@pytest.fixture(scope="module")
def qwen(model_factory):
    return model_factory(arch="qwen2")  # q/k/v biases; 4 heads over 2 KV heads


def test_a_rank_holds_heads_kv_heads_and_mlp_columns(qwen):
    config = load_config(qwen)
    half = config.shard(2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (
        config.num_heads // 2,
        config.num_kv_heads // 2,
        config.intermediate_size // 2,
    )
    assert (half.hidden_size, half.head_dim, half.vocab_size) == (
        config.hidden_size,
        config.head_dim,
        config.vocab_size,
    )
    assert half.num_queries_per_kv == config.num_queries_per_kv  # groups stay whole
    assert config.shard(1) is config


@pytest.mark.parametrize(
    "size,named", [(3, "num_attention_heads=4, num_key_value_heads=2"), (4, "num_key_value_heads=2")]
)
def test_shapes_that_do_not_divide_are_refused_naming_them(qwen, size, named):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size: {size} does not divide {named}") as err:
        load_config(qwen).shard(size)
    assert "sizes that divide its heads, KV heads and MLP: 1, 2" in str(err.value)


def test_shard_dimensions_follow_the_megatron_split():
    layer = "model.layers.3."
    assert [
        shard_dim(layer + n)
        for n in (
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.bias",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
        )
    ] == [0] * 6
    assert shard_dim(layer + "self_attn.o_proj.weight") == 1
    assert shard_dim(layer + "mlp.down_proj.weight") == 1
    for replicated in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        layer + "input_layernorm.weight",
        layer + "post_attention_layernorm.weight",
    ):
        assert shard_dim(replicated) is None


def test_each_rank_loads_its_slice_of_the_checkpoint(qwen):
    full = load_file(f"{qwen}/model.safetensors")
    ranks = [load_stage(qwen, stage=1, num_stages=2, tp_rank=r, tp_size=2) for r in range(2)]
    for name, tensor in full.items():
        held = [dict(m.named_parameters()).get(name) for m in ranks]
        if name.startswith("model.layers.") and int(name.split(".")[2]) < ranks[0].start:
            assert held == [None, None]
            continue
        dim = shard_dim(name)
        if dim is not None:
            assert torch.equal(torch.cat([h.detach() for h in held], dim=dim), tensor), name
        elif name in ("lm_head.weight", "model.norm.weight"):  # the logits are rank 0's alone
            assert torch.equal(held[0].detach(), tensor) and held[1] is None, name
        elif name == "model.embed_tokens.weight":  # not the first stage, not tied
            assert held == [None, None]
        else:
            assert all(torch.equal(h.detach(), tensor) for h in held), name
    assert ranks[0].is_last and not ranks[1].is_last


def test_a_stage_memory_setting_is_shared_by_its_ranks(qwen):
    """--kv-cache-memory is the stage's pool: each of 2 ranks holds half of every block in
    half the bytes, so the block count is the one a single process would get."""
    whole = load_stage(qwen)
    half = load_stage(qwen, tp_rank=0, tp_size=2)
    config = whole.config
    block = kv_block_bytes(config.num_layers, 16, config.num_kv_heads, config.head_dim, torch.float32)
    one = size_kv_pool(whole, 16, "torch", None, 100 * block, 256)
    shared = size_kv_pool(half, 16, "torch", None, 100 * block, 256, share=2)
    assert one.num_blocks == shared.num_blocks == 100
    assert shared.block_bytes * 2 == one.block_bytes


def test_worker_config_travels_to_the_ranks_as_json():
    config = WorkerConfig(
        model="/m",
        stage=1,
        num_stages=2,
        next_address=None,
        feedback_address="a:1",
        layer_partition=(1, 3),
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
    )
    assert WorkerConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="tensor_parallel_size: must be 1..8"):
        WorkerConfig(model="/m", tensor_parallel_size=0)


def test_a_worker_refuses_a_size_that_does_not_divide(qwen):
    done = subprocess.run(
        pagoda_command("worker", "--model", qwen, "--tensor-parallel-size", "4"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "tensor_parallel_size: 4 does not divide num_key_value_heads=2" in done.stderr


def test_serve_help_names_the_parallel_and_memory_settings():
    done = subprocess.run(pagoda_command("serve", "--help"), capture_output=True, text=True, timeout=60)
    assert "--tensor-parallel-size" in done.stdout and "--gpu-memory-utilization" in done.stdout
