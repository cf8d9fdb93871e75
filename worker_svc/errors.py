"""Domain errors of the stage worker, mapped to gRPC status codes at the server's edge."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served: missing file or tensor, bad shape, unknown architecture.

    The message always names the file, the tensor or the supported architectures.
    """


class InvalidPlanError(ValueError):
    """A micro-batch plan is malformed (shape mismatch, slot or block out of range, wrong stage).

    Fails that micro-batch only (INVALID_ARGUMENT); the stage keeps serving.
    """


class LoraNotLoadedError(InvalidPlanError):
    """A plan names a LoRA adapter this stage does not hold: its adapters are out of step with
    the scheduler's (FAILED_PRECONDITION: the scheduler loads them again, then replans; the
    step's other requests are not at fault)."""
