"""Why a checkpoint did not load, in one line each, and what makes one unfit for this job.

dcp reports a failed load on any rank as a `CheckpointException` whose text is every failing
rank's remote traceback: cut at 500 characters it ended inside the traceback, before the
cause (a resume with another model printed 117 lines and never said "size mismatch"). The
cause is the exception each rank raised, kept in `exc.failures` (rank -> (exception, stack));
`failure_cause` names it, once for all the ranks that raised the same.

A checkpoint whose sampler was saved with another dataset, global batch, world size or seed
loads no sample order this job can follow: `sampler_misfit` says so before anything is
loaded into the model (it was found after model and optimizer were overwritten, as a raw
`SamplerStateError` traceback from every rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

MAX_CAUSE_CHARS = 300


def one_line(text: str, limit: int = MAX_CAUSE_CHARS) -> str:
    """`text` with its lines joined by spaces, cut to `limit` characters."""
    joined = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return joined if len(joined) <= limit else joined[: limit - 3].rstrip() + "..."


def _exception_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        return failure_cause(exc)
    try:
        text = str(exc)
    except Exception:  # an exception whose text cannot be made: its type says enough
        text = ""
    return one_line(f"{type(exc).__name__}: {text}" if text.strip() else type(exc).__name__)


def failure_cause(exc: BaseException) -> str:
    """One line naming what `exc` says went wrong: for dcp's CheckpointException the
    exception each rank raised (`ValueError: Size mismatch between saved torch.Size([64])
    and current: torch.Size([32]) for model.x (ranks 0, 1)`), not its tracebacks."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    if not isinstance(failures, dict) or not failures:
        if isinstance(exc, CheckpointException):  # no per-rank failures to read
            return one_line(type(exc).__name__ + ": " + str(exc).split("\n", 1)[0])
        return _exception_line(exc)
    by_cause: dict[str, list[Any]] = {}
    for rank in sorted(failures, key=str):
        wrapped = failures[rank]
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        line = _exception_line(inner) if isinstance(inner, BaseException) else one_line(str(inner))
        by_cause.setdefault(line, []).append(rank)
    parts = [
        f"{line} (rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)})"
        for line, ranks in by_cause.items()
    ]
    return one_line("; ".join(parts), limit=2 * MAX_CAUSE_CHARS)


def sampler_misfit(path: Path, sampler: Any, extra: Any) -> str:
    """Why `sampler` cannot continue from the sampler state in a checkpoint's `extra`
    (this rank's extra state), or "" when it can or there is nothing to check."""
    check = getattr(sampler, "check_state_dict", None)
    state = extra.get("sampler") if isinstance(extra, dict) else None
    if check is None or state is None:
        return ""
    try:
        check(state)
    except ValueError as exc:  # SamplerStateError
        return (
            f"checkpoint {path} was saved with another data setup ({exc}): resume with the "
            "dataset, global batch and seed it was saved with, or from another checkpoint "
            "directory"
        )
    return ""


def summarise_fallbacks(root: Path, failed: list[tuple[Path, str]]) -> str:
    """The final error where no checkpoint loaded, one line: the checkpoints that failed
    for one cause named together, then the cause (`step_..., step_...: dcp load failed: ...`)."""
    by_cause: dict[str, list[str]] = {}
    for path, error in failed:
        cause = error.removeprefix(f"checkpoint {path}: ")
        by_cause.setdefault(one_line(cause, limit=2 * MAX_CAUSE_CHARS), []).append(path.name)
    parts = [f"{', '.join(names)}: {cause}" for cause, names in by_cause.items()]
    return f"no committed checkpoint under {root} could be loaded: {'; '.join(parts)}"
