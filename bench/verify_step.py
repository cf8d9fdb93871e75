"""A verify step's cost (speculative decoding) on one stage: one sequence at a 200-token
context computing its last token and K drafts, as `StageRunner.execute` runs it, for K in
--ks; the median of 20 steps each. With `--as-row`, the verify row is laid out as one row of
K + 1 tokens (causal attention within it) instead of K + 1 decodes (what the stage does).

    python -m bench.verify_step [--model GGUF_OR_DIR] [--ks 0,1,2,4,8] [--as-row]
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the real model's GGUF (SmolLM2-135M Q4_1)")
    ap.add_argument("--ks", default="0,1,2,4,8")
    ap.add_argument("--as-row", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from services.sampling import SamplingParams
    from services.step import CachedSeq, NewSeq, StepPlan
    from wiring.model_source import default_model, prepare_gguf
    from worker_svc.checkpoints.loader import load_stage
    from worker_svc.execution import runner as runner_module
    from worker_svc.execution.runner import StageRunner

    torch.set_num_threads(1)
    path = args.model or str(default_model(log=lambda line: None))
    folder = prepare_gguf(path) if str(path).endswith(".gguf") else path
    runner = StageRunner(load_stage(str(folder), 0, 1, dtype="auto"), 256, 16, "cpu")
    if args.as_row:  # every row as one span, drafts included
        runner._metadata = lambda rows: runner_module.paged_layout(
            [(r.start, r.context_len, r.state.block_ids) for r in rows], runner.block_size, runner.device
        )
    greedy = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(1, (NewSeq(1, tuple(range(100, 300)), 200, 0, 200, tuple(range(16)), greedy),)))
    state, step = runner.batch.seqs[1], 1
    for k in (int(x) for x in args.ks.split(",")):
        times = []
        for _ in range(20):
            step += 1
            start = state.num_computed
            plan = StepPlan(step, (), (CachedSeq(1, 1 + k, 16, draft_token_ids=(5,) * k, start=start if k else -1),))
            began = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - began)
            if state.num_computed > 230:  # stay near context 200
                state.num_computed = 210
                del state.token_ids[211:]
        print(f"K={k}: {1000 * sorted(times)[len(times) // 2]:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
