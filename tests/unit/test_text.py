"""services.text: tokenizer and chat templates as transformers has them, incremental
detokenization, stop strings, and the per-choice output processor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, processors
from transformers import AutoTokenizer

from services.text import (
    ChatTemplateError,
    IncrementalDetokenizer,
    StopMatch,
    StopStringMatcher,
    TextOutputProcessor,
    Tokenizer,
)
from wiring.tiny_model import BOS_TOKEN_ID, EOS_TOKEN_ID, IM_END_TOKEN_ID, IM_START_TOKEN_ID, PAD_TOKEN_ID

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
)
ARCHS = ("llama", "qwen2")
TEXTS = [
    "",
    "Hello world",
    " leading space",
    "trailing  ",
    "a\n\n b  c\r\n\tx",
    "café naïve résumé",
    "🎉🚀 emoji 👩‍👩‍👧",
    "日本語のテキスト",
    "한국어",
    "e\u0301 (decomposed)",
    "<|bos|>with<|im_end|> special <|im_start|>tokens",
    "<|im_end|>",
    "<|not special|>",
    "def f(x):\n    return x ** 2  # comment",
    "1234567890 3.14159",
    "\ufffd literal",
]
MULTIBYTE_TEXTS = ["café 🎉 日本語", "👩‍👩‍👧‍👦 family", "naïve Ωμέγα 中文 😀😃", "ñ" * 9, "€𝄞"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 日本 🎉"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "part one, "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "part two"},
            ],
        }
    ],
    [{"role": "user", "content": "<|im_end|> injected"}],
]


def _copy_tokenizer(src: str | Path, dst: Path, *, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """The tokenizer files of a model, into `dst`, with tokenizer_config.json changes."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name not in drop and (Path(src) / name).is_file() and Path(src) != dst:
            shutil.copy(Path(src) / name, dst / name)
    if config is not None:
        path = dst / "tokenizer_config.json"
        merged = {**json.loads(path.read_text()), **config}
        path.write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    return dst


@pytest.fixture(scope="module")
def model_dirs(model_factory) -> dict[str, str]:
    return {arch: model_factory(arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def toks(model_dirs) -> dict[str, Tokenizer]:
    return {arch: Tokenizer(path) for arch, path in model_dirs.items()}


@pytest.fixture(scope="module")
def hf(model_dirs) -> dict:
    return {arch: AutoTokenizer.from_pretrained(path) for arch, path in model_dirs.items()}


@pytest.fixture(scope="module")
def llama2_dir(tmp_path_factory) -> Path:
    """A SentencePiece-style checkpoint as Llama 2 has one: Metaspace normalizer, byte
    fallback, a decoder that strips the first space, and a post-processor that adds BOS."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("▁", "a"),
        ("▁", "o"),
        ("▁o", "n"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("l", "d"),
        ("▁wor", "ld"),
        ("é", "t"),
    ]
    for piece in [
        "▁",
        "t",
        "h",
        "e",
        "a",
        "o",
        "n",
        "w",
        "r",
        "l",
        "d",
        "s",
        "i",
        "é",
        "!",
        *(a + b for a, b in merges),
    ]:
        vocab.setdefault(piece, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    path = tmp_path_factory.mktemp("llama2")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "clean_up_tokenization_spaces": False,
                "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
            }
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return path


# --- no torch ------------------------------------------------------------------------------


def test_import_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys, services.text; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, f'services.text imported {bad}'"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )


# --- Tokenizer: files, ids, encode and decode ----------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_special_ids_and_vocab(arch, toks, hf) -> None:
    tok, ref = toks[arch], hf[arch]
    assert tok.bos_token_id == ref.bos_token_id == BOS_TOKEN_ID
    assert tok.pad_token_id == ref.pad_token_id == PAD_TOKEN_ID
    # tokenizer_config's eos first, then generation_config's [eos, im_end], each once
    assert tok.eos_token_ids == (EOS_TOKEN_ID, IM_END_TOKEN_ID)
    assert tok.vocab_size == len(ref) == 512
    assert (
        tok.special_token_ids
        == frozenset(range(5))
        == frozenset(ref.all_special_ids) | {IM_START_TOKEN_ID, IM_END_TOKEN_ID}
    )
    assert tok.special_tokens_map == ref.special_tokens_map


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(arch, add_special_tokens, toks, hf) -> None:
    tok, ref = toks[arch], hf[arch]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == ref.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    assert tok.encode("<|bos|>hi<|im_end|>") == [BOS_TOKEN_ID, *tok.encode("hi"), IM_END_TOKEN_ID]
    assert tok.decode([BOS_TOKEN_ID, *tok.encode("hi"), IM_END_TOKEN_ID]) == "hi"


@settings(max_examples=40)
@given(text=st.text(max_size=40), ids=st.lists(st.integers(0, 511), max_size=30), skip=st.booleans())
def test_random_text_and_ids_match_transformers(text, ids, skip, toks, hf) -> None:
    for arch in ARCHS:
        assert toks[arch].encode(text) == hf[arch].encode(text)
        assert toks[arch].decode(ids, skip) == hf[arch].decode(ids, skip_special_tokens=skip)


def test_sentencepiece_style_tokenizer_matches_transformers(llama2_dir) -> None:
    tok, ref = Tokenizer(llama2_dir), AutoTokenizer.from_pretrained(llama2_dir)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    for text in ["the world", " on a wet", "été 日本 🎉!", "<s>the", ""]:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), text
            assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("the")[0] == 1  # the post-processor adds BOS


def test_add_bos_token_is_used_only_without_a_post_processor(model_dirs, tmp_path) -> None:
    path = _copy_tokenizer(model_dirs["llama"], tmp_path / "m", config={"add_bos_token": True})
    assert Tokenizer(path).encode("hi") == Tokenizer(model_dirs["llama"]).encode("hi")
    raw = json.loads((path / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(raw))
    # transformers 5 would add nothing here; transformers 4's Llama tokenizer added the BOS.
    ids = Tokenizer(path).encode("hi")
    assert ids[0] == BOS_TOKEN_ID and ids[1:] == Tokenizer(path).encode("hi", False)


def test_tokens_declared_only_in_the_config_are_added(model_dirs, tmp_path) -> None:
    extra = {
        "content": "<|tool|>",
        "special": True,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }
    path = _copy_tokenizer(model_dirs["llama"], tmp_path / "m", config={"added_tokens_decoder": {"512": extra}})
    tok, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert tok.token_to_id("<|tool|>") == ref.convert_tokens_to_ids("<|tool|>") == 512
    assert tok.encode("a<|tool|>b") == ref.encode("a<|tool|>b")
    assert tok.vocab_size == len(ref) == 513 and 512 in tok.special_token_ids


def test_eos_ids_union_and_spellings(model_dirs, tmp_path) -> None:
    path = _copy_tokenizer(
        model_dirs["llama"],
        tmp_path / "m",
        drop=("special_tokens_map.json",),
        config={
            "eos_token": {
                "__type": "AddedToken",
                "content": "<|im_end|>",
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
        },
    )
    assert AutoTokenizer.from_pretrained(path).eos_token_id == IM_END_TOKEN_ID
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    assert Tokenizer(path).eos_token_ids == (IM_END_TOKEN_ID, PAD_TOKEN_ID, EOS_TOKEN_ID)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json.*eos_token_id"):
        Tokenizer(path)


def test_only_tokenizer_json_is_required(model_dirs, tmp_path) -> None:
    path = _copy_tokenizer(
        model_dirs["llama"], tmp_path / "m", drop=("tokenizer_config.json", "generation_config.json", "config.json")
    )
    tok, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_ids == (EOS_TOKEN_ID,)  # from special_tokens_map.json
    assert tok.encode(TEXTS[7]) == ref.encode(TEXTS[7])
    with pytest.raises(ValueError, match="has no chat template"):
        tok.encode_chat(CONVERSATIONS[0])
    (path / "special_tokens_map.json").unlink()
    assert Tokenizer(path).eos_token_ids == () and Tokenizer(path).bos_token_id is None


@pytest.mark.parametrize(
    "case, match",
    [
        ("no_dir", "not a directory"),
        ("no_tokenizer_json", r"tokenizer\.json: missing"),
        ("bad_tokenizer_json", r"tokenizer\.json: not a valid tokenizer file"),
        ("bad_config_json", r"tokenizer_config\.json: not valid JSON"),
        ("config_not_object", r"tokenizer_config\.json: must hold a JSON object"),
        ("bad_chat_template", r"tokenizer_config\.json: chat_template must be"),
        ("bad_token", r"tokenizer_config\.json: bos_token must be"),
    ],
)
def test_invalid_files_name_the_file(case, match, model_dirs, tmp_path) -> None:
    path = _copy_tokenizer(model_dirs["llama"], tmp_path / "m")
    if case == "no_dir":
        path = tmp_path / "nowhere"
    elif case == "no_tokenizer_json":
        (path / "tokenizer.json").unlink()
    elif case == "bad_tokenizer_json":
        (path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    elif case == "bad_config_json":
        (path / "tokenizer_config.json").write_text("{not json")
    elif case == "config_not_object":
        (path / "tokenizer_config.json").write_text("[]")
    elif case == "bad_chat_template":
        _copy_tokenizer(path, path, config={"chat_template": 7})
    elif case == "bad_token":
        _copy_tokenizer(path, path, config={"bos_token": 7})
    with pytest.raises(ValueError, match=match):
        Tokenizer(path)


# --- chat templates ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(arch, add_generation_prompt, toks, hf) -> None:
    tok, ref = toks[arch], hf[arch]
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tok.encode_chat(messages, add_generation_prompt) == ref.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
        )
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


FEATURE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' and not loop.first %}
        {{- raise_exception('System message must come first, not ' ~ loop.index) }}
    {%- endif %}
    {%- if message.role == 'skip' %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
<|im_start|>{{ message.role }}
    {% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{% generation %}{{ message.content | default('NO CONTENT') }}{% endgeneration %}
    {%- if message.tool_calls is defined %} CALLS {{ message.tool_calls | tojson }}{% endif %}
<|im_end|>
{% endfor %}
{%- if tools %}TOOLS {{ tools | tojson }}
{% endif %}
{%- if extra is defined %}EXTRA {{ extra | tojson(indent=2, sort_keys=True) }}
{% endif %}
{%- set d = dict(a=1) %}count={{ ns.count }} d={{ d | tojson }} year={{ strftime_now('%Y') }}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_template_features_match_transformers(model_dirs, tmp_path) -> None:
    path = _copy_tokenizer(model_dirs["llama"], tmp_path / "m", config={"chat_template": FEATURE_TEMPLATE})
    tok, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": "<b>&'\"</b> é"},
        {"role": "skip", "content": "dropped"},
        {"role": "user", "content": "weather?", "name": None},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "think",
            "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Zürich"}}}],
        },
    ]
    tools = [{"type": "function", "function": {"name": "get", "description": "<x> ü"}}]
    kwargs = {"extra": {"b": [1, 2], "a": "ß"}}
    for add in (True, False):
        assert tok.apply_chat_template(messages, add, tools, **kwargs) == ref.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add, **kwargs
        )
    text = tok.apply_chat_template(messages, tools=tools, **kwargs)
    assert "NO CONTENT" in text and "<think>think</think>" in text and "Zürich" in text
    assert '"description": "<x> ü"' in text  # tojson escapes neither HTML nor non-ASCII
    with pytest.raises(ChatTemplateError, match="System message must come first, not 2"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_encode_chat_never_doubles_bos(llama2_dir, tmp_path) -> None:
    tok = Tokenizer(llama2_dir)
    messages = [{"role": "user", "content": "the world"}]
    # The template does not write the BOS: encode_chat adds the one encode adds.
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids[1] != 1 and ids[1:] == tok.encode_chat(messages, add_special_tokens=False)
    # A template that writes it: only that one, as transformers tokenizes it.
    path = _copy_tokenizer(
        llama2_dir,
        tmp_path / "m",
        config={"chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"},
    )
    tok, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    ids = tok.encode_chat(messages)
    assert ids[:2].count(1) == 1
    assert ids == ref.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tok.encode_chat(messages, add_special_tokens=True)[:2] == [1, 1]  # asked for it


def test_chat_template_files_and_named_templates(model_dirs, tmp_path) -> None:
    named = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ tools | length if tools else 0 }}"},
    ]
    path = _copy_tokenizer(model_dirs["llama"], tmp_path / "m", config={"chat_template": named})
    tok, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "x"}]
    for tools in (None, [{"name": "f"}]):
        assert tok.apply_chat_template(messages, tools=tools) == ref.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    assert tok.apply_chat_template(messages, chat_template="tool_use") == "T0"
    assert tok.apply_chat_template(messages, chat_template="I{{ 1 + 1 }}") == "I2"
    with pytest.raises(ValueError, match=r"'nope' names none of the model's templates"):
        tok.apply_chat_template(messages, chat_template="nope")
    assert tok.chat_template == {item["name"]: item["template"] for item in named}

    # transformers 5's files win over tokenizer_config.json.
    (path / "chat_template.jinja").write_text("J{{ messages | length }}")
    (path / "chat_templates").mkdir()
    (path / "chat_templates" / "extra.jinja").write_text("E")
    tok, ref = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False) == "J1"
    assert tok.apply_chat_template(messages, chat_template="extra") == "E"
    assert tok.apply_chat_template(messages, tools=[{"name": "f"}]) == "J1"  # no tool_use now


def test_chat_errors(model_dirs, tmp_path, toks) -> None:
    path = _copy_tokenizer(model_dirs["llama"], tmp_path / "none", config={"chat_template": None})
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer(path).apply_chat_template([{"role": "user", "content": "x"}])
    bad = _copy_tokenizer(model_dirs["llama"], tmp_path / "bad", config={"chat_template": "{% if"})
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json: chat template does not"):
        Tokenizer(bad).apply_chat_template([{"role": "user", "content": "x"}])
    (bad / "chat_template.jinja").write_text("{{ oops(")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: chat template does not"):
        Tokenizer(bad).apply_chat_template([{"role": "user", "content": "x"}])
    tok = toks["llama"]
    for messages, match in [([], "empty"), ("hi", "must be a list"), (["hi"], r"messages\[0\]")]:
        with pytest.raises(ValueError, match=match):
            tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[print])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_x=1) %}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ strftime_now.__globals__.sys }}{{ raise_exception(1 / 0) }}",
    ],
)
def test_templates_run_in_a_sandbox(template, toks) -> None:
    with pytest.raises(ChatTemplateError):
        toks["llama"].apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)
    # Unsafe attributes read as undefined: nothing leaks into the prompt.
    assert (
        toks["llama"].apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template="{{ raise_exception.__globals__ }}{{ messages.__class__ }}",
        )
        == ""
    )


# --- incremental detokenization ------------------------------------------------------------


def _detokenize(tok, chunks, *, skip_special_tokens=True, prompt_token_ids=()) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids)
    pieces = [detok.push(chunk) for chunk in chunks]
    return [*pieces, detok.flush()]


@settings(max_examples=50)
@given(data=st.data(), ids=st.lists(st.integers(0, 511), max_size=48), skip=st.booleans(), arch=st.sampled_from(ARCHS))
def test_random_tokens_detokenize_to_the_full_decode(data, ids, skip, arch, toks) -> None:
    tok = toks[arch]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    pieces = _detokenize(tok, chunks, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in piece for piece in pieces)


@settings(max_examples=40)
@given(text=st.text(st.characters(exclude_characters="\ufffd"), max_size=30), arch=st.sampled_from(ARCHS))
def test_text_one_token_at_a_time_never_splits_a_character(text, arch, toks) -> None:
    tok = toks[arch]
    ids = tok.encode(text)
    pieces = _detokenize(tok, [[i] for i in ids])
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)
    if arch == "llama":  # no normalizer: the text itself comes back
        assert "".join(pieces) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_multibyte_characters_one_token_at_a_time(arch, toks) -> None:
    tok = toks[arch]
    for text in MULTIBYTE_TEXTS:
        ids = tok.encode(text)
        assert len(ids) > len(text) / 2  # many characters span several tokens
        pieces = _detokenize(tok, [[i] for i in ids])
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)
        # every piece is made of whole characters of the text, in order
        assert all(piece == "" or piece in text for piece in pieces)
    # 🎉 is four byte tokens: the first three release nothing
    ids = tok.encode("🎉")
    assert len(ids) == 4 and _detokenize(tok, [[i] for i in ids]) == ["", "", "", "🎉", ""]


def test_special_tokens_and_spaces(toks) -> None:
    tok = toks["llama"]
    ids = [*tok.encode(" a b"), IM_END_TOKEN_ID, *tok.encode("  c\n"), EOS_TOKEN_ID]
    for skip in (True, False):
        pieces = _detokenize(tok, [[i] for i in ids], skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(_detokenize(tok, [ids])) == " a b  c\n"
    assert "".join(_detokenize(tok, [ids], skip_special_tokens=False)) == (" a b<|im_end|>  c\n<|eos|>")


def test_prompt_context(toks, llama2_dir) -> None:
    tok = toks["llama"]
    prompt = tok.encode("Say: ")
    out = tok.encode("hello 🎉")
    assert "".join(_detokenize(tok, [[i] for i in out], prompt_token_ids=prompt)) == "hello 🎉"
    # A prompt that ends inside a character: the output decodes on its own.
    cut = tok.encode("日")
    assert "".join(_detokenize(tok, [cut[1:]], prompt_token_ids=cut[:1])) == tok.decode(cut[1:])
    # SentencePiece drops the space of a text's first token; after the prompt it is kept.
    sp = Tokenizer(llama2_dir)
    the, world = sp.encode("the", False), sp.encode("the world", False)[1:]
    assert len(the) == 1 and sp.id_to_token(world[0]) == "▁world"
    assert "".join(_detokenize(sp, [[i] for i in world])) == sp.decode(world) == "world"
    assert "".join(_detokenize(sp, [[i] for i in world], prompt_token_ids=[1, *the])) == " world"


@settings(max_examples=40)
@given(text=st.text(st.sampled_from("the world on a wet été日本🎉!s i"), max_size=30))
def test_sentencepiece_byte_fallback_detokenizes_whole_characters(text, llama2_dir) -> None:
    tok = Tokenizer(llama2_dir)
    ids = tok.encode(text)
    pieces = _detokenize(tok, [[i] for i in ids])
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_invalid_bytes_are_released_after_a_bound(toks) -> None:
    tok = toks["llama"]
    continuation = next(
        i for i in range(5, 512) if tok.decode([i, i]) == "\ufffd\ufffd" and tok.decode([i]) == "\ufffd"
    )
    ids = [continuation] * 100
    pieces = _detokenize(tok, [[i] for i in ids])
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * 100
    assert "".join(pieces[:99])  # released before the end, not all held until flush


# --- stop strings --------------------------------------------------------------------------


def _run_stops(stops, deltas, **kwargs) -> tuple[list[str], str | None, str]:
    matcher = StopStringMatcher(stops, **kwargs)
    released, matched = [], None
    for delta in deltas:
        text, stop = matcher.push(delta)
        released.append(text)
        if stop is not None:
            matched = stop
    return released, matched, matcher.finish()


@pytest.mark.parametrize(
    "stops, deltas, released, matched, rest",
    [
        # a stop spanning two deltas
        (["END"], ["abc E", "ND more"], ["abc ", ""], "END", ""),
        # ... three deltas
        (["STOP"], ["x S", "T", "OP y"], ["x ", "", ""], "STOP", ""),
        # a held-back prefix that does not become a stop is released
        (["END"], ["a EN", "x"], ["a ", "ENx"], None, ""),
        (["END"], ["a EN"], ["a "], None, "EN"),
        # overlapping prefixes: "ab" completes first
        (["abc", "ab"], ["xa", "bc"], ["x", ""], "ab", ""),
        (["abc", "ab"], ["xabc"], ["x"], "ab", ""),
        # the stop whose end comes first wins, whatever the order given
        (["bcd", "abcde"], ["abcdef"], ["a"], "bcd", ""),
        (["world", "hello"], ["say hello world"], ["say "], "hello", ""),
        # overlapping occurrences of one stop's prefix
        (["aab"], ["aa", "a", "ab"], ["", "a", "a"], "aab", ""),
        # unicode
        (["日本"], ["こんにちは日", "本語"], ["こんにちは", ""], "日本", ""),
        (["🎉!"], ["a🎉", "🎉", "!b"], ["a", "🎉", ""], "🎉!", ""),
        # after a match nothing more is released
        (["x"], ["axb", "cd"], ["a", ""], "x", ""),
        # no stop strings: everything passes
        ([], ["ab", "c"], ["ab", "c"], None, ""),
    ],
)
def test_stop_strings(stops, deltas, released, matched, rest) -> None:
    assert _run_stops(stops, deltas) == (released, matched, rest)


def test_stop_string_included_on_request() -> None:
    assert _run_stops(["END"], ["a E", "ND b"], include_stop_str_in_output=True) == (["a ", "END"], "END", "")


@pytest.mark.parametrize("stops", [[""], ["ok", ""], [None]])
def test_empty_stop_strings_are_refused(stops) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(stops)


@settings(max_examples=60)
@given(
    data=st.data(),
    text=st.text("abcé🎉", max_size=24),
    stops=st.lists(st.text("abcé🎉", min_size=1, max_size=4), max_size=3),
)
def test_stop_result_does_not_depend_on_how_text_is_split(data, text, stops) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    released, matched, rest = _run_stops(stops, deltas)
    # Reference: read character by character until some stop ends the text read so far.
    expected, expected_stop = text, None
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            expected_stop = max(ending, key=len)
            expected = text[: end - len(expected_stop)]
            break
    assert (matched, "".join(released) + rest) == (expected_stop, expected)


# --- the output processor ------------------------------------------------------------------


def test_output_processor_stops_on_a_string_spanning_tokens(toks) -> None:
    tok = toks["llama"]
    ids = tok.encode("The answer is 42. Done!")
    proc = TextOutputProcessor(tok, stop=["42. D"])
    deltas = []
    for i in ids:
        delta = proc.push([i])
        deltas.append(delta)
        if delta.finished:
            break
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert deltas[-1].stop_reason == "42. D"
    assert proc.text == "".join(d.text for d in deltas) == "The answer is "
    assert len(proc.token_ids) < len(ids)  # finished before the last token
    assert proc.push(tok.encode(" more")).text == ""  # tokens in flight are ignored
    assert proc.finish(stop_token_id=EOS_TOKEN_ID) == deltas[-1]._replace(text="")
    assert proc.finish_reason == "stop" and proc.stop_reason == "42. D"


@pytest.mark.parametrize("skip", [True, False])
def test_output_processor_finish_reasons(skip, toks) -> None:
    tok = toks["llama"]
    body = tok.encode("Hello 🎉 world")
    proc = TextOutputProcessor(tok, stop=["zzz"], skip_special_tokens=skip)
    pieces = [proc.push(body[:5]).text, proc.push(body[5:-1]).text]
    last = proc.finish(body[-1:] + [EOS_TOKEN_ID], stop_token_id=EOS_TOKEN_ID)
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", EOS_TOKEN_ID)
    assert "".join(pieces) + last.text == proc.text == "Hello 🎉 world"  # the eos text left out
    assert proc.token_ids == [*body, EOS_TOKEN_ID]

    proc = TextOutputProcessor(tok, stop=["rld!"])
    proc.push(body)
    last = proc.finish()
    assert (last.finish_reason, last.stop_reason) == ("length", None)
    assert proc.text == "Hello 🎉 world"  # the held-back "rld" released at the end


def test_output_processor_stop_token_text_and_stop_in_final_tokens(toks) -> None:
    tok = toks["llama"]
    period = tok.encode(".")
    assert len(period) == 1
    proc = TextOutputProcessor(tok)
    proc.push(tok.encode("One"))
    assert proc.finish(period, stop_token_id=period[0]).text == ""
    assert proc.text == "One"
    proc = TextOutputProcessor(tok, include_stop_str_in_output=True)
    proc.push(tok.encode("One"))
    assert proc.finish(period, stop_token_id=period[0]).text == "."
    # A stop string completed by the final tokens wins over length.
    proc = TextOutputProcessor(tok, stop=["ne t"])
    proc.push(tok.encode("One"))
    last = proc.finish(tok.encode(" two"))
    assert (last.text, last.finish_reason, last.stop_reason) == ("", "stop", "ne t")
    assert proc.text == "O"  # "ne" was held back since it may start the stop


def test_a_long_stop_string_costs_memory_linear_in_its_length():
    """Issue 16: every prefix of every stop string was kept (quadratic): one of 200,000
    characters took gigabytes. The automaton holds a few entries per character."""
    import tracemalloc

    tracemalloc.start()
    try:
        matcher = StopStringMatcher(["ab" * 100_000])
        out = [matcher.push("ab" * 500), matcher.push("x"), matcher.push("ab" * 99_999), matcher.push("ab")]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * 200_000  # bytes: 4 per character for the automaton, and the texts
    assert out[0] == StopMatch("", None) and out[1].text == "ab" * 500 + "x"
    assert out[3] == StopMatch("", "ab" * 100_000)  # matched at its last character
