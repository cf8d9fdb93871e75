"""A request, its choices (sequences), and the request state machine.

Six states, the legal transitions enforced in `Request.transition` and nowhere else:

    WAITING -> PREFILLING -> DECODING -> FINISHED
       ^           |             |
       +------ PREEMPTED <-------+        any live state -> ABORTED

and PREFILLING -> FINISHED: a pooling request (`Request.pooling`) ends with its prompt.

Each choice of a request (`n > 1`) is one `Sequence`, with vLLM v1's single rule: it has
`num_computed` tokens whose KV is stored and catches up to its known tokens (prompt plus
output). Chunked prefill, prefix hits and recompute after preemption all fall out of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_svc.core.speculation import Drafts
from services.pooling import Embedding, PoolingType
from services.sampling import MAX_LOGIT_BIAS_ENTRIES, SamplingOptions, sampling_params  # noqa: F401 (re-exported)


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
    # a pooling request (Request.pooling) finishes with its prompt, never decoding
    _S.PREFILLING: frozenset({_S.DECODING, _S.FINISHED, _S.PREEMPTED, _S.ABORTED}),
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
    num_blocks: int = 0  # the length of its block table, as the KV service last answered
    # the KV service's answers the stages were not sent yet, composed into one diff in the
    # plan's form (block offset, block ids after it): passed on as they came, never rebuilt
    unsent_blocks: tuple[int, tuple[int, ...]] | None = None
    has_kv: bool = False  # the KV service holds this sequence
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    drafts: Drafts | None = None  # speculative decoding: its n-gram index and back-off

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt) + len(self.output)

    def take_answer(self, block_offset: int, block_ids: tuple[int, ...]) -> None:
        """The KV service's table for it: `block_offset` entries of its last answer stay, then
        `block_ids` (`kvcache_svc.core.Allocated`). Composed with what the stages were not
        sent yet: the next step sends one diff."""
        if block_offset > self.num_blocks:
            raise ValueError(f"sequence {self.seq_id}: keeps {block_offset} of {self.num_blocks} blocks")
        unsent = self.unsent_blocks
        if unsent is not None and block_offset > unsent[0]:
            block_offset, block_ids = unsent[0], unsent[1][: block_offset - unsent[0]] + block_ids
        if unsent is not None or block_ids or block_offset < self.num_blocks:
            self.unsent_blocks = (block_offset, block_ids)
        self.num_blocks = block_offset + len(block_ids)

    def take_unsent_blocks(self) -> tuple[int, tuple[int, ...]]:
        """What the stages' table lacks (offset, ids); (num_blocks, ()) when nothing."""
        unsent, self.unsent_blocks = self.unsent_blocks, None
        return unsent if unsent is not None else (self.num_blocks, ())

    def drop_blocks(self) -> None:
        """Its blocks are gone (freed, or the KV service reset)."""
        self.num_blocks, self.unsent_blocks = 0, None

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
    # set: a pooling (embedding) request, one choice that computes its prompt and finishes
    # with its pooled vector (`embedding`) instead of sampling (services.pooling)
    pooling: PoolingType | None = None
    embedding: Embedding | None = None
    # multi-LoRA: the adapter it runs under ("": the base model) and that adapter's identity
    # (its load id, core/lora.py); its blocks are shared in the prefix cache only with
    # requests of the same adapter, loaded the same time
    lora_name: str = ""
    lora_load_id: int = 0
    # P/D disaggregation on a prefill replica (core/exports.py): hold the finished prompt's
    # KV for a decode replica; `exported` is then (its sequence id, the blocks it may pull)
    export_kv: bool = False
    exported: tuple[int, int] | None = None

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
        return (
            bool(self.sequences)
            and all(s.is_finished for s in self.sequences)
            and (len(self.sequences) == self.options.n)
        )
