"""Which probe durations every rank has seen, carried in the next probes' own all-reduce.

A rank that launches a probe late waits for the others inside it less than they wait for
it, so one rank's duration mixes network latency with the skew between ranks' threads. The
smallest duration over the ranks is the one measured by the last rank to arrive, whose
all-reduce had every peer already waiting: the latency. Each probe's payload carries this
rank's durations of the probes before it, one slot per lag, and the all-reduce (MAX over
negated durations) hands every rank that minimum, with no second collective. A slot stays
positive while any rank has not finished that probe yet; a later probe carries it again.

Not thread-safe: the sampler calls it under its own lock.
"""

from __future__ import annotations

UNKNOWN = 1.0  # a slot above 0: some rank had not finished that probe when it launched this one


class ProbeLedger:
    def __init__(self, lags: int) -> None:
        if lags < 1:
            raise ValueError(f"need at least one lag, got {lags}")
        self.lags = lags
        self._seconds: dict[int, float] = {}  # probe index -> this rank's duration
        self._stamps: dict[int, float] = {}  # probe index -> this rank's launch wall time
        self._reported_through = 0  # the highest probe index already read out

    def launched(self, index: int, stamp: float) -> list[float]:
        """The payload of probe `index` (1-based): slot i is this rank's negated duration of
        probe `index - i`, or UNKNOWN where it has not finished (or never ran)."""
        self._stamps[index] = stamp
        # Probes up to `lags - 1` before this one may still be running, and each reads out
        # the `lags` before it when it finishes: their stamps must outlive this launch.
        oldest = index - 2 * self.lags + 1
        for table in (self._stamps, self._seconds):
            for old in [k for k in table if k < oldest]:
                del table[old]
        return [
            -self._seconds[index - lag] if index - lag in self._seconds else UNKNOWN
            for lag in range(1, self.lags + 1)
        ]

    def finished(
        self, index: int, seconds: float | None, result: list[float]
    ) -> list[tuple[float, float]]:
        """Probe `index` completed here after `seconds` (None: it failed, so its own duration
        is never known), with the all-reduced payload `result`. Returns (launch stamp,
        latency) for each earlier probe that every rank has now finished, oldest first,
        each probe once."""
        if seconds is not None:
            self._seconds[index] = seconds
        out: list[tuple[float, float]] = []
        for lag in range(self.lags, 0, -1):
            earlier = index - lag
            if earlier <= self._reported_through or earlier < 1 or not result[lag - 1] <= 0:
                continue  # read out already, before the first probe, or not done everywhere
            stamp = self._stamps.get(earlier)
            if stamp is not None:
                out.append((stamp, -result[lag - 1]))
            self._reported_through = earlier
        return out
