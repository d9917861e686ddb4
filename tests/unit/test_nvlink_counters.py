"""NVLink traffic from NVML's running totals: the aggregate scope, the per-link fallback, resets,
and a GPU without NVLink, against a stand-in that keeps pynvml's field-value conventions."""

from __future__ import annotations

import json
import sys

import pytest

from trainspec.collector.samplers.nvlink import ALL_LINKS, NvlinkCounters

pynvml = pytest.importorskip("pynvml")

TX, RX = 138, 139
NOT_SUPPORTED, INVALID_ARGUMENT = 3, 2


def _field_value(ret: int, stamp_us: int, total: int):
    """The struct nvidia-ml-py returns (its own ctypes class), filled as the driver fills it:
    a 64-bit unsigned counter."""
    value = pynvml.c_nvmlFieldValue_t()
    value.nvmlReturn = ret
    value.timestamp = stamp_us
    value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    value.value.ullVal = total
    return value


class FieldNvml:
    """Field values as pynvml returns them: a request item is an id (scope left at 0, as
    pynvml leaves it) or an (id, scope) tuple; each value carries its own return code and a
    microsecond timestamp. `links` holds each link's [tx KiB, rx KiB]."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = TX
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = RX

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, links: int, *, aggregate: bool = True) -> None:
        self.links = [[0, 0] for _ in range(links)]
        self.enabled = [True] * links
        self.aggregate = aggregate
        self.now_us = 1_000_000
        self.requests: list[list] = []
        self.fail_next = 0  # reads that fail as a whole (a timeout)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= len(self.links):
            raise self.NVMLError(INVALID_ARGUMENT)  # past the device's last link
        return self.NVML_FEATURE_ENABLED if self.enabled[link] else 0

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        self.requests.append(list(field_ids))
        if self.fail_next:
            self.fail_next -= 1
            raise self.NVMLError(10)  # NVML_ERROR_TIMEOUT
        out = []
        for item in field_ids:
            field, scope = item if isinstance(item, tuple) else (item, 0)
            column = 0 if field == TX else 1
            if scope == ALL_LINKS and self.aggregate:  # a driver may answer 0 with no link
                ret, total = 0, sum(link[column] for link in self.links)
            elif scope < len(self.links):
                ret, total = 0, self.links[scope][column]
            else:
                ret, total = (INVALID_ARGUMENT if scope == ALL_LINKS else NOT_SUPPORTED), 0
            out.append(_field_value(ret, self.now_us, total))
        return out

    def send(self, link: int, tx_kib: int, rx_kib: int, seconds: float) -> None:
        self.links[link][0] += tx_kib
        self.links[link][1] += rx_kib
        self.now_us += int(seconds * 1e6)


def test_rates_are_summed_over_every_link_through_the_aggregate_scope():
    nv = FieldNvml(links=4)
    counters = NvlinkCounters(nv, "h")
    assert counters.read() == []  # a first total has nothing to be differenced against
    nv.send(0, 1024, 512, 0.0)
    nv.send(3, 1024, 0, 0.5)  # 2 MiB out, 0.5 MiB in over half a second
    assert dict(counters.read()) == {"transmit": 4 * 2**20, "receive": 2**20}
    # asked as (field, UINT_MAX) tuples: a bare id would have read link 0 alone
    assert nv.requests[-1] == [(TX, ALL_LINKS), (RX, ALL_LINKS)]


def test_a_driver_without_the_aggregate_scope_is_read_link_by_link():
    nv = FieldNvml(links=2, aggregate=False)
    counters = NvlinkCounters(nv, "h")
    counters.read()
    nv.send(0, 100, 10, 0.0)
    nv.send(1, 300, 30, 2.0)
    assert dict(counters.read()) == {"transmit": 400 * 1024 / 2, "receive": 40 * 1024 / 2}
    assert nv.requests[-1] == [(TX, 0), (RX, 0), (TX, 1), (RX, 1)]


def test_a_counter_that_goes_backwards_starts_over_instead_of_going_negative():
    nv = FieldNvml(links=1)
    counters = NvlinkCounters(nv, "h")
    nv.send(0, 5000, 5000, 1.0)
    counters.read()
    nv.links[0] = [10, 10]  # driver reloaded: totals from zero again
    nv.now_us += 1_000_000
    assert counters.read() == []
    nv.send(0, 1, 2, 1.0)
    assert dict(counters.read()) == {"transmit": 1024.0, "receive": 2048.0}


def test_one_link_reset_is_seen_even_when_the_others_grew_more():
    nv = FieldNvml(links=2, aggregate=False)
    counters = NvlinkCounters(nv, "h")
    nv.send(0, 5000, 5000, 1.0)
    counters.read()
    nv.links[0] = [0, 0]  # link 0 reset
    nv.send(1, 6000, 6000, 1.0)  # the sum still grew
    assert counters.read() == []


def test_a_change_of_clock_starts_over_instead_of_a_near_zero_rate():
    nv = FieldNvml(links=1)
    counters = NvlinkCounters(nv, "h")
    stamp, nv.now_us = nv.now_us, 0  # a read without a driver timestamp: host clock
    counters.read()
    nv.now_us = stamp + 1_000_000
    nv.send(0, 1024, 1024, 0.0)
    assert counters.read() == []  # host seconds against driver seconds: not a rate
    nv.send(0, 1024, 1024, 1.0)
    assert dict(counters.read()) == {"transmit": 2**20, "receive": 2**20}


@pytest.mark.parametrize("links", [0, 2])
def test_a_gpu_without_active_nvlink_is_left_out_not_reported_as_zero(links):
    nv = FieldNvml(links=links)  # the driver answers the aggregate scope with 0 regardless
    nv.enabled = [False] * links
    with pytest.raises(FieldNvml.NVMLError):
        NvlinkCounters(nv, "h")


def test_the_nvml_sampler_reports_nvlink_per_direction_and_rides_out_a_failed_read(
    monkeypatch,
):
    from tests.unit.test_hardware_health import FakeNvml

    class WithLinks(FakeNvml, FieldNvml):
        def __init__(self) -> None:
            FakeNvml.__init__(self)
            FieldNvml.__init__(self, links=2)

    from trainspec.collector.samplers.nvml import NvmlSampler

    fake = WithLinks()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler(["0"])
    assert sampler.unavailable_reason() is None

    def nvlink_readings() -> list[tuple[float, str]]:
        out = []
        for _ in range(10):  # NVLink is read every tenth tick
            out += [(v, a) for m, v, a in sampler.sample(0.0) if m.endswith("nvlink.throughput")]
        return out

    assert nvlink_readings() == []  # the first read only sets the totals
    fake.send(1, 2048, 1024, 1.0)
    by_direction = {json.loads(a)["direction"]: v for v, a in nvlink_readings()}
    assert by_direction == {"transmit": 2048 * 1024.0, "receive": 1024 * 1024.0}
    fake.fail_next = 1  # one read times out: no reading, and the next starts over
    assert nvlink_readings() == []
    nvlink_readings()
    fake.send(0, 512, 512, 0.5)
    by_direction = {json.loads(a)["direction"]: v for v, a in nvlink_readings()}
    assert by_direction == {"transmit": 2**20, "receive": 2**20}
    sampler.close()


def test_the_nvml_sampler_asks_a_gpu_without_nvlink_once(monkeypatch):
    from tests.unit.test_hardware_health import FakeNvml

    class NoLinks(FakeNvml, FieldNvml):
        def __init__(self) -> None:
            FakeNvml.__init__(self)
            FieldNvml.__init__(self, links=0)

    from trainspec.collector.samplers.nvml import NvmlSampler

    fake = NoLinks()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler(["0"])
    assert sampler.unavailable_reason() is None
    for _ in range(30):
        assert not [m for m, _, _ in sampler.sample(0.0) if "nvlink" in m]
    assert fake.requests == []  # no active link: the counters were never asked for
    sampler.close()
