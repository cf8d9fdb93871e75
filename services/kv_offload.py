"""`--kv-offload`: the KV tier below the pool (kvcache_svc/core/tier.py decides, each stage's
worker_svc/execution/kv_tier.py holds the bytes).

    --kv-offload host:4                   4 GiB of host memory
    --kv-offload host:4,disk:/var/kv:64   then 64 GiB of files under /var/kv
    --kv-offload host:512b,disk:/var/kv:8192b   the same in blocks

A size is GiB (a number) or blocks (a count ending in `b`). `pagoda serve` turns GiB into blocks
of the whole pipeline (every layer's K and V of one block, at the pools' dtype) and hands the
block form to the KV service, the scheduler and every stage, which all bound the tier by the
same counts; a service started alone takes the block form only.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class KVOffload:
    host: float  # GiB, or blocks when `in_blocks`
    disk: float = 0.0
    disk_path: str = ""
    in_blocks: bool = False

    @property
    def host_blocks(self) -> int:
        self._need_blocks()
        return int(self.host)

    @property
    def disk_blocks(self) -> int:
        self._need_blocks()
        return int(self.disk)

    def _need_blocks(self) -> None:
        if not self.in_blocks:
            raise ValueError(
                "kv_offload: sizes in GiB are turned into blocks by `pagoda serve`; give blocks (e.g. host:512b)"
            )

    def in_blocks_of(self, block_bytes: int) -> KVOffload:
        """The same tier in blocks of `block_bytes` each (the whole pipeline's bytes per block)."""
        if self.in_blocks:
            return self
        if block_bytes <= 0:
            raise ValueError(f"kv_offload: block_bytes must be positive, got {block_bytes}")
        host, disk = int(self.host * GIB // block_bytes), int(self.disk * GIB // block_bytes)
        if host < 1:
            raise ValueError(f"kv_offload: host:{self.host} GiB holds no block of {block_bytes} bytes")
        if self.disk_path and disk < 1:
            raise ValueError(f"kv_offload: disk:{self.disk} GiB holds no block of {block_bytes} bytes")
        return KVOffload(host, disk, self.disk_path, in_blocks=True)

    def spec(self) -> str:
        unit = "b" if self.in_blocks else ""

        def size(x: float) -> str:
            return f"{int(x)}{unit}" if self.in_blocks or x == int(x) else f"{x:g}"

        disk = f",disk:{self.disk_path}:{size(self.disk)}" if self.disk_path else ""
        return f"host:{size(self.host)}{disk}"


def parse_kv_offload(text: str | None) -> KVOffload | None:
    """None for no tier ('' or None); ValueError naming the part that is wrong."""
    if not text:
        return None
    host = disk = None
    path = ""
    units: set[bool] = set()
    for part in text.split(","):
        kind, _, rest = part.strip().partition(":")
        if kind == "host" and host is None:
            host = _size(rest, units, part)
        elif kind == "disk" and disk is None:
            path, _, size = rest.rpartition(":")
            if not path:
                raise ValueError(f"kv_offload: {part!r}: want disk:PATH:SIZE")
            disk = _size(size, units, part)
        else:
            raise ValueError(f"kv_offload: {part!r}: want host:SIZE[,disk:PATH:SIZE] (SIZE in GiB, or blocks as 512b)")
    if host is None or host <= 0:
        raise ValueError("kv_offload: a host tier of positive size comes first (host:SIZE)")
    if len(units) > 1:
        raise ValueError("kv_offload: give every size in GiB or every size in blocks")
    if disk is not None and disk <= 0:
        raise ValueError(f"kv_offload: disk size must be positive, got {disk}")
    return KVOffload(host, disk or 0.0, path, in_blocks=units == {True})


def _size(text: str, units: set[bool], part: str) -> float:
    blocks = text.endswith("b")
    try:
        value = float(text[:-1] if blocks else text)
    except ValueError:
        raise ValueError(f"kv_offload: {part!r}: the size {text!r} is not a number of GiB or blocks (512b)") from None
    if blocks and value != int(value):
        raise ValueError(f"kv_offload: {part!r}: a block count is whole")
    units.add(blocks)
    return value
