"""`wiring.tiny_train`: a tiny checkpoint trained briefly on its tokenizer's text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from support.logits import all_logits

from wiring.tiny_model import TinyModelSpec, make_tiny_model
from wiring.tiny_train import TrainingRecipe, held_out_windows, text_token_ids, train_tiny_model
from worker_svc.checkpoints.loader import load_stage


def tensor_dtypes(model_dir) -> dict[str, str]:
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def test_trained_model_learned_and_loads_the_same_in_transformers(trained_model_dir):
    summary = json.loads(open(f"{trained_model_dir}/training.json").read())
    # uniform over 512 tokens is ln 512 = 6.2; 200 steps reach about 3.3 (held out 3.6)
    assert summary["first_loss"] > 5.5
    assert summary["final_loss"] < 4.0 and summary["held_out_loss"] < 4.2, summary
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(trained_model_dir, dtype=torch.float32).eval()
    seqs = held_out_windows(trained_model_dir, 4, 48, seed=1)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(seqs)).logits
    got = all_logits(load_stage(trained_model_dir, dtype="float32"), seqs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_held_out_text_is_not_trained_on(trained_model_dir):
    train, held = text_token_ids(trained_model_dir)
    assert 0.04 < len(held) / (len(train) + len(held)) < 0.06
    windows = held_out_windows(trained_model_dir, 8, 64, seed=3)
    assert windows == held_out_windows(trained_model_dir, 8, 64, seed=3)
    assert all(len(w) == 64 for w in windows)
    held_text = held.tolist()
    assert all(any(held_text[i : i + 64] == w for i in range(len(held_text) - 63)) for w in windows)


def test_training_is_deterministic_and_keeps_names_and_dtype(tmp_path):
    spec = TinyModelSpec(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, dtype="bfloat16", tie_word_embeddings=True
    )
    recipe = TrainingRecipe(steps=3, batch_size=2, seq_len=32)
    random_dir = make_tiny_model(tmp_path / "random", spec)
    dirs = [
        make_tiny_model(tmp_path / f"t{i}", spec, finish=lambda path: train_tiny_model(path, recipe)) for i in range(2)
    ]
    assert tensor_dtypes(dirs[0]) == tensor_dtypes(random_dir)  # same names, all BF16
    assert set(tensor_dtypes(dirs[0]).values()) == {"BF16"}
    first, second = ((d / "model.safetensors").read_bytes() for d in dirs)
    assert first == second
    assert first != (random_dir / "model.safetensors").read_bytes()
    assert json.loads((dirs[0] / "training.json").read_text())["recipe"]["steps"] == 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("steps", 0),
        ("batch_size", -1),
        ("seq_len", 1.5),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("held_out_fraction", 1.0),
        ("warmup_steps", -1),
    ],
)
def test_recipe_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainingRecipe(**{field: value})


def test_sequence_longer_than_the_model_is_refused(tmp_path):
    model = make_tiny_model(tmp_path / "m", TinyModelSpec(max_position_embeddings=64))
    with pytest.raises(ValueError, match="seq_len"):
        train_tiny_model(model, TrainingRecipe(steps=1, seq_len=128))


def test_cli_train_steps(tmp_path):
    def pagoda(*args):
        return subprocess.run(
            [sys.executable, "-m", "wiring.cli", "tiny-model", *args], capture_output=True, text=True, timeout=120
        )

    done = pagoda(str(tmp_path / "m"), "--hidden-size", "32", "--num-layers", "1", "--train-steps", "2")
    assert done.returncode == 0, done.stderr
    assert "trained for 2 steps" in done.stdout
    assert (tmp_path / "m" / "training.json").is_file()
    bad = pagoda(str(tmp_path / "x"), "--train-steps", "-1")
    assert bad.returncode == 2 and "--train-steps" in bad.stderr and "steps" in bad.stderr
    assert not (tmp_path / "x").exists()
