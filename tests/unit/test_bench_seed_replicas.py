"""The per-seed replica test of bench/compression_seeds.py and the `+ulpK` nudges it runs.

No training here: the statistics take final losses, the parser takes names, and the nudge
is checked on a small layer.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from bench import compression, compression_seeds
from bench.compression import _nudge_one_ulp, split_nudge, split_start
from bench.compression_seeds import (
    across_seeds,
    compare_replicas,
    replica_configs,
    replica_difference,
    t_sf,
)

from tests.helpers.cli import one_line_error

# --- the nudge suffix -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("none", ("none", None)),
        ("none+ulp", ("none", 0)),
        ("lowrank-bf16:12:3:exact+ulp3", ("lowrank-bf16:12:3:exact", 3)),
        ("torch:powersgd:6@3+ulp12", ("torch:powersgd:6@3", 12)),
        ("lowrank:4@4/int8+ulp1", ("lowrank:4@4/int8", 1)),
    ],
)
def test_split_nudge_accepts(config, expected):
    assert split_nudge(config) == expected


@pytest.mark.parametrize(
    "config",
    ["none+ulp0", "none+ulpx", "none+ulp01", "none+ulp-1", "none+ulp 2", "none+ulp٣",
     "none+up", "none+", "+ulp", "+ulp2"],
)  # fmt: skip
def test_split_nudge_refuses(config):
    with pytest.raises(ValueError, match="ulpK") as info:
        split_nudge(config)
    assert "\n" not in str(info.value)


def test_replica_configs_parse_back():
    names = replica_configs("torch:powersgd:6@3", 3, hook_seed=False)
    assert names == [
        "torch:powersgd:6@3",
        "torch:powersgd:6@3+ulp1",
        "torch:powersgd:6@3+ulp2",
        "torch:powersgd:6@3+ulp3",
    ]
    assert [split_nudge(n) for n in names] == [
        ("torch:powersgd:6@3", None),
        *(("torch:powersgd:6@3", k) for k in (1, 2, 3)),
    ]
    moved = replica_configs("lowrank-bf16:12:3:exact", 2)
    assert moved[1:] == ["lowrank-bf16:12:3:exact+ulp1+q1", "lowrank-bf16:12:3:exact+ulp2+q2"]
    assert [split_start(n) for n in moved] == [
        ("lowrank-bf16:12:3:exact", None, 0),
        *(("lowrank-bf16:12:3:exact", k, k) for k in (1, 2)),
    ]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("none", ("none", None, 0)),
        ("lowrank:4+q7", ("lowrank:4", None, 7)),
        ("torch:powersgd:6@3+ulp+q9999", ("torch:powersgd:6@3", 0, 9999)),
    ],
)
def test_split_start_accepts(config, expected):
    assert split_start(config) == expected


@pytest.mark.parametrize("config", ["+q1", "none+q0", "none+q01", "none+q10000", "none+q1+ulp1"])
def test_split_start_refuses(config):
    with pytest.raises(ValueError) as info:
        split_start(config)
    assert "\n" not in str(info.value)


def test_bad_suffix_is_one_line_before_any_run(monkeypatch, capsys):
    def no_runs(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(compression_seeds, "run_config", no_runs)
    monkeypatch.setattr(sys, "argv", ["compression_seeds.py", "--ours", "lowrank:4+ulpx"])
    one_line_error(capsys, compression_seeds.main(), "lowrank:4+ulpx", "ulpK")
    argv = ["compression_seeds.py", "--replicas", "2", "--theirs", "torch:powersgd:6@3+ulp1"]
    monkeypatch.setattr(sys, "argv", argv)
    one_line_error(capsys, compression_seeds.main(), "--replicas adds")
    monkeypatch.setattr(sys, "argv", ["compression_seeds.py", "--replicas", "-1"])
    one_line_error(capsys, compression_seeds.main(), "--replicas >= 0")

    monkeypatch.setattr(compression, "run_config", no_runs)
    monkeypatch.setattr(sys, "argv", ["compression.py", "--configs", "none,int8+ulp0"])
    one_line_error(capsys, compression.main(), "int8+ulp0")


def test_run_config_reports_a_bad_suffix_as_a_row():
    r = compression.run_config("none+ulpx", steps=30, batch=1, timeout_s=1.0)
    assert r["config"] == "none+ulpx" and "ulpK" in r["error"]


# --- the nudge itself -------------------------------------------------------------------


def _layer() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    with torch.no_grad():
        layer.bias[:8] = 0.0  # zeros move too, to the smallest subnormal either way
    return layer, [p.detach().clone() for p in layer.parameters()]


def _step(t: torch.Tensor, way: float) -> torch.Tensor:
    return torch.nextafter(t, torch.full_like(t, way))


def test_plain_ulp_moves_every_weight_one_step_up():
    layer, before = _layer()
    _nudge_one_ulp(layer)
    for p, b in zip(layer.parameters(), before):
        assert torch.equal(p, _step(b, math.inf))


def test_ulp_k_moves_every_weight_one_step_either_way_from_its_own_generator():
    layer, before = _layer()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    _nudge_one_ulp(layer, 3)
    assert torch.equal(torch.get_rng_state(), rng)  # the training seed's stream untouched
    ups = []
    for p, b in zip(layer.parameters(), before):
        up, down = p == _step(b, math.inf), p == _step(b, -math.inf)
        assert bool((up ^ down).all())  # exactly one step, never zero, never two
        ups.append(up.flatten())
    share_up = torch.cat(ups).float().mean().item()
    assert 0.4 < share_up < 0.6, share_up

    # The same K gives the same start whatever the global seed; another K another start.
    again, _ = _layer()
    torch.manual_seed(999)
    _nudge_one_ulp(again, 3)
    other, _ = _layer()
    _nudge_one_ulp(other, 4)
    for p, q in zip(layer.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, r) for p, r in zip(layer.parameters(), other.parameters()))


# --- the statistics ---------------------------------------------------------------------


def test_t_sf_against_closed_forms():
    assert t_sf(1.0, 1) == pytest.approx(0.25, abs=1e-12)  # Cauchy
    assert t_sf(2.0, 1) == pytest.approx(0.5 - math.atan(2) / math.pi, abs=1e-12)
    assert t_sf(2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6), abs=1e-12)  # 1/2 - t/2/sqrt(2+t^2)
    assert t_sf(2.446912, 6) == pytest.approx(0.025, abs=1e-6)  # the table's 97.5% point
    assert t_sf(2.0, 1e9) == pytest.approx(0.0227501, abs=1e-6)  # the normal's
    assert t_sf(-1.3, 4.5) == pytest.approx(1 - t_sf(1.3, 4.5), abs=1e-12)
    assert t_sf(math.inf, 3) == 0.0


def test_clear_worse_seed():
    ours, theirs = [2.10, 2.11, 2.09, 2.10], [2.00, 2.01, 1.99, 2.00]
    f = replica_difference(ours, theirs)
    assert f["verdict"] == "worse"
    assert f["ours_mean"] == pytest.approx(2.10) and f["theirs_mean"] == pytest.approx(2.00)
    assert f["diff"] == pytest.approx(0.05)
    # each side's sample variance (n - 1) is 0.0002 / 3; the ratio's first-order error
    var = 0.0002 / 3 / 4
    assert f["se"] == pytest.approx(math.sqrt(var / 2.0**2 + var * 2.1**2 / 2.0**4))
    assert f["t"] == pytest.approx(f["diff"] / f["se"]) and f["t"] > 10
    assert f["n_ours"] == f["n_theirs"] == 4


def test_clear_better_seed():
    f = replica_difference([2.00, 2.01, 1.99, 2.00], [2.10, 2.11, 2.09, 2.10])
    assert f["verdict"] == "better"
    assert f["diff"] == pytest.approx(2.00 / 2.10 - 1)
    assert f["t"] < -10


def test_tied_seed():
    f = replica_difference([2.00, 2.04, 1.97, 2.03], [2.01, 1.98, 2.05, 2.00])
    assert f["verdict"] == "tied"
    assert abs(f["diff"]) < 2 * f["se"]


@pytest.mark.parametrize(
    ("shift", "verdict"),
    [(0.0150, "worse"), (0.0105, "tied"), (-0.0105, "tied"), (-0.0150, "better")],
)
def test_the_line_is_two_welch_standard_errors(shift, verdict):
    # torch without spread, ours +-0.01 around 1 + shift: SE = 0.01 / sqrt(3) with the
    # sample variance, so 0.0105 is 1.82 SE (tied) and 0.015 is 2.6 SE. A population
    # variance (0.01 / 2) would call 0.0105 worse, a 1-SE line both, a 3-SE line neither.
    ours = [1 + shift + e for e in (-0.01, 0.01, -0.01, 0.01)]
    f = replica_difference(ours, [1.0, 1.0, 1.0, 1.0])
    assert f["se"] == pytest.approx(0.01 / math.sqrt(3))
    assert f["verdict"] == verdict
    assert f["df"] == pytest.approx(3)  # Welch: all the spread on ours' side, 4 - 1
    assert f["chance"] == pytest.approx(0.0697, abs=1e-4)  # P(T_3 > 2)


def test_welch_degrees_of_freedom_with_spread_on_both_sides():
    # equal spread and counts: Welch's df is the pooled 2n - 2 (here to first order)
    f = replica_difference([1.0, 1.02, 0.98, 1.0], [1.0, 1.02, 0.98, 1.0])
    assert f["verdict"] == "tied" and f["diff"] == 0.0
    assert f["df"] == pytest.approx(6)


def test_too_few_replicas_is_no_verdict():
    f = replica_difference([2.0], [2.1, 2.0])
    assert f["verdict"] == "unknown" and math.isnan(f["se"])
    assert f["diff"] == pytest.approx(2.0 / 2.05 - 1)


def test_across_seeds_paired_t():
    q = across_seeds([0.01, 0.02, 0.03])
    assert q["mean"] == pytest.approx(0.02) and q["median"] == pytest.approx(0.02)
    assert q["ours_lower"] == 0 and q["seeds"] == 3 and q["df"] == 2
    assert q["paired_t"] == pytest.approx(0.02 / (0.01 / math.sqrt(3)))
    # two-sided p of t = 2 sqrt(3) at 2 df: 1 - t / sqrt(2 + t^2)
    t = q["paired_t"]
    assert q["p_two_sided"] == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-9)

    lower = across_seeds([-0.02, 0.01, -0.005, -0.001])
    assert lower["ours_lower"] == 3 and lower["median"] == pytest.approx(-0.003)
    assert lower["paired_t"] < 0


def test_compare_replicas_over_seeds():
    ours = {
        0: [2.10, 2.11, 2.09, 2.10],  # worse
        1: [2.00, 2.01, 1.99, 2.00],  # better
        2: [2.00, 2.04, 1.97, 2.03],  # tied
        3: [2.50],  # a run lost: no verdict
    }
    theirs = {
        0: [2.00, 2.01, 1.99, 2.00],
        1: [2.10, 2.11, 2.09, 2.10],
        2: [2.01, 1.98, 2.05, 2.00],
        3: [2.00, 2.01, 1.99, 2.00],
    }
    none = {0: 2.05, 1: 2.00, 2: 2.02, 3: 2.00}
    q = compare_replicas(ours, theirs, none)
    assert (q["worse"], q["better"], q["tied"], q["unknown"]) == ([0], [1], [2], [3])
    diffs = [q["per_seed"][s]["diff"] for s in (0, 1, 2)]
    assert q["seeds"] == 3 and q["mean"] == pytest.approx(sum(diffs) / 3)
    assert q["ours_lower"] == sum(d < 0 for d in diffs) == 1
    assert q["paired_t"] == pytest.approx(across_seeds(diffs)["paired_t"])
    chances = [q["per_seed"][s]["chance"] for s in (0, 1, 2)]
    assert all(0.04 < c < 0.075 for c in chances)  # Welch df 3 to 6: P(T > 2) 0.046-0.070
    assert q["worse_expected_by_chance"] == pytest.approx(sum(chances))
    assert q["any_worse_by_chance"] == pytest.approx(1 - math.prod(1 - c for c in chances))
    # ours against none: +2.44%, 0%, -0.50%, +25%: within 2% on two of four seeds
    assert q["per_seed"][0]["ours_vs_none"] == pytest.approx(2.10 / 2.05 - 1)
    assert q["ours_within_2pct_of_none"] == 2 and q["ours_vs_none_seeds"] == 4
    assert q["ours_vs_none_worst"] == pytest.approx(0.25)


def test_nccl_backend_needs_a_gpu_per_rank_before_any_run(monkeypatch, capsys):
    def no_runs(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(compression, "run_config", no_runs)
    monkeypatch.setattr(sys, "argv", ["compression.py", "--backend", "nccl"])
    one_line_error(capsys, compression.main(), "--backend nccl needs --device cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["compression.py", "--backend", "nccl", "--device", "cuda"]
    monkeypatch.setattr(sys, "argv", argv)
    one_line_error(capsys, compression.main(), "needs 2 GPUs (one per rank), torch sees 1")
