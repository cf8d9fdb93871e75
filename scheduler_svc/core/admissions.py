"""Which sequences without KV come into the next micro-batch: running sequences that lost
their KV (a partly re-admitted request), then waiting requests in the queue's order.

    propose_readmissions(draft, running, flight, namespace)        propose: what to ask
    propose_admissions(draft, queue, running, max_num_seqs, chunked, namespace)
    apply_readmissions(proposal, output, requests, flight, scheduled)   finalize: what got
    apply_admissions(proposal, output, requests, flight, scheduled, now)  blocks joins

Proposing only adds to the proposal being built (`ProposalDraft`): new sequences for the KV
service under fresh ids. Applying admits what got blocks; what the KV service allocated for
a sequence that ended meanwhile, or for a request that must not overtake one that got none,
is freed again.
"""

from __future__ import annotations

from scheduler_svc.core import forks
from scheduler_svc.core.in_flight import InFlight
from scheduler_svc.core.lora import request_namespace
from scheduler_svc.core.proposal import Admission, AdmittedSeq, Proposal, ProposalDraft, Readmission
from scheduler_svc.core.queue import WaitingQueue
from scheduler_svc.core.request import Request, Sequence
from scheduler_svc.core.running import RunningSet
from scheduler_svc.core.stage_view import skips_prefix_cache
from services.kv_types import Allocated, NewSequence, StepOutput

# seq_id -> a sequence the KV service gave slots in this step, and those slots
Allocations = dict[int, tuple[Sequence, Allocated]]

# one choice of an admission: (existing sequence or None for a new choice, its tokens, how
# many to compute now)
AdmissionChunk = tuple[Sequence | None, list[int], int]


def propose_readmissions(draft: ProposalDraft, running: list[Request], flight: InFlight, namespace: str | None) -> None:
    """Running sequences that lost their KV (a partly re-admitted request): a recompute,
    chunked whatever the setting."""
    for request in running:
        for seq in request.sequences:
            if draft.num_seqs >= draft.seq_cap:
                return
            if seq.is_finished or seq.has_kv or flight.is_busy(seq.seq_id):
                continue
            tokens = seq.all_tokens()[: forks.target(seq)]
            n = min(len(tokens), draft.budget)
            if n <= 0:
                continue
            new_seq_id = draft.take_seq_id()
            draft.new_sequences.append(
                NewSequence(
                    new_seq_id,
                    tokens,
                    request_namespace(namespace, seq.request),
                    n,
                    skips_prefix_cache(seq.request, seq.index),
                )
            )
            draft.readmissions.append(Readmission(seq, new_seq_id))
            draft.spend(n, 1)


def propose_admissions(
    draft: ProposalDraft,
    queue: WaitingQueue,
    running: list[Request],
    max_num_seqs: int,
    chunked: bool,
    namespace: str | None,
) -> None:
    """Waiting requests, in the queue's order, while the budgets allow; the first that does
    not fit stops the rest (no overtaking). `chunked`: a prompt over the budget comes in
    chunks (else it waits for a micro-batch it fits whole)."""
    if not len(queue):
        return
    num_reserved = sum(forks.reserved(r) for r in running)
    for request in queue.ordered(limit=64):
        if draft.is_full:
            return
        seqs = request.live_sequences if request.sequences else None
        if seqs == []:
            continue  # every choice ended while it waited (finish_choice takes it out)
        count = len(seqs) if seqs is not None else forks.first_admission(request)[1]
        if num_reserved + forks.reserved(request) > max_num_seqs or draft.num_seqs + count > max(draft.seq_cap, count):
            return
        chunks = _admission_chunks(request, seqs, count, draft.budget, chunked)
        # a request's choices may come back a few at a time (the rest re-admit as budget
        # allows); a fresh request's several one-token choices come together
        if not chunks or (seqs is None and len(chunks) < count):
            return
        admitted: list[AdmittedSeq] = []
        for index, (existing, tokens, n) in enumerate(chunks):
            seq_id = draft.take_seq_id()
            skips = skips_prefix_cache(request, existing.index if existing is not None else index)
            draft.new_sequences.append(NewSequence(seq_id, tokens, request_namespace(namespace, request), n, skips))
            admitted.append(AdmittedSeq(existing, seq_id, index))
        draft.admissions.append(Admission(request, tuple(admitted)))
        draft.spend(sum(n for _, _, n in chunks), count)
        num_reserved += forks.reserved(request)


def _admission_chunks(
    request: Request, seqs: list[Sequence] | None, count: int, budget: int, chunked: bool
) -> list[AdmissionChunk]:
    """The choices of one admission that fit the budget, in order."""
    chunks: list[AdmissionChunk] = []
    cost = 0
    for i in range(count):
        if seqs is None:
            tokens = forks.first_admission(request)[0]
        else:
            tokens = seqs[i].all_tokens()[: forks.target(seqs[i])]
        left = budget - cost
        if len(tokens) <= left:
            n = len(tokens)
        elif chunked or seqs is not None:
            # recomputing after preemption is chunked whatever the setting: prompt plus
            # output may have outgrown the budget, and it must come back
            n = left
        else:
            n = 0
        if n <= 0:
            break
        chunks.append((None if seqs is None else seqs[i], tokens, n))
        cost += n
    return chunks


def apply_readmissions(
    proposal: Proposal, output: StepOutput, requests: RunningSet, flight: InFlight, scheduled: Allocations
) -> None:
    """A re-admitted sequence that got blocks takes its new id (into `scheduled`); one that
    ended meanwhile gives them back."""
    for readmission in proposal.readmissions:
        seq, new_seq_id = readmission.seq, readmission.new_seq_id
        result = output.results.get(new_seq_id)
        if isinstance(result, Allocated) and (seq.is_finished or seq.request not in requests.running):
            flight.free_at_kv((new_seq_id,))
        elif isinstance(result, Allocated):
            seq.seq_id = new_seq_id
            seq.has_kv = True
            scheduled[seq.seq_id] = (seq, result)


def apply_admissions(
    proposal: Proposal, output: StepOutput, requests: RunningSet, flight: InFlight, scheduled: Allocations, now: float
) -> None:
    """A request is admitted when any of its choices got blocks (into `scheduled`); after one
    that got none, the later ones give theirs back (they must not overtake it)."""
    blocked = False
    for admission in proposal.admissions:
        request = admission.request
        results = [output.results.get(a.seq_id) for a in admission.seqs]
        gone = request not in requests.queue  # aborted (or its choices stopped) meanwhile
        if gone or blocked or not any(isinstance(r, Allocated) for r in results):
            blocked = blocked or not gone
            flight.free_at_kv(
                a.seq_id for a, r in zip(admission.seqs, results, strict=True) if isinstance(r, Allocated)
            )
            continue
        requests.admit(request, now)
        for a, r in zip(admission.seqs, results, strict=True):
            s = a.existing or forks.new_sequence(a.seq_id, request, a.index)
            if s not in request.sequences:
                request.sequences.append(s)
            if isinstance(r, Allocated):
                s.seq_id = a.seq_id
                s.has_kv = True
                if not request.num_preemptions:
                    request.num_cached_tokens += r.num_computed_tokens
                scheduled[s.seq_id] = (s, r)
