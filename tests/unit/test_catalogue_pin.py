"""The standard is pinned: metric names, units and instruments per catalogue version.

Changing a metric's name, unit or instrument (or adding or removing one) without bumping
the catalogue's version fails here; a new version adds its own pinned table below.
"""

from __future__ import annotations

from trainspec.schema import load_catalogue

PINNED_0_1 = {
    "trainspec.gpu.utilization": ("1", "gauge"),
    "trainspec.gpu.memory.utilization": ("1", "gauge"),
    "trainspec.process.cpu.utilization": ("1", "gauge"),
    "trainspec.host.cpu.utilization": ("1", "gauge"),
    "trainspec.gpu.memory.used": ("By", "gauge"),
    "trainspec.gpu.memory.limit": ("By", "gauge"),
    "trainspec.memory.allocator.allocated": ("By", "gauge"),
    "trainspec.memory.allocator.reserved": ("By", "gauge"),
    "trainspec.memory.allocator.fragmentation": ("1", "gauge"),
    "trainspec.memory.allocator.alloc_retries": ("{retry}", "counter"),
    "trainspec.memory.allocator.ooms": ("{oom}", "counter"),
    "trainspec.memory.pressure": ("1", "gauge"),
    "trainspec.process.memory.rss": ("By", "gauge"),
    "trainspec.host.memory.used": ("By", "gauge"),
    "trainspec.host.memory.limit": ("By", "gauge"),
    "trainspec.comm.probe.latency": ("s", "histogram"),
    "trainspec.comm.allreduce.duration": ("s", "histogram"),
    "trainspec.step.comm_exposed": ("s", "histogram"),
    "trainspec.grad.norm": ("{norm}", "gauge"),
    "trainspec.grad.variance": ("{variance}", "gauge"),
    "trainspec.grad.noise_scale": ("{sample}", "gauge"),
    "trainspec.step.duration": ("s", "histogram"),
    "trainspec.step.data_wait": ("s", "histogram"),
    "trainspec.step.forward": ("s", "histogram"),
    "trainspec.step.backward": ("s", "histogram"),
    "trainspec.step.optimizer": ("s", "histogram"),
    "trainspec.step.samples": ("{sample}", "counter"),
    "trainspec.step.tokens": ("{token}", "counter"),
    "trainspec.step.throughput": ("{sample}/s", "gauge"),
    "trainspec.step.loss": ("{loss}", "gauge"),
    "trainspec.step.mfu": ("1", "gauge"),
    "trainspec.gpu.power": ("W", "gauge"),
    "trainspec.gpu.energy": ("J", "counter"),
    "trainspec.gpu.temperature": ("Cel", "gauge"),
    "trainspec.gpu.clock.sm": ("Hz", "gauge"),
    "trainspec.gpu.throttle_reasons": ("{bitmask}", "gauge"),
    "trainspec.gpu.errors.ecc": ("{error}", "counter"),
    "trainspec.gpu.errors.remapped_rows": ("{row}", "counter"),
    "trainspec.gpu.pcie.throughput": ("By/s", "gauge"),
    "trainspec.gpu.nvlink.throughput": ("By/s", "gauge"),
    "trainspec.comm.bytes": ("By", "counter"),
    "trainspec.checkpoint.duration": ("s", "histogram"),
    "trainspec.checkpoint.stall": ("s", "histogram"),
    "trainspec.checkpoint.size": ("By", "gauge"),
    "trainspec.faults": ("{fault}", "event"),
    "trainspec.anomalies": ("{anomaly}", "event"),
    "trainspec.actions": ("{action}", "event"),
    "trainspec.telemetry.dropped": ("{point}", "counter"),
}

# 0.2: critical Xid errors (NVML events) added.
PINNED_0_2 = {**PINNED_0_1, "trainspec.gpu.errors.xid": ("{error}", "counter")}

PINNED = {"0.1": PINNED_0_1, "0.2": PINNED_0_2}


def test_catalogue_matches_the_pinned_standard_for_its_version():
    cat = load_catalogue()
    assert cat.version in PINNED, (
        f"catalogue version {cat.version} has no pinned table: add one to this test"
    )
    actual = {m.name: (m.unit, m.instrument) for m in cat}
    expected = PINNED[cat.version]
    changed = {
        n: (expected.get(n), actual.get(n))
        for n in expected.keys() | actual.keys()
        if expected.get(n) != actual.get(n)
    }
    assert not changed, f"changed without a version bump (pinned, now): {changed}"


def test_pinned_prometheus_names_are_derived_and_unique():
    cat = load_catalogue()
    names = [m.prometheus_name for m in cat]
    assert len(set(names)) == len(names) == len(PINNED[cat.version])
    assert cat["trainspec.gpu.utilization"].prometheus_name == "trainspec_gpu_utilization_ratio"
    assert cat["trainspec.comm.bytes"].prometheus_name == "trainspec_comm_bytes_total"
    assert cat["trainspec.step.duration"].prometheus_name == "trainspec_step_duration_seconds"
