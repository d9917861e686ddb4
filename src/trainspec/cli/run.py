"""`trainspec run [options] -- torchrun ... script.py`: instrument an unmodified script.

Also `trainspec run -- python script.py` for a single process (started by this command
itself; a Python process further down, under a shell script, is not instrumented unless it
is a torchrun worker).

Like `opentelemetry-instrument`, it changes the environment, not the script: it puts
trainspec's `sitecustomize` on PYTHONPATH, so each torchrun worker patches torch at start-up
(see trainspec.runtime.auto), and gives every rank the same run id.

SIGINT and SIGTERM sent to it are passed on to the job, whose end it waits for; it exits
with the job's status. What the job printed is the job's: when it fails, this command adds
one line saying so and what was stored, on stderr, and neither repeats nor hides the rest,
and stores a `job_failed` event in the run (`cli/job_exit.py`). The steps the line counts
are this job's: a job given the run id of an earlier one (`--run-id`) adds to that run.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainspec.cli.child import run_job
from trainspec.cli.main import CliError

if TYPE_CHECKING:
    from trainspec.config import TrainspecConfig


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=runs_root, default=None, help="runs root (default: config store.root)"
    )
    parser.add_argument("--run-id", default=None, help="run id (default: generated)")
    parser.add_argument(
        "--prometheus-port", type=port_number, default=0, help="serve /metrics from this base port"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command, e.g. torchrun ..."
    )


def runs_root(text: str) -> str:
    """argparse type of --out: a path that is not empty (`--out ""` stored under the
    configured root, or the working directory, without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give the runs root, e.g. --out runs")
    return text


def port_number(text: str) -> int:
    """argparse type of --prometheus-port: 0 (off) or a TCP port. A rank that cannot bind
    an impossible port must not be where this is found out."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def checked_config() -> TrainspecConfig:
    """The configuration the ranks will load (TOML from TRAINSPEC_CONFIG, then TRAINSPEC_*),
    checked here so a bad file is one line naming the key, not a traceback from every rank."""
    from trainspec.config import ConfigError, load_config
    from trainspec.levels import LEVEL_RULES

    try:
        return load_config(extra_rules=LEVEL_RULES)  # the runtime's rules (runtime/init.py)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc


def check_ports_free(addr: str, base: int, count: int) -> None:
    """Raise CliError unless `count` ports from `base` can be bound on `addr`, as the ranks'
    /metrics servers will (base + local rank); a rank that cannot bind only logs a warning."""
    for port in range(base, base + count):
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                addr, port, 0, socket.SOCK_STREAM
            )[0]
            with socket.socket(family, kind, proto) as sock:
                # as http.server does, so a port in TIME_WAIT is not taken for one in use
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
        except OSError as exc:  # EADDRINUSE, EADDRNOTAVAIL, an unresolvable address (gaierror)
            reason = exc.strerror or str(exc)
            where = f"{addr}:{port} (base {base} + local rank {port - base})"
            raise CliError(f"Prometheus endpoint: cannot listen on {where}: {reason}") from exc


def make_runs_root(root: Path, where: str) -> Path:
    """Create the runs directory before any rank starts; CliError naming `where` if it cannot
    be made or written, or is a run's own directory (a new run inside it is one that neither
    the dashboard nor `query` of that root would find)."""
    from trainspec.store.layout import is_run_dir

    if is_run_dir(root):
        raise CliError(
            f"{where} {root}: is a run's directory; give the runs root it is in ({root.parent})"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()  # writable: the launcher's log goes here
    except OSError as exc:
        raise CliError(
            f"{where} {root}: cannot create the runs directory: {exc.strerror or exc}"
        ) from exc
    return root


def autoload_dir() -> Path:
    import trainspec.runtime

    return Path(trainspec.runtime.__file__).parent / "autoload"


def run(args: argparse.Namespace) -> int:
    from trainspec.runtime.identity import new_run_id
    from trainspec.store.layout import check_run_id

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise CliError(
            "give the command to run after --, e.g. trainspec run -- torchrun --nproc-per-node 2 train.py"
        )
    try:
        given = check_run_id(args.run_id) if args.run_id is not None else None
    except ValueError as exc:  # the run id names the run's directory under --out
        raise CliError(f"--run-id: {exc}") from exc
    cfg = checked_config()  # with --out too: the ranks load the same file
    # --run-id, else store.run_id (TOML or TRAINSPEC_STORE_RUN_ID, checked as the file was
    # loaded), else a new one: the variable was overwritten with a new id, without a word.
    # Inside a job `trainspec run` started (a sweep script run by it), the variable is the
    # outer run's: every inner run would have joined its directory.
    inherited = "TRAINSPEC_RUN_PID" in os.environ
    run_id = given or ("" if inherited else cfg.store.run_id) or new_run_id()
    # Found out here, not by every rank as a run that stores nothing.
    root = make_runs_root(Path(args.out or cfg.store.root), "--out" if args.out else "store.root")
    env = dict(os.environ)
    env["TRAINSPEC_AUTO"] = "1"
    env["TRAINSPEC_RUN_PID"] = str(os.getpid())  # `-- python train.py`: that process is the job
    env["TRAINSPEC_STORE_RUN_ID"] = run_id
    env["TRAINSPEC_STORE_ROOT"] = str(root)
    if args.prometheus_port:
        env["TRAINSPEC_COLLECTOR_PROMETHEUS_PORT"] = str(args.prometheus_port)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(autoload_dir()), env.get("PYTHONPATH", "")) if p
    )
    started_at = time.time()  # this job's rows are those stored from now on
    try:
        code = run_job(command, env)
    except FileNotFoundError as exc:
        raise CliError(f"command not found: {command[0]}") from exc
    except OSError as exc:  # not executable, a directory...
        raise CliError(f"cannot run {command[0]}: {exc.strerror or exc}") from exc
    sidecar = cfg.collector.mode == "sidecar"
    line = summary_line(run_id, root / run_id, sidecar=sidecar, since=started_at)
    if code == 0:
        print(f"trainspec run: {line}")
    else:  # the job's own traceback and torchrun's summary are above it, left as they are
        line += failure_note(root / run_id, code, started_at=started_at)
        print(f"trainspec run: the job exited with code {code}; {line}", file=sys.stderr)
    return code


def failure_note(run_dir: Path, code: int, *, started_at: float) -> str:
    """Store the failed job's `job_failed` event in its run, where the run is stored here
    (after `summary_line`: a killed rank's journaled steps are stored by then); words for
    the last line when it could not be. Never changes the exit status."""
    from trainspec.cli.job_exit import record_job_failure

    if not _stored_here(run_dir):  # nothing stored, or all of it by the node's agent
        return ""
    try:
        record_job_failure(run_dir, code, started_at=started_at)
    except Exception as exc:  # noqa: BLE001 - the job's status is what this command reports
        return f"; the job's failure was not stored in the run ({exc})"
    return ""


def summary_line(run_id: str, run_dir: Path, *, sidecar: bool, since: float | None = None) -> str:
    """The command's last line: what the run stored, and what the job stored elsewhere when
    its script started trainspec itself with another run id or runs root (the line said
    "nothing stored" with the steps in another run). `since`: the job's start (unix
    seconds): the steps counted are those stored from then on (`count_steps`)."""
    from trainspec.runtime.run_note import take_notes

    elsewhere = take_notes(run_dir)
    parts = []
    for where in [run_dir, *elsewhere]:
        note = salvaged_note(where)  # first: the steps counted below include them
        if where is not run_dir:
            chose = (f"run id {where.name} over {run_id}" if where.name != run_id
                     else f"runs root {where.parent} over {run_dir.parent}")  # fmt: skip
            line = stored_line(where.name, where, sidecar=sidecar, since=since)
            parts.append(f"the script chose {chose}: {line}{note}")
        elif not elsewhere or _stored_here(where) or note:
            parts.append(stored_line(run_id, where, sidecar=sidecar, since=since) + note)
    return "; ".join(parts)


def _stored_here(run_dir: Path) -> bool:
    return (run_dir / "segments").is_dir() or (run_dir / "run.duckdb").is_file()


def stored_line(run_id: str, run_dir: Path, *, sidecar: bool, since: float | None = None) -> str:
    """What the run stored (the steps since `since`, when given), for the last line."""
    stored_here = _stored_here(run_dir)
    if sidecar and not stored_here:  # the node's agent stores the run, in its own store
        return f"run {run_id} sent to the trainspec-agent"
    if not stored_here:
        return (
            f"nothing stored for run {run_id} (no training step was seen; any warnings are above)"
        )
    counted = count_steps(run_dir, since=since)
    if sidecar:
        held = "" if counted is None else f" ({_held(*counted)})"
        return (f"run {run_id}: what the trainspec-agent did not take is in {run_dir}{held}; "
                "the rest is in the agent's store")  # fmt: skip
    if counted is None:
        return f"run {run_id} stored in {run_dir}"
    return f"run {run_id} stored in {run_dir} ({_held(*counted)})"


def salvaged_note(run_dir: Path) -> str:
    """Store what a killed rank journaled and never flushed (its process is gone now);
    words for the last line when there was some. Never changes the exit status."""
    from trainspec.store.journal import salvage_run

    if not (run_dir / "journal").is_dir():
        return ""
    try:
        done = salvage_run(run_dir)
    except Exception as exc:  # noqa: BLE001 - `trainspec compact` tries again
        return f"; journaled rows not stored ({exc}); `trainspec compact` tries again"
    if not done.total:
        return ""
    return f"; {done.total} journaled rows no flush had stored were stored from the journal"


def _held(steps: int, ranks: int) -> str:
    if not ranks:
        return "no steps"
    return f"{steps} step{'s' * (steps != 1)}, {ranks} rank{'s' * (ranks != 1)}"


def count_steps(run_dir: Path, *, since: float | None = None) -> tuple[int, int] | None:
    """The most steps a rank stored (a step a restart ran again once: 134 were said for a
    120-step job), and how many ranks stored any; with `since` (unix seconds), only the
    steps that ended from then on: a job appended to a run (`--run-id` of an earlier job)
    was said to store the whole run's. None when the run cannot be read (the line then
    says less: it never changes the job's exit status)."""
    where = "" if since is None else "WHERE ts >= $since"
    try:
        import trainspec.store as store

        con = store.open(run_dir)
        try:
            row = con.execute(
                "SELECT coalesce(max(n), 0), count(*) FROM (SELECT rank, count(DISTINCT step) "
                f"AS n FROM steps {where} GROUP BY rank)",
                {} if since is None else {"since": since},
            ).fetchone()
        finally:
            con.close()
    except Exception:  # noqa: BLE001 - a damaged or foreign run: `trainspec validate` says why
        return None
    return (int(row[0]), int(row[1])) if row is not None else None
