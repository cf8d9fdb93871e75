"""Sampling, torch-free: one type for every layer.

`SamplingOptions` is a request's sampling: built and checked where a request enters (the
gateway's two front doors, `LLM.generate`, the scheduler reading the wire), carried on the
wire by its one codec (`services.sampling_pb`), and admitted against the model's and the
server's limits by one check (`services.admission`). `SamplingParams` is the view of it the
stages sample with, derived once per request (`sampling_params`) with the model's EOS ids
inside, and carried to them once per sequence by the same codec.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 65536  # a schema, regex or grammar's text (both front doors)
MAX_CHOICES = 256
# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per position a request may ask for (as OpenAI)
MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI
_WIRE_INT = 2**32  # counts and token ids travel as uint32
# real numbers travel as float32: a larger one would arrive as inf (and be refused by the
# scheduler, naming its own field instead of the request's)
_WIRE_FLOAT_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a choice may generate (structured output), applied by the last
    stage's sampler as a token mask each step (`services.grammar` turns it into a grammar).

    kind: "json_schema" (`spec`: a JSON Schema as JSON text), "json_object" (any JSON
    object; `spec` empty), "regex" (`spec`: a regular expression the whole output matches),
    "choice" (`choices`: the output is exactly one of them), "grammar" (`spec`: a Lark or
    GBNF grammar). The text is bounded here (MAX_STRUCTURED_CHARS, MAX_CHOICES); whether it
    compiles is checked where a request enters (`services.grammar.check`).
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output: kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"structured_output: the {self.kind} may have at most {MAX_STRUCTURED_CHARS} characters")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"structured_output: choice needs 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("structured_output: choices must be non-empty strings")
            if sum(map(len, self.choices)) > MAX_STRUCTURED_CHARS:
                raise ValueError(
                    f"structured_output: choices may have at most {MAX_STRUCTURED_CHARS} characters together"
                )
        elif self.choices:
            raise ValueError(f"structured_output: choices are only for kind 'choice', not {self.kind!r}")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured_output: the {self.kind} is empty")


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(x: float) -> str:
    if is_int(x) and x >= 2**16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The numbers one field may hold. The bounds are named as pydantic names them (`ge`, `gt`,
    `le`, `lt`; None: unbounded), so that the REST model takes its bounds from here (`bounds`)."""

    integer: bool = False  # an int (a bool is not one); otherwise any finite number
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __contains__(self, value: object) -> bool:
        if not (is_int(value) if self.integer else _is_real(value) and math.isfinite(value)):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    @property
    def bounds(self) -> dict[str, float]:
        """As keyword arguments to pydantic's `Field`."""
        return {k: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}

    def __str__(self) -> str:
        """What a value must be, as an error says it: "an int in [0, 2**32)", "in (0, 1]"."""
        low, high = (self.ge if self.gt is None else self.gt), (self.le if self.lt is None else self.lt)
        if low is not None and high is not None:
            interval = (
                f"in {'(' if self.gt is not None else '['}{_number(low)}, "
                f"{_number(high)}{')' if self.lt is not None else ']'}"
            )
            return f"an int {interval}" if self.integer else interval
        kind = "an int" if self.integer else "a finite number"
        if low is not None:
            return f"{kind} {'>' if self.gt is not None else '>='} {_number(low)}"
        return kind if high is None else f"{kind} {'<' if self.lt is not None else '<='} {_number(high)}"


# What each number a request's sampling holds may be: one table for the type, its stage
# view and the REST model's bounds.
RANGES: dict[str, Range] = {
    "n": Range(True, ge=1, lt=_WIRE_INT),
    "max_tokens": Range(True, ge=1, lt=_WIRE_INT),
    "min_tokens": Range(True, ge=0, lt=_WIRE_INT),
    "temperature": Range(ge=0.0, le=_WIRE_FLOAT_MAX),
    "top_p": Range(gt=0.0, le=1.0),
    "top_k": Range(True, ge=0, lt=_WIRE_INT),  # 0: off
    "min_p": Range(ge=0.0, le=1.0),
    "seed": Range(True, ge=0, lt=2**64),
    "logprobs": Range(True, ge=0, le=MAX_LOGPROBS),
    "presence_penalty": Range(ge=-2.0, le=2.0),
    "frequency_penalty": Range(ge=-2.0, le=2.0),
    "repetition_penalty": Range(gt=0.0, le=2.0),
    "prompt_logprobs": Range(True, ge=0, le=MAX_LOGPROBS),
    "num_logprobs": Range(True, ge=0),  # a stage returns any number asked (at most its vocabulary)
}
_MAY_BE_NONE = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs", "num_logprobs"})
LOGIT_BIAS_RANGE = Range(ge=-100.0, le=100.0)  # each token's bias


def _check_ranges(obj: object, names: Iterable[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None and name in _MAY_BE_NONE:
            continue
        if value not in RANGES[name]:
            none = "None or " if name in _MAY_BE_NONE else ""
            raise ValueError(f"{name}: must be {none}{RANGES[name]}, got {value!r}")


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name}: must be a tuple of token ids, got {ids!r}")
    ids = tuple(ids)
    if not all(is_int(i) and 0 <= i < _WIRE_INT for i in ids):
        raise ValueError(f"{name}: token ids must be non-negative ints below 2**32, got {ids!r}")
    return ids


def _logit_bias(pairs: object) -> tuple[tuple[int, float], ...]:
    pairs = tuple(pairs)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(pairs)}")
    bias = tuple(sorted((int(t), float(b)) for t, b in dict(pairs).items()))
    if len(bias) != len(pairs):
        raise ValueError("logit_bias: a token id appears twice")
    for token_id, value in bias:
        if token_id < 0:
            raise ValueError(f"logit_bias: token id {token_id} is negative")
        if value not in LOGIT_BIAS_RANGE:
            raise ValueError(
                f"logit_bias: bias {value} for token {token_id} is outside "
                f"[{_number(LOGIT_BIAS_RANGE.ge)}, {_number(LOGIT_BIAS_RANGE.le)}]"
            )
    return bias


@dataclass(frozen=True)
class SamplingOptions:
    """A request's sampling, as every layer sees it: built and checked where a request enters
    (the gateway from its REST and gRPC models, `LLM.generate` from the caller, the scheduler
    from the wire), carried to the scheduler as `pagoda.v1.SamplingParams`
    (`services.sampling_pb`), admitted against the limits (`services.admission.admit`), and
    turned into what each choice samples with (`sampling_params`) once per request. Invalid
    values raise `ValueError` naming the field first (`"top_p: must be in (0, 1], got 2"`);
    the bounds are `RANGES`.

    `max_tokens` None means the rest of the context; the scheduler resolves it against
    `max_model_len` when it admits the request (`resolve_max_tokens`). top_k 0 means off.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    prompt_logprobs: int | None = None  # score the prompt, with this many alternatives
    structured: StructuredOutput | None = None  # structured output: a grammar to follow

    # the numbers checked against RANGES, in this order
    _RANGED: ClassVar[tuple[str, ...]] = (
        "n",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "prompt_logprobs",
    )

    def __post_init__(self) -> None:
        _check_ranges(self, self._RANGED)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured: must be None or a StructuredOutput, got {self.structured!r}")
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    def resolve_max_tokens(self, room: int) -> SamplingOptions:
        """With `max_tokens` None: as many as `room` (the context left after the prompt)."""
        return self if self.max_tokens is not None else replace(self, max_tokens=room)

    @property
    def uses_penalties(self) -> bool:
        """The stages' sampler then needs each sequence's history (prompt and output)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Penalties and a grammar (whose state is rebuilt from the output so far) need the
        sequence's history on its first sampling row."""
        return self.uses_penalties or self.structured is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


# What only the scheduler acts on; the stages' view leaves them out (1, None, None there).
_SCHEDULER_FIELDS = ("n", "max_tokens", "prompt_logprobs")
# What one choice samples with, by its `SamplingOptions` name (logprobs is the view's num_logprobs).
CHOICE_FIELDS = tuple(f.name for f in fields(SamplingOptions) if f.name not in (*_SCHEDULER_FIELDS, "logprobs"))


@dataclass(frozen=True, init=False)
class SamplingParams(SamplingOptions):
    """How one choice of a request picks its next token: the stages' view of its request's
    `SamplingOptions` (`sampling_params` derives it), the model's EOS ids inside. What only
    the scheduler acts on is left out (n 1, max_tokens and prompt_logprobs None). The view
    names logprobs `num_logprobs`: how many alternatives the last stage returns, any number
    (its vocabulary bounds them; a request asks for at most MAX_LOGPROBS).

    Stop and EOS ids are masked while fewer than min_tokens tokens have been generated; with
    ignore_eos, EOS ids are not stops, so they are never masked. Built by keyword (or by
    `sampling_params`), not by `dataclasses.replace`.
    """

    eos_token_ids: tuple[int, ...] = ()

    _RANGED: ClassVar[tuple[str, ...]] = tuple(
        "num_logprobs" if name == "logprobs" else name for name in SamplingOptions._RANGED
    )

    def __init__(self, *, eos_token_ids: Iterable[int] = (), num_logprobs: int | None = None, **choice: Any) -> None:
        """`choice`: any of CHOICE_FIELDS, by name; ValueError naming the field."""
        object.__setattr__(self, "eos_token_ids", _token_ids("eos_token_ids", eos_token_ids))
        super().__init__(n=1, max_tokens=None, logprobs=num_logprobs, prompt_logprobs=None, **choice)

    @property
    def num_logprobs(self) -> int | None:
        """None: none returned; 0: the sampled token's only."""
        return self.logprobs

    @property
    def min_tokens_masked_ids(self) -> tuple[int, ...]:
        """Ids that may not be sampled before min_tokens tokens exist: stops, and EOS unless ignored."""
        if self.ignore_eos:
            return self.stop_token_ids
        return self.stop_token_ids + self.eos_token_ids


@functools.lru_cache(maxsize=4096)
def sampling_params(options: SamplingOptions, eos_token_ids: tuple[int, ...]) -> SamplingParams:
    """A request's options as the stages sample with them, the model's EOS ids inside: built
    once per request, sent once per sequence."""
    return SamplingParams(
        eos_token_ids=eos_token_ids,
        num_logprobs=options.logprobs,
        **{name: getattr(options, name) for name in CHOICE_FIELDS},
    )
