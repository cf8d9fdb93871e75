"""Multi-LoRA serving, the weight side: PEFT adapters held in a fixed bank of slots, and the
batched low-rank products that serve one step mixing tokens of several adapters.

    load_adapter(folder, ...) -> LoraAdapter     a PEFT folder's A and B for a stage's layers
                                                 (worker_svc/weights/lora_adapter.py)
    LoraBank(...)                                `max_loras` slots of stacked, rank-padded A, B
    LoraStep(bank, token_slots)                  one step's tokens grouped by slot, made once
    LoraStep.layer(i).add(out, x, targets)       out += scaling * (x A^T) B^T, group by group

An adapter adds `scaling * B @ A` to the weight of some of a decoder layer's seven linear
layers (q/k/v/o_proj, gate/up/down_proj; `LORA_TARGETS`; an adapter of a fused module of
Phi-3's checkpoint, `qkv_proj` or `gate_up_proj`, is the adapters of its parts, B's rows
split: `FUSED_TARGETS`). Instead of merging it, each
step computes the low-rank product for the tokens of each adapter present in the batch:
their rows of `x` are gathered (`index_select`), multiplied by the slot's A^T then B^T
(scaling folded into B when the adapter is added), and added back to the linear's output
(`index_add_`). Tokens of the base model (slot -1) cost nothing; a step with none at all
is not a LoRA step (`LoraStep.active`), and the model runs it as it runs any step.

Slots are zero-padded to the bank's `max_rank`, and a module an adapter does not target is
all zeros, so padding never changes a result; products use a slot's own rank only, and
skip the targets it holds none of.

Files (PEFT's adapter_config.json and adapter_model.safetensors, never a pickle) and tensor
parallelism's shares of A and B: worker_svc/weights/lora_adapter.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from worker_svc.model_config import ModelConfig
from worker_svc.weights.lora_adapter import LORA_TARGETS, LoraAdapter, load_adapter, module_shape

# --- the bank ------------------------------------------------------------------------------


class LoraBankFullError(ValueError):
    """Every slot of the bank holds an adapter (FAILED_PRECONDITION: retrying changes nothing;
    unload one, or serve with a larger --max-loras)."""


class HeldAdapter(NamedTuple):
    """An adapter a bank holds: its name, its folder and the identity it was loaded under
    (the scheduler's load id; 0 for one of --lora-modules)."""

    name: str
    folder: str
    load_id: int


class LoraBank:
    """`max_loras` slots of adapters for layers `[start, end)` of a model of `config` (the
    config the stage holds). Per target, A is held as `[layers, slots, max_rank, in]` and
    B^T, scaled, as `[layers, slots, max_rank, out]`.

    Invariants: a free slot has no name, rank 0, no targets and no `held` record; a slot of
    rank r holds its adapter's values in its first r rows (fewer for a module of smaller
    rank) and zeros elsewhere, and zeros for every (layer, target) the adapter does not
    adapt."""

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        end: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside 0..{config.num_layers}")
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be positive, got {max_loras}, {max_rank}")
        self.config, self.start, self.end = config, start, end
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        layers = end - start
        self.out_sizes = {t: module_shape(config, t)[0] for t in LORA_TARGETS}
        self._a = {
            t: torch.zeros(layers, max_loras, max_rank, module_shape(config, t)[1], dtype=dtype, device=self.device)
            for t in LORA_TARGETS
        }
        self._bt = {
            t: torch.zeros(layers, max_loras, max_rank, self.out_sizes[t], dtype=dtype, device=self.device)
            for t in LORA_TARGETS
        }
        self._names: list[str | None] = [None] * max_loras
        self._ranks = [0] * max_loras
        self._targets: list[frozenset[str]] = [frozenset()] * max_loras
        self._held: list[HeldAdapter | None] = [None] * max_loras
        # targets -> every slot's A^T for them side by side: one batched product per input
        # (`fused`)
        self._fused: dict[tuple[str, ...], torch.Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters held, in slot order."""
        return tuple(n for n in self._names if n is not None)

    @property
    def held(self) -> tuple[HeldAdapter, ...]:
        """The adapters held, in slot order, with their folders and load ids."""
        return tuple(h for h in self._held if h is not None)

    def slot_of(self, name: str) -> int | None:
        return self._names.index(name) if name in self._names else None

    def rank_of(self, slot: int) -> int:
        """The slot's rank (0: free)."""
        return self._ranks[slot]

    def targets_of(self, slot: int) -> frozenset[str]:
        return self._targets[slot]

    def add(self, name: str, adapter: LoraAdapter, load_id: int = 0) -> int:
        """Put `adapter` in a free slot under `name` (and the identity `load_id`); returns the
        slot. ValueError when the name is taken or the adapter does not fit the bank,
        LoraBankFullError when no slot is free."""
        if name in self._names:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (slot {self._names.index(name)})")
        self._check_fits(name, adapter)
        if None not in self._names:
            raise LoraBankFullError(
                f"LoRA bank is full: max_loras={self.max_loras} adapters loaded "
                f"({', '.join(self.names)}); unload one before adding {name!r}, or "
                "serve with a larger --max-loras"
            )
        slot = self._names.index(None)
        for target in LORA_TARGETS:
            self._a[target][:, slot].zero_()
            self._bt[target][:, slot].zero_()
        for (layer, target), w in adapter.weights.items():
            r = w.a.shape[0]
            self._a[target][layer - self.start, slot, :r] = w.a.to(self._a[target])
            self._bt[target][layer - self.start, slot, :r] = (w.b.T * w.scaling).to(self._bt[target])
        self._names[slot], self._ranks[slot], self._targets[slot] = name, adapter.rank, adapter.targets
        self._held[slot] = HeldAdapter(name, adapter.folder, load_id)
        self._drop_fused(slot)
        return slot

    def remove(self, name: str) -> int:
        """Free `name`'s slot (ValueError when it is not loaded); returns the slot."""
        slot = self.slot_of(name)
        if slot is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(self.names) or 'none'})")
        self._names[slot], self._ranks[slot], self._targets[slot] = None, 0, frozenset()
        self._held[slot] = None
        self._drop_fused(slot)
        return slot

    def _drop_fused(self, slot: int) -> None:
        self._fused.clear()

    def fused(self, targets: tuple[str, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every slot's products for linear layers that read one input (q/k/v, gate/up, or
        one): (A^T of the targets side by side [layers, slots, in, len(targets) * max_rank],
        and each target's scaled B^T [layers, slots, max_rank, out]); zeros where a slot
        adapts a target less or not at all (zeros change no result). A^T is made once per
        targets (again after a slot changes)."""
        if targets not in self._fused:
            a = torch.cat([self._a[t] for t in targets], dim=2)  # [layers, slots, R, in]
            self._fused[targets] = a.transpose(2, 3).contiguous()
        return self._fused[targets], [self._bt[t] for t in targets]

    def _check_fits(self, name: str, adapter: LoraAdapter) -> None:
        if (adapter.start, adapter.end) != (self.start, self.end):
            raise ValueError(
                f"LoRA adapter {name!r} was loaded for layers [{adapter.start}, "
                f"{adapter.end}), the bank holds [{self.start}, {self.end})"
            )
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {name!r} has rank {adapter.rank}, above the bank's max_rank={self.max_rank}"
            )
        for (layer, target), w in adapter.weights.items():
            want = (self.out_sizes[target], self._a[target].shape[-1])
            if (w.b.shape[0], w.a.shape[1]) != want:
                raise ValueError(
                    f"LoRA adapter {name!r}: layer {layer} {target} is "
                    f"{w.b.shape[0]}x{w.a.shape[1]}, the bank's model {want[0]}x{want[1]} "
                    "(another tensor-parallel size?)"
                )

    def weights(self, target: str, local: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], scaled B^T [r, out]) of a slot at local layer `local`, r its rank."""
        r = self._ranks[slot]
        return self._a[target][local, slot, :r], self._bt[target][local, slot, :r]


# --- one step ------------------------------------------------------------------------------


class LoraStep:
    """One step's tokens grouped by adapter slot, made once and used by every layer and
    target. `token_slots`: a slot per token of the flattened batch (`torch.long [T]`), -1 for
    the base model. `groups`: (slot, the token indices on the bank's device, or None when
    the slot has every token of the step)."""

    def __init__(self, bank: LoraBank, token_slots: torch.Tensor) -> None:
        slots = token_slots.detach().to("cpu", torch.long)
        if slots.dim() != 1:
            raise ValueError(f"token_slots must be one slot per token [T], got shape {list(slots.shape)}")
        self.bank = bank
        self.num_tokens = slots.shape[0]
        used = torch.unique(slots).tolist()
        bad = [s for s in used if s != -1 and not (0 <= s < bank.max_loras and bank.rank_of(s))]
        if bad:
            raise ValueError(
                f"token_slots name slots {bad} that hold no adapter "
                f"(bank of {bank.max_loras}, loaded: {', '.join(bank.names) or 'none'})"
            )
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in (s for s in used if s >= 0):
            rows = torch.nonzero(slots == slot).flatten()
            whole = rows.shape[0] == self.num_tokens
            groups.append((slot, None if whole else rows.to(bank.device)))
        self.groups = tuple(groups)
        # the adapters' tokens as [groups, longest group] for batched products: `gather` picks
        # each group's tokens from the input with one extra zero row (index T) for padding,
        # `scatter` puts the deltas back (padding onto row 0: zeros, which change nothing);
        # None for one slot holding every token (no gather)
        self.slots = torch.tensor([s for s, _ in groups], dtype=torch.long, device=bank.device)
        # slots in a row (usually: every adapter loaded is in the step) are taken as a view
        # of the bank's stacked weights, not gathered (a copy of every B per layer)
        first = groups[0][0] if groups else 0
        self.slot_range = (
            slice(first, first + len(groups))
            if [s for s, _ in groups] == list(range(first, first + len(groups)))
            else None
        )
        self.longest = max((self.num_tokens if r is None else r.shape[0] for _, r in groups), default=0)
        self.gather = self.scatter = None
        if groups and not (len(groups) == 1 and groups[0][1] is None):
            gather = torch.full((len(groups), self.longest), self.num_tokens, dtype=torch.long)
            for i, (_, rows) in enumerate(groups):
                gather[i, : rows.shape[0]] = rows.cpu()
            self.gather = gather.flatten().to(bank.device)
            self.scatter = torch.where(self.gather == self.num_tokens, 0, self.gather)

    @property
    def active(self) -> bool:
        """Whether any token of the step is served by an adapter."""
        return bool(self.groups)

    def layer(self, local: int) -> LoraLayer:
        """The products of local layer `local` (0 is the bank's `start`)."""
        return LoraLayer(self, local)


class LoraLayer(NamedTuple):
    """One step's LoRA products at one layer (`LoraStep.layer`)."""

    step: LoraStep
    local: int

    def add(self, out: torch.Tensor, x: torch.Tensor, targets: tuple[str, ...]) -> torch.Tensor:
        """Add each target's delta, for every group of the step, to its columns of `out`
        (in place; the targets' outputs side by side in `targets`' order, as in a fused
        product); `x` [T, in] is the linear layers' input. Returns `out`.

        The adapters' tokens are gathered once as [groups, longest group]; one batched
        product takes them through every group's A of all `targets` (`LoraBank.fused`), one
        per target through its B, and each target's deltas go back in one scatter: a few
        operations per input, whatever the number of adapters in the step."""
        step = self.step
        bank = step.bank
        groups = step.slots.shape[0]
        if step.gather is None:
            xs = x.unsqueeze(0)
        else:
            xs = F.pad(x, (0, 0, 0, 1)).index_select(0, step.gather).view(groups, step.longest, x.shape[1])
        at, bts = bank.fused(targets)
        take = (
            (lambda w: w[self.local, step.slot_range])
            if step.slot_range is not None
            else (lambda w: w[self.local].index_select(0, step.slots))
        )
        low = torch.bmm(xs.to(bank.dtype), take(at))  # [groups, longest, len(targets) * max_rank]
        r = bank.max_rank
        deltas = [torch.bmm(low[:, :, i * r : (i + 1) * r].contiguous(), take(bt)) for i, bt in enumerate(bts)]
        delta = (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=2)).to(out.dtype)
        if step.gather is None:
            return out.add_(delta[0])
        return out.index_add_(0, step.scatter, delta.view(-1, delta.shape[-1]))


def token_slots(
    row_slots: Sequence[int], row_num_tokens: Sequence[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A step's per-token slots (`torch.long [T]`) from its rows' slots (-1: base model) and
    token counts, rows in batch order."""
    counts = torch.tensor(row_num_tokens, dtype=torch.long)
    slots = torch.tensor(row_slots, dtype=torch.long)
    return torch.repeat_interleave(slots, counts).to(device)


def bank_for(
    model,
    *,
    enable: bool,
    modules: Mapping[str, str],
    max_loras: int,
    max_rank: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> LoraBank | None:
    """A stage's bank (`--enable-lora`), holding the adapters of `--lora-modules` for its
    layers (`model`: its StageModel); None when LoRA is off. In the dtype of the stage's
    activations, on its device."""
    if not enable:
        return None
    param = next(model.parameters())
    bank = LoraBank(model.config, model.start, model.end, max_loras, max_rank, param.dtype, param.device)
    for name, path in modules.items():
        bank.add(name, load_adapter(path, model.config, model.start, model.end, tp_rank, tp_size, max_rank=max_rank))
    return bank
