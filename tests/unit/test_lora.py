"""Multi-LoRA on the stage side (worker_svc/weights/lora.py): one forward over a batch that mixes
tokens of three PEFT adapters and of the base model gives, row by row, the logits of peft's
merged model under transformers; a pipeline split and a tensor-parallel split give the
whole model's; a step with no adapter tokens is bit for bit the step without a bank.

Adapters are made by peft itself (tests/support/lora.py): ranks 4, 8 (with per-module
rank and alpha patterns) and 16 (rsLoRA), each on a different set of target modules.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.lora import make_adapter, merged_model, reference_logits

from worker_svc.checkpoints.loader import load_stage
from worker_svc.checkpoints.shards import shard_dim
from worker_svc.errors import CheckpointError
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.kernels.attention import AttentionMetadata, TorchAttentionBackend
from worker_svc.models.stage import StageModel
from worker_svc.weights.lora import LoraBank, LoraBankFullError, LoraStep, token_slots
from worker_svc.weights.lora_adapter import LORA_TARGETS, SHARD_DIMS, load_adapter, module_shape

MAX_RANK = 16
BLOCK_SIZE = 4
ADAPTERS = {  # name -> make_adapter's arguments
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
    "mlp-r8": dict(
        r=8,
        lora_alpha=16,
        target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
        alpha_pattern={"o_proj": 32},
        seed=2,
    ),
    "all-r16-rslora": dict(
        r=16,
        lora_alpha=32,
        use_rslora=True,
        seed=3,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}
NAMES = list(ADAPTERS)
PROMPTS = [
    [17, 99, 5, 300, 42, 7, 250],
    [8, 8, 61, 400, 123, 9, 77, 31, 200, 15, 6, 88],
    [301, 12, 44, 5, 90],
    [64, 128, 256, 11, 13, 17, 19, 23, 29],
]
ROW_ADAPTERS = ["attn-r4", None, "mlp-r8", "all-r16-rslora"]  # None: the base model
NEXT_TOKENS = [33, 71, 150, 402]  # each sequence's token of the decode step


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")  # 4 layers, 4 heads over 2 KV heads, MLP 176


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def references(model_dir, adapter_dirs):
    """Per row of the batch, transformers' logits over its prompt and next token: peft's
    merged model for an adapter's rows, the base model for the others."""
    models = {name: merged_model(model_dir, path) for name, path in adapter_dirs.items()}
    models[None] = merged_model(model_dir)
    return [
        reference_logits(models[name], prompt + [nxt])
        for name, prompt, nxt in zip(ROW_ADAPTERS, PROMPTS, NEXT_TOKENS, strict=True)
    ]


def make_bank(
    model: StageModel, adapter_dirs, names=NAMES, tp_rank: int = 0, tp_size: int = 1, max_loras: int = 4
) -> LoraBank:
    bank = LoraBank(model.config, model.start, model.end, max_loras=max_loras, max_rank=MAX_RANK)
    for name in names:
        bank.add(
            name,
            load_adapter(adapter_dirs[name], model.config, model.start, model.end, tp_rank, tp_size, max_rank=MAX_RANK),
        )
    return bank


class Batch:
    """The sequences' KV pools of one stage and the steps run over them: each sequence holds
    its own blocks; a step runs a span of positions of every sequence."""

    def __init__(self, model: StageModel, num_seqs: int = len(PROMPTS), max_len: int = 16) -> None:
        config = model.config
        self.model, self.blocks_per_seq = model, -(-max_len // BLOCK_SIZE)
        self.cache = PagedKVCache(
            model.num_local_layers,
            num_seqs * self.blocks_per_seq,
            BLOCK_SIZE,
            config.num_kv_heads,
            config.head_dim,
            torch.float32,
            "cpu",
        )

    def metadata(self, spans: list[tuple[int, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        slots, positions, starts, table = [], [], [0], []
        for i, (start, end) in enumerate(spans):
            blocks = [i * self.blocks_per_seq + j for j in range(self.blocks_per_seq)]
            positions += range(start, end)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            starts.append(starts[-1] + end - start)
            table.append(blocks)
        context = tuple(end for _, end in spans)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
            context_lens=torch.tensor(context), block_tables=torch.tensor(table),
            query_start_loc_list=tuple(starts), context_lens_list=context,
        )  # fmt: skip
        return metadata, torch.tensor(positions)

    def run(
        self, inputs: torch.Tensor, spans: list[tuple[int, int]], lora: LoraStep | None, logits_rows: bool = True
    ) -> torch.Tensor:
        metadata, positions = self.metadata(spans)
        rows = torch.arange(positions.shape[0]) if logits_rows and self.model.is_last else None
        return self.model(inputs, positions, self.cache.pools, metadata, TorchAttentionBackend(), rows, lora=lora)


def prefill_ids(prompts: list[list[int]] = PROMPTS) -> torch.Tensor:
    return torch.tensor([t for p in prompts for t in p])


def prefill_spans(prompts: list[list[int]] = PROMPTS) -> list[tuple[int, int]]:
    return [(0, len(p)) for p in prompts]


def decode_spans(prompts: list[list[int]] = PROMPTS) -> list[tuple[int, int]]:
    return [(len(p), len(p) + 1) for p in prompts]


def step_slots(bank: LoraBank, num_tokens: list[int]) -> torch.Tensor:
    row_slots = [-1 if name is None else bank.slot_of(name) for name in ROW_ADAPTERS]
    return token_slots(row_slots, num_tokens)


def run_prefill_and_decode(
    model: StageModel, bank: LoraBank | None, prompts: list[list[int]] = PROMPTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits at every prompt position [sum(len), vocab], decode logits [4, vocab]);
    on a stage other than the last, its hidden states."""
    batch = Batch(model)
    lengths = [len(p) for p in prompts]
    lora = None if bank is None else LoraStep(bank, step_slots(bank, lengths))
    prefill = batch.run(prefill_ids(prompts), prefill_spans(prompts), lora)
    lora = None if bank is None else LoraStep(bank, step_slots(bank, [1] * len(prompts)))
    decode = batch.run(torch.tensor(NEXT_TOKENS), decode_spans(prompts), lora)
    return prefill, decode


def unfuse(model: StageModel) -> StageModel:
    """Make every layer take its separate q/k/v and gate/up products."""
    for layer in model.model.layers.values():
        layer.self_attn.qkv, layer.mlp.gate_up = None, None
    return model


# --- the batched product against peft ----------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_one_mixed_forward_equals_peft_merged_models(model_dir, adapter_dirs, references, fused):
    model = load_stage(model_dir, dtype="float32")
    if not fused:
        unfuse(model)
    prefill, decode = run_prefill_and_decode(model, make_bank(model, adapter_dirs))
    base_prefill, base_decode = run_prefill_and_decode(model, None)
    offset = 0
    for i, (prompt, want) in enumerate(zip(PROMPTS, references, strict=True)):
        got = prefill[offset : offset + len(prompt)]
        torch.testing.assert_close(got, want[: len(prompt)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], want[len(prompt)], atol=1e-4, rtol=1e-4)
        base_rows = base_prefill[offset : offset + len(prompt)]
        if ROW_ADAPTERS[i] is None:  # the base model's rows are the base model's
            assert torch.equal(got, base_rows)
        else:  # and every adapter changes its rows far past the tolerance
            assert (got - base_rows).abs().max() > 0.1
        offset += len(prompt)


def test_a_step_without_adapter_tokens_is_bit_identical(model_dir, adapter_dirs):
    model = load_stage(model_dir, dtype="float32")
    bank = make_bank(model, adapter_dirs)
    batch_a, batch_b = Batch(model), Batch(model)
    none = LoraStep(bank, torch.full((prefill_ids().shape[0],), -1))
    assert not none.active and none.groups == ()
    assert torch.equal(
        batch_a.run(prefill_ids(), prefill_spans(), none), batch_b.run(prefill_ids(), prefill_spans(), None)
    )


def test_a_step_of_one_adapter_takes_every_token_at_once(model_dir, adapter_dirs, references):
    model = load_stage(model_dir, dtype="float32")
    bank = make_bank(model, adapter_dirs)
    prompt = PROMPTS[3]
    batch = Batch(model)
    metadata = batch.metadata([(0, len(prompt))])[0]
    lora = LoraStep(bank, torch.full((len(prompt),), bank.slot_of("all-r16-rslora")))
    assert [rows for _, rows in lora.groups] == [None]
    got = model(
        torch.tensor(prompt),
        torch.arange(len(prompt)),
        batch.cache.pools,
        metadata,
        TorchAttentionBackend(),
        torch.arange(len(prompt)),
        lora=lora,
    )
    torch.testing.assert_close(got, references[3][: len(prompt)], atol=1e-4, rtol=1e-4)


# --- pipeline and tensor-parallel splits ----------------------------------------------------


def test_a_pipeline_split_equals_the_whole_model(model_dir, adapter_dirs):
    whole = load_stage(model_dir, dtype="float32")
    want = run_prefill_and_decode(whole, make_bank(whole, adapter_dirs))
    stages = [load_stage(model_dir, k, 2, dtype="float32") for k in range(2)]
    assert [(s.start, s.end) for s in stages] == [(0, 2), (2, 4)]
    banks = [make_bank(s, adapter_dirs) for s in stages]
    batches = [Batch(s) for s in stages]
    for inputs, spans, want_logits in (
        (prefill_ids(), prefill_spans(), want[0]),
        (torch.tensor(NEXT_TOKENS), decode_spans(), want[1]),
    ):
        lengths = [end - start for start, end in spans]
        hidden = batches[0].run(inputs, spans, LoraStep(banks[0], step_slots(banks[0], lengths)))
        got = batches[1].run(hidden, spans, LoraStep(banks[1], step_slots(banks[1], lengths)))
        torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=1e-5)


class ThreadReduce:
    """The ranks' all-reduce for ranks run as threads of one process."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * size

    def for_rank(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)  # the same order on every rank
            self.barrier.wait()
            return total

        return reduce


def test_two_tensor_parallel_ranks_equal_the_whole_model(model_dir, adapter_dirs):
    whole = load_stage(model_dir, dtype="float32")
    want = run_prefill_and_decode(whole, make_bank(whole, adapter_dirs))
    ranks = [load_stage(model_dir, dtype="float32", tp_rank=r, tp_size=2) for r in range(2)]
    reduce = ThreadReduce(2)
    for r, model in enumerate(ranks):
        model.set_reduce(reduce.for_rank(r))
    banks = [make_bank(m, adapter_dirs, tp_rank=r, tp_size=2) for r, m in enumerate(ranks)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(run_prefill_and_decode, ranks, banks))
    torch.testing.assert_close(got[0][0], want[0], atol=1e-4, rtol=1e-4)  # rank 0 has the logits
    torch.testing.assert_close(got[0][1], want[1], atol=1e-4, rtol=1e-4)


def test_targets_split_as_the_loader_splits_the_base_weights():
    parent = {t: "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn" for t in LORA_TARGETS}
    assert SHARD_DIMS == {t: shard_dim(f"model.layers.5.{parent[t]}.{t}.weight") for t in LORA_TARGETS}


def test_a_rank_holds_b_rows_of_column_and_a_columns_of_row_parallel_targets(model_dir, adapter_dirs):
    whole = load_stage(model_dir, dtype="float32")
    config = whole.config
    full = load_adapter(adapter_dirs["all-r16-rslora"], config, 0, 4, max_rank=MAX_RANK)
    half = config.shard(2)
    shares = [load_adapter(adapter_dirs["all-r16-rslora"], half, 0, 4, r, 2, max_rank=MAX_RANK) for r in range(2)]
    width = max(config.hidden_size, config.intermediate_size, config.q_size)
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(0))
    for (layer, target), w in full.weights.items():
        parts = [s.weights[layer, target] for s in shares]
        out_size, in_size = module_shape(half, target)
        assert all(p.scaling == w.scaling for p in parts)
        if target in ("o_proj", "down_proj"):  # row parallel: A's columns, partial deltas sum
            assert [tuple(p.a.shape) for p in parts] == [(16, in_size)] * 2
            assert all(torch.equal(p.b, w.b) for p in parts)
            xs = x[:, : 2 * in_size]
            whole_delta = xs @ w.a.T @ w.b.T
            partial = [xs[:, r * in_size : (r + 1) * in_size] @ p.a.T @ p.b.T for r, p in enumerate(parts)]
            torch.testing.assert_close(partial[0] + partial[1], whole_delta, atol=1e-5, rtol=1e-5)
        else:  # column parallel: B's rows (the rank's heads, KV heads or MLP columns)
            assert [tuple(p.b.shape) for p in parts] == [(out_size, 16)] * 2
            assert all(torch.equal(p.a, w.a) for p in parts)
            assert torch.equal(torch.cat([p.b for p in parts]), w.b)


# --- packed (bfloat16-weight) stages and the native decode step -------------------------------


def test_packed_stage_adds_deltas_and_skips_the_native_decode_step(model_dir, adapter_dirs, monkeypatch):
    """bfloat16 weights on the CPU are PackedLinear; a step of at most 16 rows keeps float32
    activations, so the stage equals a float32 model of the same (rounded) weights."""
    monkeypatch.setenv("PAGODA_PACKED_BF16", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # FusedDecoder.applies: one thread only
    packed = load_stage(model_dir, dtype="bfloat16")
    assert packed.model.layers["0"].self_attn.qkv_packed is not None
    exact = load_stage(model_dir, dtype="float32")
    with torch.no_grad():
        for p in exact.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    calls = []
    if packed.fused_decode is not None:
        native = packed.fused_decode.forward
        monkeypatch.setattr(packed.fused_decode, "forward", lambda *a: calls.append(1) or native(*a))

    short = [p[:3] for p in PROMPTS]  # 12 prefill rows: the native products, float32 activations
    got = run_prefill_and_decode(packed, make_bank(packed, adapter_dirs), short)
    assert calls == []  # the decode step had adapter tokens
    want = run_prefill_and_decode(exact, make_bank(exact, adapter_dirs), short)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)
    base = run_prefill_and_decode(packed, None, short)
    assert (got[1] - base[1]).abs().max() > 0.1
    if packed.fused_decode is not None:
        assert calls == [1]  # the base model's decode step took the native call

    # a step whose tokens are all the base model's runs the same native call, bit for bit
    bank = make_bank(packed, adapter_dirs)
    batch_a, batch_b = Batch(packed), Batch(packed)
    lengths = [len(p) for p in short]
    batch_a.run(prefill_ids(short), prefill_spans(short), None)
    batch_b.run(prefill_ids(short), prefill_spans(short), LoraStep(bank, torch.full((sum(lengths),), -1)))
    none = LoraStep(bank, torch.full((len(short),), -1))
    assert torch.equal(
        batch_a.run(torch.tensor(NEXT_TOKENS), decode_spans(short), None),
        batch_b.run(torch.tensor(NEXT_TOKENS), decode_spans(short), none),
    )
    if packed.fused_decode is not None:
        assert calls == [1, 1, 1]


# --- the bank --------------------------------------------------------------------------------


def test_a_full_bank_is_refused_and_a_removed_slot_is_reused(model_dir, adapter_dirs):
    model = load_stage(model_dir, dtype="float32")
    bank = make_bank(model, adapter_dirs, max_loras=2, names=NAMES[:2])
    assert bank.names == tuple(NAMES[:2]) and bank.slot_of(NAMES[1]) == 1
    third = load_adapter(adapter_dirs[NAMES[2]], model.config, 0, 4, max_rank=MAX_RANK)
    with pytest.raises(LoraBankFullError, match=r"LoRA bank is full: max_loras=2"):
        bank.add(NAMES[2], third)
    with pytest.raises(ValueError, match="already loaded"):
        bank.add(NAMES[0], third)
    assert bank.remove(NAMES[0]) == 0 and bank.slot_of(NAMES[0]) is None
    with pytest.raises(ValueError, match=r"token_slots name slots \[0\] that hold no adapter"):
        LoraStep(bank, torch.tensor([0, -1]))
    assert bank.add(NAMES[2], third) == 0
    assert bank.names == (NAMES[2], NAMES[1]) and bank.rank_of(0) == 16
    with pytest.raises(ValueError, match="is not loaded"):
        bank.remove("nope")


def test_the_bank_reports_each_adapters_folder_and_identity(model_dir, adapter_dirs):
    """What a stage reports in StageLoadInfo.lora_adapters (issue 35): the scheduler tells a
    reload under an old name, and a stage that restarted, by them; a full bank names
    --max-loras."""
    model = load_stage(model_dir, dtype="float32")
    bank = make_bank(model, adapter_dirs, max_loras=2, names=NAMES[:1])
    assert bank.held == ((NAMES[0], str(adapter_dirs[NAMES[0]]), 0),)  # (--lora-modules: id 0)
    second = load_adapter(adapter_dirs[NAMES[1]], model.config, 0, 4, max_rank=MAX_RANK)
    bank.add(NAMES[1], second, load_id=77)
    assert [(h.name, h.load_id) for h in bank.held] == [(NAMES[0], 0), (NAMES[1], 77)]
    with pytest.raises(LoraBankFullError, match="--max-loras"):
        bank.add(NAMES[2], second)
    bank.remove(NAMES[0])
    assert [(h.name, h.folder, h.load_id) for h in bank.held] == [(NAMES[1], str(adapter_dirs[NAMES[1]]), 77)]


def test_a_reused_slot_holds_nothing_of_its_previous_adapter(model_dir, adapter_dirs):
    """The rank-16 adapter on every target, then the rank-4 one on q/v: the slot's other
    targets and rows must be zeros again (padding keeps results exact)."""
    model = load_stage(model_dir, dtype="float32")
    bank = make_bank(model, adapter_dirs, names=["all-r16-rslora"], max_loras=1)
    bank.remove("all-r16-rslora")
    bank.add("attn-r4", load_adapter(adapter_dirs["attn-r4"], model.config, 0, 4, max_rank=MAX_RANK))
    fresh = make_bank(model, adapter_dirs, names=["attn-r4"], max_loras=1)
    for target in bank._a:
        assert torch.equal(bank._a[target], fresh._a[target]) and torch.equal(bank._bt[target], fresh._bt[target])
    assert bank.targets_of(0) == {"q_proj", "v_proj"} and bank.rank_of(0) == 4


def test_token_slots_repeat_each_rows_slot():
    assert token_slots([2, -1, 0], [3, 1, 2]).tolist() == [2, 2, 2, -1, 0, 0]


# --- what load_adapter refuses -----------------------------------------------------------------


def test_a_pickle_only_folder_is_refused_naming_the_file(model_dir, tmp_path):
    folder = make_adapter(model_dir, tmp_path / "bin", r=4, target_modules=["q_proj"], safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    config = load_stage(model_dir, dtype="float32").config
    with pytest.raises(CheckpointError, match=r"adapter_model\.bin is a pickle, which is never loaded"):
        load_adapter(folder, config, 0, 4, max_rank=MAX_RANK)


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["v_proj", "lm_head"]])
def test_an_unsupported_target_module_is_refused(model_dir, tmp_path, targets):
    folder = make_adapter(model_dir, tmp_path / "a", r=4, target_modules=targets)
    config = load_stage(model_dir, dtype="float32").config
    with pytest.raises(ValueError, match=rf"target module\(s\) {targets[1]} not supported"):
        load_adapter(folder, config, 0, 4, max_rank=MAX_RANK)


def test_an_unsupported_tensor_is_refused_under_a_regex_target(model_dir, tmp_path):
    folder = make_adapter(model_dir, tmp_path / "a", r=4, target_modules=r".*(q_proj|lm_head)")
    config = load_stage(model_dir, dtype="float32").config
    with pytest.raises(
        ValueError,
        match=r"tensor 'base_model\.model\.lm_head\.[\w.]+' is not a LoRA "
        r"weight of a supported target",
    ):
        load_adapter(folder, config, 0, 4, max_rank=MAX_RANK)


def test_a_rank_above_max_rank_is_refused(model_dir, adapter_dirs):
    config = load_stage(model_dir, dtype="float32").config
    with pytest.raises(ValueError, match=r"LoRA rank 16 is above max_rank=8"):
        load_adapter(adapter_dirs["all-r16-rslora"], config, 0, 4, max_rank=8)
    adapter = load_adapter(adapter_dirs["all-r16-rslora"], config, 0, 4, max_rank=16)
    with pytest.raises(ValueError, match=r"rank 16, above the bank's max_rank=8"):
        LoraBank(config, 0, 4, max_loras=1, max_rank=8).add("big", adapter)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("use_dora", True, "use_dora=True is not supported"),
        ("modules_to_save", ["lm_head"], "modules_to_save=\\['lm_head'\\] is not supported"),
        ("fan_in_fan_out", True, "fan_in_fan_out=true is not supported"),
        ("bias", "lora_only", "bias='lora_only' is not supported"),
    ],
)
def test_options_lora_serving_does_not_compute_are_refused(model_dir, adapter_dirs, tmp_path, key, value, message):
    import json
    import shutil

    folder = tmp_path / "a"
    shutil.copytree(adapter_dirs["attn-r4"], folder)
    raw = json.loads((folder / "adapter_config.json").read_text())
    raw[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(raw))
    config = load_stage(model_dir, dtype="float32").config
    with pytest.raises(ValueError, match=message):
        load_adapter(folder, config, 0, 4, max_rank=MAX_RANK)


def test_a_stage_keeps_only_its_layers(model_dir, adapter_dirs):
    config = load_stage(model_dir, dtype="float32").config
    adapter = load_adapter(adapter_dirs["mlp-r8"], config, 2, 4, max_rank=MAX_RANK)
    assert {layer for layer, _ in adapter.weights} == {2, 3}
    assert adapter.rank == 8 and adapter.targets == {"o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter.weights[2, "down_proj"].a.shape == (4, config.intermediate_size)  # rank_pattern
    assert adapter.weights[2, "o_proj"].scaling == 32 / 8  # alpha_pattern
    assert adapter.weights[2, "up_proj"].scaling == 16 / 8
    with pytest.raises(ValueError, match=r"loaded for layers \[2, 4\), the bank holds \[0, 4\)"):
        LoraBank(config, 0, 4, max_loras=1, max_rank=MAX_RANK).add("x", adapter)
