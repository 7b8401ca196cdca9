"""
How a run shares the CPU with other work. Every entry point (train.py, eval.py, bench.py, the tests) imports this
module before torch, because OpenMP reads its settings once, when torch's library loads.

After each parallel region torch's CPU threads (libgomp) spin GOMP_SPINCOUNT times before they sleep: 300,000 by
default, milliseconds. Alone that saves a wake-up; on a busy machine every spin takes a core from a thread that has
work, and the tiny model's thousands of small ops a step make that most of the step (a default step took 7x its
time alone beside two busy processes per core, a warm-up step up to 23x; ~40x was seen on a machine at load 9).
Sleeping at once (OMP_WAIT_POLICY=PASSIVE) is the fastest under load but pays a wake-up per op alone (a default
step 1.3-1.9x slower). 10,000 spins keep a step alone within ~5% and take most of the loss under load away
(bench.py share; docs/results.md, "Sharing the machine"). It changes no result: the same work in the same order.
A value you set yourself (GOMP_SPINCOUNT or OMP_WAIT_POLICY) wins.
"""
import os
import sys

SPINCOUNT = "10000"

if "torch" in sys.modules:  # too late to matter in this process; its children still inherit the setting
    print("threads.py: imported after torch: OpenMP's spin count is set for child processes only", file=sys.stderr)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPINCOUNT


def load_per_core():
    """The machine's 1-minute load average over its cores (the kernel's count, as the load is the whole
    kernel's): about 1.0 with every core busy, this run's own threads included. Each step's metrics
    line keeps it (`load_per_core`), so a slow run says whether it shared the machine."""
    return os.getloadavg()[0] / os.cpu_count()
