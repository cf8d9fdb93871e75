"""Pooling (embedding) requests in the planner: one choice that computes its prompt and
finishes with its pooled vector instead of sampling (services/pooling.py).

    never_samples(request)        its steps sample nothing (so no placeholder step follows
                                  one, and it never drafts)
    is_pooled(seq)                a step came back with its whole prompt computed
    take_vector(seq, embedding)   it finishes with that vector (STOP), or ERROR without one
"""

from __future__ import annotations

from scheduler_svc.core.request import FinishReason, Request, Sequence
from services.pooling import Embedding


def never_samples(request: Request) -> bool:
    return request.pooling is not None


def is_pooled(seq: Sequence) -> bool:
    """Whether a pooling sequence's prompt is computed: the step that completed it brought
    back its pooled vector."""
    return seq.num_computed == seq.num_tokens


def take_vector(seq: Sequence, embedding: Embedding | None) -> None:
    """A pooling request's prompt came back computed: it finishes with its vector (STOP), or
    with ERROR when the last stage returned none (a bug)."""
    seq.request.embedding = embedding
    seq.finish_reason = FinishReason.STOP if embedding is not None else FinishReason.ERROR
