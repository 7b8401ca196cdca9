"""
How a run shares the CPU with other work. Every entry point (train.py, eval.py, bench.py, the tests) imports this
module before torch, because OpenMP reads its settings once, when torch's library loads.

torch's CPU threads (libgomp) spin after each parallel region before they sleep (libgomp's default: 300,000
spins). Alone that saves a wake-up; on a busy machine every spin takes a core from a thread with work, and the
tiny model's thousands of small ops per step make that the whole step (a warm-up step took ~40x its alone time
beside other jobs). Waiting passively costs nothing alone and keeps a loaded run near its share of the cores
(bench.py share; docs/results.md, "Sharing the machine"). It changes no result: the same work, the same order.
A value you set yourself (OMP_WAIT_POLICY, or libgomp's GOMP_SPINCOUNT) wins.
"""
import os
import sys

if "torch" in sys.modules:  # too late to matter in this process; its children still inherit the setting
    print("threads.py: imported after torch: OpenMP's waiting is set for child processes only", file=sys.stderr)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
