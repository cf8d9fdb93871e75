"""n > 1 in the planner: a request's choices forked from its first, sharing the prompt's pages.

The first choice prefills the prompt but its last token (`target`); then the other choices are
forked from it (sharing every block; the partial last one is copied on write by the KV
service) and each computes the last prompt token itself, sampling with its own index. A
one-token prompt has nothing to share: its choices are admitted together instead.

The planner asks at named points:

    target(seq)                                  how far a sequence may compute now
    reserved(request)                            its sequence slots against max_num_seqs
    first_admission(request)                     a new request's tokens and sequences
    is_due / any_due / propose(...)              propose: the forks that go in this step
    apply(proposal, running, flight)             finalize: the forked choices join
    undo_unforked(request)                       preempted before its fork: it comes again
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.proposal import PlannedFork, Proposal, ProposalDraft
from scheduler_svc.core.request import Request, Sequence
from services.kv_types import Append, Fork


def target(seq: Sequence) -> int:
    """How far a sequence may compute now: all known tokens, but a parent awaiting its fork
    stops before the last prompt token."""
    request = seq.request
    if len(request.sequences) < request.options.n and len(request.prompt) > 1:
        return len(request.prompt) - 1
    return seq.num_tokens


def reserved(request: Request) -> int:
    """Sequence slots a request holds against max_num_seqs: all its unfinished choices,
    forked or not yet, so that an admitted request can always fork."""
    # (asked of every running request at every plan: the field, not the property)
    return request.options.n - sum(1 for s in request.sequences if s.finish_reason is not None)


def first_admission(request: Request) -> tuple[list[int], int]:
    """A request's first admission: the tokens its first choice computes (the choices fork
    before the last prompt token) and how many sequences come in (n for a one-token prompt,
    which has nothing to fork from)."""
    tokens = list(request.prompt)
    if request.options.n > 1 and len(request.prompt) > 1:
        tokens = tokens[:-1]
    return tokens, request.options.n if len(request.prompt) == 1 else 1


def is_due(request: Request, flight: InFlight) -> bool:
    """Whether a request's other choices may be forked now: some are not yet, and its first
    choice holds its KV, has no step in flight and has computed all but the last prompt token."""
    if len(request.sequences) >= request.options.n:
        return False
    parent = request.sequences[0] if request.sequences else None
    return not (
        parent is None
        or not parent.has_kv
        or flight.is_busy(parent.seq_id)
        or parent.num_computed != len(request.prompt) - 1
        or len(request.prompt) == 1
    )


def any_due(running: Iterable[Request], flight: InFlight) -> bool:
    """Whether some running request's fork is due (asked at every plan: the cheap test first)."""
    return any(len(r.sequences) < r.options.n and is_due(r, flight) for r in running)


def propose(draft: ProposalDraft, running: Iterable[Request], flight: InFlight) -> None:
    """Forks of n > 1 requests that are due: every choice then computes the last prompt token."""
    for request in running:
        if not is_due(request, flight):
            continue
        k = request.options.n - len(request.sequences)
        if draft.budget < k + 1 or draft.num_seqs + k + 1 > max(draft.seq_cap, k + 1):
            continue  # (its choices were counted against max_num_seqs at admission)
        parent = request.sequences[0]
        last_token = request.prompt[len(request.prompt) - 1]
        child_seq_ids = tuple(draft.take_seq_id() for _ in range(k))
        for child_seq_id in child_seq_ids:
            draft.kv_forks.append(Fork(parent.seq_id, child_seq_id))
            draft.appends.append(Append(child_seq_id, [last_token]))
        draft.appends.append(Append(parent.seq_id, [last_token]))
        draft.forks.append(PlannedFork(parent, child_seq_ids, len(request.sequences)))
        draft.spend(k + 1, k + 1)


def apply(proposal: Proposal, running: list[Request], flight: InFlight) -> list[tuple[Sequence, list[Sequence]]]:
    """The forked choices join their requests, as their parent stands; those of a parent that
    ended meanwhile are freed (the KV service forked them)."""
    forks: list[tuple[Sequence, list[Sequence]]] = []
    for planned in proposal.forks:
        parent = planned.parent
        request = parent.request
        if not (parent.has_kv and not parent.is_finished and request in running):
            flight.free_at_kv(planned.child_seq_ids)
            continue
        children = []
        for i, child_seq_id in enumerate(planned.child_seq_ids):
            child = new_sequence(child_seq_id, request, planned.first_index + i)
            request.sequences.append(child)
            child.has_kv = True
            child.num_computed = parent.num_computed
            child.kv_len = parent.kv_len
            children.append(child)
        forks.append((parent, children))
    return forks


def undo_unforked(request: Request) -> None:
    """A request preempted before its fork: the first choice restarts, the fork comes again."""
    if request.sequences and len(request.sequences) < request.options.n:
        del request.sequences[1:]


def new_sequence(seq_id: int, request: Request, index: int) -> Sequence:
    """A new choice, not yet attached to its request."""
    return Sequence(seq_id, request, index, entropy_seed=entropy(request, index))


def entropy(request: Request, index: int) -> int:
    """A per-choice random stream for unseeded sampling, stable across preemption."""
    digest = hashlib.blake2b(f"{request.request_id}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
