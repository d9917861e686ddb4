"""Collector: runs samplers on a thread, buffers step records and events, feeds the sinks."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import pyarrow as pa

from trainspec.collector.priority import lower_current_thread
from trainspec.collector.records import STEP_FIELDS, Batch, EventRecord, Reading, StepRecord
from trainspec.collector.sampler import Sampler
from trainspec.collector.sink import PartialWrite, Sink
from trainspec.store.journal import Generation, Journal
from trainspec.store.tables import EVENTS, SAMPLES

_EVENT_FIELDS = EVENTS.names

log = logging.getLogger("trainspec.collector")


class _SampleBuffer:
    """Column buffers for raw readings; bounded, with the overflow counted, not blocked on."""

    def __init__(self, rank: int, capacity: int) -> None:
        self.rank = rank
        self.capacity = capacity
        self._lock = threading.Lock()
        self._reset()
        self.dropped = 0

    def _reset(self) -> None:
        self.ts: list[float] = []
        self.metric: list[str] = []
        self.value: list[float] = []
        self.attrs: list[str] = []
        # (metric, attrs) -> row: the slot a `latest` series took past the capacity.
        self._slots: dict[tuple[str, str], int] = {}

    def extend(self, now: float, readings: Sequence[Reading], *, latest: bool = False) -> int:
        """Buffer what fits; how many of `readings` (the first ones) were taken. `latest`
        readings (the drop counter, which counts this buffer's overflow) are never refused:
        past the capacity each of their series keeps one slot, which holds its latest
        reading (a cumulative counter's latest reading holds the earlier ones)."""
        with self._lock:
            room = self.capacity - len(self.ts)
            if room < len(readings):
                if latest:
                    self._keep_latest(now, readings)
                    return len(readings)
                self.dropped += len(readings) - max(room, 0)
                readings = readings[: max(room, 0)]
            for reading in readings:
                self.ts.append(reading[3] if len(reading) == 4 else now)
                self.metric.append(reading[0])
                self.value.append(float(reading[1]))
                self.attrs.append(reading[2])
            return len(readings)

    def _keep_latest(self, now: float, readings: Sequence[Reading]) -> None:
        """Past the capacity: each reading takes its series' slot, or overwrites it."""
        for reading in readings:
            ts = reading[3] if len(reading) == 4 else now
            key = (reading[0], reading[2])
            row = self._slots.get(key)
            if row is None:
                self._slots[key] = len(self.ts)
                self.ts.append(ts)
                self.metric.append(reading[0])
                self.value.append(float(reading[1]))
                self.attrs.append(reading[2])
            else:
                self.ts[row] = ts
                self.value[row] = float(reading[1])

    def drain(self) -> pa.Table:
        with self._lock:
            cols = (self.ts, self.metric, self.value, self.attrs)
            self._reset()
        n = len(cols[0])
        return pa.Table.from_arrays(
            [
                pa.array(cols[0], pa.float64()),
                pa.array([self.rank] * n, pa.int32()),
                pa.array(cols[1], pa.string()),
                pa.array(cols[2], pa.float64()),
                pa.array(cols[3], pa.string()),
            ],
            schema=SAMPLES,
        )


def _next_due(due: float, now: float, interval: float) -> float:
    """The sampler's next reading time after one taken at `now` (due at `due`): the next
    point of its grid at least half an interval away. A tick that woke late (a loaded
    machine) no longer leaves the next reading a few milliseconds after it; the grid skips a
    point instead, and holds after a long stall too."""
    nxt = due + interval
    earliest = now + 0.5 * interval
    if nxt < earliest:
        nxt += math.ceil((earliest - nxt) / interval) * interval
    return nxt


class Collector:
    """One rank's telemetry pipeline. Start once, `close` once (idempotent).

    The training thread only calls `record_step` and `record_event`: an append to a bounded
    deque, never a wait. Samplers run on the `trainspec-sampler` thread; sinks run on the
    `trainspec-flush` thread every `flush_interval_s` and once more at close. Those two can
    run `thread_nice` above the training threads (`priority.py`); a sampler that times
    other ranks (the latency probe) keeps the process's priority (`_lanes`).

    With a `journal` (the run store's, store/journal.py), every tick of the sampling thread
    appends its readings and the step records and events that arrived since the last tick,
    so a process killed between flushes loses at most one tick (50 ms) of rows, not a
    flush interval's. Each flush takes the buffers and starts the journal's next generation
    under one lock, and deletes the generation once the durable sinks stored its rows.
    """

    def __init__(
        self,
        *,
        rank: int,
        samplers: Sequence[Sampler],
        sinks: Sequence[Sink],
        flush_interval_s: float = 2.0,
        capacity: int = 100_000,
        clock: Callable[[], float] = time.time,
        thread_nice: int = 0,
        journal: Journal | None = None,
    ) -> None:
        self.rank = rank
        self.journal = journal
        # Held while a tick appends to the buffers and the journal, and while a flush takes
        # the buffers and rotates the journal: a generation holds exactly a flush's rows.
        self._journal_lock = threading.Lock()
        self._journaled_steps: list[StepRecord] = []
        self._journaled_events: list[EventRecord] = []
        self.thread_nice = thread_nice
        self.sinks = list(sinks)
        self.flush_interval_s = flush_interval_s
        self.capacity = capacity
        self._clock = clock
        self._samples = _SampleBuffer(rank, capacity)
        # pyarrow imports pandas on its first conversion of a Python list (~0.5 s holding
        # the GIL): pay that here, at set-up, not on the flush thread mid-training.
        pa.array([0.0], pa.float64())
        self._steps: deque[StepRecord] = deque()
        self._events: deque[EventRecord] = deque()
        self.dropped: dict[str, int] = {"queue": 0}
        # Rows a durable sink failed to store that the journal kept for `salvage`.
        self.deferred: dict[str, int] = {}
        self._queue_drops_said = False
        self.sink_errors: dict[str, int] = {}
        self.unavailable: dict[str, str] = {}
        self.samplers = self._admit(samplers)
        # Called on the sampling thread with each sampler's readings (the actuator's
        # hardware-health watch); a tap that raises is logged and removed.
        self._taps: list[Callable[[Sequence[Reading]], None]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._close_lock = threading.Lock()
        self.sampler_busy_s = 0.0  # thread CPU time spent sampling (overhead report)
        self.flush_busy_s = 0.0  # thread CPU time spent in sinks
        self.ticks = 0

    def _admit(self, samplers: Sequence[Sampler]) -> list[Sampler]:
        ready = []
        for sampler in samplers:
            try:
                reason = sampler.unavailable_reason()
            except Exception as exc:  # a probe of the machine must not take the job down
                reason = f"{type(exc).__name__}: {exc}"
            if reason is None:
                ready.append(sampler)
            else:
                self.unavailable[sampler.name] = reason
                log.info("trainspec: %s sampler unavailable: %s", sampler.name, reason)
        return ready

    # -- training thread ---------------------------------------------------------------
    def record_step(self, record: StepRecord) -> None:
        if len(self._steps) + len(self._journaled_steps) >= self.capacity:
            self.dropped["queue"] += 1
            return
        self._steps.append(record)

    def record_event(self, event: EventRecord) -> None:
        if len(self._events) + len(self._journaled_events) >= self.capacity:
            self.dropped["queue"] += 1
            return
        self._events.append(event)

    def dropped_total(self) -> int:
        """Points lost anywhere: full queues, failing sinks, sinks' own delivery failures."""
        own = self._samples.dropped + sum(self.dropped.values())
        return own + sum(sink.dropped for sink in self.sinks)

    def add_tap(self, tap: Callable[[Sequence[Reading]], None]) -> None:
        """Have `tap(readings)` see every sampler's readings, on the sampling thread. It must
        be quick and must not block: it runs between readings."""
        self._taps.append(tap)

    # -- threads -------------------------------------------------------------------------
    def start(self) -> Collector:
        for name, lane, nice in self._lanes():
            self._spawn(name, functools.partial(self._sample_loop, lane), nice)
        self._spawn("trainspec-flush", self._flush_loop, self.thread_nice)
        return self

    def _lanes(self) -> list[tuple[str, list[Sampler], int]]:
        """The sampling threads: (name, samplers, nice). One thread for all, the ones that
        time other ranks first in each tick, unless `thread_nice` lowers the sampling thread:
        then each of those gets a thread of its own at the process's priority. (Until
        2026-11-25 the probe always had its own: two threads woke every 50 ms, not one.)"""
        peers = [s for s in self.samplers if s.times_peers]
        rest = [s for s in self.samplers if not s.times_peers]
        if self.thread_nice == 0:
            return [("trainspec-sampler", peers + rest, 0)]
        own = [(f"trainspec-{s.name}", [s], 0) for s in peers]
        return [("trainspec-sampler", rest, self.thread_nice), *own]

    def _spawn(self, name: str, target: Callable[[], None], nice: int = 0) -> None:
        def run() -> None:
            lower_current_thread(nice)
            target()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _sample_loop(self, lane: list[Sampler]) -> None:
        """Ticks on a grid of the lane's shortest interval; each sampler reads on its own
        grid (`_next_due`). A tick that ends late (a stall, a loaded machine) skips the grid
        points it missed instead of running them at once: until 2026-11-28 the loop caught
        up every missed tick in a burst, and as the clocks were read once per tick, before
        the probe, a sampler after a slow probe ran twice 0.1 ms apart. Each sampler's clocks
        are now read as it runs, and it is not read again within half its interval."""
        start = time.monotonic()
        tick = min((s.interval_s for s in lane), default=1.0)
        slack = 0.5 * tick  # a sampler off the tick grid runs at the tick nearest its point
        # Per sampler: [its grid point, the earliest time it may run (half an interval
        # after its last reading, and at most `slack` before its point)].
        due = {id(s): [start, start] for s in lane}
        k = 0
        while not self._stop.is_set() and lane:
            t0 = time.thread_time()
            mono = time.monotonic()  # read again after each sampler that ran
            for sampler in [s for s in lane if s in self.samplers]:
                slot = due[id(sampler)]
                if mono < slot[1]:
                    continue
                interval = sampler.interval_s
                slot[0] = point = _next_due(slot[0], mono, interval)
                earliest = mono + 0.5 * interval
                slot[1] = point - slack if point - slack > earliest else earliest
                self._run_sampler(sampler, self._clock())
                mono = time.monotonic()
            self._journal_records()
            self.sampler_busy_s += time.thread_time() - t0
            self.ticks += 1
            # Deadline scheduling: a slow tick does not shift every later one, and a stall
            # does not leave a burst of ticks behind it (the next point after now).
            mono = time.monotonic()
            k = max(k + 1, math.floor((mono - start) / tick) + 1)
            self._stop.wait(max(0.0, start + k * tick - mono))

    def _run_sampler(self, sampler: Sampler, now: float, *, closing: bool = False) -> None:
        try:
            readings = sampler.closing_readings(now) if closing else sampler.sample(now)
        except Exception as exc:
            with contextlib.suppress(ValueError):  # two lanes may fail it at once
                self.samplers.remove(sampler)
            self.unavailable[sampler.name] = f"failed: {type(exc).__name__}: {exc}"
            log.warning("trainspec: %s sampler failed and is off: %s", sampler.name, exc)
            with contextlib.suppress(Exception):
                sampler.close()  # release what it holds (file descriptors, NVML)
            return
        if readings:
            with self._journal_lock:
                taken = self._samples.extend(now, readings, latest=sampler.latest_slot)
                if self.journal is not None and taken:
                    kept = readings[:taken]
                    self.journal.append_samples(
                        [r[3] if len(r) == 4 else now for r in kept],
                        [r[0] for r in kept],
                        [float(r[1]) for r in kept],
                        [r[2] for r in kept],
                    )
            for tap in list(self._taps):
                try:
                    tap(readings)
                except Exception as exc:
                    with contextlib.suppress(ValueError):  # the other lane may have removed it
                        self._taps.remove(tap)
                    log.warning("trainspec: a reading tap failed and is off: %s", exc)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            t0 = time.thread_time()
            self.flush()
            self.flush_busy_s += time.thread_time() - t0

    def cpu_seconds(self) -> float:
        """CPU time the collector's own threads have used (sampling and sinks)."""
        return self.sampler_busy_s + self.flush_busy_s

    def _journal_records(self) -> None:
        """Append the step records and events that arrived since the last tick."""
        if self.journal is None or not (self._steps or self._events):
            return
        with self._journal_lock:
            self._journal_pending(self.journal)

    def _journal_pending(self, journal: Journal) -> None:
        """Move the queued step records and events to the journaled lists, appending them to
        the journal; the caller holds `_journal_lock`."""
        steps = [self._steps.popleft() for _ in range(len(self._steps))]
        events = [self._events.popleft() for _ in range(len(self._events))]
        self._journaled_steps += steps
        self._journaled_events += events
        journal.append("steps", [[getattr(s, n) for n in STEP_FIELDS] for s in steps])
        rows = [e.row() for e in events]
        journal.append("events", [[r[n] for n in _EVENT_FIELDS] for r in rows])

    def _drain(self) -> tuple[Batch, Generation | None]:
        """The buffered rows, and the journal generation that holds exactly them (every
        record still queued is journaled first), closed to new rows."""
        with self._journal_lock:
            if self.journal is not None:
                self._journal_pending(self.journal)
            steps, self._journaled_steps = self._journaled_steps, []
            events, self._journaled_events = self._journaled_events, []
            steps += [self._steps.popleft() for _ in range(len(self._steps))]
            events += [self._events.popleft() for _ in range(len(self._events))]
            samples = self._samples.drain()
            generation = self.journal.rotate() if self.journal is not None else None
        return Batch(samples=samples, steps=steps, events=events), generation

    def flush(self, sinks: Sequence[Sink] | None = None) -> None:
        """Hand everything buffered to every sink (or to `sinks`), on the calling thread."""
        self._say_queue_drops()
        batch, generation = self._drain()
        journal = self.journal
        if batch.is_empty():
            if journal is not None:
                journal.retire(generation)
            return
        points = batch.samples.num_rows + len(batch.steps) + len(batch.events)
        durable, failed = 0, 0
        # A durable sink's rows that fail to store are not lost while a whole generation
        # holds them: `salvage` stores them later. Counted apart, not as dropped.
        deferrable = generation is not None and generation.complete
        for sink in self.sinks if sinks is None else sinks:
            durable += sink.durable
            try:
                sink.write(batch)
            except Exception as exc:
                failed += sink.durable
                lost = exc.lost if isinstance(exc, PartialWrite) else points
                counts = self.deferred if sink.durable and deferrable else self.dropped
                counts[sink.name] = counts.get(sink.name, 0) + lost
                count = self.sink_errors[sink.name] = self.sink_errors.get(sink.name, 0) + 1
                if count == 1 or count % 100 == 0:
                    log.warning("trainspec: sink %s failed (%d times): %s", sink.name, count, exc)
        if journal is None:
            return
        if durable and not failed:  # the rows are stored: the generation is not needed
            journal.retire(generation)
        else:  # for `salvage` (the next start of this writer, compact, trainspec run)
            journal.keep(generation)

    def _say_queue_drops(self) -> None:
        """Once, on the flush thread: records dropped because a queue was full were only
        counted (a capacity of 1 stored 1 step of 5 without a word)."""
        dropped = self.dropped["queue"] + self._samples.dropped
        if dropped and not self._queue_drops_said:
            self._queue_drops_said = True
            log.warning("trainspec: the collector's queues were full (collector.queue_capacity "
                        "= %d): %d records dropped so far, counted in trainspec.telemetry.dropped",
                        self.capacity, dropped)  # fmt: skip

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop the threads, flush what is left, close samplers and sinks. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not any(thread.is_alive() for thread in self._threads):  # else a tick may be running
            for sampler in list(self.samplers):
                self._run_sampler(sampler, self._clock(), closing=True)
        # The drop counter as it stands, to every sink (the exporters close next: until
        # 2026-11-28 its final reading reached the store alone), and again after the
        # exporters closed, with what they lost closing, for the durable sinks.
        self._final_readings()
        self.flush()
        durable = [s for s in self.sinks if s.durable]
        self._close_sinks([s for s in self.sinks if not s.durable], deadline)
        self._final_readings()
        self.flush(durable)
        if self.journal is not None:
            self.journal.close()
        self._close_sinks(durable, deadline)
        for sampler in self.samplers:
            try:
                sampler.close()
            except Exception as exc:
                log.warning("trainspec: closing %s sampler: %s", sampler.name, exc)

    def _final_readings(self) -> None:
        for sampler in list(self.samplers):
            if sampler.final_reading:
                self._run_sampler(sampler, self._clock())

    def _close_sinks(self, sinks: Sequence[Sink], deadline: float) -> None:
        for sink in sinks:
            try:
                sink.close(timeout_s=max(0.5, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("trainspec: closing %s sink: %s", sink.name, exc)
