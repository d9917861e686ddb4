"""Peak dense 16-bit tensor FLOP/s of common GPUs, for MFU when the user gives none.

Figures are the vendors' published dense (no sparsity) BF16/FP16 tensor-core peaks
(NVIDIA A100/H100/H200/L4/V100 datasheets). MFU follows Chowdhery et al. 2022 (PaLM,
appendix B): model FLOPs per second over this peak. Unknown devices (and CPUs) get None:
MFU is then not reported rather than guessed.
"""

from __future__ import annotations

# Substring of torch.cuda.get_device_name() -> peak FLOP/s (dense BF16/FP16 tensor).
_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("V100", 125e12),
)


def peak_flops_for(device_name: str) -> float | None:
    for key, peak in _PEAKS:
        if key in device_name:
            return peak
    return None
