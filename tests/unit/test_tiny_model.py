"""wiring.tiny_model: checkpoints that transformers loads, byte-identical for one spec."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from wiring.tiny_model import (
    IM_END_TOKEN_ID,
    PRESETS,
    SPEC_25M,
    TinyModelSpec,
    add_cli_arguments,
    default_model_dir,
    float32_to_bfloat16_bits,
    make_tiny_model,
    spec_from_args,
)

torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Hello",
    "In Python, a list is",
    "héllo 世界",
    "1 2 3 4",
    "import",
    "The class statement",
]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}
SPECS = {
    "llama": TinyModelSpec(rope_scaling=LLAMA3_ROPE),
    "mistral": TinyModelSpec(arch="mistral", sliding_window=64),
    "qwen2": TinyModelSpec(arch="qwen2", num_layers=2, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(root / name, spec) for name, spec in SPECS.items()}


def _load(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


# --- files and determinism -----------------------------------------------------------------


def test_same_spec_gives_identical_bytes_even_in_another_process(tmp_path: Path) -> None:
    spec = TinyModelSpec(arch="qwen2", num_layers=2, dtype="bfloat16", seed=7)
    here = make_tiny_model(tmp_path / "here", spec)
    again = make_tiny_model(tmp_path / "again", spec)
    # Another process, another hash seed; it must also never import torch.
    code = (
        "import sys, wiring.tiny_model as t; "
        f"t.make_tiny_model(sys.argv[1], t.TinyModelSpec(**{spec.to_dict()!r})); "
        "assert 'torch' not in sys.modules, 'wiring.tiny_model imported torch'"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "there")],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
    )
    assert set(_file_bytes(here)) == FILES
    assert _file_bytes(here) == _file_bytes(again) == _file_bytes(tmp_path / "there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "here", "there"]  # no temp dirs


def test_importing_does_not_import_torch() -> None:
    code = "import wiring.tiny_model, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_seed_changes_weights_but_not_tokenizer(tmp_path: Path) -> None:
    a = _file_bytes(make_tiny_model(tmp_path / "a", TinyModelSpec(num_layers=1, seed=0)))
    b = _file_bytes(make_tiny_model(tmp_path / "b", TinyModelSpec(num_layers=1, seed=1)))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_refuses_a_nonempty_dir_unless_overwriting_a_checkpoint(tmp_path: Path) -> None:
    spec = TinyModelSpec(num_layers=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_tiny_model(tmp_path / "other", spec, overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"

    out = make_tiny_model(tmp_path / "model", spec)
    with pytest.raises(FileExistsError):
        make_tiny_model(out, TinyModelSpec(num_layers=2))
    make_tiny_model(out, TinyModelSpec(num_layers=2), overwrite=True)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    (tmp_path / "empty").mkdir()
    make_tiny_model(tmp_path / "empty", spec)  # an empty directory is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model", "other"]


def test_default_model_dir_is_made_once_per_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    path = default_model_dir()
    assert path.parent.parent == tmp_path and (path / "model.safetensors").is_file()
    mtime_ns = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime_ns
    other = default_model_dir(cache_dir=tmp_path, spec=TinyModelSpec(num_layers=1))
    assert other != path and other.parent == path.parent


# --- loading with transformers ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPECS))
def test_transformers_loads_every_tensor_with_the_intended_config(model_dirs: dict[str, Path], name: str) -> None:
    spec = SPECS[name]
    model, info = _load(model_dirs[name])
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected, mismatched
    config = model.config
    assert (
        type(model).__name__
        == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.arch]
    )
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        config.max_position_embeddings,
    ) == (
        spec.num_layers,
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.vocab_size,
        spec.max_position_embeddings,
    )
    assert config.tie_word_embeddings == spec.tie_word_embeddings
    assert model.num_parameters() == spec.num_parameters
    # transformers 5 reads the legacy rope_theta / rope_scaling into rope_parameters.
    assert config.rope_parameters["rope_theta"] == spec.rope_theta
    if spec.rope_scaling:
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == 8.0
    if spec.arch == "mistral":
        assert config.sliding_window == spec.sliding_window
    if spec.arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_mistral_without_a_window_has_none(tmp_path: Path) -> None:
    # MistralConfig defaults to a 4096-token window; the maker writes null explicitly.
    path = make_tiny_model(tmp_path, TinyModelSpec(arch="mistral", num_layers=1))
    assert AutoConfig.from_pretrained(path).sliding_window is None


def test_tied_embeddings_write_no_lm_head(model_dirs: dict[str, Path]) -> None:
    with safe_open(model_dirs["qwen2"] / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    with safe_open(model_dirs["llama"] / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" in set(f.keys())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_logits_are_peaked_and_greedy_output_varies(model_dirs: dict[str, Path], name: str) -> None:
    model, _ = _load(model_dirs[name])
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[name])
    vocab_size = SPECS[name].vocab_size
    max_probs, num_distinct = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            input_ids = tokenizer(prompt, return_tensors="pt").input_ids
            logits = model(input_ids).logits[0, -1]  # [vocab_size]
            max_probs.append(logits.softmax(-1).max().item())
            assert logits.std().item() > 2.0
            output = model.generate(
                input_ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
            )
            num_distinct.append(len(set(output[0, input_ids.shape[1] :].tolist())))
    assert sum(max_probs) / len(max_probs) > 10 / vocab_size
    assert max(num_distinct) >= 6, num_distinct  # not stuck on one token for every prompt


@pytest.mark.parametrize("dtype, torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_half_precision_files_hold_rounded_float32_weights(
    tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    spec32 = TinyModelSpec(num_layers=1)
    spec16 = TinyModelSpec(num_layers=1, dtype=dtype)
    dir32 = make_tiny_model(tmp_path / "f32", spec32)
    dir16 = make_tiny_model(tmp_path / dtype, spec16)
    with (
        safe_open(dir32 / "model.safetensors", framework="pt") as f32,
        safe_open(dir16 / "model.safetensors", framework="pt") as f16,
    ):
        assert set(f32.keys()) == set(f16.keys())
        for name in f32.keys():
            w32, w16 = f32.get_tensor(name), f16.get_tensor(name)
            assert w32.dtype == torch.float32 and w16.dtype == torch_dtype
            assert torch.equal(w32.to(torch_dtype), w16), name  # round to nearest even
    assert json.loads((dir16 / "config.json").read_text())["torch_dtype"] == dtype
    model, info = AutoModelForCausalLM.from_pretrained(dir16, dtype="auto", output_loading_info=True)
    assert model.dtype == torch_dtype and not any(info.values())


def test_bfloat16_rounding_ties_go_to_even() -> None:
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.5], dtype=np.float32)
    bits = float32_to_bfloat16_bits(values)
    expected = torch.tensor(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert bits.tolist() == expected.tolist()
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020]


# --- tokenizer -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tokenizer_round_trips_text(model_dirs: dict[str, Path], name: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs[name])
    raw = Tokenizer.from_file(str(model_dirs[name] / "tokenizer.json"))
    assert len(tokenizer) == raw.get_vocab_size() == SPECS[name].vocab_size
    for text in [
        "Hello, world! def f(x): return x ** 2",
        "héllo 世界",
        "  tabs\tand\n\nnewlines ",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]:
        ids = tokenizer(text).input_ids
        assert ids == raw.encode(text).ids  # transformers tokenizes as tokenizer.json says
        assert tokenizer.decode(ids) == text
    assert tokenizer("Hello").input_ids[0] != tokenizer.bos_token_id  # no BOS added
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tokenizer.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_chat_template_renders_chatml(model_dirs: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(IM_END_TOKEN_ID) == 2


def test_generation_config_stops_on_eos_and_im_end(model_dirs: dict[str, Path]) -> None:
    generation = json.loads((model_dirs["llama"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, IM_END_TOKEN_ID] and generation["bos_token_id"] == 0
    config = AutoConfig.from_pretrained(model_dirs["llama"])
    assert (config.bos_token_id, config.eos_token_id) == (0, 1)


# --- the spec and the CLI ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"arch": "gpt2"}, "arch"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": 64, "num_heads": 5}, "num_heads"),
        ({"hidden_size": 36, "num_heads": 4}, "num_heads"),  # odd head_dim: no rotary pairs
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"vocab_size": 100_000}, "vocab_size"),
        ({"intermediate_size": -1}, "intermediate_size"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "wavy", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling"),
        ({"sliding_window": 128}, "sliding_window"),  # llama has none
        ({"arch": "mistral", "sliding_window": 0}, "sliding_window"),
        ({"dtype": "int8"}, "dtype"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_specs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        TinyModelSpec(**kwargs)


def test_spec_defaults_and_presets() -> None:
    spec = TinyModelSpec()
    assert (
        spec.arch,
        spec.num_layers,
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.vocab_size,
        spec.max_position_embeddings,
        spec.dtype,
    ) == ("llama", 4, 64, 176, 4, 2, 16, 512, 4096, "float32")
    assert TinyModelSpec(intermediate_size=176) == spec and hash(spec) == hash(TinyModelSpec())
    assert TinyModelSpec(rope_scaling=LLAMA3_ROPE) == TinyModelSpec(rope_scaling=dict(LLAMA3_ROPE))
    assert PRESETS["tiny"] == spec and PRESETS["25m"] is SPEC_25M
    assert 23_000_000 < SPEC_25M.num_parameters < 27_000_000


def test_cli_arguments_make_a_spec() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    add_cli_arguments(parser)
    assert spec_from_args(parser.parse_args(["out"])) == TinyModelSpec()
    args = parser.parse_args(
        [
            "out",
            "--arch",
            "mistral",
            "--num-layers",
            "2",
            "--hidden-size",
            "128",
            "--num-heads",
            "8",
            "--num-kv-heads",
            "4",
            "--vocab-size",
            "1024",
            "--max-position-embeddings",
            "8192",
            "--tie-word-embeddings",
            "--rope-theta",
            "500000",
            "--rope-scaling",
            json.dumps(LLAMA3_ROPE),
            "--sliding-window",
            "256",
            "--dtype",
            "bfloat16",
            "--seed",
            "3",
        ]
    )
    assert spec_from_args(args) == TinyModelSpec(
        arch="mistral",
        num_layers=2,
        hidden_size=128,
        intermediate_size=352,
        num_heads=8,
        num_kv_heads=4,
        vocab_size=1024,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        sliding_window=256,
        dtype="bfloat16",
        seed=3,
    )
    assert spec_from_args(parser.parse_args(["out", "--preset", "25m", "--num-layers", "2"])) == (
        TinyModelSpec(**{**SPEC_25M.to_dict(), "num_layers": 2})
    )
    with pytest.raises(ValueError, match="^num_kv_heads:"):
        spec_from_args(parser.parse_args(["out", "--num-kv-heads", "3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["out", "--rope-scaling", "{not json"])
