"""Compare the Triton topk kernels with the torch reference; run with TRITON_INTERPRET=1 on a
CPU (or as is on a GPU). Prints one JSON line of measured differences; exit 0 = ran."""

from __future__ import annotations

import json
import sys

import torch

from trainspec.kernels import LocalWire, triton_topk
from trainspec.kernels.codecs import TopKCodec
from trainspec.kernels.codecs import topk as reference


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    worst = {"values_max_abs": 0.0, "residual_max_abs": 0.0, "sum_max_abs": 0.0}
    index_mismatches = cases = 0
    for n in (1, 7, 1000, 3000):
        for fraction in (0.01, 0.3, 1.0):
            for dtype in (torch.float32, torch.float16):
                for with_residual in (False, True):
                    g = (torch.randn(n, generator=gen) * 2).to(dtype).to(device)
                    r = (torch.randn(n, generator=gen) * 0.01).to(device) if with_residual else None
                    k = reference.kept_entries(n, fraction)
                    ref = reference.select_with_feedback(g, 0.5, r, k)
                    got = TopKCodec(fraction, backend="triton").select(g, 0.5, r, k)
                    order_ref, order_got = ref[1].argsort(), got[1].argsort()
                    index_mismatches += int((ref[1][order_ref] != got[1][order_got]).sum())
                    worst["values_max_abs"] = max(
                        worst["values_max_abs"],
                        _max_abs(ref[0][order_ref], got[0][order_got]),
                    )
                    worst["residual_max_abs"] = max(
                        worst["residual_max_abs"], _max_abs(ref[2], got[2])
                    )
                    out_ref = torch.randn(n, generator=gen).to(device)
                    out_got = out_ref.clone()
                    reference.scatter_accumulate(out_ref, ref[0], ref[1])
                    triton_topk.scatter_add(out_got, ref[0], ref[1])
                    worst["sum_max_abs"] = max(worst["sum_max_abs"], _max_abs(out_ref, out_got))
                    cases += 1
    # The codec end to end on the Triton backend agrees with the torch backend.
    g = torch.randn(3000, generator=gen).to(device)
    r = torch.randn(3000, generator=gen).to(device) * 0.01
    a = TopKCodec(0.05, backend="torch").reduce(g, 0.75, r, 0, LocalWire()).wait()
    b = TopKCodec(0.05, backend="triton").reduce(g, 0.75, r, 0, LocalWire()).wait()
    codec = {
        "codec_sum_max_abs": _max_abs(a.summed, b.summed),
        "codec_residual_max_abs": _max_abs(a.residual, b.residual),
    }
    # Nothing selected from an empty bucket, and an auto codec picks Triton only on CUDA.
    empty = triton_topk.take_and_clear(torch.zeros(0, device=device), torch.zeros(0).long())
    auto = TopKCodec(0.1)._use_triton(torch.device(device))
    print(json.dumps({"cases": cases, "device": device, "index_mismatches": index_mismatches,
                      **worst, **codec, "empty_values": empty[0].numel(),
                      "auto_uses_triton": auto}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
