"""The README's chat request, sent as written (no sampling fields) to a running server, N times
in rounds: how many answers mention Paris (issue 35). Start the server first (`make run`).

    python -m bench.readme_chat [--url http://localhost:8000] [--n 20] [--rounds 5] [--extra JSON]

`--extra '{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0}'` adds fields to every
request (that one: the sampling a request got before the model's defaults applied).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

REQUEST = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 32,
}


def answer(url: str, extra: dict) -> str:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps({**REQUEST, **extra}).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=300).read())["choices"][0]["message"]["content"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://localhost:8000")
    ap.add_argument("--n", type=int, default=20, help="requests per round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--extra", default="{}", help="fields added to each request (JSON)")
    ap.add_argument("--show", action="store_true", help="print each answer")
    args = ap.parse_args(argv)
    extra = json.loads(args.extra)
    counts = []
    for _ in range(args.rounds):
        hits = 0
        for _ in range(args.n):
            text = answer(args.url, extra)
            hits += "paris" in text.lower()
            if args.show:
                print(repr(text))
        counts.append(hits)
        print(f"Paris: {hits} of {args.n}", flush=True)
    if args.rounds > 1:
        print(f"all rounds: {sum(counts)} of {args.n * args.rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
