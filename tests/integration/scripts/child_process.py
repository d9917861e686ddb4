"""A script that imports nothing of trainspec: each rank starts a Python child and reports
whether torch was imported in it (trainspec's start-up instrumentation imports torch), and
whether the user's own sitecustomize ran in the rank and in the child."""

from __future__ import annotations

import os
import subprocess
import sys

probe = "import sys; print('torch' in sys.modules, 'USER_SITE_RAN' in __import__('os').environ)"
child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
print(f"rank {os.environ['RANK']} child {child.stdout.strip()} "
      f"self-user-site {'USER_SITE_RAN' in os.environ}", flush=True)  # fmt: skip
