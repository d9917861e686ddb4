"""Two ranks, two DDP models wrapped by one session (`ts.wrap` twice), explicit mode.

Step 0 at level `none`, shares 6 and 2 of 8 samples set once on the session's hook: each
model's reduced gradient must equal its single-process full-batch gradient, and the step's
stored gradient norm must be the norm over both models. Before step 1 a level switch asked of
the session's hook must reach both models' hooks. Writes, per rank, to argv[1] (with {rank}):
{"hooks", "max_abs_diff", "max_abs_grad", "norm_step0", "levels_after", "late_shares",
"late_level", "noise_step1"}.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

import trainspec
from trainspec.runtime.hook_wiring import hook_of

SHARES = [6, 2]


def mlp(n_in: int, n_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, 16), torch.nn.Tanh(), torch.nn.Linear(16, n_out)
    )


def main() -> int:
    out = sys.argv[1]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ts = trainspec.init()
    rank = ts.identity.rank
    refs = [mlp(8, 4), mlp(4, 1)]
    models = [mlp(8, 4), mlp(4, 1)]
    for ref, m in zip(refs, models, strict=True):
        m.load_state_dict(ref.state_dict())
    a, b = (ts.wrap(m) for m in models)
    hooks = ts.hook
    ts.manage_shares()
    hooks.set_shares(SHARES[rank], sum(SHARES))

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SHARES), 8, generator=gen)
    y = torch.randn(sum(SHARES), 1, generator=gen)
    lo = sum(SHARES[:rank])
    mine = slice(lo, lo + SHARES[rank])

    def losses(first, second, rows):
        h = first(x[rows])
        return h.pow(2).mean(), (second(h.detach()[:, :4]) - y[rows]).pow(2).mean()

    with ts.step(samples=SHARES[rank]):
        la, lb = losses(a, b, mine)
        la.backward()
        lb.backward()
    got = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (a, b)]
    ra, rb = losses(refs[0], refs[1], slice(None))
    ra.backward()
    rb.backward()
    want = [torch.cat([p.grad.reshape(-1) for p in r.parameters()]) for r in refs]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in got))

    hooks.set_level("int8")  # at the next step, on every model
    for m in (a, b):
        m.zero_grad()
    with ts.step(samples=SHARES[rank]):
        la, lb = losses(a, b, mine)
        la.backward()
        lb.backward()
    # The step's noise scale: both models' smoothed terms summed, then their ratio.
    terms = [hook_of(m).noise_terms() for m in (a, b)]
    noise = None
    if all(t is not None for t in terms):
        noise = sum(t[0] for t in terms if t) / sum(t[1] for t in terms if t)
    # A third model wrapped after actuate(): it starts at the actuated shares and level.
    ts.actuate(dataset_len=64, global_batch=8, seed=0)
    late = ts.wrap(mlp(2, 1))
    record = {
        "late_shares": [list(hook_of(m).shares) for m in (a, late)],
        "late_level": hook_of(late).next_level,
        "hooks": type(hooks).__name__,
        "max_abs_diff": max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)),
        "max_abs_grad": max(float(w.abs().max()) for w in want),
        "norm_step0": norm,
        "levels_after": [hook_of(m).level for m in (a, b)],
        "noise_step1": noise,
    }
    ts.close()
    with open(out.replace("{rank}", str(rank)), "w") as fh:
        json.dump(record, fh)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
