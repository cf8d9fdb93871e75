"""A step's work around the model's compute, made cheaper without changing a number: the
rotary tables a stage keeps (`StageModel._cos_sin`) give bit for bit what `cos_sin` computes
for the same positions; the native embedding lookup equals `PackedEmbedding`'s torch one."""

from __future__ import annotations

import pytest
import torch

from worker_svc.kernels.quant_kernels import quant_kernels
from worker_svc.model_config import ModelConfig, RopeConfig
from worker_svc.models.stage import ROPE_TABLE_POSITIONS, StageModel
from worker_svc.weights.packed import PackedEmbedding

ROPES = {
    "default": RopeConfig(),
    "llama3": RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192),
    "yarn": RopeConfig("yarn", 1000000.0, 4.0, original_max_position_embeddings=4096),
}


def _model(head_dim: int, rope: RopeConfig) -> StageModel:
    config = ModelConfig(
        "LlamaForCausalLM", "llama", 64, 32, 64, 2, 2, 1, head_dim, 1e-6, 32768, False, False, rope=rope
    )
    return StageModel(config, 0, 2, True, True)


def _longrope(head_dim: int) -> RopeConfig:
    half = head_dim // 2
    return RopeConfig(
        "longrope",
        10000.0,
        original_max_position_embeddings=4096,
        short_factor=tuple(1.0 + i / half for i in range(half)),
        long_factor=tuple(2.0 + i / half for i in range(half)),
    )


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("rope", [*ROPES, "longrope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_equal_cos_sin_bit_for_bit(head_dim, rope, dtype):
    model = _model(head_dim, _longrope(head_dim) if rope == "longrope" else ROPES[rope])
    g = torch.Generator().manual_seed(head_dim)
    cases = [
        torch.tensor([0]),
        torch.tensor([200]),
        torch.arange(300, 317),
        torch.randint(0, ROPE_TABLE_POSITIONS, (64,), generator=g),
        torch.tensor([ROPE_TABLE_POSITIONS + 5, 3]),
    ]  # beyond the tables: computed
    for positions in cases:
        got = model._cos_sin(positions, int(positions.max()) + 1, dtype)
        want = [r.cos_sin(positions, dtype) for r in model.rotaries]
        for (cos, sin), (want_cos, want_sin) in zip(got, want, strict=True):
            assert cos.shape == want_cos.shape and cos.dtype == dtype
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    tables = model._rope_tables[(dtype, torch.device("cpu"))]
    assert tables[0][0].shape[0] == ROPE_TABLE_POSITIONS  # grown to the largest position asked


@pytest.mark.skipif(quant_kernels() is None, reason="native kernels not built")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_native_embedding_lookup_equals_packed_embeddings(qtype):
    from worker_svc.kernels.block_formats import row_bytes

    hidden, vocab = 256, 50
    g = torch.Generator().manual_seed(7)
    qweight = torch.randint(0, 256, (vocab, row_bytes(qtype, hidden)), dtype=torch.uint8, generator=g)
    config = ModelConfig("LlamaForCausalLM", "llama", vocab, hidden, 64, 1, 2, 1, 128, 1e-6, 256, False, False)
    model = StageModel(config, 0, 1, True, False)
    model.model.embed_tokens = PackedEmbedding(qweight, qtype, hidden)
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = model._embed(ids)
    want = model.model.embed_tokens(ids)
    assert got.shape == (5, hidden)
    # (random bytes: a few fp16 scales are inf or NaN, alike in both)
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq_id", True),
        ("output_position", False),
        ("choice_index", 2**32),
        ("entropy_seed", -1),
        ("params", object()),
        ("output_position", 1.0),
    ],
)
def test_sample_rows_quick_check_lets_no_bad_row_through(field, value):
    from services.sampling import SamplingParams
    from worker_svc.execution.sampler_types import SampleRow

    kwargs = dict(seq_id=0, params=SamplingParams(), choice_index=0, output_position=0, entropy_seed=0)
    SampleRow(**kwargs)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        SampleRow(**kwargs)


def test_plain_greedy_rows_take_the_raw_argmax_and_masked_ones_do_not():
    from services.sampling import SamplingParams
    from worker_svc.execution.sampler import Sampler
    from worker_svc.execution.sampler_types import SampleRow

    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    rows = [
        SampleRow(0, SamplingParams(temperature=0.0), 0, 0, 1),
        SampleRow(1, SamplingParams(temperature=0.0, logit_bias=[(2, 5.0)]), 0, 0, 1),
        SampleRow(2, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]), 0, 0, 1),
    ]
    assert Sampler().sample(logits, rows).token_ids == [1, 2, 2]
    assert Sampler().sample(logits[:1], rows[:1]).token_ids == [1]
