"""Train a tiny checkpoint briefly on its own tokenizer's text: a small model with learned
logit margins.

`make_tiny_model` writes random weights scaled so that greedy decoding is a sharp test of a
runtime, but random networks are far more sensitive to weight noise than trained ones (their
top-1/top-2 margins are small and their layers amplify perturbations). Measuring what a lossy
transformation of the weights costs (FP8 quantization) needs a model that behaves like a real
one: `train_tiny_model` replaces a checkpoint's weights by a model trained for a few hundred
steps on the text the tokenizer was trained on (CPython's pydoc topics), starting from the
architecture's standard initialization (`initializer_range`, 0.02), seeded.

Deterministic for the same checkpoint, recipe, torch build and thread count. Training runs in
float32 on the CPU; the weights are written back in the checkpoint's dtype under the same
tensor names, and `training.json` records the recipe and the losses. The last
`held_out_fraction` of the text is never trained on: `held_out_windows` draws evaluation
prompts from it.

This module needs torch and transformers; `wiring.tiny_model` stays torch-free and calls
it only through `make_tiny_model(..., finish=...)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from wiring.tiny_model import _training_text


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """How a tiny model is trained: AdamW, linear warmup then linear decay to 10% of `lr`,
    gradients clipped to norm 1, batches of random windows of the training tokens."""

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    held_out_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "warmup_steps"):
            value = getattr(self, name)
            minimum = 0 if name == "warmup_steps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: must be a positive number, got {self.lr!r}")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction: must be in (0, 1), got {self.held_out_fraction!r}")

    def lr_at(self, step: int) -> float:
        warmup = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.lr * warmup * (0.1 + 0.9 * (1 - step / self.steps))


def text_token_ids(
    model_dir: str | os.PathLike[str], recipe: TrainingRecipe = TrainingRecipe()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training ids, held-out ids): the tokenized training text, split at its end."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode("\n\n".join(_training_text())).ids, dtype=torch.long)
    split = int(len(ids) * (1 - recipe.held_out_fraction))
    return ids[:split], ids[split:]


def held_out_windows(
    model_dir: str | os.PathLike[str],
    count: int,
    length: int,
    *,
    seed: int = 0,
    recipe: TrainingRecipe = TrainingRecipe(),
) -> list[list[int]]:
    """`count` windows of `length` tokens from the held-out text, at seeded random offsets."""
    _, held_out = text_token_ids(model_dir, recipe)
    if len(held_out) <= length:
        raise ValueError(f"length: the held-out text has only {len(held_out)} tokens")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(held_out) - length, (count,), generator=g).tolist()
    return [held_out[s : s + length].tolist() for s in starts]


def train_tiny_model(model_dir: str | os.PathLike[str], recipe: TrainingRecipe = TrainingRecipe()) -> dict[str, Any]:
    """Replace the weights of the checkpoint in `model_dir` by a briefly trained model.

    Returns (and writes to `training.json`) the recipe, the mean training loss of the first and
    last 10 steps, and the loss on held-out windows.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if recipe.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len: {recipe.seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )
    weights_file = model_dir / "model.safetensors"
    with safe_open(weights_file, "pt") as f:
        names = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    out_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[next(iter(names.values()))]

    train_ids, held_ids = text_token_ids(model_dir, recipe)
    if len(train_ids) <= recipe.seq_len + 1:
        raise ValueError(f"seq_len: the training text has only {len(train_ids)} tokens")
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(recipe.seed)
    losses = []
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step)
        starts = torch.randint(0, len(train_ids) - recipe.seq_len, (recipe.batch_size,), generator=g)
        batch = torch.stack([train_ids[s : s + recipe.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())

    model.eval()
    eval_windows = held_out_windows(model_dir, 16, min(recipe.seq_len, len(held_ids) - 1), recipe=recipe)
    with torch.no_grad():
        batch = torch.tensor(eval_windows)
        held_out_loss = float(model(input_ids=batch, labels=batch).loss)

    state = model.state_dict()
    missing = sorted(set(names) - set(state))
    if missing:
        raise RuntimeError(f"the trained model lacks checkpoint tensors {missing[:5]}")
    tensors = {name: state[name].detach().to(out_dtype).contiguous() for name in sorted(names)}
    tmp = weights_file.with_name(f".{weights_file.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, weights_file)
    head = min(10, len(losses))
    summary = {
        "recipe": dataclasses.asdict(recipe),
        "init": f"transformers' initialization, initializer_range {config.initializer_range}",
        "text": "CPython pydoc topics (the tokenizer's training text)",
        "train_tokens": len(train_ids),
        "held_out_tokens": len(held_ids),
        "first_loss": sum(losses[:head]) / head,
        "final_loss": sum(losses[-head:]) / head,
        "held_out_loss": held_out_loss,
    }
    (model_dir / "training.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
