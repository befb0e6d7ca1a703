"""The project's own reasoning task: multi-step integer arithmetic with checkable steps.

A problem is a chain of operations applied left to right to a start value, written with parentheses:

    Compute ((12+7)*3)-5.

Its reference solution uses the step format used everywhere in the project (steps separated by a blank
line, final answer in ``\\boxed{}``)::

    Step 1: 12+7=19

    Step 2: 19*3=57

    Step 3: 57-5=52

    The answer is \\boxed{52}

Every intermediate value stays in [0, 999]. Difficulty levels set the number of operations and the
operand range. Problems are generated from a seed alone; the test split is fixed (its own seed) and
the training stream never yields a test question. :func:`grade` checks a solution text step by step.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from sgl_tts.search import STEP_DELIMITER, extract_answer, split_steps

# The task's text conventions are the search primitives' defaults: steps separated by a blank line,
# the answer in \boxed{...} (task.extract_answer / task.split_steps are those primitives).
STEP_SEPARATOR = STEP_DELIMITER
MAX_VALUE = 999


@dataclasses.dataclass(frozen=True)
class Level:
    """A difficulty level: how many operations, and the range of added/subtracted operands."""

    ops: int
    max_operand: int
    max_multiplier: int = 9


# Longer chains make a well-trained model's per-step sampling slips add up (errors that voting and a
# PRM can fix), instead of systematic errors of an undertrained model (which they cannot).
LEVELS: dict[int, Level] = {
    1: Level(ops=3, max_operand=20),
    2: Level(ops=5, max_operand=50),
    3: Level(ops=7, max_operand=99),
    4: Level(ops=9, max_operand=99),
}

# Harder than anything trained on: multipliers up to 30 (training and the test split use 2-9), 9
# operations. The shipped generator is right greedily on ~45% of them and a T=0.8 sample on ~12%; the
# PRM still separates its sampled steps (step AUC ~0.9): `sgl-tts workload --measure`, docs/TINY_MODELS.md.
# Kept apart from LEVELS: test_split() and train_stream() draw "all levels", and must not change.
HARD_LEVELS: dict[int, Level] = {
    5: Level(ops=9, max_operand=99, max_multiplier=30),
}

TEST_SEED = "sgl-tts-arith-test-v1"
HARD_SEED = "sgl-tts-arith-hard-v1"
TRAIN_SEED = "sgl-tts-arith-train-v1"
TEST_SIZE = 500


def apply(x: int, op: str, y: int) -> int:
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    raise ValueError(f"unknown operation {op!r}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """A start value and a chain of (operation, operand) pairs."""

    start: int
    ops: tuple[tuple[str, int], ...]
    level: int

    @property
    def question(self) -> str:
        expr = str(self.start)
        for i, (op, y) in enumerate(self.ops):
            expr = f"{expr}{op}{y}" if i == len(self.ops) - 1 else f"({expr}{op}{y})"
        return f"Compute {expr}."

    @property
    def values(self) -> list[int]:
        """Running values: start, then the value after each operation."""
        vals = [self.start]
        for op, y in self.ops:
            vals.append(apply(vals[-1], op, y))
        return vals

    @property
    def answer(self) -> int:
        return self.values[-1]

    def step_texts(self) -> list[str]:
        vals = self.values
        steps = [f"Step {k + 1}: {vals[k]}{op}{y}={vals[k + 1]}" for k, (op, y) in enumerate(self.ops)]
        return steps + [answer_step(self.answer)]

    def solution(self) -> str:
        return STEP_SEPARATOR.join(self.step_texts())

    def to_record(self, pid: str) -> dict:
        """One JSONL line in the runner's dataset format (``question``, ``answer`` + extras)."""
        return {"id": pid, "question": self.question, "answer": str(self.answer), "level": self.level,
                "start": self.start, "ops": [list(o) for o in self.ops], "solution": self.solution()}

    @classmethod
    def from_record(cls, rec: dict) -> "Problem":
        return cls(int(rec["start"]), tuple((str(o), int(y)) for o, y in rec["ops"]), int(rec["level"]))


def answer_step(value: int | str) -> str:
    return f"The answer is \\boxed{{{value}}}"


def prompt(question: str) -> str:
    """The text a model is given: the question, then a blank line; the first step follows."""
    return question + STEP_SEPARATOR


def level_spec(level: int) -> Level:
    """A level's definition, from :data:`LEVELS` or :data:`HARD_LEVELS`."""
    spec = LEVELS.get(level) or HARD_LEVELS.get(level)
    if spec is None:
        raise ValueError(f"unknown level {level}; levels are {sorted(LEVELS)} and hard {sorted(HARD_LEVELS)}")
    return spec


def make_problem(rng: random.Random, level: int) -> Problem:
    spec = level_spec(level)
    value = rng.randint(1, spec.max_operand)
    start = value
    ops = []
    for _ in range(spec.ops):
        choices = []
        if value + 1 <= MAX_VALUE:
            choices.append("+")
        if value >= 2:
            choices.append("-")
        if value >= 1 and value * 2 <= MAX_VALUE:
            choices.append("*")
        op = rng.choice(choices)
        if op == "+":
            y = rng.randint(1, min(spec.max_operand, MAX_VALUE - value))
        elif op == "-":
            y = rng.randint(1, min(spec.max_operand, value - 1))
        else:
            y = rng.randint(2, min(spec.max_multiplier, MAX_VALUE // value))
        ops.append((op, y))
        value = apply(value, op, y)
    return Problem(start, tuple(ops), level)


def generate(count: int, seed: int | str, levels: Sequence[int] = tuple(LEVELS),
             exclude: Iterable[str] = ()) -> list[Problem]:
    """``count`` distinct problems from ``seed``, levels in turn; questions in ``exclude`` are skipped."""
    if not levels:
        raise ValueError("no levels given")
    for lv in levels:
        level_spec(lv)
    rng = random.Random(str(seed))
    seen = set(exclude)
    out: list[Problem] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise RuntimeError(f"could not draw {count} distinct problems at levels {list(levels)}")
        p = make_problem(rng, levels[len(out) % len(levels)])
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def test_split(levels: Sequence[int] = tuple(LEVELS)) -> list[Problem]:
    """The fixed held-out test problems (500, all levels in turn)."""
    return generate(TEST_SIZE, TEST_SEED, levels)


def hard_split(count: int = 200) -> list[Problem]:
    """Problems of the hard levels (:data:`HARD_LEVELS`) from their own fixed seed; never a test question."""
    return generate(count, HARD_SEED, tuple(HARD_LEVELS), exclude=(p.question for p in test_split()))


def mixed_split(count: int) -> list[Problem]:
    """``count`` problems alternating test split and hard split (test first): the mixed stream that
    ``sgl-tts load --workload mixed`` serves. Its first ``2k`` are the test split's first ``k`` and the
    hard split's first ``k``."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    tests, hards = test_split()[:(count + 1) // 2], hard_split(max(count // 2, 1))
    out: list[Problem] = []
    for i in range(count):
        out.append(tests[i // 2] if i % 2 == 0 else hards[i // 2])
    return out


SPLITS = ("test", "hard", "mixed")


def split(name: str, count: int | None = None) -> list[Problem]:
    """A named problem set: ``test`` (the 500-problem test split), ``hard`` (:func:`hard_split`) or
    ``mixed`` (:func:`mixed_split`); the first ``count`` (all of ``test``, 200 of the others, if None)."""
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if name == "test":
        probs = test_split()
        if count is not None and count > len(probs):
            raise ValueError(f"the test split has {len(probs)} problems, asked for {count}")
        return probs[:count]
    if name == "hard":
        return hard_split(200 if count is None else count)
    if name == "mixed":
        return mixed_split(200 if count is None else count)
    raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLITS)}")


def is_hard(problem: Problem) -> bool:
    return problem.level in HARD_LEVELS


def train_stream(seed: int | str = TRAIN_SEED, levels: Sequence[int] = tuple(LEVELS),
                 exclude: Iterable[str] = ()) -> Iterator[Problem]:
    """An endless stream of training problems that never repeats a test question (nor one in
    ``exclude``). A level listed k times is drawn k times as often."""
    held_out = {p.question for p in test_split()} | set(exclude)
    rng = random.Random(str(seed))
    while True:
        p = make_problem(rng, rng.choice(list(levels)))
        if p.question not in held_out:
            yield p


def write_jsonl(problems: Sequence[Problem], path: str | Path, prefix: str = "arith") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, p in enumerate(problems):
            f.write(json.dumps(p.to_record(f"{prefix}-{i:04d}")) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Problem]:
    """Problems from a file :func:`write_jsonl` wrote (``start``, ``ops``, ``level`` per line); a line
    without them is named."""
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            p = Problem.from_record(rec)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: not a task problem ({type(exc).__name__}: {exc}); "
                             f"write problems with sgl-tts workload") from None
        if "answer" in rec and str(rec["answer"]) != str(p.answer):
            raise ValueError(f"{path}:{n}: answer {rec['answer']} does not match its operations ({p.answer})")
        out.append(p)
    return out


# ------------------------------------------------------------------------------------- checker
_STEP = re.compile(r"^Step (\d+): (\d+)([+\-*])(\d+)=(-?\d+)$")


@dataclasses.dataclass(frozen=True)
class Grade:
    """Verdicts for one solution text.

    Attributes:
        steps: the solution split at blank lines (the last one normally holds ``\\boxed{}``).
        step_ok: per step, whether that step is right given the problem and the *true* running value
            (wrong format, wrong operand copied, wrong result all make it wrong).
        prefix_ok: per step, whether it and every step before it are right (Math-Shepherd labels:
            "is the solution still correct here?").
        answer: the boxed answer, or ``None``.
        answer_ok: the boxed answer equals the problem's answer.
    """

    steps: tuple[str, ...]
    step_ok: tuple[bool, ...]
    prefix_ok: tuple[bool, ...]
    answer: str | None
    answer_ok: bool


def check_step(problem: Problem, index: int, text: str) -> bool:
    """Is step ``index`` (0-based) right? Arithmetic steps must copy the true running value and the
    problem's operation; the step after the last operation must box the true answer."""
    n = len(problem.ops)
    if index == n:
        return text == answer_step(problem.answer)
    if index > n:
        return False
    m = _STEP.match(text)
    if not m:
        return False
    k, x, op, y, z = int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])
    want_op, want_y = problem.ops[index]
    return (k == index + 1 and x == problem.values[index] and op == want_op and y == want_y
            and z == apply(x, op, y))


def grade(problem: Problem, text: str) -> Grade:
    """Grade a solution text (what follows the prompt) step by step and by its final answer."""
    steps = split_steps(text)
    step_ok = tuple(check_step(problem, i, s) for i, s in enumerate(steps))
    prefix, ok = [], True
    for v in step_ok:
        ok = ok and v
        prefix.append(ok)
    answer = extract_answer(text)
    return Grade(tuple(steps), step_ok, tuple(prefix), answer, answer == str(problem.answer))
