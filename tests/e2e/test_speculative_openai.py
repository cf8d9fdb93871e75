"""Speculative decoding end to end (issue 27): `pagoda serve --speculative-config` (n-gram)
with two stages, the last feeding the first (asynchronous scheduling), driven by the
official `openai` SDK. Greedy completions equal those of transformers (the tie rule); the
drafted and accepted counters reach `/metrics` under vLLM's names; the KV pool is empty once
the requests end.
"""

from __future__ import annotations

import json
import re
import urllib.request

import openai
import pytest
import torch
from support.reference import HFReference
from support.stack import start_serve

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("speculative-stack-logs")
    serve = start_serve(
        model_dir,
        logs,
        "--pipeline-parallel-size",
        "2",
        "--num-kv-blocks",
        "64",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--speculative-config",
        SPEC,
    )
    yield serve
    serve.stop()


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_greedy_completions_equal_transformers_and_counters_count(stack, model_dir):
    reference = HFReference(model_dir)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="none")
    g = torch.Generator().manual_seed(7)
    prompts = []
    for n in (10, 30, 60):
        seg = torch.randint(5, 512, (n,), generator=g).tolist()
        prompts.append(seg + seg[: n // 2] + seg)
    for prompt in prompts:
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=32,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        got = out.choices[0].token_ids
        assert len(got) == 32
        assert reference.compare(prompt, got).tie_divergences <= 1
    drafts = _metric(stack.port, "pagoda:spec_decode_num_draft_tokens_total")
    accepted = _metric(stack.port, "pagoda:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert _metric(stack.port, "pagoda:kv_cache_used_blocks") == 0
