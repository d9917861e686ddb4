"""`trainspec demo` stopped before its end: by Ctrl-C (once or twice) or by --timeout. The
job is stopped and waited for, and one line says what was kept: the steps stored so far and
where. torchrun is a stand-in here that stores a run as the ranks would."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import trainspec.store as store
from tests.helpers.cli import one_line_error
from tests.helpers.runs import make_compliant_run
from trainspec.cli import demo
from trainspec.cli.main import main

pytestmark = pytest.mark.timeout(60)


def ctrl_c() -> None:
    """A SIGINT to this process, as the terminal's Ctrl-C sends it."""
    os.kill(os.getpid(), signal.SIGINT)


class Torchrun:
    """Stands in for the torchrun job: it has stored a few steps (or what `stored` says),
    trains until stopped, and runs `on_poll` at each poll and `on_wait` when waited for after
    SIGTERM."""

    def __init__(
        self,
        env: dict[str, str],
        on_poll: Callable[[], None] = lambda: None,
        on_wait: Callable[[], None] = lambda: None,
        stops: bool = True,
        stored: str = "steps",
    ) -> None:
        self.run_dir = Path(env["TRAINSPEC_STORE_ROOT"]) / env["TRAINSPEC_STORE_RUN_ID"]
        if stored == "steps":
            make_compliant_run(self.run_dir, ranks=1, seconds=1.0)
        elif stored == "no steps":  # the ranks have started, and not finished a step
            (self.run_dir / "segments").mkdir(parents=True)
        self.on_poll, self.on_wait, self.stops = on_poll, on_wait, stops
        self.returncode: int | None = None
        self.terminated = self.killed = False

    def poll(self) -> int | None:
        self.on_poll()
        return self.returncode

    def terminate(self) -> None:
        self.terminated = True

    def kill(self) -> None:
        self.killed = True
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        self.on_wait()
        if self.killed or self.stops:
            self.returncode = self.returncode or -15
            return self.returncode
        raise subprocess.TimeoutExpired("torchrun", timeout or 0)

    def steps_stored(self) -> int:
        sql = "SELECT max(step) + 1 FROM steps WHERE rank = 0"
        return int(store.query(self.run_dir, sql).column(0)[0].as_py())


@pytest.fixture
def launch(monkeypatch):
    """`launch(**behaviour)`: the next demo starts a `Torchrun` with it; returns a list that
    holds it once started."""
    for name in ("TRAINSPEC_CONFIG", "TRAINSPEC_COLLECTOR_PROMETHEUS_PORT"):
        monkeypatch.delenv(name, raising=False)
    started: list[Torchrun] = []

    def arrange(**behaviour) -> list[Torchrun]:
        def popen(cmd, env, **kwargs):
            started.append(Torchrun(env, **behaviour))
            return started[0]

        monkeypatch.setattr(demo.subprocess, "Popen", popen)
        return started

    yield arrange
    # the demo's SIGINT handling ends with it: Python's own handler is back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _demo(tmp_path: Path, *extra: str) -> int:
    return main(["demo", "--out", str(tmp_path / "runs"), "--steps", "50", *extra])


def _once(action: Callable[[], None]) -> Callable[[], None]:
    done: list[bool] = []

    def call() -> None:
        if not done:
            done.append(True)
            action()

    return call


def test_a_second_ctrl_c_while_the_job_stops_still_says_what_was_kept(tmp_path, capsys, launch):
    """The second SIGINT raised inside the wait for the job: no line, the job unwaited."""
    started = launch(on_poll=_once(ctrl_c), on_wait=ctrl_c)
    assert _demo(tmp_path) == 130
    job = started[0]
    assert job.terminated and job.returncode is not None
    err = capsys.readouterr().err.strip()
    assert err == (
        f"trainspec demo: interrupted; the {job.steps_stored()} steps stored so far are kept "
        f"in {job.run_dir}"
    )


def test_a_job_that_ignores_sigterm_is_killed_and_the_line_still_comes(tmp_path, capsys, launch):
    """Waiting raised TimeoutExpired: an 'unexpected' exit 2 and torchrun left running."""
    started = launch(on_poll=_once(ctrl_c), stops=False)
    assert _demo(tmp_path) == 130
    assert started[0].killed
    assert "trainspec demo: interrupted; the " in capsys.readouterr().err


def test_the_timeout_says_the_steps_stored_so_far_are_kept(tmp_path, capsys, launch):
    started = launch()
    code = _demo(tmp_path, "--timeout", "0.5")
    job = started[0]
    log = tmp_path / "runs" / f"{job.run_dir.name}.log"
    err = one_line_error(capsys, code)
    assert err == (
        f"trainspec demo: error: training did not finish in 0.5s; stopped it; the "
        f"{job.steps_stored()} steps stored so far are kept in {job.run_dir} (log: {log})"
    )
    assert job.terminated


def test_a_ctrl_c_while_the_timeout_stops_the_job_does_not_cut_it_short(tmp_path, capsys, launch):
    started = launch(on_wait=ctrl_c)
    code = _demo(tmp_path, "--timeout", "0.5")
    err = one_line_error(capsys, code, "training did not finish in 0.5s; stopped it;")
    assert str(started[0].run_dir) in err


def test_an_interrupt_before_the_first_step_says_so(tmp_path, capsys, launch):
    """'the 0 steps stored so far are kept' read as if steps had been lost."""
    started = launch(on_poll=_once(ctrl_c), stored="no steps")
    assert _demo(tmp_path) == 130
    err = capsys.readouterr().err.strip()
    assert err == (
        f"trainspec demo: interrupted; no step was stored yet; what was is kept in "
        f"{started[0].run_dir}"
    )
