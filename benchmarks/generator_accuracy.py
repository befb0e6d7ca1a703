"""Accuracy of a generator on the task's test split: T=0.8 single sample (mean over 8 samples),
majority@8, pass@8, greedy, and T=0.8 accuracy by level.

    ./dev.sh run python benchmarks/generator_accuracy.py sgl_tts/models/data/generator 500
"""

import collections
import sys

from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.search import vote
from sgl_tts.tiny.training import sample_solutions

probs = task.test_split()[:int(sys.argv[2]) if len(sys.argv) > 2 else 100]
be = LocalBackend(sys.argv[1], max_running=512, seed=0)
texts = sample_solutions(be, probs, 8, temperature=0.8, seed=0)
g0 = sample_solutions(be, probs, 1, temperature=0.0, seed=0)
be.shutdown()
g = [[task.grade(p, t) for t in ts] for p, ts in zip(probs, texts)]
single = sum(x.answer_ok for gs in g for x in gs) / (8 * len(probs))
maj = sum(vote([x.answer for x in gs]) == str(p.answer) for p, gs in zip(probs, g)) / len(probs)
pas = sum(any(x.answer_ok for x in gs) for gs in g) / len(probs)
greedy = sum(task.grade(p, t[0]).answer_ok for p, t in zip(probs, g0)) / len(probs)
by = collections.defaultdict(list)
for p, gs in zip(probs, g):
    by[p.level] += [x.answer_ok for x in gs]
print(f"problems {len(probs)} single(T=0.8) {single:.3f} majority@8 {maj:.3f} pass@8 {pas:.3f} "
      f"greedy {greedy:.3f} by level (T=0.8):",
      {k: round(sum(v) / len(v), 3) for k, v in sorted(by.items())})
