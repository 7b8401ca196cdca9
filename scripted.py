"""
A scripted policy in place of a model, for tests, `python bench.py env` and `train.py --engine scripted`: it drives
the rollouts through code and math end to end with answers a tiny model could never write (right ones, wrong ones,
programs that loop forever, hostile programs).
"""
import functools
import json

import judge
from model import iter_hf_state, load_tokenizer
from engines import Completion, Engine, stop_ids


class ScriptedEngine(Engine):
    """A scripted policy in place of a model: each answer is `script(prompt_text, rng)`, tokenized with the model
    folder's tokenizer; the log-probs are placeholders (0.0). It lets tests and `python bench.py env` drive
    tree_rollout, plain_rollout and `train.py --engine scripted` through code and math end to end, with answers a
    tiny model could never write. Reproducible: the rng is seeded from the engine seed and the call seed."""

    def __init__(self, model_dir, seed=0, max_len=2048, script=None):
        self.tok = load_tokenizer(model_dir)
        self.stop, self.n_tokens = stop_ids(model_dir)
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.max_len, self.seed, self.calls = max_len, seed, 0
        self.script = script or DefaultScript()

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, seed=None):
        import random
        rng = random.Random(f"{self.seed}-{self.calls if seed is None else seed}")
        self.calls += 1
        out, longest = [], 0
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            row = []
            for _ in range(n):
                ids = self.tok.encode(self.script(text, rng), add_special_tokens=False)
                longest = max(longest, len(ids))
                ids = ids[: max(0, max_new_tokens - 1)] + [self.eos]
                row.append(Completion(ids, [0.0] * len(ids)))
            out.append(row)
        self.say_if_cut(longest, max_new_tokens)
        return out

    def say_if_cut(self, longest, max_new_tokens):
        """Once per engine: the scripted answers did not fit the response budget, so they were
        cut (and mostly score 0): a line says so and how to fit them."""
        if longest + 1 > max_new_tokens and not getattr(self, "_said_cut", False):
            self._said_cut = True
            print(f"note: scripted answers are cut to the response budget of {max_new_tokens} "
                  f"tokens (--max_new_tokens; this call's longest has {longest}): give a budget "
                  "that fits them, e.g. --max_new_tokens 256", flush=True)

    def load(self, weights):
        for _ in weights:  # consumed: under FSDP2 each tensor is a collective every rank takes part in
            pass

    def sync(self, model):
        self.load(iter_hf_state(model))


@functools.lru_cache(maxsize=1)
def _question_rows():
    """{the first 300 characters of every code/math question: its rows}, and the keys' lengths, longest
    first: read once a process (every run's engine shares it; the suite starts hundreds of runs)."""
    import envs as E
    rows = {}
    for task in ("code", "math"):
        for split in ("train", "test"):
            for r in E.load_split(task, split):
                rows.setdefault(r["question"][:300], []).append(r)
    return rows, sorted({len(k) for k in rows}, reverse=True)


class DefaultScript:
    """Answers any task's prompt from the task's own data, by role (read from the system prompt):
      coder      the row's reference solution, or (no reference in the data) a lookup table of its ground-truth tests
      tester     the row's first ground-truth tests as cases
      math tool  a program printing the answer (sometimes importing sympy first, as tool agents do)
      reasoner   a short derivation ending in \\boxed{answer} (a team's judge and a solver answer the same way)
      verifier   approves the latest solution if its \\boxed{} answer is the row's, else rejects it
      search     the search task's verifier, search and answer agents on a generated world: search the
                 question's entity, then its link for a two-hop question, answer the value read
      games      a random move list in the answer format
    and, with the given probabilities, a wrong answer, a program that loops forever, or a hostile program."""

    def __init__(self, p_wrong=0.3, p_loop=0.05, p_hostile=0.02):
        self.p_wrong, self.p_loop, self.p_hostile = p_wrong, p_loop, p_hostile

    def rows(self):
        return _question_rows()[0]

    def _row(self, text):
        """The row this prompt is about. The same statement can be in two datasets (LiveCodeBench takes LeetCode
        problems): the prompt's answer format (assert lines, io cases, stdin) says which kind of row it is.
        A question shorter than 300 characters is its whole key, so every key length is tried (longest first)."""
        i = text.find("Problem:\n")
        table = self.rows()
        hits = (
            next((table[text[i + 9 : i + 9 + n]] for n in _question_rows()[1] if text[i + 9 : i + 9 + n] in table), [])
            if i >= 0
            else []
        )
        rows = [r for r in hits if r["question"] in text]
        if "assert line" in text:
            rows = [r for r in rows if r.get("test_type") == "code"] or rows
        elif "**Test Input:**" in text or "reads stdin" in text:
            rows = [r for r in rows if r.get("test_type") != "code"] or rows
        return rows[0] if rows else None

    def __call__(self, text, rng):
        role = next((r for key, r in (("You are the coder", "coder"), ("You are the unit tester", "tester"),
                                      ("computes the answer", "math_tool"), ("You are the reasoning agent", "reasoner"),
                                      ("You are the judge", "reasoner"), ("You are the Solver", "reasoner"),
                                      ("Verifier of a multi-agent team", "verifier"),
                                      ("of a search team", "search"))
                     if key in text), "game")
        u = rng.random()
        if role in ("coder", "math_tool") and u < self.p_loop:
            return "```python\nwhile True:\n    pass\n```"
        if role in ("coder", "math_tool") and u < self.p_loop + self.p_hostile:
            return "```python\nimport os\nprint(open('/etc/hostname').read())\nos.remove('/tmp/x')\n```"
        wrong = u > 1 - self.p_wrong
        if role == "search" or "\nq:" in text:
            return _script_search(text, wrong)
        row = self._row(text)
        if role == "game":
            moves = [rng.choice("UDLR") for _ in range(rng.randint(1, 6))]
            return f"```python\nprint({moves!r})\n```" if "tool agent" in text else f"#### {json.dumps(moves)}"
        if row is None:
            return "I do not know."
        if role == "reasoner":
            ans = "0" if (wrong and row["answer"].strip() != "0") else row["answer"]
            return f"Working it out step by step gives \\boxed{{{'1' if wrong and ans == row['answer'] else ans}}}."
        if role == "math_tool":
            ans = "-1" if wrong else row["answer"]
            pre = "import sympy\n" if rng.random() < 0.25 else ""
            return f"```python\n{pre}print({ans!r})\n```"
        if role == "tester":
            return _script_tests(row, wrong)
        if role == "verifier":
            import envs as E
            latest = text.rsplit('The output of "Solver":', 1)[-1].split('The output of "Verifier"')[0]
            right = E.math_equal(row["answer"], E.last_boxed(latest))
            return "<verify>" + ("approve" if right != wrong else "reject") + "</verify>"
        return "```python\n" + (_script_wrong(row) if wrong else _script_solution(row)) + "\n```"


def _script_search(text, wrong):
    """The search task on a generated world (full prompts): the entity in the question, its passage
    'x>y=v' once searched, the link's for a two-hop question."""
    import re
    compact = re.search(r"q:(\w)(>?)=\?", text)  # the tiny model's prompts: "q:a>=?", passages "a>c=5"
    start = compact or re.search(r"entity (?:linked to )?'(\w)'", text)
    if start is None:
        return "<verify>yes</verify>" if "Verifier" in text else "<answer>unknown</answer>"
    two_hops = bool(compact.group(2)) if compact else "linked to" in text
    start = start.group(1)
    history = text.split("q:", 1)[-1] if compact else text.split("Searches so far", 1)[-1]
    found = {x: (y, v) for x, y, v in re.findall(r"(\w)>(\w)=(\d)", history)}
    need = found[start][0] if two_hops and start in found else start
    enough = need in found and (not two_hops or start in found)
    value = found[need][1] if need in found else "0"
    value = str((int(value) + 1) % 10) if wrong else value
    if "You are the Verifier" in text or "\nOK?" in text:
        verdict = "yes" if enough != wrong else "no"
        return verdict[0] if compact else f"<verify>{verdict}</verify>"
    if "You are the Search agent" in text or "\nFIND:" in text:
        return need if compact else f"<think>look it up</think><search>{need}</search>"
    return value if compact else f"<think>read it</think><answer>{value}</answer>"


def _script_solution(row):
    ref = judge.reference_solution(row)
    if ref:
        return ref
    return judge.table_solution(row)


def _script_wrong(row):
    if row["test_type"] == "functional":
        return f"class Solution:\n    def {row['entry_point']}(self, *args):\n        return None\n"
    if row["test_type"] == "code":
        return (row["starter_code"] or "") + "\n    pass\n" if row["starter_code"] else "pass\n"
    return "print('wrong')\n"


def _script_tests(row, wrong):
    if row["test_type"] == "code":
        lines = [ln.strip() for ln in row["test_code"].splitlines() if ln.strip().startswith("assert")][:3]
        call = (
            f"Solution().{row['entry_point']}" if row["source"] == "leetcode" else (row["entry_point"] or "candidate")
        )
        lines = [ln.replace("candidate", call) for ln in lines]
        if wrong:
            lines = [ln.rsplit("==", 1)[0] + "== 'not this'" if "==" in ln else ln for ln in lines]
        return "```python\n" + "\n".join(lines) + "\n```"
    cases = row["tests"][:3]
    return "\n".join(
        f"**Test Input:**\n```\n{c['input']}\n```\n**Test Output:**\n```\n{'0' if wrong else c['output']}\n```"
        for c in cases
    )
