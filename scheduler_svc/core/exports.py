"""P/D disaggregation on a prefill replica (issue 39): finished prompts whose KV is held for a
decode replica to pull (`GenerateRequest.kv_export`).

A request sent with kv_export (and n = 1) finishes as any other, but its sequence's KV is not
dropped: the KV service keeps its blocks and the stages its block table, so that a decode
replica's stages can read them (`StageWorker.ExportBlocks`). The hold ends when an Abort names
the request (the gateway sends one once the decode replica has answered, or has given up), or
after `EXPORT_HOLD_S`, whichever comes first; a pipeline reset ends every hold (the KV service
and the stages forget everything then).
"""

from __future__ import annotations

from scheduler_svc.core.request import Request, Sequence

EXPORT_HOLD_S = 30.0  # a hold nobody released (a gateway that died, a decode side that failed)


class HeldExports:
    """Request id -> (its held sequence, when the hold ends). Invariant (`check_integrity`):
    every held sequence still has its KV and is finished."""

    def __init__(self, hold_s: float = EXPORT_HOLD_S) -> None:
        self.hold_s = hold_s
        self._held: dict[str, tuple[Sequence, float]] = {}
        self.num_exports = self.num_released = self.num_expired = 0

    def __len__(self) -> int:
        return len(self._held)

    @staticmethod
    def wanted(request: Request) -> bool:
        return request.export_kv and request.options.n == 1 and request.pooling is None

    def hold(self, seq: Sequence, block_size: int, now: float) -> None:
        """`seq` finished: keep its KV, and say on its request what can be pulled (its full
        prompt blocks before the one holding the last prompt token, which the decode side
        computes to sample from)."""
        request = seq.request
        num_blocks = min(seq.num_blocks, (len(request.prompt) - 1) // block_size)
        request.exported = (seq.seq_id, num_blocks)
        self._held[request.request_id] = (seq, now + self.hold_s)
        self.num_exports += 1

    def release(self, request_id: str) -> Sequence | None:
        """The held sequence of `request_id` (None: none held), no longer held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self.num_released += 1
        return held[0]

    def expired(self, now: float) -> list[Sequence]:
        """The sequences whose hold ended by `now`, no longer held."""
        ended = [rid for rid, (_, until) in self._held.items() if until <= now]
        self.num_expired += len(ended)
        return [self._held.pop(rid)[0] for rid in ended]

    def clear(self) -> None:
        self._held.clear()

    def check_integrity(self) -> None:
        for rid, (seq, _) in self._held.items():
            assert seq.has_kv and seq.is_finished and seq.request.request_id == rid, (rid, seq.seq_id)
