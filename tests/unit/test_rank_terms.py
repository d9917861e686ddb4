"""The terms every rank settles at init (runtime/rank_terms.py): a setting given to one rank
only must not change what crosses the wire on that rank alone."""

import logging

import pytest

from trainspec.config import load_config
from trainspec.runtime.rank_terms import Agreement, Terms, settle


def vote(run_id="r", collector=True, probe=True, compression="none", block=256):
    return Terms(run_id, collector, probe, compression, block).as_wire()


def said(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_rank_zero_s_run_id_and_wire_settings_win(caplog):
    votes = [vote("a", compression="int8", block=64), vote("b", compression="bf16")]
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle(votes, rank=1)
    assert (deal.run_id, deal.compression, deal.int8_block_size) == ("a", "int8", 64)
    assert "rank 1 was given kernels.compression=bf16, int8_block_size=256" in said(caplog)


def test_the_hook_is_on_everywhere_when_any_rank_collects(caplog):
    votes = [vote(), vote(collector=False, probe=False)]
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        off_rank = settle(votes, rank=1)
    assert off_rank.hook and not off_rank.probe
    assert "collector is off on this rank (1)" in said(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        on_rank = settle(votes, rank=0)
    assert on_rank == off_rank
    assert "collector is off on rank(s) [1]" in said(caplog)
    assert "rank(s) [1] run no latency probe" in said(caplog)


def test_no_rank_collecting_means_plain_ddp_and_no_warning(caplog):
    votes = [vote(collector=False, probe=False)] * 3
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle(votes, rank=2)
    assert not deal.hook and not deal.probe
    assert said(caplog) == ""


def test_a_probe_switched_off_on_one_rank_is_off_on_all():
    deal = settle([vote(), vote(), vote(probe=False)], rank=0)
    assert deal.hook and not deal.probe


@pytest.mark.parametrize("rank", [0, 1])
def test_agreeing_ranks_hear_nothing(rank, caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle([vote(), vote()], rank=rank)
    assert deal == Agreement("r", True, True, "none", 256)
    assert said(caplog) == ""


def test_the_agreement_applies_to_a_copy_of_the_config():
    cfg = load_config(overrides={"kernels": {"compression": "bf16"}})
    agreed = Agreement("r", True, False, "int8:64", 64).applied_to(cfg)
    assert (agreed.kernels.compression, agreed.kernels.int8_block_size) == ("int8:64", 64)
    assert agreed.collector.probe is False
    assert (cfg.kernels.compression, cfg.collector.probe) == ("bf16", True)  # untouched


def test_a_rank_alone_keeps_its_own_terms():
    cfg = load_config(overrides={"collector": {"enabled": False}})
    deal = Agreement.alone(Terms.of(cfg, "solo"))
    assert (deal.run_id, deal.hook, deal.probe) == ("solo", False, False)
