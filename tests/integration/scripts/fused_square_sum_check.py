"""Compare the fused sum of squares (collector/fused_square_sum.py) with a float64 reference;
run with TRITON_INTERPRET=1 on a CPU (or as is on a GPU). Prints one JSON line of measured
figures; exit 0 = ran."""

from __future__ import annotations

import json
import sys

import torch

from trainspec.collector import fused_square_sum as fss
from trainspec.collector.gradients import square_sums_of


def reference(grads: list[torch.Tensor]) -> float:
    return sum(float(g.double().square().sum()) for g in grads)


class _NoFused:
    def square_sum(self, grads: list[torch.Tensor]) -> None:
        return None


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    interpret = device == "cpu"
    gen = torch.Generator().manual_seed(0)
    worst_rel = {"float32": 0.0, "bfloat16": 0.0, "float16": 0.0}
    cases = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # One element, one block exactly, a block and one, several blocks, and a mix of
        # tensor sizes in one launch (a model's weights, biases and norms).
        for sizes in (
            (1,),
            (fss.BLOCK,),
            (fss.BLOCK + 1,),
            (3 * fss.BLOCK + 17,),
            (5, 300, 4096, 77, 12289),
        ):
            grads = [torch.randn(n, generator=gen).to(dtype).to(device) for n in sizes]
            got = fss.FusedSquareSum(interpret=interpret).square_sum(grads)
            assert got is not None and got.dtype == torch.float64 and got.dim() == 0
            want = reference(grads)
            worst_rel[str(dtype).split(".")[1]] = max(
                worst_rel[str(dtype).split(".")[1]], abs(float(got) - want) / want
            )
            cases += 1

    # A steady loop: one table; gradients that move: a new one; the values follow.
    fused = fss.FusedSquareSum(interpret=interpret)
    grads = [torch.randn(n, generator=gen).to(device) for n in (10, 5000, 3)]
    sums = [float(fused.square_sum(grads)) for _ in range(3)]  # type: ignore[arg-type]
    steady_rel = abs(sums[0] - reference(grads)) / reference(grads)
    builds_steady = fused.builds
    grads[1] = torch.full((5000,), 2.0, device=device)  # a new tensor: another address
    moved = float(fused.square_sum(grads))  # type: ignore[arg-type]
    # Another gradient at an address a table has, with another size (a parameter whose
    # gradient was None let another's take its block): a table of its own, its own sum.
    shared = fss.FusedSquareSum(interpret=interpret)
    block = torch.randn(5000, generator=gen).to(device)
    shared.square_sum([block])
    head = float(shared.square_sum([block[:10]]))  # type: ignore[arg-type]
    same_address_rel = abs(head - reference([block[:10]])) / reference([block[:10]])
    # Two placements taking turns (parameters that have gradients on alternate steps): two
    # tables, each kept.
    turns = fss.FusedSquareSum(interpret=interpret)
    both = [torch.randn(n, generator=gen).to(device) for n in (100, 200)]
    turns_ok = all(
        abs(float(turns.square_sum(g)) - reference(g)) / reference(g) < 1e-6  # type: ignore[arg-type]
        for _ in range(3)
        for g in (both, both[:1])
    )
    # A model's parameters through the collector's own entry: the fused launch where it
    # applies, the foreach path where not (on CPU without the interpreter), the same sum.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 7)
    )
    model.to(device)(torch.randn(8, 64, generator=gen).to(device)).square().sum().backward()
    params = list(model.parameters())
    via_fused = square_sums_of(params, fss.FusedSquareSum(interpret=interpret))
    via_foreach = square_sums_of(params, _NoFused())
    result = {
        "cases": cases,
        "worst_rel": worst_rel,
        "steady_equal": sums[0] == sums[1] == sums[2],
        "steady_rel": steady_rel,
        "builds_steady": builds_steady,
        "builds_after_move": fused.builds,
        "moved_rel": abs(moved - reference(grads)) / reference(grads),
        # Where the path does not apply: the caller's foreach path takes over.
        "mixed_dtypes": fused.square_sum([grads[0], grads[1].half()]) is None,
        "non_contiguous": fused.square_sum([torch.randn(4, 6, device=device).t()]) is None,
        "empty": fused.square_sum([]) is None,
        "integer": fused.square_sum([torch.ones(4, dtype=torch.int32, device=device)]) is None,
        "turns_ok": turns_ok,
        "same_address_rel": same_address_rel,
        "same_address_builds": shared.builds,
        "turns_builds": turns.builds,
        "model_fused_dtype": str(via_fused[0].dtype),
        "model_rel": abs(float(via_fused[0]) - float(via_foreach[0])) / float(via_foreach[0]),
        "model_sums": len(via_fused),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
