"""A request, its choices (sequences), and the request state machine.

Six states, the legal transitions enforced in `Request.transition` and nowhere else:

    WAITING -> PREFILLING -> DECODING -> FINISHED
       ^           |             |
       +------ PREEMPTED <-------+        any live state -> ABORTED

Each choice of a request (`n > 1`) is one `Sequence`, with vLLM v1's single rule: it has
`num_computed` tokens whose KV is stored and catches up to its known tokens (prompt plus
output). Chunked prefill, prefix hits and recompute after preemption all fall out of it.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from services.sampling import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_live(self) -> bool:
        return self not in (RequestState.FINISHED, RequestState.ABORTED)


_S = RequestState
LEGAL_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.PREFILLING, _S.ABORTED}),
    _S.PREFILLING: frozenset({_S.DECODING, _S.PREEMPTED, _S.ABORTED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.PREEMPTED, _S.ABORTED}),
    _S.PREEMPTED: frozenset({_S.WAITING, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug: the scheduler tried a transition the state machine does not allow."""


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (or EOS)
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI


def kv_blocks_needed(prompt_len: int, n: int, max_tokens: int, block_size: int) -> int:
    """The most KV blocks a request can hold at once. One choice: its whole context. Several:
    the prompt's blocks (shared), and each choice's output plus its copy of the prompt's
    partial last block."""
    if n == 1:
        return -(-(prompt_len + max_tokens) // block_size)
    return -(-prompt_len // block_size) + n * (-(-max_tokens // block_size) + 1)


@dataclass(frozen=True)
class SamplingOptions:
    """What the scheduler needs of a request's sampling: token-id rules plus what stages sample with.

    Validated by the server edge (`ValueError` naming the field); the planner trusts it.
    """

    n: int = 1
    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n: must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature: must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed: must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs: must be in [0, 20], got {self.prompt_logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be non-negative")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty: must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias: a token id appears twice")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias: token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: bias {bias} for token {token_id} is outside [-100, 100]")

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
        repetition_penalty=o.repetition_penalty, logit_bias=o.logit_bias,
    )


@dataclass
class Sequence:
    """One choice of a request: its own output, KV blocks (held by the KV service) and progress."""

    seq_id: int
    request: Request
    index: int  # the choice index
    entropy_seed: int
    output: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    num_computed: int = 0
    # tokens the KV service was told of: behind num_computed by a placeholder step's token
    # (async scheduling) until the next step tells it
    kv_len: int = 0
    block_table: tuple[int, ...] = ()
    has_kv: bool = False  # the KV service holds this sequence
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt) + len(self.output)

    def token(self, i: int) -> int:
        prompt = self.request.prompt
        return prompt[i] if i < len(prompt) else self.output[i - len(prompt)]

    def tokens(self, start: int, end: int) -> list[int]:
        prompt = self.request.prompt
        if end <= len(prompt):
            return list(prompt[start:end])
        return (list(prompt[start:]) if start < len(prompt) else []) + self.output[
            max(0, start - len(prompt)) : end - len(prompt)
        ]

    def all_tokens(self) -> list[int]:
        return list(self.request.prompt) + self.output

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (the prompt, or prompt + output after preemption)."""
        return self.num_computed < self.num_tokens - 1


@dataclass
class Request:
    """A client's request: prompt token ids, sampling options, tenant and priority, n choices."""

    request_id: str
    prompt: tuple[int, ...]
    options: SamplingOptions
    arrival_s: float
    tenant: str = ""
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    debug_timeline: bool = False
    trace_context: str = ""
    state: RequestState = RequestState.WAITING
    sequences: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    first_scheduled_s: float | None = None
    finished_s: float | None = None
    history: list[tuple[RequestState, float]] = field(default_factory=list)
    # with options.prompt_logprobs: per prompt position 0 .. len - 2, the next prompt token's
    # (id, logprob, rank, [(id, logprob)]); filled as prefill chunks come back
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def transition(self, new: RequestState, now: float = 0.0) -> None:
        if new not in LEGAL_TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.name} -> {new.name}")
        self.state = new
        self.history.append((new, now))

    @property
    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.is_finished]

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.output) for s in self.sequences)

    @property
    def all_finished(self) -> bool:
        return bool(self.sequences) and all(s.is_finished for s in self.sequences) and (
            len(self.sequences) == self.options.n
        )
