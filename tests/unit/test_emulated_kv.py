"""P/D disaggregation on the emulated device (issue 39): the profile's KV link
(`DeviceProfile.kv_transfer_bytes_per_s`), an emulated stage's import area of keys and its tier
ops (worker_svc/execution/emulated_kv.py, EmulatedRunner), and the chunk layout and checks of an
emulated transfer (worker_svc/service/kv_transfer.py). The transfer between two stage servers:
tests/service/test_kv_transfer_emulated.py."""

from __future__ import annotations

import json
import zlib

import grpc
import pytest
import torch

from services.device_profile import DeviceProfile, load_profile, profile_to_dict
from services.sampling import SamplingParams
from services.step import TIER_DEMOTE, TIER_DROP, TIER_LOAD, TIER_SAVE, NewSeq, StepPlan, TierOp
from worker_svc.config import WorkerConfig
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.emulated import EmulatedRunner, EmulatedSlice, build_emulated_runner
from worker_svc.execution.emulated_kv import EmulatedKVTier
from worker_svc.execution.kv_tier import ImportAreaFullError, TierMissError
from worker_svc.models.registry import read_config
from worker_svc.service.kv_transfer import TransferError, check_empty_chunk, decode_chunk, empty_chunk, emulated_layout

A100 = "a100-80gb-llama2-70b-tp8"
H200 = "h200-141gb-llama3-8b-tp1"
LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "eos_token_id": 2,
}
Code = grpc.StatusCode


def key(i: int) -> bytes:
    return b"key-%03d" % i


def profile(rate: float = 0.0) -> DeviceProfile:
    return DeviceProfile(
        name="test-device",
        source="made up for the tests",
        fixed_s=0.0,
        per_prefill_token_s=0.0,
        per_decode_row_s=0.0,
        per_context_token_s=0.0,
        allreduce_per_token_s=0.0,
        eos_probability=0.0,
        kv_transfer_bytes_per_s=rate,
    )


def runner(import_blocks: int = 4, layers: int = 4, num_blocks: int = 16) -> EmulatedRunner:
    config = read_config({**LLAMA2_70B, "num_hidden_layers": layers})
    model = EmulatedSlice(config, 0, layers, True, True)
    return EmulatedRunner(
        model, profile(), num_blocks, 16, torch.bfloat16, 8, sleep=lambda s: None, import_blocks=import_blocks
    )


def new_seq(seq_id: int, prompt_len: int, num_computed: int, blocks: tuple[int, ...]) -> NewSeq:
    tokens, scheduled = tuple(range(3, 3 + prompt_len)), prompt_len - num_computed
    return NewSeq(seq_id, tokens, prompt_len, num_computed, scheduled, blocks, SamplingParams(ignore_eos=True))


# --- the profile's KV link --------------------------------------------------------------------


def test_the_kv_link_is_bytes_over_its_rate_and_free_when_not_modelled(tmp_path):
    assert profile().kv_transfer_time_s(10**9) == 0.0
    assert profile(2e11).kv_transfer_time_s(5_242_880 * 256) == pytest.approx(6.7108864e-3)
    with pytest.raises(ValueError, match="num_bytes"):
        profile(1.0).kv_transfer_time_s(-1)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="kv_transfer_bytes_per_s must be finite and >= 0"):
            profile(bad)
    data = profile_to_dict(profile(3e9))
    assert data["kv_transfer_bytes_per_s"] == 3e9
    (tmp_path / "p.json").write_text(json.dumps(data))
    assert load_profile(str(tmp_path / "p.json")) == profile(3e9)
    del data["kv_transfer_bytes_per_s"]  # optional: 0, not modelled
    (tmp_path / "q.json").write_text(json.dumps(data))
    assert load_profile(str(tmp_path / "q.json")).kv_transfer_bytes_per_s == 0.0


def test_the_shipped_gpu_profiles_take_their_link_from_the_published_nics():
    a100, h200 = load_profile(A100), load_profile(H200)
    assert a100.kv_transfer_bytes_per_s == 8 * 200e9 / 8  # 8 x 200 Gb/s HDR, one per GPU
    assert h200.kv_transfer_bytes_per_s == 400e9 / 8  # one 400 Gb/s NDR
    assert load_profile("cpu-local").kv_transfer_bytes_per_s == 0.0
    for p, spec in ((a100, "DGX A100"), (h200, "DGX H200")):
        note = next(n for n in p.notes if n.startswith("kv_transfer_bytes_per_s"))
        assert spec in note and "derived from the published" in note


# --- the import area of keys and the tier ops -------------------------------------------------


def test_a_pull_keeps_all_its_keys_or_none_within_the_bound():
    tier = EmulatedKVTier(16, 3)
    tier.put_keys([key(0), key(1)])
    with pytest.raises(ImportAreaFullError):
        tier.put_keys([key(2), key(3)])
    assert sorted(tier.imports.keys()) == [key(0), key(1)]
    tier.put_keys([key(1), key(2)])  # a key held again replaces itself
    assert tier.num_import_blocks == 3 and tier.imports.nbytes == 0
    with pytest.raises(ValueError, match="1 to 120 bytes"):
        tier.put_keys([b""])
    tier.check_integrity()


def test_keys_not_loaded_expire_after_the_ttl():
    now = [100.0]
    tier = EmulatedKVTier(16, 4, import_ttl_s=10.0, clock=lambda: now[0])
    tier.put_keys([key(0)])
    now[0] += 6
    tier.put_keys([key(1)])
    now[0] += 5  # key 0 is 11 s old
    tier.apply([])
    assert list(tier.imports.keys()) == [key(1)]
    tier.check_integrity()


def test_a_load_consumes_its_key_a_drop_forgets_and_a_miss_fails_after_the_rest():
    tier = EmulatedKVTier(16, 8)
    tier.put_keys([key(i) for i in range(4)])
    tier.apply([TierOp(TIER_LOAD, key(0), 5), TierOp(TIER_DROP, key(1)), TierOp(TIER_DROP, key(9))])
    assert sorted(tier.imports.keys()) == [key(2), key(3)]
    assert (tier.num_loaded_import, tier.num_dropped) == (1, 1)
    with pytest.raises(TierMissError) as caught:
        tier.apply([TierOp(TIER_LOAD, key(0), 5), TierOp(TIER_LOAD, key(2), 6), TierOp(TIER_DROP, key(3))])
    assert caught.value.keys == (key(0),) and tier.num_import_blocks == 0  # the rest was applied
    assert tier.num_missed == 1
    tier.put_keys([key(7)])
    tier.clear()
    assert tier.num_import_blocks == 0
    tier.check_integrity()


@pytest.mark.parametrize(
    "ops, words",
    [
        ([TierOp(TIER_SAVE, key(0), 1)], "does not model"),
        ([TierOp(TIER_DEMOTE, key(0))], "does not model"),
        ([TierOp(TIER_LOAD, key(0), 16)], "out of range"),
        ([TierOp(TIER_LOAD, key(0), 2), TierOp(TIER_LOAD, key(1), 2)], "loaded twice"),
        ([TierOp(TIER_DROP, b"k" * 121)], "1 to 120 bytes"),
    ],
)
def test_ops_an_emulated_stage_cannot_carry_out_are_refused(ops, words):
    with pytest.raises(InvalidPlanError, match=words):
        EmulatedKVTier(16, 8).check(ops, 1)


# --- the emulated runner with an import area --------------------------------------------------


def test_the_runner_loads_pulled_keys_and_computes_only_the_rest():
    r = runner()
    r.kv_tier.put_keys([key(0), key(1)])
    loads = (TierOp(TIER_LOAD, key(0), 4), TierOp(TIER_LOAD, key(1), 6))
    result = r.execute(StepPlan(1, (new_seq(7, 40, 32, (4, 6, 10)),), tier_ops=loads))
    assert len(result.sampled.token_ids) == 1 and r.kv_tier.num_import_blocks == 0
    assert r.kv_tier.num_loaded_import == 2 and r.batch.seqs[7].block_ids == [4, 6, 10]


def test_a_load_of_a_key_not_held_fails_the_step_as_on_a_real_stage():
    r = runner()
    with pytest.raises(TierMissError):
        r.execute(StepPlan(1, (new_seq(7, 40, 32, (4, 6, 10)),), tier_ops=(TierOp(TIER_LOAD, key(0), 4),)))
    assert r.kv_tier.num_missed == 1


def test_tier_ops_without_an_import_area_or_of_a_tier_change_nothing():
    plain = runner(import_blocks=0)
    assert plain.kv_tier is None
    with pytest.raises(InvalidPlanError, match="no import area"):
        plain.execute(StepPlan(1, (new_seq(7, 40, 32, (4, 6, 10)),), tier_ops=(TierOp(TIER_LOAD, key(0), 4),)))
    r = runner()
    r.kv_tier.put_keys([key(0)])
    with pytest.raises(InvalidPlanError, match="does not model"):
        r.execute(StepPlan(1, (new_seq(7, 40, 0, (4, 6, 10)),), tier_ops=(TierOp(TIER_SAVE, key(5), 1),)))
    assert len(plain.batch) == len(r.batch) == 0 and r.kv_tier.num_import_blocks == 1
    r.execute(StepPlan(2, (new_seq(8, 16, 0, (1,)),), reset=True))
    assert r.kv_tier.num_import_blocks == 0


def test_the_built_runner_has_the_import_area_it_is_given_and_refuses_a_kv_tier(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    common = dict(model=str(tmp_path), device=f"emulated:{A100}", num_kv_blocks=64)
    built = build_emulated_runner(WorkerConfig(kv_import_blocks=32, **common), sleep=lambda s: None)
    assert built.kv_tier.import_blocks == 32
    assert build_emulated_runner(WorkerConfig(**common), sleep=lambda s: None).kv_tier is None
    with pytest.raises(ValueError, match="^kv_offload: an emulated device models no KV tier"):
        build_emulated_runner(WorkerConfig(kv_offload="host:8b", **common))


# --- the chunks of an emulated transfer -------------------------------------------------------


def test_an_emulated_block_is_the_one_a_real_stage_of_its_layers_would_send(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    config = WorkerConfig(model=str(tmp_path), device=f"emulated:{A100}", num_stages=2, stage=1, num_kv_blocks=8)
    second = build_emulated_runner(config, sleep=lambda s: None)
    layout = emulated_layout(second)  # every KV head though the profile emulates 8 ranks of 1 each
    assert (layout.dtype, layout.shape, layout.layer_start, layout.layer_end) == (
        torch.bfloat16,
        (80, 16, 8, 128),
        40,
        80,
    )
    assert layout.nbytes == 5_242_880 // 2 == second.kv_block_bytes * 8  # half of LLaMA-2-70B's block


def test_empty_chunks_pass_an_emulated_check_only():
    layout = emulated_layout(runner())
    chunk = empty_chunk(3, layout)
    assert chunk.data == b"" and chunk.crc32 == zlib.crc32(b"") and list(chunk.shape) == [8, 16, 8, 128]
    check_empty_chunk(chunk, 3, layout)
    with pytest.raises(TransferError, match="0 bytes, expected") as real:
        decode_chunk(chunk, 3, layout)  # a real stage refuses it
    assert real.value.code == Code.DATA_LOSS
    bytes_chunk = empty_chunk(3, layout)
    bytes_chunk.data, bytes_chunk.crc32 = b"x", zlib.crc32(b"x")  # a real source's bytes
    with pytest.raises(TransferError, match="empty blocks only") as full:
        check_empty_chunk(bytes_chunk, 3, layout)
    assert full.value.code == Code.DATA_LOSS
    other = empty_chunk(3, layout._replace(layer_end=5))
    with pytest.raises(TransferError) as wrong:
        check_empty_chunk(other, 3, layout)
    assert wrong.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(TransferError) as moved:
        check_empty_chunk(chunk, 4, layout)
    assert moved.value.code == Code.DATA_LOSS
