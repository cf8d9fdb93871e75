"""KV groups on the stage worker (issue 33; services/kv_layout.py): a hybrid model's sub-groups
each have their own block table, all drawing pages from one pool.

A tiny Gemma-3-shaped model (transformers' own, random weights: tests/support/archs.py)
with sliding and full layers, window 8, block size 4, is driven through `StageRunner`s by a
stand-in for the KV service (`PageService`): pages from a shuffled free list, a page of every
sub-group per block position, a sliding sub-group's pages given back (NULL_PAGE) once its
window has left their block and handed at once to whatever is allocated next (another
sequence, the same step), a fork made by copying a sequence's pages (block copies), and page
0 kept out of use and filled with large values, so that any read of a NULL page (mapped to
0) inside a window would change the output. Prompts and generations are 4x the window,
batched, prefilled in chunks. Greedy output equals transformers' (float32) and the same
runner's with one table for all layers, on the torch backend and the CPU one (native decode
kernel, and the fused native decode step on bfloat16 weights), one stage and two.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from support.archs import make_arch_model
from support.reference import HFReference

from services.kv_layout import NULL_PAGE, first_needed_block, kv_layout
from services.sampling import SamplingParams
from services.step import CachedSeq, NewSeq, StepPlan
from worker_svc.checkpoints.loader import load_stage
from worker_svc.errors import InvalidPlanError
from worker_svc.execution.kv_cache import PagedKVCache
from worker_svc.execution.runner import StageRunner
from worker_svc.kernels.attention import TorchAttentionBackend, get_backend
from worker_svc.kernels.attention_metadata import paged_layout

WINDOW, BLOCK, CHUNK = 8, 4, 7
S, F = "sliding_attention", "full_attention"
# 2 full layers, 5 sliding: pages of 2 slots; sub-groups full, then 3 sliding (the last of one layer)
LAYER_TYPES = [S, S, F, S, S, F, S]
NEW_TOKENS = 4 * WINDOW
PROMPT_LENGTHS = (32, 37, 29, 41)
NUM_PAGES = 400
GARBAGE = 50.0  # page 0's K/V: never in a table but as a NULL page's stand-in


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The model; its LM head untied (tied, the tiny Gemma repeats its input token whatever
    it attends to; untied, a window of 64 gives other tokens for every prompt)."""
    folder = make_arch_model(
        tmp_path_factory.mktemp("gemma3-kv-groups"),
        "gemma3",
        tmp_path_factory.mktemp("none"),
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        tie_word_embeddings=False,
    )
    return folder, HFReference(folder)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(33)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


# --- a stand-in for the KV service ----------------------------------------------------------


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]  # known: prompt, then outputs
    prompt_len: int
    max_new: int
    arrival: int
    computed: int = 0
    entries: list = field(default_factory=list)
    held: int = -1  # entries the stages hold equal to ours (-1: not sent yet)
    fed: int = 0  # tokens the first stage knows

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new


class PageService:
    """Pages of one pool for the tables of `windows`' sub-groups ((0,): one table of block
    ids). Freed pages are taken first, so a page a window leaves is reused at once."""

    def __init__(self, windows: tuple[int, ...], seed: int = 0) -> None:
        self.windows = windows
        self.grouped = len(windows) > 1
        self.free = list(range(1, NUM_PAGES))  # page 0 is never handed out
        random.Random(seed).shuffle(self.free)
        self.num_nulled = 0
        self.reused: set[int] = set()  # pages handed out again after being given back
        self._given_back: set[int] = set()

    def _take(self) -> int:
        page = self.free.pop()
        if page in self._given_back:
            self.reused.add(page)
        return page

    def _give_back(self, page: int) -> None:
        self._given_back.add(page)
        self.free.append(page)

    def grow(self, seq: _Seq, end: int) -> None:
        while len(seq.entries) < -(-end // BLOCK):
            seq.entries.append(tuple(self._take() for _ in self.windows) if self.grouped else self._take())

    def slide(self, seq: _Seq, start: int) -> None:
        """The sliding sub-groups give back the pages of blocks wholly before `start - window + 1`."""
        for g, w in enumerate(self.windows):
            for k in range(first_needed_block(start, w, BLOCK) if w else 0):
                entry = seq.entries[k]
                if entry[g] != NULL_PAGE:
                    self._give_back(entry[g])
                    seq.entries[k] = entry[:g] + (NULL_PAGE,) + entry[g + 1 :]
                    seq.held = min(seq.held, k)
                    self.num_nulled += 1

    def release(self, seq: _Seq) -> None:
        for entry in seq.entries:
            for page in entry if self.grouped else (entry,):
                if page != NULL_PAGE:
                    self._give_back(page)

    def fork(self, seq: _Seq) -> tuple[list, list[tuple[int, int]]]:
        """A copy of `seq`'s table on new pages, and the page copies that fill them."""
        entries, copies = [], []
        for entry in seq.entries:
            pages = []
            for page in entry if self.grouped else (entry,):
                if page == NULL_PAGE:
                    pages.append(NULL_PAGE)
                else:
                    pages.append(self._take())
                    copies.append((page, pages[-1]))
            entries.append(tuple(pages) if self.grouped else pages[0])
        return entries, copies


class Driver:
    """Steps of every live sequence (a prefill chunk of at most CHUNK tokens, or a decode)
    through the stages, one step at a time; `fork_at`: (step, parent, child id)."""

    def __init__(self, runners: list[StageRunner], service: PageService) -> None:
        self.runners, self.service = runners, service
        self.greedy = SamplingParams(temperature=0.0)
        self.seqs: dict[int, _Seq] = {}
        self.finished: list[int] = []

    def run(self, prompt_list: list[list[int]], fork_at: tuple[int, int, int]) -> dict[int, list[int]]:
        for i, p in enumerate(prompt_list):
            self.seqs[i] = _Seq(i, list(p), len(p), NEW_TOKENS, arrival=2 * i)
        step = 0
        while any(not s.done for s in self.seqs.values()):
            step += 1
            self._step(step, fork_at[1:] if step == fork_at[0] else None)
        return {i: s.outputs for i, s in self.seqs.items()}

    def _fork(self, parent_id: int, child_id: int) -> list[tuple[int, int]]:
        parent = self.seqs[parent_id]
        assert parent.computed == len(parent.tokens) - 1 and parent.computed > 2 * WINDOW, "fork mid-decode"
        entries, copies = self.service.fork(parent)
        self.seqs[child_id] = _Seq(
            child_id, list(parent.tokens), parent.prompt_len, parent.max_new, 0, parent.computed, entries
        )
        return copies

    def _step(self, step_id: int, fork: tuple[int, int] | None) -> None:
        live = [s for s in self.seqs.values() if s.arrival < step_id and not s.done]
        for s in live:
            self.service.slide(s, s.computed)
        copies = []
        if fork is not None:  # (after the parent's pages slid: only live pages are copied)
            copies = self._fork(*fork)
            live.append(self.seqs[fork[1]])
        sizes = {s.seq_id: min(CHUNK, len(s.tokens) - s.computed) for s in live}
        for s in live:
            self.service.grow(s, s.computed + sizes[s.seq_id])
        new = [self._new(s, sizes[s.seq_id]) for s in live if s.held < 0]
        cached = [self._cached(s, sizes[s.seq_id]) for s in live if s.held >= 0]
        plan = StepPlan(step_id, tuple(n for n in new), tuple(cached), tuple(self.finished), tuple(copies))
        self.finished = []
        hidden = None
        for runner in self.runners:
            result = runner.execute(plan, hidden)
            hidden = result.hidden
        sampled = {t.seq_id: t.token_id for t in result.sampled_tokens()}
        for s in live:
            s.computed += sizes[s.seq_id]
            s.held = len(s.entries)
            if s.seq_id in sampled:
                s.tokens.append(sampled[s.seq_id])
            if s.done:
                self.finished.append(s.seq_id)
                self.service.release(s)

    def _new(self, s: _Seq, n: int) -> NewSeq:
        s.fed = len(s.tokens)
        return NewSeq(s.seq_id, tuple(s.tokens), s.prompt_len, s.computed, n, tuple(s.entries), self.greedy)

    def _cached(self, s: _Seq, n: int) -> CachedSeq:
        end = s.computed + n
        new_tokens = tuple(s.tokens[s.fed : end])
        s.fed = max(s.fed, end)
        return CachedSeq(s.seq_id, n, s.held, tuple(s.entries[s.held :]), new_tokens)


def _runners(folder: str, num_stages: int, backend: str, grouped: bool, dtype: str = "float32") -> list[StageRunner]:
    runners = []
    for k in range(num_stages):
        model = load_stage(folder, k, num_stages, dtype=dtype)
        runner = StageRunner(model, NUM_PAGES, BLOCK, backend, layout=model.kv_layout if grouped else None)
        for k_pool, v_pool in runner.kv_cache.slot_pools:
            k_pool[0].normal_(0, GARBAGE)
            v_pool[0].normal_(0, GARBAGE)
        runners.append(runner)
    return runners


def _generate(folder: str, num_stages: int, backend: str, grouped: bool, dtype: str = "float32"):
    runners = _runners(folder, num_stages, backend, grouped, dtype)
    service = PageService(runners[0].model.kv_layout.windows if grouped else (0,), seed=num_stages)
    outputs = Driver(runners, service).run(prompts(), fork_at=(14, 1, 9))
    return outputs, service, runners


def _check_fork(outputs: dict[int, list[int]]) -> None:
    """The fork (9, of 1 mid-decode, its outputs so far copied) continues exactly as its
    parent does."""
    assert outputs.pop(9) == outputs[1]


# --- the runner, end to end -----------------------------------------------------------------


def test_the_model_groups_as_the_kv_service_does(gemma):
    model = load_stage(gemma[0], dtype="float32")
    layout = model.kv_layout
    assert layout == kv_layout([WINDOW if t == S else None for t in LAYER_TYPES])
    assert layout.windows == (0, WINDOW, WINDOW, WINDOW) and layout.layers_per_page == 2
    assert [model.kv_group_of(i) for i in range(len(LAYER_TYPES))] == [1, 1, 0, 2, 2, 0, 3]


@pytest.mark.parametrize(("num_stages", "backend"), [(1, "torch"), (1, "cpu"), (2, "torch"), (2, "cpu")])
def test_grouped_greedy_equals_transformers_and_one_table(gemma, num_stages, backend):
    folder, ref = gemma
    outputs, service, runners = _generate(folder, num_stages, backend, grouped=True)
    assert service.num_nulled > 20 and len(service.reused) > 20, "windows never slid, or pages were never reused"
    assert runners[0].num_kv_groups == 4
    assert all(r.kv_cache.layout is not None for r in runners)
    plain, _, _ = _generate(folder, num_stages, backend, grouped=False)
    assert outputs == plain
    _check_fork(outputs)
    diverged = 0
    for prompt, out in zip(prompts(), outputs.values(), strict=True):
        assert len(out) == NEW_TOKENS
        diverged += ref.compare(prompt, out).tie_divergences > 0
    assert diverged <= 1, f"{diverged} of {len(outputs)} prompts needed the tie rule"
    assert all(len(set(out)) >= 10 for out in outputs.values()), "repeated tokens: a vacuous test"


@pytest.fixture
def one_thread():
    """The native step runs at one torch thread (a test before may leave more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_the_fused_native_decode_step_reads_each_layers_group(gemma, num_stages, one_thread):
    """bfloat16 weights on the CPU: every decode step goes through the one native call,
    each layer reading its own sub-group's table and slots; the tokens equal the one-table
    runner's (the same kernels over the same keys)."""
    folder = gemma[0]
    calls = []
    runners = _runners(folder, num_stages, "cpu", grouped=True, dtype="bfloat16")
    for runner in runners:
        fused = runner.model.fused_decode
        assert fused is not None
        native = fused.forward
        fused.forward = lambda *a, native=native: calls.append(a[3].num_groups) or native(*a)
    service = PageService(runners[0].model.kv_layout.windows, seed=5)
    outputs = Driver(runners, service).run(prompts(), fork_at=(14, 1, 9))
    assert len(calls) >= 20 and set(calls) == {4}  # (steps of decodes only: the rest mix in prefill chunks)
    plain_runners = _runners(folder, num_stages, "cpu", grouped=False, dtype="bfloat16")
    plain = Driver(plain_runners, PageService((0,), seed=5)).run(prompts(), fork_at=(14, 1, 9))
    assert outputs == plain
    _check_fork(outputs)


# --- attention over NULL pages, every backend -----------------------------------------------


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
def test_attention_never_reads_a_null_page_a_query_can_see(backend_name):
    """A sliding sub-group's table with its out-of-window pages NULL (page 0 in the tensors,
    holding large values) gives what contiguous whole-context tables give, for decode rows
    and prefill chunks past the window (the Triton kernels under the interpreter)."""
    if backend_name == "triton":
        pytest.importorskip("triton")
    backend = get_backend(backend_name)
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, window = 4, 2, 16, WINDOW
    spans = [(29, 30), (41, 42), (20, 27), (0, 11)]  # two decodes, a chunk past the window, a first chunk
    num_pages = 64
    pools = [torch.randn(num_pages, BLOCK, kv_heads, dim, generator=g) for _ in range(2)]
    for pool in pools:
        pool[0].normal_(0, GARBAGE, generator=g)
    free = list(range(1, num_pages))
    random.Random(1).shuffle(free)
    plain_rows, grouped_rows = [], []
    for start, end in spans:
        pages = [free.pop() for _ in range(-(-end // BLOCK))]
        plain_rows.append((start, end, pages))
        gone = first_needed_block(start, window, BLOCK)
        grouped_rows.append((start, end, [(free.pop(), NULL_PAGE if k < gone else p) for k, p in enumerate(pages)]))
    plain, _ = paged_layout(plain_rows, BLOCK, "cpu")
    grouped, _ = paged_layout(grouped_rows, BLOCK, "cpu", num_groups=2)
    sliding = grouped.group(1)
    assert torch.equal(sliding.slot_mapping, plain.slot_mapping)
    assert (sliding.block_tables == 0).any()  # the NULL pages read as page 0
    q = torch.randn(plain.query_start_loc_list[-1], heads, dim, generator=g)
    want = TorchAttentionBackend().forward(q, *pools, plain, 0.25, window)
    got = backend.forward(q, *pools, sliding, 0.25, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_group_views_are_made_once_a_step_and_share_the_rows():
    rows = [(3, 4, [(1, 2, 3)] * 1), (0, 6, [(4, 5, 6), (7, NULL_PAGE, 9)])]
    metadata, positions = paged_layout(rows, BLOCK, "cpu", num_groups=3)
    assert positions.tolist() == [3, 0, 1, 2, 3, 4, 5]
    assert metadata.num_groups == 3 and metadata.group(0) is metadata
    view = metadata.group(2)
    assert metadata.group(2) is view and view.num_groups == 1
    assert view.block_tables.tolist() == [[3, 0], [6, 9]]
    assert view.slot_mapping.tolist() == [15, 24, 25, 26, 27, 36, 37]
    assert metadata.group(1).block_tables.tolist() == [[2, 0], [5, 0]]  # NULL and padding: page 0
    assert metadata.block_tables.tolist() == [[1, 0], [4, 7]]
    assert view.split_rows() == metadata.split_rows() == ([0], [1])
    assert [m is view for m in metadata.layer_views([2, 0, 2])] == [True, False, True]


# --- pools, plans, memory, ranks ------------------------------------------------------------


def test_a_stage_allocates_one_pool_per_page_slot_its_layers_use(gemma):
    layout = load_stage(gemma[0], dtype="float32").kv_layout
    # layers 2..4 (full, sliding, sliding): slots 0, 0 and 1 -> two tensors, layers 2 and 3 share one
    cache = PagedKVCache(3, 10, 4, 2, 16, torch.float32, layout=layout, layers=range(2, 5))
    assert len(cache.slot_pools) == 2 and cache.pools[0] is cache.pools[1] is not cache.pools[2]
    assert cache.nbytes == 2 * 2 * 10 * 4 * 2 * 16 * 4
    k, v = cache.pools[0]
    k[3].fill_(1.0)
    cache.copy_blocks([(3, 7)])
    assert torch.equal(k[7], k[3]) and not v[7].any() and not cache.pools[2][0][7].any()


def test_a_model_that_does_not_group_keeps_one_pool_a_layer_and_one_table(tmp_path):
    folder = make_arch_model(tmp_path / "llama", "llama", tmp_path)
    model = load_stage(folder, dtype="float32")
    assert not model.kv_layout.grouped and model.kv_layout.describe() == "one table for all layers"
    assert not kv_layout([48] * 3).grouped  # all sliding (Mistral): one table of whole-context blocks
    cache = PagedKVCache(3, 10, 4, 2, 16, torch.float32, layout=model.kv_layout, layers=range(3))
    plain = PagedKVCache(3, 10, 4, 2, 16, torch.float32)
    assert cache.layout is None and len(cache.slot_pools) == len(cache.pools) == 3 and cache.nbytes == plain.nbytes
    assert len({id(p) for p in cache.pools}) == 3
    runner = StageRunner(model, 16, 4, layout=model.kv_layout)
    assert runner.num_kv_groups == 1 and runner.batch.shape.kv_windows == (0,)
    metadata, _ = runner._metadata(
        runner.batch.apply(StepPlan(1, new_seqs=(NewSeq(1, (5, 6, 7, 8, 9), 5, 0, 5, (3, 2), SamplingParams()),)))
    )
    assert metadata.group_block_tables is None and all(m is metadata for m in metadata.layer_views([0, 0, 0]))
    with pytest.raises(InvalidPlanError, match=r"sequence 2: block id \(4, 5\) out of range"):  # an entry
        runner.validate(StepPlan(2, new_seqs=(NewSeq(2, (5, 6), 2, 0, 2, ((4, 5),), SamplingParams()),)), None)


def test_grouped_plans_are_checked_entry_by_entry(gemma):
    model = load_stage(gemma[0], dtype="float32")
    runner = StageRunner(model, 64, BLOCK, layout=model.kv_layout)
    greedy = SamplingParams(temperature=0.0)
    tokens = tuple(range(5, 45))

    def new(entries, num_computed=0):
        return StepPlan(1, new_seqs=(NewSeq(7, tokens, 40, num_computed, 40 - num_computed, tuple(entries), greedy),))

    good = [(4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3) for k in range(10)]
    with pytest.raises(InvalidPlanError, match=r"sequence 7: block table entry 2 is \(8, 9, 10\): want one page id"):
        runner.validate(new(good[:2] + [(8, 9, 10)] + good[3:]), None)
    with pytest.raises(InvalidPlanError, match="sequence 7: block table entry 0 is 0: want"):  # an int
        runner.validate(new([0] + good[1:]), None)
    null_full = [(NULL_PAGE, 1, 2, 3)] + good[1:]
    with pytest.raises(InvalidPlanError, match="sequence 7: block table entry 0, KV sub-group 0 .window full."):
        runner.validate(new(null_full, num_computed=30), None)
    # from position 30 the window (8) reaches back to 23: blocks 0..4 may go, block 5 may not
    gone = [(a, NULL_PAGE, NULL_PAGE, NULL_PAGE) if k < 5 else (a, b, c, d) for k, (a, b, c, d) in enumerate(good)]
    runner.validate(new(gone, num_computed=30), None)
    too_far = gone[:5] + [(20, NULL_PAGE, 22, 23)] + gone[6:]
    with pytest.raises(InvalidPlanError, match="entry 5, KV sub-group 1 .window 8.: page 4294967295 .*NULL only"):
        runner.validate(new(too_far, num_computed=30), None)
    with pytest.raises(InvalidPlanError, match="entry 3, KV sub-group 2 .window 8.: page 64 out of range"):
        runner.validate(new(good[:3] + [(12, 13, 64, 15)] + good[4:]), None)
    with pytest.raises(InvalidPlanError, match="block table has 9 blocks, context needs 10"):
        runner.validate(new(good[:9]), None)


def test_memory_counts_pages_of_the_slots_a_stage_uses(gemma):
    from worker_svc.execution.memory import _profile_step, kv_block_bytes, size_kv_pool

    model = load_stage(gemma[0], 0, 2, dtype="float32")  # layers 0..3: slots 0 and 1
    layout = model.kv_layout
    per_layer = kv_block_bytes(1, BLOCK, 2, 16, torch.float32)
    sizing = size_kv_pool(model, BLOCK, "torch", None, 100 * 2 * per_layer, 64, layout=layout)
    assert (sizing.num_blocks, sizing.block_bytes) == (100, 2 * per_layer)
    assert sizing.unit == "pages" and sizing.describe(BLOCK).startswith("100 pages of 4 tokens (")
    assert layout.describe() in sizing.describe(BLOCK)
    plain = size_kv_pool(model, BLOCK, "torch", None, 100 * 2 * per_layer, 64)
    assert plain.block_bytes == 4 * per_layer and plain.describe(BLOCK).startswith("50 blocks (200 tokens")
    _profile_step(model, BLOCK, get_backend("torch"), 37, None, layout)()  # a grouped prefill runs


def test_tensor_parallel_ranks_get_every_groups_tables():
    from worker_svc.execution.tensor_parallel import step_from_payload, step_payload

    rows = [(3, 4, [(1, 2, 3)]), (0, 6, [(4, 5, 6), (7, NULL_PAGE, 9)])]
    for metadata, _ in (
        paged_layout(rows, BLOCK, "cpu", num_groups=3),
        paged_layout([(3, 4, [1]), (0, 6, [4, 7])], BLOCK, "cpu"),
    ):
        positions, ids = torch.arange(7), torch.arange(100, 107)
        payload, layout = step_payload([(1, 2)], positions, metadata, ids)
        step = step_from_payload(payload, layout, True, torch.device("cpu"))
        got = step.metadata
        assert step.block_copies == [(1, 2)] and torch.equal(step.inputs, ids)
        assert got.num_groups == metadata.num_groups and got.context_lens_list == metadata.context_lens_list
        for g in range(metadata.num_groups):
            assert torch.equal(got.group(g).block_tables, metadata.group(g).block_tables)
            assert torch.equal(got.group(g).slot_mapping, metadata.group(g).slot_mapping)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_verify_step_over_a_grouped_table_equals_one_table(gemma, backend):
    """Speculative decoding's verify step (one decode per position, all over the sequence's
    table) past the window, the sliding pages before it NULL: the logits equal the one-table
    runner's."""
    model_dir = gemma[0]
    prompt = tuple(prompts()[3][:30])
    drafts = (17, 301, 99)
    greedy = SamplingParams(temperature=0.0)
    got = []
    for grouped in (True, False):
        model = load_stage(model_dir, dtype="float32")
        runner = StageRunner(model, NUM_PAGES, BLOCK, backend, layout=model.kv_layout if grouped else None)
        service = PageService(model.kv_layout.windows if grouped else (0,), seed=9)
        seq = _Seq(1, list(prompt), len(prompt), 8, 0)
        service.grow(seq, len(prompt) - 1)
        runner.execute(
            StepPlan(1, new_seqs=(NewSeq(1, prompt, len(prompt), 0, len(prompt) - 1, tuple(seq.entries), greedy),))
        )
        seq.held, seq.computed = len(seq.entries), len(prompt) - 1
        service.slide(seq, seq.computed)
        service.grow(seq, seq.computed + 1 + len(drafts))
        plan = StepPlan(
            2,
            cached_seqs=(
                CachedSeq(1, 1 + len(drafts), seq.held, tuple(seq.entries[seq.held :]), draft_token_ids=drafts),
            ),
        )
        assert not grouped or NULL_PAGE in plan.cached_seqs[0].block_ids[0]
        got.append(runner.execute(plan, keep_logits=True).logits)
    assert got[0].shape[0] == 1 + len(drafts) and torch.equal(got[0], got[1])
