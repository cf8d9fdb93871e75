"""Tool calling in chat completions: forced calls on structured output
(docs/structured-output.md), and which requests are "auto".

When the model chooses ("auto", OpenAI's default when tools are given), a free answer must be
told from a call by the syntax of the model's chat template: that needs the server started
with `--enable-auto-tool-choice --tool-call-parser NAME` (the reply is then parsed:
gateway/chat_parsing.py); without it "auto" is a 400 naming `tool_choice` and the flags, as
vLLM answers. What works, for every model, is the calling the grammar guarantees:

- `tool_choice: {"type": "function", "function": {"name": N}}` constrains the output to N's
  `parameters` schema; the answer is one tool call whose `arguments` is the output
  (streamed as argument deltas); finish_reason "stop", as OpenAI gives for a named call. A
  call cut short (`max_tokens`, a stop string) is still the call, its arguments as far as
  they got and finish_reason "length" when that cut it, streamed or not (as vLLM answers).
- `tool_choice: "required"` constrains the output to a JSON array of one or more
  `{"name": ..., "parameters": {...}}` objects, each a declared tool with its schema; the
  answer is one tool call per entry (exactly one with `parallel_tool_calls: false`);
  finish_reason "tool_calls". Streamed, the calls come in one chunk when the output is
  complete.
- `tool_choice: "none"` generates a plain message (the tools still reach the template).

A function declared without `parameters` takes no arguments, as OpenAI reads it: a call's
arguments are exactly `{}`. A call's `arguments` are its JSON as the model wrote it, and its
id is made as vLLM makes them (`chatcmpl-tool-...`), for forced calls and parsed ones alike.

The tools are given to the chat template as `tools`, as transformers' templates expect.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid
from gateway.parsers import TOOL_CALL_PARSERS
from gateway.parsers.tool_base import array_texts, new_tool_call_id, object_members
from services import grammar
from services.sampling import StructuredOutput

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
# A function declared without `parameters` takes none, as OpenAI reads it: its arguments are
# `{}` and nothing else (an open object would let a forced call run on for ever).
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCalling:
    """How a chat request's output becomes tool calls: `name` for a named function, None
    for "required" (a list of calls)."""

    name: str | None
    names: tuple[str, ...]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"


def declared_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Declared tools by name -> their parameters schema; a 400 naming the bad entry."""
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where}.type", "must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
        if name in out:
            raise invalid(f"{where}.function.name", f"{name!r} is declared twice")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", "must be a JSON Schema object")
        out[name] = parameters
    return out


def chooses_auto(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Whether the model chooses between answering and calling: tools with "auto", or with
    no tool_choice (OpenAI's default when tools are given)."""
    return bool(tools) and tool_choice in (None, "auto")


def tool_calling(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool = True, auto: bool = False
) -> tuple[ToolCalling | None, StructuredOutput | None]:
    """What the request's `tools` and `tool_choice` ask: the calling mode and the output
    constraint that guarantees it (None, None: a plain message, parsed for calls when the
    request `chooses_auto`); `parallel` False: one call. `auto`: the server parses replies
    for calls (--enable-auto-tool-choice), else "auto" is a 400."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return None, None
    declared = declared_tools(tools)
    if tool_choice == "none":
        return None, None
    if tool_choice is None or tool_choice == "auto":
        if auto:
            return None, None
        raise invalid(
            "tool_choice",
            "'auto' (the default with tools) needs the server started with "
            "--enable-auto-tool-choice and --tool-call-parser NAME (the model's "
            f"tool-call syntax: {', '.join(TOOL_CALL_PARSERS)}); or send 'required' "
            'or {"type": "function", "function": {"name": ...}}',
        )
    if tool_choice == "required":
        for name in declared:
            _check_schema(tools, name, declared[name])
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in declared.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
        return ToolCalling(None, tuple(declared)), StructuredOutput("json_schema", json.dumps(schema))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in declared:
            raise invalid("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(declared)})")
        _check_schema(tools, name, declared[name])
        return ToolCalling(name, tuple(declared)), StructuredOutput("json_schema", json.dumps(declared[name]))
    raise invalid(
        "tool_choice", 'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
    )


def _check_schema(tools: list[dict[str, Any]], name: str, parameters: dict[str, Any]) -> None:
    """A forced call's output follows its tool's `parameters`: a schema that cannot be compiled
    is a 400 naming that tool's field (it failed later, naming the scheduler's own field)."""
    try:
        grammar.check(StructuredOutput("json_schema", json.dumps(parameters)))
    except (grammar.GrammarError, ValueError) as exc:
        where = next(i for i, tool in enumerate(tools) if tool["function"]["name"] == name)
        raise invalid(f"tools[{where}].function.parameters", f"not a JSON Schema a call can follow: {exc}") from None


def call_id() -> str:
    return new_tool_call_id()


def tool_calls(calling: ToolCalling, text: str) -> list[dict[str, Any]] | None:
    """The output as OpenAI tool calls, each call's arguments as written: a named function's
    is the whole output, even cut short; None when "required" calls are not complete (cut
    short by max_tokens or a stop string): the caller then returns them as plain content."""
    if calling.name is not None:
        return [_call(calling.name, text)]
    listed = array_texts(text, 0)
    if listed is None or text[listed[1] :].strip():
        return None
    calls = []
    for written in listed[0]:
        found = object_members(written, 0)
        name = None if found is None else found[0].get("name", (None, ""))[0]
        if name not in calling.names:
            return None
        calls.append(_call(name, found[0].get("parameters", ({}, "{}"))[1]))
    return calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def message(calling: ToolCalling | None, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A choice's message and finish reason, with the output as tool calls when it is one."""
    if calling is None:
        return {"role": "assistant", "content": text}, finish_reason
    complete = finish_reason == "stop"
    calls = tool_calls(calling, text) if complete or calling.name is not None else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, (
        calling.finish_reason if complete else finish_reason
    )
