"""Loaded by Python at start-up in every process `trainspec run` launches (via PYTHONPATH).

Only torchrun's workers (RANK set) with TRAINSPEC_AUTO=1 are instrumented; the launcher and
any other Python process started under it are left alone. A failure here is reported and
the script runs uninstrumented: telemetry never stops training.
"""

import os
import sys

if os.environ.get("TRAINSPEC_AUTO") == "1" and "RANK" in os.environ:
    try:
        from trainspec.runtime.auto import install

        install()
    except Exception as exc:  # noqa: BLE001 - must never break the user's script
        print(f"trainspec: instrumentation off: {type(exc).__name__}: {exc}", file=sys.stderr)
