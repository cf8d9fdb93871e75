"""A Gemma-style SentencePiece BPE tokenizer made locally (no hub): `<pad> <eos> <bos> <unk>
<mask>` first, the 256 byte pieces `<0x00>`... (byte fallback), then the characters and
merges a BPE trainer learns from a small multilingual corpus, in merge order, as Gemma's
vocabulary is laid out. `transformers`' own `GemmaTokenizer` holds it, so it is the
reference a GGUF file written from it (`tokenizer.ggml.model` "llama") must read back as."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Grüße aus München! Die Straße ist schön, und der Käse schmeckt gut.",
    "Le café est très bon, naïve élève, à bientôt et merci beaucoup.",
    "El niño come manzanas y la señora lee un libro en la biblioteca.",
    "Hello, world! How are you today? I am fine, thank you very much.",
    "def main():\n    print('hello')\n    return 0\n\nif __name__ == '__main__':\n    main()",
    "1234567890 3.14159 2.71828 100% of the numbers, 42 and 7.",
    "世界你好，今天天气很好。我们去公园散步吧。",
    "こんにちは世界。今日はいい天気ですね。",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
] * 20


def make_gemma_tokenizer(out_dir: str | Path, vocab_size: int = 700) -> Path:
    """Trains the merges, then saves `GemmaTokenizer(vocab, merges)` (BOS added, Gemma 3's
    chat template) to `out_dir`."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials + byte_pieces, show_progress=False, limit_alphabet=200
    )
    trainer_tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    template = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "gemma3.jinja").read_text()
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, chat_template=template)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out
