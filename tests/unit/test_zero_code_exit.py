"""The zero-code layer at the process's end (`on_exit`, `runtime/exit_status.py`): a
`sys.exit` with a failing code, whose `SystemExit` no `sys.excepthook` sees, and an
exception printed by a hook the script installed over trainspec's, fail the step in
progress, as an uncaught exception does (`on_uncaught`); a normal end records no failure."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.unit.test_zero_code_failure import stored, train
from trainspec.runtime.auto import AutoInstrumentation, _excepthook


def ended(auto: AutoInstrumentation, code: object) -> None:
    """As the `sys.exit(code)` that left the script would leave it (the interpreter's top
    level freed its `SystemExit`)."""
    auto.exits.exit_code = code


@pytest.mark.parametrize("stepped", [False, True])
@pytest.mark.parametrize(
    ("code", "reason"), [(1, "SystemExit: 1"), ("bad data", "SystemExit: bad data")]
)
def test_a_failing_exit_fails_the_step_in_progress(auto, stepped, code, reason):
    """Nothing was recorded: the step `sys.exit(1)` left was neither stored nor failed.
    After its optimizer stepped, that step is over and stored; the one begun as it ended
    failed (`on_uncaught`'s rule)."""
    for _ in range(3):
        train(auto)
    train(auto, step=stepped)
    ended(auto, code)
    auto.on_exit()
    steps, events = stored(auto)
    failed = 4 if stepped else 3
    assert steps == list(range(failed))
    assert events == [(failed, "fault", "step_failed", "warning", reason)]


@pytest.mark.parametrize("code", [0, None, False, "not seen"])
def test_a_normal_end_stores_the_last_step_and_records_no_failure(auto, code):
    for _ in range(4):
        train(auto)
    if code != "not seen":
        ended(auto, code)
    auto.on_exit()
    assert stored(auto) == ([0, 1, 2, 3], [])


def test_an_exception_the_script_s_own_hook_printed_fails_the_step(auto, monkeypatch):
    """The script replaced `sys.excepthook`: trainspec's never ran, and nothing was recorded.
    `PyErr_Print` set `sys.last_value` before it called the script's hook."""
    train(auto)
    train(auto, step=False)
    exc = RuntimeError("boom")
    for name in ("last_value", "last_exc"):
        monkeypatch.setattr(sys, name, exc, raising=False)
    auto.on_exit()
    assert stored(auto) == ([0], [(1, "fault", "step_failed", "error", "RuntimeError: boom")])


def test_a_failure_trainspec_s_hook_recorded_is_not_recorded_again_at_exit(auto, monkeypatch):
    train(auto)
    train(auto, step=False)
    exc = RuntimeError("boom")
    _excepthook(auto, lambda *a: None)(RuntimeError, exc, None)
    for name in ("last_value", "last_exc"):
        monkeypatch.setattr(sys, name, exc, raising=False)
    ended(auto, 1)
    auto.on_exit()
    assert stored(auto) == ([0], [(1, "fault", "step_failed", "error", "RuntimeError: boom")])


def test_an_exception_reported_before_trainspec_started_is_none_of_the_run_s(monkeypatch):
    monkeypatch.setattr(sys, "last_value", RuntimeError("earlier"), raising=False)
    monkeypatch.delattr(sys, "last_exc", raising=False)
    assert AutoInstrumentation().exits.ending() is None


# A process whose `sys.exit` and `exit()` are trainspec's, printing at exit what it is seen
# to end on; the interpreter's own top level runs the script (pytest's frames would catch).
PROCESS = """
import atexit, builtins, sys
from trainspec.runtime.auto import AutoInstrumentation, _exit_watched
auto = AutoInstrumentation()
sys.exit = _exit_watched(auto, sys.exit)
Quitter = type(builtins.exit)
Quitter.__call__ = _exit_watched(auto, Quitter.__call__)
atexit.register(lambda: print("ending", repr(auto.exits.ending()), "failures", auto.failures))
def step():
    {body}
step()
{after}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("body", "after", "status", "seen"),
    [
        ("sys.exit(1)", "", 1, "SystemExit(1)"),
        ("sys.exit('bad data')", "", 1, "SystemExit('bad data')"),
        ("exit(3)", "", 3, "SystemExit(3)"),
        ("from sys import exit; exit(2)", "", 2, "SystemExit(2)"),
        ("sys.exit(0)", "", 0, "None"),
        ("sys.exit()", "", 0, "None"),
        ("pass", "", 0, "None"),
        # caught by the script, in a function or at the top of the module: it goes on
        ("try:\n        sys.exit(1)\n    except SystemExit:\n        pass", "", 0, "None"),
        ("pass", "try:\n    sys.exit(1)\nexcept SystemExit as e:\n    caught = e.code", 0, "None"),
        ("pass", "try:\n    sys.exit(1)\nexcept SystemExit:\n    sys.exit(0)", 0, "None"),
        ("pass", "try:\n    sys.exit(0)\nexcept SystemExit:\n    raise", 0, "None"),
        ("pass", "try:\n    sys.exit(4)\nexcept SystemExit:\n    raise", 4, "SystemExit(4)"),
        # the script's own hook printed it
        (
            "sys.excepthook = lambda *a: print('theirs')\n    raise KeyError('k')",
            "",
            1,
            "KeyError('k')",
        ),  # fmt: skip
        # not seen (the module docstring says so): the process ends as it did
        ("raise SystemExit(1)", "", 1, "None"),
    ],
)
def test_what_a_process_is_seen_to_end_on(tmp_path, body, after, status, seen):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(PROCESS).format(body=body, after=after))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == status, proc.stderr
    assert f"ending {seen} failures 0" in proc.stdout, (proc.stdout, proc.stderr)
