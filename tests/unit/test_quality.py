"""bench/quality.py: the metrics on hand-made distributions (exact values), the windows, the
text (bench/quality_text.py), the formats (bench/quality_formats.py), and the window logits
(bench/quality_logits.py) against transformers' on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from bench import quality as q
from bench.quality_formats import WeightFormat, weight_format
from bench.quality_logits import LLAMA_PYTHON, llama_logits, window_logits
from bench.quality_text import strip_gutenberg


def _logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is each row of probabilities."""
    return torch.tensor(rows, dtype=torch.float64).log()


def test_identical_distributions_have_zero_kl_and_the_same_top() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    s = q.score_tokens(logits, logits.clone(), torch.arange(5))
    assert s.kl.tolist() == [0.0] * 5
    assert s.same_top.all()
    assert torch.allclose(s.nll, -torch.log_softmax(logits.double(), -1)[torch.arange(5), torch.arange(5)])


def test_two_token_kl_has_its_closed_form() -> None:
    ref, fmt = _logits([0.5, 0.5], [0.8, 0.2]), _logits([0.9, 0.1], [0.8, 0.2])
    s = q.score_tokens(ref, fmt, torch.tensor([1, 0]))
    assert s.kl[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), abs=1e-12)
    assert s.kl[1].item() == pytest.approx(0.0, abs=1e-15)
    assert s.nll.tolist() == pytest.approx([-math.log(0.1), -math.log(0.8)], abs=1e-12)
    # argmax of [0.5, 0.5] is the first token, as is [0.9, 0.1]'s
    assert s.same_top.tolist() == [True, True]


def test_kl_is_ref_against_format_not_the_reverse() -> None:
    ref, fmt = _logits([0.25, 0.75]), _logits([0.5, 0.5])
    s = q.score_tokens(ref, fmt, torch.tensor([0]))
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert s.kl.item() == pytest.approx(want, abs=1e-12)
    assert not s.same_top.item()


def test_a_uniform_model_has_the_vocabulary_size_as_perplexity() -> None:
    vocab = 49152
    s = q.score_tokens(torch.zeros(7, vocab), torch.zeros(7, vocab), torch.arange(7))
    assert q.perplexity(s.nll) == pytest.approx(vocab, rel=1e-12)
    out = q.summarize([s])
    assert out["num_scored"] == 7 and out["mean_kl"] == 0.0 and out["same_top"] == 1.0
    assert out["perplexity"] == pytest.approx(vocab, rel=1e-12) and out["perplexity_se"] == pytest.approx(0.0, abs=1e-6)


def test_summarize_averages_over_all_scored_positions() -> None:
    a = q.TokenScores(
        torch.tensor([1.0, 3.0], dtype=torch.float64),
        torch.tensor([0.0, 0.2], dtype=torch.float64),
        torch.tensor([True, False]),
    )
    b = q.TokenScores(
        torch.tensor([2.0], dtype=torch.float64), torch.tensor([0.4], dtype=torch.float64), torch.tensor([True])
    )
    out = q.summarize([a, b])
    assert out["num_scored"] == 3
    assert out["perplexity"] == pytest.approx(math.exp(2.0))
    assert out["mean_kl"] == pytest.approx(0.2) and out["max_kl"] == pytest.approx(0.4)
    assert out["same_top"] == pytest.approx(2 / 3)
    assert out["mean_kl_se"] == pytest.approx(0.2 / math.sqrt(3))


def test_windows_are_consecutive_and_cover_at_least_the_tokens_asked_for() -> None:
    ids = list(range(100))
    assert q.make_windows(ids, 16, 40) == [ids[0:16], ids[16:32], ids[32:48]]  # ceil(40 / 16)
    assert len(q.make_windows(ids, 16, 10_000)) == 6  # as many whole windows as the text has
    assert q.first_scored(512) == 256  # rows 256..510: 255 scored tokens, each with >= 256 of context
    with pytest.raises(ValueError):
        q.make_windows(ids, 2, 10)


def test_strip_gutenberg_keeps_the_book_only() -> None:
    raw = "header\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nThe book.\n*** END OF THIS ***\nlicence\n"
    assert strip_gutenberg(raw) == "The book.\n"
    assert strip_gutenberg("no markers\n") == "no markers\n"


def test_format_names_map_to_load_options() -> None:
    assert weight_format("float32", "Q4_1") == WeightFormat("float32", "source", "float32")
    assert weight_format("bfloat16", "Q4_1") == WeightFormat("bfloat16", "source", "bfloat16")
    assert weight_format("Q4_1", "Q4_1") == WeightFormat("Q4_1", "source", "auto")
    assert weight_format("Q8_0", "Q4_1") == WeightFormat("Q8_0", "Q8_0", "auto")
    assert weight_format("Q4_K_M", "Q4_1") == WeightFormat("Q4_K_M", "Q4_K_M", "auto")
    assert weight_format("fp8", "Q4_1") == WeightFormat("fp8", "source", "float32", "fp8")
    with pytest.raises(ValueError, match="unknown format"):
        weight_format("Q7_K", "Q4_1")


def test_window_logits_equal_transformers(model_factory, hf_llama) -> None:
    from worker_svc.checkpoints.loader import load_stage

    torch.set_num_threads(1)
    model = load_stage(model_factory(arch="llama"), dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    first = q.first_scored(len(ids))
    got = window_logits(model, ids, first)
    with torch.no_grad():
        want = hf_llama(torch.tensor([ids])).logits[0].float()
    assert got.shape == (len(ids) - 1 - first, model.config.vocab_size)
    assert (got - want[first : len(ids) - 1]).abs().max().item() < 1e-4
    assert (window_logits(model, ids, 0) - want[:-1]).abs().max().item() < 1e-4


def test_the_module_imports_without_torch() -> None:
    """`pagoda --help` builds its parser: importing it must stay light."""
    import subprocess
    import sys

    code = "import sys, bench.quality; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.skipif(not LLAMA_PYTHON.is_file(), reason="no llama-cpp-python environment")
def test_llama_cpp_logits_line_up_with_pagoda_on_the_same_file(gguf_factory, tmp_path) -> None:
    """llama.cpp's rows are the same positions as Pagoda's (both run the same Q8_0 file; its
    KV cache is float16, so they agree closely, not exactly)."""
    from pathlib import Path

    from wiring.model_source import prepare_gguf
    from worker_svc.checkpoints.loader import load_stage

    torch.set_num_threads(1)
    path = Path(gguf_factory("Q8_0", arch="llama"))
    model = load_stage(prepare_gguf(path))
    windows = [torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    first = q.first_scored(64)
    logits, info = llama_logits(LLAMA_PYTHON, path, windows, first, tmp_path / "logits.npy")
    assert logits.shape == (2, 64 - 1 - first, 512) and info["eval_s"] > 0
    for k, ids in enumerate(windows):
        s = q.score_tokens(
            window_logits(model, ids, first), torch.from_numpy(logits[k].copy()), torch.tensor(ids[first + 1 :])
        )
        assert s.kl.mean().item() < 0.05 and s.same_top.double().mean().item() > 0.8
