"""The compression ladder at the job's world size: raising compression never sends more bytes.

int8 and topk are all-gathers, whose bytes grow with W - 1 where an all-reduce's stay under
twice the payload: at 4 ranks `int8` sent more than `bf16` (a real 4-rank job: 10308 against
10140 comm bytes a step), from 8 ranks more than `none` (7.11 MB against 7.00 MB per 1M
values), and the default ladder `none,bf16,int8` "raised" compression to it (QA). The
configuration cannot know the world size; the policy rates the ladder at it.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from tests.unit.test_actuator_detectors import window
from trainspec.actuator.compression import (
    CompressionPolicy,
    rate_ladder,
    rung_sent_bytes,
    sends_fewer,
)
from trainspec.config_rules import nominal_sends_less
from trainspec.kernels.codecs import make_codec
from trainspec.kernels.wire import (
    LocalWire,
    all_gather_sent_bytes,
    all_reduce_sent_bytes,
    completed,
    level_sent_bytes,
)
from trainspec.levels import parse_level

WORLDS = (2, 4, 8, 64)


class CountingWire(LocalWire):
    """A wire of `world_size` ranks that sends nothing and counts what each collective the
    codec launches would send, by `Wire`'s own formulas; every rank's payload is this one's."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size

    def all_reduce(self, tensor, then=None):
        nbytes = tensor.numel() * tensor.element_size()
        self._record("all_reduce", tensor, all_reduce_sent_bytes(nbytes, self.world_size))
        return completed(tensor if then is None else then(tensor))

    def all_gather(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        self._record("all_gather", tensor, all_gather_sent_bytes(nbytes, self.world_size))
        return completed([tensor] * self.world_size)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("level", ["none", "bf16", "int8", "int8:64", "int8:1", "topk:0.01"])
@pytest.mark.parametrize("n", [1000, 4099])
def test_level_sent_bytes_is_what_the_codec_sends_through_the_wire(world, level, n):
    wire = CountingWire(world)
    grad = torch.randn(n)
    make_codec(level).reduce(grad, 0.5, None, 0, wire).wait()
    assert wire.records, "the codec launched no collective"
    assert level_sent_bytes(parse_level(level), n, world) == wire.sent_bytes()


def test_qa_counts_per_million_values():
    per = lambda level, w: level_sent_bytes(parse_level(level), 1_000_000, w)  # noqa: E731
    assert per("int8", 8) == 7_109_396 and per("none", 8) == 7_000_000
    assert per("int8", 4) > per("bf16", 4) and per("int8", 2) < per("bf16", 2)
    assert per("topk:0.01", 8) == 7 * 8 * 10_000  # W x F of none, about
    assert level_sent_bytes(parse_level("lowrank:2"), 1_000_000, 8) is None  # shapes decide


def test_the_configurations_two_rank_rating_agrees_with_the_wire_at_two_ranks():
    """The config check rates rungs without torch or the world size; at W = 2 it must read
    the pairs as the wire's counts do (it is the policy's order at two ranks)."""
    rungs = ["none", "bf16", "int8:1", "int8:4", "int8:8", "int8:64", "int8:256", "int8:65536",
             "topk:0.01", "topk:0.1", "topk:0.2", "topk:0.5", "topk:1"]  # fmt: skip
    for later, earlier in itertools.permutations(rungs, 2):
        assert nominal_sends_less(later, earlier) == sends_fewer(later, earlier, 2), (
            later,
            earlier,
        )


@pytest.mark.parametrize(
    ("ladder", "int8_block", "kept"),
    [
        # the default ladder: int8 beats bf16 only below 4 ranks, none below 8
        (("none", "bf16", "int8"), None, {2: ("none", "bf16", "int8"), 4: ("none", "bf16"),
                                          8: ("none", "bf16"), 64: ("none", "bf16")}),
        (("none", "int8"), None, {2: ("none", "int8"), 4: ("none", "int8"), 8: ("none",),
                                  64: ("none",)}),
        # the job's int8 block: 8 values a scale cost 1.5 bytes a value, as much as bf16
        # does at 4 ranks... and more than it at 3 (below); a block of 65536 is no help at 8
        (("none", "bf16", "int8"), 8, {2: ("none", "bf16", "int8:8"), 4: ("none", "bf16"),
                                       8: ("none", "bf16"), 64: ("none", "bf16")}),
        (("none", "int8"), 65536, {2: ("none", "int8:65536"), 4: ("none", "int8:65536"),
                                   8: ("none",), 64: ("none",)}),
        # topk sends W x F of none: 0.64 at 64 ranks, more than bf16's half
        (("bf16", "topk:0.01"), None, {2: ("bf16", "topk:0.01"), 4: ("bf16", "topk:0.01"),
                                       8: ("bf16", "topk:0.01"), 64: ("bf16",)}),
        (("none", "topk:0.01"), None, {w: ("none", "topk:0.01") for w in WORLDS}),
        # lowrank sends by all-reduce: above the dense levels at any world size
        (("none", "bf16", "int8", "lowrank:4"), None,
         {2: ("none", "bf16", "int8", "lowrank:4"), 4: ("none", "bf16", "lowrank:4"),
          8: ("none", "bf16", "lowrank:4"), 64: ("none", "bf16", "lowrank:4")}),
    ],
)  # fmt: skip
def test_the_policy_keeps_the_rungs_that_send_fewer_bytes_at_its_world_size(
    ladder, int8_block, kept
):
    pol = CompressionPolicy(ladder=ladder, int8_block=int8_block)
    for world, rungs in kept.items():
        assert rate_ladder(pol.ladder, world)[0] == rungs, world


def test_the_int8_block_decides_at_three_ranks():
    # bf16 at 3 ranks: 2 x 2/3 x 2 = 2.67 bytes a value; int8:B: 2 x (1 + 4/B)
    assert rate_ladder(("none", "bf16", "int8:8"), 3)[0] == ("none", "bf16")  # 3.0
    assert rate_ladder(("none", "bf16", "int8:16"), 3)[0] == ("none", "bf16", "int8:16")  # 2.5


@pytest.mark.parametrize("world", [2, 3, 4, 5, 7, 8, 9, 16, 64, 128])
@pytest.mark.parametrize("block", [None, 8, 64, 256, 65536])
@pytest.mark.parametrize(
    "ladder",
    [
        ("none", "bf16", "int8"),
        ("none", "int8"),
        ("none", "bf16", "int8", "topk:0.01"),
        ("none", "int8:64", "int8", "topk:0.05"),
        ("bf16", "topk:0.1", "topk:0.01"),
        ("none", "bf16", "int8", "lowrank:4", "lowrank:2"),
    ],
)
def test_raising_compression_never_sends_more_bytes(world, block, ladder):
    """Comm-bound every window from the bottom rung: every move sends fewer bytes."""
    pol = CompressionPolicy(ladder=ladder, int8_block=block, cooldown=0)
    s = window([0.01] * world)
    level, moves = pol.ladder[0], 0
    for _ in range(len(ladder) + 2):
        a = pol.decide(s, level, comm_bound=True, critical=False, exposed_share=0.5)
        if a is None or a.kind != "compression":
            continue
        after = a.after["level"]
        assert sends_fewer(after, level, world) is not False, (level, after)
        before_b, after_b = rung_sent_bytes(level, world), rung_sent_bytes(after, world)
        if before_b is not None and after_b is not None:
            assert after_b < before_b, (level, after, before_b, after_b)
        level, moves = after, moves + 1
    assert moves == len(rate_ladder(pol.ladder, world)[0]) - 1


def test_at_four_ranks_bf16_is_the_top_and_the_skip_is_said_once(caplog):
    pol = CompressionPolicy(cooldown=0)
    s = window([0.01] * 4)
    with caplog.at_level(logging.WARNING, logger="trainspec.actuator"):
        up = pol.decide(s, "none", comm_bound=True, critical=False, exposed_share=0.5)
        assert up.after == {"level": "bf16"}  # a move is not held back by the notice
        notice = pol.decide(s, "bf16", comm_bound=True, critical=False, exposed_share=0.5)
        assert notice is not None and notice.kind == "advice" and not notice.changes_state
        for _ in range(3):  # never to int8, nor said again
            assert pol.decide(s, "bf16", comm_bound=True, critical=False, exposed_share=0.5) is None
    assert "at 4 ranks int8 sends no fewer bytes than bf16" in notice.reason
    assert notice.evidence["world_size"] == 4 and notice.evidence["rungs"] == ["none", "bf16"]
    skipped = notice.evidence["skipped"]["int8"]
    assert skipped["than"] == "bf16" and skipped["bytes"] > skipped["than_bytes"]
    warned = [r for r in caplog.records if "sends no fewer bytes" in r.getMessage()]
    assert len(warned) == 1


def test_at_two_ranks_the_default_ladder_moves_as_before():
    pol = CompressionPolicy(cooldown=0)
    s = window([0.01] * 2)
    assert pol.decide(s, "none", comm_bound=True, critical=False,
                      exposed_share=0.5).after == {"level": "bf16"}  # fmt: skip
    assert pol.decide(s, "bf16", comm_bound=True, critical=False,
                      exposed_share=0.5).after == {"level": "int8"}  # fmt: skip
    assert pol.decide(s, "int8", comm_bound=True, critical=False, exposed_share=0.5) is None


def test_a_job_at_a_skipped_rung_moves_to_fewer_bytes():
    """`kernels.compression = int8` at 8 ranks: more bytes than none. A critical regime
    lowers it to bf16; so does a comm-bound window (fewer bytes, none above it)."""
    s = window([0.01] * 8)
    pol = CompressionPolicy(cooldown=0)
    down = pol.decide(s, "int8", comm_bound=False, critical=True, exposed_share=0.1)
    assert down.after == {"level": "bf16"} and "critical" in down.reason
    pol = CompressionPolicy(cooldown=0)
    move = pol.decide(s, "int8", comm_bound=True, critical=False, exposed_share=0.5)
    assert move.after == {"level": "bf16"}
    assert "at 8 ranks int8 sends more than bf16" in move.reason
    # with a kept rung above it, a comm-bound window raises to that one
    pol = CompressionPolicy(ladder=("none", "bf16", "int8", "lowrank:4"), cooldown=0)
    up = pol.decide(s, "int8", comm_bound=True, critical=False, exposed_share=0.5)
    assert up.after == {"level": "lowrank:4"}
    assert pol.decide(s, "lowrank:4", comm_bound=False, critical=True,
                      exposed_share=0.1).after == {"level": "bf16"}  # fmt: skip
