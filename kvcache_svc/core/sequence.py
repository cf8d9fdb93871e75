"""Per-sequence table state and the record of what a micro-batch in flight wrote."""

from __future__ import annotations

from kvcache_svc.core.prefix_cache import ROOT_KEY, CachedBlock


class SequenceState:
    """One sequence's table: `ceil(num_tokens / block_size)` entries, and after them any
    entries held ahead for tokens not known yet (`Append.num_lookahead_slots`). An entry is
    a tuple of page ids, one per KV sub-group (services/kv_layout.py; one page for a model
    whose layers attend alike); sliding sub-groups' pages of the first `num_slid` entries
    went back to the pool (`NULL_PAGE`): no window reaches them any more.

    With prefix caching, `last_full_key` is the chain key of its last full block and
    `partial_token_bytes` the tokens of its partial last block (empty when it has none).
    `cacheable` turns False for good once it wrote in a failed micro-batch: its later
    blocks' KV attended to garbage.

    `num_answered` is how many entries of `block_ids` the last `Allocated` for it named and
    still hold (a copy-on-write lowers it to the replaced entry), None before its first
    answer: the next answer is a diff from there (`Allocated.block_offset`).
    """

    __slots__ = (
        "seq_id",
        "namespace",
        "block_ids",
        "num_tokens",
        "last_full_key",
        "partial_token_bytes",
        "cacheable",
        "num_answered",
        "num_slid",
    )

    def __init__(self, seq_id: int, namespace: str | None) -> None:
        self.seq_id = seq_id
        self.namespace = namespace
        self.block_ids: list[tuple[int, ...]] = []
        self.num_tokens = 0
        self.last_full_key = ROOT_KEY
        self.partial_token_bytes = b""
        self.cacheable = True
        self.num_answered: int | None = None
        self.num_slid = 0

    def answer_offset(self) -> int:
        """The next answer's `block_offset`; from then on all of the table is answered."""
        offset = self.num_answered or 0
        self.num_answered = len(self.block_ids)
        return offset

    def copy(self, seq_id: int, num_blocks: int) -> SequenceState:
        """A child sharing the first `num_blocks` blocks (those holding tokens)."""
        child = SequenceState(seq_id, self.namespace)
        child.block_ids = self.block_ids[:num_blocks]
        child.num_tokens = self.num_tokens
        child.last_full_key = self.last_full_key
        child.partial_token_bytes = self.partial_token_bytes
        child.cacheable = self.cacheable
        child.num_slid = min(self.num_slid, num_blocks)
        return child


class MicroBatchRecord:
    """What a micro-batch in flight wrote: blocks it filled (to cache on completion, if the
    block still belongs to the same allocation) and the sequences it wrote."""

    __slots__ = ("filled", "seqs", "tier_keys")

    def __init__(self) -> None:
        self.filled: list[tuple[SequenceState, int, int, CachedBlock]] = []
        self.seqs: list[SequenceState] = []
        self.tier_keys: list[bytes] = []  # keys saved to or loaded from the KV tier (forgotten if it fails)
