"""``sgl-tts run``'s data: the problems file it reads (JSONL, every bad line named) and the results
file it appends to (one fsynced line per finished problem, read back to resume: a
:class:`~sgl_tts.records.RecordStore` keyed by each record's ``run_key``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

from sgl_tts.records import KeyMismatch, RecordStore, StoreError
from sgl_tts.search import SearchResult, top_k, vote
from sgl_tts.experiment.config import RULES, RunError, RunConfig, read_input, utf8_text


# -------------------------------------------------------------------------------------- problems
@dataclasses.dataclass(frozen=True)
class ProblemRecord:
    index: int
    id: str
    question: str
    answer: str | None


def read_problems(path: str | os.PathLike | None, limit: int | None = None) -> list[ProblemRecord]:
    """The dataset's problems, every line checked before any is run."""
    if path is None:
        from sgl_tts.tiny import task
        problems = task.test_split()
        records = [ProblemRecord(i, f"arith-test-{i}", p.question, str(p.answer))
                   for i, p in enumerate(problems)]
        return records[:limit] if limit else records
    p = Path(path)
    fix = 'each line must be a JSON object {"question": "...", "answer": "..." (optional)}'
    text = utf8_text(read_input(p, f"problems file {p}", f"pass --problems PATH to a JSONL file ({fix})"), str(p))
    out: list[ProblemRecord] = []
    for lineno, line in enumerate(text.split("\n"), 1):   # JSON Lines: \n ends a line (\r\n too)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunError(f"{p} line {lineno}: not valid JSON ({exc.msg}); {fix}") from None
        if not isinstance(rec, dict):
            raise RunError(f"{p} line {lineno}: expected a JSON object, got "
                           f"{type(rec).__name__}; {fix}")
        if "question" not in rec:
            raise RunError(f"{p} line {lineno}: no \"question\" field; {fix}")
        q = rec["question"]
        if not isinstance(q, str) or not q.strip():
            raise RunError(f"{p} line {lineno}: \"question\" must be a non-empty string; {fix}")
        answer = rec.get("answer")
        if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
            raise RunError(f"{p} line {lineno}: \"answer\" must be a string or a number, got "
                           f"{type(answer).__name__}; {fix}")
        pid = rec.get("id")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
            raise RunError(f"{p} line {lineno}: \"id\" must be a string or an integer, got "
                           f"{type(pid).__name__}; {fix}")
        pid = str(len(out) if pid is None else pid)
        out.append(ProblemRecord(len(out), pid, q, None if answer is None else str(answer).strip()))
        if limit and len(out) >= limit:
            break
    if not out:
        raise RunError(f"{p} has no problems; {fix}")
    return out


# ---------------------------------------------------------------------------------------- output
def subsample_sizes(n: int) -> list[int]:
    """Every 2^k <= n, then n itself."""
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def answers_at(result: SearchResult, size: int) -> dict[str, str | None]:
    """Best-of-N's selection rules (majority, PRM-weighted vote, best PRM score; ties to the earlier
    trajectory) applied to the first ``size`` trajectories of a result."""
    trajs = result.trajectories[:size]
    if not trajs:
        return {rule: None for rule in RULES}
    answers = [t.answer for t in trajs]
    scores = [t.score for t in trajs]
    return {"majority": vote(answers), "prm_weighted": vote(answers, scores),
            "prm_best": trajs[top_k(scores, 1)[0]].answer}


def result_record(problem: ProblemRecord, result: SearchResult, cfg: RunConfig, prm_used: bool
                  ) -> dict[str, Any]:
    """One output line: the problem, the program's answers, every trajectory and the costs."""
    rules = RULES if prm_used else ("majority",)
    answers = {r: result.answers.get(r) for r in rules}
    # a program's own selection rules beyond best-of-N's (DeepConf's confidence votes): at N only
    answers |= {r: a for r, a in result.answers.items() if r not in RULES}
    # at N itself: the program's own answers; below N: the first N' trajectories (best-of-N's rules)
    sub = {str(k): (dict(answers) if k == cfg.n else {r: a for r, a in answers_at(result, k).items() if r in rules})
           for k in subsample_sizes(cfg.n)}
    rec: dict[str, Any] = {
        "index": problem.index, "id": problem.id, "question": problem.question,
        "reference": problem.answer, "answer": result.answer, "answers": answers,
        "subsampled": sub, "run_key": cfg.run_key(),
        "tokens_generated": result.tokens_generated, "tokens_kept": result.tokens_kept,
        "tokens_speculative": result.tokens_speculative, "tokens_reused": result.tokens_reused,
        **({"branches": {"started": result.branches_started, "declined": result.branches_declined,
                         "stopped": result.branches_stopped, "stood_down": dict(result.stood_down)}}
           if result.branches_started or result.branches_declined else {}),
        "seconds": round(result.seconds, 4),
        "seconds_generating": round(result.seconds_generating, 4),
        "seconds_verifying": round(result.seconds_verifying, 4),
        **({"exit_reason": result.exit_reason} if result.exit_reason is not None else {}),
        **({"traces_stopped": result.traces_stopped} if result.traces_stopped else {}),
        "trajectories": [{"steps": t.steps, "step_scores": [round(x, 6) for x in t.step_scores],
                          "score": round(t.score, 6), "answer": t.answer, "tokens": t.tokens,
                          "finished": t.finished, "seconds": round(t.seconds, 4)}
                         for t in result.trajectories],
    }
    if problem.answer is not None:
        rec["correct"] = {r: a == problem.answer for r, a in answers.items()}
        rec["pass"] = any(t.answer == problem.answer for t in result.trajectories)
    return rec


#: what a run's output is, in a store error
RUN_OUTPUT = "an sgl-tts run output"


def results_store(path: str | os.PathLike, run_key: str) -> RecordStore:
    """A run's output file as a :class:`~sgl_tts.records.RecordStore`: one record per finished problem,
    each carrying the settings' ``run_key``; a record of another key is refused."""
    return RecordStore(path, run_key, field="run_key", what=RUN_OUTPUT)


def read_results(path: Path, run_key: str, problems: Sequence[ProblemRecord]) -> dict[int, dict]:
    """Finished problems already in ``path``: a torn last line (a crash mid-write) is left out (and
    cut off by the next append); a file written by a different config or dataset is an error rather
    than mixed into."""
    if path.is_dir():
        raise RunError(f"output file {path} is a directory; pass --output PATH to a JSONL file")
    try:
        lines = results_store(path, run_key).read_numbered()
    except KeyMismatch as exc:
        raise RunError(f"{path} holds results of different settings (run key {exc.theirs}, these settings "
                       f"{run_key}); use another --output or delete the file") from None
    except StoreError as exc:
        raise RunError(f"{exc}; choose another --output") from None
    by_index = {p.index: p for p in problems}
    done: dict[int, dict] = {}
    for lineno, rec in lines:
        p = by_index.get(rec.get("index"))
        if p is None or p.question != rec.get("question"):
            if p is None and rec.get("index", -1) >= len(problems):
                continue  # beyond --limit: kept in the file, left out of this summary
            raise RunError(f"{path} line {lineno} is for a different problem set (problem "
                           f"{rec.get('index')} differs); use another --output or delete the file")
        done[p.index] = rec
    return done
