"""On-disk layout of trainspec checkpoints: directories, the commit marker, validation, retention.

    <root>/step_000000120_<nonce>/      one checkpoint (nonce: new at each job launch and each
        .metadata, __0_0.distcp, ...    load, so neither a resumed job nor one that rolled back
                                        writes into the directory of a step saved before)
        extra/rank<r>.json              per-rank state dcp does not hold (RNG, sampler, ...)
        extra/rank<r>.tensors.pt        optional: tensors only rank r holds (error feedback)
        COMMIT                          JSON manifest: step, world size, every file's size and
                                        CRC32, whether the saved state is finite and the
                                        anomaly in progress when it was taken; written last,
                                        by rank 0, after every rank's data

A directory without COMMIT does not exist as far as loading goes, and one with COMMIT is
never written into again (runtime/checkpoint.py refuses). The manifest's checksums
catch a corrupt or missing file before any byte reaches the model, because dcp stores raw
tensor bytes and would otherwise load garbage without complaint.

A step saved more than once (retraced after a rollback, or by another launch) has a directory
per save; the listing orders them by commit time, newest last, so the newest is loaded first.

A diverged job must not lose its last good state to its own later saves. `finite: false` in
the manifest (a tensor saved held a NaN, or a trained parameter or optimizer state an
infinity) marks a checkpoint
that never counts toward `keep_last` and is loaded only when no finite one verifies
(`load_order`); `anomaly` (a loss spike or non-finite loss in progress, as the actuator's
checkpoint policy saw it) marks one taken during trouble, and retention always keeps the
newest checkpoint taken before the trouble began (`apply_retention`). A manifest without
these keys (older ones) reads as finite and taken in no anomaly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

COMMIT_NAME = "COMMIT"
EXTRA_DIR = "extra"
FORMAT_VERSION = 1
_DIR_RE = re.compile(r"^step_(\d{9})_([0-9a-f]+)$")
_ASIDE_PREFIX = "damaged-"
_ASIDE_RE = re.compile(r"^damaged-step_(\d{9})_[0-9a-f]+(?:\.\d+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; training must not go on from it."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files do not match its manifest (corrupt or missing shard)."""


class WorldSizeMismatchError(CheckpointError):
    """The newest committed checkpoint was written by a job of another world size."""


class SamplerMismatchError(CheckpointError):
    """The newest committed checkpoint's sampler was saved with another dataset, global batch
    or seed: this job cannot continue its sample order."""


@dataclass(frozen=True)
class CheckpointDir:
    path: Path
    step: int
    nonce: str

    @property
    def commit_path(self) -> Path:
        return self.path / COMMIT_NAME

    def is_committed(self) -> bool:
        return self.commit_path.is_file()


def dir_name(step: int, nonce: str) -> str:
    return f"step_{step:09d}_{nonce}"


def extra_path(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / EXTRA_DIR / f"rank{rank}.json"


def rank_tensors_path(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / EXTRA_DIR / f"rank{rank}.tensors.pt"


def _named_dirs(root: Path, pattern: re.Pattern[str]) -> list[tuple[Path, re.Match[str]]]:
    """The directories under `root` whose names match `pattern`, with the match."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = pattern.match(child.name)
        if match and child.is_dir():
            found.append((child, match))
    return found


def list_checkpoints(root: Path) -> list[CheckpointDir]:
    """Every checkpoint directory under `root`, committed or not, oldest first: by step, and
    the saves of one step (a step retraced after a rollback) by when they were committed."""
    found = [CheckpointDir(d, int(m.group(1)), m.group(2)) for d, m in _named_dirs(root, _DIR_RE)]
    return sorted(found, key=lambda c: (c.step, *_commit_time(c)))


def _commit_time(c: CheckpointDir) -> tuple[float, float]:
    """(the marker's mtime, the clock reading in its manifest); (0, 0) for none. The
    manifest's reading breaks a tie of mtimes, which a file system with coarse timestamps (one
    or two seconds) gives two saves of one step close together."""
    try:
        mtime = c.commit_path.stat().st_mtime
    except OSError:
        return 0.0, 0.0
    try:
        stamp = json.loads(c.commit_path.read_text()).get("committed_unix_s", 0.0)
    except (OSError, ValueError, AttributeError):
        return mtime, 0.0
    return mtime, float(stamp) if isinstance(stamp, (int, float)) else 0.0


def committed_newest_first(root: Path) -> list[CheckpointDir]:
    return [c for c in reversed(list_checkpoints(root)) if c.is_committed()]


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: a crash leaves the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _data_files(ckpt_dir: Path) -> list[Path]:
    # Temporary names (ours and dcp's) are excluded: only renamed, finished files count.
    return sorted(
        p
        for p in ckpt_dir.rglob("*")
        if p.is_file() and p.name != COMMIT_NAME and ".tmp" not in p.name
    )


def write_commit(
    ckpt_dir: Path,
    *,
    step: int,
    world_size: int,
    reason: str,
    finite: bool = True,
    anomaly: str | None = None,
) -> int:
    """Seal a checkpoint whose every rank has finished writing; returns its size in bytes.
    `finite`: every saved parameter and optimizer state is finite on every rank; `anomaly`:
    the trouble in progress when it was taken (None: none), both read back by `marks`."""
    files = {}
    total = 0
    for path in _data_files(ckpt_dir):
        size = path.stat().st_size
        files[str(path.relative_to(ckpt_dir))] = {"bytes": size, "crc32": _crc32(path)}
        total += size
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "reason": reason,
        "finite": bool(finite),
        "anomaly": anomaly,
        "committed_unix_s": time.time(),
        "files": files,
    }
    write_atomic(ckpt_dir / COMMIT_NAME, json.dumps(manifest, indent=1).encode())
    return total


def read_manifest(c: CheckpointDir) -> dict:
    """The commit marker's manifest; CorruptCheckpointError unless it has the shape
    `write_commit` gives it (a JSON object whose files each have an int size and CRC32)."""
    try:
        manifest = json.loads(c.commit_path.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{c.commit_path}: unreadable commit marker ({exc})") from exc
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{c.commit_path}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT_VERSION or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(
            f"{c.commit_path}: unknown manifest format {manifest.get('format')!r}"
        )
    for rel, entry in manifest["files"].items():
        if not (
            isinstance(entry, dict)
            and all(type(entry.get(key)) is int for key in ("bytes", "crc32"))
        ):
            raise CorruptCheckpointError(
                f"{c.commit_path}: manifest entry for {rel} lacks an integer size and crc32"
            )
    return manifest


def verify(c: CheckpointDir, *, world_size: int) -> dict:
    """Check the world size and every file against the manifest; returns the manifest."""
    manifest = read_manifest(c)
    if manifest.get("world_size") != world_size:
        raise WorldSizeMismatchError(
            f"checkpoint {c.path} was written by {manifest.get('world_size')} ranks, "
            f"this job has {world_size}; refusing to resume from it"
        )
    for rel, expect in manifest["files"].items():
        path = c.path / rel
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {c.path}: missing file {rel}")
        size = path.stat().st_size
        if size != expect["bytes"] or _crc32(path) != expect["crc32"]:
            raise CorruptCheckpointError(
                f"checkpoint {c.path}: {rel} does not match its manifest (corrupt: {size} bytes, "
                f"expected {expect['bytes']} with crc32 {expect['crc32']})"
            )
    for rank in range(world_size):
        if str(extra_path(c.path, rank).relative_to(c.path)) not in manifest["files"]:
            raise CorruptCheckpointError(f"checkpoint {c.path}: manifest lacks rank {rank}'s state")
    return manifest


def marks(c: CheckpointDir) -> tuple[bool, str | None]:
    """(finite, anomaly) of a committed checkpoint, from its manifest; an unreadable manifest
    or one written before these keys existed reads as (True, None): verifying it at load is
    what finds damage."""
    try:
        manifest = read_manifest(c)
    except CheckpointError:
        return True, None
    anomaly = manifest.get("anomaly")
    return manifest.get("finite") is not False, anomaly if isinstance(anomaly, str) else None


def load_order(root: Path) -> list[CheckpointDir]:
    """The committed checkpoints in the order to try loading them: newest first, those whose
    weights are not finite after every finite one (a diverged state is resumed from only
    when nothing else loads)."""
    committed = committed_newest_first(root)
    finite = {c.path for c in committed if marks(c)[0]}
    return [c for c in committed if c.path in finite] + [
        c for c in committed if c.path not in finite
    ]


def remove(c: CheckpointDir) -> None:
    """Un-commit first, so a crash halfway through deleting never leaves a committed husk."""
    with contextlib.suppress(OSError):
        c.commit_path.unlink(missing_ok=True)
    shutil.rmtree(c.path, ignore_errors=True)


def set_aside(c: CheckpointDir) -> Path:
    """Rename `c` out of the listing (`damaged-<name>`, numbered if taken); its new path."""
    for n in range(1000):
        target = c.path.with_name(f"{_ASIDE_PREFIX}{c.path.name}" + (f".{n}" if n else ""))
        if not target.exists():
            c.path.rename(target)
            return target
    raise FileExistsError(f"no free name to set {c.path} aside")


def set_aside_steps(root: Path) -> list[tuple[Path, int]]:
    """The directories `set_aside` renamed under `root`, with the step each was saved at."""
    found = [(d, int(m.group(1))) for d, m in _named_dirs(root, _ASIDE_RE)]
    return sorted(found, key=lambda item: item[1])


def _stale_debris(c: CheckpointDir, newest: CheckpointDir) -> bool:
    """An uncommitted directory no writer can still be filling, given that `newest` was just
    committed: one of an older step, or of the same step under another job launch's nonce (a
    save killed before its commit, redone by the restarted job). Every rank of the job that
    committed `newest` passed the commit barrier and saves one step at a time, so nothing
    of its own is in flight, and one job at a time writes under a root: the launch that
    left the directory at or below `newest`'s step is gone. A newer uncommitted directory is
    left alone (a dead launch's too, until this job's commits pass its step)."""
    if c.is_committed():
        return False
    return c.step < newest.step or (c.step == newest.step and c.nonce != newest.nonce)


def _retained(committed: list[CheckpointDir], keep_last: int) -> list[CheckpointDir]:
    """Which of `committed` (oldest first) retention keeps: the newest `keep_last` whose
    weights are finite; the newest finite one taken in no anomaly (the last state before the
    trouble began), however many anomaly checkpoints came after it; and, as the evidence of a
    divergence, the newest one whose weights are not finite while no finite one is newer.
    A checkpoint of a diverged state never counts toward `keep_last`, so saves made after a
    divergence can never rotate the last good state out."""
    marked = [(c, *marks(c)) for c in committed]
    finite = [c for c, ok, _ in marked if ok]
    kept = finite[-keep_last:]
    clean = [c for c, ok, anomaly in marked if ok and anomaly is None]
    if clean and clean[-1] not in kept:
        kept.append(clean[-1])
    diverged = [c for c, ok, _ in marked if not ok]
    if diverged and (not finite or diverged[-1].step > finite[-1].step):
        kept.append(diverged[-1])
    return kept


def apply_retention(root: Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` committed checkpoints whose weights are finite, the newest
    one taken before an anomaly (`_retained`); drop older ones and stale debris
    (`_stale_debris`: uncommitted directories no save can still be writing).
    A checkpoint set aside as damaged is kept for a person to look at until `keep_last`
    committed finite checkpoints newer than it exist, then dropped like the good ones of its
    age: a job that keeps finding damage must not fill the disk with it."""
    all_dirs = list_checkpoints(root)
    committed = [c for c in all_dirs if c.is_committed()]
    if not committed:
        return []
    keep = {c.path for c in _retained(committed, keep_last)}
    newest = committed[-1]
    removed = []
    for c in all_dirs:
        if (c.is_committed() and c.path not in keep) or _stale_debris(c, newest):
            remove(c)
            removed.append(c.path)
    finite = [c for c in committed if c.path in keep and marks(c)[0]]
    if len(finite) >= keep_last:
        oldest = finite[-keep_last].step
        for path, step in set_aside_steps(root):
            if step < oldest:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed
