"""The step contract's wire cost on the scheduler's side of a step: the last stage encoding a
step's sampled tokens into its MicroBatchDone, and the scheduler decoding it, per batch size, as
rows (one message per sampled token, the form used when a token carries logprobs) and as the
two columns used otherwise (issue 37: the control plane's per-row Python).

    python -m bench.step_codec [--rows 1,16,64,256] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import time

from services.pb import worker_pb2
from services.step import SampledToken, StepResult, TokenLogprobs
from services.step_codec import result_from_pb, result_to_pb


def timed(result: StepResult, repeats: int) -> tuple[float, float, int]:
    """(encode us, decode us, bytes) of one step's result."""
    t = time.perf_counter()
    for _ in range(repeats):
        done = worker_pb2.MicroBatchDone(micro_batch_id=1)
        result_to_pb(result, done)
        wire = done.SerializeToString()
    encode = (time.perf_counter() - t) / repeats
    t = time.perf_counter()
    for _ in range(repeats):
        result_from_pb(worker_pb2.MicroBatchDone.FromString(wire))
    decode = (time.perf_counter() - t) / repeats
    return 1e6 * encode, 1e6 * decode, len(wire)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    print(f"{'rows':>5} {'form':<8} {'encode us':>10} {'decode us':>10} {'bytes':>6}")
    for n in (int(x) for x in args.rows.split(",")):
        columns = StepResult(1, tuple(SampledToken(i, 1000 + i, None) for i in range(n)))
        # one token with logprobs sends every row as a message (the form before the columns)
        rows = StepResult(1, (SampledToken(0, 1000, TokenLogprobs(-0.1, [])), *columns.sampled[1:]))
        for form, result in (("columns", columns), ("rows", rows)):
            encode, decode, size = timed(result, args.repeats)
            print(f"{n:>5} {form:<8} {encode:>10.1f} {decode:>10.1f} {size:>6}")


if __name__ == "__main__":
    main()
