"""A slow stage is not a hung one (issue 34): `pagoda serve` with its stage worker throttled
to 1/20 of its speed (SIGSTOP/SIGCONT, 5 ms running in every 100) under a burst, with a
step deadline that its prefill steps pass many times over.

Before: every late step reset the pipeline, everything was preempted and the same step was
planned again, for ever. Now every request finishes with the output of an undisturbed run,
the scheduler trace shows the late steps waited on (their stage was ticking), no reset, and
no step planned again at a size that was late.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.stack import start_serve

from scheduler_svc.core.deadlines import MIN_TOKEN_CAP

NUM_REQUESTS = 16
MAX_TOKENS = 8
STEP_TIMEOUT_S = 1.0
RUN_S, PERIOD_S = 0.005, 0.1  # the throttle: 1/20 of the time running


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chaos-slow-stage")
    model = model_factory(arch="llama", hidden_size=256, num_layers=8, intermediate_size=768)
    s = start_serve(
        model,
        logs,
        "--num-kv-blocks",
        "1024",
        "--block-size",
        "16",
        "--num-threads",
        "1",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "tiny",
        "--max-num-batched-tokens",
        "2048",
        "--step-timeout-s",
        str(STEP_TIMEOUT_S),
        env={"PAGODA_TRACE_SCHEDULER": "1", "PAGODA_TRACE_FILE": str(logs / "trace.jsonl")},
    )
    s.trace_path = logs / "trace.jsonl"
    yield s
    s.stop()


def prompts(tag: str):
    """Prompts of their own per run: a run's prefills are computed, not found cached."""
    return [
        f"{tag} request {i}: " + "the quick brown fox jumps over the lazy dog " * (8 + i % 5)
        for i in range(NUM_REQUESTS)
    ]


def run_all(stack, tag: str):
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=600)

    def one(prompt):
        try:
            r = c.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return ("ok", r.choices[0].token_ids)
        except (openai.APIError, openai.APIConnectionError) as exc:
            return ("error", f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, prompts(tag)))


class Throttle:
    """Keeps a process stopped but for RUN_S in every PERIOD_S (a CPU quota of 1/20)."""

    def __init__(self, pid: int) -> None:
        self.pid, self._stop = pid, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            os.kill(self.pid, signal.SIGCONT)
            time.sleep(RUN_S)
            os.kill(self.pid, signal.SIGSTOP)
            time.sleep(PERIOD_S - RUN_S)
        os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> Throttle:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def trace_events(path, since_line: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[since_line:] if line.strip()]


def throttled_round(stack, tag: str) -> list[dict]:
    """Runs the requests with the worker throttled; checks what must hold every time and returns
    the scheduler's trace events of the round."""
    mark = len(stack.trace_path.read_text().splitlines())
    worker = stack.service_pid("worker", 0)
    began = time.time()
    with Throttle(worker):
        outcomes = run_all(stack, tag)
    took = time.time() - began
    events = trace_events(stack.trace_path, mark)
    baseline = run_all(stack, tag)  # the same prompts at full speed (prefix hits: exact too)
    late = [e for e in events if e.get("event") == "late"]
    print(
        f"\n[chaos] {tag}: worker throttled to 1/20: {len(outcomes)} requests, "
        f"{sum(o[0] == 'ok' for o in outcomes)} completed in {took:.1f} s; {len(late)} late steps "
        f"(blamed {[b for e in late for b in e['blamed']]}, caps {[e['token_cap'] for e in late]})"
    )
    assert [o[0] for o in outcomes] == ["ok"] * NUM_REQUESTS, outcomes
    assert [o[1] for o in outcomes] == [o[1] for o in baseline], "outputs differ from the undisturbed run"
    assert late, "the throttled prefill steps should pass their deadline"
    assert all(e["working"] for e in late), late
    assert not [e for e in events if e.get("event") == "reset"], "a slow stage was taken for a hung one"
    return events


def test_a_throttled_stage_finishes_every_request_with_no_preemption_loop(stack):
    assert all(kind == "ok" for kind, _ in run_all(stack, "warm-up"))  # the scheduler learns the step rate
    events: list[dict] = []
    for attempt in range(3):
        # A late step is blamed when the stage, asked, is computing it. On a loaded machine the
        # question can land while the stage computes a newer, not yet late step (the late one's
        # result is on its way back): nothing is blamed then, rightly, and the round is repeated.
        events += throttled_round(stack, f"throttled {attempt}")
        if any(e.get("event") == "late" and e["blamed"] for e in events):
            break
    blamed = [size for e in events if e.get("event") == "late" for _, size in e["blamed"]]
    assert blamed, "in no round was a late step's stage computing it"
    smallest = None
    for e in events:  # no step planned again at a size that was late
        if e.get("event") == "late" and e["blamed"]:
            smallest = min([size for _, size in e["blamed"]] + ([smallest] if smallest else []))
        elif e.get("event") == "dispatched" and smallest is not None:
            # (a late step of one token leaves the floor: a step of one token always fits a plan)
            assert e["num_tokens"] < smallest or smallest <= MIN_TOKEN_CAP, (e, smallest)
    assert stack.kv_used_blocks() == 0
