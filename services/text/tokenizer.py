"""A checkpoint's tokenizer and chat template, read from its files with `tokenizers` and jinja2.

What transformers' `AutoTokenizer.from_pretrained(dir)` (version 5) gives for a checkpoint with
a `tokenizer.json`, without importing transformers or torch: the gateway and the scheduler
start in a fraction of a second and never hold a model library.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, processors

from services.text.chat import (
    compile_chat_template,
    cut_at_final_message,
    normalize_messages,
    plain_data,
    reads_content_parts,
    render_chat_template,
    tag_final_message,
)

__all__ = ["Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 writes the template here
CHAT_TEMPLATES_DIR = "chat_templates"  # ... and further named ones here, one NAME.jinja each


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: a byte-level BPE vocabulary spells each
    byte as one printable character, the byte's own code point where that prints, else 256, 257,
    ... in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
# How a byte-fallback vocabulary (SentencePiece, Llama 2) spells a byte it has no piece for.
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# The named special tokens that transformers passes to every chat template (its
# `special_tokens_map`), in its order.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, None when there is no such file; ValueError naming the file
    when it is not a JSON object."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any, *, origin: str, key: str) -> str | None:
    """A special token as tokenizer files spell it: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{origin}: {key} must be a string or an object with a 'content' string, got {value!r}")


def _token_ids(value: Any, *, origin: str, key: str) -> list[int]:
    """eos_token_id as config files spell it: absent, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{origin}: {key} must be a token id or a list of token ids, got {value!r}")
    return values


def _decoder_states(decoder: decoders.Decoder) -> list[dict[str, Any]]:
    """The decoder's settings as tokenizer.json spells them; a Sequence's, each of its own."""
    state = json.loads(decoder.__getstate__())
    return state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]


def _added_token(spec: Any, *, origin: str) -> AddedToken:
    if not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
        raise ValueError(
            f"{origin}: added_tokens_decoder entries must be objects with a 'content' string, got {spec!r}"
        )
    flags = {
        key: bool(spec[key]) for key in ("single_word", "lstrip", "rstrip", "normalized", "special") if key in spec
    }
    return AddedToken(spec["content"], **flags)


def _named_special_tokens(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... that are set. As transformers reads them: special_tokens_map.json
    is the legacy spelling, read (and preferred) only where tokenizer_config.json predates
    `added_tokens_decoder`."""
    origin = str(model_dir / TOKENIZER_CONFIG_FILE)
    named = {key: _token_content(config.get(key), origin=origin, key=key) for key in _NAMED_SPECIAL_TOKENS}
    if "added_tokens_decoder" not in config:
        map_path = model_dir / SPECIAL_TOKENS_MAP_FILE
        for key, value in (_read_json(map_path) or {}).items():
            if key in named and value is not None:
                named[key] = _token_content(value, origin=str(map_path), key=key)
    return {key: value for key, value in named.items() if value is not None}


def _add_declared_tokens(
    backend: tokenizers.Tokenizer, config: Mapping[str, Any], named: Mapping[str, str], *, origin: str
) -> None:
    """Adds the tokens the config declares (added_tokens_decoder, the named and additional
    special tokens) that tokenizer.json lacks, as transformers adds them, so that the same
    text encodes to the same ids."""
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict) or not all(str(key).isdigit() for key in declared):
        raise ValueError(f"{origin}: added_tokens_decoder must map token ids to tokens")
    to_add = [_added_token(spec, origin=origin) for _, spec in sorted(declared.items(), key=lambda item: int(item[0]))]
    to_add = [token for token in to_add if backend.token_to_id(token.content) is None]
    extra = [*named.values()]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        if isinstance(config.get(key), list):
            extra += [_token_content(value, origin=origin, key=key) or "" for value in config[key]]
    for content in extra:
        if content and backend.token_to_id(content) is None and all(token.content != content for token in to_add):
            to_add.append(AddedToken(content, special=True))
    for token in to_add:
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _load_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> template source, name -> file it came from). The files transformers 5 writes
    (chat_template.jinja as "default", chat_templates/NAME.jinja) take precedence over
    tokenizer_config.json's `chat_template`, a string or a list of {name, template}."""
    templates: dict[str, str] = {}
    origins: dict[str, str] = {}
    files = [("default", model_dir / CHAT_TEMPLATE_FILE)]
    if (model_dir / CHAT_TEMPLATES_DIR).is_dir():
        files += [
            (path.name.removesuffix(".jinja"), path)
            for path in sorted((model_dir / CHAT_TEMPLATES_DIR).glob("*.jinja"))
        ]
    for name, path in files:
        if path.is_file():
            try:
                templates[name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: cannot read the chat template: {e}") from e
            origins[name] = str(path)
    if templates:
        return templates, origins
    value = config.get("chat_template")
    origin = str(model_dir / TOKENIZER_CONFIG_FILE)
    if value is None:
        return {}, {}
    if isinstance(value, str):
        return {"default": value}, {"default": origin}
    if isinstance(value, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        for item in value
    ):
        return (
            {item["name"]: item["template"] for item in value},
            {item["name"]: f"{origin} (chat template {item['name']!r})" for item in value},
        )
    raise ValueError(f"{origin}: chat_template must be a string or a list of {{'name': ..., 'template': ...}} objects")


class Tokenizer:
    """A checkpoint's tokenizer: `tokenizer.json`, the special tokens of `tokenizer_config.json`
    (legacy `special_tokens_map.json`), stop ids of `generation_config.json` and `config.json`,
    and its chat templates. Read-only once loaded (compiled templates are cached), so one
    instance serves every request.

    Encoding and decoding are `tokenizers`' own, as transformers 5 uses them: the post-processor
    in tokenizer.json decides which special tokens `encode` adds (transformers 5 ignores
    `add_bos_token` when tokenizer.json exists; here it is used only where tokenizer.json has
    no post-processor at all, as transformers 4's Llama tokenizer did).
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"{model_dir}: not a directory")
        self._model_dir = model_dir
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise ValueError(
                f"{tokenizer_path}: missing; Pagoda reads a model's tokenizer from "
                f"tokenizer.json (transformers' save_pretrained writes one)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # tokenizers raises plain Exception on a malformed file
            raise ValueError(f"{tokenizer_path}: not a valid tokenizer file: {e}") from e
        config = _read_json(model_dir / TOKENIZER_CONFIG_FILE) or {}
        config_origin = str(model_dir / TOKENIZER_CONFIG_FILE)

        self._named_special_tokens = _named_special_tokens(model_dir, config)
        _add_declared_tokens(backend, config, self._named_special_tokens, origin=config_origin)

        self._bos_token_id = self._named_id("bos_token", backend)
        eos_token_id = self._named_id("eos_token", backend)
        if backend.post_processor is None:
            self._install_post_processor(backend, config, eos_token_id)
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._special_token_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        self._added_token_bytes = {token_id: token.content.encode("utf-8") for token_id, token in added.items()}
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._byte_fallback = backend.decoder is not None and "ByteFallback" in {
            d.get("type") for d in _decoder_states(backend.decoder)
        }

        eos_ids = [eos_token_id] if eos_token_id is not None else []
        for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
            path = model_dir / name
            eos_ids += _token_ids((_read_json(path) or {}).get("eos_token_id"), origin=str(path), key="eos_token_id")
        self._eos_token_ids = tuple(dict.fromkeys(eos_ids))

        probe = "a"
        with_special = backend.encode(probe, add_special_tokens=True).ids
        without = backend.encode(probe, add_special_tokens=False).ids
        self._encode_adds_bos = (
            self._bos_token_id is not None
            and with_special[:1] == [self._bos_token_id]
            and without[:1] != [self._bos_token_id]
        )

        self._chat_templates, self._chat_template_origins = _load_chat_templates(model_dir, config)
        self._compiled: dict[str, Any] = {}
        self._reads_content_parts: dict[str, bool] = {}

    def _named_id(self, key: str, backend: tokenizers.Tokenizer) -> int | None:
        token = self._named_special_tokens.get(key)
        return None if token is None else backend.token_to_id(token)

    def _install_post_processor(
        self, backend: tokenizers.Tokenizer, config: Mapping[str, Any], eos_token_id: int | None
    ) -> None:
        """transformers 4's `update_post_processor`: BOS/EOS from add_bos_token/add_eos_token,
        for a tokenizer.json that has no post-processor to say."""
        bos = self.bos_token if config.get("add_bos_token") is True else None
        eos = self.eos_token if config.get("add_eos_token") is True else None
        if self._bos_token_id is None:
            bos = None
        if eos_token_id is None:
            eos = None
        if bos is None and eos is None:
            return
        single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
        pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
        special_tokens = [
            (token, token_id)
            for token, token_id in ((bos, self._bos_token_id), (eos, eos_token_id))
            if token is not None
        ]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)

    # --- properties ------------------------------------------------------------------------

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (transformers'
        `len(tokenizer)`); the model's embedding may have more rows than this."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._named_special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._named_special_tokens.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token", self._backend)

    def backend_json(self) -> str:
        """The tokenizer as `tokenizers` serialises it (with the declared special tokens),
        without padding or truncation: what a grammar library builds its token table from."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos token, then generation_config's
        and config.json's eos_token_id (an int or a list), each once, in that order."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens, the ones `decode(..., skip_special_tokens=True)` drops."""
        return self._special_token_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (bos_token, eos_token, ...), as transformers'
        `special_tokens_map`; every chat template sees them as variables."""
        return dict(self._named_special_tokens)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The template source; a dict name -> source for a model with several; None."""
        if not self._chat_templates:
            return None
        if list(self._chat_templates) == ["default"]:
            return self._chat_templates["default"]
        return dict(self._chat_templates)

    # --- tokens ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids. With
        `add_special_tokens` the tokenizer's post-processor adds its own (e.g. a BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text: must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`. Bytes that do not form whole UTF-8 characters become
        U+FFFD; ids the tokenizer does not know are dropped (as `tokenizers` does)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for on its own: what it adds to a decoded text, before
        the text is read as UTF-8. Unlike `decode([token_id])`, which gives U+FFFD for a token
        that holds only part of a character, these are the token's real bytes: a byte-level
        BPE's vocabulary entry read through GPT-2's byte alphabet, a byte-fallback `<0xNN>`
        piece's byte; an added token's content. Other tokens (no bytes in their vocabulary
        entry) give the UTF-8 of their decode; an unknown id gives b"" (decode drops it)."""
        added = self._added_token_bytes.get(token_id)
        if added is not None:
            return added
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL_ALPHABET for c in piece):
            return bytes(_BYTE_LEVEL_ALPHABET[c] for c in piece)
        if self._byte_fallback and (match := _BYTE_FALLBACK_PIECE.fullmatch(piece)):
            return bytes([int(match[1], 16)])
        if not self._byte_level and "\u2581" in piece:
            # SentencePiece's word-start marker: a space a lone decode would strip
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # --- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation, rendered by the model's chat template as
        transformers' `apply_chat_template(..., tokenize=False)` renders it.

        `chat_template` names one of the model's templates, or is a template itself; by
        default the model's ("tool_use" when `tools` are given and the model has one).
        `continue_final_message`: the prompt ends where the last message's text does (no
        end-of-turn after it), so that the model continues that message; only with
        `add_generation_prompt` False. Other keyword arguments become template variables,
        as do the named special tokens. Raises ValueError (ChatTemplateError) when the
        model has no chat template, on an empty or malformed conversation, and when the
        template refuses it.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: not with add_generation_prompt (the model "
                "continues the last message instead of starting a new one)"
            )
        source, origin = self._select_chat_template(chat_template, tools)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = compile_chat_template(source, origin=origin)
        _check_tools_and_documents(tools, documents)
        variables = {**self._named_special_tokens, **plain_data(kwargs)}
        variables.update(
            messages=normalize_messages(messages),
            tools=plain_data(None if tools is None else list(tools)),
            documents=plain_data(None if documents is None else list(documents)),
            add_generation_prompt=add_generation_prompt,
        )
        if not continue_final_message:
            return render_chat_template(template, variables)
        final = tag_final_message(variables["messages"], source)
        return cut_at_final_message(render_chat_template(template, variables), final)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_special_tokens: bool | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation (see `apply_chat_template`).

        `add_special_tokens=None` (the default) adds the BOS that `encode` would add unless
        the rendered text already starts with it, so the prompt never holds two; False encodes
        the text alone (transformers' `apply_chat_template(tokenize=True)`); True adds
        whatever the post-processor adds.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt, tools, documents=documents, chat_template=chat_template, **kwargs
        )
        if add_special_tokens is not None:
            return self.encode(text, add_special_tokens=add_special_tokens)
        ids = self.encode(text, add_special_tokens=False)
        if (
            self._encode_adds_bos
            and self._bos_token_id is not None
            and not (self.bos_token and text.startswith(self.bos_token))
        ):
            ids.insert(0, self._bos_token_id)
        return ids

    def chat_template_reads_content_parts(self, tools: Sequence[Any] | None = None) -> bool:
        """Whether the template a conversation with `tools` gets loops over a message's content
        (OpenAI's list of parts); False without a template. See `reads_content_parts`."""
        if not self._chat_templates:
            return False
        source, _ = self._select_chat_template(None, tools)
        reads = self._reads_content_parts.get(source)
        if reads is None:
            reads = self._reads_content_parts[source] = reads_content_parts(source)
        return reads

    def _select_chat_template(self, chat_template: str | None, tools: Sequence[Any] | None) -> tuple[str, str]:
        """(source, where it came from), chosen as transformers' `get_chat_template` does."""
        templates = self._chat_templates
        if chat_template is not None:
            if chat_template in templates:
                return templates[chat_template], self._chat_template_origins[chat_template]
            if "{" not in chat_template:  # a name, not a template (which would render as-is)
                raise ValueError(
                    f"chat_template: {chat_template!r} names none of the model's templates {sorted(templates)}"
                )
            return chat_template, "the chat_template argument"
        if not templates:
            raise ValueError(
                f"{self._model_dir}: the model has no chat template ({TOKENIZER_CONFIG_FILE} "
                f"has no chat_template and there is no {CHAT_TEMPLATE_FILE}); send a plain "
                f"prompt instead"
            )
        if len(templates) == 1 and "default" in templates:
            name = "default"
        elif tools is not None and "tool_use" in templates:
            name = "tool_use"
        elif "default" in templates:
            name = "default"
        else:
            raise ValueError(
                f"{self._model_dir}: the model has several chat templates "
                f"{sorted(templates)} and none named 'default'; name one"
            )
        return templates[name], self._chat_template_origins[name]


def _check_tools_and_documents(tools: Sequence[Any] | None, documents: Sequence[Any] | None) -> None:
    """ValueError naming the entry when `tools` or `documents` are not lists of mappings."""
    if tools is not None:
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise ValueError("tools: must be a list of JSON-schema objects")
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ValueError(f"tools[{i}]: must be a JSON-schema object, got {type(tool).__name__}")
    if documents is not None:
        for i, document in enumerate(documents):
            if not isinstance(document, Mapping):
                raise ValueError(f"documents[{i}]: must be an object, got {type(document).__name__}")
