"""One rank of a job that checks a shadow pass of DDP's `join()` adds exactly nothing: run
under torchrun (2 or 3 gloo ranks) as join_exact_worker.py OUT_DIR LEVEL...

Rank r trains STEPS[r] steps of SHARES[r] samples and then joins: with 2 ranks rank 1
shadows steps 2-3; with 3, rank 2 shadows steps 2-4 and rank 1 step 4. The first steps give
every rank an error-feedback residual. On each step some rank sits out, every rank that
trained it records each bucket's exchange (the codec's state just before it, and its inputs)
and, after the backward, replays them through copies of the codec on a process group of the
ranks that trained the step alone (`LocalWire` for one): what the step must give when the
rank in its shadow pass adds exactly 0 and the error-feedback credit goes to the ranks that
trained. The gradient DDP handed back and this rank's residuals after the step are compared
with that replay bitwise, and with the step's uncompressed weighted sum for scale. A joined
rank compares its residuals before and after its shadow passes. Each rank writes
OUT_DIR/rank<r>.json."""

from __future__ import annotations

import copy
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainspec.kernels import CompressionHook, LocalWire
from trainspec.kernels.wire import Wire

SHARES = {2: (3, 2), 3: (4, 3, 2)}
STEPS = {2: (4, 2), 3: (5, 4, 2)}
TIMEOUT = timedelta(seconds=60)


class Replay:
    """Records each bucket's exchange on this rank while `on`: a copy of the codec as it stood
    just before (warm starts, step count), and copies of the bucket, weight, residual and
    shapes it was given; and each bucket's parameters (`bucket.parameters()`)."""

    def __init__(self, hook: CompressionHook) -> None:
        self.on = False
        self.calls: list[tuple[Any, ...]] = []
        self.params: dict[int, list[torch.Tensor]] = {}
        codec = hook._codec  # one level for the whole run
        for name in ("reduce", "reduce_carrying"):
            real = getattr(codec, name, None)
            if real is not None:
                setattr(codec, name, self._recording(codec, real, name))
        on_bucket = hook.on_bucket

        def recording_bucket(bucket: dist.GradBucket) -> torch.futures.Future:
            self.params[bucket.index()] = bucket.parameters()
            return on_bucket(bucket)

        hook.on_bucket = recording_bucket  # type: ignore[method-assign]

    def _recording(self, codec: Any, real: Any, name: str) -> Any:
        def call(grad, weight, residual, key, wire, *rest):  # type: ignore[no-untyped-def]
            if self.on:
                twin = copy.deepcopy(codec)
                vars(twin).pop("reduce", None)  # the copies of these wrappers
                vars(twin).pop("reduce_carrying", None)
                kept = None if residual is None else residual.clone()
                shapes = rest[0] if name == "reduce" and rest else None
                self.calls.append((twin, grad.clone(), weight, kept, key, shapes))
            return real(grad, weight, residual, key, wire, *rest)

        return call

    def replay(self, wire: Wire) -> dict[int, Any]:
        """Each recorded exchange again, on `wire`, in the order the hook made them."""
        out = {}
        for twin, grad, weight, residual, key, shapes in self.calls:
            out[key] = twin.reduce(grad, weight, residual, key, wire, shapes).wait()
        self.calls = []
        return out


def _by_parameter(flat: torch.Tensor, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    pieces = flat.split([p.numel() for p in params])
    return {id(p): piece for p, piece in zip(params, pieces, strict=True)}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def run_level(level: str, rank: int, world: int, groups: dict[tuple[int, ...], Any]) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    # ~1 KB buckets: several, chained, the last one carrying the statistics at `none`
    model = DDP(net, bucket_cap_mb=0.001)
    hook = CompressionHook(level)
    shares, steps = SHARES[world], STEPS[world]
    hook.set_shares(shares[rank], sum(shares))
    hook.register(model)
    replay = Replay(hook)
    weight = shares[rank] / sum(shares)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    params = list(model.parameters())
    join_steps: list[dict] = []
    with model.join():
        for step in range(steps[rank]):
            active = tuple(r for r in range(world) if steps[r] > step)
            x = torch.randn(shares[rank], 8, generator=gen)
            y = torch.randn(shares[rank], 4, generator=gen)
            own = torch.autograd.grad(nn.functional.mse_loss(net(x), y), params)
            opt.zero_grad()
            replay.on = len(active) < world
            nn.functional.mse_loss(model(x), y).backward()
            replay.on = False
            if len(active) < world:
                join_steps.append(_check_step(step, active, hook, replay, params, own, weight,
                                              groups[active]))  # fmt: skip
            opt.step()
        # Data ran out: what this rank owes, before its shadow passes for the others' steps.
        before = {k: v.clone() for k, v in hook.error_feedback().items()}
    after = hook.error_feedback()
    changed = [
        float((after[k] - v).abs().max()) if k in after else float("inf")
        for k, v in before.items()
        if k not in after or not torch.equal(after[k], v)
    ]
    return {
        "level": hook.level,
        "join_steps": join_steps,
        "shadow_passes": max(steps) - steps[rank],
        "held_pieces": len(before),
        "held_nonzero": sum(int(bool(v.abs().max() > 0)) for v in before.values() if v.numel()),
        "pieces_after": len(after),
        "residual_changed": changed,
    }


def _check_step(
    step: int,
    active: tuple[int, ...],
    hook: CompressionHook,
    replay: Replay,
    params: list[torch.Tensor],
    own: tuple[torch.Tensor, ...],
    weight: float,
    group: Any,
) -> dict:
    """This step against its replay on the ranks that trained it alone (`Replay`)."""
    wire = LocalWire() if group is None else Wire(group)
    alone = replay.replay(wire)
    want_grad: dict[int, torch.Tensor] = {}
    want_residual: dict[int, torch.Tensor] = {}
    for key, result in alone.items():
        want_grad.update(_by_parameter(result.summed, replay.params[key]))
        if result.residual is not None:
            want_residual.update(_by_parameter(result.residual, replay.params[key]))
    applied = torch.cat([p.grad.reshape(-1) for p in params])
    expected = torch.cat([want_grad[id(p)].reshape(-1) for p in params])
    # The step's uncompressed weighted sum over the ranks that trained it, for scale.
    exact = torch.cat([(g * weight).reshape(-1) for g in own])
    if group is not None:
        dist.all_reduce(exact, group=group)
    held = hook.error_feedback()
    residual_equal = set(held) == set(want_residual) and all(
        torch.equal(held[k], v) for k, v in want_residual.items()
    )
    residual_err = max(
        (_rel(held[k], v) for k, v in want_residual.items() if k in held and v.norm() > 0),
        default=0.0,
    )
    return {
        "step": step,
        "active": list(active),
        "buckets": len(alone),
        "grad_equal": bool(torch.equal(applied, expected)),
        "grad_err": _rel(applied, expected),
        "codec_err": _rel(expected, exact),  # the codec's own error, every rank training
        "applied_vs_uncompressed": _rel(applied, exact),
        "residual_equal": residual_equal,
        "residual_err": residual_err,
    }


def main(argv: list[str]) -> int:
    out_dir, levels = argv[0], argv[1:]
    if not levels:
        print("usage: join_exact_worker.py OUT_DIR LEVEL...", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in STEPS:
        print(f"join_exact_worker.py runs on 2 or 3 ranks, not {world}", file=sys.stderr)
        return 2
    # A group of the ranks that trained each step some rank sat out (every rank makes each)
    groups: dict[tuple[int, ...], Any] = {}
    for step in range(max(STEPS[world])):
        active = tuple(r for r in range(world) if STEPS[world][r] > step)
        if len(active) < world and active not in groups:
            groups[active] = None
            if len(active) > 1:
                groups[active] = dist.new_group(list(active), timeout=TIMEOUT)
    try:
        report = {"rank": rank, "world": world,
                  "levels": [run_level(level, rank, world, groups) for level in levels]}  # fmt: skip
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(report, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
