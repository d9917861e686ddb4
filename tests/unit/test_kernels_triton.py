"""The Triton int8 and topk kernels against the torch reference, on CPU through Triton's
interpreter.

Runs in a subprocess because TRITON_INTERPRET must be set before Triton compiles anything.
Skipped, with the reason, where Triton is not installed (it is optional: `trainspec[triton]`).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.check_script import run_check_script


@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_the_torch_reference_under_the_interpreter() -> None:
    result = run_check_script("kernels_triton_check.py", interpret=True, timeout_s=170)
    assert result["cases"] == 20
    assert result["codes_mismatch"] <= 1
    assert result["scale_max_abs"] == 0.0
    assert result["residual_max_abs"] < 1e-5
    assert result["acc_max_abs"] < 1e-5
    assert result["codec_max_abs"] < 1e-5
    assert result["nonfinite_blocks"] == 2  # NaN and inf scales stay (was 1: NaN came out finite)


def test_triton_backend_without_triton_says_so() -> None:
    from trainspec.kernels import triton_int8

    if triton_int8.available():
        pytest.skip("triton is installed here; the missing-dependency path cannot be shown")
    import torch

    with pytest.raises(RuntimeError, match="triton is not installed"):
        triton_int8.quantize_with_feedback(torch.ones(4), 1.0, None, 256)


def test_triton_needs_a_power_of_two_block() -> None:
    from trainspec.kernels import triton_int8

    if not triton_int8.available():
        pytest.skip("triton is not installed")
    import torch

    with pytest.raises(ValueError, match="power-of-two"):
        triton_int8.quantize_with_feedback(torch.ones(4), 1.0, None, 100)


@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_topk_kernels_match_the_torch_reference_under_the_interpreter() -> None:
    result = run_check_script("topk_triton_check.py", interpret=True, timeout_s=170)
    assert result["cases"] == 48
    assert result["index_mismatches"] == 0  # the same selection, entry for entry
    assert result["values_max_abs"] == 0.0
    assert result["residual_max_abs"] == 0.0
    assert result["sum_max_abs"] == 0.0
    assert result["codec_sum_max_abs"] == 0.0
    assert result["codec_residual_max_abs"] == 0.0
    assert result["empty_values"] == 0
    assert result["auto_uses_triton"] is False  # on the CPU, auto is the torch reference


def test_a_topk_codec_names_a_bad_backend() -> None:
    from trainspec.kernels.codecs import TopKCodec

    with pytest.raises(ValueError, match="topk backend must be auto, torch or triton"):
        TopKCodec(0.1, backend="cuda")


def test_triton_topk_without_triton_says_so() -> None:
    from trainspec.kernels import triton_topk

    if triton_topk.available():
        pytest.skip("triton is installed here; the missing-dependency path cannot be shown")
    import torch

    with pytest.raises(RuntimeError, match="triton is not installed"):
        triton_topk.feedback_magnitude(torch.ones(4), 1.0, None)


def test_an_automatic_topk_backend_falls_back_once_where_the_kernels_fail(monkeypatch, caplog):
    """The Triton topk kernels have not run on a GPU yet: where they fail to compile or
    launch under `backend="auto"`, one warning, then the torch reference, with its result;
    a backend asked for by name raises."""
    import torch

    from trainspec.kernels import triton_topk
    from trainspec.kernels.codecs import TopKCodec
    from trainspec.kernels.codecs import topk as reference

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(reference, "_triton_usable", lambda device: True)
    monkeypatch.setattr(triton_topk, "feedback_magnitude", broken)
    monkeypatch.setattr(triton_topk, "scatter_add", broken)
    g, r = torch.randn(100), torch.randn(100) * 0.01
    want = reference.select_with_feedback(g, 0.5, r, 10)
    auto = TopKCodec(0.1)
    got = auto.select(g, 0.5, r, 10)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert auto.backend == "torch" and caplog.text.count("Triton topk kernels failed") == 1
    out = torch.zeros(100)
    auto.accumulate(out, want[0], want[1])  # the reference from here on: no second warning
    assert caplog.text.count("Triton topk kernels failed") == 1 and out.abs().sum() > 0
    with pytest.raises(RuntimeError, match="no kernel image"):
        TopKCodec(0.1, backend="triton").select(g, 0.5, r, 10)
