"""Embeddings (issue 28): a pooling request is a prefill-only request through the same
scheduler and stages, whose last stage pools the final norm's output (last token or mean)
and L2-normalizes it. Here: the pooling math, the stage's checks, the wire, admission, the
planner's handling (prefix cache, no placeholder steps, blocks freed), equality with
`transformers` in process (PP 1 and 2, chunked), and `/v1/embeddings` over a fake scheduler
(formats, 400s naming the field). Over a real stack with the openai SDK:
tests/e2e/test_embeddings_openai.py."""

from __future__ import annotations

import asyncio
import base64
import json
import struct

import httpx2 as httpx
import pytest
import torch
import torch.nn.functional as F

from gateway.app import create_app
from gateway.config import GatewayConfig
from kvcache_svc.core import KVCacheManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.planner import Planner, PlannerConfig
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, RequestState, SamplingOptions
from scheduler_svc.server import InvalidRequest, request_from_pb
from services.admission import AdmissionError, Limits, admit_pooling
from services.pb import common_pb2, scheduler_pb2, worker_pb2
from services.pooling import PoolingType, embedding_from_pb, embedding_to_pb, embedding_values
from services.sampling import SamplingParams
from services.step import NewSeq, PooledOutput, SampledToken, StepPlan, StepResult
from services.step_codec import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from services.text import Tokenizer
from wiring.local_engine import LLM, _collect, build_local_engine
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.batch import PersistentBatch, Row, SeqState, StageShape
from worker_svc.execution.pooler import normalized_bytes, pool, pool_positions

LAST, MEAN = PoolingType.LAST, PoolingType.MEAN


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


def reference(hf_model, prompt: list[int], pooling: PoolingType) -> torch.Tensor:
    """transformers' final hidden states (the last of `output_hidden_states`: the final
    norm's output), pooled and L2-normalized."""
    with torch.no_grad():
        hidden = hf_model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(hidden[-1] if pooling is LAST else hidden.mean(dim=0), dim=-1)


def test_the_reference_hidden_state_is_the_final_norms_output(hf_llama):
    """What the comparisons rest on: in HF Llama the last `hidden_states` entry is the final
    norm's output (the LM head applied to it gives the logits)."""
    prompt = [5, 17, 99, 260, 31]
    with torch.no_grad():
        out = hf_llama(input_ids=torch.tensor([prompt]), output_hidden_states=True)
        body = hf_llama.model(input_ids=torch.tensor([prompt]))
    assert len(out.hidden_states) == hf_llama.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[-1], body.last_hidden_state)
    assert torch.allclose(hf_llama.lm_head(out.hidden_states[-1]), out.logits, atol=1e-5)


# --- the math ------------------------------------------------------------------------------


def _row(pooling, start, num_tokens, prompt_len, is_last=True):
    state = SeqState(
        1, list(range(prompt_len)), prompt_len, start + num_tokens, [0], SamplingParams(), 0, 0, pooling=pooling
    )
    done = start + num_tokens == prompt_len
    return Row(state, start, num_tokens, False, None, is_last, is_last and done)


def test_mean_pooling_sums_over_chunks_and_last_pooling_takes_the_last_position():
    g = torch.Generator().manual_seed(0)
    normed = torch.randn(10, 8, generator=g)  # the final norm's output of a 10-token prompt
    # mean, in chunks of 4, 4 and 2 (each step's rows: here one row per step)
    state = None
    pooled = []
    for start, n in ((0, 4), (4, 4), (8, 2)):
        row = _row(MEAN, start, n, 10)
        if state is not None:
            row.state = state
        rows, indices = pool_positions([row])
        assert indices == list(range(n))
        pooled = pool(normed[start : start + n], rows)
        state = row.state
        assert bool(pooled) == (start + n == 10)  # only the chunk that completes the prompt gives it
    want = F.normalize(normed.mean(dim=0), dim=-1)
    assert torch.allclose(torch.tensor(embedding_values(pooled[0].embedding)), want, atol=1e-6)
    # last: only the row that completes its prompt pools, at its last position in the batch
    other = Row(SeqState(2, [1, 2, 3], 3, 3, [0], SamplingParams(), 0, 0), 0, 3, True)  # samples
    chunk = _row(LAST, 0, 4, 10)
    last = _row(LAST, 6, 4, 10)
    rows, indices = pool_positions([other, chunk, last])
    assert rows == [last] and indices == [3 + 4 + 3]
    got = pool(normed[[9]], rows)
    assert torch.allclose(torch.tensor(embedding_values(got[0].embedding)), F.normalize(normed[9], dim=-1))


def test_vectors_leave_as_unit_little_endian_float32():
    data = normalized_bytes(torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert data == struct.pack("<2f", 0.6, 0.8)
    assert normalized_bytes(torch.zeros(3)) == bytes(12)  # no division by zero (F.normalize's eps)


# --- the stage -----------------------------------------------------------------------------


def _batch(is_last=True):
    return PersistentBatch(
        StageShape(is_first=True, is_last=is_last, num_blocks=8, block_size=4, max_positions=64, vocab_size=512)
    )


def test_the_stage_refuses_malformed_pooling_sequences():
    batch = _batch()
    with pytest.raises(InvalidPlanError, match="MEAN pooling computes every position"):
        batch.apply(StepPlan(1, (NewSeq(1, (5, 6, 7, 8), 4, 2, 2, (0,), SamplingParams(), pooling=MEAN),)))
    with pytest.raises(InvalidPlanError, match="a pooling sequence's tokens are its prompt"):
        batch.apply(StepPlan(1, (NewSeq(1, (5, 6, 7, 8), 3, 0, 4, (0,), SamplingParams(), pooling=LAST),)))
    assert not batch.seqs  # refused whole, nothing applied
    # last-token pooling after a prefix hit: only the last position is computed, which is enough
    rows = batch.apply(StepPlan(1, (NewSeq(1, (5, 6, 7, 8), 4, 3, 1, (0,), SamplingParams(), pooling=LAST),)))
    assert (rows[0].sample, rows[0].pools, rows[0].pool_done) == (False, True, True)


def test_only_the_last_stage_pools_and_a_pooling_row_never_samples():
    plan = StepPlan(
        1,
        (
            NewSeq(1, (5, 6, 7, 8), 4, 0, 2, (0,), SamplingParams(), pooling=MEAN),
            NewSeq(2, (5, 6), 2, 0, 2, (1,), SamplingParams()),
        ),
    )
    first = _batch(is_last=False).apply(plan)
    assert [(r.sample, r.pools, r.pool_done) for r in first] == [(False, False, False)] * 2
    last = _batch().apply(plan)
    assert [(r.sample, r.pools, r.pool_done) for r in last] == [(False, True, False), (True, False, False)]


# --- the wire ------------------------------------------------------------------------------


def test_the_wire_carries_pooling_both_ways():
    sent = StepPlan(
        1,
        (
            NewSeq(3, (5, 6, 7), 3, 0, 3, (0,), SamplingParams(), pooling=MEAN),
            NewSeq(4, (5, 6), 2, 0, 2, (1,), SamplingParams()),
        ),
    )
    plan = plan_from_pb(plan_to_pb(sent))
    assert [n.pooling for n in plan.new_seqs] == [MEAN, None]
    vector = struct.pack("<3f", 0.6, 0.8, 0.0)
    done = worker_pb2.MicroBatchDone(micro_batch_id=1)
    result_to_pb(StepResult(1, pooled=(PooledOutput(3, vector),)), done)
    assert done.pooled[0].embedding.dtype == common_pb2.DTYPE_FLOAT32
    assert list(done.pooled[0].embedding.shape) == [3]
    assert result_from_pb(done).pooled == (PooledOutput(3, vector),)
    bad = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[4], data=vector)
    with pytest.raises(ValueError, match="embedding"):
        embedding_from_pb(bad)
    unknown = plan_to_pb(sent)
    unknown.new_seqs[0].pooling = 9
    with pytest.raises(ValueError, match="unknown pooling type 9"):
        plan_from_pb(unknown)


# --- admission and the scheduler's edge ------------------------------------------------------


def test_a_pooling_request_has_one_choice_and_may_fill_the_context():
    limits = Limits(max_model_len=32, num_kv_blocks=4, block_size=4)
    assert admit_pooling(SamplingOptions(max_tokens=None, temperature=0.5), limits, 16).max_tokens == 1
    with pytest.raises(AdmissionError, match="one choice") as exc:
        admit_pooling(SamplingOptions(n=2), limits, 4)
    assert exc.value.field == "n"
    with pytest.raises(AdmissionError, match="need 5 KV blocks") as exc:
        admit_pooling(SamplingOptions(), limits, 17)
    assert exc.value.field == "prompt"
    with pytest.raises(AdmissionError, match="exceed max_model_len=32"):
        admit_pooling(SamplingOptions(), Limits(max_model_len=32), 33)
    assert admit_pooling(SamplingOptions(), Limits(max_model_len=32), 32).n == 1


def test_the_scheduler_edge_takes_a_pooling_request_and_names_what_is_wrong():
    config = SchedulerConfig(max_model_len=16, num_kv_blocks=64)
    msg = scheduler_pb2.GenerateRequest(
        request_id="e", prompt_token_ids=list(range(1, 17)), pooling=common_pb2.POOLING_TYPE_MEAN
    )
    request = request_from_pb(msg, config, 512)  # a whole context: nothing is generated after it
    assert request.pooling is MEAN and request.options.n == 1
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):  # generation needs room
        request_from_pb(scheduler_pb2.GenerateRequest(prompt_token_ids=list(range(1, 17))), config, 512)
    msg.sampling_params.n = 2
    with pytest.raises(InvalidRequest, match="sampling_params.n: a pooling"):
        request_from_pb(msg, config, 512)
    msg.sampling_params.n, msg.pooling = 1, 7
    with pytest.raises(InvalidRequest, match="pooling: unknown pooling type 7"):
        request_from_pb(msg, config, 512)


# --- the planner ---------------------------------------------------------------------------


def _step(planner, kv, now=0.0):
    proposal = planner.propose()
    output = kv.step(proposal.step_input)
    return proposal, planner.finalize(proposal, output, now)


@pytest.mark.parametrize("pooling", [LAST, MEAN])
def test_the_planner_runs_a_pooling_request_as_a_prefill_that_ends_with_its_vector(pooling):
    """Chunked, beside a generating request, two steps in flight with asynchronous
    scheduling: the pooling sequence is never given a placeholder step (it never samples),
    finishes with its vector when its last chunk comes back (PREFILLING -> FINISHED) and
    frees its blocks; only mean pooling skips the prefix cache."""
    planner = Planner(
        PlannerConfig(max_num_batched_tokens=8, block_size=4, async_decode=True, max_in_flight=2), WaitingQueue()
    )
    kv = KVCacheManager(32, 4)
    gen = Request("g", (7, 8), SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True), 0.0)
    embed = Request("e", tuple(range(5, 17)), SamplingOptions(max_tokens=1), 0.0, pooling=pooling)
    planner.add(gen)
    planner.add(embed)
    proposal, mb = _step(planner, kv)
    assert [n.skip_prefix_cache for n in proposal.step_input.new_sequences] == [False, pooling is MEAN]
    assert [n.pooling for n in mb.plan.new_seqs] == [None, pooling]
    vector = struct.pack("<2f", 0.6, 0.8)
    in_flight, placeholders, embed_placeholders = [mb], 0, 0
    for step in range(1, 30):
        proposal, later = _step(planner, kv, float(step))  # planned while the others are in flight
        placeholders += len(proposal.placeholders)
        embed_placeholders += sum(p.seq.request is embed for p in proposal.placeholders)
        in_flight += [later] if later is not None else []
        if not in_flight:
            break
        mb = in_flight.pop(0)
        pooled = [PooledOutput(s.seq_id, vector) for s in mb.seqs if s.seq.request is embed and s.context_len == 12]
        planner.on_result(
            mb.micro_batch_id, [SampledToken(s.seq_id, 9) for s in mb.seqs if s.sample], float(step), pooled=pooled
        )
        planner.check_integrity()
    assert placeholders > 0 and embed_placeholders == 0
    assert embed.embedding == vector and embed.sequences[0].output == []
    assert [state for state, _ in embed.history] == [RequestState.PREFILLING, RequestState.FINISHED]
    assert gen.state == RequestState.FINISHED and not planner.requests and not planner.running
    _step(planner, kv, 99.0)  # the last frees travel with the next call
    assert kv.stats().num_used_blocks == 0


def test_an_aborted_pooling_request_frees_its_blocks():
    planner = Planner(PlannerConfig(max_num_batched_tokens=4, block_size=4), WaitingQueue())
    kv = KVCacheManager(16, 4)
    planner.add(Request("e", tuple(range(5, 17)), SamplingOptions(max_tokens=1), 0.0, pooling=MEAN))
    _, mb = _step(planner, kv)
    assert kv.stats().num_used_blocks > 0
    planner.abort("e")
    planner.on_result(mb.micro_batch_id, [])
    _step(planner, kv)
    assert kv.stats().num_used_blocks == 0 and not planner.requests


# --- in process, against transformers ------------------------------------------------------


PROMPTS = [[5, 17, 99, 260, 31], list(range(20, 61)), [300, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("pp", [1, 2])
def test_embeddings_equal_transformers(model_dir, hf_llama, pp):
    """Three prompts batched together, prefilled in chunks of 16 tokens across `pp` stages:
    each vector equals transformers' final hidden states pooled and normalized, within 1e-5."""
    llm = LLM(model_dir, pipeline_parallel_size=pp, max_num_batched_tokens=16, num_kv_blocks=64)
    for pooling in (LAST, MEAN):
        outs = llm.embed(PROMPTS, pooling)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert len(out.embedding) == hf_llama.config.hidden_size
            got = torch.tensor(out.embedding)
            assert torch.allclose(got, reference(hf_llama, prompt, pooling), atol=1e-5, rtol=0), (pp, pooling)
            assert got.norm().item() == pytest.approx(1.0, abs=1e-5)


def test_pooling_beside_generation_under_async_scheduling(model_dir, hf_llama):
    """Embedding and generating requests share steps of an asynchronous engine: the greedy
    generations are those of a run alone, every vector equals the reference, a repeated
    last-token prompt is served from the prefix cache with the same vector, and every KV
    block is free afterwards."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=96, max_num_batched_tokens=16, async_scheduling=True)
    greedy = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def go(with_embeddings: bool):
        engine = build_local_engine(model_dir, config, num_kv_blocks=96)
        await engine.start()
        try:
            streams = [engine.submit(Request(f"g{i}", (7, 8, 9 + i), greedy, 0.0)) for i in range(2)]
            if with_embeddings:
                streams += [
                    engine.submit(
                        Request(
                            f"e{i}", tuple(p), SamplingOptions(max_tokens=1), 0.0, pooling=LAST if i % 2 == 0 else MEAN
                        )
                    )
                    for i, p in enumerate(PROMPTS)
                ]
            results = await asyncio.gather(*(_collect(s) for s in streams))
            # the whole prompt is in the cache (4 full blocks): only its last position is computed
            again = await _collect(
                engine.submit(Request("again", tuple(PROMPTS[2]), SamplingOptions(max_tokens=1), 0.0, pooling=LAST))
            )
            await asyncio.sleep(0.05)
            stats = engine.kv.manager.stats()
            return results, again, stats, engine.planner.num_placeholder_steps
        finally:
            await engine.stop()

    alone, _, _, _ = asyncio.run(go(False))
    mixed, again, stats, placeholders = asyncio.run(go(True))
    assert placeholders > 0  # asynchronous scheduling did plan ahead for the generations
    assert [c for c, _ in mixed[:2]] == [c for c, _ in alone[:2]]
    for i, (prompt, (_, final)) in enumerate(zip(PROMPTS, mixed[2:], strict=True)):
        pooling = LAST if i % 2 == 0 else MEAN
        want = reference(hf_llama, prompt, pooling)
        assert torch.allclose(torch.tensor(embedding_values(final.embedding)), want, atol=1e-5, rtol=0)
        assert final.num_completion_tokens == 0 and final.num_prompt_tokens == len(prompt)
    assert again[1].num_cached_tokens == len(PROMPTS[2]) - 1
    assert torch.allclose(
        torch.tensor(embedding_values(again[1].embedding)), reference(hf_llama, PROMPTS[2], LAST), atol=1e-5, rtol=0
    )
    assert stats.num_used_blocks == 0


# --- the REST route --------------------------------------------------------------------------


class FakeScheduler:
    """The part of `TextGenerator` the route uses: each pooling request answered with a
    vector whose first value is its prompt's length."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[scheduler_pb2.GenerateRequest] = []

    async def scheduler_responses(self, request, metadata=None, session=""):
        self.requests.append(request)
        resp = scheduler_pb2.GenerateResponse(
            request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_STOP
        )
        resp.usage.num_prompt_tokens = len(request.prompt_token_ids)
        embedding_to_pb(struct.pack("<2f", len(request.prompt_token_ids), 0.5), resp.embedding)
        yield resp

    async def health(self, timeout_s: float = 2.0):
        return True, ""


MAX_MODEL_LEN = 32


def _client(tokenizer, **config):
    scheduler = FakeScheduler(tokenizer)
    cfg = GatewayConfig(
        model=str(tokenizer.model_dir),
        scheduler_address="unused:1",
        max_model_len=MAX_MODEL_LEN,
        served_model_names=("tiny",),
        **config,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg, scheduler)), base_url="http://gateway")
    return client, scheduler


def _post(tokenizer, body, **config):
    async def go():
        client, scheduler = _client(tokenizer, **config)
        async with client:
            content = body if isinstance(body, bytes) else json.dumps(body)
            resp = await client.post("/v1/embeddings", content=content, headers={"Content-Type": "application/json"})
        return resp, scheduler

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def test_the_route_returns_floats_or_base64_for_every_input_shape(tokenizer):
    n_hi = len(tokenizer.encode("hi"))
    for body, lengths in (
        ({"input": "hi"}, [n_hi]),
        ({"input": ["hi", "hi there"]}, [n_hi, len(tokenizer.encode("hi there"))]),
        ({"input": [5, 6, 7]}, [3]),
        ({"input": [[5], [6, 7]], "model": "tiny"}, [1, 2]),
    ):
        resp, scheduler = _post(tokenizer, body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["object"] == "list" and out["model"] == "tiny"
        assert [d["index"] for d in out["data"]] == list(range(len(lengths)))
        assert [d["embedding"] for d in out["data"]] == [[float(n), 0.5] for n in lengths]
        assert out["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
        assert all(r.pooling == common_pb2.POOLING_TYPE_LAST and r.sampling_params.n == 1 for r in scheduler.requests)
    resp, scheduler = _post(tokenizer, {"input": [5, 6, 7], "encoding_format": "base64"}, pooling_type="MEAN")
    assert base64.b64decode(resp.json()["data"][0]["embedding"]) == struct.pack("<2f", 3.0, 0.5)
    assert scheduler.requests[0].pooling == common_pb2.POOLING_TYPE_MEAN
    # a prompt may fill the whole context: nothing is generated after it
    assert _post(tokenizer, {"input": list(range(5, 5 + MAX_MODEL_LEN))})[0].status_code == 200


EMBEDDING_BAD = [
    ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[5], []]}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": [99999]}, 400, "input"),
    ({"input": list(range(5, 6 + MAX_MODEL_LEN))}, 400, "input"),
    ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": "hi", "model": "gpt-4"}, 404, "model"),
    ({"input": "hi", "temperature": 0.5}, 400, "temperature"),
    ({"input": "hi", "user": 5}, 400, "user"),
    (b'{"input": "\\ud800"}', 400, "input"),
]


@pytest.mark.parametrize(("body", "status", "param"), EMBEDDING_BAD)
def test_bad_embedding_requests_are_refused_naming_the_field(tokenizer, body, status, param):
    resp, scheduler = _post(tokenizer, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    assert scheduler.requests == []  # refused before the scheduler


def test_vllm_task_and_pooling_type_settings_are_checked(tokenizer):
    for task in ("generate", "embed"):
        GatewayConfig(model="m", scheduler_address="a:1", task=task)
    with pytest.raises(ValueError, match="task"):
        GatewayConfig(model="m", scheduler_address="a:1", task="classify")
    with pytest.raises(ValueError, match="pooling_type"):
        GatewayConfig(model="m", scheduler_address="a:1", pooling_type="CLS")
