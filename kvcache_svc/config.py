"""The KV-cache service's configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from services import settings as shared
from services.defaults import NUM_KV_BLOCKS
from services.grpc_utils import DEFAULT_MAX_MESSAGE_BYTES
from services.kv_layout import parse_spec
from services.settings import uses

MAX_NUM_BLOCKS = 2**32 - 1  # block ids travel as uint32

_setting = partial(shared.declare, "kvcache")


@dataclass(frozen=True)
class KVCacheConfig:
    """What `pagoda kvcache` was started with. Derived values are properties.

    `num_blocks` and `block_size` must match every stage worker's (`--num-kv-blocks`,
    `--block-size`): the KV service decides which block holds which tokens, the workers hold
    the blocks. `watermark` is the fraction of blocks a new sequence must leave available.
    Each field that is a setting carries its declaration (services/settings.py).
    """

    # the pool: the shared --num-kv-blocks (parsed as `num_blocks`, this field's older name)
    num_blocks: int = uses(shared.NUM_KV_BLOCKS, NUM_KV_BLOCKS, dest="num_blocks")
    block_size: int = uses(shared.BLOCK_SIZE)
    watermark: float = _setting(0.01, "fraction of blocks a new sequence must leave free", "float", group="cache")
    enable_prefix_caching: bool = uses(shared.ENABLE_PREFIX_CACHING)
    kv_offload: str = uses(shared.KV_OFFLOAD)
    kv_import_blocks: int = uses(shared.KV_IMPORT_BLOCKS)
    kv_groups: str = uses(shared.KV_GROUPS)
    host: str = uses(shared.HOST)
    port: int = uses(shared.PORT)
    # run `check_integrity()` once no mutating call came for this long; 0 turns it off
    integrity_check_idle_s: float = 1.0
    # KV events (kvcache_svc/events.py): how many are kept for subscribers that reconnect
    events_kept: int = _setting(
        65_536, "KV events kept for SubscribeEvents subscribers that reconnect", "int", group="cache"
    )
    # the prefix index in Redis for routers (kvcache_svc/publisher.py): this replica's name
    # and where; "" keeps nothing in Redis
    replica_id: str = _setting(
        "r0", "this replica's name in the prefix index (routers: gateway --scheduler NAME=...)", group="parallelism"
    )
    redis_url: str = uses(shared.REDIS_URL, "")
    # the scheduler's Step calls on this host's local socket (services/local_stream.py)
    step_channel: str = _setting(
        "auto",
        "how the scheduler's Step calls reach this KV service: auto (a local socket offered to a "
        "scheduler on this host, gRPC from elsewhere) or grpc (gRPC only)",
        "str",
        choices=("auto", "grpc"),
        serve="pass",
        group="network",
    )

    def __post_init__(self) -> None:
        if not 1 <= self.num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks: must be in [1, 2**32), got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.events_kept < 1:
            raise ValueError(f"events_kept: must be positive, got {self.events_kept}")
        if not self.replica_id or any(c in self.replica_id for c in "{}:, \t"):
            raise ValueError(f"replica_id: a name without braces, colons, commas or spaces, got {self.replica_id!r}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url: must start with redis://, rediss:// or unix://")
        parse_spec(self.kv_groups)  # raises naming the field
        if self.integrity_check_idle_s < 0:
            raise ValueError(f"integrity_check_idle_s: must be >= 0, got {self.integrity_check_idle_s}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def group_windows(self) -> tuple[int, ...]:
        return parse_spec(self.kv_groups)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_message_bytes(self) -> int:
        """The largest message the service takes or sends, with headroom.

        A Step can carry every slot of the pool twice over (prompt token ids in, at most 5
        bytes each; slots out, at most 10 bytes each, plus block ids), and Stats with
        sequences lists every table; 24 bytes per slot plus 4 MiB covers both, and never
        less than the default.
        """
        return max(DEFAULT_MAX_MESSAGE_BYTES, 24 * self.num_slots + (4 << 20))


# what `pagoda kvcache` takes: the config's settings, then where it reports
SETTINGS = shared.settings_of(KVCacheConfig, shared.METRICS_PORT, shared.READY_FILE, shared.INTERNAL_TOKEN)
