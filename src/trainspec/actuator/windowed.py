"""A small hysteresis latch shared by the threshold detectors (enter after k, leave after k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainspec.actuator.state_fields import read_bool, read_count


@dataclass
class Latch:
    patience: int = 2
    active: bool = False
    _run: int = 0

    def update(self, entering: bool, leaving: bool) -> str | None:
        """Feed one window; returns "enter" or "exit" on a transition, else None."""
        wanted = leaving if self.active else entering
        self._run = self._run + 1 if wanted else 0
        if self._run >= self.patience:
            self._run = 0
            self.active = not self.active
            return "enter" if self.active else "exit"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "run": self._run}

    def load_state_dict(self, state: Any) -> None:
        """Missing keys keep their value; raises StateError naming a bad one."""
        active, run = read_bool(state, "active", self.active), read_count(state, "run", self._run)
        self.active, self._run = active, run
