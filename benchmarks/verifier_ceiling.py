"""How well can a step verifier rank the tiny generator's own samples, and how well does the PRM?

For N sampled solutions per test problem, every step tag gets a score from each *scorer*, and each
scorer is measured the way the tiny-model issue measures the PRM: step AUC against the checker's
"correct so far" labels, and best-of-N accuracy (the trajectory whose last step scores highest).

Scorers:
- ``generator sum log p``: the generator's own log-probability of every solution token up to the
  tag, summed (how surprised the generator is by what was written, all of it);
- ``generator min log p``: the single most surprising token so far;
- ``generator mean log p``: the sum divided by the number of tokens;
- ``generator digit check``: the token-check PRM's share computed directly from its definition
  (:mod:`sgl_tts.models.token_check_prm`): per solution token, for a written digit the sum over the
  other digits of clamp(log p[other] - log p[written], 0, 1), else 0, averaged over the solution so
  far without the step tags (scored negated: fewer unexpected digits is better);
- ``PRM [last]``, ``PRM [min]``, ``PRM [prod]``: the step-tag PRM's P(+) at the tag, and its
  running min and product over the steps so far.

The generator-based rows are computed from the generator directly: what a PRM built on the generator
can reach (the shipped PRM computes the digit-check row's quantity; see docs/TINY_MODELS.md).

    ./dev.sh run python benchmarks/verifier_ceiling.py --problems 100 --out docs/results/verifier_ceiling.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.machine import describe
from sgl_tts.models import shipped_model
from sgl_tts.prm import StepTagPRM, auc, tag_positions
from sgl_tts.search import aggregate, vote
from sgl_tts.tiny.training import sample_solutions


def running(values: list[float], how: str) -> list[float]:
    """The aggregate of the first k values, for every k."""
    return [aggregate(values[:k], how) for k in range(1, len(values) + 1)]


def _digit_check(logp: dict[int, float], written: int, digits: list[int]) -> float:
    """Sum over the other digits of clamp(log p[other] - log p[written], 0, 1); 0 for a non-digit."""
    if written not in digits:
        return 0.0
    return sum(min(1.0, max(0.0, logp[d] - logp[written])) for d in digits if d != written)


def step_scores(gen, question: str, steps: list[str], prm_scores: list[float], start: int) -> dict[str, list[float]]:
    """Every scorer's score of one solution after each of its steps (empty when the solution cannot
    be tagged): the generator's own log-probabilities (sum, min, mean), its digit check, and the PRM
    under three aggregations. ``start``: the first token after the prompt."""
    tok = gen.tokenizer
    try:
        ids, tags = tag_positions(tok, question, steps)
    except ValueError:
        return {}
    if not tags:
        return {}
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    tag_id = tok.encode("\n\n")[0]
    rows = gen.next_token_logprobs([ids], [list(range(start - 1, tags[-1]))], list(range(len(tok))))[0]
    lp = [rows[i - start][ids[i]] for i in range(start, tags[-1] + 1)]
    cut = [t - start + 1 for t in tags]
    check = [0.0 if ids[i] == tag_id else _digit_check(rows[i - start], ids[i], digits)
             for i in range(start, tags[-1] + 1)]
    counted = [int(ids[i] != tag_id) for i in range(start, tags[-1] + 1)]
    return {"generator sum log p": [sum(lp[:c]) for c in cut],
            "generator min log p": [min(lp[:c]) for c in cut],
            "generator mean log p": [sum(lp[:c]) / c for c in cut],
            "generator digit check": [-sum(check[:c]) / sum(counted[:c]) for c in cut],
            "PRM [last]": list(prm_scores), "PRM [min]": running(list(prm_scores), "min"),
            "PRM [prod]": running(list(prm_scores), "prod")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generator", default=str(shipped_model("generator")))
    ap.add_argument("--prm", default=str(shipped_model("prm")))
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    if args.problems < 1 or args.samples < 4:
        ap.error("need --problems >= 1 and --samples >= 4")
    t0 = time.perf_counter()
    problems = task.test_split()[:args.problems]
    gen = LocalBackend(args.generator, seed=0)
    texts = sample_solutions(gen, problems, args.samples, temperature=args.temperature, seed=args.seed,
                             progress=True)
    prm = StepTagPRM(LocalBackend(args.prm, seed=0), cache=False)
    tok = gen.tokenizer
    names = ["generator sum log p", "generator min log p", "generator mean log p",
             "generator digit check", "PRM [last]", "PRM [min]", "PRM [prod]"]
    scores: dict[str, list[float]] = {n: [] for n in names}
    labels: list[int] = []
    ns = sorted({n for n in (4, 16, args.samples) if n <= args.samples})
    best = {(n, m): 0 for n in names for m in ns}
    single = majority = 0.0
    for p, sols in tqdm(list(zip(problems, texts)), desc="scoring"):
        grades = [task.grade(p, t) for t in sols]
        steps = [list(g.steps) for g in grades]
        prm_scores = prm.score(p.question, steps)
        start = len(tok.encode(task.prompt(p.question)))
        finals = []
        for g, st, ps in zip(grades, steps, prm_scores):
            per = step_scores(gen, p.question, st, ps, start)
            if per:
                for n in names:
                    scores[n] += per[n]
                labels += [int(v) for v in g.prefix_ok]
            finals.append({n: (per[n][-1] if per.get(n) else -math.inf) for n in names})
        for n in names:
            for m in ns:
                pick = max(range(m), key=lambda j: finals[j][n])
                best[(n, m)] += grades[pick].answer_ok
        single += sum(g.answer_ok for g in grades) / len(grades)
        majority += str(vote([g.answer for g in grades])) == str(p.answer)
    gen.shutdown()
    prm.backend.shutdown()
    k = len(problems)
    result = {
        "problems": k, "samples": args.samples, "temperature": args.temperature,
        "single_sample_mean": single / k, f"majority@{args.samples}": majority / k,
        "rows": [{"scorer": n, "step_auc": auc(scores[n], labels),
                  **{f"best_of_{m}": best[(n, m)] / k for m in ns}} for n in names],
        "graded_steps": len(labels), "seconds": time.perf_counter() - t0,
        "generator": args.generator, "prm": args.prm, "machine": describe(),
        "date": datetime.date.today().isoformat(),
        "command": "benchmarks/verifier_ceiling.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(f"{k} problems x {args.samples} samples at T={args.temperature}: single sample "
          f"{single / k:.1%}, majority@{args.samples} {majority / k:.1%}")
    print("| scorer | step AUC | " + " | ".join(f"best-of-{m}" for m in ns) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in ns) + " |")
    for r in result["rows"]:
        print(f"| {r['scorer']} | {r['step_auc']:.3f} | "
              + " | ".join(f"{r[f'best_of_{m}']:.1%}" for m in ns) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
