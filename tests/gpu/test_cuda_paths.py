"""The CUDA paths on a real GPU: NVML samplers, the allocator sampler, CUDA-event phase
timing, the Triton int8 kernels, the hook on CUDA tensors (gloo) and on NCCL, the pinned
checkpoint stager, and the demo end to end on `--device cuda`.

Skipped where no CUDA device is visible (CI has none). Run them on a GPU machine with
`python -m pytest -q tests/gpu` (`.ci/gpu` runs them with the GPU benchmarks). Each test
prints what it measured; with TRAINSPEC_GPU_REPORT=FILE set, it also appends it to FILE as
one JSON line, the figures docs/benchmarks.md records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.check_script import run_check_script
from tests.integration.test_hook_multirank import TOLERANCE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]

REPO = Path(__file__).parents[2]
SCRIPTS = REPO / "tests" / "integration" / "scripts"


def report(name: str, figures: dict[str, Any]) -> None:
    line = json.dumps({"test": name, **figures}, default=str)
    print(line)
    path = os.environ.get("TRAINSPEC_GPU_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


class EarlyReads:
    """Counts host values read before their copy landed: such a read waits for the device,
    and torch's sync debug mode does not see an event wait. Reads after `closing` is set
    (the session's close, which must have every value) are not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from trainspec.host_copy import HostValues

        self.reads: list[str] = []
        self.closing = False
        floats = HostValues.floats

        def checked(values: HostValues) -> list[float]:
            if not self.closing and not values.ready():
                self.reads.append("read before its copy landed")
            return floats(values)

        monkeypatch.setattr(HostValues, "floats", checked)


def train_without_syncs(
    train: Any, warm_up: int, steps: int, early: EarlyReads, ts: Any, root: Path
) -> Path:
    """`train(warm_up)`, then `train(steps)` under torch's sync debug mode 'error' (a sync
    in a step raises), then close the session (its reads may wait); the run's folder."""
    train(warm_up)  # cuBLAS, the allocator and the optimizers' state set up first
    torch.cuda.set_sync_debug_mode("error")
    try:
        train(steps)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    early.closing = True  # the reads at close are meant to wait
    ts.close()
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


def _busy(seconds: float) -> None:
    """Keep the GPU computing for about `seconds` (utilization and power to read)."""
    a = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = torch.tanh(a @ a * 1e-3)
        torch.cuda.synchronize()


@pytest.mark.timeout(60)
def test_nvml_sampler_reads_the_jobs_gpu() -> None:
    from trainspec.collector.samplers.nvml import NvmlSampler, visible_nvml_indices

    sampler = NvmlSampler(visible_nvml_indices(0), interval_s=0.05)
    assert sampler.unavailable_reason() is None
    readings: list[tuple[str, float, str]] = []
    try:
        for tick in range(40):  # 2 s at 50 ms, the GPU busy for the second half
            if tick == 20:
                _busy(0.3)
            readings += sampler.sample(time.time())
            time.sleep(0.05)
    finally:
        sampler.close()
    by_name: dict[str, list[float]] = {}
    for name, value, _ in readings:
        by_name.setdefault(name, []).append(value)
    attrs = json.loads(readings[0][2])
    total = torch.cuda.get_device_properties(0).total_memory
    report("nvml", {
        "gpu": sampler.gpus[0].name,
        "attrs": attrs,
        "metrics": {k: [min(v), max(v), len(v)] for k, v in sorted(by_name.items())},
        "unsupported": sorted(m for _, m in sampler._unsupported),
        "power_kind": sorted({json.loads(a).get("trainspec.power.kind") for n, _, a in readings
                              if n == "trainspec.gpu.power"}),
    })  # fmt: skip
    assert attrs["hw.id"].startswith("GPU-") and attrs["gpu.index"] == 0
    for metric in (
        "trainspec.gpu.memory.used",
        "trainspec.gpu.memory.limit",
        "trainspec.gpu.utilization",
        "trainspec.gpu.power",
        "trainspec.gpu.temperature",
        "trainspec.gpu.clock.sm",
        "trainspec.gpu.energy",
    ):
        assert metric in by_name, metric
    # NVML counts the whole framebuffer, torch what it may allocate: within a few percent
    assert abs(by_name["trainspec.gpu.memory.limit"][0] - total) / total < 0.05
    assert 0 < max(by_name["trainspec.gpu.memory.used"]) <= by_name["trainspec.gpu.memory.limit"][0]
    assert all(0.0 <= u <= 1.0 for u in by_name["trainspec.gpu.utilization"])
    assert max(by_name["trainspec.gpu.utilization"]) > 0.0  # the busy spell was seen
    assert all(10.0 < p < 2000.0 for p in by_name["trainspec.gpu.power"])  # watts
    assert all(5.0 < t < 110.0 for t in by_name["trainspec.gpu.temperature"])  # Celsius
    assert max(by_name["trainspec.gpu.clock.sm"]) > 1e8  # hertz
    energy = by_name["trainspec.gpu.energy"]
    assert energy[-1] >= energy[0] > 0  # joules, a running total


@pytest.mark.timeout(60)
def test_allocator_sampler_sees_an_allocation() -> None:
    from trainspec.collector.samplers.allocator import AllocatorSampler

    sampler = AllocatorSampler(0)
    assert sampler.unavailable_reason() is None
    before = dict((n, v) for n, v, _ in sampler.sample(time.time()))
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    after = dict((n, v) for n, v, _ in sampler.sample(time.time()))
    del block
    report("allocator", {"before": before, "after": after})
    grown = (
        after["trainspec.memory.allocator.allocated"]
        - before["trainspec.memory.allocator.allocated"]
    )
    assert grown >= 256 << 20
    assert (
        after["trainspec.memory.allocator.reserved"]
        >= after["trainspec.memory.allocator.allocated"]
    )
    assert 0.0 < after["trainspec.memory.pressure"] <= 1.0


@pytest.mark.timeout(60)
def test_cuda_phase_clock_times_the_device_not_the_launch() -> None:
    from trainspec.runtime.step_timer import CudaPhaseClock

    clock = CudaPhaseClock(torch.device("cuda", 0))
    x = torch.randn(8192, 8192, device="cuda")
    (x @ x).sum().item()  # cuBLAS set up before the host clock starts
    host0 = time.perf_counter()
    a = clock.mark()
    for _ in range(30):
        x = x @ x * 1e-4
    b = clock.mark()
    launched_s = time.perf_counter() - host0  # the host is back before the device is done
    ready_at_once = clock.ready(b)
    torch.cuda.synchronize()
    device_s = time.perf_counter() - host0
    assert clock.ready(b)
    timed = clock.elapsed(a, b)
    report("cuda_phase_clock", {"launch_s": launched_s, "device_s": device_s, "event_s": timed,
                                "ready_at_once": ready_at_once})  # fmt: skip
    assert timed is not None and timed > 5 * launched_s
    assert 0.8 * device_s < timed <= device_s * 1.05


@pytest.mark.timeout(300)
def test_triton_int8_kernels_match_the_reference_on_the_gpu() -> None:
    result = run_check_script("kernels_triton_check.py", interpret=False, timeout_s=280)
    report("triton_int8", result)
    assert result["device"] == "cuda" and result["cases"] == 20
    assert result["codes_mismatch"] <= 1
    assert result["scale_max_abs"] < 1e-6
    assert result["residual_max_abs"] < 1e-5
    assert result["acc_max_abs"] < 1e-5
    assert result["codec_max_abs"] < 1e-5


@pytest.mark.timeout(300)
def test_triton_topk_kernels_match_the_reference_on_the_gpu() -> None:
    result = run_check_script("topk_triton_check.py", interpret=False, timeout_s=280)
    report("triton_topk", result)
    assert result["device"] == "cuda" and result["cases"] == 48
    assert result["auto_uses_triton"] is True
    # The arithmetic is the reference's, so values, residuals and sums may differ by float
    # rounding only (a fused multiply-add); a magnitude that rounds the other way at the
    # k-th place may swap one entry for its neighbour in rank, rarely.
    assert result["index_mismatches"] <= 2
    assert result["values_max_abs"] < 1e-5
    assert result["residual_max_abs"] < 1e-5
    assert result["sum_max_abs"] < 1e-5
    assert result["codec_sum_max_abs"] < 1e-5


def _hook_worker(scenario: str, world: int, backend: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{scenario}-{world}-{backend}.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HOOK_WORKER_DEVICE": "cuda",
        "HOOK_WORKER_BACKEND": backend,
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "kernels_hook_worker.py"), scenario, str(world), str(out)],
        env=env, capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _gpus_for(world: int, backend: str) -> None:
    """Skip unless NCCL can have a GPU per rank (it refuses two ranks on one device); gloo
    puts several ranks on one GPU."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} NCCL ranks need {world} GPUs, {torch.cuda.device_count()} visible")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "backend"), [(2, "gloo"), (1, "nccl"), (2, "nccl"), (4, "nccl")])
def test_hook_on_cuda_tensors_matches_a_plain_all_reduce(
    world: int, backend: str, tmp_path: Path
) -> None:
    """Every level on CUDA buckets (Triton int8, device futures): two ranks sharing the GPU
    over gloo's CUDA path, and NCCL with a GPU per rank (2 and 4 ranks where the machine
    has the GPUs; every machine lent so far had one)."""
    _gpus_for(world, backend)
    result = _hook_worker("compare", world, backend, tmp_path)
    report(f"hook_compare_{backend}_{world}", {k: v["rel_l2_err"] for k, v in result.items()})
    for level, tol in TOLERANCE.items():
        assert result[level]["rel_l2_err"] <= tol, (level, result[level])
    assert result["none"]["max_abs_diff"] < 1e-6
    for level, r in result.items():
        assert abs(r["grad_norm"] - r["applied_norm"]) <= 1e-5 * r["applied_norm"], (level, r)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_uneven_shares_and_level_switches_on_cuda(backend: str, tmp_path: Path) -> None:
    _gpus_for(2, backend)
    shares = _hook_worker("shares", 2, backend, tmp_path)
    switch = _hook_worker("switch", 2, backend, tmp_path)
    report(f"hook_shares_switch_cuda_{backend}", {"shares_max_abs_diff": shares["max_abs_diff"],
                                       "plain_ddp_max_abs_diff": shares["plain_ddp_max_abs_diff"],
                                       "switch_levels": sorted(set(switch["levels"])),
                                       "switch_rank_diff": switch["param_max_rank_diff"],
                                       "losses_first_last": [switch["losses"][0], switch["losses"][-1]]})  # fmt: skip
    assert shares["max_abs_diff"] < 1e-5 * max(1.0, shares["grad_max_abs"])
    assert shares["plain_ddp_max_abs_diff"] > 100 * shares["max_abs_diff"]
    assert set(switch["levels"]) == {"none", "int8", "lowrank:2", "bf16", "int8:64", "topk:0.1"}
    assert switch["param_max_rank_diff"] == 0.0
    assert all(x == x for x in switch["losses"]) and switch["losses"][-1] < switch["losses"][0]


@pytest.mark.timeout(60)
def test_pinned_stager_snapshot_survives_the_next_step() -> None:
    from trainspec.runtime.checkpoint_staging import StateStager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).cuda()  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randn(64, 512, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    stager = StateStager(pin_memory=True)
    for _ in range(3):
        step()
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        staged = stager.stage(model, opt)
        step()  # the snapshot must not move with training
        for key, value in want.items():
            got = staged["model"][key]
            assert got.device.type == "cpu" and got.is_pinned(), key
            assert torch.equal(got, value), key
    report("pinned_stager", {"rebuilds": stager.rebuilds})
    assert stager.rebuilds <= 2  # the first save, and the optimizer's state appearing


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("compression", "ranks"), [("none", 1), ("int8", 1), ("int8", 2)])
def test_demo_on_cuda_trains_stores_and_validates(
    compression: str, ranks: int, tmp_path: Path
) -> None:
    """NCCL, a GPU per rank (the 2-rank case where the machine has two), NVML, CUDA-event
    phases and the allocator sampler live; the demo's own validation must pass, with the GPU
    metrics required."""
    _gpus_for(ranks, "nccl")
    env = {**os.environ, "TRAINSPEC_KERNELS_COMPRESSION": compression,
           "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "demo", "--ranks", str(ranks), "--device", "cuda",
         "--steps", "120", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from trainspec.store import query

    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    metrics = {r["metric"]: r for r in query(run_dir, """
        SELECT metric, count(*) AS n, min(value) AS lo, max(value) AS hi,
               median(ts - lag_ts) AS median_gap_s
        FROM (SELECT metric, value, ts, lag(ts) OVER (PARTITION BY metric, attrs ORDER BY ts)
              AS lag_ts FROM samples WHERE metric LIKE 'trainspec.gpu.%'
                                      OR metric LIKE 'trainspec.memory.allocator.%')
        GROUP BY metric ORDER BY metric""").to_pylist()}  # fmt: skip
    steps = query(run_dir, """SELECT count(*) AS n, median(duration_s) AS step_s,
        median(forward_s) AS fwd_s, median(backward_s) AS bwd_s, median(optimizer_s) AS opt_s,
        min(loss) AS min_loss, max(loss) AS max_loss, any_value(compression) AS level,
        median(comm_bytes) AS bytes FROM steps""").to_pylist()[0]  # fmt: skip
    report(f"demo_cuda_{compression}_{ranks}", {"steps": steps, "metrics": metrics,
                                        "stdout_tail": proc.stdout[-1500:]})  # fmt: skip
    assert steps["n"] == 120 * ranks
    for metric in ("trainspec.gpu.utilization", "trainspec.gpu.memory.used",
                   "trainspec.gpu.power", "trainspec.memory.allocator.reserved"):  # fmt: skip
        assert metric in metrics, metric
    assert metrics["trainspec.gpu.memory.used"]["median_gap_s"] < 0.1  # 50 ms sampling
    assert 0 < steps["fwd_s"] < steps["step_s"] and 0 < steps["bwd_s"] < steps["step_s"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batch", [None, 4])
def test_a_cuda_step_adds_no_device_synchronization(
    micro_batch: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss and the gradient statistics reach the host through pinned copies read once
    the step's events completed (host_copy.py): under torch's sync debug mode 'error', any
    `.item()`, `.cpu()` or `float()` of a CUDA tensor in a step would raise. The mode does not
    see an event wait, so a read before its copy landed (which would wait) fails here on its
    own; and the stored values must be those computed on the device."""
    import trainspec
    from tests.helpers.env import one_process
    from trainspec.store import query

    early = EarlyReads(monkeypatch)
    one_process(monkeypatch)
    ts = trainspec.init(run_root=tmp_path, device=torch.device("cuda", 0))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                              torch.nn.Linear(1024, 256)).cuda()  # fmt: skip
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model = ts.wrap(net, optimizer=opt, micro_batch_size=micro_batch)
    x = torch.randn(16, 256, device="cuda")
    chunks = 4 if micro_batch else 1
    truth: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, grad norm), left on the GPU

    def train(steps: int) -> None:
        for _ in range(steps):
            with ts.step(samples=16) as s:
                total = torch.zeros((), device="cuda")
                for part in x.chunk(chunks):
                    loss = model(part).pow(2).mean() / chunks
                    loss.backward()
                    total += loss.detach()
                norm = torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in net.parameters()])
                )
                truth.append((total.clone(), norm))
                opt.step()
                opt.zero_grad()
                s.loss = total

    run = train_without_syncs(train, 3, 20, early, ts, tmp_path)
    rows = query(
        run, "SELECT step, loss, grad_norm, grad_variance FROM steps ORDER BY step"
    ).to_pylist()
    report(f"no_sync_micro_{micro_batch}", {"steps": len(rows), "early_reads": len(early.reads)})
    assert not early.reads
    assert [r["step"] for r in rows] == list(range(23))
    for row, (loss, norm) in zip(rows, truth, strict=True):
        assert row["loss"] == pytest.approx(float(loss), rel=1e-6)
        assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
        assert (row["grad_variance"] is not None) == bool(micro_batch)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("level", ["none", "bf16", "int8"])
def test_a_ddp_backward_on_nccl_does_not_wait_for_its_statistics(level: str) -> None:
    """The hook's totals travel like the loss (kernels/late_stats.py): under sync debug mode
    'error' a backward with trainspec's hook on NCCL reads nothing to the host, and the norm
    read afterwards is the applied gradient's. (The next backward's first bucket may wait on
    the event of the step before's copy, which the mode does not see and which is meant: the
    GPU still holds the forward queued since, so it does not idle.)"""
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainspec.kernels import CompressionHook

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                  torch.nn.Linear(1024, 256)).cuda()  # fmt: skip
        ddp = DistributedDataParallel(net, bucket_cap_mb=0.5)
        hook = CompressionHook(level, local_batch_size=16)
        hook.register(ddp)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        x = torch.randn(16, 256, device="cuda")

        def step() -> torch.Tensor:
            ddp(x).pow(2).mean().backward()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
            opt.step()
            opt.zero_grad()
            return norm

        for _ in range(3):  # DDP rebuilds its buckets after the first; Triton compiles
            step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            norms = [step() for _ in range(10)]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        stats = hook.latest_stats()
        report(f"hook_no_sync_{level}", {"grad_norm": stats.grad_norm, "applied": float(norms[-1])})
        assert stats.step == 12 and stats.level == level
        assert stats.grad_norm == pytest.approx(float(norms[-1]), rel=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_models_in_one_process_add_no_device_synchronization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two models wrapped in one process (no DDP): the step's norm covers both, each model's
    taken at its update and read to the host only once landed (`host_copy`), so a step under
    sync debug mode 'error' raises nothing; the stored norm is both models' applied one.
    (Several DDP models, a HookSet, need two ranks; on one GPU NCCL takes only one.)"""
    import trainspec
    from tests.helpers.env import one_process
    from trainspec.store import query

    early = EarlyReads(monkeypatch)
    one_process(monkeypatch)
    ts = trainspec.init(run_root=tmp_path, device=torch.device("cuda", 0))
    torch.manual_seed(0)
    nets = [
        torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
        ).cuda()  # fmt: skip
        for _ in range(2)
    ]
    opts = [torch.optim.AdamW(n.parameters(), lr=1e-3) for n in nets]
    first, second = (ts.wrap(n, optimizer=o) for n, o in zip(nets, opts, strict=True))
    x = torch.randn(16, 256, device="cuda")
    norms: list[torch.Tensor] = []

    def train(steps: int) -> None:
        for _ in range(steps):
            with ts.step(samples=16):
                second(first(x)).pow(2).mean().backward()
                grads = [p.grad.norm() for n in nets for p in n.parameters()]
                norms.append(torch.linalg.vector_norm(torch.stack(grads)))
                for opt in opts:
                    opt.step()
                    opt.zero_grad()

    run = train_without_syncs(train, 3, 10, early, ts, tmp_path)
    rows = query(run, "SELECT step, grad_norm FROM steps ORDER BY step").to_pylist()
    report("two_models_no_sync", {"steps": len(rows), "early_reads": len(early.reads)})
    assert not early.reads
    assert [r["step"] for r in rows] == list(range(13))
    for row, norm in zip(rows, norms, strict=True):
        assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-4)


@pytest.mark.timeout(60)
def test_pooled_events_are_reused_once_read_and_follow_the_current_stream() -> None:
    """Phase marks and host copies take their events from a pool (`device_events`): a mark
    goes back once its step's durations are read and is recorded again by a later step; the
    stream object is cached per raw stream, so a script's `torch.cuda.stream(s)` still puts
    the next event on `s`."""
    from trainspec.device_events import recorder
    from trainspec.host_copy import HostValues
    from trainspec.runtime.step_timer import CudaPhaseClock, StepTiming

    clock = CudaPhaseClock(torch.device("cuda", 0))
    x = torch.randn(2048, 2048, device="cuda")
    timing = StepTiming(clock)
    timing.begin("forward")
    y = x @ x
    timing.end("forward")
    torch.cuda.synchronize()
    first = timing.seconds()["forward"]
    used = {id(m) for pairs in timing.marks.values() for pair in pairs for m in pair}
    later = StepTiming(clock)
    later.begin("forward")
    y = y @ x
    later.end("forward")
    reused = {id(m) for pairs in later.marks.values() for pair in pairs for m in pair}
    torch.cuda.synchronize()
    assert reused == used  # the read marks, not new events
    assert timing.seconds()["forward"] == first  # read once: not the reused events' times
    assert later.seconds()["forward"] is not None

    values = HostValues(y.sum())
    (event,) = values._events
    ((_, pinned),) = values._lent
    expected = float(y.sum())
    assert values.floats() == [pytest.approx(expected, rel=1e-5)]
    again = HostValues(-y.sum())
    assert again._events[0] is event  # given back by the read, taken by the next copy
    assert again._lent[0][1] is pinned  # the pinned buffer too
    assert again.floats() == [pytest.approx(-expected, rel=1e-5)]
    assert values.floats() == [pytest.approx(expected, rel=1e-5)]  # its own read, kept

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(40):
            a = torch.tanh(a @ a * 1e-3)
        on_side = recorder().record(0, timing=False)
    on_default = recorder().record(0, timing=False)
    torch.cuda.current_stream().synchronize()
    assert on_default.query()
    assert not on_side.query()  # behind the side stream's work, not the default stream's
    side.synchronize()
    assert on_side.query()
    report("pooled_events", {"device": event.trainspec_device, "forward_s": first})


@pytest.mark.timeout(300)
def test_fused_square_sum_matches_float64_and_keeps_its_table_in_a_training_loop() -> None:
    """The single process's step norm in one Triton launch (collector/fused_square_sum.py):
    the same checks as under the interpreter, on the GPU; then a training loop that sets
    gradients to None every step, whose captured norm equals torch's, taken by the kernel
    (a table built, the path still on) and, once warm, with no table built again (the
    caching allocator hands the gradients the same blocks: measured, not assumed)."""
    checks = run_check_script("fused_square_sum_check.py", interpret=False, timeout_s=280)

    from trainspec.collector.gradients import ParameterGradientNorm
    from trainspec.workload import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(block_size=32, n_layer=2, n_embd=128)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    norm = ParameterGradientNorm(model.parameters())
    x = torch.randint(0, 64, (8, 32), device="cuda")
    worst = 0.0
    builds_warm = 0
    for step in range(20):
        if step == 5:
            builds_warm = norm._fused[0].builds
        model(x, x)[1].backward()
        norm.capture()
        want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        got = norm.step_summary()
        assert got is not None
        worst = max(worst, abs(got.grad_norm - float(want)) / float(want))
        opt.step()
        opt.zero_grad(set_to_none=True)
    builds = norm._fused[0].builds
    from trainspec.collector import fused_square_sum

    report("fused_square_sum", {**checks, "loop_builds_first_5": builds_warm,
                                "loop_builds": builds, "loop_rel": worst,
                                "path_on": fused_square_sum.available()})  # fmt: skip
    assert checks["cases"] == 15 and max(checks["worst_rel"].values()) < 1e-6
    assert checks["builds_steady"] == 1 and checks["builds_after_move"] == 2
    assert checks["turns_ok"] and checks["turns_builds"] == 2
    assert checks["same_address_rel"] < 1e-6 and checks["same_address_builds"] == 2
    assert checks["model_sums"] == 1 and checks["model_rel"] < 1e-6
    assert worst < 1e-5
    assert fused_square_sum.available() and builds_warm >= 1
    assert builds == builds_warm, f"the gradients kept moving: {builds} tables in 20 steps"
