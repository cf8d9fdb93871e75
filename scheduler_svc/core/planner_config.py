"""The planner's settings: one frozen dataclass, validated at construction (ValueError)."""

from __future__ import annotations

from dataclasses import dataclass

from services import defaults
from services.defaults import BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS


def parse_microbatch_size(value: str | int) -> str | int:
    """A micro-batch size as given (a flag's text or a number): "auto", or the positive int it
    names. Raises ValueError otherwise."""
    if value == "auto":
        return value
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"microbatch_size: 'auto' or a positive int, got {value!r}") from None
    if size < 1:
        raise ValueError(f"microbatch_size: 'auto' or a positive int, got {value!r}")
    return size


@dataclass(frozen=True)
class PlannerConfig:
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    enable_chunked_prefill: bool = True
    max_in_flight: int = 1
    pipeline_parallel_size: int = 1
    microbatch_size: str | int = "auto"
    max_model_len: int = MAX_MODEL_LEN
    namespace: str | None = None  # the model: prefixes are shared only within one
    block_size: int = BLOCK_SIZE
    # vLLM-style asynchronous scheduling: a decoding sequence is scheduled for step k+1
    # before step k's token is known; the stage feeds itself the token it sampled (one
    # stage), or the last stage feeds the first (several stages: `Planner.set_feedback`)
    async_decode: bool = False
    # speculative decoding (scheduler_svc/core/speculation.py): up to this many n-gram drafts
    # per decoding sequence per step, verified in one step of drafts + 1 positions
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = defaults.PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = defaults.PROMPT_LOOKUP_MAX
    # "ngram": the planner looks drafts up; "draft_model": the last stage proposes them
    speculative_method: str = "ngram"
    # no drafts while more requests than this run (None: always)
    speculative_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be positive")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight: must be positive")
        object.__setattr__(self, "microbatch_size", parse_microbatch_size(self.microbatch_size))
