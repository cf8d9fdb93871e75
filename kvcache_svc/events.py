"""KV events: what entered and left the prefix cache, numbered (issue 13).

The semantics of vLLM's KV events: `BlocksStored` (a chain of full blocks: their keys in
order, the key before the first, their tokens), `BlocksRemoved` (keys), `AllBlocksCleared`.
Every event has a sequence number, strictly increasing from 1 per KV-service epoch (a new
epoch per process start), so a subscriber knows whether it missed anything.

The prefix cache reports each change as it happens (`stored`, `removed`, `cleared`); the
service calls `flush` after each operation, which turns what that operation did into
numbered events (consecutive stored blocks of one chain become one `BlocksStored`), keeps
the last `capacity` of them for subscribers that reconnect, and hands them to the live
subscribers. A subscriber that asks for events older than those kept, or that falls more
than its queue behind, is told so and resynchronises from a snapshot (`snapshot`: every
cached block and the sequence number it reflects).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.prefix_hash import unpack_token_ids

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 65_536  # events kept for subscribers that reconnect
SUBSCRIBER_QUEUE = 16_384  # events a live subscriber may fall behind before it is cut off


@dataclass(frozen=True)
class Stored:
    """Full blocks entered the cache, a chain: `keys[0]`'s parent is `parent_key`. `medium`
    "" is the pool; "host" or "disk" the KV tier below it (kvcache_svc/core/tier.py), whose
    blocks are named by key only (no parent, no tokens)."""

    keys: tuple[bytes, ...]
    parent_key: bytes
    token_ids: tuple[int, ...]  # block_size per block
    namespace: str | None
    medium: str = ""


@dataclass(frozen=True)
class Removed:
    keys: tuple[bytes, ...]
    medium: str = ""


@dataclass(frozen=True)
class Cleared:
    pass


Change = Stored | Removed | Cleared


@dataclass(frozen=True)
class Event:
    sequence_number: int
    epoch: int
    change: Change


class Gone(Exception):
    """The events asked for are no longer kept (or belong to another epoch): resynchronise
    from a snapshot."""


class EventLog:
    """Numbered prefix-cache events of one KV service."""

    def __init__(self, epoch: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.epoch = epoch
        self.last_sequence_number = 0
        self._kept: deque[Event] = deque(maxlen=capacity)
        self._pending: list[Change] = []
        self._subscribers: set[asyncio.Queue] = set()

    # --- what the prefix cache reports -------------------------------------------------

    def stored(self, key: bytes, parent_key: bytes, namespace: str | None, token_bytes: bytes) -> None:
        last = self._pending[-1] if self._pending else None
        tokens = unpack_token_ids(token_bytes)
        if isinstance(last, Stored) and not last.medium and last.keys[-1] == parent_key and last.namespace == namespace:
            self._pending[-1] = Stored((*last.keys, key), last.parent_key, last.token_ids + tokens, namespace)
        else:
            self._pending.append(Stored((key,), parent_key, tokens, namespace))

    def removed(self, key: bytes) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, Removed) and not last.medium:
            self._pending[-1] = Removed((*last.keys, key))
        else:
            self._pending.append(Removed((key,)))

    def cleared(self) -> None:
        self._pending = [Cleared()]  # what came before it in this operation is moot

    # --- what the KV tier reports (kvcache_svc/core/tier.py `TierListener`) -------------

    def tier_stored(self, key: bytes, medium: str) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, Stored) and last.medium == medium:
            self._pending[-1] = Stored((*last.keys, key), b"", (), None, medium)
        else:
            self._pending.append(Stored((key,), b"", (), None, medium))

    def tier_removed(self, key: bytes, medium: str) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, Removed) and last.medium == medium:
            self._pending[-1] = Removed((*last.keys, key), medium)
        else:
            self._pending.append(Removed((key,), medium))

    # --- numbering and delivery --------------------------------------------------------

    def flush(self) -> list[Event]:
        """Number what the last operation did and deliver it."""
        if not self._pending:
            return []
        events = []
        for change in self._pending:
            self.last_sequence_number += 1
            events.append(Event(self.last_sequence_number, self.epoch, change))
        self._pending = []
        self._kept.extend(events)
        for queue in list(self._subscribers):
            if queue.qsize() + len(events) >= queue.maxsize:  # (a slot is always left for the None)
                log.warning(
                    "a KV-event subscriber fell %d events behind: cut off (it resumes or resnapshots)", queue.qsize()
                )
                self._subscribers.discard(queue)
                queue.put_nowait(None)
                continue
            for event in events:
                queue.put_nowait(event)
        return events

    def since(self, after: int, epoch: int = 0) -> list[Event]:
        """The kept events numbered above `after` (0: all kept). Gone when some of them are
        not kept any more, or `epoch` (when given) is not this log's."""
        if epoch and epoch != self.epoch:
            raise Gone(
                f"epoch {epoch} is over (this KV service's epoch is {self.epoch}): resynchronise from EventsSnapshot"
            )
        if after > self.last_sequence_number:
            raise Gone(
                f"sequence number {after} is ahead of this KV service's last, {self.last_sequence_number} "
                f"(epoch {self.epoch}): resynchronise from EventsSnapshot"
            )
        oldest = self._kept[0].sequence_number if self._kept else self.last_sequence_number + 1
        if after and after + 1 < oldest:
            raise Gone(
                f"events after {after} are no longer kept (the oldest kept is {oldest}): resynchronise "
                "from EventsSnapshot"
            )
        return [e for e in self._kept if e.sequence_number > after]

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE) -> asyncio.Queue:
        """A queue of every event flushed from now on; None in it means cut off (too slow)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)


def chains(entries: Iterable) -> list[Stored]:
    """Cached blocks (`CachedBlock`s) as `Stored` changes, one block each (a snapshot)."""
    return [Stored((e.key,), e.parent_key, unpack_token_ids(e.token_bytes), e.namespace) for e in entries]
