"""Log-probability tokens in the OpenAI responses: a token that holds only part of a UTF-8
character is shown by its bytes ("bytes:\\xe2\\x80"), never as an anonymous U+FFFD, so no two
alternatives at one position collide; chat entries carry each token's raw `bytes`; streamed
and whole responses agree.

Token ids come from the tiny models' byte-level BPE (256 single-byte tokens, merges such as
"\\xe2\\x80" and "’"), through the real `TextGenerator` over a scripted scheduler stream.
"""

from __future__ import annotations

import asyncio
import codecs
import json

import httpx2 as httpx
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st
from support.scripted_call import ScriptedCall, script_scheduler
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from gateway import openai_format as fmt
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.core import TextGenerator
from gateway.generation import ChoiceDelta, TokenLogprob, TopToken
from gateway.grpc_api import response_from_delta
from services.pb import common_pb2, scheduler_pb2
from services.text import Tokenizer
from services.text.tokenizer import _BYTE_LEVEL_ALPHABET
from wiring.tiny_model import EOS_TOKEN, IM_END_TOKEN_ID, SPECIAL_TOKENS

ARCHS = ("llama", "qwen2")  # GPT-2's pre-tokenizer; Qwen2's split regex and NFC


@pytest.fixture(scope="module")
def toks(model_factory) -> dict[str, Tokenizer]:
    return {arch: Tokenizer(model_factory(arch=arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def tok(toks) -> Tokenizer:
    return toks["llama"]


def ids_by_bytes(tok: Tokenizer) -> dict[bytes, int]:
    return {tok.token_bytes(i): i for i in range(tok.vocab_size)}


def label(tok: Tokenizer, token_id: int) -> str:
    """The token's text in a response, built as the gateway builds it (TextGenerator._token)."""
    return fmt.token_label(*TextGenerator("unused:1", tok, 64)._token(token_id))


def escaped(raw: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# --- the token's bytes and text ------------------------------------------------------------


def test_byte_alphabet_is_gpt2s() -> None:
    assert set(_BYTE_LEVEL_ALPHABET) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_BYTE_LEVEL_ALPHABET.values()) == list(range(256))
    assert _BYTE_LEVEL_ALPHABET["Ġ"] == ord(" ") and _BYTE_LEVEL_ALPHABET["a"] == ord("a")


@pytest.mark.parametrize("arch", ARCHS)
def test_token_bytes_cover_the_vocabulary(arch, toks) -> None:
    tok = toks[arch]
    by_bytes = ids_by_bytes(tok)
    assert len(by_bytes) == tok.vocab_size  # distinct ids, distinct bytes
    assert all(bytes([b]) in by_bytes for b in range(256))  # the 256 byte tokens
    for token_id in range(tok.vocab_size):
        raw = tok.token_bytes(token_id)
        # the bytes are what decoding reads: lossily, the token's own decode
        assert raw.decode("utf-8", "replace") == tok.decode([token_id], skip_special_tokens=False)
        # ... and joined, what a sequence decodes to
    ids = tok.encode("naïve “quotes” 日本 🎉", add_special_tokens=False)
    assert b"".join(map(tok.token_bytes, ids)).decode() == tok.decode(ids)
    assert tok.token_bytes(tok.vocab_size + 7) == b""  # unknown: decode drops it


def test_labels_of_valid_and_partial_characters(tok) -> None:
    by_bytes = ids_by_bytes(tok)
    # a lone continuation byte and a lead byte: both decode to U+FFFD, labelled by their bytes
    for raw in (b"\x80", b"\x99", b"\xe2", b"\xf0", b"\xff"):
        assert tok.decode([by_bytes[raw]]) == "\ufffd"
        assert label(tok, by_bytes[raw]) == escaped(raw)
    assert label(tok, by_bytes[b"\xe2"]) == "bytes:\\xe2"
    # valid text is itself: ASCII, a space-led word, a newline
    for text in ("a", " ", "\n"):
        assert label(tok, by_bytes[text.encode()]) == text
    word = next(raw for raw in by_bytes if len(raw) > 2 and raw.startswith(b" ") and raw.isascii())
    assert label(tok, by_bytes[word]) == word.decode()
    # special tokens are spelled out
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_bytes(token_id) == token.encode()
        assert label(tok, token_id) == token
    # merges of several bytes >= 0x80: a whole character is text, a part of one is bytes
    merged = [raw for raw in by_bytes if len(raw) > 1 and max(raw) >= 0x80]
    whole = [raw for raw in merged if _is_utf8(raw)]
    partial = [raw for raw in merged if not _is_utf8(raw)]
    if not whole or not partial:
        pytest.skip("this vocabulary merges no multi-byte character (or no part of one)")
    for raw in whole:
        assert label(tok, by_bytes[raw]) == raw.decode()
    for raw in partial:
        assert label(tok, by_bytes[raw]) == escaped(raw)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_token_label_directly() -> None:
    assert fmt.token_label("\ufffd", b"\xe2\x80") == "bytes:\\xe2\\x80"
    assert fmt.token_label("’", "’".encode()) == "’"
    assert fmt.token_label("\ufffd", "\ufffd".encode()) == "\ufffd"  # a real U+FFFD is text
    assert fmt.token_label(EOS_TOKEN, EOS_TOKEN.encode()) == EOS_TOKEN
    assert fmt.token_label("x", None) == "x"  # no bytes given: the text's own
    assert fmt.token_label("", b"") == ""


@pytest.fixture(scope="module")
def byte_fallback_tok(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style tokenizer with byte fallback, as Llama 2's: `<0xNN>` pieces, a
    Metaspace-like normalizer and a decoder that strips the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld")]
    for piece in ["▁", "w", "o", "r", "l", "d", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    path = tmp_path_factory.mktemp("byte-fallback")
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(path)


def test_byte_fallback_pieces(byte_fallback_tok) -> None:
    tok = byte_fallback_tok
    lead, cont, letter = (tok.token_to_id(p) for p in ("<0xE2>", "<0x80>", "<0x41>"))
    assert (tok.token_bytes(lead), tok.token_bytes(cont), tok.token_bytes(letter)) == (b"\xe2", b"\x80", b"A")
    assert tok.decode([lead]) == tok.decode([cont]) == "\ufffd"
    assert (label(tok, lead), label(tok, cont), label(tok, letter)) == ("bytes:\\xe2", "bytes:\\x80", "A")
    world = tok.token_to_id("▁world")
    # a word keeps the space its "▁" stands for (a lone decode strips it)
    assert tok.token_bytes(world) == b" world" and label(tok, world) == " world"
    assert tok.token_bytes(1) == b"<s>" and label(tok, 1) == "<s>"
    # "’" falls back to its three bytes, which join into it
    ids = tok.encode("’", add_special_tokens=False)
    assert [tok.token_bytes(i) for i in ids[-3:]] == [b"\xe2", b"\x80", b"\x99"]
    # (the decoded text drops the text's first space, the "▁" SentencePiece puts in front)
    assert b"".join(map(tok.token_bytes, ids)).decode().removeprefix(" ") == tok.decode(ids) == "’"


# --- text offsets ----------------------------------------------------------------------------


def _char_starts(raw: bytes) -> list[int]:
    """The byte where each character of `raw`'s lossy decode starts; a U+FFFD's is where the
    bytes it replaces start."""
    replaced: dict[int, int] = {}

    def record(e: UnicodeDecodeError) -> tuple[str, int]:
        replaced[e.start] = e.end
        return "\ufffd", e.end

    codecs.register_error("test-logprob-tokens-record", record)
    text = raw.decode("utf-8", "test-logprob-tokens-record")
    assert text == raw.decode("utf-8", "replace")
    starts, pos = [], 0
    while pos < len(raw):
        starts.append(pos)
        if pos in replaced:
            pos = replaced[pos]
        else:  # a valid character: its length from its lead byte
            pos += 1 if raw[pos] < 0x80 else 2 if raw[pos] < 0xE0 else 3 if raw[pos] < 0xF0 else 4
    assert len(starts) == len(text)
    return starts


def _reference_offsets(tokens: list[bytes]) -> list[int]:
    """Each (non-empty) token's offset: the index of the character of the whole text's lossy
    decode that holds its first byte."""
    starts = _char_starts(b"".join(tokens))
    out, pos = [], 0
    for token in tokens:
        out.append(sum(1 for s in starts if s <= pos) - 1)
        pos += len(token)
    return out


_BYTES = st.sampled_from(
    [
        b"a",
        b" ",
        b"\xe2",
        b"\x80",
        b"\x99",
        b"\xf0",
        b"\x9f",
        b"\x8e",
        b"\x89",
        b"\xc3",
        b"\xa9",
        b"\xe0",
        b"\xff",
        b"\xef",
        b"\xbf",
        b"\xbd",
    ]
)
_TOKENS = st.lists(st.lists(_BYTES, min_size=1, max_size=3).map(b"".join), max_size=12)


def test_text_offsets_examples() -> None:
    def offsets(tokens: list[bytes]) -> list[int]:
        o = fmt.TextOffsets()
        return [o.advance(t) for t in tokens]

    assert offsets([b"he", b"llo"]) == [0, 2]
    assert offsets([b"a", b"\xe2", b"\x80", b"\x99", b"b"]) == [0, 1, 1, 1, 2]  # "a’b"
    assert offsets([b"\xe2", b"b"]) == [0, 1]  # "�b": the lone lead byte is one character
    assert offsets([b"\xe2\x80", b"\xe2", b"\x80\x99"]) == [0, 1, 1]  # "�’"
    assert offsets([b"\xe0", b"\x80"]) == [0, 1]  # overlong: two U+FFFD


@given(tokens=_TOKENS, cut=st.integers(0, 12))
def test_text_offsets_point_into_the_text_and_do_not_depend_on_chunks(tokens, cut) -> None:
    whole = fmt.TextOffsets()
    expected = [whole.advance(t) for t in tokens]
    text = b"".join(tokens).decode("utf-8", "replace")
    assert all(0 <= offset < len(text) for offset in expected) and expected == sorted(expected)
    assert expected == _reference_offsets(tokens)
    # the same tokens in two chunks, one TextOffsets kept across them: the same offsets
    chunked = fmt.TextOffsets()
    first = fmt.completion_logprobs(_plain(tokens[:cut]), chunked)["text_offset"]
    second = fmt.completion_logprobs(_plain(tokens[cut:]), chunked)["text_offset"]
    assert first + second == expected


def _plain(tokens: list[bytes]) -> list[TokenLogprob]:
    return [TokenLogprob(i, t.decode("utf-8", "replace"), -1.0, [], t) for i, t in enumerate(tokens)]


# --- the responses ---------------------------------------------------------------------------


def test_completion_top_logprobs_keep_every_alternative(tok) -> None:
    by_bytes = ids_by_bytes(tok)
    alternatives = [by_bytes[b"\xe2"], by_bytes[b"\x80"], by_bytes[b"\x99"], by_bytes[b"a"]]
    sampled = by_bytes[b"\x80"]
    resp = scheduler_pb2.GenerateResponse(token_ids=[sampled])
    entry = resp.logprobs.add()
    entry.sampled.token_id, entry.sampled.logprob = sampled, -1.5
    for rank, token_id in enumerate(alternatives, 1):
        entry.top.add(token_id=token_id, logprob=-0.5 * rank, rank=rank)
    generator = TextGenerator("unused:1", tok, 64)
    [lp] = generator._logprobs(resp.logprobs, [sampled])
    assert lp.token == "\ufffd" and lp.token_bytes == b"\x80"
    assert [t.token for t in lp.top] == ["\ufffd"] * 3 + ["a"]  # what a per-token decode gives

    body = fmt.completion_logprobs([lp])
    assert body["tokens"] == ["bytes:\\x80"]
    assert body["top_logprobs"] == [{"bytes:\\xe2": -0.5, "bytes:\\x80": -1.0, "bytes:\\x99": -1.5, "a": -2.0}]
    assert body["token_logprobs"] == [-1.5]  # the sampled token's own, as the scheduler sent it

    chat = fmt.chat_logprobs([lp])["content"]
    assert chat == [
        {
            "token": "bytes:\\x80",
            "logprob": -1.5,
            "bytes": [0x80],
            "top_logprobs": [
                {"token": "bytes:\\xe2", "logprob": -0.5, "bytes": [0xE2]},
                {"token": "bytes:\\x80", "logprob": -1.0, "bytes": [0x80]},
                {"token": "bytes:\\x99", "logprob": -1.5, "bytes": [0x99]},
                {"token": "a", "logprob": -2.0, "bytes": [ord("a")]},
            ],
        }
    ]


def test_alternatives_with_the_same_text_keep_the_likelier() -> None:
    # two ids that decode to the same valid text (different merges of one string)
    lp = TokenLogprob(9, "ab", -3.0, [TopToken(7, "ab", -2.0), TopToken(8, "ab", -1.0), TopToken(6, "c", -2.5)])
    assert fmt.completion_logprobs([lp])["top_logprobs"] == [{"ab": -1.0, "c": -2.5}]


# --- whole and streamed responses, through the app ------------------------------------------


class _ScriptedScheduler:
    def __init__(self, script) -> None:
        self.script = script

    def Generate(self, request, metadata=None):  # noqa: N802 (gRPC's spelling)
        return ScriptedCall(self.script(request))


def _script(chunks: list[list[int]], alternatives: list[int]):
    """Each chunk one response; every token's alternatives are `alternatives`, the likeliest
    first, with the sampled token's own logprob from its rank there (or -9 outside)."""

    def script(request) -> list[scheduler_pb2.GenerateResponse]:
        want = request.sampling_params.HasField("logprobs")
        responses = []
        for i, chunk in enumerate(chunks):
            resp = scheduler_pb2.GenerateResponse(request_id=request.request_id, token_ids=chunk)
            for token_id in chunk:
                if not want:
                    continue
                entry = resp.logprobs.add()
                entry.sampled.token_id = token_id
                entry.sampled.logprob = next((-0.25 * r for r, t in enumerate(alternatives, 1) if t == token_id), -9.0)
                for rank, t in enumerate(alternatives[: request.sampling_params.logprobs], 1):
                    entry.top.add(token_id=t, logprob=-0.25 * rank, rank=rank)
            if i == len(chunks) - 1:
                resp.finish_reason = common_pb2.FINISH_REASON_LENGTH
                resp.usage.num_prompt_tokens = len(request.prompt_token_ids)
                resp.usage.num_completion_tokens = sum(map(len, chunks))
            responses.append(resp)
        return responses

    return script


def _post_both(tok: Tokenizer, script, path: str, body: dict) -> tuple[dict, list[dict]]:
    """(the whole response, the stream's chunks) of one request, over the scripted stream."""
    generator = TextGenerator("unused:1", tok, 256)
    script_scheduler(generator, _ScriptedScheduler(script))
    config = GatewayConfig(
        model=str(tok.model_dir), scheduler_address="unused:1", served_model_names=("tiny",), max_model_len=256
    )
    app = create_app(config, generator)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            whole = await client.post(path, json=body)
            stream = await client.post(path, json={**body, "stream": True})
        return whole, stream

    whole, stream = asyncio.run(go())
    assert whole.status_code == stream.status_code == 200, (whole.text, stream.text)
    events = [e[len("data: ") :] for e in stream.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return whole.json(), [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def scripted(tok):
    """Output "a’�b" in 4 responses, as byte tokens ("’" split over three, a lone lead byte),
    each position offering the same alternatives: three tokens that decode to U+FFFD, a merge
    of two bytes if the vocabulary has one, "a" and "b"."""
    by_bytes = ids_by_bytes(tok)
    b = {raw: by_bytes[raw] for raw in (b"a", b"b", b"\xe2", b"\x80", b"\x99")}
    chunks = [[b[b"a"], b[b"\xe2"]], [b[b"\x80"]], [b[b"\x99"], b[b"\xe2"]], [b[b"b"]]]
    alternatives = [b[b"\xe2"], b[b"\x80"], b[b"\x99"], b[b"a"], b[b"b"]]
    if b"\xe2\x80" in by_bytes:
        alternatives.insert(3, by_bytes[b"\xe2\x80"])
    return chunks, alternatives


def test_completions_whole_and_streamed_agree(tok, scripted) -> None:
    chunks, alternatives = scripted
    whole, events = _post_both(
        tok,
        _script(chunks, alternatives),
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 5, "logprobs": 5},
    )
    [choice] = whole["choices"]
    assert choice["text"] == "a’\ufffdb"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "bytes:\\xe2", "bytes:\\x80", "bytes:\\x99", "bytes:\\xe2", "b"]
    assert lp["text_offset"] == [0, 1, 1, 1, 2, 3]
    assert [choice["text"][o] for o in lp["text_offset"]] == ["a", "’", "’", "’", "\ufffd", "b"]
    # every alternative keeps its own key: 5 asked, plus the sampled token where it is not among them
    labels = [label(tok, t) for t in alternatives[:5]]
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert list(top)[:5] == labels and len(top) == 5 + (token not in labels)

    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        for c in event["choices"]:
            for key in streamed:
                streamed[key] += (c["logprobs"] or {}).get(key, [])
    assert streamed == lp
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]


def test_chat_whole_and_streamed_agree(tok, scripted) -> None:
    chunks, alternatives = scripted
    whole, events = _post_both(
        tok,
        _script(chunks, alternatives),
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 4,
        },
    )
    [choice] = whole["choices"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == ["a", "bytes:\\xe2", "bytes:\\x80", "bytes:\\x99", "bytes:\\xe2", "b"]
    assert [e["bytes"] for e in content] == [[0x61], [0xE2], [0x80], [0x99], [0xE2], [0x62]]
    assert (
        bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace")
        == choice["message"]["content"]
        == "a’\ufffdb"
    )
    for e in content:
        tops = e["top_logprobs"]
        assert [t["token"] for t in tops] == [label(tok, t) for t in alternatives[:4]]
        assert [bytes(t["bytes"]) for t in tops] == [tok.token_bytes(t) for t in alternatives[:4]]
        assert len({t["token"] for t in tops}) == 4
    streamed = [e for event in events for c in event["choices"] for e in ((c["logprobs"] or {}).get("content") or [])]
    assert streamed == content


def test_special_tokens_in_logprobs_are_spelled_out(tok) -> None:
    by_bytes = ids_by_bytes(tok)
    chunks = [[by_bytes[b"a"]], [IM_END_TOKEN_ID]]
    whole, _ = _post_both(
        tok,
        _script(chunks, [IM_END_TOKEN_ID, by_bytes[b"a"]]),
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = whole["choices"][0]["logprobs"]["content"]
    assert content[1]["token"] == "<|im_end|>" and bytes(content[1]["bytes"]) == b"<|im_end|>"
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<|im_end|>", "a"]


def test_grpc_api_keeps_the_decoded_text_and_the_ids(tok) -> None:
    """pagoda.v1.Generation names every token by id: its `token` stays the plain decode."""
    by_bytes = ids_by_bytes(tok)
    lead, cont = by_bytes[b"\xe2"], by_bytes[b"\x80"]
    lp = TokenLogprob(
        cont,
        "\ufffd",
        -1.0,
        [TopToken(lead, "\ufffd", -0.5, b"\xe2"), TopToken(cont, "\ufffd", -1.0, b"\x80")],
        b"\x80",
    )
    msg = response_from_delta("r", ChoiceDelta(0, "", [cont], [lp]))
    [entry] = msg.choices[0].logprobs
    assert (entry.token_id, entry.token) == (cont, "\ufffd")
    assert [(t.token_id, t.token, t.logprob) for t in entry.top] == [(lead, "\ufffd", -0.5), (cont, "\ufffd", -1.0)]
