"""A scheduler killed while a request streams (issue 35, item 19): the stream ends with an
error that says what happened in the API's terms (the scheduler went away; the answer is
incomplete; send it again), not gRPC's transport text ("Stream removed (Socket closed)").
Real processes (`pagoda serve`), the official `openai` SDK as the client."""

from __future__ import annotations

import os
import signal

import openai
import pytest
from support.stack import start_serve

TRANSPORT_WORDS = (
    "Stream removed",
    "Socket closed",
    "Connection reset",
    "GOAWAY",
    "peer went",
)  # (gRPC's, a local stream's)


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    s = start_serve(
        model_factory(arch="llama"),
        tmp_path_factory.mktemp("scheduler-lost"),
        "--num-kv-blocks",
        "64",
        "--num-threads",
        "1",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--max-restarts",
        "5",
    )
    yield s
    s.stop()


def test_a_stream_cut_by_a_killed_scheduler_says_so(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a long story"}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            received += 1
            if received == 3:  # streaming: the client holds part of an answer
                os.kill(stack.service_pid("scheduler"), signal.SIGKILL)
    message = str(caught.value)
    assert received >= 3
    assert "scheduler" in message and "incomplete" in message and "again" in message, message
    assert not any(word in message for word in TRANSPORT_WORDS), message
    stack.wait_serving(60)  # and it serves again
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert again.choices[0].finish_reason in ("length", "stop")
