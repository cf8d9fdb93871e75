"""Real chat templates (tests/fixtures/chat_templates/, sources in its README) render through the
gateway exactly as `transformers`' `apply_chat_template` renders them: the same text and the same
token ids, for Llama 3.1, Mistral v0.3, Qwen2.5, Qwen3, Gemma 2, Gemma 3 and Phi-3.

Each family gets the tiny byte-level tokenizer (`model_factory(arch="llama", vocab_size=1024)`)
with its template, its named special tokens (bos, eos) and the tokens its template writes added,
so that ids are meaningful: `<start_of_turn>` is one id, as in the real vocabulary. Families whose
real tokenizer adds a BOS to every encode get a post-processor that does too, so that a template
writing `{{ bos_token }}` itself shows whether the gateway doubles it. Qwen and Phi-3 get none
(Qwen has no BOS); where a tokenizer adds a BOS that the template never writes, Pagoda adds it
once and transformers not at all (`test_a_bos_the_template_never_writes_is_added_once`).

The gateway side is `validation.chat_prompt`, the function a /v1/chat/completions request goes
through, fed an OpenAI request body (tool-call arguments as JSON text, `content: null` beside
tool calls); the reference gets the same conversation as the template expects it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoTokenizer

from gateway.errors import ApiError
from gateway.parsers.reasoning import reasoning_parser
from gateway.protocol import ChatCompletionRequest
from gateway.validation import ModelLimits, chat_prompt
from services.text import Tokenizer
from services.text.chat import reads_content_parts

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


@dataclass(frozen=True)
class Family:
    name: str  # tests/fixtures/chat_templates/<name>.jinja
    bos: str | None
    eos: str
    special: tuple[str, ...]  # added as special tokens (bos and eos among them)
    plain: tuple[str, ...] = ()  # added as ordinary tokens, as the real vocabulary has them
    adds_bos: bool = False  # the real tokenizer's post-processor puts a BOS before every encode
    tools: bool = False  # the template renders tools and tool calls


FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama3",
            "<|begin_of_text|>",
            "<|eot_id|>",
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            adds_bos=True,
            tools=True,
        ),
        Family(
            "mistral",
            "<s>",
            "</s>",
            (
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            adds_bos=True,
            tools=True,
        ),
        Family(
            "qwen2",
            None,
            "<|im_end|>",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            ("<tool_call>", "</tool_call>"),
            tools=True,
        ),
        Family(
            "qwen3",
            None,
            "<|im_end|>",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
            tools=True,
        ),
        Family("gemma2", "<bos>", "<eos>", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), adds_bos=True),
        Family(
            "gemma3",
            "<bos>",
            "<eos>",
            ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
            adds_bos=True,
        ),
        Family(
            "phi3",
            "<s>",
            "<|endoftext|>",
            ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        ),
    )
}


def _family_dir(base: str, family: Family, root: Path) -> Path:
    """The tiny tokenizer as `family`'s: its tokens added to tokenizer.json, its template in
    chat_template.jinja and tokenizer_config.json, its bos and eos named."""
    path = root / family.name
    path.mkdir()
    backend = BackendTokenizer.from_file(str(Path(base) / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    if family.adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, backend.token_to_id(family.bos))],
        )
    backend.save(str(path / "tokenizer.json"))
    template = (TEMPLATES / f"{family.name}.jinja").read_text(encoding="utf-8")
    config = json.loads((Path(base) / "tokenizer_config.json").read_text())
    config.update(
        bos_token=family.bos,
        eos_token=family.eos,
        chat_template=template,
        additional_special_tokens=list(family.special),
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizers(model_factory, tmp_path_factory):
    """name -> (Pagoda's Tokenizer, transformers' tokenizer) of each family's folder."""
    base = model_factory(arch="llama", vocab_size=1024)
    root = tmp_path_factory.mktemp("chat-templates")
    made = {}
    for family in FAMILIES.values():
        path = _family_dir(base, family, root)
        made[family.name] = (Tokenizer(path), AutoTokenizer.from_pretrained(path))
    return made


# --- conversations, as a chat template sees them -------------------------------------------

SYSTEM = {"role": "system", "content": "You are a terse assistant. Réponds en français si besoin."}
USER = {"role": "user", "content": "  Grüße! What is 2+2? 世界 🌍  "}
REPLY = {"role": "assistant", "content": "4. Ça va ✓"}
USER_2 = {"role": "user", "content": "And times three?\nAnswer in one line."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, in °C.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call12345", "content": '{"temp_c": 21, "sky": "☀"}'}
ASK_WEATHER = {"role": "user", "content": "Weather in Zürich?"}
CALLING = {"role": "assistant", "content": "", "tool_calls": [CALL]}

PLAIN = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, REPLY, USER_2],
    "no_system_multi_turn": [USER, REPLY, USER_2],
}
# (messages, tools): a call and its result, then the model answers
TOOL_CONVERSATIONS = {
    "tool_call_and_result": ([SYSTEM, ASK_WEATHER, CALLING, TOOL_RESULT], [WEATHER_TOOL]),
    "tools_offered": ([ASK_WEATHER], [WEATHER_TOOL]),
}


def _cases() -> list[tuple[str, str, list[dict], list[dict] | None, dict[str, Any], bool]]:
    """(family, case, messages, tools, chat_template_kwargs, add_generation_prompt)."""
    cases = []
    for name, family in FAMILIES.items():
        plain = dict(PLAIN)
        if name == "gemma2":  # its template refuses a system message (test below)
            plain = {k: v for k, v in plain.items() if v[0]["role"] != "system"}
        for case, messages in plain.items():
            cases.append((name, case, messages, None, {}, True))
        cases.append((name, "ends_with_reply", plain["no_system_multi_turn"][:2], None, {}, False))
        if family.tools:
            for case, (messages, tools) in TOOL_CONVERSATIONS.items():
                cases.append((name, case, messages, tools, {}, True))
    return cases


QWEN3_CASES = [
    ("thinking_off", [SYSTEM, USER], None, {"enable_thinking": False}),
    ("thinking_on", [SYSTEM, USER], None, {"enable_thinking": True}),
    ("thinking_off_multi_turn", [USER, REPLY, USER_2], None, {"enable_thinking": False}),
    # an earlier answer's reasoning, written in its content, is dropped before the last question
    (
        "old_reasoning_dropped",
        [USER, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, USER_2],
        None,
        {},
    ),
    # after the last question the reasoning of a tool-calling turn is kept, from reasoning_content
    (
        "reasoning_content_kept",
        [ASK_WEATHER, {**CALLING, "reasoning_content": "I need the tool."}, TOOL_RESULT],
        [WEATHER_TOOL],
        {"enable_thinking": True},
    ),
    (
        "reasoning_content_final",
        [
            ASK_WEATHER,
            {**CALLING, "reasoning_content": "Need the tool."},
            TOOL_RESULT,
            {"role": "assistant", "content": "21 °C, sunny.", "reasoning_content": "It said 21."},
        ],
        [WEATHER_TOOL],
        {},
    ),
]


def _request_body(
    messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any], add_generation_prompt: bool
) -> dict[str, Any]:
    """The conversation as an OpenAI client sends it: each call's arguments as JSON text, a
    tool-calling message's content null."""
    sent = []
    for message in messages:
        if "tool_calls" in message:
            message = {
                **message,
                "content": message["content"] or None,
                "tool_calls": [
                    {
                        **call,
                        "function": {
                            **call["function"],
                            "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False),
                        },
                    }
                    for call in message["tool_calls"]
                ],
            }
        sent.append(message)
    body: dict[str, Any] = {"model": "tiny", "messages": sent, "add_generation_prompt": add_generation_prompt}
    if tools:
        body["tools"] = tools
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def _gateway_ids(tok: Tokenizer, body: dict[str, Any]) -> list[int]:
    req = ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))
    return chat_prompt(req, tok, ModelLimits("tiny", 1 << 16, tok.vocab_size))


def _reference(hf, messages, tools, kwargs, add_generation_prompt) -> tuple[str, list[int]]:
    common = dict(tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    text = hf.apply_chat_template(messages, tokenize=False, **common)
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **common)
    return text, list(ids)


def _check(tokenizers, name, messages, tools, kwargs, add_generation_prompt) -> str:
    tok, hf = tokenizers[name]
    text, ids = _reference(hf, messages, tools, kwargs, add_generation_prompt)
    got = _gateway_ids(tok, _request_body(messages, tools, kwargs, add_generation_prompt))
    assert tok.decode(got, skip_special_tokens=False) == text
    assert got == ids
    return text


@pytest.mark.parametrize(
    "name,case,messages,tools,kwargs,add_generation_prompt", _cases(), ids=[f"{c[0]}-{c[1]}" for c in _cases()]
)
def test_the_gateway_renders_as_transformers(tokenizers, name, case, messages, tools, kwargs, add_generation_prompt):
    text = _check(tokenizers, name, messages, tools, kwargs, add_generation_prompt)
    family = FAMILIES[name]
    tok, _ = tokenizers[name]
    ids = tok.encode(text, add_special_tokens=False)
    marker = next(t for t in family.special[1:] if t in text) if name != "qwen2" else "<|im_start|>"
    assert tok.token_to_id(marker) in ids  # the template's markers are single tokens
    if family.bos is not None and text.startswith(family.bos):
        assert ids.count(tok.bos_token_id) == 1  # a template that writes its BOS gets one


@pytest.mark.parametrize("case,messages,tools,kwargs", QWEN3_CASES, ids=[c[0] for c in QWEN3_CASES])
def test_qwen3_thinking_and_reasoning(tokenizers, case, messages, tools, kwargs):
    text = _check(tokenizers, "qwen3", messages, tools, kwargs, True)
    if kwargs.get("enable_thinking") is False:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert text.endswith("<|im_start|>assistant\n")
    if case == "old_reasoning_dropped":
        assert "add" not in text
    if case.startswith("reasoning_content"):
        assert "<think>\nI need the tool.\n</think>" in text or "<think>\nNeed the tool.\n</think>" in text


def test_gemma3_folds_the_system_message_into_the_first_user_turn(tokenizers):
    text = _check(tokenizers, "gemma3", [SYSTEM, USER, REPLY, USER_2], None, {}, True)
    assert text.startswith(f"<bos><start_of_turn>user\n{SYSTEM['content']}\n\n{USER['content'].strip()}<end_of_turn>\n")
    assert "system" not in text


PARTS = [{"type": "text", "text": "  Part one, ü. "}, {"type": "text", "text": "Part two 🌍"}]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_text_parts_reach_the_template_as_vllm_passes_them(tokenizers, name):
    """OpenAI's list of text parts: a template that loops over a message's parts (Gemma 3)
    gets the list, as transformers and vLLM's "openai" format give it; any other gets the texts
    joined by newlines (vLLM's "string" format), since it would print a list as Python."""
    tok, hf = tokenizers[name]
    reads_parts = tok.chat_template_reads_content_parts()
    assert reads_parts == (name == "gemma3")
    content = PARTS if reads_parts else "\n".join(part["text"] for part in PARTS)
    text, ids = _reference(hf, [{"role": "user", "content": content}], None, {}, True)
    got = _gateway_ids(tok, _request_body([{"role": "user", "content": PARTS}], None, {}, True))
    assert got == ids and tok.decode(got, skip_special_tokens=False) == text
    assert "[{" not in text and "Part two 🌍" in text


@pytest.mark.parametrize(
    "source,expected",
    [
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{{ m['content'] | trim }}{% endfor %}", False),
        ("{% for m in messages %}{% set c = m.content %}{{ c.split('x')[0] }}{% endfor %}", False),
        ("{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}", False),
        ("{% for m in messages %", False),  # does not parse
    ],
)
def test_which_templates_read_content_parts(source, expected):
    assert reads_content_parts(source) is expected


def test_a_bos_the_template_never_writes_is_added_once(model_factory, tmp_path):
    """Pagoda's own rule, unlike transformers and vLLM (which add nothing to the rendered text)
    and like llama.cpp: a tokenizer whose encode adds a BOS gets exactly one in front of a
    template that writes none (Phi-3's template, a post-processor adding `<s>`)."""
    phi3 = Family("phi3", "<s>", "<|endoftext|>", FAMILIES["phi3"].special, adds_bos=True)
    path = _family_dir(model_factory(arch="llama", vocab_size=1024), phi3, tmp_path)
    tok, hf = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    _, ids = _reference(hf, [SYSTEM, USER], None, {}, True)
    assert ids[0] != tok.bos_token_id
    assert _gateway_ids(tok, _request_body([SYSTEM, USER], None, {}, True)) == [tok.bos_token_id, *ids]


def test_a_template_that_refuses_the_conversation_is_a_400(tokenizers):
    """Gemma 2 has no system role; its template raises, and so does transformers."""
    tok, hf = tokenizers["gemma2"]
    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        hf.apply_chat_template([SYSTEM, USER], tokenize=False)
    with pytest.raises(ApiError, match="System role not supported") as raised:
        _gateway_ids(tok, _request_body([SYSTEM, USER], None, {}, True))
    assert raised.value.status == 400


def test_qwen3_reasoning_parser_reads_replies_to_either_prompt(tokenizers):
    """With enable_thinking false the template ends the prompt with an empty think block, and
    the model answers at once: the reply is all content. With thinking on, the model writes
    `<think>` itself. Whole and streamed (one character at a time) agree."""
    tok, _ = tokenizers["qwen3"]
    prompt = tok.decode(
        _gateway_ids(tok, _request_body([USER], None, {"enable_thinking": False}, True)), skip_special_tokens=False
    )
    assert prompt.endswith("<think>\n\n</think>\n\n")
    parser = reasoning_parser("qwen3")
    replies = {
        "4. Ça va.": (None, "4. Ça va."),  # thinking off
        "<think>\n2+2 is 4.\n</think>\n\n4.": ("\n2+2 is 4.\n", "\n\n4."),  # thinking on
        "<think>\ncut short": ("\ncut short", None),
        "\n\n</think> stray": (None, "\n\n</think> stray"),  # no opening tag: content
    }
    for reply, expected in replies.items():
        assert parser.extract(reply) == expected, reply
        stream = parser.stream()
        deltas = [stream.feed(c) for c in reply] + [stream.finish()]
        reasoning = "".join(d.reasoning or "" for d in deltas) or None
        content = "".join(d.content or "" for d in deltas) or None
        assert (reasoning, content) == expected, reply
