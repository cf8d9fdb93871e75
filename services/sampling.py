"""Sampling, torch-free, one definition for every layer.

`SamplingOptions` is a request's sampling as a client asks for it (the gateway, the
scheduler and the in-process `LLM` share it; `services.sampling_pb` is its codec);
`SamplingParams` is how one choice of it samples, built once per request by
`sampling_params`, carried to the stages once per sequence by the step codec
(`services.step_codec`) and applied by their sampler.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

_MAX_SEED = 2**64 - 1
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 65536  # a schema, regex or grammar's text (both front doors)
MAX_CHOICES = 256
# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-5


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
            raise ValueError(f"structured_output: kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"structured_output: the {self.kind} may have at most "
                             f"{MAX_STRUCTURED_CHARS} characters")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"structured_output: choice needs 1 to {MAX_CHOICES} strings, "
                                 f"got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("structured_output: choices must be non-empty strings")
            if sum(map(len, self.choices)) > MAX_STRUCTURED_CHARS:
                raise ValueError(f"structured_output: choices may have at most "
                                 f"{MAX_STRUCTURED_CHARS} characters together")
        elif self.choices:
            raise ValueError(f"structured_output: choices are only for kind 'choice', not {self.kind!r}")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured_output: the {self.kind} is empty")


@dataclass(frozen=True)
class SamplingParams:
    """How one choice of a request picks its next token.

    Invariants: temperature >= 0 and finite (below 1e-5 means greedy); top_k None or 0 means off,
    otherwise >= 1; 0 < top_p <= 1 (1 means off); 0 <= min_p <= 1 (0 means off); seed None or in
    [0, 2**64 - 1]; num_logprobs None (none returned) or >= 0; min_tokens >= 0; stop and EOS ids are
    non-negative. Stop and EOS ids are masked while fewer than min_tokens tokens have been generated;
    with ignore_eos, EOS ids are not stops, so they are never masked.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    structured: StructuredOutput | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be None or StructuredOutput, got {self.structured!r}")
        _check_shared_fields(self)
        if self.num_logprobs is not None and (not _is_int(self.num_logprobs) or self.num_logprobs < 0):
            raise ValueError(f"num_logprobs: must be None or an int >= 0, got {self.num_logprobs!r}")
        object.__setattr__(self, "eos_token_ids", _token_ids("eos_token_ids", self.eos_token_ids))

    @property
    def uses_penalties(self) -> bool:
        """Penalties need the sequence's history (SampleRow.history on its first row)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Penalties and a grammar (whose state is rebuilt from the output so far) need the
        sequence's history on its first sampling row."""
        return self.uses_penalties or self.structured is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def min_tokens_masked_ids(self) -> tuple[int, ...]:
        """Ids that may not be sampled before min_tokens tokens exist: stops, and EOS unless ignored."""
        if self.ignore_eos:
            return self.stop_token_ids
        return self.stop_token_ids + self.eos_token_ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI
_WIRE_INT = 2**32  # counts and token ids travel as uint32

# The fields a request's options and a choice's params share, checked by one rule each:
# (name, what a value must satisfy, what the error says it must be).
_SHARED_FIELD_RULES = (
    ("temperature", lambda v: _is_real(v) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("top_p", lambda v: _is_real(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("top_k", lambda v: v is None or (_is_int(v) and 0 <= v < _WIRE_INT), ">= 0 (0 = off) and below 2**32"),
    ("min_p", lambda v: _is_real(v) and 0.0 <= v <= 1.0, "in [0, 1]"),
    ("seed", lambda v: v is None or (_is_int(v) and 0 <= v <= _MAX_SEED), "None or an int in [0, 2**64)"),
    ("min_tokens", lambda v: _is_int(v) and 0 <= v < _WIRE_INT, "an int >= 0 and below 2**32"),
    ("ignore_eos", lambda v: isinstance(v, bool), "a bool"),
    ("presence_penalty", lambda v: _is_real(v) and -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("frequency_penalty", lambda v: _is_real(v) and -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("repetition_penalty", lambda v: _is_real(v) and 0.0 < v <= 2.0, "in (0, 2]"),
)


def _check_shared_fields(obj: SamplingOptions | SamplingParams) -> None:
    """The one validation of what `SamplingOptions` and `SamplingParams` share; normalises
    `stop_token_ids` to a tuple and `logit_bias` to sorted (id, bias) pairs. ValueError naming
    the field first."""
    for name, ok, expected in _SHARED_FIELD_RULES:
        value = getattr(obj, name)
        if not ok(value):
            raise ValueError(f"{name}: must be {expected}, got {value!r}")
    object.__setattr__(obj, "stop_token_ids", _token_ids("stop_token_ids", obj.stop_token_ids))
    object.__setattr__(obj, "logit_bias", _logit_bias(obj.logit_bias))


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name}: must be a tuple of token ids, got {ids!r}")
    ids = tuple(ids)
    if not all(_is_int(i) and 0 <= i < _WIRE_INT for i in ids):
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
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias: bias {value} for token {token_id} is outside [-100, 100]")
    return bias


@dataclass(frozen=True)
class SamplingOptions:
    """A request's sampling, as every layer sees it: built and validated where a request
    enters (the gateway from its REST and gRPC models, `LLM.generate` from the caller, the
    scheduler from the wire, `services.sampling_pb.options_from_pb`), carried to the
    scheduler as `pagoda.v1.SamplingParams` (`options_to_pb`), and turned into what each
    choice samples with (`sampling_params`) once per request. Invalid values raise
    `ValueError` naming the field first (`"top_p: must be in (0, 1], got 2"`).

    `max_tokens` None means the rest of the context; the scheduler resolves it against
    `max_model_len` when it admits the request (`resolve_max_tokens`).
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

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 1 <= value < _WIRE_INT):
                raise ValueError(f"{name}: must be at least 1 and below 2**32, got {value!r}")
        if self.n is None:
            raise ValueError("n: must be at least 1, got None")
        _check_shared_fields(self)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= 20):
                raise ValueError(f"{name}: must be in [0, 20], got {value!r}")

    def resolve_max_tokens(self, room: int) -> SamplingOptions:
        """With `max_tokens` None: as many as `room` (the context left after the prompt)."""
        return self if self.max_tokens is not None else replace(self, max_tokens=room)

    @property
    def uses_penalties(self) -> bool:
        """The stages' sampler then needs each sequence's history (prompt and output)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@functools.lru_cache(maxsize=4096)
def sampling_params(o: SamplingOptions, eos_token_ids: tuple[int, ...]) -> SamplingParams:
    """A request's options as the stages sample with them: built once per request, sent once
    per sequence."""
    return SamplingParams(
        temperature=o.temperature, top_k=o.top_k or None, top_p=o.top_p, min_p=o.min_p,
        seed=o.seed, num_logprobs=o.logprobs, min_tokens=o.min_tokens,
        stop_token_ids=o.stop_token_ids, eos_token_ids=eos_token_ids, ignore_eos=o.ignore_eos,
        presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
        repetition_penalty=o.repetition_penalty, logit_bias=o.logit_bias, structured=o.structured,
    )
