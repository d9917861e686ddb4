"""The store's journal: rows a process had not flushed when it was killed are stored by the
next start of its writer (or compact, or trainspec run), once, and never a live process's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import trainspec.store as store
from trainspec.collector import Collector, StepRecord
from trainspec.collector.records import EventRecord
from trainspec.collector.sampler import Sampler
from trainspec.collector.sinks.store import StoreSink
from trainspec.store.journal import Journal, journal_dir, journal_writers, salvage, salvage_run

WRITER = "rank-0"


class _Constant(Sampler):
    name = "constant"

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.n = 0

    def sample(self, now: float):
        self.n += 1
        return [("trainspec.host.cpu.utilization", float(self.n), "{}")]


def _count(run: Path, sql: str) -> int:
    return store.query(run, sql).column(0)[0].as_py()


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


KILLED = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from trainspec.collector import Collector, StepRecord
    from trainspec.collector.records import EventRecord
    from trainspec.collector.sinks.store import StoreSink
    sys.path.insert(0, sys.argv[2])
    from test_journal import _Constant, _wait_for, WRITER
    run = Path(sys.argv[1])
    sink = StoreSink(run, WRITER, journal_rank=0)
    c = Collector(rank=0, samplers=[_Constant()], sinks=[sink], flush_interval_s=3600,
                  journal=sink.journal).start()
    for step in range(25):
        c.record_step(StepRecord(ts=1000.0 + step, rank=0, step=step, duration_s=0.1, loss=2.5))
    c.record_event(EventRecord(ts=1000.5, rank=0, step=3, kind="checkpoint", name="saved",
                               reason="periodic", evidence={"bytes": 12}))
    gen = sink.journal.current.path
    _wait_for(lambda: b'"events"' in gen.read_bytes() and b'"samples"' in gen.read_bytes())
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _killed_writer(run: Path) -> None:
    """A process that records 25 steps, an event and samples, never flushes, and is killed."""
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, str(run), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def test_a_killed_writer_s_unflushed_rows_are_stored_by_its_next_start(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _killed_writer(run)
    assert _count(run, "SELECT count(*) FROM steps") == 0  # nothing was flushed
    sink = StoreSink(run, WRITER, journal_rank=0)  # the restarted rank
    assert sink.salvaged is not None and sink.salvaged.rows["steps"] == 25
    steps = store.query(run, "SELECT step, loss, rank FROM steps ORDER BY step").to_pylist()
    assert [r["step"] for r in steps] == list(range(25))
    assert {(r["loss"], r["rank"]) for r in steps} == {(2.5, 0)}
    event = store.query(run, "SELECT kind, name, evidence, step FROM events").to_pylist()
    assert event == [
        {"kind": "checkpoint", "name": "saved", "evidence": '{"bytes": 12}', "step": 3}
    ]
    assert _count(run, "SELECT count(*) FROM samples WHERE rank = 0") >= 1
    # Once: the generation is gone, and salvaging again stores nothing more.
    again = salvage(run, WRITER)
    assert again.total == 0 and _count(run, "SELECT count(*) FROM steps") == 25
    sink.journal.close()
    assert journal_writers(run) == []


def test_compact_stores_what_a_writer_that_never_restarted_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _killed_writer(run)
    done = salvage_run(run)
    assert done.rows["steps"] == 25 and done.files == 1
    assert _count(run, "SELECT count(*) FROM steps") == 25


def test_a_generation_whose_rows_reached_a_segment_is_not_stored_twice(tmp_path: Path) -> None:
    """Killed after a flush's segment was renamed, before its generation was deleted."""
    run = tmp_path / "run"
    sink = StoreSink(run, WRITER, journal_rank=0)
    c = Collector(rank=0, samplers=[], sinks=[sink], flush_interval_s=3600, journal=sink.journal)
    for step in range(5):
        c.record_step(StepRecord(ts=10.0 + step, rank=0, step=step, duration_s=0.1))
    c._journal_records()  # what a sampling tick does
    batch, generation = c._drain()
    sink.write(batch)  # the segment is in...
    assert generation is not None
    os.close(generation.fd)  # ...and the process dies before `retire`
    os.close(sink.journal.current.fd)
    done = salvage(run, WRITER)
    assert done.total == 0 and done.already == 1
    assert _count(run, "SELECT count(*) FROM steps") == 5


def test_a_live_process_s_journal_is_left_alone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    journal = Journal(run, WRITER, rank=0)
    journal.append("steps", [[1.0, 0, 0, 0.1] + [None] * 16])
    assert salvage(run, WRITER).total == 0  # locked: its own flush stores these rows
    assert journal.current.path.exists()
    journal.close()
    assert not journal_dir(run, WRITER).exists()


def test_a_line_cut_short_by_the_kill_is_left_out_and_a_damaged_file_is_kept(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    d = journal_dir(run, WRITER)
    d.mkdir(parents=True)
    row = [5.0, 0, 7, 0.1] + [None] * 16
    header = json.dumps({"format": 1, "rank": 0})
    (d / "1-ab.000000.jsonl").write_text(
        f'{header}\n["steps",[{json.dumps(row)}]]\n["steps",[[6.0,0'
    )
    (d / "2-ab.000000.jsonl").write_text(f'{header}\nnot json\n["steps",[{json.dumps(row)}]]\n')
    done = salvage(run, WRITER)
    assert done.rows == {"steps": 1}
    assert [p.name for p, _ in done.unreadable] == ["2-ab.000000.jsonl"]
    assert (d / "2-ab.000000.jsonl").exists() and not (d / "1-ab.000000.jsonl").exists()


def test_the_collector_deletes_each_generation_once_its_rows_are_stored(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sink = StoreSink(run, WRITER, journal_rank=0)
    c = Collector(
        rank=0, samplers=[_Constant()], sinks=[sink], flush_interval_s=0.1, journal=sink.journal
    ).start()
    for step in range(30):
        c.record_step(StepRecord(ts=time.time(), rank=0, step=step, duration_s=0.01))
        c.record_event(EventRecord(ts=time.time(), rank=0, step=step, kind="action", name="x",
                                   reason="r"))  # fmt: skip
        time.sleep(0.01)
    c.close()
    assert not journal_dir(run).exists()  # every generation retired, the directory removed
    assert _count(run, "SELECT count(*) FROM steps") == 30
    assert _count(run, "SELECT count(*) FROM events") == 30


def test_a_flush_that_fails_keeps_its_generation_for_salvage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sink = StoreSink(run, WRITER, journal_rank=0)
    c = Collector(rank=0, samplers=[], sinks=[sink], flush_interval_s=3600, journal=sink.journal)
    c.record_step(StepRecord(ts=1.0, rank=0, step=0, duration_s=0.1))
    c._journal_records()
    steps_writer = sink._writers["steps"]
    real_write = steps_writer.write
    steps_writer.write = lambda batch: (_ for _ in ()).throw(OSError("disk full"))  # type: ignore[method-assign]
    c.flush()
    # Not lost: the generation holds them. Counted as deferred, not dropped (they were
    # counted dropped and then stored by salvage).
    assert c.deferred == {"store": 1} and c.dropped.get("store", 0) == 0
    steps_writer.write = real_write  # type: ignore[method-assign]
    c.close()
    kept = list(journal_dir(run, WRITER).glob("*.jsonl"))
    assert len(kept) == 1
    assert salvage(run, WRITER).rows == {"steps": 1}
    assert _count(run, "SELECT count(*) FROM steps") == 1


@pytest.mark.parametrize("value", ["0", "false"])
def test_the_journal_can_be_switched_off(tmp_path: Path, monkeypatch, value: str) -> None:
    from trainspec.config import load_config

    monkeypatch.setenv("TRAINSPEC_STORE_JOURNAL", value)
    assert load_config().store.journal is False


def test_validate_says_journaled_rows_are_unread_and_compact_stores_them(
    tmp_path: Path, capsys
) -> None:
    from trainspec.cli.main import main

    run = tmp_path / "run"
    _killed_writer(run)
    main(["validate", str(run)])
    out = capsys.readouterr()
    assert "rank-0: rows journaled by a process that ended before flushing" in out.out + out.err
    assert main(["compact", str(run)]) == 0
    out = capsys.readouterr()
    assert "stored 2" in out.out  # 25 steps, an event and the samples
    assert _count(run, "SELECT count(*) FROM steps") == 25
    main(["validate", str(run)])
    out = capsys.readouterr()
    assert "rows journaled by a process" not in out.out + out.err


def test_a_damaged_segment_does_not_stop_salvage_or_compact(tmp_path: Path) -> None:
    """The "already stored" check read every segment of the writer: one that does not read
    made every salvage fail, and `compact --skip-unreadable` with it."""
    from trainspec.store.compact import compact_run

    run = tmp_path / "run"
    _killed_writer(run)
    bad = run / "segments" / "steps" / WRITER / "seg-0000000007-0000000007.parquet"
    bad.write_bytes(b"PAR1 not a parquet file")
    done = compact_run(run, skip_unreadable=True)
    assert done.salvaged.rows["steps"] == 25
    assert _count(run, "SELECT count(*) FROM steps") == 25


def test_files_a_process_left_before_naming_or_writing_a_generation_are_removed(
    tmp_path: Path,
) -> None:
    """A generation was created under its final name, then locked, then given its header: a
    reader in between took the lock (the live journal stopped), and a kill there left an
    empty file that every salvage called unreadable and `validate` warned about for ever."""
    run = tmp_path / "run"
    d = journal_dir(run, WRITER)
    d.mkdir(parents=True)
    (d / ".1-ab.000000.jsonl.tmp").write_bytes(b"")  # killed before its name
    (d / "1-ab.000001.jsonl").write_bytes(b"")  # an empty file under a final name
    (d / "1-ab.000002.jsonl").write_text(json.dumps({"format": 1, "rank": 0}) + "\n")
    assert journal_writers(run) == [WRITER]
    done = salvage(run, WRITER)
    assert done.unreadable == [] and done.total == 0 and done.files == 2
    assert not journal_dir(run).exists()
    live = Journal(run, WRITER, rank=0)  # named only once locked and headed
    assert [p.name.startswith(".") for p in journal_dir(run, WRITER).iterdir()] == [False]
    assert salvage(run, WRITER).files == 0  # the live one is left alone
    live.close()


def test_after_close_the_journal_touches_nothing(tmp_path: Path) -> None:
    """A flush after close rotated again: it closed the fd number of the retired generation,
    by then another file's, and left a new generation behind."""
    run = tmp_path / "run"
    sink = StoreSink(run, WRITER, journal_rank=0)
    c = Collector(rank=0, samplers=[], sinks=[sink], flush_interval_s=3600, journal=sink.journal)
    c.record_step(StepRecord(ts=1.0, rank=0, step=0, duration_s=0.1))
    c.close()
    other = os.open(tmp_path / "victim", os.O_WRONLY | os.O_CREAT)
    try:
        c.record_step(StepRecord(ts=2.0, rank=0, step=1, duration_s=0.1))
        c.flush()  # Session.flush after close, a signal handler's
        assert sink.journal is not None and sink.journal.current is None
        os.write(other, b"still mine")  # EBADF if the journal closed it
    finally:
        os.close(other)
    assert not journal_dir(run).exists()
    assert _count(run, "SELECT count(*) FROM steps") == 2


FORKED = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from trainspec.store.journal import Journal
    journal = Journal(Path(sys.argv[1]), "rank-0", rank=0)
    journal.append("steps", [[5.0, 0, 3, 0.1] + [None] * 16])
    if os.fork() == 0:  # a DataLoader worker that outlives its rank
        journal.forget_in_child()
        time.sleep(20)
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_forked_child_does_not_keep_a_killed_parent_s_journal_locked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", FORKED, str(run)], start_new_session=True)
    try:
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert salvage(run, WRITER).rows == {"steps": 1}  # while the child still sleeps
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("removed_at", ["writer dir", "first generation"])
def test_a_journal_starts_though_another_rank_s_salvage_removes_the_shared_directory(
    tmp_path: Path, monkeypatch, removed_at: str
) -> None:
    """Rank 1's salvage ends with `rmdir` of the run's empty `journal/`; landing between rank
    0's making that directory and making `journal/rank-0` in it (or its first generation),
    it left rank 0 without a journal ("No such file or directory"). Interleaved here
    deterministically: the other rank's real salvage runs at that very point, once."""
    run = tmp_path / "run"
    real_mkdir, real_open = os.mkdir, os.open
    interleaved: list[str] = []

    def other_rank_salvages() -> None:
        if not interleaved:
            interleaved.append("salvaged")
            salvage(run, "rank-1")  # nothing to store: it only removes the empty directories

    def mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if removed_at == "writer dir" and Path(path) == journal_dir(run):
            other_rank_salvages()

    def open_(path, *args, **kwargs):
        at_first = removed_at == "first generation" and not interleaved
        if at_first and Path(path).parent == journal_dir(run, WRITER):
            os.rmdir(journal_dir(run, WRITER))  # as a close of this writer's earlier process
            other_rank_salvages()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    journal = Journal(run, WRITER, rank=0)
    monkeypatch.undo()
    assert interleaved == ["salvaged"]
    assert journal.current is not None and journal.current.path.parent == journal_dir(run, WRITER)
    journal.append("steps", [[5.0, 0, 3, 0.1] + [None] * 16])
    assert journal.current.path.exists()
    journal.close()


def test_rows_dropped_when_the_journal_failed_are_not_stored_later(
    tmp_path: Path, monkeypatch
) -> None:
    """A full disk: a journal write fails (the generation lacks a row) and so does the
    flush, which counts the rows dropped. The generation used to be kept after a clean close
    and its rows stored by the next compact: counted lost and stored (420 -> 440 steps)."""
    import errno

    import trainspec.store.journal as journal_module

    run = tmp_path / "run"
    sink = StoreSink(run, WRITER, journal_rank=0)
    c = Collector(rank=0, samplers=[], sinks=[sink], flush_interval_s=3600, journal=sink.journal)
    c.record_step(StepRecord(ts=1.0, rank=0, step=0, duration_s=0.1))
    c._journal_records()  # journaled
    real_write = os.write

    def disk_full(fd: int, data: bytes) -> int:
        current = sink.journal.current if sink.journal is not None else None
        if current is not None and fd == current.fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(journal_module.os, "write", disk_full)
    c.record_step(StepRecord(ts=2.0, rank=0, step=1, duration_s=0.1))
    c._journal_records()  # not journaled: journaling stops
    monkeypatch.undo()
    steps_writer = sink._writers["steps"]
    real_steps_write = steps_writer.write
    steps_writer.write = lambda batch: (_ for _ in ()).throw(OSError("disk full"))  # type: ignore[method-assign]
    c.flush()
    assert c.dropped == {"queue": 0, "store": 2} and c.deferred == {}
    steps_writer.write = real_steps_write  # type: ignore[method-assign]
    c.record_step(StepRecord(ts=3.0, rank=0, step=2, duration_s=0.1))
    c.close()
    assert not list(journal_dir(run).glob("*/*.jsonl"))  # nothing left for salvage
    assert salvage_run(run).total == 0
    # What the store holds and what was counted dropped add up to what was recorded.
    assert _count(run, "SELECT count(*) FROM steps") == 1
