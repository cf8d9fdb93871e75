"""The scheduler's edge: GenerateRequest validation and the queue bound."""

from __future__ import annotations

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.queue import QueueFull, WaitingQueue
from scheduler_svc.core.request import Request, SamplingOptions
from scheduler_svc.server import InvalidRequest, request_from_pb
from services.pb import scheduler_pb2

CONFIG = SchedulerConfig(max_model_len=64, tenant_weights={"gold": 3.0, "free": 1.0}, enforce_tenants=True)


def msg(prompt=(5, 6, 7), tenant="gold", **params):
    m = scheduler_pb2.GenerateRequest(prompt_token_ids=list(prompt), tenant=tenant)
    for k, v in params.items():
        if isinstance(v, dict):
            getattr(m.sampling_params, k).update(v)
        elif isinstance(v, list):
            getattr(m.sampling_params, k).extend(v)
        else:
            setattr(m.sampling_params, k, v)
    return m


@pytest.mark.parametrize(
    ("request_msg", "field"),
    [
        (msg(prompt=()), "prompt_token_ids"),
        (msg(prompt=(5, 600)), "prompt_token_ids"),
        (msg(prompt=[5] * 64), "prompt_token_ids"),
        (msg(max_tokens=62), "max_tokens"),
        (msg(tenant="nobody"), "tenant"),
        (msg(top_p=0.0), "top_p"),
        (msg(top_p=1.5), "top_p"),
        (msg(temperature=-0.5), "temperature"),
        (msg(min_p=2.0), "min_p"),
        (msg(max_tokens=4, min_tokens=5), "min_tokens"),
        (msg(logprobs=50), "logprobs"),
        (msg(presence_penalty=2.5), "sampling_params.presence_penalty"),
        (msg(frequency_penalty=-3.0), "sampling_params.frequency_penalty"),
        (msg(repetition_penalty=0.0), "sampling_params.repetition_penalty"),
        (msg(repetition_penalty=2.5), "sampling_params.repetition_penalty"),
        (msg(logit_bias={600: 1.0}), "sampling_params.logit_bias: token id 600"),
        (msg(logit_bias={7: 101.0}), "sampling_params.logit_bias: bias 101"),
        (msg(logit_bias={i: 1.0 for i in range(301)}), "sampling_params.logit_bias: at most 300"),
        (msg(prompt_logprobs=21), "sampling_params.prompt_logprobs"),
        (msg(n=1000), "sampling_params.n"),
    ],
)
def test_bad_requests_name_the_field(request_msg, field):
    with pytest.raises(InvalidRequest, match=field):
        request_from_pb(request_msg, CONFIG, vocab_size=512)


def test_a_good_request_converts():
    r = request_from_pb(msg(max_tokens=10, temperature=0.5, seed=3, stop_token_ids=[9]), CONFIG, 512)
    assert r.prompt == (5, 6, 7) and r.tenant == "gold"
    assert r.options.max_tokens == 10 and r.options.seed == 3 and r.options.stop_token_ids == (9,)
    default = request_from_pb(msg(), CONFIG, 512)
    assert default.options.max_tokens == 64 - 3  # the rest of the context
    assert not default.options.uses_penalties and default.options.logit_bias == ()
    p = request_from_pb(
        msg(presence_penalty=0.5, repetition_penalty=1.25, logit_bias={9: -100.0, 7: 2.5}), CONFIG, 512
    ).options
    assert p.uses_penalties and p.presence_penalty == 0.5 and p.repetition_penalty == 1.25
    assert p.frequency_penalty == 0.0 and p.logit_bias == ((7, 2.5), (9, -100.0))


def test_a_request_that_can_never_fit_in_kv_is_refused():
    small = SchedulerConfig(max_model_len=4096, num_kv_blocks=8, block_size=16)
    with pytest.raises(InvalidRequest, match="KV blocks"):
        request_from_pb(msg(prompt=[5] * 100, tenant="", max_tokens=100), small, 512)
    request_from_pb(msg(prompt=[5] * 50, tenant="", max_tokens=30), small, 512)


def test_queue_bound_is_resource_exhausted():
    q = WaitingQueue("fcfs", max_len=2)
    for i in range(2):
        q.push(Request(f"r{i}", (5,), SamplingOptions(), float(i)))
    with pytest.raises(QueueFull):
        q.push(Request("r2", (5,), SamplingOptions(), 2.0))


def test_async_scheduling_is_on_by_default():
    assert SchedulerConfig().is_async and SchedulerConfig().max_in_flight == 2
    assert not SchedulerConfig(async_scheduling=False).is_async
    assert SchedulerConfig(async_scheduling=False).max_in_flight == 1
    assert SchedulerConfig(pipeline_parallel_size=2).is_async
    assert SchedulerConfig(pipeline_parallel_size=3).max_in_flight == 3
    assert SchedulerConfig(async_scheduling=True).max_in_flight == 2
    assert not SchedulerConfig(pipeline_parallel_size=2, async_scheduling=False).is_async


def test_microbatch_size_is_auto_or_a_positive_int():
    from scheduler_svc.config import parse_microbatch_size

    assert parse_microbatch_size("auto") == "auto"
    assert parse_microbatch_size("3") == 3 and parse_microbatch_size(2) == 2
    assert SchedulerConfig(microbatch_size="4").microbatch_size == 4
    for bad in ("0", "-1", "x", "", None, 0):
        with pytest.raises(ValueError, match="microbatch_size"):
            parse_microbatch_size(bad)
    with pytest.raises(ValueError, match="microbatch_size"):
        SchedulerConfig(microbatch_size="many")


def test_the_transport_takes_results_only_of_steps_in_flight():
    """Issue 16: a stage reporting a micro-batch id it was never sent (2**64 - 1) once made
    every later real result look stale; now only steps sent and still in flight count."""
    from scheduler_svc.events import ErrorEvent
    from scheduler_svc.transport import GrpcStageTransport
    from services.pb import worker_pb2
    from services.step import StepResult

    transport = GrpcStageTransport(["a:1", "b:2"])
    transport._in_flight |= {5, 6}
    transport._last_sent = 6
    events = []

    def done(mb_id, error=None, upstream=()):
        d = worker_pb2.MicroBatchDone(micro_batch_id=mb_id)
        if error:
            d.error.code, d.error.message = 3, error
        d.timing.stage_index = 1
        for stage in upstream:  # what the stages before it appended on the way
            d.upstream_timings.add(stage_index=stage)
        return d

    transport._handle_done(1, done(2**64 - 1), events.append)  # never sent
    transport._handle_done(0, done(5), events.append)  # a stage before the last: no result
    transport._handle_done(1, done(5, upstream=(0,)), events.append)  # the result, every stage's timing
    transport._handle_done(1, done(5), events.append)  # a late duplicate
    transport._handle_done(0, done(6, "bad"), events.append)
    transport._handle_done(1, done(6), events.append)  # after its failure: nothing
    assert [type(e) for e in events] == [StepResult, ErrorEvent]
    assert events[0].step_id == 5 and [t.stage_index for t in events[0].timings] == [0, 1]
    assert events[1].micro_batch_id == 6 and events[1].code == "INVALID_ARGUMENT"
    assert not transport._in_flight
    transport._in_flight.add(7)
    transport._last_sent = 7
    bad = done(7)
    bad.sampled_seq_ids.extend([1, 2])
    bad.sampled_token_ids.append(9)  # columns of unequal length: that step fails, not the stream
    transport._handle_done(1, bad, events.append)
    assert isinstance(events[2], ErrorEvent) and events[2].micro_batch_id == 7 and events[2].code == "INTERNAL"
    assert not transport._in_flight
