"""What the zero-code layer counts as a step, its samples and its phases, driven through its
entry points in one process (the calls the patched torch makes, in a script's order)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import UserDict
from typing import Any

import pytest
import torch

import trainspec.store as store
from trainspec.runtime.auto import AutoInstrumentation
from trainspec.runtime.batches import batch_size

PAUSE_S = 0.01


@pytest.fixture
def auto(ts) -> AutoInstrumentation:
    """The layer with a session started, as at a script's process group (a DDP model)."""
    layer = AutoInstrumentation()
    layer.session, layer.ctx = ts, ts.begin_step()
    layer.ddp_hooked = True  # the DDP model's forward hooks report forwards
    return layer


def sgd() -> torch.optim.Optimizer:
    """An optimizer the no-DDP path can read a gradient norm from."""
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    return torch.optim.SGD([param], lr=0.1)


def steps(auto: AutoInstrumentation) -> list[dict[str, Any]]:
    auto._finish_step()  # the last step, as at exit
    auto.session.collector.flush()
    rows = store.query(auto.session.run_dir, "SELECT * FROM steps ORDER BY step").to_pylist()
    return rows


def forward(auto: AutoInstrumentation, n: int, *, pause_s: float = 0.0) -> None:
    """A DDP model's forward on a batch of `n`, then its loss's backward."""
    auto.on_forward_start(((torch.zeros(n, 3),), {}))
    time.sleep(pause_s)
    auto.on_forward_end()
    auto.on_backward_start()
    time.sleep(pause_s)
    auto.on_backward_end()


def step(auto: AutoInstrumentation, *optimizers: object) -> None:
    for opt in optimizers:
        auto.on_optimizer_pre(opt)
        auto.on_optimizer_post(opt)


def test_an_optimizer_that_starts_stepping_later_joins_the_running_step(auto):
    """o1 every batch, o2 every second batch: o2's first step came after o1 had ended the
    step, and made one of its own (21 steps for 20 batches, one with no samples)."""
    o1, o2 = object(), object()
    loader = object()
    for i in range(6):
        auto.on_batch(torch.zeros(8, 3), 0.0, loader)
        forward(auto, 8)
        step(auto, o1, *([o2] if i % 2 == 1 else []))
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [8] * 6
    assert all(r["forward_s"] is not None and r["backward_s"] is not None for r in rows)


def test_an_optimizer_unfrozen_mid_run_steps_in_the_step_it_steps_in(auto):
    """No DataLoader either: the step is closed at the next forward."""
    o1, head = object(), object()
    for i in range(6):
        forward(auto, 4)
        step(auto, o1, *([head] if i >= 3 else []))
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [4] * 6
    assert all(r["optimizer_s"] is not None for r in rows)


def test_every_batch_of_loaders_zipped_together_counts(auto):
    """`for a, b in zip(loader_bs8, loader_bs4)` with a forward on each: 4 per step (the
    last batch read), not 12."""
    la, lb = object(), object()
    opt = object()
    for _ in range(3):
        auto.on_batch(torch.zeros(8, 3), 0.001, la)
        auto.on_batch(torch.zeros(4, 3), 0.001, lb)
        forward(auto, 8)
        forward(auto, 4)
        step(auto, opt)
    assert [r["samples"] for r in steps(auto)] == [12] * 3


def test_an_evaluation_loop_s_batches_do_not_count_in_the_next_step(auto):
    """Its batches are read with gradients on (only the forward is under no_grad), from a
    loader of its own: they must not join the next training batch's count."""
    train, opt = object(), object()
    auto.on_batch(torch.zeros(8, 3), 0.0, train)
    forward(auto, 8)
    step(auto, opt)
    evaluation = object()
    for _ in range(2):
        auto.on_batch(torch.zeros(5, 3), 0.0, evaluation)
        with torch.no_grad():
            auto.on_forward_start(((torch.zeros(5, 3),), {}))
            auto.on_forward_end()
    auto.on_loader_end(train)  # the training epoch's loader ended; a new one starts
    auto.on_batch(torch.zeros(8, 3), 0.0, object())
    forward(auto, 8)
    step(auto, opt)
    assert [r["samples"] for r in steps(auto)] == [8, 8]


def test_a_loop_that_reads_one_batch_ahead_counts_one_batch_a_step(auto):
    loader, opt = object(), object()
    auto.on_batch(torch.zeros(8, 3), 0.0, loader)
    for _ in range(3):
        auto.on_batch(torch.zeros(8, 3), 0.0, loader)  # the next batch, read ahead
        forward(auto, 8)
        step(auto, opt)
    assert [r["samples"] for r in steps(auto)] == [8, 8, 8]


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Inputs:
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids, self.note = ids, "text"


class Opaque:
    __slots__ = ("payload",)

    def __init__(self) -> None:
        self.payload = torch.zeros(6, 2)


@pytest.mark.parametrize(
    ("batch", "size"),
    [
        (Batch(torch.zeros(6, 16), torch.zeros(6, 1)), 6),  # a collate_fn's dataclass
        (Inputs(torch.zeros(5, 7)), 5),  # an object with tensor attributes
        (UserDict({"ids": torch.zeros(3, 2)}), 3),  # a mapping not a dict (BatchEncoding)
        ([Batch(torch.zeros(2, 1), torch.zeros(2))], 2),
        (Opaque(), 0),  # nothing to read: the forward's input counts instead
    ],
)
def test_a_collated_object_s_size_is_its_first_tensor_s(batch, size):
    assert batch_size(batch) == size


def test_a_batch_of_unknown_size_counts_the_forward_s_input(auto):
    """A collate function's own type gave samples = 0 on every step (and so no gradient
    variance): the forward's input tells."""
    loader, opt = object(), object()
    for _ in range(2):
        auto.on_batch(Opaque(), 0.0, loader)
        forward(auto, 6)
        step(auto, opt)
    assert [r["samples"] for r in steps(auto)] == [6, 6]


def test_a_closure_s_forward_and_backward_are_timed_as_those_phases(auto):
    """LBFGS evaluates its closure inside `optimizer.step`: the backward phase was empty on
    every step, and forward and backward landed in the optimizer phase."""
    loader, lbfgs = object(), object()
    for _ in range(2):
        auto.on_batch(torch.zeros(8, 3), 0.0, loader)
        auto.on_optimizer_pre(lbfgs)
        for _ in range(3):  # the closure, evaluated again by the line search
            forward(auto, 8, pause_s=PAUSE_S)
        auto.on_optimizer_post(lbfgs)
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [8, 8]  # one batch, however many evaluations
    for r in rows:
        assert r["forward_s"] >= 3 * PAUSE_S and r["backward_s"] >= 3 * PAUSE_S
        assert r["optimizer_s"] < min(r["forward_s"], r["backward_s"])  # its own work only
        total = r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        assert total <= r["duration_s"] + 1e-6


def test_a_closure_s_backward_without_ddp_is_the_backward_phase(auto):
    auto.ddp_hooked = False
    loader, lbfgs = object(), sgd()
    for _ in range(2):
        auto.on_batch(torch.zeros(8, 3), 0.0, loader)
        auto.on_optimizer_pre(lbfgs)
        for _ in range(2):
            auto.on_backward_start()
            time.sleep(PAUSE_S)
            auto.on_backward_end()
        auto.on_optimizer_post(lbfgs)
    for r in steps(auto):
        assert r["backward_s"] >= 2 * PAUSE_S and r["optimizer_s"] < r["backward_s"]


def test_step_0_of_a_rank_with_no_process_group_is_timed_whole(tmp_path, monkeypatch):
    """A torchrun worker that makes no group starts trainspec at its first optimizer step:
    step 0's forward and backward had no value, a cadence violation in every such run."""
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    monkeypatch.setenv("RANK", "0")  # a torchrun worker, not a lone process
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TRAINSPEC_STORE_ROOT", str(tmp_path))
    monkeypatch.setenv("TRAINSPEC_STORE_RUN_ID", "nogroup")
    layer = AutoInstrumentation()
    opt = sgd()
    try:
        for _ in range(2):
            for _ in range(2):  # accumulated micro-batches
                layer.on_batch(torch.zeros(8, 3), 0.0, "loader")
                time.sleep(PAUSE_S)  # the forward, unseen: from the batch to the backward
                layer.on_backward_start()
                time.sleep(PAUSE_S)
                layer.on_backward_end()
            step(layer, opt)
        assert layer.session is not None
        rows = steps(layer)
    finally:
        if layer.session is not None:
            layer.session.close()
    assert [r["samples"] for r in rows] == [16, 16]
    first = rows[0]
    assert first["forward_s"] >= 2 * PAUSE_S and first["backward_s"] >= 2 * PAUSE_S
    # trainspec's own set-up, in between, is no part of the step
    assert first["duration_s"] < 1.0
    total = first["forward_s"] + first["backward_s"] + first["optimizer_s"]
    assert total <= first["duration_s"] + 1e-6


@pytest.mark.parametrize("evaluation", ["none", "read under no_grad", "read with gradients"])
def test_an_evaluation_between_steps_is_no_steps_time(auto, evaluation):
    """A validation pass between epochs (forwards under no_grad, the model in eval mode)
    made the next step's time its own: 1.0 s against a 4 ms median, throughput 250x too low
    (QA, 2026-11-27). Its batches read with gradients on had started the step (review)."""
    o1, loader, held_out = object(), object(), object()
    reads = contextlib.nullcontext if evaluation == "read with gradients" else torch.no_grad
    for i in range(3):
        if i == 2 and evaluation != "none":
            for _ in range(3):
                with reads():
                    auto.on_batch(torch.zeros(8, 3), 0.0, held_out)
                with torch.no_grad():
                    auto.on_forward_start(((torch.zeros(8, 3),), {}), False)  # model.eval()
                    time.sleep(0.1)
                    auto.on_forward_end()
        auto.on_batch(torch.zeros(8, 3), 0.0, loader)
        forward(auto, 8, pause_s=PAUSE_S)
        step(auto, o1)
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [8, 8, 8]
    assert rows[2]["duration_s"] < 0.2, rows[2]  # not the evaluation's 0.3 s
    gap = rows[2]["ts"] - rows[2]["duration_s"] - rows[1]["ts"]
    assert (gap > 0.25) if evaluation != "none" else (abs(gap) < 1e-6), gap  # else tiled


def test_a_no_grad_pass_of_a_training_model_inside_the_step_is_the_steps_time(auto):
    """A loop that runs the model under no_grad first (a policy's old log-probs, a teacher
    pass), in train mode, before its training forward: that is the step's work, and the
    step kept only the training forward's 20 ms (review)."""
    o1 = object()
    for _ in range(3):
        with torch.no_grad():
            auto.on_forward_start(((torch.zeros(4, 3),), {}), True)  # train mode
            time.sleep(0.05)
            auto.on_forward_end()
        forward(auto, 4, pause_s=PAUSE_S)
        step(auto, o1)
    rows = steps(auto)
    assert all(r["duration_s"] > 0.05 for r in rows[1:]), rows


def test_an_evaluation_without_ddp_is_no_steps_time(auto):
    """No DDP model: no forward hook, but the evaluation's batches are read under no_grad
    (review: the 0.3 s evaluation was the next step's)."""
    auto.ddp_hooked = False
    opt = sgd()
    for i in range(3):
        if i == 2:
            with torch.no_grad():
                for _ in range(3):
                    auto.on_batch(torch.zeros(8, 3), 0.0, object())
                    time.sleep(0.1)
        auto.on_batch(torch.zeros(8, 3), 0.0, "train")
        auto.on_backward_start()
        time.sleep(PAUSE_S)
        auto.on_backward_end()
        step(auto, opt)
    rows = steps(auto)
    assert rows[2]["duration_s"] < 0.2, rows[2]


def test_zipped_loaders_of_different_lengths_count_no_batch_of_the_round_that_ended(auto):
    """zip(A, B) with B shorter: the round in which B ends read A's batch, never trained on;
    it was counted in the next epoch's first step (review: [6, 6, 10, 6, 10, 6])."""
    o1 = object()
    for _ in range(3):  # epochs
        a, b = object(), object()
        for _ in range(2):
            auto.on_batch(torch.zeros(4, 3), 0.0, a)
            auto.on_batch(torch.zeros(2, 3), 0.0, b)
            forward(auto, 4)
            step(auto, o1)
        auto.on_batch(torch.zeros(4, 3), 0.0, a)  # zip reads A, then B ends
        auto.on_loader_end(b)
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [6] * 6


def train_on(auto: AutoInstrumentation, x: torch.Tensor, opt: object) -> None:
    """A DDP model's forward on `x`, its backward and the optimizer's step."""
    auto.on_forward_start(((x,), {}))
    auto.on_forward_end()
    auto.on_backward_start()
    auto.on_backward_end()
    step(auto, opt)


@pytest.mark.parametrize("moved", [False, True], ids=["same tensors", "copied to a device"])
def test_a_loop_that_reads_one_batch_ahead_counts_the_batch_each_forward_trains_on(auto, moved):
    """`batch = next(it); for ...: nxt = next(it, None); model(batch); batch = nxt` (a
    prefetcher): each forward took the batch read just before it, so an epoch of [4, 4, 2]
    was counted [4, 2, 0]. The forward's input is the batch it trains on: the same tensors
    (or a view of them), or, copied to a device, a tensor of its size."""
    opt = object()
    for _ in range(2):  # epochs
        loader = object()
        batches = [(torch.zeros(n, 3),) for n in (4, 4, 2)]
        auto.on_batch(batches[0], 0.0, loader)
        for i in range(3):
            if i + 1 < 3:
                auto.on_batch(batches[i + 1], 0.0, loader)  # the next one, read ahead
            else:
                auto.on_loader_end(loader)  # next(it, None)
            (x,) = batches[i]
            train_on(auto, x.clone() if moved else x[:, :2], opt)
    assert [r["samples"] for r in steps(auto)] == [4, 4, 2] * 2


def test_a_batch_a_loop_skips_is_not_counted(auto):
    """`for batch in loader: if skip(batch): continue`: the skipped batch is not trained on,
    and a later batch of another size is counted as it is."""
    loader, opt = object(), object()
    sizes = [4, 3, 4, 2]  # the 3 is skipped
    for n in sizes:
        x = torch.zeros(n, 3)
        auto.on_batch(x, 0.0, loader)
        if n != 3:
            train_on(auto, x.clone(), opt)
    assert [r["samples"] for r in steps(auto)] == [4, 4, 2]


@pytest.mark.parametrize("first", ["evaluation", "warm-up"])
def test_a_phase_that_trains_on_tensors_after_a_loader_phase_counts_its_inputs(auto, first):
    """A DataLoader used only for a first evaluation (its batches read with gradients on)
    or a warm-up, then a loop over tensors in memory: once any loader had given a batch,
    samples came from loaders only, and every later step counted 0."""
    opt, loader = object(), object()
    for _ in range(2):
        x = torch.zeros(8, 3)
        auto.on_batch((x,), 0.0, loader)
        if first == "evaluation":
            with torch.no_grad():
                auto.on_forward_start(((x,), {}), False)
                auto.on_forward_end()
        else:
            train_on(auto, x, opt)
    auto.on_loader_end(loader)
    for _ in range(3):
        train_on(auto, torch.zeros(6, 3), opt)
    expected = ([8, 8] if first == "warm-up" else []) + [6, 6, 6]
    assert [r["samples"] for r in steps(auto)] == expected


def test_a_batch_trained_on_for_several_steps_counts_in_each(auto):
    """`for batch in loader: for _ in range(2): model(batch); opt.step()` (after a first
    step of one): the second step trains on the batch again (it counted 0)."""
    loader, opt = object(), object()
    for repeats in (1, 2, 2):
        x = torch.zeros(4, 3)
        auto.on_batch((x,), 0.0, loader)
        for _ in range(repeats):
            train_on(auto, x, opt)
    assert [r["samples"] for r in steps(auto)] == [4] * 5


@pytest.mark.parametrize("moved", [False, True], ids=["same tensors", "copied to a device"])
def test_a_second_model_s_forward_in_a_loader_step_adds_no_samples(auto, moved):
    """A GAN's generator runs on noise (of the batch's size) after the discriminator took
    the batch, in a loop that reads one batch ahead: the step trains on the batch, once (the
    batch read ahead is the next step's), also in the last step, which reads none."""
    loader, d_opt, g_opt = object(), object(), object()
    batches = [torch.zeros(n, 3) for n in (4, 4, 2)]
    auto.on_batch(batches[0], 0.0, loader)
    for i, x in enumerate(batches):
        if i + 1 < len(batches):
            auto.on_batch(batches[i + 1], 0.0, loader)
        else:
            auto.on_loader_end(loader)
        train_on(auto, x.clone() if moved else x, d_opt)
        train_on(auto, torch.zeros(4, 3), g_opt)  # the generator, on noise of its size
    assert [r["samples"] for r in steps(auto)] == [4, 4, 2]


def test_a_step_that_trains_on_no_sample_stores_no_loss(auto):
    """An empty share (a rank given no samples this step): the zero-code layer reads no
    loss, so such a step stores none (an explicit script's empty share reports `None`)."""
    loader, opt = object(), object()
    auto.on_batch(torch.zeros(4, 3), 0.0, loader)
    train_on(auto, torch.zeros(4, 3), opt)
    auto.on_batch(torch.zeros(0, 3), 0.0, loader)  # an empty share
    train_on(auto, torch.zeros(0, 3), opt)
    rows = steps(auto)
    assert [(r["samples"], r["loss"]) for r in rows] == [(4, None), (0, None)]


@pytest.mark.parametrize("backward", [True, False], ids=["backward", "autograd.grad"])
def test_a_read_ahead_loop_without_ddp_counts_the_batch_each_step_trains_on(auto, backward):
    """No DDP model (no forward seen): batches counted as they were read gave a loop that
    reads one ahead [8, 2, 0] for an epoch of [4, 4, 2]. A backward takes the oldest batch
    the loop asked for; a step with no backward seen (`torch.autograd.grad`) takes its
    batches at its end."""
    auto.ddp_hooked = False
    opt = sgd()
    for _ in range(2):  # epochs
        loader = object()
        batches = [torch.zeros(n, 3) for n in (4, 4, 2)]
        auto.on_batch(batches[0], 0.0, loader)
        for i in range(3):
            if i + 1 < 3:
                auto.on_batch(batches[i + 1], 0.0, loader)
            else:
                auto.on_loader_end(loader)
            if backward:
                auto.on_backward_start()
                auto.on_backward_end()
            step(auto, opt)
    assert [r["samples"] for r in steps(auto)] == [4, 4, 2] * 2


@pytest.mark.parametrize("k", [4, 2])
def test_a_loop_without_ddp_that_reads_k_batches_for_one_backward_counts_them(auto, k):
    """No DDP model: `sum(model(next(it)) for _ in range(k)).backward(); opt.step()`. A
    backward that took the oldest batch waiting (a read-ahead loop's) counted 8 a step for
    8k. It takes all but the newest (one read ahead): the first step counts k - 1 batches
    (there it cannot be told from a read-ahead loop), the next ones k, and a last step that
    finds the loader's end the rest; in all, every batch read."""
    auto.ddp_hooked = False
    opt, loader = sgd(), object()
    for group in (k, k, k, k // 2):
        for _ in range(group):
            auto.on_batch(torch.zeros(8, 3), 0.0, loader)
        if group < k:
            auto.on_loader_end(loader)  # a short last group: `next(it)` found the end
        auto.on_backward_start()
        auto.on_backward_end()
        step(auto, opt)
    samples = [r["samples"] for r in steps(auto)]
    assert samples == [8 * (k - 1), 8 * k, 8 * k, 8 * (k // 2 + 1)]
    assert sum(samples) == 8 * (3 * k + k // 2)


def test_an_evaluation_in_eval_mode_with_gradients_on_is_no_step_s(auto):
    """A validation loop under `model.eval()` that leaves gradients on (no `no_grad`) after
    every few steps: its batches counted in the step it ran in, [8, 8, 208, ...], and its
    time was that step's (QA, 2026-11-27)."""
    opt, loader, held_out = object(), object(), object()
    for i in range(3):
        if i == 2:
            for _ in range(4):
                batch = torch.zeros(50, 3)
                auto.on_batch(batch, 0.0, held_out)  # gradients on
                auto.on_forward_start(((batch,), {}), False)  # model.eval()
                time.sleep(0.05)
                auto.on_forward_end()
            auto.on_loader_end(held_out)
        batch = torch.zeros(8, 3)
        auto.on_batch(batch, 0.0, loader)
        auto.on_forward_start(((batch,), {}), True)
        auto.on_forward_end()
        auto.on_backward_start()
        auto.on_backward_end()
        step(auto, opt)
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [8, 8, 8]
    assert rows[2]["duration_s"] < 0.15, rows[2]  # not the evaluation's 0.2 s


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_with_the_model_in_eval_mode_counts(auto, accumulate):
    """Fine-tuning with frozen batch-norm and dropout (`model.eval()` while training): each
    forward is followed by its backward, so it trains, and is timed as the step's forward."""
    opt, loader = object(), object()
    for _ in range(3):
        for _ in range(accumulate):
            batch = torch.zeros(8, 3)
            auto.on_batch(batch, 0.0, loader)
            auto.on_forward_start(((batch,), {}), False)
            time.sleep(PAUSE_S)
            auto.on_forward_end()
            auto.on_backward_start()
            auto.on_backward_end()
        step(auto, opt)
    rows = steps(auto)
    assert [r["samples"] for r in rows] == [8 * accumulate] * 3
    assert all(r["forward_s"] >= PAUSE_S for r in rows), rows
    assert all(r["backward_s"] is not None for r in rows), rows
