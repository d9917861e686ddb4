"""What arrives from ranks: OTLP/HTTP metrics and framed Arrow batches, checked before use.

Every refusal is a `Rejected(status, reason)` (4xx: the sender's fault; 503: ours, retry
or write locally) and is counted by reason in `IngestCounters`, so garbage, truncated,
oversized or mislabelled bodies cost one counter increment and never a crash. Bodies are
limited before and after gzip decompression (a small gzip bomb cannot grow past the limit).
A raw batch is checked whole before any of it is stored: its rank header is a rank, every
row is that rank's, and every event's JSON columns hold objects.
"""

from __future__ import annotations

import json
import math
import threading
import zlib
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from trainspec.collector.sinks.agent import BATCH_CONTENT_TYPE, BatchFormatError, decode_tables
from trainspec.schema.targets import Point, TargetError, decode_otlp
from trainspec.schema.targets.otlp import JSON_TYPES, PROTOBUF_TYPES
from trainspec.schema.targets.points import RANK_ATTR


class Rejected(Exception):
    """A request the agent refuses: the HTTP status and a one-line reason."""

    def __init__(self, status: int, reason: str, counter: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.counter = counter


@dataclass
class IngestCounters:
    """Accepted requests and points, and refusals by reason (exported on /metrics)."""

    accepted_requests: Counter = field(default_factory=Counter)  # by path kind
    accepted_points: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)  # by reason
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def accept(self, kind: str, points: int) -> None:
        with self._lock:
            self.accepted_requests[kind] += 1
            self.accepted_points[kind] += points

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                "accepted_requests": dict(self.accepted_requests),
                "accepted_points": dict(self.accepted_points),
                "rejected": dict(self.rejected),
            }


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body without its Content-Encoding, never longer than `limit` bytes. A gzip body
    may hold several members, one after another (RFC 1952 2.2, as `gzip.decompress` reads
    it): each is inflated and the results joined. Anything after a member that is not a
    whole member (trailing garbage, a cut-off member) is refused, never ignored."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc != "gzip":
        raise Rejected(415, f"Content-Encoding {enc!r} is not supported (gzip only)", "encoding")
    parts: list[bytes] = []
    size, rest, member = 0, body, 0
    while rest or member == 0:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out = inflater.decompress(rest, limit + 1 - size)
        except zlib.error as exc:
            where = "gzip body" if member == 0 else f"data after gzip member {member}"
            raise Rejected(400, f"{where} does not inflate: {exc}", "gzip") from exc
        size += len(out)
        if size > limit or inflater.unconsumed_tail:
            raise Rejected(413, f"body inflates past {limit} bytes", "too_large")
        if not inflater.eof:
            raise Rejected(400, "gzip body is truncated", "gzip")
        parts.append(out)
        rest, member = inflater.unused_data, member + 1
    return b"".join(parts)


def decode_metrics(body: bytes, content_type: str | None) -> list[Point]:
    """An OTLP metrics request (protobuf or JSON) as points; Rejected if it is not one."""
    mt = media_type(content_type)
    if mt not in JSON_TYPES and mt not in PROTOBUF_TYPES:
        raise Rejected(
            415, f"Content-Type {mt or 'missing'!r}: OTLP is protobuf or JSON", "content_type"
        )
    if not body:
        raise Rejected(400, "empty body", "empty")
    try:
        return decode_otlp(body, mt)
    except TargetError as exc:
        raise Rejected(400, str(exc), "otlp_decode") from exc
    except Exception as exc:  # protobuf raises more than DecodeError on hostile input
        raise Rejected(400, f"not an OTLP request: {type(exc).__name__}", "otlp_decode") from exc


def decode_batch(body: bytes, content_type: str | None) -> dict[str, pa.Table]:
    """A rank's framed Arrow batch; Rejected if it is not one."""
    mt = media_type(content_type)
    if mt != BATCH_CONTENT_TYPE:
        raise Rejected(415, f"Content-Type {mt or 'missing'!r}: expected {BATCH_CONTENT_TYPE}",
                       "content_type")  # fmt: skip
    try:
        return decode_tables(body)
    except BatchFormatError as exc:
        raise Rejected(400, f"not a trainspec batch: {exc}", "batch_decode") from exc


MAX_RANK = 2**31  # ranks are int32 in the store


def check_otlp_ranks(points: list[Point]) -> None:
    """Rejected (400, `otlp_rank`) where a point's `trainspec.rank` is present but no rank:
    outside [0, 2**31), or not a whole number at all (0.5, NaN, infinity, true, "abc").
    int() had read 0.5 as rank 0 and true as rank 1, and raised on infinity (a 500)."""
    for p in points:
        raw = p.attribute(RANK_ATTR)
        if raw is None:
            continue
        rank = p.rank
        if rank is None:
            raise Rejected(400, f"trainspec.rank {raw!r} is not a whole number",
                           "otlp_rank")  # fmt: skip
        if not 0 <= rank < MAX_RANK:
            raise Rejected(400, f"trainspec.rank {rank} is not a rank in [0, 2**31)",
                           "otlp_rank")  # fmt: skip


def parse_rank(header: str | None) -> int:
    """The `X-Trainspec-Rank` header as a rank, 0 <= rank < 2**31; Rejected if it is not."""
    text = (header or "").strip()
    if not (text.isascii() and text.isdigit()) or int(text) >= MAX_RANK:
        raise Rejected(400, f"X-Trainspec-Rank {text!r} is not a rank in [0, 2**31)",
                       "batch_headers")  # fmt: skip
    return int(text)


BATCH_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


MAX_SERVICE = 128  # characters of an X-Trainspec-Service header that are kept


def parse_service(text: str | None) -> str | None:
    """The `X-Trainspec-Service` header (the rank's service.name), or None when absent or
    not 1-128 printable characters: a label, never a reason to refuse a batch."""
    if not text or len(text) > MAX_SERVICE or not text.isprintable():
        return None
    return text


def parse_batch_id(header: str | None) -> str | None:
    """The `X-Trainspec-Batch` header (1-64 of [A-Za-z0-9._-]), or None when absent."""
    if header is None:
        return None
    text = header.strip()
    if not 0 < len(text) <= 64 or not set(text) <= BATCH_ID_CHARS:
        raise Rejected(400, f"X-Trainspec-Batch {text[:80]!r} is not 1-64 of [A-Za-z0-9._-]",
                       "batch_headers")  # fmt: skip
    return text


def parse_deadline(header: str | None) -> float | None:
    """The `X-Trainspec-Deadline` header (unix seconds the sender waits until), or None."""
    if header is None:
        return None
    try:
        deadline = float(header.strip())
    except ValueError:
        deadline = math.nan
    if not math.isfinite(deadline):
        raise Rejected(400, f"X-Trainspec-Deadline {header[:40]!r} is not a unix time",
                       "batch_headers")  # fmt: skip
    return deadline


def check_batch(tables: dict[str, pa.Table], rank: int) -> None:
    """Rejected unless every row is `rank`'s and every event's JSON columns are objects."""
    for name, table in tables.items():
        column = table.column("rank")
        wrong = pc.filter(column, pc.invert(pc.fill_null(pc.equal(column, rank), False)))
        if len(wrong):
            raise Rejected(400, f"{name} row has rank {wrong[0].as_py()} but X-Trainspec-Rank "
                           f"is {rank}", "rank_mismatch")  # fmt: skip
    if "events" in tables:
        for i, row in enumerate(tables["events"].to_pylist()):
            for key in ("evidence", "before", "after"):
                if not _is_object_or_empty(row[key]):
                    raise Rejected(400, f"event {i} ({row['kind']}/{row['name']}, step "
                                   f"{row['step']}): {key} is not a JSON object",
                                   "event_json")  # fmt: skip


def _is_object_or_empty(text: str | None) -> bool:
    if not text:
        return True
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False
