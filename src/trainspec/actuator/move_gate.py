"""When the rebalance policy may move shares: patience, one quick follow-up, back-off.

The policy says where shares should go; this gate says whether to go now. A move needs
`patience` windows in a row that each predict a worthwhile gain. Right after a considered
move, one follow-up needs only `settle_patience` windows, and only if it goes the same way:
the move gave the speed model its second share, so the fitted line can correct the first,
per-sample guess at once, while a follow-up that would undo the move is noise, not news.
Each considered move doubles the patience the next one needs (up to `max_backoff` x; back
to 1x when shares return to equal; not applied once the straggler has recovered): a neighbour slowing a rank for a few windows is what a
shared host does all day, and chasing it costs more than it gains. After any move the gate
waits `cooldown` windows and counts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def same_way(before: list[int], after: list[int]) -> bool:
    """True when `after` moves no rank against the direction `before` moved it."""
    return any(after) and all(a * b >= 0 for a, b in zip(before, after, strict=True))


@dataclass
class MoveGate:
    patience: int = 2
    settle_patience: int = 1
    max_backoff: int = 4
    cooldown: int = 0
    _run: int = 0
    _cooling: int = 0
    _settling: int = 0  # windows left in which a same-way follow-up needs settle_patience
    _settling_now: bool = False
    _quick: bool = False
    _backoff: int = 1  # the patience a considered move needs now, in multiples of patience
    _last_move: list[int] = field(default_factory=list)  # new - old shares of the last move

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be at least 1, got {self.patience}")
        if not 1 <= self.settle_patience <= self.patience:
            raise ValueError(
                f"settle_patience must be in [1, patience={self.patience}], "
                f"got {self.settle_patience}"
            )
        if self.max_backoff < 1 or self.cooldown < 0:
            raise ValueError(
                f"need max_backoff >= 1 and cooldown >= 0, got {self.max_backoff}, {self.cooldown}"
            )

    def open_window(self) -> bool:
        """Start a window; False while cooling down (the window then counts for nothing)."""
        if self._cooling > 0:
            self._cooling -= 1
            return False
        self._settling_now = self._settling > 0
        self._settling = max(0, self._settling - 1)
        return True

    def reset(self) -> None:
        """A window without usable measurements: the run of gaining windows starts again."""
        self._run = 0

    def ready(
        self,
        gain: float,
        move: list[int],
        *,
        min_gain: float,
        follow_min_gain: float,
        back_off: bool = True,
    ) -> bool:
        """Count this window; True when `move` (new - current shares) may happen now. `gain`
        is the predicted step-time gain of the move's target: above `min_gain` for a
        considered move, above `follow_min_gain` for the quick follow-up.
        `back_off=False` waits plain patience (the straggler has recovered: going back is
        news, not noise)."""
        quick = self._settling_now and same_way(self._last_move, move)
        if quick != self._quick:
            self._run = 0  # a run counts windows judged against one bar only
        self._quick = quick
        threshold = follow_min_gain if quick else min_gain
        self._run = self._run + 1 if gain > threshold else 0
        considered = self.patience * (self._backoff if back_off else 1)
        return self._run >= (self.settle_patience if self._quick else considered)

    @property
    def needed_windows(self) -> int:
        """Windows in a row a considered move needs now (patience x back-off)."""
        return self.patience * self._backoff

    def moved(self, move: list[int], *, back_to_equal: bool, back_off: bool = True) -> None:
        """Record that `move` was made (`back_off=False`: the straggler has recovered)."""
        self._run, self._cooling = 0, self.cooldown
        self._settling = 0 if self._quick else self.patience
        if back_to_equal or not back_off:
            self._backoff = 1
        elif not self._quick:
            self._backoff = min(self._backoff * 2, self.max_backoff)
        self._last_move = list(move)
