"""gateway.parsers reasoning parsers (issue 28, reasoning output): `<think>...</think>` read
out of replies written as the models write them, whole and streamed in every split."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.parsers import REASONING_PARSERS, ReasoningDelta, reasoning_parser

R1_REPLY = "<think>\nThe user asks for 2 + 2. That is 4.\n</think>\n\n2 + 2 = 4."

# (reply, deepseek_r1's (reasoning, content), qwen3's)
REPLIES = [
    (
        R1_REPLY,
        ("\nThe user asks for 2 + 2. That is 4.\n", "\n\n2 + 2 = 4."),
        ("\nThe user asks for 2 + 2. That is 4.\n", "\n\n2 + 2 = 4."),
    ),
    # the template put <think> in the prompt
    ("Okay, so 2 + 2.\n</think>\n\n4.", ("Okay, so 2 + 2.\n", "\n\n4."), (None, "Okay, so 2 + 2.\n</think>\n\n4.")),
    # cut short while thinking: no </think>
    ("<think>\nLet me think about this", ("\nLet me think about this", None), ("\nLet me think about this", None)),
    ("Let me think about this", ("Let me think about this", None), (None, "Let me think about this")),
    ("<think>\nDone.\n</think>", ("\nDone.\n", None), ("\nDone.\n", None)),
    ("<think>\n\n</think>\n\nHello!", ("\n\n", "\n\nHello!"), ("\n\n", "\n\nHello!")),
    ("<think></think>Hello!", (None, "Hello!"), (None, "Hello!")),
    ("\n<think>x</think>y", ("x", "y"), ("x", "y")),
    ("a <think>b</think>c", ("a <think>b", "c"), (None, "a <think>b</think>c")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    (
        "<think>I could say </thought> here</think>ok",
        ("I could say </thought> here", "ok"),
        ("I could say </thought> here", "ok"),
    ),
    ("<thinking>x", ("<thinking>x", None), (None, "<thinking>x")),
    ("<thi", ("<thi", None), (None, "<thi")),
    ("  ", ("  ", None), (None, "  ")),
    ("", (None, None), (None, None)),
]


def streamed(name: str, deltas: list[str]) -> tuple[str | None, str | None]:
    stream = reasoning_parser(name).stream()
    out = [stream.feed(delta) for delta in deltas] + [stream.finish()]
    reasoning = "".join(piece.reasoning or "" for piece in out)
    content = "".join(piece.content or "" for piece in out)
    return reasoning or None, content or None


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if text else []
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def chunkings(text: str, seed: int = 0, num_random: int = 8):
    """The whole text, 1-character deltas, every split in two, and random chunkings."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(num_random):
        yield random_chunks(text, rng)


@pytest.mark.parametrize(("reply", "r1", "qwen3"), REPLIES)
def test_extract_reads_recorded_replies(reply, r1, qwen3):
    assert reasoning_parser("deepseek_r1").extract(reply) == r1
    assert reasoning_parser("qwen3").extract(reply) == qwen3


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("reply", [reply for reply, _, _ in REPLIES])
def test_streaming_in_every_split_gives_what_extract_gives(name, reply):
    expected = reasoning_parser(name).extract(reply)
    for deltas in chunkings(reply, seed=len(reply)):
        assert streamed(name, deltas) == expected, deltas


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("reply", [reply for reply, _, _ in REPLIES])
def test_streaming_a_reply_cut_anywhere_gives_what_extract_gives(name, reply):
    rng = random.Random(3)
    for end in range(len(reply) + 1):
        cut = reply[:end]
        assert streamed(name, random_chunks(cut, rng)) == reasoning_parser(name).extract(cut)


@given(
    st.sampled_from(sorted(REASONING_PARSERS)),
    st.lists(
        st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "<", ">", " ", "\n", "a", "think"]), max_size=12
    ),
    st.randoms(use_true_random=False),
)
def test_any_text_in_any_chunking_streams_as_extract_reads_it(name, fragments, rng):
    reply = "".join(fragments)
    assert streamed(name, random_chunks(reply, rng)) == reasoning_parser(name).extract(reply)


def test_tags_split_across_deltas():
    stream = reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<thi") == ReasoningDelta(None, None)
    assert stream.feed("nk>Let me") == ReasoningDelta("Let me", None)
    assert stream.feed(" think.</th") == ReasoningDelta(" think.", None)
    assert stream.feed("ink>\n\nThe") == ReasoningDelta(None, "\n\nThe")
    assert stream.feed(" answer") == ReasoningDelta(None, " answer")
    assert stream.finish() == ReasoningDelta(None, None)


def test_without_the_opening_tag_deepseek_r1_streams_reasoning_at_once():
    stream = reasoning_parser("deepseek_r1").stream()
    assert stream.feed("Okay, so") == ReasoningDelta("Okay, so", None)
    assert stream.feed("</") == ReasoningDelta(None, None)
    assert stream.feed("b>") == ReasoningDelta("</b>", None)
    assert stream.feed("</think>4") == ReasoningDelta(None, "4")


def test_cut_short_while_thinking_the_held_tag_start_is_reasoning():
    stream = reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<think>hmm</thi") == ReasoningDelta("hmm", None)
    assert stream.finish() == ReasoningDelta("</thi", None)


def test_qwen3_without_the_opening_tag_streams_content():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("\n") == ReasoningDelta(None, None)
    assert stream.feed("Hello") == ReasoningDelta(None, "\nHello")
    assert stream.feed("</think>") == ReasoningDelta(None, "</think>")


def test_unknown_parser_names_the_known_ones():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "openai_gptoss", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")
