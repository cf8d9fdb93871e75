"""Which grammar library masks a step fastest: xgrammar, llguidance and outlines-core, measured.

For each library that is installed: compile one JSON schema for the checkpoint's tokenizer,
then walk 32 sequences (a batch) through the tokens of documents that match it, filling each
sequence's token bitmask every step and applying it to [32, vocab] logits, as the last stage's
sampler does. Prints compile time, mask time per step (the batch of 32) and per sequence.

    python -m bench.structured_mask --model-dir /tmp/pagoda-anchor-7m [--batch 32]

The figures are what chose the library Pagoda uses (`worker_svc/execution/structured.py`); they are in
docs/structured-output.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "role", "active"],
    "additionalProperties": False,
}


def documents(batch: int) -> list[str]:
    roles = ["admin", "user", "guest"]
    out = []
    for i in range(batch):
        doc = {
            "name": f"Person number {i}",
            "age": 20 + i,
            "tags": [f"t{j}" for j in range(i % 4)],
            "address": {"city": f"City {i}", "zip": f"{10000 + i * 37:05d}"},
            "role": roles[i % 3],
            "active": i % 2 == 0,
        }
        out.append(json.dumps(doc, separators=(",", ":") if i % 2 else (", ", ": ")))
    return out


def _walk(name: str, batch_tokens: list[list[int]], vocab: int, fill, accept) -> dict:
    """fill(bitmask_or_mask_rows, active) fills masks for the active rows; accept(i, token)."""
    logits = torch.zeros(len(batch_tokens), vocab)
    steps = max(len(t) for t in batch_tokens)
    times = []
    for step in range(steps):
        active = [i for i, t in enumerate(batch_tokens) if step < len(t)]
        t0 = time.perf_counter()
        fill(logits, active)
        times.append(time.perf_counter() - t0)
        for i in active:
            accept(i, batch_tokens[i][step])
    full = [t for t, step in zip(times, range(steps), strict=True) if all(step < len(t) for t in batch_tokens)]
    per_step = statistics.median(full or times)
    return {
        "library": name,
        "steps": steps,
        "median_step_ms": per_step * 1e3,
        "per_seq_us": per_step / len(batch_tokens) * 1e6,
    }


def bench_xgrammar(tokenizer, vocab: int, eos: int, docs_tokens, schema: str) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema)
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in docs_tokens]
    bitmask = xgr.allocate_token_bitmask(len(docs_tokens), vocab)

    def fill(logits, active):
        for i in active:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=active)

    def accept(i, token):
        assert matchers[i].accept_token(token), ("xgrammar refused", i, token)

    out = _walk("xgrammar", docs_tokens, vocab, fill, accept)
    out["compile_ms"] = compile_s * 1e3
    return out


def bench_llguidance(tokenizer, vocab: int, eos: int, docs_tokens, schema: str) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in docs_tokens]
    compile_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(len(docs_tokens), vocab)

    def fill(logits, active):
        for i in active:
            llguidance.torch.fill_next_token_bitmask(matchers[i], bitmask, i)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(i, token):
        assert matchers[i].consume_token(token), ("llguidance refused", i, token, matchers[i].get_error())

    out = _walk("llguidance", docs_tokens, vocab, fill, accept)
    out["compile_ms"] = compile_s * 1e3
    return out


def bench_outlines(tokenizer, vocab: int, eos: int, docs_tokens, schema: str) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    mapping: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id == eos or token in tokenizer.all_special_tokens:
            continue
        mapping.setdefault(bytes(byte_decoder[c] for c in token), []).append(token_id)
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(schema), Vocabulary(eos, mapping))
    compile_s = time.perf_counter() - t0
    guides = [Guide(index) for _ in docs_tokens]
    words = (vocab + 31) // 32
    masks = torch.zeros(len(docs_tokens), words, dtype=torch.int32)

    def fill(logits, active):
        for i in active:
            guides[i].write_mask_into(masks[i].data_ptr(), words, 4)
        allowed = ((masks.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab]
        if active:
            rows = torch.tensor(active)
            logits[rows] = logits[rows].masked_fill(allowed[rows] == 0, float("-inf"))

    def accept(i, token):
        if not (token == eos and guides[i].is_finished()):
            guides[i].advance(token)

    out = _walk("outlines-core", docs_tokens, vocab, fill, accept)
    out["compile_ms"] = compile_s * 1e3
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character a ByteLevel BPE stores."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--libraries", default="xgrammar,llguidance,outlines-core")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    eos = tokenizer.eos_token_id
    docs = documents(args.batch)
    docs_tokens = [tokenizer.encode(d, add_special_tokens=False) + [eos] for d in docs]
    schema = json.dumps(SCHEMA)
    runners = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance, "outlines-core": bench_outlines}
    print(f"batch {args.batch}, vocabulary {vocab}, {statistics.mean(map(len, docs_tokens)):.0f} tokens per document")
    print(f"{'library':<14} {'compile ms':>10} {'step ms (batch)':>16} {'us per sequence':>16}")
    for name in args.libraries.split(","):
        try:
            r = runners[name](tokenizer, vocab, eos, docs_tokens, schema)
        except ImportError as e:
            print(f"{name:<14} not installed ({e})")
            continue
        except Exception as e:  # a library that cannot take this schema is a finding, not a crash
            print(f"{name:<14} failed: {type(e).__name__}: {e}")
            continue
        print(f"{r['library']:<14} {r['compile_ms']:>10.1f} {r['median_step_ms']:>16.3f} {r['per_seq_us']:>16.1f}")


if __name__ == "__main__":
    main()
