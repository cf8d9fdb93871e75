"""The Redis key schema of the replicas' prefix index, shared by its writer and its reader.

A KV service with `--redis-url` publishes (kvcache_svc/publisher.py) and the gateway's router
reads (gateway/kv_index.py), for each replica `r0`:

- `pagoda:kv:{r0}:blocks`: a set of the keys of every block in the replica's prefix cache;
- `pagoda:kv:{r0}:events`: the KV events, a trimmed stream;
- `pagoda:kv:{r0}:alive`: the heartbeat (`{"epoch", "sequence_number", "block_size"}`).

The braces put a replica's keys in one hash slot (Redis Cluster).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaKeys:
    blocks: str
    events: str
    alive: str
    tier: str  # the KV tier's blocks (host and disk): hits that cost a load, not a recompute


def replica_keys(replica: str) -> ReplicaKeys:
    tag = f"pagoda:kv:{{{replica}}}"
    return ReplicaKeys(blocks=f"{tag}:blocks", events=f"{tag}:events", alive=f"{tag}:alive", tier=f"{tag}:tier")
