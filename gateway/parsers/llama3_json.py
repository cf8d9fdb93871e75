"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`.

The format of Llama 3.1/3.2/3.3 with the JSON tool-calling chat template (vLLM's
`llama3_json` parser, also used for Llama 4): the reply is the call's JSON object, with
`<|python_tag|>` before it when the template asks for it; several calls are separated by
`;`. Each object needs a string `name` and an object `parameters` (or `arguments`: vLLM
reads both); one that lacks them makes the whole reply content, so a plain JSON answer stays
an answer. The section begins at `<|python_tag|>` (text before it is content) or at a `{`
that opens the reply. Beyond vLLM, which drops text around the calls: text after them is
content; vLLM streams only replies that begin with the tag or `{`, as this does.
"""

from __future__ import annotations

from gateway.parsers.tool_base import RawCall, ToolParser, json_call_at, skip_blank

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """JSON call objects joined by `;`; see the module's docstring."""

    markers = (PYTHON_TAG,)
    marker_tokens = (PYTHON_TAG,)
    leading = "{"

    def parse_item(self, text: str, pos: int) -> tuple[list[RawCall], int] | None:
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
        calls: list[RawCall] = []
        while True:
            found = json_call_at(text, pos, needs_arguments=True)
            if found is None or found[0] is None:
                return None
            calls.append(found[0])
            pos = found[1]
            after = skip_blank(text, pos)
            if not text.startswith(";", after):
                return calls, pos
            pos = after + 1
            if skip_blank(text, pos) == len(text):  # a `;` that ends the reply
                return calls, len(text)

    def check_section(self, section: str, new_text: str) -> bool | None:
        pos = skip_blank(section, len(PYTHON_TAG) if section.startswith(PYTHON_TAG) else 0)
        if pos == len(section):
            return None
        if section[pos] != "{":
            return False
        inside = skip_blank(section, pos + 1)
        if inside < len(section) and section[inside] not in '"}':  # a first key, or the end
            return False
        if "}" not in new_text:  # the object can only have ended with a `}`
            return None
        found = json_call_at(section, pos, needs_arguments=True)
        if found is None:  # not whole yet (or never: then `finish` gives it as content)
            return None
        return found[0] is not None
