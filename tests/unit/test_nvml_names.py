"""Every NVML entry point and constant trainspec names exists in the installed nvidia-ml-py.

No GPU is needed to catch a misspelt name, and one would otherwise go unseen on a GPU too:
the samplers treat an AttributeError as a field the device does not support (old bindings
lack new fields), so a typo would switch a metric off with one log line at info level."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pynvml = pytest.importorskip("pynvml")

SOURCE = Path(__file__).resolve().parents[2] / "src" / "trainspec"
NVML_NAME = re.compile(r"^(nvml[A-Z]\w*|NVML_\w+)$")
# Names read with getattr and a fallback, for bindings older or newer than the one installed.
OPTIONAL = {
    "nvmlDeviceGetCurrentClocksEventReasons",  # renamed from ...ThrottleReasons in 12.x
}


def _names_used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            else:
                continue
            if NVML_NAME.match(name):
                used.setdefault(name, []).append(f"{path.relative_to(SOURCE)}:{node.lineno}")
    return used


def test_the_samplers_name_nvml_functions_and_constants():
    used = _names_used()
    # The scan sees the samplers: a scan that found nothing would pass vacuously.
    assert {"nvmlDeviceGetMemoryInfo", "NVML_FI_DEV_POWER_INSTANT"} <= set(used)


def test_every_nvml_name_trainspec_uses_exists_in_the_bindings():
    # `nvmlReturn` is a member of the field-value struct, not of the module.
    struct_members = {name for name, _ in pynvml.c_nvmlFieldValue_t._fields_}
    missing = {
        name: where
        for name, where in _names_used().items()
        if name not in OPTIONAL | struct_members and not hasattr(pynvml, name)
    }
    assert not missing, f"not in nvidia-ml-py {getattr(pynvml, '__version__', '?')}: {missing}"
