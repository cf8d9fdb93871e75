"""The disk format of a stage's KV tier (worker_svc/execution/kv_tier.py): one file per block.

File format (version 1, little-endian)::

    8s magic b"PAGODAKV" | H format version | H key length | I meta length | I crc32 of payload
    key bytes
    meta: UTF-8 JSON {"dtype": "float32", "shapes": [[block_size, heads, head_dim], ... one per
          pool], "payload_bytes": n}
    payload: each pool's block, raw, in pool order (K0, V0, K1, V1 ...)
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from math import prod
from pathlib import Path

import torch

MAGIC = b"PAGODAKV"
FORMAT_VERSION = 1
SUFFIX = ".kv"
TMP_SUFFIX = SUFFIX + ".tmp"
_PREFIX = struct.Struct("<8sHHII")  # magic, version, key length, meta length, payload crc32


class Unreadable(Exception):
    """A tier file that must not be served; the message says why."""


class BlockFiles:
    """The disk format of one stage's blocks: one file per key in `directory` (module docstring).

    Stateless apart from its directory: safe to call from any thread, as long as one thread
    writes and removes (the store's I/O thread).
    """

    def __init__(self, directory: Path, dtype: torch.dtype, block_shape: tuple[int, ...]) -> None:
        self.directory, self.dtype, self.block_shape = directory, dtype, block_shape
        self.payload_bytes = prod(block_shape) * dtype.itemsize
        shapes = [list(block_shape[1:])] * block_shape[0]
        meta = {"dtype": str(dtype).removeprefix("torch."), "shapes": shapes, "payload_bytes": self.payload_bytes}
        self.meta = json.dumps(meta, separators=(",", ":")).encode()

    def path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def file_bytes(self, key: bytes) -> int:
        return _PREFIX.size + len(key) + len(self.meta) + self.payload_bytes

    def write(self, key: bytes, block: torch.Tensor) -> None:
        """`block` ([num_pools, block_size, heads, head_dim], contiguous, on the CPU) -> its file."""
        payload = block.reshape(-1).view(torch.uint8).numpy()
        header = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(key), len(self.meta), zlib.crc32(payload))
        path = self.path(key)
        tmp = path.with_name(path.name.removesuffix(SUFFIX) + TMP_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                f.write(header + key + self.meta)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, key: bytes, pin: bool = False) -> torch.Tensor:
        """The block stored under `key`, checked whole; `Unreadable` (or OSError) if not servable."""
        try:
            f = open(self.path(key), "rb")
        except FileNotFoundError:
            raise Unreadable("its file is missing") from None
        with f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) != _PREFIX.size:
                raise Unreadable("truncated header")
            magic, version, key_len, meta_len, crc = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise Unreadable("not a KV tier file (magic)")
            if version != FORMAT_VERSION:
                raise Unreadable(f"format version {version}, expected {FORMAT_VERSION}")
            if f.read(key_len) != key:
                raise Unreadable("its header names another key")
            if f.read(meta_len) != self.meta:
                raise Unreadable("its dtype or shapes differ from this stage's pools")
            raw = torch.empty(self.payload_bytes, dtype=torch.uint8, pin_memory=pin)
            got = f.readinto(raw.numpy())
            if got != self.payload_bytes:
                raise Unreadable(f"truncated: {got} of {self.payload_bytes} payload bytes")
            if f.read(1):
                raise Unreadable("bytes past the payload")
        if zlib.crc32(raw.numpy()) != crc:
            raise Unreadable("checksum mismatch")
        return raw.view(self.dtype).view(self.block_shape)

    def remove(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def listing(self) -> dict[str, int]:
        """The tier's files (finished and temporary) in the directory: name -> size."""
        names = (p for p in self.directory.iterdir() if p.name.endswith((SUFFIX, TMP_SUFFIX)))
        return {p.name: p.stat().st_size for p in names}

    def remove_all(self) -> None:
        for name in self.listing():
            (self.directory / name).unlink(missing_ok=True)


def process_folder_name(stage: int, num_stages: int) -> str:
    """A stage process's own folder under the disk tier's directory: no two live processes share
    one (replicas, restarts, in-process engines), and `sweep_dead_folders` finds the dead's."""
    return f"stage{stage}-of-{num_stages}-pid{os.getpid()}"


def sweep_dead_folders(directory: Path) -> list[str]:
    """Remove the tier folders of processes that are gone (killed before they could clean up);
    returns their names. A folder whose process lives, or that is not a tier folder, stays."""
    removed = []
    if not directory.is_dir():
        return removed
    for folder in directory.iterdir():
        _, sep, pid = folder.name.rpartition("-pid")
        if not sep or not pid.isdigit() or not folder.is_dir() or _alive(int(pid)):
            continue
        for f in folder.iterdir():
            if f.name.endswith((SUFFIX, TMP_SUFFIX)):
                f.unlink(missing_ok=True)
        try:
            folder.rmdir()
            removed.append(folder.name)
        except OSError:  # something else lives there: left alone
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
