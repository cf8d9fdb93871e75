"""Speculative decoding on the real model (issue 27): `pagoda serve` with and without
`--speculative-config` (n-gram), the same requests through the `openai` SDK, one server at
a time on an otherwise idle machine.

    python -m bench.spec_decode [--model GGUF_OR_DIR] [--k 4] [--out DIR]

Loads (greedy):
- grounded: a chat request that asks the model to repeat a passage word for word (the
  passages are paragraphs of this repository's docs); the output copies the prompt, which
  is what prompt lookup drafts from;
- random: prompts of random token ids, `ignore_eos`: nothing to copy.
Each at one stream (requests one after another) and at 16 streams (16 clients, closed loop).
Reported: output tokens per second (output tokens over the load's wall time), ratios to no
speculation, and the acceptance rate from the server's `/metrics`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def passages(count: int) -> list[str]:
    """Paragraphs of 60-160 words from the docs, in a fixed order."""
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for para in path.read_text().split("\n\n"):
            words = para.split()
            if 60 <= len(words) <= 160 and not para.lstrip().startswith(("|", "```", "#", "-")):
                out.append(" ".join(words))
    random.Random(0).shuffle(out)
    return out[:count]


def start(model: str | None, log_dir: Path, extra: list[str]):
    from wiring.launcher import ServiceProcess, free_port, pagoda_command

    port, grpc_port = free_port(), free_port()
    args = ([model] if model else []) + [
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--log-dir",
        str(log_dir),
        "--served-model-name",
        "m",
        *extra,
    ]
    proc = ServiceProcess(
        "serve", pagoda_command("serve", *args), f"127.0.0.1:{grpc_port}", log_path=log_dir / "serve.log"
    )
    proc.start()
    proc.wait_healthy(600)
    return proc, port


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def run_load(port: int, kind: str, streams: int, num: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    texts = passages(num)
    rng = random.Random(1)

    def one(i: int) -> int:
        if kind == "grounded":
            text = texts[i % len(texts)]
            out = client.chat.completions.create(
                model="m",
                temperature=0.0,
                max_tokens=max_tokens,
                messages=[{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{text}"}],
            )
        else:
            prompt = [rng.randrange(100, 40000) for _ in range(128)]
            out = client.completions.create(
                model="m", prompt=prompt, temperature=0.0, max_tokens=max_tokens, extra_body={"ignore_eos": True}
            )
        return out.usage.completion_tokens

    drafts0 = metric(port, "pagoda:spec_decode_num_draft_tokens_total")
    accepted0 = metric(port, "pagoda:spec_decode_num_accepted_tokens_total")
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(num)))
    wall = time.perf_counter() - started
    drafts = metric(port, "pagoda:spec_decode_num_draft_tokens_total") - drafts0
    accepted = metric(port, "pagoda:spec_decode_num_accepted_tokens_total") - accepted0
    return {
        "load": kind,
        "streams": streams,
        "requests": num,
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafts if drafts else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: pagoda serve's (SmolLM2-135M-Instruct)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--loads",
        default="grounded:1:6,grounded:16:32,random:1:4,random:16:32",
        help="kind:streams:requests, comma-separated",
    )
    args = ap.parse_args(argv)
    spec = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min,
        }
    )
    always = json.dumps({**json.loads(spec), "disable_by_batch_size": None})
    # "ngram": Pagoda's default (no drafts above 8 running requests); "always": vLLM's default
    arms = {"plain": [], "ngram": ["--speculative-config", spec], "always": ["--speculative-config", always]}
    loads = [(k, int(s), int(n)) for k, s, n in (x.split(":") for x in args.loads.split(","))]
    results: dict[str, list[dict]] = {}
    for arm, extra in arms.items():
        with tempfile.TemporaryDirectory() as logs:
            proc, port = start(args.model, Path(logs), extra)
            try:
                run_load(port, "grounded", 1, 1, 16)  # warm-up
                results[arm] = [run_load(port, k, s, n, args.max_tokens) for k, s, n in loads]
            finally:
                proc.stop(30)
    lines = [
        f"n-gram speculation, {spec} (always: disable_by_batch_size null)",
        "",
        "| load | streams | plain tok/s | ngram tok/s | ratio | acceptance | always tok/s | ratio | acceptance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(arm: dict, plain: dict) -> str:
        acc = "-" if arm["acceptance"] is None else f"{arm['acceptance']:.2f}"
        return f"{arm['tok_s']:.1f} | {arm['tok_s'] / plain['tok_s']:.2f}x | {acc}"

    for plain, ngram, always_ in zip(results["plain"], results["ngram"], results["always"], strict=True):
        lines.append(
            f"| {plain['load']} | {plain['streams']} | {plain['tok_s']:.1f} | {cell(ngram, plain)} | "
            f"{cell(always_, plain)} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_decode.json").write_text(json.dumps(results, indent=2))
        (args.out / "spec_decode.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
