"""Automatic tool calls (`tool_choice: "auto"`): the registry of tool-call parsers by name.

Each parser reads one model family's tool-call syntax out of its reply, whole
(`extract(text) -> ExtractedToolCalls`) or streamed (`stream()` per choice, then
`feed(delta) -> StreamDelta` and `finish() -> StreamDelta`). The names are vLLM's
`--tool-call-parser` names; the formats and behaviour are in each parser's module, the
shared rules in `gateway/parsers/tool_base.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.parsers.harmony import HarmonyToolParser
from gateway.parsers.hermes import HermesToolParser
from gateway.parsers.llama3_json import Llama3JsonToolParser
from gateway.parsers.mistral import MistralToolParser
from gateway.parsers.pythonic import PythonicToolParser
from gateway.parsers.tool_base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_mistral_tool_call_id,
    new_tool_call_id,
)

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": HarmonyToolParser,
    "pythonic": PythonicToolParser,
}

__all__ = [
    "TOOL_CALL_PARSERS",
    "ExtractedToolCalls",
    "HarmonyToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "new_mistral_tool_call_id",
    "new_tool_call_id",
    "tool_call_parser",
]


def tool_call_parser(
    name: str, *, parallel_tool_calls: bool = True, new_id: Callable[[], str] | None = None
) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        parser = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}") from None
    return parser(parallel_tool_calls=parallel_tool_calls, new_id=new_id)
