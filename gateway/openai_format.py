"""Response bodies in OpenAI's shapes: completions, chat, their stream chunks, log-probabilities.

Plain functions from the gateway's results (`ChoiceDelta`s accumulated into `ChoiceResult`s,
`Usage`) to JSON-ready dicts. Choice indices are global: prompt `p` of a request with `n`
choices per prompt owns indices `p*n ... p*n+n-1`, as OpenAI numbers them.
"""

from __future__ import annotations

import codecs
import json
import math
from dataclasses import dataclass, field
from typing import Any

from gateway import tools
from gateway.chat_parsing import ReplyParsing
from gateway.generation import ChoiceDelta, TokenLogprob, Usage
from gateway.tools import ToolCalling

# JSON has no infinities: a token of probability 0 gets this instead of -inf (as vLLM).
MIN_LOGPROB = -9999.0


@dataclass
class ChoiceResult:
    """One choice accumulated from its deltas."""

    index: int
    prompt_index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _lp(value: float | None) -> float | None:
    if value is None:
        return None  # a prompt's first token
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def prompt_logprobs_body(entries: list[TokenLogprob], num_top: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}
    for the prompt's token and its `num_top` likeliest alternatives (ranks 1, 2, ...; the
    prompt may have been scored with more, for echo's logprobs); None first."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        body = {
            str(t.token_id): {"logprob": _lp(t.logprob), "rank": rank, "decoded_token": t.token}
            for rank, t in enumerate(e.top[:num_top], start=1)
        }
        body[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.token}
        out.append(body)
    return out


def echo_logprobs(prompt_logprobs: list[TokenLogprob] | None, num_top: int) -> list[TokenLogprob]:
    """An echoed prompt's entries with `num_top` alternatives each, as the generated tokens
    have (the prompt may have been scored with more for `prompt_logprobs`)."""
    return [
        TokenLogprob(e.token_id, e.token, e.logprob, e.top[:num_top], e.token_bytes, e.rank)
        for e in prompt_logprobs or []
    ]


def echoed(delta: ChoiceDelta, prompt_text: str, num_top: int | None) -> ChoiceDelta:
    """A choice's first delta with the prompt in front (`echo`): its text, and its tokens'
    log-probabilities when logprobs were asked (`num_top` alternatives)."""
    logprobs = delta.logprobs if num_top is None else [*echo_logprobs(delta.prompt_logprobs, num_top), *delta.logprobs]
    return ChoiceDelta(
        delta.index,
        prompt_text + delta.text,
        delta.token_ids,
        logprobs,
        delta.finish_reason,
        delta.stop_reason,
        delta.prompt_logprobs,
        delta.stop_token_id,
    )


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def token_label(token: str, token_bytes: bytes | None) -> str:
    """A token as OpenAI shows it in log-probabilities: its own text (`token`, its decode) when
    its bytes are valid UTF-8 on their own, else `bytes:` and a `\\xNN` escape per byte
    ("bytes:\\xe2\\x80"). Tokens that hold part of a character all decode to U+FFFD; their
    labels tell them apart. `token_bytes` None: the UTF-8 of `token`."""
    if token_bytes is None:
        return token
    try:
        token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)
    return token


def _bytes(token: str, token_bytes: bytes | None) -> bytes:
    return token.encode("utf-8") if token_bytes is None else token_bytes


class TextOffsets:
    """Where each token of one choice starts in the choice's text, in characters, as tokens
    arrive (one per choice, kept across stream chunks so that they count as the whole response
    does). A token that continues a character starts at that character; bytes that never form
    one count as the single U+FFFD that decoding gives them."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._num_chars = 0

    def advance(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes, which then count as part of the text."""
        pending, _ = self._decoder.getstate()
        start = self._num_chars
        if pending and token_bytes and not _continues(pending, token_bytes[:1]):
            start += 1  # the unfinished character before it ends as one U+FFFD
        self._num_chars += len(self._decoder.decode(token_bytes))
        return start


def _continues(pending: bytes, byte: bytes) -> bool:
    """Whether `byte` continues the unfinished character `pending` (or finishes it)."""
    try:
        (pending + byte).decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    return True


def completion_logprobs(logprobs: list[TokenLogprob], offsets: TextOffsets | None = None) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}
    (the sampled token among them, as vLLM returns it). Tokens as `token_label` shows them.
    `offsets`: the choice's, where the text of `logprobs` continues earlier chunks."""
    offsets = offsets if offsets is not None else TextOffsets()
    text_offsets, tops = [], []
    for lp in logprobs:
        text_offsets.append(offsets.advance(_bytes(lp.token, lp.token_bytes)))
        if lp.logprob is None:  # an echoed prompt's first token: nothing to score it by
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token, token_bytes, value in [
            *((t.token, t.token_bytes, t.logprob) for t in lp.top),
            (lp.token, lp.token_bytes, lp.logprob),
        ]:
            label, value = token_label(token, token_bytes), _lp(value)
            # Distinct bytes give distinct labels, but distinct ids can still share them (the
            # same string from different merges, a decoder that drops a leading space): a dict
            # holds one, the likelier, as OpenAI's does.
            if value > top.get(label, -math.inf):
                top[label] = value
        tops.append(top)
    return {
        "tokens": [token_label(lp.token, lp.token_bytes) for lp in logprobs],
        "token_logprobs": [_lp(lp.logprob) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": text_offsets,
    }


def _token_entry(token: str, token_bytes: bytes | None, logprob: float) -> dict[str, Any]:
    return {
        "token": token_label(token, token_bytes),
        "logprob": _lp(logprob),
        "bytes": list(_bytes(token, token_bytes)),
    }


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: one entry per token, each (and each alternative) with its `bytes`, the
    token's own bytes, which a client joins to rebuild characters split across tokens."""
    return {
        "content": [
            {
                **_token_entry(lp.token, lp.token_bytes, lp.logprob),
                "top_logprobs": [_token_entry(t.token, t.token_bytes, t.logprob) for t in lp.top],
            }
            for lp in logprobs
        ]
    }


def _extras(
    choice: dict[str, Any],
    stop_reason: str | int | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    choice["stop_reason"] = stop_reason  # vLLM: the stop string or token id that matched
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def completion_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[ChoiceResult],
    usage: Usage,
    want_logprobs: bool,
    prompts: list[list[int]] | None,
    echo_texts: list[str] | None = None,
    prompt_logprobs: int | None = None,
    num_top: int | None = None,
) -> dict[str, Any]:
    """`prompts` given: return_token_ids was asked. `echo_texts` given (per prompt): echo,
    the prompt's text (and its tokens' logprobs) before each choice's."""
    out = []
    for c in choices:
        text, logprobs = c.text, c.logprobs
        if echo_texts is not None:
            text = echo_texts[c.prompt_index] + text
            if want_logprobs:
                logprobs = [*echo_logprobs(c.prompt_logprobs, num_top or 0), *logprobs]
        choice = _extras(
            {
                "index": c.index,
                "text": text,
                "logprobs": completion_logprobs(logprobs) if want_logprobs else None,
                "finish_reason": c.finish_reason,
            },
            c.stop_reason,
            c.token_ids if prompts else None,
            prompts[c.prompt_index] if prompts else None,
        )
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(c.prompt_logprobs or [], prompt_logprobs)
        out.append(choice)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage_body(usage),
    }


def chat_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[ChoiceResult],
    usage: Usage,
    want_logprobs: bool,
    prompt: list[int] | None,
    prompt_logprobs: int | None = None,
    calling: ToolCalling | None = None,
    parsing: ReplyParsing | None = None,
) -> dict[str, Any]:
    """`calling`: the request forced tool calls (gateway.tools), so each choice's output is
    returned as its calls. `parsing`: each choice's output is read by the server's parsers
    into reasoning, content and tool calls (gateway.chat_parsing)."""
    extra = {}
    if prompt_logprobs is not None:  # vLLM: once for the request, beside the choices
        extra["prompt_logprobs"] = prompt_logprobs_body(
            choices[0].prompt_logprobs or [] if choices else [], prompt_logprobs
        )
    return {
        **extra,
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            _extras(
                {
                    "index": c.index,
                    **dict(
                        zip(
                            ("message", "finish_reason"),
                            _message(calling, parsing, c.text, c.finish_reason),
                            strict=True,
                        )
                    ),
                    "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                },
                c.stop_reason,
                c.token_ids if prompt is not None else None,
                None,
            )
            for c in choices
        ],
        "usage": usage_body(usage),
        **({"prompt_token_ids": prompt} if prompt is not None else {}),
    }


def _message(
    calling: ToolCalling | None, parsing: ReplyParsing | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    if parsing is not None:
        return parsing.message(text, finish_reason)
    return tools.message(calling, text, finish_reason)


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    delta: ChoiceDelta,
    want_logprobs: bool,
    want_token_ids: bool,
    offsets: TextOffsets,
) -> dict[str, Any]:
    """`offsets`: the choice's, advanced past this chunk's tokens when logprobs are asked."""
    choice = {
        "index": index,
        "text": delta.text,
        "logprobs": completion_logprobs(delta.logprobs, offsets) if want_logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    if want_token_ids:
        choice["token_ids"] = delta.token_ids
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    delta: ChoiceDelta | None,
    want_logprobs: bool,
    want_token_ids: bool,
) -> dict[str, Any]:
    """`delta` None: the opening chunk of a choice, which carries the role."""
    if delta is None:
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    else:
        choice = {
            "index": index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": chat_logprobs(delta.logprobs) if want_logprobs else None,
            "finish_reason": delta.finish_reason,
        }
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        if want_token_ids:
            choice["token_ids"] = delta.token_ids
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()
