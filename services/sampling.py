"""How one choice of a request samples: one torch-free type for every layer.

The scheduler builds it once per request from the validated request; the stages' sampler
applies it; the step codec (`services.step_codec`) carries it over the wire once per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

_MAX_SEED = 2**64 - 1
# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-5


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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique

    def __post_init__(self) -> None:
        if (
            not _is_real(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise ValueError(f"top_k must be None, 0 (off) or a positive int, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**64 - 1], got {self.seed!r}")
        if self.num_logprobs is not None and (
            not _is_int(self.num_logprobs) or self.num_logprobs < 0
        ):
            raise ValueError(f"num_logprobs must be None or an int >= 0, got {self.num_logprobs!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        for name in ("stop_token_ids", "eos_token_ids"):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"{name} must be a tuple of token ids, got {ids!r}")
            ids = tuple(ids)
            if not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"{name} must hold non-negative int token ids, got {ids!r}")
            object.__setattr__(self, name, ids)  # normalise a list to a tuple; still immutable
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        bias = tuple(sorted((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        if len(bias) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError("logit_bias must map non-negative token ids to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def uses_penalties(self) -> bool:
        """Penalties need the sequence's history (SampleRow.history on its first row)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

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
