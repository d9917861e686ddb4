"""`CompressionHook.set_level` checks its step: NaN was accepted and never applied, 2.5 was
accepted, "2" failed with a comparison error that did not name the argument."""

from __future__ import annotations

import pytest

from trainspec.kernels.codecs import Level, LevelError
from trainspec.kernels.hook import CompressionHook

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank_group")]


@pytest.mark.parametrize("at_step", [float("nan"), 2.5, "2", True])
def test_a_step_that_is_not_a_whole_number_is_refused_by_name(at_step) -> None:
    hook = CompressionHook("none")
    with pytest.raises(TypeError, match="at_step must be a whole step number"):
        hook.set_level("int8", at_step=at_step)
    assert hook._pending is None


def test_a_past_step_and_a_bad_level_are_refused_and_a_good_switch_is_pending() -> None:
    import numpy as np

    hook = CompressionHook("none")
    with pytest.raises(LevelError, match="int4"):
        hook.set_level("int4")
    hook.set_level("int8", at_step=np.int64(3))
    assert hook._pending is not None and hook._pending.at_step == 3
    hook._step = 5
    with pytest.raises(ValueError, match="cannot switch level at step 4"):
        hook.set_level("bf16", at_step=4)


@pytest.mark.parametrize("seed", [-1, 1 << 31, True, 2.0])
def test_a_bad_seed_is_refused_when_the_hook_is_built(seed) -> None:
    """Not when a switch first builds a lowrank codec, mid-run."""
    with pytest.raises(ValueError, match="seed must be an integer"):
        CompressionHook("none", seed=seed)


def test_every_lowrank_codec_of_the_hook_takes_its_seed() -> None:
    hook = CompressionHook("lowrank:2", seed=3)
    assert hook._codec.seed == 3
    assert hook._codec_for(Level("lowrank-bf16", 4)).seed == 3


@pytest.mark.parametrize(
    ("local", "total"), [(1, float("inf")), (1.5, 4), (True, 2), (1, 2.0), (1, "2")]
)
def test_shares_that_are_not_whole_numbers_are_refused_by_name(local, total) -> None:
    """inf as the global count was taken and weighed this rank's gradient 0, silently."""
    hook = CompressionHook("none")
    with pytest.raises(TypeError, match="must be a whole number of samples"):
        hook.set_shares(local, total)
    assert hook.shares is None
    import numpy as np

    hook.set_shares(np.int64(3), 8)
    assert hook.shares == (3, 8) and type(hook.shares[0]) is int
