"""A step whose body marks no phase is timed from what `wrap` knows: the model's forward,
from its end to the optimizer's step (backward), the optimizer's step. Such a run failed
`trainspec validate` (three required phases empty on every row, and with no optimizer given
to `wrap`, the gradient norm too). A step that marks any phase keeps exactly its own marks.

The phases are read on the session's clock; here a clock the test moves by hand, so each
phase's length is known exactly (a phase counted twice, or read on another clock, shows)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from trainspec.runtime.step_timer import HostPhaseClock


class HandClock(HostPhaseClock):
    """A phase clock that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now


class Costly(torch.nn.Module):
    """A model whose forward takes `cost` on the hand clock."""

    def __init__(self, clock: HandClock, cost: float = 3.0) -> None:
        super().__init__()
        self.clock, self.cost = clock, cost
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.cost
        return self.lin(x)


FORWARD, BACKWARD, OPTIMIZER = 3.0, 5.0, 2.0


@pytest.fixture
def setup(ts):
    """The session on a hand clock, a costly model, its optimizer, and the step records."""
    clock = HandClock()
    ts.clock = clock
    records: list = []
    ts.record_listeners.append(records.append)
    model = Costly(clock)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ts, clock, model, opt, records


def _train(clock: HandClock, model, opt, micro_batches: int = 1) -> float:
    """Forward, `loss.backward()` and the optimizer's step, each taking its known time on the
    hand clock; returns the gradient norm the optimizer saw."""
    for _ in range(micro_batches):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        clock.now += BACKWARD
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    opt.step(lambda: _tick(clock, OPTIMIZER))
    opt.zero_grad()
    return norm


def _tick(clock: HandClock, cost: float) -> None:
    clock.now += cost


def _phases(record) -> tuple:
    return (record.forward_s, record.backward_s, record.optimizer_s)


@pytest.mark.parametrize("given", [True, False], ids=["optimizer", "no-optimizer"])
def test_a_step_with_no_phase_marked_is_timed_by_the_hooks(setup, given):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt if given else None)
    norms = []
    for _ in range(3):
        with ts.step(samples=2):
            norms.append(_train(clock, model, opt))
    assert [_phases(r) for r in records] == [(FORWARD, BACKWARD, OPTIMIZER)] * 3
    # With no optimizer given, the norm is read at the step of whichever optimizer steps the
    # model's parameters (it was never read).
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-6)


def test_the_forwards_of_an_accumulated_step_add_up(setup):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt)
    with ts.step(samples=6):
        _train(clock, model, opt, micro_batches=3)
    assert _phases(records[0]) == (3 * FORWARD, 3 * BACKWARD, OPTIMIZER)


def test_a_step_that_marks_a_phase_keeps_exactly_its_own_marks(setup):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt)
    with ts.step(samples=2) as s:
        with s.phase("forward"):  # around the model's forward: counted once, not twice
            loss = model(torch.randn(2, 4)).sum()
            clock.now += 1.0
        loss.backward()
        opt.step()
    with ts.step(samples=2) as s:
        loss = model(torch.randn(2, 4)).sum()  # before the script's first mark: not mixed in
        loss.backward()
        with s.phase("optimizer"):
            opt.step(lambda: _tick(clock, OPTIMIZER))
    assert _phases(records[0]) == (FORWARD + 1.0, None, None)
    assert _phases(records[1]) == (None, None, OPTIMIZER)


def test_a_step_marked_by_hand_is_left_to_whoever_marked_it(setup):
    """The zero-code layer drives the session by hand (`begin_step`, `ctx.timing`): the
    hooks must not add to what it times."""
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt)
    ctx = ts.begin_step(samples=2)
    ctx.timing.begin("forward")
    loss = model(torch.randn(2, 4)).sum()
    ctx.timing.end("forward")
    loss.backward()
    opt.step()
    ts.end_step(ctx)
    assert _phases(records[0]) == (FORWARD, None, None)


def test_a_step_with_no_forward_records_what_it_has(setup):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt)
    with ts.step(samples=2):
        pass
    with ts.step(samples=2):
        model(torch.randn(2, 4)).sum().backward()
        opt.zero_grad()  # the optimizer never steps: the backward has no end
    with ts.step(samples=2):
        opt.step(lambda: _tick(clock, OPTIMIZER))
    assert [_phases(r) for r in records] == [
        (None, None, None),
        (FORWARD, None, None),
        (None, None, OPTIMIZER),
    ]


def test_work_outside_a_step_or_without_gradients_is_not_the_steps(setup):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model)
    model(torch.randn(2, 4)).sum().backward()  # before the step: not its forward
    opt.step()  # nor its optimizer, nor its gradient norm
    opt.zero_grad()
    with ts.step(samples=2):
        with torch.no_grad():
            model(torch.randn(2, 4))  # an evaluation inside the step
        clock.now += 7.0
        opt.step()
    assert _phases(records[0]) == (None, None, 0.0)
    assert records[0].grad_norm is None


def test_another_models_optimizer_does_not_overwrite_the_norm(setup):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model)  # no optimizer: the norm is read at any optimizer's step
    other = torch.nn.Linear(4, 1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with ts.step(samples=2):
        loss = model(torch.randn(2, 4)).sum() + other(torch.randn(2, 4)).sum()
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        opt.step()
        opt.zero_grad(set_to_none=False)  # the model's gradients are 0 at the other's step
        other_opt.step()
    assert records[0].grad_norm == pytest.approx(norm, rel=1e-6)


def test_the_global_optimizer_hooks_go_when_the_session_closes(setup):
    ts, clock, model, opt, records = setup
    before = (
        len(torch_optimizer._global_optimizer_pre_hooks),
        len(torch_optimizer._global_optimizer_post_hooks),
    )
    model = ts.wrap(model)
    assert len(torch_optimizer._global_optimizer_pre_hooks) == before[0] + 1
    ts.close()
    after = (
        len(torch_optimizer._global_optimizer_pre_hooks),
        len(torch_optimizer._global_optimizer_post_hooks),
    )
    assert after == before
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_micro_steps_are_observed_without_backward_blocks(setup):
    """`wrap(micro_batch_size=...)` estimates the gradient's variance across micro-steps;
    each automatic backward's end is one, as a `phase("backward")` block's end is."""
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt, micro_batch_size=2)
    with ts.step(samples=6):
        norm = _train(clock, model, opt, micro_batches=3)
    # The last micro-step is observed before the update reads the statistics: the norm is
    # that of all three micro-batches' gradient.
    assert records[0].grad_norm == pytest.approx(norm, rel=1e-5)
    assert records[0].grad_variance is not None


def _micro_statistics(ts, scale: float, blocks: bool) -> tuple:
    """Three steps of three micro-batches under a GradScaler at `scale` (lr 0: the same
    gradients every step); the last step's norm, variance and noise scale."""
    records: list = []
    ts.record_listeners.append(records.append)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model = ts.wrap(model, optimizer=opt, micro_batch_size=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 16, generator=gen) for _ in range(3)]
    for _ in range(3):
        with ts.step(samples=12) as s:
            for x in data:
                loss = model(x).pow(2).mean() / 3
                if blocks:
                    with s.phase("backward"):
                        scaler.scale(loss).backward()
                else:
                    scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    r = records[-1]
    return r.grad_norm, r.grad_variance, r.grad_noise_scale


@pytest.mark.parametrize("blocks", [True, False], ids=["backward-blocks", "automatic"])
def test_micro_steps_under_a_grad_scaler_are_read_before_it_unscales(ts, blocks):
    """The last automatic backward ended at the optimizer's pre-hook, after `scaler.step` had
    unscaled the gradients: its micro-step mixed scaled and unscaled gradients (a norm of
    0.0034 for 3.45, no noise scale). It ends as the scaler starts unscaling now."""
    norm, variance, noise = _micro_statistics(ts, 1024.0, blocks)
    assert norm == pytest.approx(3.44714, rel=1e-4)
    assert variance == pytest.approx(62.7125, rel=1e-3)
    assert noise == pytest.approx(9.42095, rel=1e-3)


def test_a_compiled_model_keeps_its_forward_phase_and_dynamo_never_traces_the_hooks(ts):
    """On the session's own clock (perf_counter on CPU): traced by Dynamo, the hooks broke
    the user's graph at the clock and their state."""
    records: list = []
    ts.record_listeners.append(records.append)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(ts.wrap(model, optimizer=opt), backend="eager")
    torch._dynamo.utils.counters.clear()
    for _ in range(2):
        with ts.step(samples=2):
            compiled(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert all(r.forward_s is not None and r.forward_s > 0 for r in records) and len(records) == 2
    # One clean break at the compiled region's edge, where the hooks run as plain Python.
    reasons = list(torch._dynamo.utils.counters["graph_break"])
    assert all("torch.compiler.disable" in reason for reason in reasons), reasons


def test_a_wrapped_model_saved_whole_loads_and_runs(setup):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # pickles its hooks: ours cannot carry the session
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded(torch.randn(2, 4)).shape == (2, 1)


def test_a_scripted_model_is_wrapped_without_forward_hooks(setup, caplog):
    """TorchScript modules refuse forward hooks: `wrap` raised where it used to work."""
    ts, clock, model, opt, records = setup
    scripted = ts.wrap(torch.jit.script(torch.nn.Linear(4, 1)))
    opt = torch.optim.SGD(scripted.parameters(), lr=0.1)
    with ts.step(samples=2):
        scripted(torch.randn(2, 4)).sum().backward()
        opt.step(lambda: _tick(clock, OPTIMIZER))
    assert _phases(records[0]) == (None, None, OPTIMIZER)
    assert records[0].grad_norm is not None
    assert "no forward or backward phase from RecursiveScriptModule" in caplog.text


def test_a_failing_hook_never_reaches_the_script(setup, caplog):
    ts, clock, model, opt, records = setup
    model = ts.wrap(model, optimizer=opt, micro_batch_size=2)

    def broken() -> None:
        raise RuntimeError("observer broke")

    ts.grad_source.after_backward = broken
    with ts.step(samples=4):
        _train(clock, model, opt, micro_batches=2)
    assert "observer broke" in caplog.text
    assert records[0].forward_s == 2 * FORWARD


def test_a_short_run_without_phase_blocks_is_compliant(ts):
    """The README's loop with no `phase()` blocks and no optimizer given to `wrap`."""
    from trainspec.schema import load_catalogue
    from trainspec.store.compliance import validate_target

    model = ts.wrap(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        with ts.step(samples=4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    ts.close()
    report = validate_target(ts.run_dir)
    steps = {m.name for m in load_catalogue() if m.store_table == "steps"}
    assert not [v for v in report.violations if v.metric in steps], report.render_text()
