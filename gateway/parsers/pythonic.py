"""Pythonic tool calls: `[get_weather(city='Paris'), get_time()]`, a Python list of calls.

The format of Llama 3.2 (1B, 3B), Llama 4 and ToolACE (vLLM's `pythonic` and
`llama4_pythonic` parsers): the reply is a Python list of calls with keyword arguments,
optionally between `<|python_start|>` and `<|python_end|>` (Llama 4). It is read with `ast`
and only literals are taken (strings, numbers, True/False/None, lists, tuples, dicts with
string keys): nothing is evaluated. A call with a positional or non-literal argument, or a
list that is not all calls, makes the whole reply content, as in vLLM. The section begins at
`<|python_start|>` (text before it is content) or at a `[` that opens the reply, and runs to
the end of the reply: no text may follow the list.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from gateway.parsers.tool_base import RawCall, ToolParser, arguments_json

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_HEAD = re.compile(r"\[\s*[^\W\d]\w*\s*\(")  # `[name(`: how a list of calls begins
_HEAD_SO_FAR = re.compile(r"\[\s*(?:[^\W\d]\w*\s*)?")  # what can still become one


class PythonicToolParser(ToolParser):
    """A Python list of calls, literals only; see the module's docstring."""

    markers = (PYTHON_START,)
    marker_tokens = (PYTHON_START, PYTHON_END)
    leading = "["

    def parse_item(self, text: str, pos: int) -> tuple[list[RawCall], int] | None:
        body = _body(text[pos:]).rstrip()
        if body.endswith(PYTHON_END):
            body = body[: -len(PYTHON_END)].rstrip()
        if not _HEAD.match(body):
            return None
        calls = parse_call_list(body)
        return None if calls is None else (calls, len(text))

    def check_section(self, section: str, new_text: str) -> bool | None:
        body = _body(section)
        if not body or _HEAD_SO_FAR.fullmatch(body):
            return None
        return _HEAD.match(body) is not None


def _body(section: str) -> str:
    if section.startswith(PYTHON_START):
        section = section[len(PYTHON_START) :]
    return section.lstrip()


def parse_call_list(source: str) -> list[RawCall] | None:
    """`[f(a=1), g()]` as calls; None unless it is a non-empty list of calls by name with
    literal keyword arguments."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        call = _call(node)
        if call is None:
            return None
        calls.append(call)
    return calls


class _NotLiteral(Exception):
    pass


def _call(node: ast.expr) -> RawCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            arguments[keyword.arg] = _literal(keyword.value)
    except (_NotLiteral, RecursionError):
        return None
    text = arguments_json(arguments)
    return None if text is None else (node.func.id, text)


def _literal(node: ast.expr) -> Any:
    """The value of a literal; _NotLiteral for anything else (a name, a call, an operation)."""
    if isinstance(node, ast.Constant) and _is_json_scalar(node.value):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and _is_number(node.operand.value)
    ):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):  # JSON keys are strings; None: **d
            raise _NotLiteral
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise _NotLiteral


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, bool)) or _is_number(value)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
