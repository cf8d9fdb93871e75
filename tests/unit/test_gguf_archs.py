"""GGUF files of every served architecture, written by the test itself the way llama.cpp's
converter writes them (wiring/gguf_export.py), read back as the model they came from; and
tiny Q4_K_M-style files (Q4_K, Q6_K and the Q5_0/Q8_0 llama.cpp writes for rows that are
not whole super-blocks) of a Llama, a Qwen3 and a Gemma 3, served at float32, give the
greedy output of `transformers` reading the same file (the tie rule), at one and two stages.

The Q4_K_M models' shapes are chosen so that llama.cpp and transformers read the file as
one model (worker_svc/checkpoints/gguf_checkpoint.py's docstring): hidden 256 (whole super-blocks) and
intermediate 288 (ffn_down falls back), Qwen3's head size 128 and Gemma 3's 256 (=
query_pre_attn_scalar), Gemma 3's twelve layers in llama.cpp's layout (every sixth global,
window 48, shorter than most prompts).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.archs import ARCH_CONFIGS, Q4_K_M_MODELS, make_arch_model
from support.driver import DriverSeq, PipelineDriver
from support.reference import HFReference
from test_model_equivalence import NEW_TOKENS, make_prompts

from services.sampling import SamplingParams
from wiring.gguf_export import gguf_tensor_name, write_gguf
from wiring.model_source import prepare_gguf
from worker_svc.checkpoints.gguf_checkpoint import GGUFCheckpoint
from worker_svc.checkpoints.loader import load_stage
from worker_svc.execution.runner import StageRunner
from worker_svc.models.registry import ARCHITECTURES, load_config
from worker_svc.weights.quantization import weight_bytes

# what the small round-trip models change of ARCH_CONFIGS to be writable: llama.cpp's
# attention scale (1 / sqrt(head size)) and Gemma 3's layout (every sixth layer global)
ROUND_TRIP = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"query_pre_attn_scalar": 16, "num_hidden_layers": 7, "layer_types": None},
}


@pytest.fixture(scope="module")
def tokenizer_dir(model_factory):
    return model_factory(arch="llama", vocab_size=1024)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory, tokenizer_dir):
    """arch -> (the GGUF file, its prepared folder, transformers reading it), made once."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            folder = tmp_path_factory.mktemp(f"q4km-{arch}")
            source = make_arch_model(folder / "hf", arch, tokenizer_dir, **Q4_K_M_MODELS[arch])
            path = write_gguf(source, folder / f"tiny-{arch}-Q4_K_M.gguf", "Q4_K_M")
            made[arch] = (path, prepare_gguf(path), HFReference(None, gguf_file=path))
        return made[arch]

    return get


def _prompts() -> list[list[int]]:
    """Five of test_model_equivalence's prompts: 1 to 177 tokens, two past Gemma 3's window."""
    prompts = make_prompts(1024)
    return [prompts[i] for i in (0, 2, 4, 5, 6)]


def _run(folder, num_stages: int, prompts, dtype: str):
    runners = [
        StageRunner(load_stage(folder, k, num_stages, dtype=dtype), num_blocks=512, block_size=16, backend="cpu")
        for k in range(num_stages)
    ]
    driver = PipelineDriver(runners, chunk_size=None, max_batched_tokens=512, seed=num_stages)
    seqs = [DriverSeq(i, p, NEW_TOKENS, SamplingParams(temperature=0.0), arrival_step=i) for i, p in enumerate(prompts)]
    return driver.run(seqs)


@pytest.mark.parametrize("arch", list(Q4_K_M_MODELS))
def test_the_file_holds_q4_k_m_types_and_llama_cpp_metadata(q4_k_m, arch):
    import gguf

    path, _, _ = q4_k_m(arch)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(types.values())
    name = reader.fields["general.architecture"].contents()
    assert name == arch
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{name}.")}
    head_dim = Q4_K_M_MODELS[arch]["head_dim"]
    if arch == "gemma3":
        assert fields["gemma3.attention.key_length"] == fields["gemma3.attention.value_length"] == head_dim
        assert fields["gemma3.attention.sliding_window"] == 48
        assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types  # tied: the output
    if arch == "qwen3":
        assert fields["qwen3.attention.key_length"] == head_dim and "blk.0.attn_q_norm.weight" in types
    if arch == "llama":
        assert fields["llama.rope.dimension_count"] == head_dim


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", list(Q4_K_M_MODELS))
def test_float32_greedy_equals_transformers_reading_the_file(q4_k_m, arch, num_stages):
    _, folder, ref = q4_k_m(arch)
    prompts = _prompts()
    outputs = _run(folder, num_stages, prompts, "float32")
    diverged = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out) == NEW_TOKENS
        diverged += ref.compare(prompt, out).tie_divergences > 0
    assert diverged <= 1, f"{diverged} of {len(prompts)} prompts needed the tie rule"
    assert len({t for out in outputs for t in out}) >= 5, "every prompt gives the same tokens: a vacuous test"


def test_gemma3_window_is_shorter_than_the_prompts(q4_k_m):
    _, folder, ref = q4_k_m("gemma3")
    stage = load_stage(folder, dtype="float32")
    windows = [layer.self_attn.sliding_window for layer in stage.model.layers.values()]
    assert windows == ([48] * 5 + [None]) * 2
    assert ref.model.config.layer_types == list(stage.config.layer_types)
    assert sum(len(p) > 48 for p in _prompts()) >= 2


@pytest.mark.parametrize("arch", list(Q4_K_M_MODELS))
def test_at_its_own_types_a_stage_holds_at_most_1_2x_the_file(q4_k_m, arch):
    path, folder, _ = q4_k_m(arch)
    stage = load_stage(folder)  # dtype auto: the file's own types, packed
    assert {"Q4_K", "Q6_K"} <= set(stage.weight_format.removeprefix("gguf:").split("/"))
    assert weight_bytes(stage) <= 1.2 * GGUFCheckpoint(path).tensor_bytes()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_the_prepared_tokenizer_encodes_as_transformers_reads_the_file(q4_k_m, arch):
    """A gemma3 (and qwen3) file with a byte-level BPE vocabulary (`tokenizer.ggml.model`
    "gpt2", as llama.cpp writes one from a tokenizer.json) prepares, and its folder encodes as
    transformers encodes reading the file."""
    from transformers import AutoTokenizer

    from services.text.tokenizer import Tokenizer

    path, folder, _ = q4_k_m(arch)
    prepared = AutoTokenizer.from_pretrained(str(folder))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Grüße, 世界! naïve café — 🙂 x²  12345"
    ids = theirs.encode(text, add_special_tokens=False)
    assert prepared.encode(text, add_special_tokens=False) == ids and len(ids) > 5
    assert (
        Tokenizer(folder).encode(text, add_special_tokens=False) == ids
    )  # what Pagoda's services read from the folder
    assert prepared.decode(ids) == text


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_every_architecture_reads_back_as_the_checkpoint_it_was_written_from(tmp_path, tokenizer_dir, arch):
    """F32 files: the same config (but what llama.cpp writes Mistral without: its name and
    window; float32 rounding of eps and rope factors) and the same weights, bit for bit."""
    source = make_arch_model(tmp_path / "hf", arch, tokenizer_dir, **ROUND_TRIP.get(arch, {}))
    folder = prepare_gguf(write_gguf(source, tmp_path / f"{arch}.gguf", "F32"))
    want, got = load_config(source), load_config(folder)
    skip = {"source", "rms_norm_eps", "rope"} | (
        {"architecture", "model_type", "sliding_window"} if arch == "mistral" else set()
    )
    for field in dataclasses.fields(want):
        if field.name not in skip:
            assert getattr(got, field.name) == getattr(want, field.name), field.name
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    assert got.rope.rope_type == want.rope.rope_type and got.rope.factor == want.rope.factor
    assert got.rope.long_factor == pytest.approx(want.rope.long_factor)
    ours, theirs = load_stage(source, dtype="float32").state_dict(), load_stage(folder, dtype="float32").state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_tensor_names_agree_with_gguf_py():
    """Each architecture's names, read backwards, are the ones gguf-py's name map gives."""
    import gguf

    arches = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    for arch in ARCHITECTURES:
        if not arch.gguf_names + arch.gguf_expert_names:  # gpt-oss: not read from GGUF here
            continue
        name = (arch.gguf_names + arch.gguf_expert_names)[0]  # Mixtral: a llama file with experts
        if name not in arches:  # mistral: written as llama
            continue
        names = gguf.get_tensor_name_map(arches[name], 4)
        for hf in arch.gguf_layer_tensors.values():
            module, leaf = hf.rsplit(".", 1)
            assert (
                gguf_tensor_name(f"model.layers.3.{hf}", arch.gguf_layer_tensors)
                == f"{names.get_name(f'model.layers.3.{module}')}.{leaf}"
            ), (name, hf)


def test_what_a_gguf_file_cannot_say_is_refused(tmp_path, tokenizer_dir):
    gemma3 = make_arch_model(tmp_path / "g3", "gemma3", tokenizer_dir)  # layers [S, S, F, S, S, F]
    with pytest.raises(ValueError, match="layer_types"):
        write_gguf(gemma3, tmp_path / "g3.gguf", "F32")
    gemma2 = make_arch_model(tmp_path / "g2", "gemma2", tokenizer_dir)  # query_pre_attn_scalar 24, head 16
    with pytest.raises(ValueError, match="query_pre_attn_scalar 24"):
        write_gguf(gemma2, tmp_path / "g2.gguf", "F32")
    yarn = make_arch_model(
        tmp_path / "q2",
        "qwen2",
        tokenizer_dir,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 512,
        },
    )
    with pytest.raises(ValueError, match="yarn"):
        write_gguf(yarn, tmp_path / "q2.gguf", "F32")


TEXTS = [
    "Grüße, 世界! naïve café — 🙂 x²  12345",
    "  two leading spaces\nand a newline\ttab",
    "Привет, мир! こんにちは。",
    "def f(x):\n    return x ** 2  # ²³",
    "ǅ ẞ ﬁ ⅔ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍💻",
    "",
]


def test_a_gemma3_file_with_a_sentencepiece_vocabulary_tokenizes_as_its_source(tmp_path):
    """Real Gemma 3 GGUF downloads carry a SentencePiece-style BPE (`tokenizer.ggml.model`
    "llama": pieces, scores, byte pieces for byte fallback, no merges). A file written that
    way from a Gemma tokenizer made here reads back (transformers' reader, then Pagoda's own
    tokenizer over the prepared folder) encoding and decoding a unicode corpus as the source,
    BOS included, and the model's chat template with it."""
    import gguf
    from support.spm import make_gemma_tokenizer
    from transformers import AutoTokenizer

    from services.text.tokenizer import Tokenizer

    spm = make_gemma_tokenizer(tmp_path / "tok")
    source = make_arch_model(
        tmp_path / "hf", "gemma3", spm, **ROUND_TRIP["gemma3"], bos_token_id=2, eos_token_id=1, pad_token_id=0
    )
    path = write_gguf(source, tmp_path / "g3.gguf", "Q8_0")
    fields = gguf.GGUFReader(path).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    assert "tokenizer.ggml.merges" not in fields
    folder = prepare_gguf(path)
    want = AutoTokenizer.from_pretrained(spm)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer(folder)
    for text in TEXTS:
        ids = want.encode(text)
        assert ids[:1] == [2]  # <bos>
        assert theirs.encode(text) == ids, text
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == want.decode(ids, skip_special_tokens=True) == text
    assert any(want.convert_ids_to_tokens(i).startswith("<0x") for i in want.encode(TEXTS[4])), "no byte fallback"
    messages = [{"role": "user", "content": "Grüße 🙂"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
