"""Speculative decoding's settings: vLLM's `--speculative-config` JSON, read once for the
scheduler (which proposes n-gram drafts and plans verify steps) and the stages (the last one
holds a draft model).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small-checkpoint", "num_speculative_tokens": 4}

A verify step computes a sequence's last known token and its drafts (K + 1 positions); the
last stage keeps the drafts up to the first the target model would not have produced and adds
its own token there (services/step.py, `CachedSeq.draft_token_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services import defaults

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per sequence per step, at most
MAX_LOOKUP = 64  # the longest n-gram looked up
# Unlike vLLM (None), Pagoda stops drafting above 8 running sequences by default: on the CPU
# each verified position costs about a decode row of compute, so at 16 streams a copy load
# gained 1.02x and a load whose drafts were mostly accepted lost 0.93x (docs/benchmarks.md)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = defaults.PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = defaults.PROMPT_LOOKUP_MIN
    model: str | None = None  # draft_model: the draft checkpoint (folder or GGUF file)
    # vLLM's: no drafts while more requests than this run (a large batch is compute-bound:
    # each draft then costs about what the token it may save does); None: always draft
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LOOKUP:
                raise ValueError(f"speculative_config.{name}: an int in [1, {MAX_LOOKUP}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: the draft checkpoint, required by method draft_model")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model: only for method draft_model")
        n = self.disable_by_batch_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size: a positive int or null, got {n!r}")

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """The flag's JSON text (None or empty: no speculation). As vLLM, `prompt_lookup_min`
        defaults to `prompt_lookup_max` when only that is given, and the reverse; with
        neither, n-grams of 4 down to 2 tokens are looked up."""
        if text is None or not str(text).strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config: a JSON object")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "model",
            "disable_by_batch_size",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown fields {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        if "method" not in raw:
            raise ValueError("speculative_config.method: required (ngram or draft_model)")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        lookup_max, lookup_min = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max, lookup_min = defaults.PROMPT_LOOKUP_MAX, defaults.PROMPT_LOOKUP_MIN
        elif lookup_max is None:
            lookup_max = lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        return cls(
            raw["method"],
            raw["num_speculative_tokens"],
            lookup_max,
            lookup_min,
            raw.get("model"),
            raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
        )

    def to_json(self) -> str:
        out = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "disable_by_batch_size": self.disable_by_batch_size,
        }
        if self.method == "ngram":
            out.update(prompt_lookup_max=self.prompt_lookup_max, prompt_lookup_min=self.prompt_lookup_min)
        else:
            out["model"] = self.model
        return json.dumps(out)
