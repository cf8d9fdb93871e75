"""gpt-oss's Harmony format for tests: a small tokenizer with its special tokens and chat
template, and replies recorded as gpt-oss writes them.

`write_harmony_tokenizer(model_dir)` turns any tiny checkpoint folder (one from
`model_factory`, or a tiny `GptOssForCausalLM` that transformers wrote) into one that speaks
Harmony: a byte-level BPE whose first ids are gpt-oss's special tokens, the real gpt-oss
chat template (tests/fixtures/chat_templates/gpt_oss.jinja), and gpt-oss's stop tokens
(`<|return|>`, `<|endoftext|>`, `<|call|>`, as its generation_config.json lists them). The
vocabulary fills the checkpoint's `vocab_size`, so the model's embedding fits it.

`RECORDED`: replies as the gateway's text holds them (markers kept; the stop token
`<|return|>` or `<|call|>` left out, as a stop token's text is), with what each parser
gives back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "gpt_oss.jinja"

# gpt-oss's special tokens (o200k_harmony's names), at ids 0..8 here, in this order
STARTOFTEXT = "<|startoftext|>"
ENDOFTEXT = "<|endoftext|>"
RETURN = "<|return|>"
CONSTRAIN = "<|constrain|>"
CHANNEL = "<|channel|>"
START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CALL = "<|call|>"
SPECIAL_TOKENS = (STARTOFTEXT, ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL)
STOP_TOKENS = (RETURN, ENDOFTEXT, CALL)  # gpt-oss's generation_config.json eos_token_id, in its order


def write_harmony_tokenizer(model_dir: str | Path, vocab_size: int | None = None) -> dict[str, int]:
    """Gives the checkpoint in `model_dir` gpt-oss's tokens and template (the module's
    docstring); returns each special token's id. `vocab_size`: the tokenizer's size (default:
    config.json's)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    size = vocab_size or config["vocab_size"]
    if size > config["vocab_size"]:
        raise ValueError(f"vocab_size: {size} exceeds the model's {config['vocab_size']}")
    backend = _train_bpe(size)
    backend.save(str(model_dir / "tokenizer.json"))
    ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    template = TEMPLATE_PATH.read_text(encoding="utf-8")
    named = {"bos_token": STARTOFTEXT, "eos_token": RETURN, "pad_token": ENDOFTEXT}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in named.values()],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 4096),
        "chat_template": template,
    }
    _write_json(model_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        model_dir / "special_tokens_map.json",
        {**named, "additional_special_tokens": tokenizer_config["additional_special_tokens"]},
    )
    (model_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    generation = model_dir / "generation_config.json"
    generation_config = json.loads(generation.read_text()) if generation.exists() else {}
    generation_config.update(
        bos_token_id=ids[STARTOFTEXT], eos_token_id=[ids[t] for t in STOP_TOKENS], pad_token_id=ids[ENDOFTEXT]
    )
    _write_json(generation, generation_config)
    config.update(bos_token_id=ids[STARTOFTEXT], eos_token_id=ids[RETURN], pad_token_id=ids[ENDOFTEXT])
    _write_json(model_dir / "config.json", config)
    return ids


def _train_bpe(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` tokens, the special tokens first, trained on
    CPython's pydoc text (as wiring.tiny_model's)."""
    from pydoc_data import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([topics.topics[key] for key in sorted(topics.topics)], trainer=trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size: the training text yields {backend.get_vocab_size()} tokens, not {vocab_size}")
    if [backend.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("the BPE trainer did not put the special tokens first")
    return backend


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------ recorded replies


@dataclass(frozen=True)
class Recorded:
    """A reply as the gateway's text holds it, and what the parsers give: `reasoning`
    (openai_gptoss), `content` and `calls` ((name, arguments); both parsers, or `openai`
    alone), `content_unread` (openai_gptoss alone: a call's arguments are content)."""

    text: str
    reasoning: str | None
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()
    content_unread: str | None = None  # None: the same as `content`, which has no call's arguments

    @property
    def reasoning_only_content(self) -> str | None:
        return self.content if self.content_unread is None else self.content_unread


def _message(header: str, body: str, end: str = END) -> str:
    return f"{START}assistant{header}{MESSAGE}{body}{end}"


_PARIS = '{"location":"Paris"}'
RECORDED: dict[str, Recorded] = {
    "reasoning_and_final": Recorded(
        f'{CHANNEL}analysis{MESSAGE}The user asks "What is 2+2?". Simple arithmetic: 2+2 = 4. '
        f"Provide the answer.{END}{START}assistant{CHANNEL}final{MESSAGE}2 + 2 = **4**.",
        'The user asks "What is 2+2?". Simple arithmetic: 2+2 = 4. Provide the answer.',
        "2 + 2 = **4**.",
    ),
    "final_only": Recorded(
        f"{CHANNEL}final{MESSAGE}Hello! How can I help you today? Grüße, 世界 🌍",
        None,
        "Hello! How can I help you today? Grüße, 世界 🌍",
    ),
    "reasoning_and_call": Recorded(
        f"{CHANNEL}analysis{MESSAGE}The user wants the current weather in Paris. We have a get_weather "
        f'function. Call it with location "Paris".{END}'
        f"{START}assistant{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json{MESSAGE}{_PARIS}",
        'The user wants the current weather in Paris. We have a get_weather function. Call it with location "Paris".',
        None,
        (("get_weather", _PARIS),),
        content_unread=_PARIS,
    ),
    "two_calls": Recorded(
        f"{CHANNEL}analysis{MESSAGE}Need the weather in both cities: call get_weather twice.{END}"
        + _message(f"{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json", _PARIS, CALL)
        + f"{START}assistant{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json{MESSAGE}"
        '{"location":"Tokyo","unit":"celsius"}',
        "Need the weather in both cities: call get_weather twice.",
        None,
        (("get_weather", _PARIS), ("get_weather", '{"location":"Tokyo","unit":"celsius"}')),
        content_unread=_PARIS + '\n{"location":"Tokyo","unit":"celsius"}',
    ),
    "preamble_then_call": Recorded(
        f"{CHANNEL}analysis{MESSAGE}User wants a 3-day forecast. Tell them, then call get_forecast.{END}"
        + _message(f"{CHANNEL}commentary", "Let me check the forecast for Paris.")
        + f"{START}assistant{CHANNEL}commentary to=functions.get_forecast {CONSTRAIN}json{MESSAGE}"
        '{"city": "Paris", "days": 3}',
        "User wants a 3-day forecast. Tell them, then call get_forecast.",
        "Let me check the forecast for Paris.",
        (("get_forecast", '{"city": "Paris", "days": 3}'),),
        content_unread='Let me check the forecast for Paris.\n{"city": "Paris", "days": 3}',
    ),
    "cut_short_thinking": Recorded(  # max_tokens reached mid-analysis
        f"{CHANNEL}analysis{MESSAGE}We need the sum of the first 10 primes: 2, 3, 5, 7, 11, 13",
        "We need the sum of the first 10 primes: 2, 3, 5, 7, 11, 13",
        None,
    ),
    "cut_short_call": Recorded(  # max_tokens reached inside the call's JSON: no call, no content
        f"{CHANNEL}analysis{MESSAGE}Call get_weather.{END}"
        f'{START}assistant{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json{MESSAGE}{{"location":"Pa',
        "Call get_weather.",
        None,
        content_unread='{"location":"Pa',
    ),
    "recipient_before_channel": Recorded(  # as the template writes past calls; no arguments
        f"{CHANNEL}analysis{MESSAGE}Just call get_time.{END}"
        f"{START}assistant to=functions.get_time{CHANNEL}commentary json{MESSAGE}{{}}{CALL}",
        "Just call get_time.",
        None,
        (("get_time", "{}"),),
        content_unread="{}",
    ),
    "stop_tokens_kept": Recorded(  # include_stop_str_in_output, or no stop token set
        f"{CHANNEL}analysis{MESSAGE}Greet back.{END}{START}assistant{CHANNEL}final{MESSAGE}Hi!{RETURN}",
        "Greet back.",
        "Hi!",
    ),
    "two_analyses": Recorded(  # a built-in tool's call in analysis is reasoning too
        f"{CHANNEL}analysis{MESSAGE}First thought.{END}"
        + _message(f"{CHANNEL}analysis to=python", "print(6 * 7)", CALL)
        + f"{START}assistant{CHANNEL}final{MESSAGE}42",
        "First thought.\nprint(6 * 7)",
        "42",
    ),
}
