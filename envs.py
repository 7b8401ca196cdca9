"""
The tasks of the AT-GRPO paper and Dr. MAS's workflows: two agents on most, three on search (verifier,
search, answer), N + M + 1 in a math team (N reasoners, M tool agents, a judge).

    env = make_env("plan", seed=3)            # or make_env("code", row=...), see TASKS / load_split
    msgs = env.observe("tool")                # chat messages for that role (render with the chat template)
    local = env.step("tool", text)            # parse + apply this role's answer; returns its local reward
    team = env.team_reward(); env.end_turn(); env.done, env.success
    branch = env.clone()                      # independent copy for tree sampling

Tasks and roles (`TASKS` has each task's workflows; docs/method.md §6):
    plan, sokoban, sudoku   tool -> plan       sequential: the tool agent writes Python whose printed answer is
                                               simulated on a copy; the plan agent gives the final
                                               answer
    code                    coder || tester    parallel: program vs generated unit tests
    math                    tool || reasoner   parallel: Python answer vs \\boxed{} answer
    math, solver_verifier   solver -> verifier looping until the verifier approves (Dr. MAS)
    math --team N,M         N reasoners || M tool agents, then a judge
    search                  verifier -> search or answer   the verifier routes; the search agent queries
                                               a retriever (Dr. MAS)
`workflow="single"` keeps only the last role of each (plan agent, coder, reasoner): the paper's
single-agent baseline. `compact=True` (the embedded CPU default) keeps the same state, rules and
rewards but renders terse prompts and lets the tool agent answer with the action list itself instead
of a program, so that a tiny model trained from scratch can learn it in minutes.

This file imports neither torch nor vllm. Model output is untrusted: parsers never raise; an
unparseable answer gets the format penalty; model code runs only in sandbox.py's `run_code`
(bubblewrap namespaces, rlimits, an audit hook).
"""
import copy
import json
import os
import random
import re
from collections import deque
from typing import NamedTuple

import judge
import retrieval
import sandbox
from judge import actual_output, code_pass_rate, math_equal, reference_solution, run_asserts, run_tests
from sandbox import run_code  # model-written code runs only there

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# Wall-clock limits of model-written programs (train.py --tool_timeout / --test_timeout set them). A
# tool agent's program (games: a search on a small grid; math: arithmetic, maybe sympy, whose import
# alone takes ~1 s) needs seconds, and every looping candidate costs the whole limit; a code test
# gets LiveCodeBench's own 6 s per test.
TOOL_TIMEOUT = 5.0


def set_timeouts(tool, test):
    """train.py's --tool_timeout (here) and --test_timeout (the code judge's)."""
    global TOOL_TIMEOUT
    TOOL_TIMEOUT = tool
    judge.TEST_TIMEOUT = test


# -----------------------------------------------------------------------------
# parsing helpers (untrusted text in, never raise)

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_WORDS = {"UP": "U", "DOWN": "D", "LEFT": "L", "RIGHT": "R", "U": "U", "D": "D", "L": "L", "R": "R"}
MAX_ACTIONS = 64


def extract_code(text):
    """The last ```python block (or last ``` block); None if there is none."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", text or "", re.S)
    return blocks[-1] if blocks else None


def parse_actions(text, compact=False):
    """Action list from an answer: JSON list after the last '####' (or the last JSON-ish list
    anywhere), or, in compact mode, the bare letters 'URDL...'. None when nothing parses."""
    text = (text or "")[-4000:]
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    lists = re.findall(r"\[[^\[\]]*\]", text)
    if lists:
        items = re.findall(r"[A-Za-z]+", lists[-1])
        acts = [_WORDS.get(w.upper()) for w in items]
        if acts and all(acts) and len(acts) <= MAX_ACTIONS:
            return acts
        return None
    s = text.strip()
    if compact and 0 < len(s) <= MAX_ACTIONS and all(c in MOVES for c in s):
        return list(s)
    return None


def last_boxed(text):
    """Content of the last \\boxed{...} (nested braces handled), else None."""
    text = text or ""
    i = text.rfind("\\boxed")
    while i >= 0:
        j = i + len("\\boxed")
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            depth, k = 0, j
            while k < len(text):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    return text[j + 1:k].strip()
                k += 1
        i = text.rfind("\\boxed", 0, i)
    return None


# -----------------------------------------------------------------------------
# the common two-agent game: tool agent (program -> simulated on a copy) then plan agent (executed)

TOOL_SYS = ("You are the tool agent of a two-agent team. Write a Python program that solves the puzzle below "
            "algorithmically (e.g. BFS or A*; do not hard-code the answer) and prints the answer {fmt}. "
            "Put the program in one ```python block.")
PLAN_SYS = ("You are the plan agent of a two-agent team. A tool agent wrote a program for the puzzle below; its "
            "output was simulated on a copy of the puzzle. Check it and give the final answer: after a line '####', "
            "write {fmt}.")


class Env:
    """What every task's env shares: the turn, its outcome so far, and who speaks next.
    `speakers()` names the agents that answer next in this turn (one: it speaks alone; several: they
    answer the same state at once), () when the turn is over. A fixed workflow lists its turn as
    `stages`, spoken in order; a routed one overrides `speakers` and decides from its state (the
    search task's router). Every agent speaks at most once per turn: a subclass's `step(role, text)`
    adds the role to `spoken`, and `end_turn` (the subclass's, calling this one) starts the next
    turn with nobody having spoken. A new workflow is one subclass: stages or speakers, observe,
    step, team_reward."""
    stages = ()  # a subclass sets it (an attribute) or derives it from its roles (a property)
    speaks_again = False  # True: an agent may answer twice in a turn, both in one group (rollout.py)

    def __init__(self):
        self.turn, self.done, self.success, self.format_ok = 0, False, False, True
        self.spoken = set()  # the agents that have answered this turn

    def speakers(self):
        for stage in self.stages:
            if not all(role in self.spoken for role in stage):
                return stage
        return ()

    def clone(self):
        """A copy to branch from (a subclass copies its own lists and dicts too)."""
        new = copy.copy(self)
        new.spoken = set(self.spoken)
        return new

    def end_turn(self):
        self.turn += 1
        self.spoken = set()

    def warmup_view(self, role):
        """The tiny base's 'calls' warm-up teaches `role`'s answer in this state (tiny.py)."""
        return True

    def anchor(self, role):
        """GiGPO's anchor state (docs/method.md §4): the env's own observation of its state, what
        verl-agent's and Dr. MAS's envs return as `anchor_obs` (env_manager.py:30,54 there), so that
        trajectories meeting one state at different turns share a step group. By default the
        observation's user text: the code and math tasks' prompts carry no turn counter."""
        return "\n".join(m["content"] for m in self.observe(role) if m["role"] == "user")


class GridGame(Env):
    """Shared by plan, sokoban and sudoku: the tool/plan workflow, observation assembly and
    rewards."""
    roles_mas = ("tool", "plan")
    answer_fmt = ""
    fail_reward = -2.0  # an unparsable or illegal answer (all penalty knobs: beside FORMAT_PENALTY)

    def __init__(self, workflow="mas", compact=False):
        super().__init__()
        self.roles = self.roles_mas if workflow == "mas" else self.roles_mas[-1:]
        self.compact = compact
        # what the plan agent sees this turn
        self.tool_text, self.tool_out, self.tool_sim = None, None, None

    # sequential: one agent at a time (the rollouts run a turn as these stages, in order)
    @property
    def stages(self):
        return [(r,) for r in self.roles]

    def clone(self):
        return copy.deepcopy(self)

    # subclasses: board() text, parse(text) -> action or None, simulate(action) -> (reward, solved,
    # note) on self
    def tool_answer(self, text):
        """The tool agent's answer: the printed output of its program (compact mode: the text
        itself)."""
        if self.compact:
            return text, self.parse(text)
        code = extract_code(text)
        if code is None:
            return "(no ```python block found)", None
        r = run_code(code, timeout=TOOL_TIMEOUT)
        out = (r.stdout.strip() or r.stderr.strip()[-300:] or "(no output)")[-1000:]
        return out, self.parse(r.stdout if r.ok else "")

    def step(self, role, text):
        self.spoken.add(role)
        if role == "tool":
            out, action = self.tool_answer(text)
            self.tool_text, self.tool_out, self.format_ok = text, out, action is not None
            if action is None:
                self.tool_sim = "unparseable"
                return self.fail_reward
            sim = self.clone()
            reward, solved, note = sim.apply(action)
            self.tool_sim = ("solved" if solved else "not solved") + (f" ({note})" if note and not self.compact else "")
            return reward
        action = self.parse(text)
        self.format_ok = action is not None
        if action is None:
            return self.fail_reward
        reward, solved, _ = self.apply(action)
        self.success = self.success or solved
        self.done = self.done or solved
        return reward

    def team_reward(self):
        return 1.0 if self.success else 0.0

    def anchor(self, role):
        """The board alone, for every role: the state, without the prompt's "turn N" and rules (as
        Dr. MAS's anchor is the env's observation, not what another agent said this turn)."""
        return self.board()

    def tool_line(self):
        """Compact mode: what the plan agent sees of the tool agent's turn, its answer and the
        simulated verdict."""
        return f"{(self.tool_out or '')[:MAX_ACTIONS]}={'ok' if self.tool_sim == 'solved' else 'no'}"

    def observe(self, role):
        if self.compact:
            c = self.board() + (("\n" + self.summary()) if hasattr(self, "summary") else "")
            if role == "plan" and "tool" in self.roles:
                c += "\n" + self.tool_line()
            return [{"role": "user", "content": c}]
        fmt = self.answer_fmt
        task = f"{self.rules()}\n\nCurrent state (turn {self.turn + 1}):\n{self.board()}"
        if role == "tool":
            return [{"role": "system", "content": TOOL_SYS.format(fmt=fmt)}, {"role": "user", "content": task}]
        if "tool" not in self.roles:
            sys_msg = f"Solve the puzzle below. After a line '####', write {fmt}."
            return [{"role": "system", "content": sys_msg}, {"role": "user", "content": task}]
        seen = (f"\n\nTool agent's program:\n```python\n{(extract_code(self.tool_text or '') or '')[:3000]}\n```\n"
                f"Its output: {self.tool_out}\nSimulated result: {self.tool_sim}")
        return [{"role": "system", "content": PLAN_SYS.format(fmt=fmt)}, {"role": "user", "content": task + seen}]


def bfs(start, neighbours, is_goal, limit=200000):
    """Shortest action list from `start` to a goal state; neighbours(s) -> [(action, s2)]. None if
    unreachable."""
    prev, q = {start: None}, deque([start])
    while q and len(prev) < limit:
        s = q.popleft()
        if is_goal(s):
            path = []
            while prev[s] is not None:
                s, a = prev[s]
                path.append(a)
            return path[::-1]
        for a, s2 in neighbours(s):
            if s2 not in prev:
                prev[s2] = (s, a)
                q.append(s2)
    return None


# -----------------------------------------------------------------------------
# Plan-Path


class PlanPath(GridGame):
    answer_fmt = 'the moves as a JSON list, e.g. ["U", "R", "R"] (U up, D down, L left, R right)'

    def __init__(self, seed, size=10, p_block=0.22, workflow="mas", compact=False):
        super().__init__(workflow, compact)
        rng = random.Random(f"plan-{size}-{seed}")
        while True:  # resample until the goal is reachable from the start
            grid = [["#" if rng.random() < p_block else "." for _ in range(size)] for _ in range(size)]
            free = [(r, c) for r in range(size) for c in range(size) if grid[r][c] == "."]
            if len(free) < 2:
                continue
            start, goal = rng.sample(free, 2)
            self.grid, self.size, self.pos, self.goal = grid, size, start, goal
            path = bfs(start, self.neighbours, lambda s: s == goal)
            if path is not None:
                break
        self.start, self.shortest, self.moves = start, len(path), 0

    def summary(self):
        """Compact mode's extra line: the goal offset and the four neighbours ('.' free, '#' blocked
        or off-grid), e.g. '+2-1 U.D#L.R#'. Same information as the grid, in a form a tiny model
        learns from in minutes."""
        free = dict(self.neighbours(self.pos))
        dr, dc = self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]
        return f"{dr:+d}{dc:+d} " + "".join(a + ("." if a in free else "#") for a in "UDLR")

    def neighbours(self, s):
        out = []
        for a, (dr, dc) in MOVES.items():
            r, c = s[0] + dr, s[1] + dc
            if 0 <= r < self.size and 0 <= c < self.size and self.grid[r][c] == ".":
                out.append((a, (r, c)))
        return out

    def rules(self):
        return (f"Move from the player @ to the goal G on this {self.size}x{self.size} grid ('#' blocked, '.' free; "
                f"rows top to bottom, U decreases the row). You are at row {self.pos[0]}, col {self.pos[1]}; "
                f"the goal is at row {self.goal[0]}, col {self.goal[1]}.")

    def random_answer(self, role, rng, max_moves=4):
        """The format warm-up's answer (tiny.py): 1..max_moves random moves, walls or not."""
        return "".join(rng.choice("UDLR") for _ in range(rng.randint(1, max_moves)))

    def board(self):
        rows = [row[:] for row in self.grid]
        rows[self.goal[0]][self.goal[1]] = "G"
        rows[self.pos[0]][self.pos[1]] = "@"
        return "\n".join("".join(r) for r in rows)

    def parse(self, text):
        return parse_actions(text, self.compact)

    def apply(self, actions):
        """Execute moves; per-move reward (docs/method.md §6): -0.01 valid / -0.10 invalid, shaping
        0.99*phi' - phi with phi = -manhattan, +1 on reaching the goal, +0.5 more if the valid moves
        so far form a shortest path (the reference counts every action instead: a documented
        difference, docs/design.md)."""
        total, invalid = 0.0, 0
        for a in actions:
            if self.pos == self.goal:
                break
            phi = -abs(self.pos[0] - self.goal[0]) - abs(self.pos[1] - self.goal[1])
            nxt = dict(self.neighbours(self.pos)).get(a)
            # a wall bump costs -0.10 here and does not count as a move toward "shortest"
            if nxt is None:
                total -= 0.10
                invalid += 1
            else:
                self.pos, self.moves = nxt, self.moves + 1
                total -= 0.01
            phi2 = -abs(self.pos[0] - self.goal[0]) - abs(self.pos[1] - self.goal[1])
            total += 0.99 * phi2 - phi
            if self.pos == self.goal:
                total += 1.0 + (0.5 if self.moves == self.shortest else 0.0)
        return total, self.pos == self.goal, f"{invalid} invalid moves; now at {self.pos}"


# -----------------------------------------------------------------------------
# Sokoban (one box): reverse play from a solved room, so every instance is solvable


class SharedTable(dict):
    """A table built once per room and never changed: a room's clones share it (a copy costs 5x a build)."""

    def __deepcopy__(self, memo):
        return self


class Sokoban(GridGame):
    answer_fmt = 'the moves as a JSON list, e.g. ["U", "R", "R"] (U up, D down, L left, R right)'

    def __init__(self, seed, size=6, reverse_steps=25, workflow="mas", compact=False, solve_shaping=0.0):
        super().__init__(workflow, compact)
        self.solve_shaping = solve_shaping  # --sokoban_solve_shaping (0: the spec's reward)
        self._togo = None  # moves_to_solve's table, built on first use
        rng = random.Random(f"sokoban-{size}-{seed}")
        while True:
            walls = {(r, c) for r in range(size) for c in range(size) if r in (0, size - 1) or c in (0, size - 1)}
            inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
            walls |= set(rng.sample(inner, rng.randint(0, 3)))
            free = [p for p in inner if p not in walls]
            goal = rng.choice(free)
            box, player = goal, rng.choice([p for p in free if p != goal])
            for _ in range(reverse_steps):  # reverse moves: walk, or pull the box along
                a = rng.choice("UDLR")
                dr, dc = MOVES[a]
                nxt = (player[0] + dr, player[1] + dc)
                if nxt in walls or nxt == box:
                    continue
                if (player[0] - dr, player[1] - dc) == box and rng.random() < 0.7:
                    box = player
                player = nxt
            if abs(box[0] - goal[0]) + abs(box[1] - goal[1]) >= 2:
                break
        self.size, self.walls, self.goal, self.box, self.player, self.moves = size, walls, goal, box, player, 0

    def summary(self):
        """Compact mode's extra line, Plan-Path's exactly: the offset of the player's next leg, then
        what each move meets ('.' free, '#' wall, '$' a box it can push, 'x' a box stuck against a
        wall), e.g. '+0+1 U#D.L#R.'. The leg: off the push spot, to the spot (the cell behind the box,
        away from the goal along the goal's longer offset; ties: rows); on it, the push along that
        offset to the goal's row or column. So each turn is Plan-Path's "walk along the offset", one
        skill (a line with both offsets, the spot's and the goal's, left which to follow to the model:
        docs/experiments.md, 2026-11-30). Same information as the room, in a form a tiny model learns
        from (docs/design.md)."""
        (pr, pc), (br, bc), (gr, gc) = self.player, self.box, self.goal
        sr, sc = self.push_spot()
        if (sr, sc) == (pr, pc):  # on the spot: the leg is the push itself, along push_spot's axis
            sr, sc = (pr + gr - br, pc) if sc == bc else (pr, pc + gc - bc)
        cells = ""
        for a, (dr, dc) in MOVES.items():
            q = (pr + dr, pc + dc)
            cells += a + ("#" if q in self.walls else ("$" if self.move((self.player, self.box), a) else "x")
                          if q == self.box else ".")
        return f"{sr - pr:+d}{sc - pc:+d} {cells}"

    def push_spot(self):
        """The cell a push toward the goal starts from: behind the box, one step against the goal's
        longer offset from it (ties: rows)."""
        (br, bc), (gr, gc) = self.box, self.goal
        if abs(gr - br) >= abs(gc - bc):
            push = ((gr > br) - (gr < br), 0)
        else:
            push = (0, (gc > bc) - (gc < bc))
        return br - push[0], bc - push[1]

    def moves_to_solve(self):
        """--sokoban_solve_shaping's distance: the fewest moves from this state to a solve (one
        backward BFS per room, walks and pulls from every solved state, kept for the room's later
        states). A stuck box counts the moves a jam undid, not a cliff: the player's Manhattan
        distance to the push spot plus the box's to the goal (a cap of 24 charged a jam ~20 moves,
        and the runs learned to answer one move: docs/experiments.md, 2026-11-30)."""
        if self._togo is None:
            free = [(r, c) for r in range(self.size) for c in range(self.size) if (r, c) not in self.walls]
            frontier = [(p, self.goal) for p in free if p != self.goal]
            togo = SharedTable.fromkeys(frontier, 0)
            while frontier:
                nxt = []
                for player, box in frontier:
                    for dr, dc in MOVES.values():
                        prev = (player[0] - dr, player[1] - dc)  # the player stepped from here
                        if prev in self.walls or prev == box:
                            continue
                        before = [(prev, box)]  # a walk, or a push of a box that stood where the player is
                        if box == (player[0] + dr, player[1] + dc):
                            before.append((prev, player))
                        for state in before:
                            if state not in togo:
                                togo[state] = togo[player, box] + 1
                                nxt.append(state)
                frontier = nxt
            self._togo = togo
        if (self.player, self.box) in self._togo:
            return self._togo[self.player, self.box]
        (pr, pc), (sr, sc), (br, bc), (gr, gc) = self.player, self.push_spot(), self.box, self.goal
        return abs(pr - sr) + abs(pc - sc) + abs(br - gr) + abs(bc - gc)

    def rules(self):
        return ("Push the box $ onto the goal . ('#' wall, '@' you, '*' box on goal, '+' you on goal). You can push "
                "a box one cell if the cell behind it is free; you cannot pull.")

    def random_answer(self, role, rng, max_moves=4):
        """The format warm-up's answer (tiny.py): a random legal walk of 1..max_moves moves, into no
        wall and pushing the box into none: the rules, as a real base model knows them, not the
        solution."""
        state, out = (self.player, self.box), ""
        for _ in range(rng.randint(1, max_moves)):
            ok = {a: nxt for a in "UDLR" if (nxt := self.move(state, a))}
            if not ok:
                break
            a = rng.choice(list(ok))
            out, state = out + a, ok[a]
        return out or rng.choice("UDLR")

    def board(self):
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                p = (r, c)
                if p in self.walls:
                    row += "#"
                elif p == self.box:
                    row += "*" if p == self.goal else "$"
                elif p == self.player:
                    row += "+" if p == self.goal else "@"
                else:
                    row += "." if p == self.goal else " "
            rows.append(row)
        return "\n".join(rows)

    def parse(self, text):
        return parse_actions(text, self.compact)

    def move(self, state, a):
        """(player, box) -> next state, or None if the move is invalid."""
        player, box = state
        dr, dc = MOVES[a]
        nxt = (player[0] + dr, player[1] + dc)
        if nxt in self.walls:
            return None
        if nxt == box:
            beyond = (box[0] + dr, box[1] + dc)
            if beyond in self.walls:
                return None
            return nxt, beyond
        return nxt, box

    def apply(self, actions):
        """Per move: -0.01 valid / -0.05 invalid, +1 box onto goal, -0.5 box off goal, shaping
        0.1*(0.99*phi' - phi) with phi = -box distance to the goal, +10 on solving. With
        --sokoban_solve_shaping W (not the spec's: its reward pays a walk to the box nothing) also
        W*(psi' - psi), psi = -moves_to_solve: potential-based (Ng et al. 1999), undiscounted, as a
        0.99 would pay a move 0.01*W*(moves left) for going nowhere (a back-and-forth, seen)."""
        total = 0.0
        for a in actions:
            if self.box == self.goal:
                break
            phi = -abs(self.box[0] - self.goal[0]) - abs(self.box[1] - self.goal[1])
            psi = -self.moves_to_solve() if self.solve_shaping else 0.0
            was_on = self.box == self.goal
            nxt = self.move((self.player, self.box), a)
            if nxt is None:
                total -= 0.05
            else:
                (self.player, self.box), self.moves = nxt, self.moves + 1
                total -= 0.01
            on = self.box == self.goal
            total += (1.0 if on and not was_on else 0.0) - (0.5 if was_on and not on else 0.0)
            total += 0.1 * (0.99 * (-abs(self.box[0] - self.goal[0]) - abs(self.box[1] - self.goal[1])) - phi)
            if self.solve_shaping:
                total += self.solve_shaping * (-self.moves_to_solve() - psi)
            if on:
                total += 10.0
        return total, self.box == self.goal, f"box at {self.box}"


# -----------------------------------------------------------------------------
# Sudoku 4x4 with a unique solution


SUDOKU_FILL = 0.1  # the spec's reward for a legal fill of an empty cell


def sudoku_solutions(grid, limit=2):
    """All completions of a 4x4 grid (0 = empty), up to `limit` (brute force over empty cells)."""
    g = [row[:] for row in grid]
    out = []

    def ok(r, c, v):
        if v in g[r] or v in (g[i][c] for i in range(4)):
            return False
        br, bc = r // 2 * 2, c // 2 * 2
        return all(g[i][j] != v for i in range(br, br + 2) for j in range(bc, bc + 2))

    def rec(k):
        if len(out) >= limit:
            return
        if k == 16:
            out.append([row[:] for row in g])
            return
        r, c = divmod(k, 4)
        if g[r][c]:
            return rec(k + 1)
        for v in range(1, 5):
            if ok(r, c, v):
                g[r][c] = v
                rec(k + 1)
                g[r][c] = 0
    rec(0)
    return out


# the 4x4 grid's 12 units: rows, columns, 2x2 boxes, as lists of (r, c)
SUDOKU_UNITS = ([[(r, c) for c in range(4)] for r in range(4)] + [[(r, c) for r in range(4)] for c in range(4)]
                + [[(r, c) for r in range(br, br + 2) for c in range(bc, bc + 2)] for br in (0, 2) for bc in (0, 2)])


def sudoku_valid(g):
    """A full 4x4 grid with every row, column and 2x2 box a permutation of 1..4."""
    return all(sorted(g[r][c] for r, c in unit) == [1, 2, 3, 4] for unit in SUDOKU_UNITS)


class Sudoku(GridGame):
    answer_fmt = ("the completed grid as a JSON list of 4 rows, e.g. [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]] "
                  "(or a list of [row, col, value] fills, 0-based)")
    fail_reward = -1.0

    def __init__(self, seed, workflow="mas", compact=False, wrong_fill=SUDOKU_FILL):
        super().__init__(workflow, compact)
        self.wrong_fill = wrong_fill  # a legal fill of a digit that is not the solution's
        rng = random.Random(f"sudoku-{seed}")
        # a valid 4x4 grid
        base = [[(2 * (r % 2) + r // 2 + c) % 4 + 1 for c in range(4)] for r in range(4)]
        digits = rng.sample(range(1, 5), 4)
        if rng.random() < 0.5:
            rows = rng.sample([0, 1], 2) + rng.sample([2, 3], 2)
        else:
            rows = rng.sample([2, 3], 2) + rng.sample([0, 1], 2)
        cols = rng.sample([0, 1], 2) + rng.sample([2, 3], 2)
        full = [[digits[base[r][c] - 1] for c in cols] for r in rows]
        puzzle = [row[:] for row in full]
        for k in rng.sample(range(16), 16):  # remove clues while the solution stays unique
            r, c = divmod(k, 4)
            keep, puzzle[r][c] = puzzle[r][c], 0
            if len(sudoku_solutions(puzzle)) != 1:
                puzzle[r][c] = keep
        self.clues, self.grid, self.solution = puzzle, [row[:] for row in puzzle], full

    def summary(self):
        """Compact mode's view: one character per cell in reading order, the digit of a filled cell,
        or for an empty cell its candidates (`candidates`) as a letter (bitmask - 1: a={1}, b={2},
        c={1,2}, d={3}, ..., h={4}, ..., o={1,2,3,4}; '!' none left), e.g. '1d3b4hcc...'. Same
        information as the grid (the candidates follow from it), aligned with the 16-digit answer,
        so a tiny model learns it in minutes."""
        cand = self.candidates(self.grid)
        out = ""
        for r in range(4):
            for c in range(4):
                if self.grid[r][c]:
                    out += str(self.grid[r][c])
                    continue
                mask = sum(1 << (v - 1) for v in cand[r, c])
                out += chr(ord("a") + mask - 1) if mask else "!"
        return out

    @classmethod
    def candidates(cls, g):
        """{(r, c): digits} for each empty cell of grid `g`, after Sudoku's two first deductions,
        one pass each: the digits its row, column and box still allow, then a digit that only one
        cell of a row, column or box still allows is that cell's only candidate (a cell forced to
        two digits has none). One pass, not to the end: the view names each next step, never the
        solution (why: docs/results.md, Sudoku's view)."""
        cand = {(r, c): {v for v in range(1, 5) if cls.legal(g, r, c, v)}
                for r in range(4) for c in range(4) if not g[r][c]}
        forced = {}  # cell -> the digits it is the only place for, in some unit
        for unit in SUDOKU_UNITS:
            for v in range(1, 5):
                places = [rc for rc in unit if v in cand.get(rc, ())]
                if len(places) == 1 and all(g[r][c] != v for r, c in unit):
                    forced.setdefault(places[0], set()).add(v)
        for rc, digits in forced.items():
            cand[rc] = digits if len(digits) == 1 else set()
        return cand

    def observe(self, role):
        """Compact mode: the view line last (a fixed distance from the answer that it aligns with),
        after the tool agent's grid and its simulated verdict for the plan agent."""
        if not self.compact:
            return super().observe(role)
        c = self.summary()
        if role == "plan" and "tool" in self.roles:
            c = self.tool_line() + "\n" + c
        return [{"role": "user", "content": c}]

    def rules(self):
        return ("Fill the 4x4 Sudoku (0 = empty) with 1-4 so that every row, column and 2x2 box holds each digit "
                "once. Given clues must be kept.")

    def random_answer(self, role, rng, max_moves=4):
        """The format warm-up's answer (tiny.py): a 16-digit grid (0 = no answer) filling 1..max_moves
        random empty cells, each with a random digit of the view's candidates for it that its row,
        column and box still allow after the fills before it: the rules, not the solution."""
        cells, g = ["0"] * 16, [row[:] for row in self.grid]
        shown = self.candidates(self.grid)  # the view's letters
        empty = [(r, c) for r in range(4) for c in range(4) if not g[r][c]]
        for r, c in rng.sample(empty, min(len(empty), rng.randint(1, max_moves))):
            cand = [v for v in sorted(shown[r, c]) if self.legal(g, r, c, v)]
            if cand:
                g[r][c] = rng.choice(cand)
                cells[4 * r + c] = str(g[r][c])
        return "".join(cells)

    def board(self):
        return "\n".join("".join(str(v) for v in row) for row in self.grid)

    def parse(self, text):
        """[(r, c, v)] fills from a 4x4 grid (JSON, or 16 digits in compact mode) or a list of [r,
        c, v]."""
        text = (text or "")[-4000:]
        if "####" in text:
            text = text.rsplit("####", 1)[1]
        nums = None
        m = re.search(r"\[\s*\[.*\]\s*\]", text, re.S)
        if m:
            try:
                nums = json.loads(m.group(0))
            except (ValueError, RecursionError):
                nums = None
        if nums is None and self.compact:
            digits = re.sub(r"\s", "", text)
            if len(digits) == 16 and digits.isdigit():
                nums = [[int(digits[4 * r + c]) for c in range(4)] for r in range(4)]
        if not isinstance(nums, list) or not nums:
            return None
        try:
            if len(nums) == 4 and all(isinstance(r, list) and len(r) == 4 for r in nums):
                return [(r, c, int(nums[r][c])) for r in range(4) for c in range(4)]
            if all(isinstance(x, list) and len(x) == 3 for x in nums):
                return [(int(r), int(c), int(v)) for r, c, v in nums][:64]
        except (TypeError, ValueError, OverflowError):
            return None
        return None

    @staticmethod
    def legal(g, r, c, v):
        """No other cell of (r, c)'s row, column or box holds v (the cell's own value does not
        count)."""
        if any(g[r][j] == v for j in range(4) if j != c) or any(g[i][c] == v for i in range(4) if i != r):
            return False
        br, bc = r // 2 * 2, c // 2 * 2
        return all(g[i][j] != v for i in range(br, br + 2) for j in range(bc, bc + 2) if (i, j) != (r, c))

    def apply(self, fills):
        """Only the clues are fixed: a fill may set an empty cell or change an earlier fill, so one
        wrong guess never locks the puzzle. +0.1 per legal fill that changes a cell, -0.3 per
        illegal one (bad range, changing a clue, or clashing with its row/column/box), +2 when
        solved. A full-grid answer is judged as a whole: each changed cell is checked against the
        answer grid itself (so a correct grid always solves the puzzle), and a 0 in it means "no
        answer for this cell" (the cell keeps its value, no reward, no penalty)."""
        full = len(fills) == 16 and {(r, c) for r, c, _ in fills} == {(r, c) for r in range(4) for c in range(4)}
        ref = self.grid
        # the grid as the answer proposes it (clues kept): what each changed cell is checked against
        if full:
            ref = [row[:] for row in self.grid]
            for r, c, v in fills:
                if 1 <= v <= 4 and not self.clues[r][c]:
                    ref[r][c] = v
        total = 0.0
        for r, c, v in fills:
            if full and v == 0:
                continue
            if not (0 <= r < 4 and 0 <= c < 4 and 1 <= v <= 4):
                total -= 0.3
            elif self.clues[r][c]:
                total -= 0.3 if v != self.clues[r][c] else 0.0
            elif self.grid[r][c] == v:
                continue
            elif self.legal(ref, r, c, v):
                total += self.fill_reward(r, c, v)
                self.grid[r][c] = v
            else:
                total -= 0.3
        solved = sudoku_valid(self.grid)
        return total + (2.0 if solved else 0.0), solved, f"{sum(v == 0 for row in self.grid for v in row)} empty cells"

    def fill_reward(self, r, c, v):
        """A legal fill of an empty cell: the spec's partial progress, +0.1, whether or not v is the
        solution's digit (`--sudoku_wrong_fill R`: R for a digit that is not, a deviation from the
        spec, off by default). Rewriting a filled cell with another legal digit earns 0: it is allowed
        (a wrong fill can be recovered) but it is not progress, so toggling one cell never pays (the
        reference charges -0.3 for it: docs/design.md)."""
        if self.grid[r][c]:
            return 0.0
        return SUDOKU_FILL if v == self.solution[r][c] else self.wrong_fill


# -----------------------------------------------------------------------------
# Code: coder || tester

CODER_SYS = ("You are the coder of a two-agent team. Write a complete, correct Python solution{how}. Put it in one "
             "```python block.")
TESTER_SYS = ("You are the unit tester of a two-agent team. Write {n} new test cases for the problem below that a "
              "correct solution must pass.{how}")
TEST_FMT_IO = (" Write each case as:\n**Test Input:**\n```\n<stdin>\n```\n**Test Output:**\n```\n"
               "<expected stdout>\n```")
TEST_FMT_ASSERT = (" Write each case as one Python assert line calling the function, e.g. "
                   "`assert f(1, 2) == 3`, in one ```python block.")


def parse_tests(text, row):
    """Tester output -> list of cases ({'input','output'} for io problems, assert lines for function
    problems)."""
    text = (text or "")[-20000:]
    if row["test_type"] == "code":
        code = extract_code(text) or text
        return [ln.strip() for ln in code.splitlines() if ln.strip().startswith("assert ")][:20]
    pairs = re.findall(r"Input:?\**\s*```[a-z]*\n(.*?)```.*?Output:?\**\s*```[a-z]*\n(.*?)```", text, re.S)
    return [{"input": i, "output": o} for i, o in pairs][:20]


class Program(NamedTuple):
    """The coder's program of a turn and its pass rate on the ground-truth tests."""
    code: object  # str, or None when no program could be extracted
    pass_rate: float


class Answer(NamedTuple):
    """A math agent's answer of a turn: what the others see of it, the answer, whether it is right."""
    shown: str
    answer: object  # str, or None when no answer could be parsed
    correct: bool


MAX_MISMATCHES = 3  # failing tester cases shown to both agents next turn
# earlier programs (before the current one) shown with their mismatches: the prompt budget
MAX_EARLIER = 2


class CodeEnv(Env):
    @property
    def stages(self):  # parallel: both agents answer the turn-start state
        return [self.roles]

    def __init__(self, row, workflow="mas", train_tests=None, compact=False):
        super().__init__()
        self.row, self.roles = row, (("coder", "tester") if workflow == "mas" else ("coder",))
        # training scores on the first few ground-truth tests, evaluation on all of them
        # (docs/method.md §6)
        self.gt = row["tests"][:train_tests] if (train_tests and row["test_type"] != "code") else row["tests"]
        self.code, self.tests, self.history = None, [], []
        # (code, its mismatches) of every turn so far: the history both agents see
        self.attempts = []
        self.pending = {}
        self.pass_rate = 0.0

    def clone(self):
        new = super().clone()
        new.pending, new.history, new.tests = dict(self.pending), list(self.history), list(self.tests)
        new.attempts = list(self.attempts)
        return new

    def observe(self, role):
        row = self.row
        fn = row["test_type"] in ("code", "functional")
        task = f"Problem:\n{row['question']}"
        if row["starter_code"] and row["starter_code"] not in row["question"]:
            task += f"\n\nStarter code:\n```python\n{row['starter_code']}\n```"
        if self.turn > 0:
            # as the reference: past programs too
            for code, mism in self.attempts[:-1][-MAX_EARLIER:]:
                task += f"\n\nAn earlier attempt:\n```python\n{_clip_mid(code or '', 1500)}\n```"
                task += ("\nIts mismatches: " + "; ".join(mism)) if mism else ""
            task += f"\n\nCurrent code:\n```python\n{(self.code or '')[:4000]}\n```"
            if self.history:
                task += "\nMismatches on the tester's cases (input / expected / actual):\n" + "\n".join(self.history)
            task += "\nCheck the code and the tests and improve your part."
        if role == "coder":
            how = " that completes the given function/class" if fn else " that reads stdin and writes stdout"
            return [{"role": "system", "content": CODER_SYS.format(how=how)}, {"role": "user", "content": task}]
        how = TEST_FMT_ASSERT if row["test_type"] == "code" else TEST_FMT_IO
        return [{"role": "system", "content": TESTER_SYS.format(n=3, how=how)},
                {"role": "user", "content": task}]

    def step(self, role, text):
        self.spoken.add(role)
        if role == "coder":
            code = extract_code(text)
            self.format_ok = code is not None
            rate, syntax_ok, runs = code_pass_rate(self.row, code, self.gt)
            self.pending["coder"] = Program(code, rate)
            return 0.1 * syntax_ok + 0.1 * runs + 0.8 * rate
        cases = parse_tests(text, self.row)
        self.pending["tester"], self.format_ok = cases, bool(cases)
        if not cases:
            return 0.0
        ref = reference_solution(self.row)
        # no reference solution in the data: use the turn's code if it passes every GT test
        if ref is None:
            program = self.pending.get("coder", Program(self.code, self.pass_rate))
            ref = program.code if program.pass_rate == 1.0 else None
        return 0.2 + 0.8 * (self._agree(ref, cases) if ref else 0.0)

    def _agree(self, solution, cases):
        """Fraction of `cases` that `solution` passes; the mismatches, as text both agents see next
        turn (docs/method.md §6: input, expected, actual; the reference shows all three too)."""
        self._mism = []
        if not cases or solution is None:
            return 0.0
        if self.row["test_type"] == "code":
            checks = run_asserts(self.row, solution, cases)
            self._mism = [f"{_clip_mid(c, 300)} -> {_clip_mid(actual_output(r, harness=True), 300)}"
                          for c, (ok, r) in zip(cases, checks) if not ok]
            return sum(ok for ok, _ in checks) / len(cases)
        try:
            compile(solution, "<solution>", "exec")
        except (SyntaxError, ValueError) as e:
            self._mism = [f"the code does not compile: {e}"]
            return 0.0
        checks, _ = run_tests(self.row, solution, cases)
        self._mism = [f"input: {_clip_mid(c['input'], 300)!r} | expected: {_clip_mid(c['output'], 300)!r} | "
                      f"actual: {_clip_mid(act, 300)!r}" for c, (ok, act) in zip(cases, checks) if not ok]
        return sum(ok for ok, _ in checks) / len(cases)

    def team_reward(self):
        return self.pending.get("coder", Program(None, self.pass_rate)).pass_rate

    def end_turn(self):
        if "coder" in self.pending:
            self.code, self.pass_rate = self.pending["coder"]  # a Program
        if "tester" in self.pending:
            self.tests = self.pending["tester"]
        self.pending = {}
        self.history = []
        if self.tests and self.code:
            agree = self._agree(self.code, self.tests)
            self.history = self._mism[:MAX_MISMATCHES]
            self.done = agree == 1.0
        if self.code:
            self.attempts.append((self.code, list(self.history)))
        self.success = self.pass_rate == 1.0
        if len(self.roles) == 1:
            self.done = True  # single agent: one turn
        super().end_turn()


# -----------------------------------------------------------------------------
# Math: tool || reasoner

MATH_TOOL_SYS = ("You are the tool agent of a two-agent team. Write a Python program that computes the answer to the "
                 "problem and prints only the final answer. Put it in one ```python block.")
MATH_REASON_SYS = ("You are the reasoning agent of a two-agent team. Solve the problem step by step and put the final "
                   "answer in \\boxed{}.")


def _clip_mid(s, n=500):
    return s if len(s) <= 2 * n else s[:n] + "\n...\n" + s[-n:]


class MathEnv(Env):
    @property
    def stages(self):  # parallel
        return [self.roles]

    def __init__(self, row, workflow="mas", compact=False):
        super().__init__()
        self.row, self.roles = row, (("tool", "reasoner") if workflow == "mas" else ("reasoner",))
        self.prev = {}      # role -> (text shown to the other agent, answer)
        self.pending = {}

    def clone(self):
        new = super().clone()
        new.prev, new.pending = dict(self.prev), dict(self.pending)
        return new

    def anchor(self, role):
        """The problem and the previous turn's answers, the same for every role (a team's judge
        too): the state, not what a teammate answered in this turn."""
        return self.row["question"], tuple(sorted(self.prev.items()))

    def observe(self, role):
        task = f"Problem:\n{self.row['question']}"
        if self.turn > 0:
            for r, (shown, ans) in self.prev.items():
                task += f"\n\nPrevious {r} answer: {ans}\n{shown}"
            task += "\n\nCheck the previous answers and refine yours."
        sys_msg = MATH_TOOL_SYS if role == "tool" else MATH_REASON_SYS
        return [{"role": "system", "content": sys_msg}, {"role": "user", "content": task}]

    def step(self, role, text):
        self.spoken.add(role)
        gold = self.row["answer"]
        if role == "reasoner":
            ans = last_boxed(text)
            self.format_ok = ans is not None
            ok = math_equal(gold, ans)
            self.pending["reasoner"] = Answer(_clip_mid(text or ""), ans, ok)
            return 0.2 * (ans is not None) + 0.8 * ok
        code = extract_code(text)
        self.format_ok = code is not None
        r = run_code(code, timeout=TOOL_TIMEOUT) if code else None
        out = r.stdout.strip() if r else ""
        ans = out.splitlines()[-1].strip() if out else None
        ok = math_equal(gold, ans)
        shown = f"```python\n{(code or '')[:2000]}\n```\nOutput: {out[-300:]}"
        self.pending["tool"] = Answer(shown, ans, ok)
        return 0.1 * bool(r and r.ok) + 0.1 * (ans is not None) + 0.8 * ok

    def team_reward(self):
        # the driver applies the reasoner's turn answer before scoring the tool's
        reasoner = self.pending.get("reasoner")
        return float(bool(reasoner and reasoner.correct))

    def end_turn(self):
        for role, answer in self.pending.items():
            self.prev[role] = (answer.shown, answer.answer)
            if role == "reasoner":
                self.success = answer.correct
        if "tool" in self.prev and "reasoner" in self.prev:
            a, b = self.prev["tool"][1], self.prev["reasoner"][1]
            self.done = a is not None and b is not None and (a == b or math_equal(b, a))
        if len(self.roles) == 1:
            self.done = True
        self.pending = {}
        super().end_turn()


# -----------------------------------------------------------------------------
# Math teams: N reasoners || M tool agents, then a judge (the AT-GRPO paper's Fig. 5; docs/method.md
# §6)

MATH_JUDGE_SYS = ("You are the judge of a team of agents. Read the team's answers to the problem, decide which one is "
                  "right, and put the team's final answer in \\boxed{}.")


def team_roles(n, m):
    """The agent instances of a team, each its own role in the (env, agent, turn) key: reasoner1..N,
    tool1..M, judge."""
    return tuple(f"reasoner{i}" for i in range(1, n + 1)) + tuple(f"tool{j}" for j in range(1, m + 1)) + ("judge",)


def parse_team(spec, task, workflow="mas", mode="aggregate"):
    """--team "N,M" -> (N, M, mode); "" -> None. Only math has a team workflow (the paper's Fig.
    5)."""
    if not spec:
        return None
    try:
        n, m = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--team takes N,M (reasoners, tool agents), e.g. --team 2,2; not {spec!r}")
    if task != "math" or workflow != "mas":
        raise ValueError("--team is the math task's team workflow: use it with --task math (and --workflow mas)")
    if n < 1 or m < 1:
        raise ValueError(f"--team {spec}: a team needs N >= 1 reasoners and M >= 1 tool agents (plus its judge)")
    if mode not in ("aggregate", "refine"):
        raise ValueError(f"--team_mode {mode!r}: aggregate or refine")
    return n, m, mode


def role_type(role):
    """reasoner2 -> reasoner, tool1 -> tool: what an instance is (its prompt, its rewards,
    --policies per_type)."""
    return role.rstrip("0123456789")


def _plurality(entries):
    """The most common (answer, correct) among members' (shown, answer, correct); ties: the first in
    role order."""
    votes = [(e.answer.strip(), e.correct) for e in entries if e.answer is not None and e.answer.strip()]
    if not votes:
        return None
    counts = {}
    for a, _ in votes:
        counts[a] = counts.get(a, 0) + 1
    return next(v for v in votes if counts[v[0]] == max(counts.values()))


class TeamMathEnv(MathEnv):
    """N reasoners and M tool agents answer in parallel, then the judge sees their answers and gives
    the team's. mode "aggregate" (train.py's default, the reference's `math_aggretion` workflow):
    one turn; rewards 1/0 for a correct answer (judge, reasoners), a tool agent 1 if its program
    prints the answer, -1 if the program fails, else 0; no team term. Success: the judge is right.
    mode "refine": T turns (from turn 1 on each member sees the previous turn's answers, the judge's
    included). Rewards (the paper gives the structure only; our reading (docs/design.md)):
      team    1 if the team's answer is correct: the judge's, once it has answered this turn; while the members'
              candidates are scored the judge has not answered yet, so the team's answer is then the
              plurality of the members' answers (what a judge that votes would say)
      judge   local 0.2 format + 0.8 correct (the reasoner's rule); members keep their two-agent local rewards
    Success: the judge's answer is correct. Done: the judge's answer agrees with the members'
    plurality answer."""

    def __init__(self, row, n, m, mode="refine"):
        super().__init__(row, "mas")
        self.roles, self.mode = team_roles(n, m), mode

    @property
    def stages(self):
        return [self.roles[:-1], ("judge",)]

    def observe(self, role):
        if role != "judge":
            msgs = super().observe(role_type(role))
            msgs[0]["content"] = msgs[0]["content"].replace("a two-agent team", f"a team of {len(self.roles)} agents")
            return msgs
        task = f"Problem:\n{self.row['question']}\n\nThe team's answers:"
        for r, (shown, ans, _) in self.pending.items():  # Answer tuples
            task += f"\n\n{r} answer: {ans}\n{shown}"
        return [{"role": "system", "content": MATH_JUDGE_SYS}, {"role": "user", "content": task}]

    def step(self, role, text):
        self.spoken.add(role)
        if role == "judge":
            ans = last_boxed(text)
            self.format_ok = ans is not None
            ok = math_equal(self.row["answer"], ans)
            self.pending["judge"] = Answer(_clip_mid(text or ""), ans, ok)
            return float(ok) if self.mode == "aggregate" else 0.2 * (ans is not None) + 0.8 * ok
        kind = role_type(role)
        local = super().step(kind, text)
        self.pending[role] = self.pending.pop(kind)
        # the reference's sample agents: 1/0, a tool program that fails -1
        if self.mode == "aggregate":
            ok = self.pending[role].correct
            return float(ok) if kind == "reasoner" or ok else (-1.0 if local < 0.1 else 0.0)
        return local

    def team_reward(self):
        if self.mode == "aggregate":
            return 0.0
        if "judge" in self.pending:
            return float(self.pending["judge"].correct)
        vote = self._vote()
        return float(bool(vote and vote[1]))

    # the members' plurality (answer, correct), ties to the first member in role order
    def _vote(self):
        return _plurality(self.pending[r] for r in self.roles[:-1] if r in self.pending)

    def end_turn(self):
        judge = self.pending.get("judge")
        vote = self._vote()
        for role, answer in self.pending.items():
            self.prev[role] = (answer.shown, answer.answer)
        self.success = bool(judge and judge.correct)
        agrees = False
        if judge and judge.answer is not None and vote:
            agrees = judge.answer.strip() == vote[0] or math_equal(vote[0], judge.answer)
        self.done = agrees
        self.done = self.done or (self.mode == "aggregate" and judge is not None)  # one turn
        self.pending = {}
        Env.end_turn(self)  # not MathEnv's: the team's turn ends with its judge


# -----------------------------------------------------------------------------
# Math, Dr. MAS's workflow (--workflow solver_verifier): a solver, then a verifier that approves
# (the item leaves the loop) or rejects (the solver tries again, seeing every earlier solution and
# critique), up to the turn limit; on the last turn the verifier is skipped (Dr. MAS
# `agent_system/agent/orchestra/math/math_orchestra.py`, max_loop_num)

SOLVER_SYS = ("You are the Solver of a multi-agent team. Solve the problem step by step, treating your "
              "teammates' earlier outputs as context, and put the final answer in \\boxed{}.")
VERIFIER_SYS = ("You are the Verifier of a multi-agent team. Check the most recent solution step by step. "
                "End with <verify>approve</verify> if it is correct, or <verify>reject</verify> if you find "
                "any error.")
# an answer without its tag or \boxed{} (Dr. MAS's invalid-action penalty, math). The other penalty
# knobs: a game's fail_reward (an illegal or unparsable move), --invalid_penalty (--reward outcome
# only: grpo_mas.outcome_rewards); gigpo_advantages' `penalty` is 0 in training (reference parity)
FORMAT_PENALTY = 0.1


def parse_verdict(text, yes, no):
    """<verify>yes</verify> or <verify>no</verify> -> (the verdict, well-formed). Dr. MAS's rule: an
    answer with neither tag counts as the first (approve; "yes, enough"), and is ill-formed."""
    found = re.findall(r"<verify>\s*(\w+)\s*</verify>", text or "", re.I)
    if found and found[-1].lower() in (yes, no):
        return found[-1].lower(), True
    return yes, False


class MathVerifyEnv(Env):
    """Rewards (per call, immediate): team = the current solution is correct (math-verify);
    solver local = -0.1 without a \boxed{} answer; verifier local = 1 if its verdict is right (approve
    a correct solution, reject a wrong one), -0.1 without a verdict tag. Success: the final solution
    is correct. Dr. MAS's own assignment (every call gets the episode's outcome) is --reward outcome."""
    roles = ("solver", "verifier")

    def __init__(self, row, max_turns=2, compact=False):
        super().__init__()
        self.row, self.max_turns = row, max_turns
        self.solution = None   # the current Answer
        self.context = []      # every earlier output, as the team sees it
        self.approved = False

    def clone(self):
        new = super().clone()
        new.context = list(self.context)
        return new

    def speakers(self):
        if "solver" not in self.spoken:
            return ("solver",)
        if "verifier" not in self.spoken and self.turn < self.max_turns - 1:
            return ("verifier",)
        return ()

    def observe(self, role):
        task = f"Problem:\n{self.row['question']}"
        if self.context:
            task += "\n\nYour teammates' outputs:" + "".join(self.context)
        return [{"role": "system", "content": SOLVER_SYS if role == "solver" else VERIFIER_SYS},
                {"role": "user", "content": task}]

    def step(self, role, text):
        self.spoken.add(role)
        if role == "solver":
            answer = last_boxed(text)
            self.format_ok = answer is not None
            self.solution = Answer(_clip_mid(text or ""), answer, math_equal(self.row["answer"], answer))
            self.context.append(f'\nThe output of "Solver": {self.solution.shown}\n')
            self.success = self.solution.correct
            return 0.0 if self.format_ok else -FORMAT_PENALTY
        verdict, self.format_ok = parse_verdict(text, "approve", "reject")
        self.context.append(f'\nThe output of "Verifier": {_clip_mid(text or "")}\n')
        self.approved = verdict == "approve"
        self.done = self.approved  # an approved item leaves the loop
        right = self.approved == self.solution.correct
        return float(right) if self.format_ok else -FORMAT_PENALTY

    def team_reward(self):
        return float(bool(self.solution and self.solution.correct))

    def end_turn(self):
        super().end_turn()
        self.done = self.done or self.turn >= self.max_turns


# -----------------------------------------------------------------------------
# Search (Dr. MAS's search workflow): each turn a verifier, acting as router, judges whether the
# retrieved information suffices; "no" calls the search agent (its query goes to the retriever, the
# passages join the history), "yes" calls the answer agent, and the episode ends at the answer or at
# the turn limit (on the last turn a "no" calls nobody). Dr. MAS `orchestra/search/search_orchestra.py`.

ROUTER_SYS = ("You are the Verifier of a search team. Review the question and the information retrieved so "
              "far, and judge whether it is enough to answer. End with <verify>yes</verify> if it is, "
              "<verify>no</verify> if more searching is needed.")
SEARCH_SYS = ("You are the Search agent of a search team. Think inside <think></think>, then write one "
              "query for the missing information inside <search></search>.")
ANSWER_SYS = ("You are the Answer agent of a search team. Think inside <think></think>, then give the "
              "final short answer inside <answer></answer>.")
SEARCH_HIT, ROUTE_RIGHT = 0.5, 0.5  # the search agent's and the router's local rewards (shaping)


def tag(text, name):
    """The content of the last <name>...</name> in text, stripped; None if there is none."""
    found = re.findall(rf"<{name}>(.*?)</{name}>", text or "", re.S)
    return found[-1].strip() if found else None


class SearchEnv(Env):
    """One question, its gold answers, a retriever (`retrieval.BM25` or `HttpRetriever`), `topk`
    passages per search. Rewards (per call, immediate; ours, so that the tree has a signal at every
    node; Dr. MAS's own, every call gets the episode's exact match, is --reward outcome):
      answer  local = exact match (or token F1: metric "f1") of its answer; the episode ends
      search  local = 0.5 if its passages bring a gold passage (any hop) the history did not hold;
              where the data names no gold passages, an answer-bearing one
      verifier local = 0.5 if its verdict is right: "yes" exactly when the history holds one, or
              on the last turn (where a "no" would end the episode unanswered)
      team    1 once the answer is right; every ill-formed answer -0.1
    An answer-bearing passage is the question's last gold passage where the data names them (the
    generated worlds, HotpotQA's supporting facts), else one that contains a gold answer."""
    roles = ("verifier", "search", "answer")

    def __init__(self, question, answers, retriever, topk=3, max_turns=4, compact=False, gold=(),
                 metric="em"):
        self.question, self.answers, self.retriever = question, list(answers), retriever
        self.topk, self.max_turns, self.compact, self.gold, self.metric = topk, max_turns, compact, gold, metric
        super().__init__()
        self.verdict = None
        self.history = []   # (query, [Passage] or an error text) per search
        self.seen = []      # passage ids retrieved so far
        self.answer = None

    def random_answer(self, role, rng, max_moves=1):
        """The format warm-up's answer (tiny.py) for `role`: y or n; a letter, or a digit, among those
        its prompt shows (a real model queries with words it read and answers with one it found;
        which one is for RL to learn). The format, never the world's facts."""
        if role == "verifier":
            return rng.choice("yn")
        text = self.observe("search")[0]["content"]
        chars = NAMES if role == "search" else "0123456789"
        return rng.choice([c for c in text if c in chars] or list(chars))

    def warmup_view(self, role):
        """Answers are learnt with passages in view: what copying a digit is learnt from."""
        return role != "answer" or bool(self.history)

    def clone(self):
        new = super().clone()
        new.history, new.seen = list(self.history), list(self.seen)
        return new

    def speakers(self):
        if self.done:
            return ()
        if "verifier" not in self.spoken:
            return ("verifier",)
        if self.verdict == "no" and "search" not in self.spoken and self.turn < self.max_turns - 1:
            return ("search",)
        if self.verdict == "yes" and "answer" not in self.spoken:
            return ("answer",)
        return ()

    def answer_bearing(self, passages):
        if self.gold:
            return [p for p in passages if p.id == self.gold[-1]]
        gold = [judge.normalize_answer(a) for a in self.answers]
        return [p for p in passages if any(g and g in judge.normalize_answer(p.contents) for g in gold)]

    def sufficient(self):
        found = [p for _, hits in self.history if not isinstance(hits, str) for p in hits]
        return bool(self.answer_bearing(found))

    def step(self, role, text):
        self.spoken.add(role)
        if role == "verifier":
            if self.compact:
                verdict = (text or "").strip().lower()
                self.format_ok = verdict in ("y", "n")
                self.verdict = {"y": "yes", "n": "no"}.get(verdict, "yes")
            else:
                self.verdict, self.format_ok = parse_verdict(text, "yes", "no")
            # "enough" is right when the history holds the answer, and on the last turn (a "no" there
            # calls nobody: the episode would end unanswered)
            enough = self.sufficient() or self.turn >= self.max_turns - 1
            right = (self.verdict == "yes") == enough
            return ROUTE_RIGHT * right if self.format_ok else -FORMAT_PENALTY
        if role == "search":
            query = (text or "").strip() if self.compact else tag(text, "search")
            self.format_ok = bool(query) and len(query) <= 300
            if not self.format_ok:
                self.history.append((query or "", "(no query: write it inside <search></search>)"))
                return -FORMAT_PENALTY
            try:
                hits = self.retriever.search(query, self.topk)
                retrieval.count(failed=False)
            except retrieval.RetrievalError as e:
                retrieval.count(failed=True, error=str(e))
                self.history.append((query, f"(the search failed: {e})"))
                return 0.0
            new = [p for p in hits if p.id not in self.seen]
            self.seen += [p.id for p in new]
            self.history.append((query, hits))
            useful = [p for p in new if p.id in self.gold] if self.gold else self.answer_bearing(new)
            return SEARCH_HIT * bool(useful)
        self.answer = (text or "").strip() if self.compact else tag(text, "answer")
        self.format_ok = bool(self.answer)
        self.done = True
        self.success = judge.exact_match(self.answer, self.answers) == 1.0
        if not self.format_ok:
            return -FORMAT_PENALTY
        if self.metric == "f1":
            return judge.f1_score(self.answer, self.answers)
        return judge.exact_match(self.answer, self.answers)

    def team_reward(self):
        return float(self.success)

    def end_turn(self):
        super().end_turn()
        self.verdict = None
        self.done = self.done or self.turn >= self.max_turns

    def anchor(self, role):
        """The question and the passages retrieved so far, in the order found (Dr. MAS's search env:
        the question, then the retrieved information, env_manager.py:30,54): what the team knows,
        without "step N of M", the queries, or a search that brought nothing new."""
        return self.question, tuple(self.seen)

    def observe(self, role):
        if self.compact:
            lines = [f"q:{self.question}"]
            for query, hits in self.history:
                lines.append(hits if isinstance(hits, str) else " ".join(p.text for p in hits))
            lines.append({"verifier": "OK?", "search": "FIND:", "answer": "ANS:"}[role])  # no entity letters
            return [{"role": "user", "content": "\n".join(lines)}]
        info = ""
        for n, (query, hits) in enumerate(self.history, 1):
            found = hits if isinstance(hits, str) else "\n".join(
                f"Doc {i}(Title: {p.title}) {p.text}" for i, p in enumerate(hits, 1))
            info += f"\nStep {n}: <search>{query}</search>\n<information>{found}</information>\n"
        task = (f"Question: {self.question}\nYou are at step {self.turn + 1} of {self.max_turns}."
                + (f"\n\nSearches so far:{info}" if info else "\n\nNothing has been searched yet."))
        sys_msg = {"verifier": ROUTER_SYS, "search": SEARCH_SYS, "answer": ANSWER_SYS}[role]
        return [{"role": "system", "content": sys_msg}, {"role": "user", "content": task}]


# The search miniature: a generated world per question, so that the tiny model can learn the workflow
# on CPU (the compact games' idea). Six entities, single letters; each has a link (another entity)
# and a value (a digit), and one passage: '"a"\na>c=5'. A question asks a value one hop away
# ("a=?": a's value) or two ("a>=?": the value of a's link). BM25 over the world's six passages,
# one passage per search in compact mode (the entity's own passage ranks first: its title repeats it).

WORLD_SIZE, NAMES = 6, "abcdefgh"  # six entities of eight letters: a random search hits one in eight


def make_world(seed):
    """(question, answer, passages, gold passage ids in hop order) of generated question `seed`."""
    rng = random.Random(f"search-{seed}")
    names = rng.sample(NAMES, WORLD_SIZE)
    link = {x: rng.choice([y for y in names if y != x]) for x in names}
    value = {x: str(rng.randrange(10)) for x in names}
    passages = [retrieval.Passage(x, f'"{x}"\n{x}>{link[x]}={value[x]}') for x in names]
    start = rng.choice(names)
    if rng.random() < 0.5:
        return f"{start}=?", value[start], passages, (start,)
    return f"{start}>=?", value[link[start]], passages, (start, link[start])


def make_search(seed, workflow="mas", compact=False, turns=4, topk=1, row=None, retriever=None,
                metric="em"):
    """A search env: a generated question (`seed`) over its own world, or a dataset row with its own
    passages (HotpotQA's context) or the shared `retriever`."""
    if row is None:
        question, answer, passages, gold = make_world(seed)
        if not compact:
            hops = "the value of the entity" if len(gold) == 1 else "the value of the entity linked to"
            question = f"What is {hops} {gold[0]!r}? (passages read 'x>y=v': x links to y, its value is v)"
        return SearchEnv(question, [answer], retrieval.BM25(passages), topk, turns, compact, gold, metric)
    index = retrieval.BM25(row["passages"]) if row["passages"] else retriever
    return SearchEnv(row["question"], row["answers"], index, topk, turns, compact, row["gold"], metric)


# -----------------------------------------------------------------------------
# task table, splits and data


def load_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


# Test seeds of the generated games are TEST_SEED0 + [0, MAX_TEST); training seeds are drawn below
# TEST_SEED0, and a training instance whose board equals any reserved test board is redrawn: 4x4
# Sudoku has few distinct puzzles, so disjoint seeds alone would still overlap (the reference code's
# Sudoku test set overlapped its training pool).
TEST_SEED0, MAX_TEST = 10 ** 6, 1000
_TEST_BOARDS = {}
# One entry per --task: a new task is an entry here and its env class (docs/extending.md). Every key
# of TASK_KEYS is required; check_task names the one an entry lacks, at start-up.
TASK_KEYS = {
    "make": "the env factory, (seed, workflow, compact, row, **settings) -> an env (make_env)",
    "workflows": "--workflow NAME -> its roles; the first workflow is the default",
    "generated": "True: instances from seeds (training below TEST_SEED0, held-out above); "
                 "False: rows of the `train` and `test` files",
    "train": "the shipped training files under data/ (a generated task: [])",
    "test": "the shipped held-out files under data/ (a generated task: [])",
    "answer_tokens": "the tiny model's compact answer in tokens, end of turn included (its response "
                     "budget); 0: the tiny model plays no compact form",
    "counters": "the names in COUNTERS the step log prints for it",
    "warmup": "the tiny base's format warm-up: 'turn' (a role's observation after the turn's "
              "earlier speakers, then env.random_answer), 'calls' (a random number of calls, then "
              "the next speaker's), or 'none'",
}
WARMUPS = ("turn", "calls", "none")


def _game(cls, **compact_settings):
    """The factory of a generated game: its compact form takes `compact_settings`, every form the
    run's `game` settings (Sudoku's wrong_fill, Sokoban's solve_shaping)."""
    def make(seed, workflow, compact, row, game=None, **_):
        return cls(seed, workflow=workflow, compact=compact, **(compact_settings if compact else {}),
                   **(game or {}))
    return make


def _make_code(seed, workflow, compact, row, train_tests=5, **_):
    return CodeEnv(row, workflow, train_tests=train_tests)


def _make_math(seed, workflow, compact, row, team=None, turns=4, **_):
    if team:  # --team: n reasoners, m tool agents and a judge
        return TeamMathEnv(row, *team)
    if workflow == "solver_verifier":
        return MathVerifyEnv(row, max_turns=turns)
    return MathEnv(row, workflow)


def _make_search(seed, workflow, compact, row, turns=4, search=None, **_):
    return make_search(seed, workflow, compact, turns, row=row, **(search or {}))


TWO_AGENTS = {"mas": ("tool", "plan"), "single": ("plan",)}
TASKS = {
    "plan": dict(make=_game(PlanPath, size=4, p_block=0.2), workflows=TWO_AGENTS, generated=True,
                 train=[], test=[], answer_tokens=8, warmup="turn", counters=("timeouts",)),
    "sokoban": dict(make=_game(Sokoban), workflows=TWO_AGENTS, generated=True, train=[], test=[],
                    answer_tokens=8, warmup="turn", counters=("timeouts",)),
    "sudoku": dict(make=_game(Sudoku), workflows=TWO_AGENTS, generated=True, train=[], test=[],
                   answer_tokens=17, warmup="turn", counters=("timeouts",)),
    "code": dict(make=_make_code, workflows={"mas": ("coder", "tester"), "single": ("coder",)},
                 generated=False, answer_tokens=0, warmup="none", counters=("timeouts",),
                 train=["code/train/leetcode_train.jsonl", "code/train/livecodebench_v5_2305_2407_public.jsonl"],
                 test=["code/test/livecodebench_v5_2408_2501_public.jsonl", "code/test/code_contests_test.jsonl",
                       "code/test/humaneval.jsonl", "code/test/mbpp_sanitized.jsonl", "code/test/leetcode_test.jsonl"]),
    "math": dict(make=_make_math, workflows={"mas": ("tool", "reasoner"), "single": ("reasoner",),
                                             "solver_verifier": ("solver", "verifier")},
                 generated=False, answer_tokens=0, warmup="none", counters=("timeouts",),
                 train=["math/train/math_train.jsonl", "math/train/aime_1983_2023.jsonl"],
                 test=["math/test/aime2024.jsonl", "math/test/aime2025.jsonl", "math/test/olympiadbench.jsonl",
                       "math/test/math500.jsonl", "math/test/gsm8k_test.jsonl", "math/test/amc23.jsonl"]),
    # generated worlds, or Search-R1's / HotpotQA's questions with --search_train / --search_test
    "search": dict(make=_make_search, workflows={"mas": ("verifier", "search", "answer")}, generated=True,
                   train=[], test=[], answer_tokens=3, warmup="calls",
                   counters=("timeouts", "search_calls", "search_failures")),
}
# what the envs count as they run, cumulative in this process: the step log prints each task's own
# (TASKS[...]["counters"]) as the step's increase; an alarm is printed when its counter rises
COUNTERS = {
    "timeouts": lambda: sandbox.stats["timeouts"],  # programs killed at their time limit
    "search_calls": lambda: retrieval.stats["calls"],  # retrievals run
    "search_failures": lambda: retrieval.stats["failures"],  # ... that failed (the agent saw it)
}
ALARMS = {"search_failures": "searches failed this step (the agents saw them as failed; is the "
                             "retriever up?)"}


def counts(task):
    """The task's counters now: {name: count} (COUNTERS)."""
    return {name: COUNTERS[name]() for name in TASKS[task]["counters"]}


def task_roles(task, workflow="mas"):
    return TASKS[task]["workflows"][workflow]


def check_task(task, workflow="mas"):
    """The task and workflow exist and the task's entry is whole: one line naming what is not."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    spec = TASKS[task]
    for key, what in TASK_KEYS.items():
        if key not in spec:
            raise ValueError(f"TASKS[{task!r}] has no {key!r}: {what}")
    if workflow not in spec["workflows"]:
        raise ValueError(f"task {task!r} has no workflow {workflow!r}: use --workflow "
                         + " or ".join(spec["workflows"]))
    if not spec["workflows"][workflow]:
        raise ValueError(f"TASKS[{task!r}]['workflows'][{workflow!r}] names no roles: list the agents "
                         "that speak, in order")
    unknown = [name for name in spec["counters"] if name not in COUNTERS]
    if unknown:
        raise ValueError(f"TASKS[{task!r}]['counters'] names {unknown[0]!r}, which envs.COUNTERS does not "
                         "read: add it there")
    if spec["warmup"] not in WARMUPS:
        raise ValueError(f"TASKS[{task!r}]['warmup'] is {spec['warmup']!r}: use one of {', '.join(WARMUPS)}")
    if spec["warmup"] != "none" and not spec["generated"]:
        raise ValueError(f"TASKS[{task!r}]: the tiny base's warm-up draws instances from seeds, and this "
                         "task's come from files: warmup 'none', or generated True")
    if spec["warmup"] != "none" and not hasattr(make_env(task, 0, workflow, compact=True), "random_answer"):
        raise ValueError(f"TASKS[{task!r}]: the warm-up answers with env.random_answer(role, rng, moves), "
                         "which its env does not have")


def load_split(task, split, files=None):
    """Rows of a dataset task: `files` (a user's own jsonl in the same schema) or the task's shipped
    files. Search questions: retrieval.load_questions (Search-R1's and HotpotQA's formats)."""
    check_task(task)
    files = files or TASKS[task].get(split, [])
    rows = []
    for f in files:
        path = f if os.path.isabs(f) or os.path.exists(f) else os.path.join(DATA, f)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no dataset file {path!r}: pass a jsonl in the schema of data/README.md")
        rows += retrieval.load_questions(path) if task == "search" else load_jsonl(path)
    return rows


def make_env(task, seed=0, workflow="mas", compact=False, row=None, train_tests=None, team=None, turns=4,
             search=None, game=None):
    """`team` (n, m, mode): math with n reasoners, m tool agents and a judge (TeamMathEnv). `turns`:
    the turn limit of the workflows that end themselves there (solver_verifier, search). `search`:
    the search task's settings, a dict of topk, retriever, metric. `game`: a game's own settings
    (Sudoku: wrong_fill)."""
    if task not in TASKS or workflow not in TASKS[task]["workflows"]:
        check_task(task, workflow)
    if row is None and not TASKS[task]["generated"]:
        raise ValueError(f"task {task!r} needs a dataset row (see load_split)")
    return TASKS[task]["make"](seed=seed, workflow=workflow, compact=compact, row=row,
                               train_tests=train_tests, team=team, turns=turns, search=search,
                               game=game)


def test_set(task, n=100, compact=False, workflow="mas", files=None, limit=None, team=None, turns=4,
             search=None):
    """Fixed evaluation instances: generated games and worlds from the reserved test seeds, datasets
    from their test files (search: --search_test)."""
    if TASKS[task]["generated"] and not files:
        if (limit or n) > MAX_TEST:
            raise ValueError(f"at most {MAX_TEST} test instances are reserved for {task}")
        return [make_env(task, TEST_SEED0 + i, workflow, compact, turns=turns, search=search)
                for i in range(limit or n)]
    rows = load_split(task, "test", files)[:limit]
    return [make_env(task, workflow=workflow, row=r, team=team, turns=turns, search=search) for r in rows]


def test_boards(task, compact):
    """The boards of a game's reserved test seeds (computed once)."""
    if (task, compact) not in _TEST_BOARDS:
        _TEST_BOARDS[task, compact] = {make_env(task, TEST_SEED0 + i, compact=compact).board()
                                       for i in range(MAX_TEST)}
    return _TEST_BOARDS[task, compact]


def train_env(task, rng, workflow="mas", compact=False, rows=None, train_tests=5, team=None, turns=4,
              search=None, game=None):
    """A fresh training instance: a game or world seed below TEST_SEED0, or a random row of the
    training pool."""
    if TASKS[task]["generated"] and not rows:
        while True:
            env = make_env(task, rng.randrange(TEST_SEED0), workflow, compact, turns=turns, search=search,
                           game=game)
            if not hasattr(env, "board") or env.board() not in test_boards(task, compact):
                return env
    return make_env(task, workflow=workflow, row=rng.choice(rows), train_tests=train_tests, team=team,
                    turns=turns, search=search)
