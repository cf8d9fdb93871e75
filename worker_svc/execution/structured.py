"""Structured output on the last stage: one llguidance matcher per constrained sequence,
and the step's token masks, filled per row and applied to the logits in one call.

A matcher is (re)built from the sequence's output so far whenever the sampler's state of
the sequence starts (a new sequence, a fork, a re-admission after preemption, a stage
rebuilt by a full resend), so the grammar's state survives all of them without being sent
anywhere. The tokenizer is read from the checkpoint folder at the first constrained
sequence (`services.grammar` has the grammar side).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from services.grammar import GrammarError, grammar_text
from services.sampling import StructuredOutput
from worker_svc.errors import InvalidPlanError


class GrammarBank:
    """Builds matchers for one checkpoint's tokenizer; `mask_rows` applies masks."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self.tokenizer_dir is None:
                    raise InvalidPlanError(
                        "structured output needs the checkpoint's tokenizer; "
                        "this stage was built without a checkpoint folder"
                    )
                import llguidance

                from services.text import Tokenizer

                try:
                    tokenizer = Tokenizer(self.tokenizer_dir)
                except ValueError as exc:
                    raise InvalidPlanError(f"structured output: {exc}") from None
                self._tokenizer = llguidance.LLTokenizer(
                    tokenizer.backend_json(), n_vocab=self.vocab_size, eos_token=list(tokenizer.eos_token_ids) or None
                )
            return self._tokenizer

    def matcher(self, spec: StructuredOutput, outputs: Sequence[int]):
        """A matcher for `spec` that has consumed `outputs` (the sequence's tokens so far)."""
        import llguidance

        try:
            text = grammar_text(spec)
        except GrammarError as exc:
            raise InvalidPlanError(f"structured output: {exc}") from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text)
        if matcher.is_error():
            raise InvalidPlanError(f"structured output: {matcher.get_error()}")
        for token in outputs:
            if matcher.is_stopped():
                break  # the grammar was complete (its EOS, ignored): the rest is free
            if not matcher.consume_token(token):
                raise InvalidPlanError(
                    f"structured output: the output so far does not follow the "
                    f"grammar at token {token}: {matcher.get_error()}"
                )
        return matcher

    def bitmask(self, matchers: Sequence, eos_ids: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32: bit j of word w set where token 32w + j is allowed
        next by the row's grammar; every EOS id of a row where its grammar may end. A row
        whose grammar allows nothing (a matcher in error) allows everything rather than
        leave nothing to sample."""
        words = -(-vocab // 32)
        bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
            if matcher.is_accepting():
                for eos in eos_ids[i]:
                    if eos < vocab:
                        word, bit = divmod(eos, 32)
                        bitmask[i, word] |= _bit(bit)
        bitmask[~bitmask.any(dim=1)] = -1
        return bitmask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens of `logits` ([rows, vocab] float32, rows contiguous) to -inf, in
        place; natively on the CPU when the kernels are built (0.1 ms for 32 x 8,192 against
        1.6 ms unpacking the bits with torch)."""
        from worker_svc.kernels.cpu_kernels import paged_decode

        kernel = paged_decode() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if kernel is not None and logits.stride(1) == 1:
            kernel.mask(logits, bitmask.contiguous())
        else:
            logits.masked_fill_(~_unpack(bitmask, logits.shape[1]).to(logits.device), float("-inf"))

    def allowed(self, matchers: Sequence, eos_ids: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
        """[rows, vocab] bool: what `bitmask` allows, unpacked."""
        return _unpack(self.bitmask(matchers, eos_ids, vocab), vocab)

    @staticmethod
    def advance(matcher, token: int, eos_ids: Sequence[int]) -> bool:
        """Feeds a sampled token to its matcher; False when the grammar refused it (the
        matcher is then in error and stops constraining)."""
        if matcher.is_stopped():
            return True
        if token in eos_ids and matcher.is_accepting():
            return True  # the sequence ends here (whichever of the model's EOS ids it was)
        return bool(matcher.consume_token(token))


def _bit(bit: int) -> int:
    """Bit `bit` of an int32 word (bit 31 is the sign)."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bit masks -> [rows, vocab] bool (bit j of word w is token 32w + j)."""
    return ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).flatten(1)[:, :vocab].bool()
