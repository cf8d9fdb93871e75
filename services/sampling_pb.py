"""The sampling fields on the wire (`pagoda.v1.SamplingParams`, `TopLogprobs`): one codec for
every layer that sends or reads them. A request's `SamplingOptions` <-> the message (the
gateway's public gRPC API reads it, the gateway writes it to the scheduler, the scheduler
reads it); the stages' view of them, `SamplingParams`, rides in the same message, written by
the same function and read by the same one (`params_from_pb`, with the model's EOS ids, which
travel beside it). Logprob entries too."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.sampling import CHOICE_FIELDS, SamplingOptions, SamplingParams, StructuredOutput


def options_to_pb(o: SamplingOptions, msg) -> None:
    """A request's options, or the stages' view of them, into a `pagoda.v1.SamplingParams`
    message; a value at its default stays unset (n 1 is 0, which reads as 1)."""
    if o.n != 1:
        msg.n = o.n
    msg.temperature = o.temperature
    msg.top_p = o.top_p
    msg.top_k = o.top_k
    msg.min_p = o.min_p
    if o.seed is not None:
        msg.seed = o.seed
    if o.max_tokens is not None:
        msg.max_tokens = o.max_tokens
    msg.min_tokens = o.min_tokens
    msg.stop_token_ids.extend(o.stop_token_ids)
    msg.ignore_eos = o.ignore_eos
    if o.logprobs is not None:
        msg.logprobs = o.logprobs
    msg.presence_penalty = o.presence_penalty
    msg.frequency_penalty = o.frequency_penalty
    if o.repetition_penalty != 1.0:  # (its absence means off)
        msg.repetition_penalty = o.repetition_penalty
    msg.logit_bias.update(dict(o.logit_bias))
    if o.prompt_logprobs is not None:
        msg.prompt_logprobs = o.prompt_logprobs
    _structured_to_pb(o.structured, msg)


def _fields_from_pb(msg) -> dict[str, Any]:
    """Every field of the message by its `SamplingOptions` name; an unset one at its default
    (an unset max_tokens stays None)."""

    def opt(name: str, default=None):
        return getattr(msg, name) if msg.HasField(name) else default

    return dict(
        n=msg.n or 1,
        max_tokens=opt("max_tokens"),
        min_tokens=msg.min_tokens,
        temperature=opt("temperature", 1.0),
        top_p=opt("top_p", 1.0),
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=opt("seed"),
        logprobs=opt("logprobs"),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=opt("repetition_penalty", 1.0),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        prompt_logprobs=opt("prompt_logprobs"),
        structured=_structured_from_pb(msg),
    )


def options_from_pb(msg) -> SamplingOptions:
    """A `pagoda.v1.SamplingParams` message as a request's options; ValueError naming the
    field (as `SamplingOptions` does) when a value is invalid."""
    return SamplingOptions(**_fields_from_pb(msg))


def params_from_pb(msg, eos_token_ids: Iterable[int]) -> SamplingParams:
    """A new sequence's message as the stages' view, with the model's EOS ids (which travel
    beside it); what only the scheduler acts on is not read. ValueError naming the field."""
    f = _fields_from_pb(msg)
    return SamplingParams(
        eos_token_ids=tuple(eos_token_ids), num_logprobs=f["logprobs"], **{name: f[name] for name in CHOICE_FIELDS}
    )


def _structured_to_pb(s: StructuredOutput | None, msg) -> None:
    """A constraint into a `SamplingParams` message's `structured_output` (None: unset)."""
    if s is None:
        return
    out = msg.structured_output
    if s.kind == "json_object":
        out.json_object = True
    elif s.kind == "choice":
        out.choice.choices.extend(s.choices)
    else:
        setattr(out, s.kind, s.spec)


def _structured_from_pb(msg) -> StructuredOutput | None:
    """`SamplingParams.structured_output` as a constraint (ValueError naming what is wrong)."""
    if not msg.HasField("structured_output"):
        return None
    out = msg.structured_output
    kind = out.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object") if out.json_object else None
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(out.choice.choices))
    return StructuredOutput(kind, getattr(out, kind))


def set_top_logprobs(entry, token_id: int, logprob: float, rank: int, top: Iterable[tuple[int, float]]) -> None:
    """One position into a `TopLogprobs` message: the token (with its rank) and the
    alternatives, most likely first (ranks 1, 2, ...)."""
    entry.sampled.token_id, entry.sampled.logprob, entry.sampled.rank = token_id, logprob, rank
    for r, (tid, lp) in enumerate(top, start=1):
        entry.top.add(token_id=tid, logprob=lp, rank=r)
