"""Mistral tool calls: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

The format of Mistral 7B Instruct v0.3, Mistral Nemo, Small and Large (vLLM's `mistral`
parser): `[TOOL_CALLS]` (a special token: the reply must be decoded with special tokens
kept) and a JSON list of call objects (a single object is read too). Newer tokenizers
(v11 and later) write `[TOOL_CALLS]name{...}` or `[TOOL_CALLS]name[ARGS]{...}`, one marker
per call; both are read. Text before the first marker is content, as in vLLM; beyond vLLM,
text after a call is content too. Call ids are 9 letters or digits, as vLLM makes them,
because Mistral's templates reject any other id when the conversation comes back.
"""

from __future__ import annotations

import re

from gateway.parsers.tool_base import (
    RawCall,
    ToolParser,
    arguments_json,
    array_texts,
    decode_json,
    json_call,
    new_mistral_tool_call_id,
    object_members,
    skip_blank,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` with a JSON list, or with `name[ARGS]{...}`; see the module's docstring."""

    markers = (TOOL_CALLS,)
    marker_tokens = (TOOL_CALLS, ARGS)
    default_new_id = staticmethod(new_mistral_tool_call_id)

    def parse_item(self, text: str, pos: int) -> tuple[list[RawCall], int] | None:
        pos = skip_blank(text, pos + len(TOOL_CALLS))
        if text.startswith(("[", "{"), pos):
            return _json_calls(text, pos)
        name = _NAME.match(text, pos)
        if name is None:
            return None
        pos = name.end()
        if text.startswith(ARGS, pos):
            pos += len(ARGS)
        decoded = decode_json(text, pos)
        if decoded is None or not isinstance(decoded[0], dict):
            return None
        arguments = arguments_json(decoded[0], text[skip_blank(text, pos) : decoded[1]])
        return None if arguments is None else ([(name.group(), arguments)], decoded[1])


def _json_calls(text: str, pos: int) -> tuple[list[RawCall], int] | None:
    decoded = decode_json(text, pos)
    if decoded is None:
        return None
    value, end = decoded
    listed = array_texts(text, pos) if isinstance(value, list) else None
    written = listed[0] if listed is not None else [text[skip_blank(text, pos) : end]]
    calls = [json_call(_members(entry)) for entry in written]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None], end


def _members(written: str):
    found = object_members(written, 0)
    return None if found is None else found[0]
