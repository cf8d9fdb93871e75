"""gpt-oss's reasoning and tool-call parsers end to end with the official `openai` SDK (issue 36).

`pagoda serve --reasoning-parser openai_gptoss --enable-auto-tool-choice --tool-call-parser
openai` of a tiny llama that speaks Harmony: gpt-oss's special tokens and chat template
(tests/support/harmony.py), its stop tokens `<|return|>` and `<|call|>`, and weights trained
here for a few seconds until greedy decoding writes, for each question, a recorded gpt-oss
reply token for token (special tokens included) and then its stop token. No constraint
holds the output (a grammar would switch the reasoning parser off), so the whole path is the
one a gpt-oss reply takes: the markers come out of the model as special tokens, the gateway's
detokenizer keeps them for the parsers, and the parsers split the text into
`reasoning_content`, `content` and `tool_calls`, unstreamed and streamed, with no marker left.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest
from support.harmony import RECORDED, write_harmony_tokenizer
from support.stack import start_serve

from gateway.parsers.harmony import MARKERS
from gateway.protocol import ChatCompletionRequest
from gateway.validation import ModelLimits, chat_prompt
from services.text import Tokenizer

MAX_MODEL_LEN = 512
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}
# question -> (the recorded reply the model is trained to write, its stop token, the request's tools)
ASKED = {
    "What is 2+2?": ("reasoning_and_final", "<|return|>", None),
    "What is the weather in Paris?": ("reasoning_and_call", "<|call|>", [WEATHER]),
}


def _body(question: str) -> dict:
    tools = ASKED[question][2]
    return {"model": "tiny", "messages": [{"role": "user", "content": question}], **({"tools": tools} if tools else {})}


def _examples(model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids as the gateway renders them, the reply's ids then its stop token) per question."""
    tok = Tokenizer(model_dir)
    limits = ModelLimits("tiny", MAX_MODEL_LEN, tok.vocab_size)
    examples = []
    for question, (case, stop, _) in ASKED.items():
        prompt = chat_prompt(ChatCompletionRequest.model_validate(_body(question)), tok, limits)
        reply = tok.encode(RECORDED[case].text, add_special_tokens=False) + [tok.token_to_id(stop)]
        examples.append((list(prompt), reply))
    return examples


def _train_to_reply(model_dir: Path, examples: list[tuple[list[int], list[int]]], max_steps: int = 800) -> None:
    """Replaces the checkpoint's weights by ones whose greedy reply to each prompt is its
    reply, each token ahead of the runner-up by a margin that float rounding cannot undo."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    length = max(len(p) + len(r) for p, r in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for row, (prompt, reply) in enumerate(examples):
        sequence = prompt + reply
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(reply)  # (the model shifts them)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(max_steps):
        out = model(input_ids=ids, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        if step % 20 == 19 and _margin(out.logits.detach(), labels) > 3.0:
            break
    else:
        raise RuntimeError(f"the replies were not learned in {max_steps} steps")
    state = model.state_dict()
    save_file(
        {name: state[name].detach().contiguous() for name in names},
        str(model_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )


def _margin(logits, labels) -> float:
    """The smallest lead of the wanted token over the runner-up, over every reply position."""
    import torch

    logits, wanted = logits[:, :-1], labels[:, 1:]
    mask = wanted != -100
    chosen = logits.gather(-1, wanted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, wanted.clamp(min=0).unsqueeze(-1), float("-inf")).amax(-1)
    return float(torch.where(mask, chosen - others, torch.tensor(float("inf"))).min())


@pytest.fixture(scope="module")
def port(model_factory, tmp_path_factory):
    model = tmp_path_factory.mktemp("harmony-model") / "model"
    shutil.copytree(model_factory(arch="llama", vocab_size=1024, num_layers=2), model)
    write_harmony_tokenizer(model)
    _train_to_reply(model, _examples(model))
    logs = tmp_path_factory.mktemp("harmony-logs")
    stack = start_serve(
        str(model),
        logs,
        "--num-kv-blocks",
        "128",
        "--num-threads",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--served-model-name",
        "tiny",
        "--reasoning-parser",
        "openai_gptoss",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
    )
    try:
        yield stack.port
    finally:
        stack.stop()


def sdk(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def ask(port: int, question: str, **kwargs):
    body = _body(question)
    return sdk(port).chat.completions.create(
        model="tiny",
        messages=body["messages"],
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 200),
        **({"tools": body["tools"]} if "tools" in body else {}),
        **kwargs,
    )


def streamed(port: int, question: str, **kwargs) -> dict:
    """The chunks of a streamed answer put back together."""
    got: dict = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in ask(port, question, stream=True, **kwargs):
        for choice in chunk.choices:
            got["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""
            got["content"] += choice.delta.content or ""
            for piece in choice.delta.tool_calls or ():
                call = got["calls"].setdefault(
                    piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""}
                )
                call["arguments"] += piece.function.arguments or ""
            got["finish"] = choice.finish_reason or got["finish"]
    return got


def no_marker(*texts: str | None) -> bool:
    return not any(text and any(m in text for m in MARKERS) for text in texts)


def test_reasoning_and_answer_apart(port):
    recorded = RECORDED["reasoning_and_final"]
    choice = ask(port, "What is 2+2?").choices[0]
    message = choice.message
    assert (choice.finish_reason, message.content, message.reasoning_content) == (
        "stop",
        recorded.content,
        recorded.reasoning,
    )
    assert not message.tool_calls

    got = streamed(port, "What is 2+2?")
    assert (got["finish"], got["content"], got["reasoning"], got["calls"]) == (
        "stop",
        recorded.content,
        recorded.reasoning,
        {},
    )


def test_a_tool_call_with_its_reasoning(port):
    recorded = RECORDED["reasoning_and_call"]
    choice = ask(port, "What is the weather in Paris?").choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert choice.message.reasoning_content == recorded.reasoning
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"location": "Paris"},
    )
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)

    got = streamed(port, "What is the weather in Paris?")
    assert (got["finish"], got["content"], got["reasoning"]) == ("tool_calls", "", recorded.reasoning)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"location": "Paris"})
    ]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", got["calls"][0]["id"])


def test_cut_short_while_thinking(port):
    """max_tokens inside the analysis: what was thought is reasoning, no content, "length"."""
    full = RECORDED["reasoning_and_final"].reasoning
    choice = ask(port, "What is 2+2?", max_tokens=8).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", None, None)
    reasoning = choice.message.reasoning_content
    assert reasoning and full.startswith(reasoning) and reasoning != full and no_marker(reasoning)
    got = streamed(port, "What is 2+2?", max_tokens=8)
    assert (got["finish"], got["content"], got["reasoning"]) == ("length", "", reasoning)


def test_without_the_parsers_the_markers_stay_out_of_the_text(port):
    """The completions endpoint (no parser) skips the special tokens, as vLLM's does."""
    prompt = "What is 2+2?"
    text = sdk(port).completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert no_marker(text)
