"""Agent ingest: simulated ranks sending 60 metrics at 20 Hz each to one trainspec-agent.

The agent runs as its own process pinned to one core (CPU 0); the simulated ranks run in this
process on the other core, one thread and one keep-alive connection per rank, each flushing
a batch every `--flush-s` (60 x 20 x flush-s raw readings in the framed Arrow encoding that
`AgentSink` sends). Reported per level (A B A B: each rank count measured twice,
interleaved):
- offered and stored points/s, and the agent's CPU use (share of its one core), so
  `points per agent CPU-second` estimates what one core sustains;
- p50/p99 from send to acknowledged: the agent acknowledges only after the segment is
  renamed into place, so acknowledged = queryable; a reader thread also polls the store
  (`trainspec.store.open`, every 100 ms) for rank 0's newest reading, and `p99 queryable`
  is that measured latency (poll period included);
- drops: batches the agent refused (a real rank would write them itself) plus rows sent
  but absent from the store at the end.
Also the decode cost per point of the two encodings the agent accepts (OTLP protobuf with one
gauge point per reading, against the framed Arrow batch), A B A B.
Goal: 64 ranks (76,800 points/s) with no drops and p99 under 2 s.
"""

from __future__ import annotations

import http.client
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from tests.integration.agent_process import start_agent, stop_agent  # noqa: E402
from tests.integration.jobs import free_port  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from trainspec.collector.sinks.agent import (  # noqa: E402
    BATCH_CONTENT_TYPE,
    BATCH_PATH,
    decode_tables,
    encode_tables,
)
from trainspec.store.tables import SAMPLES  # noqa: E402

METRICS = 60
HZ = 20
GAUGES = [
    "trainspec.gpu.utilization", "trainspec.gpu.memory.utilization", "trainspec.gpu.memory.used",
    "trainspec.gpu.power", "trainspec.gpu.temperature", "trainspec.gpu.clock.sm",
    "trainspec.host.cpu.utilization", "trainspec.process.cpu.utilization",
    "trainspec.host.memory.used", "trainspec.process.memory.rss", "trainspec.memory.pressure",
    "trainspec.memory.allocator.allocated", "trainspec.memory.allocator.reserved",
    "trainspec.memory.allocator.fragmentation", "trainspec.gpu.memory.limit",
]  # fmt: skip
SERIES = [(GAUGES[i % len(GAUGES)], f'{{"gpu.index":{i // len(GAUGES)}}}') for i in range(METRICS)]


def rank_template(rank: int, flush_s: float) -> tuple[pa.Table, pa.Array]:
    """One flush of one rank's readings (times relative to the flush's end) and its offsets."""
    ticks = int(HZ * flush_s)
    offsets, metric, attrs = [], [], []
    for k in range(ticks):
        for name, a in SERIES:
            offsets.append(-(ticks - 1 - k) / HZ)
            metric.append(name)
            attrs.append(a)
    n = len(offsets)
    table = pa.Table.from_arrays(
        [pa.array(offsets, pa.float64()), pa.array([rank] * n, pa.int32()), pa.array(metric),
         pa.array([float(i % 97) for i in range(n)], pa.float64()), pa.array(attrs)],
        schema=SAMPLES,
    )  # fmt: skip
    return table, table["ts"].combine_chunks()


def rank_batch(template: tuple[pa.Table, pa.Array], end: float) -> pa.Table:
    table, offsets = template
    return table.set_column(0, "ts", pc.add(offsets, end))


class Rank(threading.Thread):
    def __init__(self, rank: int, port: int, run_id: str, flush_s: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.rank, self.port, self.run_id, self.flush_s, self.stop = (
            rank,
            port,
            run_id,
            flush_s,
            stop,
        )
        self.latencies: list[float] = []
        self.sent_rows = 0
        self.refused = 0
        self.acked: list[tuple[float, float]] = []  # (newest reading ts, ack time)

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": self.run_id,
                   "X-Trainspec-Rank": str(self.rank)}  # fmt: skip
        # Ranks start spread over one flush period, as real ranks' flush threads do.
        next_at = time.monotonic() + self.flush_s * (self.rank % 64) / 64
        template = rank_template(self.rank, self.flush_s)
        while not self.stop.is_set():
            self.stop.wait(max(0.0, next_at - time.monotonic()))
            if self.stop.is_set():
                break
            next_at += self.flush_s
            end = time.time()
            table = rank_batch(template, end)
            body = encode_tables({"samples": table})
            t0 = time.monotonic()
            try:
                conn.request("POST", BATCH_PATH, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                ok = False
            if ok:
                self.latencies.append(time.monotonic() - t0)
                self.sent_rows += table.num_rows
                self.acked.append((end, time.time()))
            else:
                self.refused += table.num_rows
        conn.close()


def poll_queryable(run_dir: Path, stop: threading.Event, out: list[float]) -> None:
    """Time from rank 0's send to its newest reading being visible to a store reader."""
    import trainspec.store as store

    con = None
    seen = 0.0
    while not stop.wait(0.1):
        try:
            if con is None:
                con = store.open(run_dir)
            else:
                store.refresh(con)
            newest = con.execute("SELECT max(ts) FROM samples WHERE rank = 0").fetchall()[0][0]
        except Exception:  # the run appears a moment after the first commit
            continue
        if newest is None or newest <= seen:
            continue
        seen = newest
        out.append(time.time() - newest)  # the newest reading is stamped at its send time
    if con is not None:
        con.close()


def one_level(ranks: int, seconds: float, flush_s: float, root: Path, tag: str) -> dict:
    port = free_port()
    agent = start_agent(root, port, "--no-nvml", "--log-level", "WARNING")
    os.sched_setaffinity(agent.pid, {0})
    proc = psutil.Process(agent.pid)
    stop = threading.Event()
    run_id = f"bench-{tag}"
    threads = [Rank(r, port, run_id, flush_s, stop) for r in range(ranks)]
    queryable: list[float] = []
    poller = threading.Thread(
        target=poll_queryable, args=(root / run_id, stop, queryable), daemon=True
    )
    cpu0 = sum(proc.cpu_times()[:2])
    t0 = time.monotonic()
    for t in threads:
        t.start()
    poller.start()
    time.sleep(seconds)
    stop.set()
    window = time.monotonic() - t0
    for t in threads:
        t.join(60)
    wall = time.monotonic() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    poller.join(10)
    stop_agent(agent)
    import trainspec.store as store

    con = store.open(root / run_id)
    stored = con.execute("SELECT count(*) FROM samples").fetchall()[0][0]
    sent = sum(t.sent_rows for t in threads)
    lat = sorted(x for t in threads for x in t.latencies)
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else float("nan")
    return {
        "ranks": ranks,
        "offered_pts_s": ranks * METRICS * HZ,
        "stored_pts_s": stored / window,
        "agent_core_share": cpu / wall,
        "pts_per_agent_cpu_s": stored / cpu if cpu else float("nan"),
        "p50_ack_s": statistics.median(lat) if lat else float("nan"),
        "p99_ack_s": p99,
        "p99_queryable_s": _p99(queryable),
        "refused_pts": sum(t.refused for t in threads),
        "missing_pts": sent - stored,
    }


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.99 * (len(xs) - 1))] if xs else float("nan")


def decode_costs(reps: int) -> list[dict]:
    """Agent-side decode cost per point: OTLP protobuf (a gauge point per reading) vs Arrow."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    from trainspec.schema.targets import decode_otlp

    table = rank_batch(rank_template(0, 1.0), time.time())
    req = ExportMetricsServiceRequest()
    sm = req.resource_metrics.add().scope_metrics.add()
    by_metric: dict[str, object] = {}
    for t, m, v in zip(table["ts"].to_pylist(), table["metric"].to_pylist(),
                       table["value"].to_pylist()):  # fmt: skip
        metric = by_metric.get(m)
        if metric is None:
            metric = by_metric[m] = sm.metrics.add(name=m)
        metric.gauge.data_points.add(time_unix_nano=int(t * 1e9), as_double=v)
    otlp = req.SerializeToString()
    arrow = encode_tables({"samples": table})
    fns = {"otlp_protobuf": lambda: decode_otlp(otlp), "arrow_batch": lambda: decode_tables(arrow)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):  # A B A B
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / table.num_rows)
    sizes = {"otlp_protobuf": len(otlp), "arrow_batch": len(arrow)}
    return [
        {"encoding": k, "us_per_point": statistics.median(v) * 1e6,
         "bytes_per_point": sizes[k] / table.num_rows}
        for k, v in times.items()
    ]  # fmt: skip


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--flush-s", type=float, default=1.0, help="each rank's flush interval")
    args = p.parse_args()
    levels = [16, 64] if args.quick else [16, 64, 128]
    seconds = 8.0 if args.quick else 30.0
    os.sched_setaffinity(0, {1} if (os.cpu_count() or 1) > 1 else {0})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(2):
            for ranks in levels:
                rows.append({"rep": rep, **one_level(ranks, seconds, args.flush_s, Path(tmp),
                                                     f"{ranks}-{rep}")})  # fmt: skip
    print_table(rows)
    decode = decode_costs(5 if args.quick else 20)
    print()
    print_table(decode)
    write_json(args.json_path, {"levels": rows, "decode": decode, "flush_s": args.flush_s,
                                "seconds": seconds})  # fmt: skip


if __name__ == "__main__":
    main()
