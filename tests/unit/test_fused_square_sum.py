"""The fused sum of squares (collector/fused_square_sum.py): the single process's step norm
in one Triton launch on CUDA, checked on CPU through Triton's interpreter.

The interpreter runs in a subprocess: TRITON_INTERPRET must be set before Triton compiles
anything. Skipped, with the reason, where Triton is not installed (it is optional)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.helpers.check_script import run_check_script
from trainspec.collector import fused_square_sum as fss
from trainspec.collector.gradients import ParameterGradientNorm, square_sums_of


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_one_launch_sums_every_gradient_as_float64_would_under_the_interpreter() -> None:
    r = run_check_script("fused_square_sum_check.py", interpret=True, timeout_s=110)
    assert r["cases"] == 15
    # float32 sums of 4096-element blocks, added in float64: a few ulps of float32 at most.
    assert max(r["worst_rel"].values()) < 1e-6, r["worst_rel"]
    # A steady loop builds its table once and gives the same value each time; a gradient
    # that moved (a new tensor) gets a new table, and the sum follows it.
    assert r["steady_equal"] and r["steady_rel"] < 1e-6
    assert r["builds_steady"] == 1 and r["builds_after_move"] == 2
    assert r["moved_rel"] < 1e-6
    assert r["turns_ok"] and r["turns_builds"] == 2
    assert r["same_address_rel"] < 1e-6 and r["same_address_builds"] == 2
    # Where one launch cannot be exact, the caller's foreach path takes over.
    assert r["mixed_dtypes"] and r["non_contiguous"] and r["empty"] and r["integer"]
    # Through the collector's entry, one float64 sum equal to the foreach path's.
    assert r["model_sums"] == 1 and r["model_fused_dtype"] == "torch.float64"
    assert r["model_rel"] < 1e-6


def test_cpu_gradients_keep_the_foreach_path() -> None:
    """Not CUDA (and no interpreter asked for): no Triton, the torch path's float32 sum."""
    a = torch.zeros(3, requires_grad=True)
    a.grad = torch.tensor([3.0, 4.0, 12.0])
    assert fss.FusedSquareSum().square_sum([a.grad]) is None
    sums = square_sums_of([a], fss.FusedSquareSum())
    assert len(sums) == 1 and sums[0].dtype == torch.float32 and float(sums[0]) == 169.0


def test_too_many_elements_keep_the_foreach_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model past MAX_ELEMENTS keeps its GPU busy longer than the foreach path's host time:
    it is left to that path, even where the fused one could run."""
    monkeypatch.setattr(fss, "MAX_ELEMENTS", 10)
    fused = fss.FusedSquareSum(interpret=True)
    assert fused.square_sum([torch.ones(11)]) is None
    assert fused.builds == 0


def test_each_watched_model_has_its_own_table() -> None:
    """Two models in one process: each keeps its own table (one table shared would be
    rebuilt at every capture, as the two models' addresses alternate)."""
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(4, 4)
    norm = ParameterGradientNorm(first.parameters())
    norm.watch(second.parameters())
    assert len(norm._fused) == 2 and norm._fused[0] is not norm._fused[1]


@pytest.mark.skipif(not fss.available(), reason="triton is not installed")
def test_a_launch_that_fails_turns_the_fused_path_off_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU or Triton the kernel does not build for: the capture falls back to torch's
    foreach path, says so once in the process, and no model tries the kernel again."""
    monkeypatch.setattr(fss, "_off", [])
    calls = []

    def broken(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(fss, "_launch", broken)
    a = torch.zeros(2, requires_grad=True)
    a.grad = torch.tensor([3.0, 4.0])
    with caplog.at_level("WARNING", logger="trainspec.collector"):
        first = square_sums_of([a], fss.FusedSquareSum(interpret=True))
        second = square_sums_of([a], fss.FusedSquareSum(interpret=True))  # another model
    assert [float(s) for s in first] == [float(s) for s in second] == [25.0]
    assert len(calls) == 1
    assert sum("fused gradient norm off" in r.message for r in caplog.records) == 1
    assert not fss.available()


@pytest.mark.parametrize(
    ("value", "interpreting"),
    [("1", True), ("true", True), ("0", False), ("", False), (None, False)],
)
def test_cuda_gradients_stay_off_the_fused_path_while_triton_interprets(
    monkeypatch: pytest.MonkeyPatch, value: str | None, interpreting: bool
) -> None:
    """TRITON_INTERPRET runs kernels on the host, where a table of device addresses would
    crash the process: CUDA gradients then keep the foreach path."""
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert fss._interpreting() is interpreting


@pytest.mark.skipif(not fss.available(), reason="triton is not installed")
def test_a_first_sum_that_disagrees_with_torch_turns_the_path_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that runs but sums wrongly (some GPU or Triton version) would report a wrong
    norm for the whole run: the process's first fused sum is checked against torch's float64
    sum, and a disagreement turns the path off, the foreach path's value taken instead."""
    monkeypatch.setattr(fss, "_off", [])
    monkeypatch.setattr(fss, "_checked", [])
    monkeypatch.setattr(fss, "_launch", lambda table: torch.tensor(26.0, dtype=torch.float64))
    a = torch.zeros(2, requires_grad=True)
    a.grad = torch.tensor([3.0, 4.0])
    with caplog.at_level("WARNING", logger="trainspec.collector"):
        sums = square_sums_of([a], fss.FusedSquareSum(interpret=True))
    assert [float(s) for s in sums] == [25.0]
    assert not fss.available() and "read 26.0, torch's 25.0" in fss._off[0]
    assert sum("fused gradient norm off" in r.message for r in caplog.records) == 1


@pytest.mark.skipif(not fss.available(), reason="triton is not installed")
def test_a_right_first_sum_is_checked_once_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fss, "_off", [])
    monkeypatch.setattr(fss, "_checked", [])
    checks = []
    real = fss._check_once
    monkeypatch.setattr(fss, "_check_once", lambda r, g: checks.append(1) or real(r, g))
    monkeypatch.setattr(fss, "_launch", lambda table: torch.tensor(25.0, dtype=torch.float64))
    a = torch.zeros(2, requires_grad=True)
    a.grad = torch.tensor([3.0, 4.0])
    fused = fss.FusedSquareSum(interpret=True)
    assert [float(fused.square_sum([a.grad])) for _ in range(3)] == [25.0] * 3
    assert checks == [1] and fss.available()


def test_tensor_subclass_gradients_keep_the_foreach_path() -> None:
    """DTensor (FSDP2, tensor parallel) and other subclasses have no plain storage at the
    address a table would hold (a DTensor's data_ptr is 0, its numel the global size): the
    kernel would read from nowhere, which no fallback catches. They keep torch's path."""

    class Wrapped(torch.Tensor):
        pass

    g = torch.tensor([3.0, 4.0]).as_subclass(Wrapped)
    assert not fss._one_launch_applies([g])
    assert fss.FusedSquareSum(interpret=True).square_sum([g]) is None
    assert not fss._one_launch_applies([torch.tensor([1.0]), g])


def test_the_one_check_waits_for_a_finite_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss scaler's skipped first steps have inf gradients, where any comparison is
    False: such a sum leaves the check for a later one, which still catches a wrong kernel."""
    monkeypatch.setattr(fss, "_checked", [])
    inf = torch.tensor(math.inf, dtype=torch.float64)
    fss._check_once(inf, [torch.tensor([math.inf, 1.0])])
    assert fss._checked == []
    with pytest.raises(fss.WrongSum, match="read 26.0"):
        fss._check_once(torch.tensor(26.0, dtype=torch.float64), [torch.tensor([3.0, 4.0])])
    assert fss._checked == [True]


def test_a_check_that_cannot_run_is_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fss, "_checked", [])

    class Unreadable(torch.Tensor):
        def __float__(self) -> float:
            raise RuntimeError("called a synchronizing CUDA operation")

    result = torch.tensor(25.0, dtype=torch.float64).as_subclass(Unreadable)
    fss._check_once(result, [torch.tensor([3.0, 4.0])])  # does not raise
    assert fss._checked == [True]  # and is not tried again
