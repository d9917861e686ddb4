"""One process that records steps forever, printing each; the test stops it with SIGTERM."""

import sys
import time

import trainspec

ts = trainspec.init(run_root=sys.argv[1], run_id="sigterm")
step = 0
while True:
    with ts.step(samples=4):
        time.sleep(0.02)
    print(f"step {step}", flush=True)
    step += 1
