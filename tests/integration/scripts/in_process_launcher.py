"""Runs torchrun inside its own process, as `accelerate launch` and other wrappers do:
`python in_process_launcher.py SCRIPT` starts 2 ranks of SCRIPT."""

from __future__ import annotations

import sys

from torch.distributed.run import main

if __name__ == "__main__":
    main(["--standalone", "--nproc-per-node", "2", *sys.argv[1:]])
