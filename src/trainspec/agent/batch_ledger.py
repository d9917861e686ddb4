"""The batches this agent has taken, by (run, rank, batch id), so a re-sent batch is stored once.

A rank that gets no clear answer for a batch (its read timed out, the connection dropped, or
the agent answered 504 because the commit was still running) cannot know whether the batch
was stored. It sends it again later under the same `X-Trainspec-Batch` id; the agent finds
the id here and answers from that batch's own commit instead of storing it a second time.
Idempotency keys as HTTP APIs use them (the IETF draft "The Idempotency-Key HTTP Header
Field"); the ledger is bounded (the most recent `capacity` ids) and in memory, so an agent
that restarted between the two sends stores the batch again: at-least-once, as documented.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from trainspec.agent.writer import Ticket

BatchKey = tuple[str, int, str]  # run id, rank, batch id
CAPACITY = 65_536  # a 64-rank node flushing every 2 s: about 35 minutes of ids


def fingerprint(body: bytes) -> bytes:
    """What tells a re-send from another batch under a reused id."""
    return hashlib.blake2b(body, digest_size=16).digest()


class BatchLedger:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._tickets: OrderedDict[BatchKey, tuple[Ticket, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: BatchKey, body_print: bytes) -> Ticket | None:
        """The live ticket of an earlier send of this batch: queued, committing or stored.
        None when there was none, or when it was withdrawn or its commit failed (then the
        batch was not stored, and this send stores it). ValueError when the id was used
        for another body: the sender reused an id, and neither batch may be dropped."""
        with self._lock:
            entry = self._tickets.get(key)
            if entry is None:
                return None
            ticket, earlier_print = entry
            if ticket.withdrawn or (ticket.cycle.done.is_set() and ticket.cycle.error):
                del self._tickets[key]
                return None
            if earlier_print != body_print:
                raise ValueError("this batch id was used for another body")
            return ticket

    def remember(self, key: BatchKey, ticket: Ticket, body_print: bytes) -> None:
        with self._lock:
            self._tickets[key] = (ticket, body_print)
            self._tickets.move_to_end(key)
            while len(self._tickets) > self.capacity:
                self._tickets.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tickets)
