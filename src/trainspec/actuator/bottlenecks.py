"""Communication-bound and input-bound detection from the shares of the step.

Communication-bound: the exposed communication share of the step on the rank that waits
least. Taking the minimum over ranks matters: behind a straggler every fast rank waits in
its all-reduce, which is the straggler's cost, not the network's. Input-bound: the data-wait
share on the rank that waits most (one slow loader stalls everyone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainspec.actuator.findings import Finding
from trainspec.actuator.summary import RankSummary
from trainspec.actuator.windowed import Latch


def exposed_comm_share(summaries: list[RankSummary]) -> float:
    return min(s.share_of_step(s.comm_exposed_s) for s in summaries)


def data_wait_share(summaries: list[RankSummary]) -> tuple[float, int]:
    shares = [s.share_of_step(s.data_wait_s) for s in summaries]
    worst = max(range(len(shares)), key=lambda r: shares[r])
    return shares[worst], worst


@dataclass
class CommBoundDetector:
    enter_share: float = 0.3
    exit_share: float = 0.2
    patience: int = 2
    latch: Latch = field(default_factory=Latch)

    def __post_init__(self) -> None:
        self.latch.patience = self.patience

    @property
    def active(self) -> bool:
        return self.latch.active

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        share = exposed_comm_share(summaries)
        change = self.latch.update(share > self.enter_share, share < self.exit_share)
        if change is None:
            return []
        word = "is" if change == "enter" else "is no longer"
        return [
            Finding(
                "comm_bound",
                f"the job {word} communication-bound: exposed all-reduce is {share:.0%} of the "
                f"step on the rank that waits least (enter > {self.enter_share:.0%}, "
                f"exit < {self.exit_share:.0%})",
                evidence={"exposed_share": round(share, 4)},
                cleared=change == "exit",
                severity="warning" if change == "enter" else "info",
            )
        ]


@dataclass
class InputBoundDetector:
    enter_share: float = 0.2
    exit_share: float = 0.1
    patience: int = 2
    latch: Latch = field(default_factory=Latch)

    def __post_init__(self) -> None:
        self.latch.patience = self.patience

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        share, rank = data_wait_share(summaries)
        change = self.latch.update(share > self.enter_share, share < self.exit_share)
        if change is None:
            return []
        word = "is" if change == "enter" else "is no longer"
        return [
            Finding(
                "input_bound",
                f"rank {rank} {word} input-bound: waiting for data is {share:.0%} of its step",
                ranks=(rank,),
                evidence={"data_wait_share": round(share, 4)},
                cleared=change == "exit",
                severity="warning" if change == "enter" else "info",
            )
        ]
