"""
How a run shares the CPU with other work. Every entry point (train.py, eval.py, bench.py, the tests)
imports this module before torch, because OpenMP reads its settings once, when torch's library
loads.

After each parallel region torch's CPU threads (libgomp) spin GOMP_SPINCOUNT times before they
sleep: 300,000 by default, milliseconds. Alone that saves a wake-up; on a busy machine every spin
takes a core from a thread that has work, and the tiny model's thousands of small ops a step make
that most of the step (a default step took 7x its time alone beside two busy processes per core, a
warm-up step up to 23x; ~40x was seen on a machine at load 9). Sleeping at once
(OMP_WAIT_POLICY=PASSIVE) is the fastest under load but pays a wake-up per op alone (a default step
1.3-1.9x slower). 10,000 spins keep a step alone within ~5% and take most of the loss under load
away (bench.py share; docs/results.md, "Sharing the machine"). It changes no result: the same work
in the same order. A value you set yourself (GOMP_SPINCOUNT or OMP_WAIT_POLICY) wins.

A container's CPU quota (docker --cpus, a Kubernetes CPU limit) throttles time but hides no core:
torch starts a thread per physical core it may run on, and those threads wait on each other while
the kernel stops the group (in one core's quota a default step took 6.4 s on 2 threads, 4.3 s on
one: bench.py quota). Where a quota is below torch's own count, OMP_NUM_THREADS is set to it before
torch loads (as uber-go/automaxprocs sets Go's threads); a value you set wins.
"""
import math
import os
import re
import sys

SPINCOUNT = "10000"

if "torch" in sys.modules:  # too late for this process; its children still inherit the settings
    print("threads.py: imported after torch: OpenMP's settings are for child processes only",
          file=sys.stderr)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPINCOUNT


def load_per_core():
    """The machine's 1-minute load average over its cores (the kernel's count, as the load is the whole
    kernel's): about 1.0 with every core busy, this run's own threads included. Each step's metrics
    line keeps it (`load_per_core`), so a slow run says whether it shared the machine."""
    return os.getloadavg()[0] / os.cpu_count()


def cpu_quota(root="/"):
    """The CPU time this process's cgroups allow, in cores, or None where none is set: the smallest
    limit over its cgroup and those above it (a parent's limit binds its children), from cgroup v2's
    `cpu.max` ("$MAX $PERIOD", "max" for none) or v1's `cpu.cfs_quota_us` (-1 for none) over
    `cpu.cfs_period_us`. Each hierarchy is found where it is mounted (/proc/self/mountinfo) and the
    process's path taken relative to the mount's root: a container without its own cgroup namespace
    lists the host's path and mounts its own cgroup (as uber-go/automaxprocs reads them). Anything
    unreadable counts as no limit. `root` stands in for "/" (the tests)."""
    try:  # (paths are bytes to the kernel: a mount's non-UTF-8 name reads, never raises)
        cgroups = _read(os.path.join(root, "proc/self/cgroup")).splitlines()
        mounts = _read(os.path.join(root, "proc/self/mountinfo")).splitlines()
    except OSError:  # not Linux
        return None
    limits = []
    for line in cgroups:  # "ID:CONTROLLERS:PATH"; v2's controllers are empty
        fields = line.split(":", 2)
        if len(fields) < 3 or (fields[1] and "cpu" not in fields[1].split(",")):
            continue
        for mount in mounts:  # "... MOUNT_ROOT MOUNT_POINT ... - TYPE SOURCE OPTIONS"
            left, _, right = mount.partition(" - ")
            left, right = left.split(), right.split()
            if len(left) < 5 or len(right) < 3:
                continue
            v2 = right[0] == "cgroup2"
            v1_cpu = right[0] == "cgroup" and "cpu" in right[2].split(",")
            if (v2 and not fields[1]) or (v1_cpu and fields[1]):  # each line with its own hierarchy
                limits += _limits_up(root, _unescape(left[3]), _unescape(left[4]), fields[2], v2)
    return min(limits) if limits else None


def _read(path):
    return open(path, errors="surrogateescape").read()


def _unescape(name):
    """A mountinfo name as it is: the kernel writes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), name)


def _limits_up(root, mount_root, mount_point, path, v2):
    """The limits of the cgroup at `path` and of each one above it, up to the mount's root."""
    outside = mount_root != "/" and not (path + "/").startswith(mount_root + "/")
    if outside or ".." in path.split("/"):  # (/../x: outside the cgroup namespace's root)
        return []  # a cgroup outside what this mount shows
    parts = [p for p in path[len(mount_root.rstrip("/")):].split("/") if p]
    top = os.path.join(root, mount_point.lstrip("/"))
    limits = [_limit(os.path.join(top, *parts[:depth]), v2) for depth in range(len(parts), -1, -1)]
    return [x for x in limits if x is not None]


def _limit(folder, v2):
    """One cgroup's CPU limit in cores, or None (none set, or nothing readable)."""
    try:
        if v2:
            quota, period = _read(os.path.join(folder, "cpu.max")).split()
        else:
            quota = _read(os.path.join(folder, "cpu.cfs_quota_us")).strip()
            period = _read(os.path.join(folder, "cpu.cfs_period_us")).strip()
        if quota in ("max", "-1") or int(quota) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cores():
    """The CPUs this process may use: those it may run on, fewer where a CPU quota allows less
    (rounded to the nearest core, at least one: in 1.2 cores' quota one thread was faster, in 1.5
    two)."""
    quota = cpu_quota()
    if quota is None:
        return visible_cores()
    return max(1, min(visible_cores(), math.floor(quota + 0.5)))


def visible_cores():
    """The CPUs this process may run on (its affinity; all of them where the OS has no such call)."""
    return len(_cpus())


def torch_threads():
    """torch's own thread count where nothing is set: a thread per physical core among the CPUs this
    process may run on (SMT siblings count once: c10's thread_pool.cpp, defaultNumThreads)."""
    cores = set()
    for cpu in _cpus():
        try:
            siblings = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
            cores.add(open(siblings).read().strip())
        except OSError:  # no sysfs: count the CPUs
            return len(_cpus())
    return len(cores)


def _cpus():
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return range(os.cpu_count() or 1)


# the threads set here for a CPU quota (0: none). The entry points also hand it to torch once it has
# loaded: a libgomp loaded before Python (LD_PRELOAD, as vLLM's CPU docs advise and vLLM sets for its
# children) has read the environment before this line
QUOTA_THREADS = 0
if "OMP_NUM_THREADS" not in os.environ and cpu_quota() is not None:
    if usable_cores() < torch_threads():  # never more than torch's own count
        QUOTA_THREADS = usable_cores()
        os.environ["OMP_NUM_THREADS"] = str(QUOTA_THREADS)
