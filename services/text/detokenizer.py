"""Incremental detokenization: a sequence's text, token by token, never splitting a character."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first output tokens, so that a decoder that treats the
# start of a text specially (SentencePiece's Metaspace drops the first token's leading space)
# sees the output as a continuation, as vLLM does.
_NUM_PROMPT_CONTEXT_TOKENS = 5
# Tokens an unfinished character may hold back before the text is released anyway: only a
# run of invalid bytes gets this far (a UTF-8 character is at most 4 bytes), and releasing it
# keeps each push's decode short.
_MAX_PENDING_TOKENS = 64


class _Decoder(Protocol):
    """What is decoded with (`services.text.Tokenizer`); `token_to_id` and `special_token_ids`
    are read only when special tokens are kept (`keep_special_tokens`)."""

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    @property
    def special_token_ids(self) -> frozenset[int]: ...


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(_REPLACEMENT))


class IncrementalDetokenizer:
    """The text of one output sequence, released as tokens arrive.

    It decodes a short window of the latest tokens (from `prefix_offset`) and releases the text
    beyond what the window's earlier part (up to `read_offset`) decoded to, as vLLM and TGI do.
    Text ending in U+FFFD is held back: its last bytes may be the start of a character that the
    next tokens complete. A window that decodes cleanly to its end moves forward.

    Invariant (byte-level BPE tokenizers, where decoding concatenates each token's bytes):
    the concatenation of every `push` and the final `flush` equals
    `tokenizer.decode(token_ids, skip_special_tokens)`, and no released piece holds a U+FFFD
    that the full decode does not hold at the same place. Other decoders (SentencePiece's
    byte fallback) keep it for valid UTF-8; they can differ only on invalid byte runs.

    `keep_special_tokens`: special tokens written out even when `skip_special_tokens` (a
    tool-call parser's markers, `[TOOL_CALLS]`, which it reads as text); the invariant then
    holds for the decode with every other special token skipped.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
        keep_special_tokens: Collection[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # with tokens kept: the special ids skipped (the others are decoded as text)
        self._skipped: frozenset[int] | None = None
        if skip_special_tokens and keep_special_tokens:
            kept = {tokenizer.token_to_id(token) for token in keep_special_tokens}
            self._skipped = frozenset(tokenizer.special_token_ids) - kept
        context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: the output's first bytes would change the
            # context's text. Decode the output on its own instead.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._num_context_tokens = len(context)
        self._prefix_offset = 0  # the window decoded on each push starts here
        self._read_offset = len(context)  # ... and its text up to here is released
        # Characters of decode(ids[prefix_offset:]) released so far; at least all of
        # decode(ids[prefix_offset:read_offset]).
        self._num_released_chars = len(context_text)

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._skipped is not None:  # (what skip_special_tokens does, less the kept ones)
            return self._tokenizer.decode([i for i in token_ids if i not in self._skipped], skip_special_tokens=False)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    @property
    def token_ids(self) -> list[int]:
        """The output tokens pushed so far (a copy)."""
        return self._ids[self._num_context_tokens :]

    def push(self, token_ids: Iterable[int]) -> str:
        """Adds output tokens; returns the text that became stable (possibly "")."""
        num_before = len(self._ids)
        self._ids.extend(token_ids)
        if len(self._ids) == num_before:
            return ""
        force = len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS
        return self._release(force=force)

    def flush(self) -> str:
        """Releases the text held back at the end of the sequence (an unfinished character
        becomes U+FFFD, as in the full decode). Pushing may go on afterwards."""
        if len(self._ids) == self._read_offset:
            return ""
        return self._release(force=True)

    def _release(self, *, force: bool) -> str:
        window_text = self._decode(self._ids[self._prefix_offset :])
        num_unstable = 0 if force else _trailing_replacements(window_text)
        stable_end = len(window_text) - num_unstable
        delta = ""
        if stable_end > self._num_released_chars:
            delta = window_text[self._num_released_chars : stable_end]
            self._num_released_chars = stable_end
        if num_unstable == 0:
            # The window ends on a whole character: the next one starts at the tokens just
            # released, which keep the decoder's view of what precedes the new ones.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._num_released_chars = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        return delta
