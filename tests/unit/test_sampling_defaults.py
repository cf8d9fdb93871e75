"""The sampling a request gets for the fields it leaves out (issue 35, item 4): the model's
generation_config.json as vLLM applies it, llama.cpp's defaults for a GGUF file, vLLM's
`--generation-config` modes and `--override-generation-config`, a request's own fields
winning, and `/v1/models` saying which apply. The gateway runs in-process over
test_gateway_app's fake scheduler, which records the sampling each request reached it with."""

from __future__ import annotations

import json
import shutil

import pytest
from test_gateway_app import FakeGenerator, post, run

from gateway.app import create_app
from gateway.config import GatewayConfig
from services.generation_config import GGUF_SOURCE_FILE, LLAMA_CPP_DEFAULTS, SamplingDefaults, sampling_defaults
from services.text import Tokenizer

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory(arch="llama")


def _copy(tiny, tmp_path, name="model", generation=None, gguf=False):
    """The tiny model's tokenizer and config under another generation_config.json (merged over
    its stop ids), and marked as prepared for a GGUF file when `gguf`."""
    folder = tmp_path / name
    shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **(generation or {})}))
    if gguf:
        (folder / GGUF_SOURCE_FILE).write_text(json.dumps({"file": "/nowhere/model.gguf"}))
    return folder


def _sent(folder, bodies, **config):
    """Each body posted to chat completions: (the sampling the scheduler got, /v1/models)."""
    import httpx2 as httpx

    async def go():
        generator = FakeGenerator(Tokenizer(folder))
        cfg = GatewayConfig(
            model=str(folder), scheduler_address="unused:1", max_model_len=64, served_model_names=("tiny",), **config
        )
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(cfg, generator)), base_url="http://gateway"
        )
        async with client:
            for body in bodies:
                resp = await post(client, "/v1/chat/completions", {**CHAT, **body})
                assert resp.status_code == 200, resp.text
            models = (await client.get("/v1/models")).json()
        return [params.sampling for _, params, _ in generator.calls], models

    return run(go())


def _picked(options):
    return (options.temperature, options.top_p, options.top_k, options.min_p, options.repetition_penalty)


def test_a_gguf_model_gets_llama_cpps_defaults_and_a_requests_fields_win(tiny, tmp_path):
    """The default model's case: a GGUF file has no generation config, so a request without
    sampling fields samples as llama.cpp's server and Ollama would (it got temperature 1 over
    the whole vocabulary, and the README's question answered noise)."""
    folder = _copy(tiny, tmp_path, gguf=True)
    (plain, explicit, greedy, off), models = _sent(
        folder, [{}, {"temperature": 1.0, "top_p": 0.5}, {"temperature": 0}, {"top_k": -1, "min_p": 0}]
    )
    assert _picked(plain) == (0.8, 0.95, 40, 0.05, 1.0)
    assert _picked(explicit) == (1.0, 0.5, 40, 0.05, 1.0)  # each field on its own
    assert greedy.temperature == 0.0
    assert (off.top_k, off.min_p, off.temperature) == (0, 0.0, 0.8)  # -1 and 0 are "off", and win
    card = models["data"][0]
    assert card["sampling_defaults"] == {
        **LLAMA_CPP_DEFAULTS,
        "repetition_penalty": None,
        "source": "llama.cpp's, for a GGUF file",
    }


def test_generation_config_sampling_fields_apply_as_vllm_applies_them(tiny, tmp_path):
    folder = _copy(
        tiny,
        tmp_path,
        generation={"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True},
    )
    (plain, mine), models = _sent(folder, [{}, {"temperature": 0.2, "repetition_penalty": 1.0}])
    assert _picked(plain) == (0.6, 0.9, 20, 0.0, 1.05)
    assert _picked(mine) == (0.2, 0.9, 20, 0.0, 1.0)
    assert models["data"][0]["sampling_defaults"]["source"] == "the model's generation_config.json"


def test_generation_config_modes_and_the_override(tiny, tmp_path):
    folder = _copy(tiny, tmp_path, generation={"temperature": 0.6, "top_k": -1}, gguf=True)
    other = _copy(tiny, tmp_path, "other", generation={"temperature": 0.3, "min_p": 0.1})
    # a generation config with sampling fields wins over llama.cpp's; top_k -1 is off
    assert sampling_defaults(folder).fields() == {"temperature": 0.6, "top_k": 0}
    assert sampling_defaults(folder, "vllm").fields() == {}
    assert sampling_defaults(folder, str(other)).fields() == {"temperature": 0.3, "min_p": 0.1}
    over = sampling_defaults(folder, "auto", '{"temperature": 1, "top_p": 0.5}')
    assert over.fields() == {"temperature": 1.0, "top_p": 0.5, "top_k": 0}
    assert "override" in over.source
    (plain,), _ = _sent(folder, [{}], generation_config="vllm", override_generation_config='{"top_k": 7}')
    assert _picked(plain) == (1.0, 1.0, 7, 0.0, 1.0)
    # the tiny model's own generation_config.json holds stop ids only: nothing changes
    assert sampling_defaults(tiny) == SamplingDefaults(source="none in the model's generation_config.json")


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"override_generation_config": '{"temperature": -1}'}, "temperature"),
        ({"override_generation_config": '{"max_new_tokens": 5}'}, "max_new_tokens"),
        ({"override_generation_config": "[1]"}, "JSON object"),
        ({"override_generation_config": "{"}, "not JSON"),
        ({"generation_config": ""}, "generation_config"),
    ],
)
def test_bad_generation_settings_are_refused_naming_them(tiny, settings, says):
    with pytest.raises(ValueError, match=says):
        GatewayConfig(model=tiny, scheduler_address="unused:1", **settings)


def test_a_missing_or_bad_generation_config_folder_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        sampling_defaults(tiny, str(tmp_path))
    bad = _copy(tiny, tmp_path, "bad", generation={"top_p": 0})
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(bad)


def test_the_gguf_marker_is_the_one_the_stages_write():
    from worker_svc.checkpoints.gguf_checkpoint import GGUF_SOURCE_FILE as WRITTEN

    assert GGUF_SOURCE_FILE == WRITTEN


def test_the_banner_line_says_which_defaults_apply(tiny, tmp_path):
    line = sampling_defaults(_copy(tiny, tmp_path, gguf=True)).describe()
    assert line.startswith("temperature 0.8, top_p 0.95, top_k 40, min_p 0.05 (llama.cpp's")
    assert "a request's own fields win" in line
