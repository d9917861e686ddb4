"""What every rank of a job must agree on, settled at `init` in one gather on the control group.

A setting given to one rank only (its own environment, a per-node config file) made the
ranks act apart: the collector off on rank 1 left rank 0's gradient hook carrying its
statistics in a bucket rank 1's plain DDP did not (gloo aborted the first backward); a
compression level on one rank hung the job; a checkpoint directory on one rank made it
alone create the checkpointer's group (aborted, nothing stored); `actuator.window_steps`
put the control gathers at different steps (60 s stall, actuator off); `actuator.rebalance`
or `dry_run` on one rank had the other move alone to uneven shares (some samples trained
twice, others dropped, silently, to the end of the run); an agent endpoint on one rank had
it alone wait in the operator actions' broadcast. The terms:

- the run id, and every setting that decides what the ranks do together (`JOB_WIDE`: the
  kernels', actuator's and checkpoint sections, the sampling and probe intervals): rank 0's
  on every rank, with one warning on a rank that was given others. `actuator.enabled` is the
  exception: off on any rank (its kill switch) is off on every rank;
- the gradient hook: on every rank where the collector is on on any (a rank whose collector
  is off still runs the hook, so its collectives match, and stores nothing);
- the latency probe: on only where every rank probes (a probe is an all-reduce);
- the operator actions' broadcast: on every rank where rank 0 has an agent endpoint (rank 0
  fetches them; the endpoint itself stays per node, for sidecar mode);
- the run store's root stays per rank (a node may mount shared storage at its own path);
  one that differs from rank 0's is said, since it splits the run unless it is the same
  directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Any

from trainspec.config import TrainspecConfig, kill_switch_on

log = logging.getLogger("trainspec.runtime")

# section -> its keys every rank takes from rank 0 (None: the whole section)
JOB_WIDE: dict[str, tuple[str, ...] | None] = {
    "kernels": None,
    "actuator": None,
    "checkpoint": None,
    "collector": ("interval_s", "probe_timeout_s"),
}


def job_wide(cfg: TrainspecConfig, kill_switch: bool = False) -> dict[str, dict[str, Any]]:
    """The job-wide settings of `cfg`, as plain values; the actuator off where this rank's
    kill switch is on (a config built without the environment has not read it)."""
    out: dict[str, dict[str, Any]] = {}
    for section, keys in JOB_WIDE.items():
        part = getattr(cfg, section)
        names = keys if keys is not None else tuple(f.name for f in fields(part))
        out[section] = {name: getattr(part, name) for name in names}
    out["actuator"]["enabled"] = bool(out["actuator"]["enabled"]) and not kill_switch
    return out


@dataclass(frozen=True)
class Terms:
    """One rank's side of the agreement."""

    run_id: str
    collector: bool  # this rank collects (`collector.enabled`)
    probe: bool  # this rank would probe (`collector.enabled` and `collector.probe`)
    operator_actions: bool  # this rank has an agent endpoint to take actions from
    store_root: str
    job: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, cfg: TrainspecConfig, run_id: str, store_root: str = "") -> Terms:
        on = bool(cfg.collector.enabled)
        return cls(
            run_id=run_id,
            collector=on,
            probe=on and bool(cfg.collector.probe),
            operator_actions=bool(cfg.agent.endpoint),
            store_root=store_root or cfg.store.root,
            job=job_wide(cfg, kill_switch_on()),
        )

    def as_wire(self) -> dict[str, Any]:
        """Plain values for the gather (no class of ours in another rank's pickle)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Agreement:
    """The job's terms: `hook` says whether trainspec's gradient hook goes on DDP models,
    `operator_actions` whether this rank joins the operator actions' broadcast."""

    run_id: str
    hook: bool
    probe: bool
    operator_actions: bool
    job: dict[str, dict[str, Any]]

    @classmethod
    def alone(cls, mine: Terms) -> Agreement:
        """A rank with no one to agree with (not distributed): its own terms."""
        return cls(mine.run_id, mine.collector, mine.probe, mine.operator_actions, mine.job)

    def applied_to(self, cfg: TrainspecConfig) -> TrainspecConfig:
        """`cfg` with the agreed settings (a copy: the caller's is untouched)."""
        changes: dict[str, Any] = {}
        for section, values in self.job.items():
            changes[section] = replace(getattr(cfg, section), **values)
        collector = changes.get("collector", cfg.collector)
        changes["collector"] = replace(collector, probe=collector.probe and self.probe)
        return replace(cfg, **changes)


def differences(mine: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]]) -> list[str]:
    """`section.key=mine (rank 0: theirs)` for every job-wide setting that differs."""
    out = []
    for section, values in mine.items():
        for key, value in values.items():
            other = theirs.get(section, {}).get(key, value)
            if other != value:
                out.append(f"{section}.{key}={value!r} (rank 0: {other!r})")
    return out


def settle(votes: list[dict[str, Any]], rank: int, *, say: bool = True) -> Agreement:
    """The agreement from every rank's `Terms.as_wire()` (in rank order), with the warnings
    this rank owes: a setting of its own that lost to rank 0's, a part that is on here but
    not everywhere, a store root of its own."""
    terms = [Terms(**vote) for vote in votes]
    first, mine = terms[0], terms[rank]
    job = {section: dict(values) for section, values in first.job.items()}
    if "actuator" in job:  # the kill switch on any rank holds on every rank
        job["actuator"]["enabled"] = all(t.job["actuator"]["enabled"] for t in terms)
    deal = Agreement(
        run_id=first.run_id,
        hook=any(t.collector for t in terms),
        probe=all(t.probe for t in terms),
        operator_actions=first.operator_actions,
        job=job,
    )
    if not say:  # settled before, and said then
        return deal
    unlike = [d for d in differences(mine.job, job) if not d.startswith("actuator.enabled=")]
    if unlike:
        log.warning(
            "trainspec: rank %d was given %s; every rank uses rank 0's (the ranks act together "
            "on these)", rank, ", ".join(unlike),
        )  # fmt: skip
    switched = [r for r, t in enumerate(terms) if not t.job["actuator"]["enabled"]]
    if switched and mine.job["actuator"]["enabled"]:
        log.warning("trainspec: the actuator is off on rank(s) %s (TRAINSPEC_ACTUATOR or "
                    "actuator.enabled): off on every rank", switched)  # fmt: skip
    if mine.store_root != first.store_root:
        log.warning(
            "trainspec: rank %d stores under %s, rank 0 under %s: the run is split unless "
            "both are one directory", rank, mine.store_root, first.store_root,
        )  # fmt: skip
    off = [r for r, t in enumerate(terms) if not t.collector]
    if not mine.collector and deal.hook:
        log.warning(
            "trainspec: the collector is off on this rank (%d) but not on every rank: its DDP "
            "model still carries trainspec's gradient hook, so that its collectives match "
            "theirs; nothing is collected here",
            rank,
        )
    elif mine.collector and off:
        log.warning("trainspec: the collector is off on rank(s) %s: they store nothing",
                    off)  # fmt: skip
    no_probe = [r for r, t in enumerate(terms) if not t.probe]
    if mine.probe and no_probe:
        log.warning(
            "trainspec: rank(s) %s run no latency probe (collector.enabled or "
            "collector.probe): no rank probes, since a probe waits for every rank",
            no_probe,
        )
    return deal


def agree(mine: Terms, group: Any, rank: int, world_size: int, *, say: bool = True) -> Agreement:
    """Every rank's terms, gathered on `group` (collective: every rank calls it at init);
    `say=False` settles without the warnings (terms settled and said before)."""
    import torch.distributed as dist

    votes: list[Any] = [None] * world_size
    dist.all_gather_object(votes, mine.as_wire(), group=group)
    return settle(votes, rank, say=say)
