from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainspec.data import SamplerStateError, ShareBatchSampler, apportion


def _samplers(n: int, batch: int, world: int, seed: int = 3) -> list[ShareBatchSampler]:
    return [ShareBatchSampler(n, batch, rank=r, world_size=world, seed=seed) for r in range(world)]


def _random_shares(draw_fn, batch: int, world: int) -> list[int]:
    cuts = sorted(draw_fn(st.lists(st.integers(0, batch), min_size=world - 1, max_size=world - 1)))
    edges = [0, *cuts, batch]
    return [edges[i + 1] - edges[i] for i in range(world)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), more=st.integers(0, 110), world=st.integers(1, 4), extra=st.integers(0, 9))
def test_every_epoch_covers_each_sample_once_whatever_the_shares(data, more, world, extra) -> None:
    batch = world + extra
    n = batch + more  # a dataset holds at least one global batch
    samplers = _samplers(n, batch, world)
    for epoch in range(2):
        seen: Counter[int] = Counter()
        for _ in range(samplers[0].steps_per_epoch()):
            if data.draw(st.booleans()):
                shares = _random_shares(data.draw, batch, world)
                for s in samplers:
                    s.set_shares(shares)
            steps = [s.next_step() for s in samplers]
            assert {b.epoch for b in steps} == {epoch}
            assert sum(len(b.indices) for b in steps) == steps[0].global_count
            for r, b in enumerate(steps):
                assert len(b.indices) == b.shares[r]
                seen.update(b.indices)
        assert seen == Counter(range(n)), f"epoch {epoch} coverage is not exact"


def test_epochs_use_different_seeded_permutations_and_seed_reproduces() -> None:
    a = ShareBatchSampler(50, 50, rank=0, world_size=1, seed=7)
    b = ShareBatchSampler(50, 50, rank=0, world_size=1, seed=7)
    first, second = a.next_step().indices, a.next_step().indices
    assert first != second
    assert b.next_step().indices == first
    other = ShareBatchSampler(50, 50, rank=0, world_size=1, seed=8).next_step().indices
    assert other != first


def test_state_dict_resumes_the_same_order_with_changed_shares() -> None:
    ref = _samplers(37, 8, 2)
    run = _samplers(37, 8, 2)
    for step in range(13):
        if step == 3:
            for s in ref + run:
                s.set_shares([6, 2])
        expected = [s.next_step().indices for s in ref]
        if step == 6:  # "crash": rebuild from state and continue
            states = [s.state_dict() for s in run]
            run = _samplers(37, 8, 2)
            for s, state in zip(run, states, strict=True):
                s.load_state_dict(state)
            assert run[0].shares == (6, 2)
        got = [s.next_step().indices for s in run]
        assert got == expected


def test_last_step_of_epoch_splits_remainder_in_proportion() -> None:
    samplers = _samplers(10, 8, 2)
    for s in samplers:
        s.set_shares([6, 2])
        s.next_step()
    last = [s.next_step() for s in samplers]
    assert last[0].global_count == 2
    assert last[0].shares == (2, 0) and last[1].indices == []


def test_iteration_yields_one_epoch_of_index_lists() -> None:
    s = ShareBatchSampler(20, 4, rank=1, world_size=2, seed=1)
    lists = list(s)
    assert len(lists) == len(s) == 5 and all(len(x) == 2 for x in lists)
    assert s.epoch == 0
    assert len(list(s)) == 5 and s.epoch == 1


@pytest.mark.parametrize(
    "shares, message",
    [
        ([4], "one entry per rank"),
        ([5, 1], "sum to 6"),
        ([5, -1], "non-negative"),
        ([2.5, 1.5], "integers"),
    ],
)
def test_bad_shares_are_refused(shares, message) -> None:
    s = ShareBatchSampler(20, 4, rank=0, world_size=2)
    with pytest.raises(ValueError, match=message):
        s.set_shares(shares)


def test_state_from_another_configuration_is_refused() -> None:
    state = ShareBatchSampler(20, 4, rank=0, world_size=2).state_dict()
    with pytest.raises(SamplerStateError, match="lacks position, shares"):
        ShareBatchSampler(20, 4, rank=0, world_size=2).load_state_dict(
            {k: v for k, v in state.items() if k not in ("shares", "position")}
        )
    with pytest.raises(SamplerStateError, match="world_size"):
        ShareBatchSampler(20, 4, rank=0, world_size=4).load_state_dict(state)
    with pytest.raises(SamplerStateError, match="dataset_len"):
        ShareBatchSampler(21, 4, rank=0, world_size=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"dataset_len": 0}, ValueError, "dataset_len must be positive"),
        ({"rank": 2}, ValueError, "rank 2 is not in a world of size 2"),
        ({"global_batch": 1}, ValueError, "smaller than world_size"),
        ({"global_batch": 16}, ValueError, "global_batch 16 is larger than dataset_len 10"),
        ({"dataset_len": 10.0}, TypeError, "dataset_len must be a whole number, not float"),
        ({"global_batch": 4.5}, TypeError, "global_batch must be a whole number, not float"),
        ({"global_batch": "4"}, TypeError, "global_batch must be a whole number, not str"),
        ({"seed": 1.5}, TypeError, "seed must be a whole number"),
        ({"world_size": True}, TypeError, "world_size must be a whole number, not a bool"),
        ({"seed": None}, TypeError, "seed must be a whole number, not NoneType"),
        ({"seed": 2**70}, ValueError, "seed must be in"),
    ],
)
def test_bad_construction_is_refused_by_name(kwargs, error, words) -> None:
    args = {"dataset_len": 10, "global_batch": 4, "rank": 0, "world_size": 2} | kwargs
    with pytest.raises(error, match=words):
        ShareBatchSampler(args.pop("dataset_len"), args.pop("global_batch"), **args)


def test_numpy_integers_are_whole_numbers() -> None:
    s = ShareBatchSampler(np.int64(10), np.int32(4), rank=np.int64(1), world_size=2)
    assert (s.dataset_len, s.global_batch, s.rank) == (10, 4, 1)
    assert type(s.dataset_len) is int


def test_apportion_sums_and_is_proportional() -> None:
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(3, [6, 2]) == [2, 1]
    assert sum(apportion(7, [5, 0, 2])) == 7 and apportion(7, [5, 0, 2])[1] == 0
