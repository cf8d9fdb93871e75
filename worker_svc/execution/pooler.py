"""Pooling on the last stage: a pooling sequence's vector from the final norm's output.

A pooling sequence (`services.pooling`) is computed like any prompt, in one step or in
chunks; the last stage never samples it. `pool_positions` picks which positions of a step
feed pooling (a mean-pooling row: every position it computes; a last-token row: its last
position, in the step that completes its prompt), the model returns the final norm's output
there (`StageModel.forward_pooled`), and `pool` reduces it: a mean sums each chunk into the
sequence's state (`SeqState.pooled_sum`, float32) and divides by the prompt's length once
the prompt is complete. The result is L2-normalized, as vLLM's pooling runner normalizes
embeddings, and leaves as little-endian float32 bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.pooling import Embedding
from services.step import PooledOutput
from worker_svc.execution.batch import Row


def pool_positions(rows: list[Row]) -> tuple[list[Row], list[int]]:
    """The rows of a step that pool, and the batch indices of the positions they pool, in
    order (the batch's tokens are the rows' tokens, in row order)."""
    pooling, indices, offset = [], [], 0
    for r in rows:
        if r.pools and r.state.pooling.needs_every_position:
            pooling.append(r)
            indices.extend(range(offset, offset + r.num_tokens))
        elif r.pool_done:
            pooling.append(r)
            indices.append(offset + r.num_tokens - 1)
        offset += r.num_tokens
    return pooling, indices


def pool(normed: torch.Tensor, rows: list[Row]) -> list[PooledOutput]:
    """`normed` [len(indices), hidden]: the final norm's output at `pool_positions`' indices
    for these rows. Mean rows add to their sums; each row that completes its prompt gives
    its vector."""
    out: list[PooledOutput] = []
    at = 0
    for r in rows:
        state = r.state
        if state.pooling.needs_every_position:
            part = normed[at : at + r.num_tokens].float().sum(dim=0)  # [hidden]
            at += r.num_tokens
            state.pooled_sum = part if state.pooled_sum is None else state.pooled_sum + part
            if r.pool_done:
                out.append(PooledOutput(r.seq_id, normalized_bytes(state.pooled_sum / r.context_len)))
        else:
            out.append(PooledOutput(r.seq_id, normalized_bytes(normed[at].float())))
            at += 1
    return out


def normalized_bytes(vector: torch.Tensor) -> Embedding:
    """A [hidden] vector L2-normalized (as `F.normalize`: divided by max(norm, 1e-12)), as
    little-endian float32 bytes."""
    unit = F.normalize(vector.float(), p=2, dim=-1)
    return unit.cpu().numpy().astype("<f4").tobytes()
