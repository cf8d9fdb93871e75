"""The live dashboard in a real headless Chromium (Debian's, driven by Playwright from the
package index) against `pagoda serve` (PP=2) under load from the `openai` client: the page
loads without a console error, its numbers move while requests run, and a screenshot is
saved (`test-results/dashboard.png`, or under $PAGODA_TEST_RESULTS).

`make test` installs Debian's chromium where it can (`make browser`); elsewhere this test is
skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from support.stack import kill_tree

from wiring.launcher import ServiceProcess, free_port, pagoda_command

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RESULTS = Path(os.environ.get("PAGODA_TEST_RESULTS", Path(__file__).resolve().parents[2] / "test-results"))

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (make browser installs Debian's where apt-get runs as root)"
)


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dashboard-stack-logs")
    port, grpc_port = free_port(), free_port()
    serve = ServiceProcess(
        "serve",
        pagoda_command(
            "serve",
            model_factory(arch="llama"),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--pipeline-parallel-size",
            "2",
            "--num-kv-blocks",
            "96",
            "--block-size",
            "16",
            "--num-threads",
            "1",
            "--max-model-len",
            "512",
            "--served-model-name",
            "tiny",
            "--log-dir",
            str(logs),
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=logs / "serve.log",
    )
    serve.start()
    try:
        serve.wait_healthy(180)
    except Exception:
        serve.stop()
        raise
    yield port
    kill_tree(serve)  # the graceful drain is not tested here (3-7 s a stack)


def test_state_is_the_pages_json(stack):
    state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{stack}/dashboard/state", timeout=10).read())
    assert state["model"] == "tiny" and state["health"] == "serving"
    assert state["kv"]["total"] == 96 and len(state["kv"]["map"]) == 2 * 96
    assert [s["index"] for s in state["stages"]] == [0, 1]


def test_the_dashboard_moves_under_load_in_chromium(stack):
    from playwright.sync_api import sync_playwright

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack}/v1", api_key="none", max_retries=0, timeout=60)
    running = True
    failures: list[BaseException] = []

    def load(i: int) -> None:
        while running:
            try:
                client.completions.create(
                    model="tiny", prompt=f"Tell me a story {i} " * 8, max_tokens=48, temperature=1.0
                )
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{stack}/dashboard")
            page.wait_for_function("document.getElementById('health').textContent === 'serving'", timeout=20_000)
            before = page.inner_text("#generated")
            workers = [threading.Thread(target=load, args=(i,)) for i in range(6)]
            for w in workers:
                w.start()
            try:
                page.wait_for_function(
                    "Number(document.getElementById('tokens-per-s').textContent) > 0 "
                    "&& Number(document.getElementById('running').textContent) > 0",
                    timeout=30_000,
                )
                time.sleep(2.5)  # a few polls: the timeline and the throughput line fill in
                RESULTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(RESULTS / "dashboard.png"), full_page=True)
                after = page.inner_text("#generated")
                kv_used = page.inner_text("#kv-used-n")
                rows = page.inner_text("#stages")
            finally:
                running = False
                for w in workers:
                    w.join(60)
        finally:
            browser.close()
    assert not failures, failures
    assert errors == [], errors
    assert after != before
    assert int(kv_used) >= 0 and "serving" in rows
    assert (RESULTS / "dashboard.png").stat().st_size > 10_000
