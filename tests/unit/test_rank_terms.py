"""The terms every rank settles at init (runtime/rank_terms.py): a setting given to one rank
only must not change what crosses the wire on that rank alone."""

import logging

import pytest

from trainspec.config import load_config
from trainspec.runtime.rank_terms import Agreement, Terms, settle


def vote(run_id="r", collector=True, probe=True, compression="none", block=256, **over):
    """One rank's terms: the defaults with `section__key=value` overrides."""
    overrides: dict = {"kernels": {"compression": compression, "int8_block_size": block}}
    for name, value in over.items():
        section, key = name.split("__")
        overrides.setdefault(section, {})[key] = value
    cfg = load_config(overrides=overrides, environ={})
    cfg.collector.enabled, cfg.collector.probe = collector, probe
    return Terms.of(cfg, run_id).as_wire()


def said(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_rank_zero_s_run_id_and_wire_settings_win(caplog):
    votes = [vote("a", compression="int8", block=64), vote("b", compression="bf16")]
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle(votes, rank=1)
    assert deal.run_id == "a"
    assert deal.job["kernels"] == {"compression": "int8", "int8_block_size": 64}
    assert ("rank 1 was given kernels.compression='bf16' (rank 0: 'int8'), "
            "kernels.int8_block_size=256 (rank 0: 64)") in said(caplog)  # fmt: skip


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
    assert (deal.hook, deal.probe, deal.operator_actions) == (True, True, False)
    assert said(caplog) == ""


def test_the_agreement_applies_to_a_copy_of_the_config():
    cfg = load_config(overrides={"kernels": {"compression": "bf16"}}, environ={})
    job = Terms.of(load_config(overrides={"kernels": {"compression": "int8:64"}}, environ={}),
                   "r").job  # fmt: skip
    agreed = Agreement("r", True, False, False, job).applied_to(cfg)
    assert agreed.kernels.compression == "int8:64"
    assert agreed.collector.probe is False
    assert (cfg.kernels.compression, cfg.collector.probe) == ("bf16", True)  # untouched


def test_a_rank_alone_keeps_its_own_terms():
    cfg = load_config(overrides={"collector": {"enabled": False}}, environ={})
    deal = Agreement.alone(Terms.of(cfg, "solo"))
    assert (deal.run_id, deal.hook, deal.probe) == ("solo", False, False)


@pytest.mark.parametrize(
    "setting",
    [
        {"actuator__window_steps": 2},  # control gathers at other steps: a 60 s stall
        {"actuator__rebalance": False},  # one rank moved alone to uneven shares
        {"actuator__dry_run": True},
        {"checkpoint__dir": "/elsewhere"},  # one rank alone made the checkpointer's group
        {"checkpoint__mtbf_gpu_hours": 1.0},  # one rank alone saved: a 60 s stall
        {"collector__interval_s": 0.5},  # the probe paced by the slowest rank
    ],
)
def test_a_setting_that_acts_across_ranks_is_rank_zero_s(setting, caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle([vote(), vote(**setting)], rank=1)
    ((name, value),) = setting.items()
    section, key = name.split("__")
    assert deal.job[section][key] == getattr(getattr(load_config(environ={}), section), key)
    assert f"rank 1 was given {section}.{key}={value!r}" in said(caplog)


def test_the_actuator_off_on_one_rank_is_off_on_all(caplog):
    votes = [vote(), vote(actuator__enabled=False)]
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle(votes, rank=1)
    assert deal.job["actuator"]["enabled"] is False
    assert said(caplog) == ""  # its own setting: nothing to tell it
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        settle(votes, rank=0)
    assert "the actuator is off on rank(s) [1]" in said(caplog)


def test_operator_actions_follow_rank_zero_s_endpoint():
    with_endpoint = vote(agent__endpoint="http://127.0.0.1:4318")
    assert settle([with_endpoint, vote()], rank=1).operator_actions
    assert not settle([vote(), with_endpoint], rank=1).operator_actions


def test_a_store_root_of_its_own_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        deal = settle([vote(store__root="/a"), vote(store__root="/b")], rank=1)
    assert deal.run_id == "r"
    assert "rank 1 stores under /b, rank 0 under /a" in said(caplog)
