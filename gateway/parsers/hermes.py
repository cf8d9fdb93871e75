"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of NousResearch's Hermes 2 Pro and of Qwen2.5's and Qwen3's chat templates: each
call is one JSON object between `<tool_call>` and `</tool_call>` (newlines around it), as
many blocks as calls. Behaviour follows vLLM's `hermes` parser: text before the first block
is content; a last block without `</tool_call>` still counts when its JSON is whole (the
model stopped at end-of-sequence); bad JSON, or a block cut short, makes the whole reply
content. Beyond vLLM: text between and after the blocks is content too, an absent
`arguments` is `{}`, and `parameters` is read like `arguments`.
"""

from __future__ import annotations

from gateway.parsers.tool_base import RawCall, ToolParser, json_call, object_members

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    """`<tool_call>{...}</tool_call>` blocks; see the module's docstring."""

    markers = (OPEN,)
    marker_tokens = (OPEN, CLOSE)

    def parse_item(self, text: str, pos: int) -> tuple[list[RawCall], int] | None:
        body_start = pos + len(OPEN)
        close = text.find(CLOSE, body_start)
        body_end = len(text) if close < 0 else close
        body = text[body_start:body_end]
        found = object_members(body, 0)
        if found is None or body[found[1] :].strip():
            return None
        call = json_call(found[0])
        if call is None:
            return None
        return [call], (len(text) if close < 0 else close + len(CLOSE))
