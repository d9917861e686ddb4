"""The environment of a one-process `trainspec.init` in a test: no launcher variables (the
test runner may itself run under torchrun), no run id from outside, no latency probe."""

from __future__ import annotations

from typing import Any

LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TRAINSPEC_STORE_RUN_ID",
)


def one_process(monkeypatch: Any) -> None:
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRAINSPEC_COLLECTOR_PROBE", "0")
