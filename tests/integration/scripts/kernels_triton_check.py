"""Compare the Triton int8 kernels with the torch reference; run with TRITON_INTERPRET=1 on
a CPU (or as is on a GPU). Prints one JSON line of measured differences; exit 0 = ran."""

from __future__ import annotations

import json
import sys

import torch

from trainspec.kernels import LocalWire, triton_int8
from trainspec.kernels.codecs import Int8Codec
from trainspec.kernels.codecs import int8 as reference


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    worst = {"codes_mismatch": 0, "scale_max_abs": 0.0, "residual_max_abs": 0.0, "acc_max_abs": 0.0}
    cases = 0
    for n in (1, 63, 64, 1000, 5000):
        for block in (64, 256):
            for with_residual in (False, True):
                g = (torch.randn(n, generator=gen) * 2).to(device)
                r = (torch.randn(n, generator=gen) * 0.01).to(device) if with_residual else None
                ref = reference.quantize_with_feedback(g, 0.5, r, block)
                got = triton_int8.quantize_with_feedback(g, 0.5, r, block)
                # A code may differ by one where x / scale lands on .5 within float rounding.
                worst["codes_mismatch"] = max(
                    worst["codes_mismatch"], int((ref[0].int() - got[0].int()).abs().max())
                )
                worst["scale_max_abs"] = max(
                    worst["scale_max_abs"], float((ref[1] - got[1]).abs().max())
                )
                worst["residual_max_abs"] = max(
                    worst["residual_max_abs"], float((ref[2] - got[2]).abs().max())
                )
                out_ref = torch.randn(n, generator=gen).to(device)
                out_got = out_ref.clone()
                reference.dequantize_accumulate(out_ref, ref[0], ref[1], block)
                triton_int8.dequantize_accumulate(out_got, ref[0], ref[1], block)
                worst["acc_max_abs"] = max(
                    worst["acc_max_abs"], float((out_ref - out_got).abs().max())
                )
                cases += 1
    # The codec end to end on the Triton backend agrees with the torch backend.
    g = torch.randn(3000, generator=gen).to(device)
    a = Int8Codec(256, backend="torch").reduce(g, 1.0, None, 0, LocalWire()).wait()
    b = Int8Codec(256, backend="triton").reduce(g, 1.0, None, 0, LocalWire()).wait()
    worst["codec_max_abs"] = float((a.summed - b.summed).abs().max())
    # A block holding a NaN or an infinity keeps a non-finite scale, as the reference does.
    bad = torch.linspace(-1, 1, 512).to(device)
    bad[300], bad[40] = float("nan"), float("inf")
    scales = triton_int8.quantize_with_feedback(bad, 1.0, None, 256)[1]
    worst["nonfinite_blocks"] = int((~torch.isfinite(scales)).sum())
    print(json.dumps({"cases": cases, "device": device, **worst}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
