"""The sampling fields on the wire (`pagoda.v1.SamplingParams`, `TopLogprobs`), one codec for
every layer that sends or reads them: `SamplingOptions` <-> `pagoda.v1.SamplingParams` (the
gateway's public gRPC API reads it, the gateway writes it to the scheduler, the scheduler
reads it), the stages' per-sequence parameters (`services.step_codec`), logprob entries."""

from __future__ import annotations

from collections.abc import Iterable

from services.sampling import SamplingOptions, StructuredOutput


def options_to_pb(o: SamplingOptions, msg) -> None:
    """A request's options into a `pagoda.v1.SamplingParams` message (unset = the default)."""
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
    set_penalties(msg, o.presence_penalty, o.frequency_penalty, o.repetition_penalty, o.logit_bias)
    if o.prompt_logprobs is not None:
        msg.prompt_logprobs = o.prompt_logprobs
    structured_to_pb(o.structured, msg)


def options_from_pb(msg) -> SamplingOptions:
    """A `pagoda.v1.SamplingParams` message as options; ValueError naming the field (as
    `SamplingOptions` does) when a value is invalid. An unset max_tokens stays None."""
    def opt(name: str, default=None):
        return getattr(msg, name) if msg.HasField(name) else default

    return SamplingOptions(
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
        structured=structured_from_pb(msg),
    )


def structured_to_pb(s: StructuredOutput | None, msg) -> None:
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


def structured_from_pb(msg) -> StructuredOutput | None:
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


def set_penalties(params, presence_penalty: float, frequency_penalty: float,
                  repetition_penalty: float, logit_bias: Iterable[tuple[int, float]]) -> None:
    """Penalties and logit bias into a `SamplingParams` message; repetition_penalty 1.0 (off)
    stays unset, as the field's absence means."""
    params.presence_penalty = presence_penalty
    params.frequency_penalty = frequency_penalty
    if repetition_penalty != 1.0:
        params.repetition_penalty = repetition_penalty
    params.logit_bias.update(dict(logit_bias))


def set_top_logprobs(entry, token_id: int, logprob: float, rank: int,
                     top: Iterable[tuple[int, float]]) -> None:
    """One position into a `TopLogprobs` message: the token (with its rank) and the
    alternatives, most likely first (ranks 1, 2, ...)."""
    entry.sampled.token_id, entry.sampled.logprob, entry.sampled.rank = token_id, logprob, rank
    for r, (tid, lp) in enumerate(top, start=1):
        entry.top.add(token_id=tid, logprob=lp, rank=r)
