"""A small hysteresis latch shared by the threshold detectors (enter after k, leave after k)."""

from __future__ import annotations

from dataclasses import dataclass


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
