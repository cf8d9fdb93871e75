"""GGUF checkpoints: metadata, tokenizer, tensors (packed or dequantized) and greedy output
against `transformers` reading the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.reference import HFReference

from services.text.tokenizer import Tokenizer
from wiring.model_source import prepare_gguf
from worker_svc.checkpoints.gguf_checkpoint import GGUF_SOURCE_FILE, GGUFCheckpoint
from worker_svc.checkpoints.loader import load_stage
from worker_svc.errors import CheckpointError
from worker_svc.weights.packed import PackedEmbedding, PackedLinear
from worker_svc.weights.quantization import weight_bytes

# a unicode corpus: accents, CJK, emoji (several code points), right-to-left text, control
# characters, runs of spaces and newlines, digits, code
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade — naïve café, Straße, ĳ, ǅ, Ω≈ç√∫˜µ≤≥÷",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji: 🙂👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️‍🔥",
    "שלום עולם مرحبا بالعالم",
    "tabs\tand\nnewlines\r\n   three spaces    four\u00a0nbsp\u200bzwsp",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "",
]


def test_config_matches_transformers(real_gguf, gguf_factory):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    for path in (real_gguf, gguf_factory("Q8_0", arch="llama")):
        ours = GGUFCheckpoint(path).hf_config()
        theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        for key in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "bos_token_id",
            "eos_token_id",
        ):
            assert ours[key] == theirs[key], key
        assert ours["tie_word_embeddings"] == theirs.get("tie_word_embeddings", False)


def test_tokenizer_equals_transformers_on_unicode(real_gguf, gguf_factory):
    from transformers import AutoTokenizer

    for path in (Path(real_gguf), Path(gguf_factory("Q8_0", arch="llama"))):
        ours = Tokenizer(prepare_gguf(path))
        theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        for text in CORPUS:
            ids = theirs.encode(text, add_special_tokens=False)
            assert ours.encode(text) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), text


def test_real_model_chat_template_and_stop_token(real_gguf):
    tok = Tokenizer(prepare_gguf(real_gguf))
    assert tok.eos_token == "<|im_end|>" and 2 in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_float32_load_equals_transformers_weights(gguf_factory):
    from transformers import AutoModelForCausalLM

    for qtype in ("Q8_0", "Q4_1", "Q4_0"):
        path = Path(gguf_factory(qtype, arch="llama"))
        stage = load_stage(prepare_gguf(path), dtype="float32")
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        theirs = ref.state_dict()
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, theirs[name]), (qtype, name)


def test_packed_stage_holds_the_file_bytes(gguf_factory):
    path = Path(gguf_factory("Q4_1", arch="llama"))
    folder = prepare_gguf(path)
    stage = load_stage(folder)  # dtype auto: the file's own types
    assert isinstance(stage.model.embed_tokens, PackedEmbedding)
    layer = stage.model.layers["0"]
    assert isinstance(layer.self_attn.q_proj, PackedLinear) and layer.self_attn.qkv_packed is not None
    assert layer.mlp.gate_up_packed is not None
    file_bytes = json.loads((folder / GGUF_SOURCE_FILE).read_text())["tensor_bytes"]
    assert file_bytes == GGUFCheckpoint(path).tensor_bytes()
    held = weight_bytes(stage)
    assert held <= 1.2 * file_bytes, (held, file_bytes)
    assert held >= 0.9 * file_bytes  # counted, not skipped


def test_stale_prepared_folders_are_pruned(gguf_factory, tmp_path, monkeypatch):
    """The cache keeps a folder per file it served; one whose file is gone or changed goes
    (once untouched for an hour), one still matching its file stays."""
    import os
    import shutil
    import time

    from wiring import model_source

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    kept, gone, changed = (tmp_path / f"{n}.gguf" for n in ("kept", "gone", "changed"))
    for f in (kept, gone, changed):
        shutil.copy(gguf_factory("Q8_0", arch="llama"), f)
    folders = [prepare_gguf(f) for f in (kept, gone, changed)]
    half = folders[0].parent / (folders[0].name + ".abc123")  # a write that died
    half.mkdir()
    gone.unlink()
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert model_source.prune_gguf_cache(folders[0].parent) == []  # all too young
    old = time.time() - 2 * model_source.STALE_AFTER_S
    for f in [*folders, half]:
        os.utime(f, (old, old))
    removed = model_source.prune_gguf_cache(folders[0].parent)
    assert sorted(removed) == sorted([folders[1], folders[2], half])
    assert folders[0].is_dir() and prepare_gguf(kept) == folders[0]
    assert prepare_gguf(changed) != folders[2]  # prepared anew for the new contents


def test_pipeline_stages_load_only_their_layers(gguf_factory):
    folder = prepare_gguf(gguf_factory("Q8_0", arch="llama", num_layers=4))
    first, last = load_stage(folder, 0, 2), load_stage(folder, 1, 2)
    assert list(first.model.layers) == ["0", "1"] and list(last.model.layers) == ["2", "3"]
    assert first.model.norm is None and last.model.norm is not None


def test_unsupported_architecture_named(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="general.architecture 'phi2' is not supported"):
        GGUFCheckpoint(path)
    with pytest.raises(CheckpointError, match="cannot be read as GGUF"):
        (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 10)
        GGUFCheckpoint(tmp_path / "bad.gguf")


def _greedy(model: str, prompts: list[list[int]], max_tokens: int, **config) -> list[list[int]]:
    from services.sampling import SamplingOptions
    from wiring.local_engine import LLM

    llm = LLM(model, **config)
    outs = llm.generate(prompts, SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_greedy_float32_equals_transformers_on_the_file(gguf_factory, qtype):
    path = gguf_factory(qtype, arch="llama")
    ref = HFReference(None, gguf_file=path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (1, 9, 40)]
    for pp in (1, 2):
        got = _greedy(path, prompts, 12, dtype="float32", pipeline_parallel_size=pp)
        for prompt, tokens in zip(prompts, got, strict=True):
            ref.compare(prompt, tokens)


def teacher_forced_top(model: str, ids: list[int], **config) -> list[int]:
    """The most likely next token at every prompt position, scored by the engine itself
    (`prompt_logprobs`: paged KV, the stage's kernels)."""
    from services.sampling import SamplingOptions
    from wiring.local_engine import LLM

    out = LLM(model, **config).generate([ids], SamplingOptions(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    return [alternatives[0][0] for _, _, _, alternatives in out.prompt_logprobs]


def test_packed_agrees_with_float32(trained_model_dir, tmp_path):
    """A trained tiny model (peaked logits) in Q8_0 and Q4_1, served packed: the top token
    under teacher forcing agrees with the float32 dequantization's on nearly every position."""
    from wiring.gguf_export import write_gguf

    tok = Tokenizer(trained_model_dir)
    ids = tok.encode(" ".join(CORPUS[:2] * 6))[:150]
    for qtype, bound in (("Q8_0", 0.97), ("Q4_1", 0.85)):
        path = str(write_gguf(trained_model_dir, tmp_path / f"trained-{qtype}.gguf", qtype))
        packed, exact = teacher_forced_top(path, ids), teacher_forced_top(path, ids, dtype="float32")
        agree = sum(a == b for a, b in zip(packed, exact, strict=True)) / len(exact)
        assert agree >= bound, (qtype, agree)


def _decode_logits(
    model, steps: int = 6, batch: int = 3, kv_dtype: torch.dtype | None = None, lengths: tuple[int, ...] = (5, 17, 33)
) -> list[torch.Tensor]:
    """Logits of a prefill then `steps` decode steps of `batch` sequences (greedy) of
    prompts of `lengths` (at most 120 tokens), the stage's runner with the native CPU
    backend (KV pools of `kv_dtype`)."""
    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from worker_svc.execution.runner import StageRunner

    runner = StageRunner(model, 64, 16, "cpu", kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(5, 500, (n,), generator=g).tolist()) for n in lengths][:batch]
    greedy = SamplingParams(temperature=0.0)
    runner.execute(
        StepPlan(
            1,
            new_seqs=tuple(
                NewSeq(i, p, len(p), 0, len(p), tuple(range(i * 8, i * 8 + 8)), greedy) for i, p in enumerate(prompts)
            ),
        )
    )
    out = []
    captured = []
    original = model.forward

    def capture(*args, **kwargs):
        logits = original(*args, **kwargs)
        captured.append(logits.clone())
        return logits

    model.forward = capture
    try:
        for k in range(steps):
            runner.execute(StepPlan(2 + k, cached_seqs=tuple(CachedSeq(i, 1, 8) for i in range(batch))))
            out.append(captured[-1])
    finally:
        del model.forward
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "BF16"])
def test_native_decode_step_equals_the_module_path(gguf_factory, model_factory, qtype, kv_dtype):
    """The one-call native decode step (worker_svc/models/fused_decode.py) computes what the layer
    modules compute, up to float rounding, for packed and bfloat16-weight stages, over
    float32 or bfloat16 KV pools (`--kv-cache-dtype`)."""
    if qtype == "BF16":
        folder, dtype = model_factory(arch="llama", intermediate_size=128), "bfloat16"
    else:
        folder, dtype = prepare_gguf(gguf_factory(qtype, arch="llama")), "auto"
    fused, plain = load_stage(folder, dtype=dtype), load_stage(folder, dtype=dtype)
    assert fused.fused_decode is not None
    plain.fused_decode = None
    for a, b in zip(_decode_logits(fused, kv_dtype=kv_dtype), _decode_logits(plain, kv_dtype=kv_dtype), strict=True):
        # the products see the same weights; the norms, SiLU and sums round differently
        # (and a rounding moves an activation's integer by one unit at most): within 1e-4 of
        # the logits' scale, the tie tolerance of the exact path. bfloat16 pools: a K/V value
        # that the two paths round differently in float32 can land on neighbouring bfloat16
        # values (2^-9 apart), so 1e-3 there
        scale = b.abs().max()
        tol = 1e-4 if kv_dtype == torch.float32 else 1e-3
        assert ((a - b).abs().max() / scale).item() < tol, ((a - b).abs().max(), scale)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
