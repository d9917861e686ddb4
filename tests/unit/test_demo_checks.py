"""`trainspec demo` and `trainspec run` refuse what would fail in every rank before launching:
a bad configuration file, an unknown or absent device, a taken Prometheus port, a timeout that
is not positive. Each is one line on stderr and exit 2, and torchrun is never started."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.helpers.cli import one_line_error
from trainspec.cli import demo, run
from trainspec.cli.main import main


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any launch fails the test: every case here must stop before torchrun starts."""

    def launched(*args, **kwargs):
        raise AssertionError(f"launched {args[0] if args else kwargs}")

    monkeypatch.setattr(demo.subprocess, "Popen", launched)
    monkeypatch.setattr(run, "run_job", launched)
    monkeypatch.delenv("TRAINSPEC_CONFIG", raising=False)
    monkeypatch.delenv("TRAINSPEC_COLLECTOR_PROMETHEUS_PORT", raising=False)
    monkeypatch.delenv("TRAINSPEC_COLLECTOR_PROMETHEUS_ADDR", raising=False)


@pytest.mark.parametrize("command", ["demo", "run"])
def test_a_bad_config_file_is_one_line_naming_the_key(command, tmp_path, capsys, monkeypatch):
    (tmp_path / "bad.toml").write_text("[collector]\ninterval_s = -1\n")
    monkeypatch.setenv("TRAINSPEC_CONFIG", str(tmp_path / "bad.toml"))
    rest = ["--", "true"] if command == "run" else ["--steps", "5"]
    code = main([command, "--out", str(tmp_path / "runs"), *rest])  # --out: run checks it too
    one_line_error(capsys, code, "bad.toml", "collector.interval_s")


def test_a_bad_compression_level_in_the_file_is_caught_as_the_ranks_would(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "bad.toml").write_text('[kernels]\ncompression = "int3"\n')
    monkeypatch.setenv("TRAINSPEC_CONFIG", str(tmp_path / "bad.toml"))
    code = main(["demo", "--out", str(tmp_path / "runs")])
    one_line_error(capsys, code, "kernels.compression")


def test_an_unknown_device_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--out", str(tmp_path), "--device", "tpu"])
    assert exc.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["demo", "--out", str(tmp_path), "--device", "cuda"])
    one_line_error(capsys, code, "CUDA is not available")


def test_cuda_with_fewer_gpus_than_ranks_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = main(["demo", "--out", str(tmp_path), "--device", "cuda", "--ranks", "2"])
    one_line_error(capsys, code, "--ranks 2", "1 visible")


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_timeout_that_is_not_positive_is_refused(timeout, tmp_path, capsys):
    code = main(["demo", "--out", str(tmp_path), "--timeout", timeout])
    one_line_error(capsys, code, "--timeout", "positive")


def _taken_port_pair() -> tuple[int, socket.socket]:
    """A base port that is free and the port after it, held by a listener."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base >= 65535:
            continue
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", base + 1))
        except OSError:
            holder.close()
            continue
        holder.listen()
        return base, holder
    pytest.skip("no free pair of ports")


@pytest.mark.parametrize("source", ["flag", "environment"])
def test_a_taken_prometheus_port_of_any_rank_is_one_line(source, tmp_path, capsys, monkeypatch):
    base, holder = _taken_port_pair()
    with holder:
        argv = ["demo", "--out", str(tmp_path), "--ranks", "2"]
        if source == "flag":
            argv += ["--prometheus-port", str(base)]
        else:  # the ranks read collector.prometheus_port from the environment as well
            monkeypatch.setenv("TRAINSPEC_COLLECTOR_PROMETHEUS_PORT", str(base))
        code = main(argv)
    one_line_error(capsys, code, f"127.0.0.1:{base + 1}", "local rank 1", "in use")


def test_free_prometheus_ports_pass_the_check():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    run.check_ports_free("127.0.0.1", base, 1)  # raises CliError if it cannot bind


@pytest.mark.parametrize("command", ["demo", "run"])
def test_a_runs_root_that_is_a_file_is_one_line(command, tmp_path, capsys):
    root = tmp_path / "afile.txt"
    root.write_text("kept")
    rest = ["--", "true"] if command == "run" else ["--steps", "5"]
    code = main([command, "--out", str(root), *rest])
    one_line_error(capsys, code, "--out", "afile.txt", "cannot create the runs directory")
    assert root.read_text() == "kept"


def test_run_says_when_the_job_stored_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run, "run_job", lambda command, env: 0)  # a job that stored nothing
    assert main(["run", "--out", str(tmp_path), "--run-id", "r1", "--", "true"]) == 0
    assert "nothing stored for run r1" in capsys.readouterr().out
    (tmp_path / "r1" / "segments").mkdir(parents=True)  # a job that did
    assert main(["run", "--out", str(tmp_path), "--run-id", "r1", "--", "true"]) == 0
    assert f"run r1 stored in {tmp_path / 'r1'}" in capsys.readouterr().out
    monkeypatch.setenv("TRAINSPEC_COLLECTOR_MODE", "sidecar")  # the agent stores it
    assert main(["run", "--out", str(tmp_path), "--run-id", "r2", "--", "true"]) == 0
    assert "run r2 sent to the trainspec-agent" in capsys.readouterr().out


def test_more_ranks_than_one_machine_runs_is_refused(capsys):
    code = main(["demo", "--ranks", "99999999999999999999"])
    one_line_error(capsys, code, "--ranks 99999999999999999999", "at most 256")


def test_run_takes_the_run_id_the_configuration_names(tmp_path, capsys, monkeypatch):
    """TRAINSPEC_STORE_RUN_ID was overwritten with a new id, without a word."""
    seen: list[str] = []
    monkeypatch.setattr(
        run, "run_job", lambda command, env: seen.append(env["TRAINSPEC_STORE_RUN_ID"]) or 0
    )
    monkeypatch.setenv("TRAINSPEC_STORE_RUN_ID", "from-env")
    assert main(["run", "--out", str(tmp_path), "--", "true"]) == 0
    assert main(["run", "--out", str(tmp_path), "--run-id", "given", "--", "true"]) == 0
    assert seen == ["from-env", "given"]  # --run-id wins


def test_a_sidecar_run_whose_rows_stayed_local_says_where_they_are(tmp_path, capsys, monkeypatch):
    """It said the run was sent to the agent, with every step in the local segments."""
    monkeypatch.setattr(run, "run_job", lambda command, env: 0)
    monkeypatch.setenv("TRAINSPEC_COLLECTOR_MODE", "sidecar")
    (tmp_path / "r3" / "segments").mkdir(parents=True)
    assert main(["run", "--out", str(tmp_path), "--run-id", "r3", "--", "true"]) == 0
    out = capsys.readouterr().out
    assert f"did not take is in {tmp_path / 'r3'}" in out and "sent to" not in out


def test_a_run_inside_a_trainspec_run_job_gets_an_id_of_its_own(tmp_path, monkeypatch):
    """The outer run's TRAINSPEC_STORE_RUN_ID is in its job's environment: a sweep script
    run by `trainspec run` that starts `trainspec run` again joined the outer directory."""
    seen: list[str] = []
    monkeypatch.setattr(
        run, "run_job", lambda command, env: seen.append(env["TRAINSPEC_STORE_RUN_ID"]) or 0
    )
    monkeypatch.setenv("TRAINSPEC_STORE_RUN_ID", "outer")
    monkeypatch.setenv("TRAINSPEC_RUN_PID", "1")
    assert main(["run", "--out", str(tmp_path), "--", "true"]) == 0
    assert seen[0] != "outer"


def test_a_compaction_that_fails_is_one_line(tmp_path, capsys, monkeypatch):
    """A full disk at the end of the demo: "unexpected StoreError" through the catch-all."""
    import trainspec.store as store
    from tests.helpers.runs import make_compliant_run
    from trainspec.cli.main import CliError

    run_dir = make_compliant_run(tmp_path / "runs" / "demo", ranks=1, seconds=1.0)

    def full(path, *args, **kwargs):
        raise store.StoreError(f"{path}: compaction failed: No space left on device")

    monkeypatch.setattr(store, "compact", full)
    with pytest.raises(CliError, match="compaction failed: No space left on device"):
        demo._report(run_dir, tmp_path / "runs")


@pytest.mark.parametrize("command", ["demo", "run"])
def test_a_runs_root_that_is_a_run_s_own_directory_is_one_line(command, tmp_path, capsys):
    """The demo put the new run inside the old one, where the dashboard it pointed at could
    not see it (QA, 2026-11-27)."""
    old = tmp_path / "20261127-154951-542b12"
    (old / "segments").mkdir(parents=True)
    rest = ["--", "true"] if command == "run" else ["--steps", "5"]
    code = main([command, "--out", str(old), *rest])
    one_line_error(capsys, code, "--out", "is a run's directory", str(tmp_path))
    assert [p.name for p in old.iterdir()] == ["segments"]


def test_a_runs_root_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """An unwritable --out passed the mkdir and failed at the log's open as "unexpected
    PermissionError", after the banner (QA: `chattr +i`, since root writes anywhere)."""

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(run.tempfile, "TemporaryFile", refuse)
    code = main(["demo", "--out", str(tmp_path), "--steps", "5"])
    one_line_error(capsys, code, "--out", "cannot create the runs directory", "not permitted")


def test_the_printed_commands_are_quoted_for_a_shell(tmp_path, capsys, monkeypatch):
    """`--out "my runs/ü ñ"` printed `trainspec dashboard my runs/ü ñ`, which a shell runs
    as three arguments (QA, 2026-11-27)."""
    import shlex

    import pyarrow as pa

    import trainspec.cli.summary
    import trainspec.store

    out = tmp_path / "my runs" / "ü ñ"
    run_dir = out / "r1"
    monkeypatch.setattr(trainspec.cli.summary, "run_summary", lambda path: pa.table({"rank": [0]}))
    monkeypatch.setattr(trainspec.store, "compact", lambda path: path / "run.duckdb")
    monkeypatch.setattr(demo, "_validate", lambda path: 0)
    assert demo._report(run_dir, out) == 0
    lines = capsys.readouterr().out.splitlines()
    (dashboard,) = [line for line in lines if line.startswith("dashboard: ")]
    assert shlex.split(dashboard.removeprefix("dashboard: ")) == [
        "trainspec",
        "dashboard",
        str(out),
    ]
    (query,) = [line for line in lines if line.startswith("query it: ")]
    assert shlex.split(query.removeprefix("query it: "))[:3] == ["trainspec", "query", str(run_dir)]
