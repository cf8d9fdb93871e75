"""The default model on an AVX2-only CPU (issue 34), emulated on whatever CPU runs the test:
every ISA cap of an AVX2-only machine set for `pagoda serve` and its processes
(`ONEDNN_MAX_CPU_ISA=AVX2`, `ATEN_CPU_CAPABILITY=avx2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`, the
native kernels' `PAGODA_CPU_ISA=avx2`).

Before: a packed prefill always ran oneDNN's bfloat16 GEMM, which such a CPU emulates at a
fraction of float32's rate; a burst's 2,048-token steps passed the hung-stage deadline and
the server preempted and re-planned them for ever. Now the stage chooses the float32 GEMM (or
the integer kernels) there, says so in the banner and /debug/memory, and a burst of 64
requests completes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.stack import start_serve

from wiring.model_source import DEFAULT_MODEL_NAME

AVX2_CAPS = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "PAGODA_CPU_ISA": "avx2",
}
NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def avx2_stack(real_gguf, tmp_path_factory):
    stack = start_serve(
        None, tmp_path_factory.mktemp("avx2-serve"), "--num-kv-blocks", "1024", env=AVX2_CAPS, timeout_s=300
    )
    yield stack
    stack.stop()


def test_the_stage_reports_an_avx2_cpu_and_no_bfloat16_gemm(avx2_stack):
    cpu = avx2_stack.get("/debug/memory")["stages"][0]["cpu"]
    assert ": avx2 (host " in cpu or cpu.split("): ")[1].startswith("avx2"), cpu
    assert "bf16 gemm no" in cpu and "packed prefill bf16-gemm" not in cpu, cpu
    banner = (avx2_stack.logs / "serve.log").read_text()
    assert "cpu: " in banner and "bf16 gemm no" in banner, banner[-2000:]


def test_a_burst_of_64_requests_completes(avx2_stack):
    client = openai.OpenAI(base_url=f"{avx2_stack.url}/v1", api_key="none", max_retries=0, timeout=600)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()

    def one(i: int) -> tuple[str, int]:
        prompt = " ".join(words[(i + j) % len(words)] for j in range(100))  # ~128 tokens
        r = client.completions.create(
            model=DEFAULT_MODEL_NAME,
            prompt=f"{i}: {prompt}",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        outcomes = list(pool.map(one, range(NUM_REQUESTS)))
    assert outcomes == [("length", 16)] * NUM_REQUESTS
    stats = avx2_stack.get("/debug/memory")
    assert stats["kv_cache"]["num_used_blocks"] == 0
    log = (avx2_stack.logs / "scheduler.log").read_text()
    assert "pipeline unhealthy" not in log, "a step was taken for a hung stage"
