"""Issue 35, what a new user met on the command line (items 10-13 and 18): settings that a
stage refused only after loading its weights, in a 38-line traceback, are refused by
`pagoda serve` before it starts anything; a port out of range and a mistyped flag are said in
one line (with the flag meant); `--help` is in sections as vLLM's; the start banner says
where the stages really run.

Nothing here starts a process: `pagoda serve` is refused by its checks, or stopped where it
would start the stack."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.settings import SERVICES
from wiring import serve, serve_checks
from wiring.cli import build_parser, main
from wiring.flags import service_settings


@pytest.fixture(autouse=True)
def checks_only(monkeypatch):
    """No PAGODA_* variable but the test's; `pagoda serve` past its checks fails the test
    instead of starting anything."""
    import os

    for name in [
        n for n in os.environ if n.startswith("PAGODA_") and n not in ("PAGODA_INTERNAL_TOKEN", "PAGODA_AUTO_DTYPE")
    ]:
        monkeypatch.delenv(name)

    def started(*args, **kwargs):
        raise AssertionError("pagoda serve went past its checks")

    monkeypatch.setattr(serve, "_StopFlag", started)


@pytest.fixture
def model(model_factory, tmp_path) -> Path:
    """A copy of the tiny llama checkpoint (vocabulary 512, hidden size 64)."""
    return Path(shutil.copytree(model_factory(arch="llama"), tmp_path / "model"))


def refused(capsys, model: str | Path, *flags: str) -> str:
    """`pagoda serve MODEL FLAGS` refused before starting anything: its one error line."""
    code = main(["serve", str(model), "--port", "0", "--grpc-port", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def parse_error(capsys, *argv: str) -> str:
    """The parser's refusal of `pagoda ARGV`: exit code 2 and one line."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(list(argv))
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2, err
    assert err and "\n" not in err, err
    return err


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


# --- 10: settings checked before any process starts ------------------------------------------------


def _draft(path: Path) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": 2})


def test_a_draft_model_that_does_not_exist_is_refused_naming_the_flag(capsys, model, tmp_path):
    err = refused(capsys, model, "--speculative-config", _draft(tmp_path / "nowhere"))
    assert err == (
        f"error: --speculative-config: the draft model {tmp_path / 'nowhere'} does not exist "
        "(speculative_config.model: a checkpoint folder)"
    )
    (tmp_path / "empty").mkdir()
    err = refused(capsys, model, "--speculative-config", _draft(tmp_path / "empty"))
    assert err.startswith("error: --speculative-config: the draft model: ") and "config.json" in err


def test_a_draft_model_of_another_vocabulary_is_refused_naming_both(capsys, model, tmp_path):
    draft = Path(shutil.copytree(model, tmp_path / "draft"))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    err = refused(capsys, model, "--speculative-config", _draft(draft))
    assert err == (
        f"error: --speculative-config: the draft model's vocabulary (1024, {draft / 'config.json'}) "
        f"is not the target's (512, {model / 'config.json'}): a draft must share the target's "
        "tokenizer"
    )
    args = build_parser().parse_args(["serve", str(model), "--speculative-config", _draft(model)])
    assert serve_checks.check_start(args, str(model)) == []  # the same vocabulary: taken


def _adapter(folder: Path, **config) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], **config})
    )
    return folder


def test_an_adapter_of_a_rank_above_max_lora_rank_is_refused_naming_both_flags(capsys, model, tmp_path):
    big = _adapter(tmp_path / "big", r=32)
    err = refused(capsys, model, "--enable-lora", "--lora-modules", f"big={big}")
    assert err == (
        f"error: --lora-modules big={big}: LoRA rank 32 ({big / 'adapter_config.json'}) is above "
        "--max-lora-rank 16: raise --max-lora-rank to at least 32"
    )
    patterned = _adapter(tmp_path / "patterned", r=8, rank_pattern={"v_proj": 64})
    assert "LoRA rank 64" in refused(
        capsys, model, "--enable-lora", "--lora-modules", f"p={patterned}", "--max-lora-rank", "32"
    )
    args = build_parser().parse_args(
        ["serve", str(model), "--enable-lora", "--lora-modules", f"big={big}", "--max-lora-rank", "32"]
    )
    assert serve_checks.check_start(args, str(model)) == []


def test_an_adapter_folder_that_is_not_one_is_refused_naming_it(capsys, model, tmp_path):
    err = refused(capsys, model, "--enable-lora", "--lora-modules", f"a={tmp_path / 'none'}")
    assert err.startswith(f"error: --lora-modules a={tmp_path / 'none'}: ") and "adapter_config.json" in err


# --- 11: ports ---------------------------------------------------------------------------------------

REQUIRED = {
    "worker": ["--model", "m"],
    "kvcache": [],
    "scheduler": ["--model", "m", "--kvcache", "k:1", "--stages", "s:2"],
    "gateway": ["--model", "m", "--scheduler", "s:1"],
    "serve": [],
}


def _port_flags(command: str) -> list[str]:
    settings = serve.serve_settings() if command == "serve" else service_settings(command)
    return [b.setting.flag for b in settings if b.setting.name.endswith("port") and b.setting.command_line]


@pytest.mark.parametrize("command", [*SERVICES, "serve"])
def test_every_port_flag_refuses_a_port_out_of_range_in_one_line(capsys, command):
    flags = _port_flags(command)
    assert flags
    for flag in flags:
        for bad in ("99999", "65536", "-1", "http"):
            err = parse_error(capsys, command, *REQUIRED[command], flag, bad)
            assert f"argument {flag}: expected a port" in err and "65535" in err and repr(bad) in err, err
        assert (
            getattr(build_parser().parse_args([command, *REQUIRED[command], flag, "65535"]), flag[2:].replace("-", "_"))
            == 65535
        )


def test_port_0_is_any_free_port_where_that_means_something(capsys):
    assert build_parser().parse_args(["serve", "--port", "0", "--grpc-port", "0"]).port == 0
    assert build_parser().parse_args(["worker", "--model", "m", "--port", "0"]).port == 0
    # a metrics port nobody can know is no use: 0 is refused
    err = parse_error(capsys, "worker", "--model", "m", "--metrics-port", "0")
    assert "argument --metrics-port: expected a port in 1..65535, got '0'" in err


def test_serve_with_a_port_out_of_range_says_so_in_one_line(capsys, model):
    """`--port 99999` ended in an OverflowError traceback (the taken-port check's bind)."""
    with pytest.raises(SystemExit) as done:
        main(["serve", str(model), "--port", "99999"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and "\n" not in err
    assert err == "pagoda serve: error: argument --port: expected a port in 0..65535 (0: any free one), got '99999'"


# --- 12: a mistyped flag ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["serve", "--max-model-length", "4096"], "--max-model-len"),
        (["serve", "--enable-auto-tool-choise"], "--enable-auto-tool-choice"),
        (["serve", "--max-model-length=4096"], "--max-model-len"),
        (["worker", "--model", "m", "--max-lora-rnak", "8"], "--max-lora-rank"),
        (["gateway", "--model", "m", "--scheduler", "s:1", "--tool-call-parsr", "hermes"], "--tool-call-parser"),
        (["scheduler", *REQUIRED["scheduler"], "--scheduler-polcy", "fcfs"], "--scheduler-policy"),
        (["kvcache", "--num-kv-blokcs", "8"], "--num-kv-blocks"),
        (["tiny-model", "x", "--num-layesr", "2"], "--num-layers"),
        (["k8s-manifests", "--replcias", "2"], "--replicas"),
    ],
)
def test_a_mistyped_flag_is_refused_by_its_subcommand_with_the_flag_meant(capsys, argv, meant):
    err = parse_error(capsys, *argv)
    assert err.startswith(f"pagoda {argv[0]}: error: unrecognized argument"), err
    assert f"did you mean {meant}?" in err


def test_an_argument_like_no_flag_is_named_without_a_guess(capsys):
    err = parse_error(capsys, "serve", "--zzzzzz")
    assert err.startswith("pagoda serve: error: unrecognized argument --zzzzzz") and "did you mean" not in err
    assert "pagoda serve --help" in err


# --- 13: --help in sections ----------------------------------------------------------------------


def _sections(command: str) -> dict[str, list[str]]:
    return {
        g.title: [o for a in g._group_actions for o in a.option_strings]
        for g in subparser(command)._action_groups
        if g._group_actions
    }


def test_serve_help_is_in_sections_as_vllm_serves():
    sections = _sections("serve")
    titles = [t for t in sections if t not in ("positional arguments", "options")]
    assert titles[:8] == [
        "Model",
        "Device",
        "Parallelism",
        "Cache",
        "Scheduler",
        "Frontend",
        "LoRA",
        "Speculative decoding",
    ]
    for flag, title in (
        ("--max-model-len", "Model"),
        ("--dtype", "Model"),
        ("--device", "Device"),
        ("-pp", "Parallelism"),
        ("--replicas", "Parallelism"),
        ("--num-kv-blocks", "Cache"),
        ("--gpu-memory-utilization", "Cache"),
        ("--max-num-seqs", "Scheduler"),
        ("--chat-template", "Frontend"),
        ("--api-key", "Frontend"),
        ("--port", "Network"),
        ("--lora-modules", "LoRA"),
        ("--max-lora-rank", "LoRA"),
        ("--speculative-config", "Speculative decoding"),
        ("--max-restarts", "Supervision"),
    ):
        assert flag in sections[title], (flag, title)
    text = subparser("serve").format_help()
    assert "\nModel:\n" in text and "\nLoRA:\n" in text


@pytest.mark.parametrize("command", [*SERVICES, "serve"])
def test_every_flag_of_a_service_is_in_a_section(command):
    """Only --help stays among the plain options: a setting without a section is a test failure,
    not a flag lost at the end of a long list."""
    assert _sections(command)["options"] == ["-h", "--help"]


# --- 18: the start banner's cores ---------------------------------------------------------------


def _banner(capsys, service_cpus, stage_cpus) -> str:
    args = SimpleNamespace(block_size=16, max_model_len=1024, replicas=1, routing="prefix")
    stack = SimpleNamespace(
        num_kv_blocks=64, service_cpus=service_cpus, workers=[SimpleNamespace(cpus=c) for c in stage_cpus]
    )
    serve._print_capacity(args, "model", [stack], None)
    return capsys.readouterr().out


def test_the_banner_says_the_stage_is_not_pinned_on_two_cores(capsys, monkeypatch):
    """2 cores, one stage: the services get core 0 and the stage is left unpinned (its large
    steps take both cores); the banner said `stages [[]]`."""
    from wiring.launcher import cpu_plan

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    services, _ = cpu_plan(1, 1, [0, 1])
    text = _banner(capsys, services, [None])
    assert "[[]]" not in text
    assert (
        "cores: services [0] (--no-cpu-affinity to let them float); stages not pinned: any of [0, 1] "
        "(a step of 128 tokens or more takes the services' core too)"
    ) in text
    text = _banner(capsys, {0}, [{1}, {2, 3}])
    assert "cores: services [0], stages [[1], [2, 3]] (--no-cpu-affinity to let them float)" in text
    assert "cores" not in _banner(capsys, None, [None])
