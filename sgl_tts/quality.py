"""Quality of the tiny generator + PRM on held-out problems (``python -m sgl_tts.quality``).

Measures, on the fixed test split: single-sample accuracy at a temperature, majority vote over N
samples, PRM best-of-N (several step-score aggregations), PRM-weighted vote, PRM-guided step beam
search (N candidates per step, keep N/M, expand each M times), and the PRM's step-classification AUC on
the generator's own graded steps. All sampling is seeded, so a run is reproducible.

This evaluates the models directly on the CPU engine; the search algorithms as SGLang programs live in
``programs/`` (issue "TTS programs"), which will reuse these numbers as their reference.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from sgl_tts import task
from sgl_tts.training import accuracy, prm_step_scores, sample_solutions

AGGREGATIONS = {
    "last": lambda xs: xs[-1],
    "min": min,
    "prod": lambda xs: math.prod(xs),
    "mean": lambda xs: sum(xs) / len(xs),
}


def majority(answers: Sequence[str | None], weights: Sequence[float] | None = None) -> str | None:
    """Most voted (or most weighted) answer; ties go to the answer seen first; ``None`` never wins."""
    score: dict[str, float] = collections.OrderedDict()
    for i, a in enumerate(answers):
        if a is not None:
            score[a] = score.get(a, 0.0) + (1.0 if weights is None else weights[i])
    if not score:
        return None
    best = max(score.values())
    return next(a for a, v in score.items() if v == best)


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied ranks averaged)."""
    pairs = sorted(zip(scores, labels))
    n_pos = sum(labels)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum, i = 0.0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        avg_rank = (i + j + 1) / 2.0
        rank_sum += avg_rank * sum(lab for _, lab in pairs[i:j])
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def beam_search(gen, prm, problems: Sequence[task.Problem], n: int, m: int, *, temperature: float,
                seed: int, max_depth: int = 8, step_tokens: int = 40,
                agg: str = "last", progress: bool = False) -> list[str]:
    """PRM-guided step beam search for many problems at once (depth-synchronous).

    Each depth: every active prefix gets one sampled step; steps are scored by the PRM; finished
    candidates (boxed answer or end of text) are set aside; the best ``n // m`` unfinished ones are
    kept and each expanded ``m`` times. The answer is the best finished candidate's (by ``agg`` of its
    step scores), or the best unfinished one's if none finished.
    """
    from sgl_tts.backends.engine import SamplingSpec

    keep = max(1, n // m)
    active = [[[] for _ in range(n)] for _ in problems]  # per problem: list of step lists
    done: list[list[tuple[float, list[str]]]] = [[] for _ in problems]
    best_open: list[tuple[float, list[str]] | None] = [None] * len(problems)
    for depth in tqdm(range(max_depth), desc="beam search", disable=not progress):
        futs = []
        for i, (p, beams) in enumerate(zip(problems, active)):
            for j, steps in enumerate(beams):
                text = task.prompt(p.question) + "".join(s + task.STEP_SEPARATOR for s in steps)
                spec = SamplingSpec(max_new_tokens=step_tokens, temperature=temperature,
                                    stop=(task.STEP_SEPARATOR,),
                                    seed=seed * 1_000_003 + i * 100_003 + depth * 1009 + j)
                futs.append((i, steps, gen.engine.submit(gen.encode(text), spec)))
        cands: list[list[tuple[list[str], bool]]] = [[] for _ in problems]
        for i, steps, f in futs:
            comp = f.result()
            step = comp.text.strip()
            reason = comp.meta_info["finish_reason"] or {}
            finished = "\\boxed" in step or isinstance(reason.get("matched"), int)
            cands[i].append((steps + [step] if step else steps, finished or not step))
        for i, p in enumerate(problems):
            if not cands[i]:
                continue
            scores = prm_step_scores(prm, p.question, [c for c, _ in cands[i]])
            ranked = []
            for (steps, finished), sc in zip(cands[i], scores):
                value = AGGREGATIONS[agg](sc)
                (done[i].append((value, steps)) if finished else ranked.append((value, steps)))
            ranked.sort(key=lambda x: -x[0])  # stable: ties keep generation order
            if ranked and (best_open[i] is None or ranked[0][0] > best_open[i][0]):
                best_open[i] = ranked[0]
            active[i] = [steps for _, steps in ranked[:keep] for _ in range(m)]
            if len(done[i]) >= n:
                active[i] = []
        if not any(active):
            break
    out = []
    for i in range(len(problems)):
        pool = done[i] or ([best_open[i]] if best_open[i] else [])
        best = max(pool, key=lambda x: x[0])[1] if pool else []
        out.append(task.STEP_SEPARATOR.join(best))
    return out


@dataclasses.dataclass
class QualityReport:
    problems: int
    samples: int
    temperature: float
    results: dict
    seconds: float

    def table(self) -> str:
        r = self.results
        base = r["single_sample"]
        lines = ["| method | accuracy | vs single sample |", "| --- | ---: | ---: |"]
        for name, value in r.items():
            if name in ("prm_step_auc", "pass_at_n"):
                continue
            lines.append(f"| {name} | {100 * value:.1f}% | {100 * (value - base):+.1f} |")
        lines.append(f"| pass@{self.samples} (oracle) | {100 * r['pass_at_n']:.1f}% | |")
        lines.append(f"| PRM step AUC | {r['prm_step_auc']:.3f} | |")
        return "\n".join(lines)


def evaluate(generator: str | Path, prm: str | Path, *, count: int = 500, samples: int = 16,
             temperature: float = 0.8, beam_width: int = 4, seed: int = 0,
             progress: bool = True) -> QualityReport:
    from sgl_tts import LocalBackend

    t0 = time.perf_counter()
    problems = task.test_split()[:count]
    gen = LocalBackend(generator, max_running=512, seed=seed)
    scorer = LocalBackend(prm, max_running=512, seed=seed)
    try:
        texts = sample_solutions(gen, problems, samples, temperature=temperature, seed=seed,
                                 progress=progress)
        grades = [[task.grade(p, t) for t in ts] for p, ts in zip(problems, texts)]
        single = sum(g.answer_ok for gs in grades for g in gs) / (len(problems) * samples)
        votes = [majority([g.answer for g in gs]) for gs in grades]
        results = {"single_sample": single,
                   f"majority@{samples}": sum(v == str(p.answer) for v, p in zip(votes, problems)) / len(problems)}
        step_scores = [prm_step_scores(scorer, p.question, [list(g.steps) for g in gs])
                       for p, gs in tqdm(list(zip(problems, grades)), desc="PRM scoring",
                                         disable=not progress)]
        for agg, fn in AGGREGATIONS.items():
            picks = [max(range(samples), key=lambda j: fn(sc[j])) for sc in step_scores]
            results[f"prm_best_of_{samples}[{agg}]"] = sum(
                gs[j].answer_ok for gs, j in zip(grades, picks)) / len(problems)
        weighted = [majority([g.answer for g in gs], [AGGREGATIONS["min"](s) for s in sc])
                    for gs, sc in zip(grades, step_scores)]
        results[f"prm_weighted_vote@{samples}[min]"] = sum(
            v == str(p.answer) for v, p in zip(weighted, problems)) / len(problems)
        beams = beam_search(gen, scorer, problems, samples, beam_width, temperature=temperature,
                            seed=seed + 1, progress=progress)
        results[f"prm_beam_search(N={samples},M={beam_width})"] = accuracy(problems, beams)
        labels, scores = [], []
        for gs, sc in zip(grades, step_scores):
            for g, s in zip(gs, sc):
                if g.steps:
                    labels.extend(int(v) for v in g.prefix_ok)
                    scores.extend(s[:len(g.prefix_ok)])
        results["prm_step_auc"] = auc(scores, labels)
        results["pass_at_n"] = sum(any(g.answer_ok for g in gs) for gs in grades) / len(problems)
    finally:
        gen.shutdown()
        scorer.shutdown()
    return QualityReport(len(problems), samples, temperature, results, time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generator", required=True)
    ap.add_argument("--prm", required=True)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rep = evaluate(args.generator, args.prm, count=args.count, samples=args.samples,
                   temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps(dataclasses.asdict(rep)))
    else:
        print(rep.table())
        print(f"({rep.problems} problems, {rep.samples} samples at T={rep.temperature}, "
              f"{rep.seconds:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
