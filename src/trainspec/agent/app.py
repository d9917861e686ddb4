"""The agent assembled: node sampler, ingest, store writer, exposition, forwarder, control.

`Agent(settings).start()` binds the port, starts the threads and returns; `close()` stops
them (idempotent) and commits what is pending. Routes:

    POST /v1/metrics              OTLP/HTTP (protobuf, JSON, gzip) -> /metrics, upstream
    POST /v1/trainspec/batches    a rank's raw batch (framed Arrow) -> run store, /metrics
    GET  /metrics                 Prometheus exposition of every source and the agent
    POST /v1/actions, GET /v1/actions?after=N&run_id=R, GET /v1/status, /healthz, /readyz

/readyz answers 503 while a store commit failed within the last `FAILURE_WINDOW_S` seconds
(agent/writer.py), and 200 again once commits have gone that long without failing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from trainspec.agent.batch_ledger import BatchLedger, fingerprint
from trainspec.agent.control import ActionLog, BadAction, parse_action
from trainspec.agent.exposition import NODE, Exposition, SeriesBook
from trainspec.agent.forward import Forwarder
from trainspec.agent.gpu_owners import GpuOwners
from trainspec.agent.ingest import (
    IngestCounters,
    Rejected,
    check_batch,
    check_otlp_ranks,
    decode_batch,
    decode_metrics,
    decompress,
    media_type,
    parse_batch_id,
    parse_deadline,
    parse_rank,
    parse_service,
)
from trainspec.agent.metrics_feed import MetricsFeed
from trainspec.agent.node import NodeSampler, local_ranks_in_store, run_row_in_store
from trainspec.agent.otlp_sources import otlp_sources
from trainspec.agent.server import Request, Response, make_server, serve
from trainspec.agent.settings import AgentSettings
from trainspec.agent.writer import Overloaded, StoreWriter, Ticket
from trainspec.collector.records import Batch
from trainspec.collector.sinks.agent import VISIBLE_DEVICE_HEADERS
from trainspec.schema import load_catalogue
from trainspec.store.layout import check_run_id

log = logging.getLogger("trainspec.agent")
# A batch whose commit has not started this long after it arrived is withdrawn and answered
# 503 (not stored: the rank writes it itself). One whose commit has started is waited for up
# to COMMIT_FINISH_S more, then answered 504 (outcome unknown: the rank re-sends it by id).
COMMIT_WAIT_S = 3.0
COMMIT_FINISH_S = 30.0
# A rank's X-Trainspec-Deadline is its clock (the same node's): a batch read after it, plus
# this grace for clocks a little apart, is refused unstored; one still queued this long
# before it is withdrawn, so the 503 reaches the rank while it waits.
DEADLINE_GRACE_S = 1.0
DEADLINE_MARGIN_S = 0.25
# A queued batch's commit starts this long before it would be withdrawn, whatever the commit
# interval: a commit_interval_s longer than the ranks' timeout must not refuse their batches.
COMMIT_LEAD_S = 0.75
# How often the `runs` rows on disk are read again for a rank whose local rank is not known
# (this agent restarted, or started after the job): its GPU readings wait for it.
RECOVER_EVERY_S = 5.0
# Rows queued for /metrics (agent/metrics_feed.py) beyond which a batch is not shown there,
# and how long a scrape waits for the batches answered before it.
FEED_ROWS = 4_000_000
FEED_WAIT_S = 5.0
# At shutdown, how long request threads may take to send the answers of the final commit.
DRAIN_S = 5.0


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.node_id = settings.node
        self.catalogue = load_catalogue()
        self.counters = IngestCounters()
        self.book = SeriesBook(
            self.catalogue,
            max_series=settings.metrics_max_series,
            ttl_s=settings.metrics_series_ttl_s,
        )
        self.feed = MetricsFeed(max_rows=FEED_ROWS)
        self.actions = ActionLog()
        self.store = StoreWriter(
            settings.store,
            self.node_id,
            commit_interval_s=settings.commit_interval_s,
            pending_rows=settings.pending_rows,
        )
        self.batches = BatchLedger()
        self.forwarder = (
            Forwarder(settings.upstream, capacity=settings.forward_buffer)
            if settings.upstream
            else None
        )
        self.node = NodeSampler(
            self._on_node_batch, interval_s=settings.node_interval_s, nvml=settings.nvml
        )
        self.exposition = Exposition(self.book, self.status)
        self._node_resource = {"host.name": self.node_id, "service.name": "trainspec-agent"}
        # The node's GPU readings go to the ranks that own them (agent/gpu_owners.py), from
        # the devices each rank reports and its `runs` row (request threads write, the node
        # thread reads).
        self.gpus = GpuOwners()
        self._ranks_lock = threading.Lock()
        # (run, rank) -> the resource attributes of its /metrics series beyond run and rank:
        # service.name (its header), local rank and world size (its `runs` row).
        self._rank_resource: dict[tuple[str, int], dict[str, Any]] = {}
        self._recover_after: dict[str, float] = {}  # run -> monotonic time of the next read
        self._resource_read: set[tuple[str, int]] = set()  # ranks whose row was looked up
        self._arrow_sources: set[tuple[str, int]] = set()
        self._started = time.time()
        self._ready = threading.Event()
        self._closed = False
        self._feed_failed = False  # logged once; counted every time
        self.server = make_server(
            settings.host,
            settings.port,
            self._routes(),
            token=settings.resolved_token(),
            max_body_bytes=settings.max_body_bytes,
            counters=self.counters,
        )
        self.port = self.server.server_address[1]

    def _routes(self) -> dict[tuple[str, str], Any]:
        return {
            ("POST", "/v1/metrics"): self.ingest_otlp,
            ("POST", "/v1/trainspec/batches"): self.ingest_batch,
            ("GET", "/metrics"): self.metrics,
            ("POST", "/v1/actions"): self.post_action,
            ("GET", "/v1/actions"): self.get_actions,
            ("GET", "/v1/status"): lambda req: Response.json(self.status()),
            ("GET", "/healthz"): lambda req: Response.json({"status": "ok"}),
            ("GET", "/readyz"): self.readyz,
        }

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> Agent:
        self.store.start()
        self.feed.start()
        if self.forwarder is not None:
            self.forwarder.start()
        self.node.start()
        serve(self.server)
        self._ready.set()
        log.debug("trainspec-agent: listening on %s, store %s",
                  self.settings.address(self.port), self.settings.store)  # fmt: skip
        return self

    def close(self, *, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._ready.clear()
        self.server.shutdown()
        self.server.server_close()
        self.node.close(timeout_s=timeout_s)
        self.feed.close(timeout_s=timeout_s)
        if self.forwarder is not None:
            self.forwarder.close(timeout_s=timeout_s)
        self.store.close(timeout_s=timeout_s)
        # The final commit released its waiters; let them answer before the process exits
        # (its request threads are daemons), or their ranks would write those batches again.
        if not self.server.drain(DRAIN_S):
            log.warning("trainspec-agent: requests still unanswered after %g s at shutdown",
                        DRAIN_S)  # fmt: skip

    # -- ingest --------------------------------------------------------------------------
    def _body(self, req: Request) -> bytes:
        return decompress(
            req.body, req.headers.get("Content-Encoding"), self.settings.max_body_bytes
        )

    def ingest_otlp(self, req: Request) -> Response:
        body = self._body(req)
        ctype = req.headers.get("Content-Type") or ""
        points = decode_metrics(body, ctype)
        check_otlp_ranks(points)  # before it is counted or forwarded: refused means refused
        self.counters.accept("otlp", len(points))
        if self.forwarder is not None:
            self.forwarder.offer(body, media_type(ctype))
        # OTLP points are aggregates: they feed /metrics only for sources that do not send
        # raw batches (those already feed it exactly), and never the raw store.
        self._apply_otlp(points)
        if media_type(ctype) == "application/json":
            return Response.json({})
        return Response(200, b"", "application/x-protobuf")

    def _apply_otlp(self, points: list[Any]) -> None:
        for key, resource, batch in otlp_sources(points, self.catalogue, self._arrow_sources):
            self.book.apply_batch(key, resource, batch)

    def ingest_batch(self, req: Request) -> Response:
        try:
            run_id = check_run_id(req.headers.get("X-Trainspec-Run-Id") or "")
        except ValueError as exc:
            raise Rejected(400, f"X-Trainspec-Run-Id: {exc}", "batch_headers") from exc
        rank = parse_rank(req.headers.get("X-Trainspec-Rank"))
        batch_id = parse_batch_id(req.headers.get("X-Trainspec-Batch"))
        deadline = parse_deadline(req.headers.get("X-Trainspec-Deadline"))
        body = self._body(req)
        tables = decode_batch(body, req.headers.get("Content-Type"))
        check_batch(tables, rank)  # the whole batch, before any of it is stored
        if deadline is not None and time.time() > deadline + DEADLINE_GRACE_S:
            # Queued in the socket while this agent was stopped: the rank gave up on it and
            # wrote it itself, so storing it now would store it twice.
            raise Rejected(503, "arrived after its deadline; not stored", "late")
        points = sum(t.num_rows for t in tables.values())
        key = (run_id, rank, batch_id) if batch_id is not None else None
        body_print = fingerprint(body) if key is not None else b""
        try:
            earlier = self.batches.get(key, body_print) if key is not None else None
        except ValueError as exc:
            raise Rejected(
                422, f"X-Trainspec-Batch {batch_id!r}: {exc}", "batch_id_reused"
            ) from exc
        if earlier is not None:  # sent before, its answer lost: answer from that commit
            self._await_commit(earlier, deadline)
            self.counters.accept("batch_resent", 0)
            return Response.json({"rows": points, "duplicate": True})
        if "runs" in tables:
            tables["runs"] = self._with_inventory(tables["runs"])
            columns = ["rank", "local_rank", "world_size", "device"]
            for row in tables["runs"].select(columns).to_pylist():
                self.gpus.saw_run_row(run_id, row["rank"], row["local_rank"], row["device"])
                with self._ranks_lock:
                    self._rank_resource.setdefault((run_id, row["rank"]), {}).update(
                        _run_row_resource(row)
                    )
        self.gpus.saw_batch(
            run_id,
            rank,
            req.headers.get(VISIBLE_DEVICE_HEADERS["CUDA_VISIBLE_DEVICES"]),
            req.headers.get(VISIBLE_DEVICE_HEADERS["NVIDIA_VISIBLE_DEVICES"]),
        )
        with self._ranks_lock:
            service = parse_service(req.headers.get("X-Trainspec-Service"))
            if service is not None:
                self._rank_resource.setdefault((run_id, rank), {})["service.name"] = service
        commit_by = None
        if deadline is not None:  # the commit starts in time for the answer to reach the rank
            left = deadline - time.time() - DEADLINE_MARGIN_S - COMMIT_LEAD_S
            commit_by = time.monotonic() + left
        try:
            ticket = self.store.submit(run_id, tables, commit_by=commit_by)
        except Overloaded as exc:
            raise Rejected(503, str(exc), "overloaded") from exc
        if key is not None:
            self.batches.remember(key, ticket, body_print)
        self._arrow_sources.add((run_id, rank))
        # /metrics on its own thread: the answer waits for the store alone.
        # A full queue leaves the batch off /metrics (stored all the same: no request
        # refused), counted in `trainspec_agent_series_feed_skipped_batches`.
        self.feed.submit(points, lambda: self._feed_book_best_effort(run_id, rank, tables))
        self._await_commit(ticket, deadline)
        self.counters.accept("batch", points)
        return Response.json({"rows": points})

    def _await_commit(self, ticket: Ticket, deadline: float | None = None) -> None:
        """Return once the ticket's batch is durable. Otherwise Rejected: 503 when it is not
        stored and never will be (withdrawn before its commit began, or the commit failed),
        504 when its commit is still running (the rank re-sends it under the same id). A
        batch is withdrawn by the sender's deadline at the latest, while the sender waits."""
        cycle = ticket.cycle
        # At least two commit cycles: a long commit interval must not withdraw every batch.
        wait_s = max(COMMIT_WAIT_S, 2 * self.settings.commit_interval_s + 0.5)
        if deadline is not None:
            wait_s = max(0.0, min(wait_s, deadline - time.time() - DEADLINE_MARGIN_S))
        if not cycle.done.wait(wait_s):
            if self.store.withdraw(ticket):
                raise Rejected(503, "commit did not start in time; batch not stored",
                               "commit_timeout")  # fmt: skip
            if not cycle.done.wait(COMMIT_FINISH_S):
                raise Rejected(504, "commit still running; re-send this batch by its id",
                               "commit_slow")  # fmt: skip
        if ticket.withdrawn:
            raise Rejected(503, "batch withdrawn before its commit; not stored", "commit_timeout")
        if cycle.error:
            raise Rejected(503, f"commit failed: {cycle.error}", "commit_failed")

    def _feed_book_best_effort(self, run_id: str, rank: int, tables: dict[str, Any]) -> None:
        # /metrics is best effort: the batch is queued for the store, and the store's answer
        # is the one the rank gets. An error here must never turn a stored batch into a
        # failure (the rank would write it again), whatever raised it.
        try:
            self._feed_book(run_id, rank, tables)
        except Exception as exc:
            self.counters.reject("metrics_feed")
            if not self._feed_failed:
                self._feed_failed = True
                log.warning("trainspec-agent: a batch was not shown on /metrics (%s: %s); "
                            "further such batches are counted as rejected.metrics_feed",
                            type(exc).__name__, exc)  # fmt: skip

    def _feed_book(self, run_id: str, rank: int, tables: dict[str, Any]) -> None:
        from trainspec.collector.records import EventRecord, StepRecord

        samples = tables.get("samples")
        steps = [StepRecord(**r) for r in tables["steps"].to_pylist()] if "steps" in tables else []
        events = []
        for r in tables["events"].to_pylist() if "events" in tables else []:
            for key in ("evidence", "before", "after"):
                r[key] = json.loads(r[key]) if r[key] else ({} if key == "evidence" else None)
            events.append(EventRecord(**r))
        if samples is None:
            from trainspec.store.tables import empty_table

            samples = empty_table("samples")
        resource = self._rank_labels(run_id, rank)
        self.book.apply_batch((run_id, rank), resource, Batch(samples, steps, events))

    def _rank_labels(self, run_id: str, rank: int) -> dict[str, Any]:
        """A rank's /metrics resource: run, rank, host and `_resource_of`."""
        return {
            **self._resource_of(run_id, rank),
            "trainspec.run.id": run_id,
            "trainspec.rank": rank,
            "host.name": self.node_id,
        }

    def _resource_of(self, run_id: str, rank: int) -> dict[str, Any]:
        """A rank's resource attributes beyond run, rank and host, for its /metrics series:
        its service name and, from its `runs` row, local rank and world size. An agent that
        never received the row (restarted since) reads it from the store, once."""
        key = (run_id, rank)
        with self._ranks_lock:
            known = dict(self._rank_resource.get(key, {}))
            tried = key in self._resource_read
            self._resource_read.add(key)
        if "trainspec.world_size" not in known and not tried:
            row = run_row_in_store(Path(self.settings.store) / run_id, rank)
            if row is not None:
                with self._ranks_lock:
                    entry = self._rank_resource.setdefault(key, {})
                    for k, v in _run_row_resource(row).items():
                        entry.setdefault(k, v)
                    known = dict(entry)
        return known

    def _with_inventory(self, runs: Any) -> Any:
        """The agent knows the node's GPUs and topology; a rank in sidecar mode does not."""
        inv = self.node.inventory
        if not inv["gpus"]:
            return runs
        gpus = json.dumps([{**g, "topology": inv["topology"]} for g in inv["gpus"]])
        column = pa.array([gpus] * runs.num_rows, pa.string())
        return runs.set_column(runs.schema.get_field_index("gpus"), "gpus", column)

    def _on_node_batch(self, batch: Batch) -> None:
        """The node's readings: each GPU's to the ranks that own it (their store rows and
        their /metrics series, labelled with their run and rank), the rest as the node's."""
        self._recover_local_ranks()
        owned, rest = self.gpus.split(batch.samples)
        self.book.apply_batch(NODE, self._node_resource, Batch(rest, batch.steps, batch.events))
        for (run_id, rank), rows in owned.items():
            try:
                self.store.submit(run_id, {"samples": rows})
            except Overloaded:
                self.counters.reject("node_overloaded")
            self.book.apply_batch((run_id, rank), self._rank_labels(run_id, rank),
                                  Batch(rows, [], []))  # fmt: skip

    def _recover_local_ranks(self) -> None:
        """A sending rank whose `runs` row this agent has not seen (it went to an earlier
        agent, or to the rank's own segments while no agent answered) is looked up in the
        run's `runs` rows on disk, at most every `RECOVER_EVERY_S` per run while one is
        missing: only ranks sending to this agent, so rows of other nodes' ranks in a shared
        store are never taken for this node's."""
        now = time.monotonic()
        for run_id, missing in self.gpus.unknown_local(now).items():
            if now < self._recover_after.get(run_id, 0.0):
                continue
            self._recover_after[run_id] = now + RECOVER_EVERY_S
            found = local_ranks_in_store(Path(self.settings.store) / run_id, missing)
            if found:
                self.gpus.learn_local(run_id, found)
                log.info("trainspec-agent: run %s: local ranks %s recovered from the store",
                         run_id, sorted(found))  # fmt: skip

    # -- scrape, control, status --------------------------------------------------------
    def metrics(self, req: Request) -> Response:
        self.feed.caught_up(FEED_WAIT_S)  # the batches answered before this scrape are in it
        return Response(200, self.exposition.render(), "text/plain; version=0.0.4; charset=utf-8")

    def post_action(self, req: Request) -> Response:
        try:
            name, args, run_id = parse_action(req.body)
        except BadAction as exc:
            raise Rejected(400, str(exc), "bad_action") from exc
        action = self.actions.add(name, args, run_id)
        log.info("trainspec-agent: action %d %s %s", action.id, name, args)
        return Response.json({"id": action.id, "epoch": self.actions.epoch}, 202)

    def get_actions(self, req: Request) -> Response:
        try:
            after = int(req.query.get("after", ["0"])[0])
        except ValueError as exc:
            raise Rejected(400, "after must be an integer", "bad_query") from exc
        run_id = req.query.get("run_id", [""])[0]
        return Response.json(
            {"epoch": self.actions.epoch, "actions": self.actions.after(after, run_id)}
        )

    def readyz(self, req: Request) -> Response:
        # Recent health: unready while a commit failed within the store's failure window.
        ok = self._ready.is_set() and self.store.healthy()
        return Response.json({"ready": ok}, 200 if ok else 503)

    def status(self) -> dict[str, Any]:
        fwd = self.forwarder.stats() if self.forwarder is not None else {"sent": 0, "dropped": 0}
        return {
            "node": self.node_id,
            "listen": f"{self.settings.host}:{self.port}",
            "uptime_s": time.time() - self._started,
            "store": {
                "root": str(self.settings.store),
                "writer": self.store.writer_id,
                "rows_written": self.store.rows_written,
                "segments_written": self.store.segments_written,
                "pending_rows": self.store.pending(),
                "commit_errors": self.store.commit_errors,
                "active_runs": self.store.active_runs(),
            },
            "sources": [{"run_id": r, "rank": k} for r, k in self.book.sources() if k >= 0],
            "ingest": self.counters.snapshot(),
            "forward": fwd,
            "metrics": {
                "series": self.book.budget.series,
                "max_series": self.book.budget.max_series,
                "dropped_points": self.book.budget.dropped_points,
                "expired": self.book.budget.expired,
                "feed_skipped_batches": self.feed.skipped_batches,
            },
            "actions": self.actions.count(),
            "inventory": self.node.inventory,
            "samplers_unavailable": dict(self.node.collector.unavailable),
        }


def _run_row_resource(row: dict[str, Any]) -> dict[str, Any]:
    """The resource attributes a `runs` row gives: local rank and world size, where set."""
    out: dict[str, Any] = {}
    if row.get("local_rank") is not None:
        out["trainspec.local_rank"] = row["local_rank"]
    if row.get("world_size") is not None:
        out["trainspec.world_size"] = row["world_size"]
    return out
