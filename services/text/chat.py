"""Chat templates: a model's Jinja template rendered in a sandbox, as transformers renders it.

Chat templates come with checkpoints, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` and see only plain JSON-like data (dicts, lists, strings,
numbers), never the caller's objects. The environment is the one transformers builds
(`transformers.utils.chat_template_utils._cached_compile_jinja_template`): `trim_blocks`,
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block (rendered as its
body: Pagoda does not need the assistant mask it exists for), the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`, and a `tojson` filter that
does not escape HTML and keeps non-ASCII characters.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplateError",
    "compile_chat_template",
    "cut_at_final_message",
    "normalize_messages",
    "plain_data",
    "reads_content_parts",
    "tag_final_message",
]

# Names a message's reasoning is passed under; transformers fills all of them from any one,
# because templates read different ones (`reasoning_content` is the common one, gpt-oss reads
# `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# continue_final_message: appended to the last message's text before rendering, so that the
# rendered prompt can be cut where that text ends (transformers' tag, spacing included)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that refuses the conversation it is given
    (`raise_exception(...)` in the template, e.g. "roles must alternate"): the caller's input
    or the model's files are at fault, not Pagoda."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it to
    build a training mask; rendering needs only the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` refusing underscore names, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters (<, >, &, ') and would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def compile_chat_template(source: str, *, origin: str) -> jinja2.Template:
    """The compiled template; `origin` (a file name) goes into the error of one that does not
    compile."""
    try:
        return _make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{origin}: chat template does not compile: {e.message} (template line {e.lineno})"
        ) from e


def reads_content_parts(source: str) -> bool:
    """Whether the template loops over a message's content, i.e. reads OpenAI's list of parts
    (`{% for item in message['content'] %}`, directly or through a variable set from it), as
    vLLM's "auto" content format detects it: such a template gets the parts as a list, any
    other their texts joined. A template that does not parse reads none."""
    try:
        tree = _make_environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    aliases = {
        node.target.name
        for node in tree.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node, set())
    }
    return any(_is_content(node.iter, aliases) for node in tree.find_all(jinja2.nodes.For))


def _is_content(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
    """`x['content']`, `x.content` or a name in `aliases`, possibly through filters."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in aliases


def render_chat_template(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """Renders with `variables`. Any error while rendering (the template's own
    `raise_exception`, a sandbox violation, or a TypeError from an operation on messages of
    an unexpected shape) becomes a ChatTemplateError: the conversation does not suit the
    template."""
    try:
        return template.render(**variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from e
    except Exception as e:  # the template is data, not Pagoda's code: whatever it raises
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from e


def plain_data(value: Any) -> Any:
    """A copy of `value` made only of JSON types (what a sandboxed template may touch):
    dataclasses and pydantic models become dicts, str/int/float subclasses their base types,
    anything else an inert `<TypeName>` placeholder, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return plain_data(value.item())  # np.bool_(False) must not become a truthy string
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic, e.g. the openai package's
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as the template should see them: plain dicts, keys whose value is None dropped
    (OpenAI clients send `content: null` or `tool_calls: null`, which many templates render as
    the text "None"), reasoning under each of its names. Raises ValueError on an empty
    conversation or a message that is not a mapping."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages: must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: the conversation is empty")
    normalized = []
    for i, message in enumerate(plain_data(list(messages))):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: must be a mapping with 'role' and 'content', got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def tag_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """`continue_final_message`, before rendering: the last message's text (its last text
    part, for a list of parts) gets a tag at its end, in place, as transformers marks it;
    returns that text. ValueError when there is nothing to continue, or when the template
    (`source`) never reads a message's content."""
    final = messages[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message: the final message has no "content" to continue')
    if "content" not in source:
        raise ValueError("continue_final_message: the chat template does not read a message's content")
    if isinstance(final, str):
        messages[-1]["content"] = final + _CONTINUE_TAG
        return final
    for part in reversed(final if isinstance(final, list) else []):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text = part["text"]
            part["text"] = text + _CONTINUE_TAG
            return text
    raise ValueError("continue_final_message: the final message has no text to continue")


def cut_at_final_message(rendered: str, final: str) -> str:
    """`continue_final_message`, after rendering: the prompt cut where the final message's
    text (`final`, tagged by `tag_final_message`) ends, so that the model continues it;
    ChatTemplateError when the template dropped or changed it."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the "
            "rendered prompt (the chat template changes or drops it)"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space
