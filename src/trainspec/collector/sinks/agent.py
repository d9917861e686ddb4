"""AgentSink: a rank's raw batches to its node's trainspec-agent, falling back to its own store.

Sidecar mode. The store needs raw 50 ms samples, step rows and events, not aggregates, so a
batch travels whole in the store's own Arrow schemas: `POST /v1/trainspec/batches` with
`Content-Type: application/vnd.trainspec.batch` = one frame per table (samples, steps,
events, runs), each a 4-byte little-endian length then an Arrow IPC stream, LZ4-compressed
(length 0 = no rows). No per-point Python objects on either side, which is what lets one agent core keep up
with a node of ranks (bench/ingest.py). The run and rank travel in `X-Trainspec-Run-Id` and
`X-Trainspec-Rank` headers, and the devices this process sees (CUDA_VISIBLE_DEVICES,
NVIDIA_VISIBLE_DEVICES, when set) in `X-Trainspec-Cuda-Visible-Devices` and
`X-Trainspec-Nvidia-Visible-Devices`, so the agent stores its own GPU's readings as its rows
(agent/gpu_owners.py). The bearer token (`TRAINSPEC_AGENT_TOKEN`) is read by
`otlp_auth.bearer_token`: a trailing newline dropped, one no header can carry a ValueError
naming the setting; a header the HTTP client refuses is logged by name, never by value.

The agent answers 200 only once the batch is in a renamed segment (group commit), so an
acknowledged batch is durable, and 503 or 4xx only for a batch it has not stored and never
will: that batch goes to this rank's own segments (writer `rank-N`, as in embedded mode), as
does every batch while the agent refuses connections. Training never waits on or loses data
to a dead agent. After a failure the agent is tried again every `retry_after_s`, so a
restarted agent picks up.

Each batch carries an id (`X-Trainspec-Batch`: this sink's prefix and a sequence number). A
batch whose outcome is unknown (the read timed out, the connection dropped after the request
went out, or the agent answered 504/500) is neither stored here nor dropped: it is held
(at most `MAX_UNSETTLED`) and sent again under the same id when the agent is next tried, and
the agent, which remembers the ids it took (agent/batch_ledger.py), answers from the first
send's commit instead of storing it twice. A held batch the agent never answers again goes to
this rank's segments at close. The duplicate window left is an agent that stored a batch and
then died or restarted before it answered (at-least-once).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from trainspec.collector.records import Batch
from trainspec.collector.sink import Sink
from trainspec.collector.sinks.otlp_auth import TOKEN_ENV, bearer_token, env_token
from trainspec.collector.sinks.store import SegmentMerger
from trainspec.store import SegmentWriter
from trainspec.store.errors import first_line
from trainspec.store.tables import TABLES

log = logging.getLogger("trainspec.collector")

BATCH_PATH = "/v1/trainspec/batches"
BATCH_CONTENT_TYPE = "application/vnd.trainspec.batch"
FRAME_TABLES = ("samples", "steps", "events", "runs")
_LEN = struct.Struct("<I")
# LZ4 frames: about 10 bytes a reading instead of 72 (metric names and attributes repeat),
# for well under a microsecond a reading on either side (bench/ingest.py).
_IPC_OPTIONS = ipc.IpcWriteOptions(compression="lz4")


MAX_UNSETTLED = 16  # batches of unknown outcome held for a re-send; beyond, the oldest is
# written to this rank's segments (a possible duplicate, logged)
_UNKNOWN_STATUSES = {500, 504}  # answers after which the batch may or may not be stored


MAX_ANSWER_BYTES = 64 << 10  # the agent's answers are a line of JSON


class _Exchange:
    """One request and its answer, and whether its deadline cut it: decided under a lock, so
    a deadline that fires as the answer completes either cuts it or does nothing."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.finished = False
        self.cut = False

    def overran(self) -> None:
        """The deadline: end the exchange, unless it finished; the blocked read fails."""
        with self.lock:
            if self.finished:
                return
            self.cut = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def finish(self) -> bool:
        """Mark it finished; whether the deadline had cut it."""
        with self.lock:
            self.finished = True
            return self.cut


VISIBLE_DEVICE_HEADERS = {
    "CUDA_VISIBLE_DEVICES": "X-Trainspec-Cuda-Visible-Devices",
    "NVIDIA_VISIBLE_DEVICES": "X-Trainspec-Nvidia-Visible-Devices",
}


def _header_safe(value: str) -> bool:
    return len(value) <= 4096 and all(" " <= ch <= "~" for ch in value)


# Where each header's value comes from, for a refusal that must not quote the value.
_HEADER_SOURCES = {
    "Authorization": TOKEN_ENV,
    "X-Trainspec-Service": "service.name",
    "X-Trainspec-Run-Id": "the run id",
}


def _header_trouble(headers: dict[str, str]) -> str:
    """Which header http.client refused, and what to check; never its value."""
    for name, value in headers.items():
        if not _header_safe(value):
            return f"invalid {name} header (check {_HEADER_SOURCES.get(name, name)})"
    return "a header the HTTP client refuses"


def _is_acknowledgement(answer: bytes) -> bool:
    """The agent's 200 is a JSON object with the rows it stored."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("rows"), int)


# A day, as config_rules.SECONDS_MAX (the collector does not import config): a wait past
# threading.TIMEOUT_MAX raises OverflowError.
LONGEST_WAIT_S = 86_400.0


class _OutcomeUnknown(OSError):
    """The request went out and no clear answer came back: the batch may be stored."""


class BatchFormatError(ValueError):
    """A batch body is not the framed Arrow encoding; the message says what was wrong."""


def encode_tables(tables: dict[str, pa.Table]) -> bytes:
    """Frame the given tables (missing ones are empty) into one request body."""
    out = io.BytesIO()
    for name in FRAME_TABLES:
        table = tables.get(name)
        if table is None or table.num_rows == 0:
            out.write(_LEN.pack(0))
            continue
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, table.schema, options=_IPC_OPTIONS) as writer:
            writer.write_table(table)
        data = sink.getvalue().to_pybytes()
        out.write(_LEN.pack(len(data)))
        out.write(data)
    return out.getvalue()


def decode_tables(body: bytes) -> dict[str, pa.Table]:
    """The tables of a framed body, cast to the store's schemas; BatchFormatError if not one."""
    tables: dict[str, pa.Table] = {}
    pos = 0
    for name in FRAME_TABLES:
        if pos + 4 > len(body):
            raise BatchFormatError(f"truncated before the {name} frame")
        (n,) = _LEN.unpack_from(body, pos)
        pos += 4
        if n == 0:
            continue
        if pos + n > len(body):
            raise BatchFormatError(f"{name} frame says {n} bytes, {len(body) - pos} remain")
        try:
            table = ipc.open_stream(pa.py_buffer(body[pos : pos + n])).read_all()
            table.validate(full=True)  # offsets and lengths checked before any column is read
            table = table.select(TABLES[name].names).cast(TABLES[name])
        except (pa.ArrowException, KeyError, ValueError) as exc:
            raise BatchFormatError(f"{name} frame: {first_line(exc)[:200]}") from exc
        tables[name] = table
        pos += n
    if pos != len(body):
        raise BatchFormatError(f"{len(body) - pos} trailing bytes after the last frame")
    return tables


def batch_tables(batch: Batch) -> dict[str, pa.Table]:
    tables = {"samples": batch.samples}
    if batch.steps:
        tables["steps"] = batch.steps_table()
    if batch.events:
        tables["events"] = batch.events_table()
    return tables


def agent_endpoint(configured: str, environ: dict[str, str] | None = None) -> str:
    """Where the agent listens: the configured URL, else the standard OTLP endpoint variable."""
    env = os.environ if environ is None else environ
    return configured or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "") or "http://127.0.0.1:4318"


class AgentSink(Sink):
    """Sends each batch to the agent; on any failure writes it to this rank's own store."""

    name = "agent"
    durable = True

    def __init__(
        self,
        endpoint: str,
        *,
        run_id: str,
        rank: int,
        run_dir: str | Path,
        writer: str,
        fanout: int = 16,
        timeout_s: float = 5.0,
        retry_after_s: float = 10.0,
        token: str | None = None,
        service: str = "trainspec",
    ) -> None:
        """`service`: the rank's `service.name`, for the agent's /metrics labels."""
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"agent endpoint {endpoint!r} is not an http://host:port URL")
        self.host, self.port = url.hostname, url.port or 4318
        for name, value in (("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if not 0 <= value <= LONGEST_WAIT_S:  # a wait past that raises OverflowError
                raise ValueError(f"agent {name} {value!r} is not in 0..{LONGEST_WAIT_S:g} s")
        self.run_id, self.rank, self.service = run_id, rank, service
        self.run_dir, self.writer, self.fanout = Path(run_dir), writer, fanout
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        # Surrounding whitespace dropped (a token file's newline); a token no header can carry
        # is a ValueError naming the setting, and the rank writes its own store.
        self.token = bearer_token(token, "token") if token is not None else env_token()
        # The devices this process sees, so the agent gives it its own GPU's readings
        # (agent/gpu_owners.py); sent only when set, and only as header-safe text.
        self._devices = {
            header: os.environ[name]
            for name, header in VISIBLE_DEVICE_HEADERS.items()
            if name in os.environ and _header_safe(os.environ[name])
        }
        self.fallback: dict[str, SegmentWriter] | None = None  # this rank's own segments
        self.sent_batches = 0
        self.fallback_batches = 0
        self._merger = SegmentMerger()  # the fallback segments' merges
        self.resent_batches = 0
        self._id_prefix = f"{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        self._sequence = 0
        self._unsettled: deque[tuple[str, bytes, dict[str, pa.Table]]] = deque()
        # The flush thread writes; a SIGTERM's flush on the main thread, or close() after a
        # flush thread that outlived its join, may write at the same time.
        self._lock = threading.Lock()
        self._run_row: pa.Table | None = None
        self._down_since: float | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False

    # -- delivery ----------------------------------------------------------------------
    def _post(self, body: bytes, batch_id: str) -> None:
        """Deliver one batch: returns on 200. `_OutcomeUnknown` when it may have been stored,
        another OSError or HTTPException when it surely was not."""
        headers = {
            "Content-Type": BATCH_CONTENT_TYPE,
            "X-Trainspec-Run-Id": self.run_id,
            "X-Trainspec-Rank": str(self.rank),
            "X-Trainspec-Service": self.service,
            "X-Trainspec-Batch": batch_id,
            # The agent refuses the batch, unstored, if it reads it only after this (it was
            # stopped meanwhile): by then this rank has written it itself.
            "X-Trainspec-Deadline": f"{time.time() + self.timeout_s:.3f}",
        }
        headers.update(self._devices)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        conn = self._conn
        # `timeout` bounds each socket operation; an agent that trickles a byte a second
        # would hold the flush thread (and close) for ever. This bounds the whole exchange.
        exchange = _Exchange(conn)
        watchdog = threading.Timer(self.timeout_s, exchange.overran)
        watchdog.daemon = True
        watchdog.start()
        failure: BaseException | None = None
        try:
            try:
                conn.request("POST", BATCH_PATH, body=body, headers=headers)
            except (OSError, http.client.HTTPException):
                exchange.finish()
                self._drop_connection()
                raise  # not sent whole: the agent refuses a partial body
            except ValueError:  # http.client's message quotes the value: the token, maybe
                exchange.finish()
                self._drop_connection()
                raise OSError(_header_trouble(headers)) from None
            try:
                resp = conn.getresponse()
                answer = resp.read(MAX_ANSWER_BYTES + 1)
                if not resp.isclosed():  # an answer longer than any the agent gives
                    self._drop_connection()
            except (OSError, http.client.HTTPException) as exc:
                failure = exc
        finally:
            watchdog.cancel()
        if exchange.finish():  # cut: as a timeout (not tried again now); an answer cut short
            self._drop_connection()  # may even have parsed as a 200
            raise _OutcomeUnknown(f"no whole answer in {self.timeout_s:g} s") from TimeoutError(
                f"the exchange overran {self.timeout_s:g} s"
            )
        if failure is not None:
            self._drop_connection()
            raise _OutcomeUnknown(f"no answer: {type(failure).__name__}: {failure}") from failure
        # One line: the agent's answer ends in a newline, which split the warning in two.
        detail = " ".join(answer[:200].decode(errors="replace").split())
        if resp.status in (401, 403):
            detail += (
                " (the agent refuses this rank's token: TRAINSPEC_AGENT_TOKEN)" if self.token
                else " (the agent wants a token: TRAINSPEC_AGENT_TOKEN)"
            )  # fmt: skip
        if resp.status == 200:
            if not _is_acknowledgement(answer):  # not the agent's own answer: not known stored
                raise _OutcomeUnknown(f"a 200 that is not the agent's answer: {detail!r}")
            return
        if resp.status in _UNKNOWN_STATUSES:
            raise _OutcomeUnknown(f"agent answered {resp.status}: {detail}")
        raise OSError(f"agent answered {resp.status}: {detail}")

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _send(self, body: bytes, batch_id: str) -> None:
        """`_post`, once more on a fresh connection when the first dropped without an answer
        (a keep-alive connection the agent had closed looks the same)."""
        try:
            self._post(body, batch_id)
        except _OutcomeUnknown as exc:
            if isinstance(exc.__cause__, TimeoutError) or self._conn is not None:
                raise  # a timeout, or an answer (504/500): a second try would only wait again
            self._post(body, batch_id)

    def _agent_usable(self) -> bool:
        if self._down_since is None:
            return True
        return time.monotonic() - self._down_since >= self.retry_after_s

    def _mark_down(self, exc: Exception) -> None:
        if self._down_since is None:
            log.warning(
                "trainspec: agent at %s:%d unavailable (%s); writing this rank's own "
                "segments until it is back",
                self.host,
                self.port,
                exc,
            )
        self._down_since = time.monotonic()

    def _settle_held(self) -> bool:
        """Send the held batches again, oldest first; False if the agent failed meanwhile."""
        while self._unsettled:
            batch_id, body, tables = self._unsettled[0]
            try:
                self._send(body, batch_id)
            except _OutcomeUnknown as exc:
                self._mark_down(exc)
                return False
            except Exception as exc:  # refused, or failed before sending (OverflowError)
                self._unsettled.popleft()
                self._write_fallback(tables)  # surely not stored there
                self._mark_down(exc)
                return False
            self._unsettled.popleft()
            self.resent_batches += 1
        return True

    def _hold(self, batch_id: str, body: bytes, tables: dict[str, pa.Table]) -> None:
        self._unsettled.append((batch_id, body, tables))
        while len(self._unsettled) > MAX_UNSETTLED:
            old_id, _, old_tables = self._unsettled.popleft()
            log.warning("trainspec: batch %s of unknown outcome written here too (the agent "
                        "may hold it as well)", old_id)  # fmt: skip
            self._write_fallback(old_tables)

    def _deliver(self, tables: dict[str, pa.Table]) -> None:
        with self._lock:
            tables = self._with_run_row(tables)
            if self._closed:  # a write racing close(): the rank's own segments, as at close
                self._write_fallback(tables)
                return
            self._deliver_locked(tables)

    def _deliver_locked(self, tables: dict[str, pa.Table]) -> None:
        self._sequence += 1
        batch_id = f"{self._id_prefix}-{self._sequence}"
        if not self._agent_usable() or not self._settle_held():
            self._write_fallback(tables)
            return
        body = encode_tables(tables)
        try:
            self._send(body, batch_id)
        except _OutcomeUnknown as exc:
            self._hold(batch_id, body, tables)
            self._mark_down(exc)
            return
        except Exception as exc:  # refused, or failed before sending: this rank keeps it
            self._mark_down(exc)
            self._write_fallback(tables)
            return
        if self._down_since is not None:
            log.warning("trainspec: agent at %s:%d is back", self.host, self.port)
        self._down_since = None
        self.sent_batches += 1

    def _write_fallback(self, tables: dict[str, pa.Table]) -> None:
        if self.fallback is None:
            self.fallback = {
                name: SegmentWriter(self.run_dir, name, self.writer, fanout=self.fanout)
                for name in FRAME_TABLES
            }
        self.fallback_batches += 1
        for name, table in tables.items():
            self.fallback[name].write(table)
        self._merger.merge(self.fallback[name] for name in tables)

    # -- Sink ----------------------------------------------------------------------------
    def write_run_row(self, row: pa.Table) -> None:
        """The run's metadata row: it goes with the first batch (or at close), from the flush
        thread. Sent from here it made `trainspec.init` wait on a slow agent."""
        with self._lock:
            self._run_row = row

    def write(self, batch: Batch) -> None:
        if batch.is_empty():
            return
        self._deliver(batch_tables(batch))

    def _with_run_row(self, tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
        row, self._run_row = self._run_row, None
        return tables if row is None else {**tables, "runs": row}

    def close(self, *, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._closed:
            return
        if self._run_row is not None:  # no batch ever went: the run row goes alone
            self._deliver_locked(self._with_run_row({}))
        self._closed = True
        if self._unsettled:
            self._down_since = None  # one last try for what is held, whatever the schedule
            self._settle_held()
            for batch_id, _, tables in self._unsettled:  # the agent never answered again
                log.warning("trainspec: batch %s of unknown outcome written here too (the "
                            "agent may hold it as well)", batch_id)  # fmt: skip
                self._write_fallback(tables)
            self._unsettled.clear()
        self._drop_connection()
        self.fallback = None  # a write racing close gets writers of its own
