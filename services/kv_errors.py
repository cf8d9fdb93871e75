"""Domain errors of the KV-cache core.

`KVCacheError` and its subclasses are the caller's fault and map to gRPC status codes at the
edge (`SequenceNotFound` -> NOT_FOUND, `InvalidStepError` -> INVALID_ARGUMENT). A step that
raises one changed nothing. `IntegrityError` is a bug in this package, never the caller's.
Running out of blocks is not an error at all: it is a `NoBlocks` result.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base of the errors a caller can cause; the manager's state is unchanged when raised."""


class SequenceNotFound(KVCacheError):
    """A step named a sequence id the manager does not hold."""

    def __init__(self, seq_id: int, detail: str = "") -> None:
        self.seq_id = seq_id
        super().__init__(f"unknown sequence {seq_id}" + (f": {detail}" if detail else ""))


class InvalidStepError(KVCacheError):
    """A step is malformed: duplicate or conflicting ids, bad counts or token ids."""


class ImportUnavailable(KVCacheError):
    """P/D import asked of a KV service without an import level (`--kv-import-blocks`)."""


class IntegrityError(AssertionError):
    """`check_integrity()` found the manager's bookkeeping inconsistent (a bug, not input)."""
