"""The trained tiny model of the quality tests (FP8): made by `wiring.tiny_train`.

Hidden size 128, 4 layers, trained for 200 steps on CPython's pydoc text: learned logit
margins, about 20 s on one CPU thread. Shared by tests/conftest.py (`trained_model_dir`) and
the GPU tests, which run without the conftest.
"""

from __future__ import annotations

from pathlib import Path

from wiring.tiny_model import TinyModelSpec, make_tiny_model

TRAINED_SPEC = TinyModelSpec(hidden_size=128, num_layers=4)
TRAINED_STEPS = 200


def make_trained_model(out_dir: str | Path) -> str:
    from wiring.tiny_train import TrainingRecipe, train_tiny_model

    recipe = TrainingRecipe(steps=TRAINED_STEPS)
    return str(make_tiny_model(out_dir, TRAINED_SPEC, finish=lambda path: train_tiny_model(path, recipe)))
