"""How much test-time scaling buys on the project's task: the TTS programs run side by side.

:func:`compare` runs, on held-out problems of :mod:`sgl_tts.tiny.task` and one generator backend plus a PRM
scorer, the programs in ``programs/``: a single sample, self-consistency (majority vote) and PRM
best-of-N (one ``best_of_n`` run per N: both read the same samples), PRM-guided step beam search
(one run per N), PRM particle filtering (one run per N >= 2; ``sgl-tts demo``: at its smallest) and
DeepConf offline and online (no PRM; one run each per N >= 2; ``sgl-tts demo``: online at its largest).
Every row carries accuracy, generated tokens per problem and wall seconds of its run.
From the largest best-of-N run it also derives pass@N, the mean single-sample accuracy over all its
samples, best-of-N under each step-score aggregation, and the PRM's step-classification AUC against the
checker's labels.

``sgl-tts demo`` shows this on ~50 problems; ``sgl-tts quality`` measures the 500-problem test split
(the numbers recorded in ``docs/TINY_MODELS.md``). This module sits above ``programs/`` (it is an
application of them, like the CLI).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Sequence

from sgl_tts.prm import auc
from sgl_tts.search import AGGREGATIONS, aggregate, top_k, vote
from sgl_tts.search.options import (DEFAULT_AGGREGATION, DEFAULT_MAX_TOKENS, DEFAULT_STEP_TOKENS, DEFAULT_TEMPERATURE,
                                    DEFAULT_WIDTH)
from sgl_tts.tiny import task


@dataclasses.dataclass
class MethodRow:
    """One method at one N: accuracy, generated tokens per problem, wall seconds of its run."""

    method: str
    n: int
    accuracy: float
    tokens_per_problem: float
    seconds: float


@dataclasses.dataclass
class Comparison:
    problems: int
    temperature: float
    beam_width: int
    aggregation: str
    rows: list[MethodRow]
    details: dict[str, Any]
    seconds: float

    def row(self, method: str, n: int) -> MethodRow:
        return next(r for r in self.rows if r.method == method and r.n == n)

    def table(self) -> str:
        base = self.row("single sample", 1).accuracy
        lines = ["| method | N | accuracy | vs single | tokens/problem | seconds |",
                 "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in self.rows:
            lines.append(f"| {r.method} | {r.n} | {100 * r.accuracy:.1f}% | "
                         f"{100 * (r.accuracy - base):+.1f} | {r.tokens_per_problem:.0f} | "
                         f"{r.seconds:.1f} |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _results(states) -> list:
    out = []
    for st in states:
        err = st.error()
        if err is not None:
            raise err
        out.append(st.ret_value)
    return out


def _accuracy(problems: Sequence[task.Problem], answers: Sequence[str | None]) -> float:
    return sum(a == str(p.answer) for p, a in zip(problems, answers)) / max(1, len(problems))


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers from a command-line value, with an error naming ``flag``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def check_ns(ns: Sequence[int]) -> list[int]:
    """The N values sorted; they must include 1 (the single-sample baseline) and be positive."""
    out = sorted(set(int(n) for n in ns))
    if not out or out[0] != 1:
        raise ValueError(f"N values must be positive and include 1 (the single-sample baseline), "
                         f"got {list(ns)}")
    return out


def compare(generator, prm, problems: Sequence[task.Problem], *, ns: Sequence[int] = (1, 4, 16),
            beam_width: int = DEFAULT_WIDTH, temperature: float = DEFAULT_TEMPERATURE,
            aggregation: str = DEFAULT_AGGREGATION, seed: int = 0, max_tokens: int = DEFAULT_MAX_TOKENS,
            step_tokens: int = DEFAULT_STEP_TOKENS, progress: bool = True,
            particle_filtering_ns: Sequence[int] | None = None,
            deepconf_ns: Sequence[int] | None = None,
            deepconf_modes: Sequence[str] = ("offline", "online")) -> Comparison:
    """Run the TTS programs on ``problems`` with ``generator`` (an sgl backend) and ``prm`` (a
    :class:`~sgl_tts.prm.PRMScorer`); see the module docstring for what is measured.
    ``particle_filtering_ns``: the N of particle filtering's rows (its defaults: multinomial draws,
    the best particle); ``None``: every N >= 2 of ``ns``. ``deepconf_ns``: the N of DeepConf's rows,
    one per mode of ``deepconf_modes`` (its defaults, no PRM: the tokens column shows what online's
    early stopping saves); ``None``: every N >= 2 of ``ns``."""
    from sgl_tts.experiment import RunConfig, program_function

    if not problems:
        raise ValueError("no problems to evaluate")
    ns = check_ns(ns)

    def arguments(program: str, n: int, scorer, **own: Any) -> list[dict[str, Any]]:
        """The program's arguments per problem, as ``sgl-tts run`` gives them (the registry's)."""
        cfg = RunConfig(program=program, n=n, beam_width=beam_width, temperature=temperature,
                        aggregation=aggregation, seed=seed, max_tokens=max_tokens, step_tokens=[step_tokens],
                        prm=None if scorer is not None else "none", **own)
        return [cfg.program_arguments(p.question, scorer) for p in problems]

    t_all = time.perf_counter()
    rows: list[MethodRow] = []
    details: dict[str, Any] = {}
    count = len(problems)
    largest = None
    for n in ns:
        args = arguments("best_of_n", n, prm if n > 1 else None)
        t = time.perf_counter()
        res = _results(program_function("best_of_n").run_batch(args, backend=generator, progress_bar=progress))
        secs = time.perf_counter() - t
        tokens = sum(r.tokens_generated for r in res) / count
        if n == 1:
            rows.append(MethodRow("single sample", 1, _accuracy(problems, [r.answer for r in res]),
                                  tokens, secs))
            continue
        rows.append(MethodRow("majority vote", n, _accuracy(problems, [r.answers["majority"] for r in res]),
                              tokens, secs))
        rows.append(MethodRow("PRM best-of-N", n, _accuracy(problems, [r.answers["prm_best"] for r in res]),
                              tokens, secs))
        rows.append(MethodRow("PRM-weighted vote", n,
                              _accuracy(problems, [r.answers["prm_weighted"] for r in res]), tokens, secs))
        largest = (n, res)
    def search_row(method: str, program: str, n: int, scorer: Any = prm, **own: Any) -> MethodRow:
        """One run of a search at budget ``n`` over every problem, as a row."""
        args = arguments(program, n, scorer, **own)
        t = time.perf_counter()
        res = _results(program_function(program).run_batch(args, backend=generator, progress_bar=progress))
        return MethodRow(method, n, _accuracy(problems, [r.answer for r in res]),
                         sum(r.tokens_generated for r in res) / count, time.perf_counter() - t)

    rows += [search_row("PRM beam search", "beam_search", n) for n in ns if n >= beam_width]
    rows += [search_row("PRM particle filtering", "particle_filtering", n)
             for n in (ns if particle_filtering_ns is None else particle_filtering_ns) if n >= 2]
    rows += [search_row(f"DeepConf {mode}", "deepconf", n, None, deepconf_mode=mode)
             for n in (ns if deepconf_ns is None else deepconf_ns) if n >= 2 for mode in deepconf_modes]
    if largest is not None:
        details.update(_sample_details(problems, *largest))
    return Comparison(count, temperature, beam_width, aggregation, rows, details,
                      time.perf_counter() - t_all)


def _sample_details(problems: Sequence[task.Problem], n: int, results) -> dict[str, Any]:
    """pass@N, mean single-sample accuracy, best-of-N per aggregation and the PRM step AUC from the
    trajectories (and their PRM step scores) of one best-of-N run."""
    grades = [[task.grade(p, t.text) for t in r.trajectories] for p, r in zip(problems, results)]
    out: dict[str, Any] = {
        "samples": n,
        f"pass@{n}": sum(any(g.answer_ok for g in gs) for gs in grades) / len(problems),
        "single_sample_mean": sum(g.answer_ok for gs in grades for g in gs) / (n * len(problems)),
    }
    for how in AGGREGATIONS:
        picks = [top_k([aggregate(t.step_scores, how) for t in r.trajectories], 1)[0] for r in results]
        out[f"prm_best_of_{n}[{how}]"] = sum(gs[j].answer_ok for gs, j in zip(grades, picks)) / len(problems)
    labels, scores = [], []
    for gs, r in zip(grades, results):
        for g, t in zip(gs, r.trajectories):
            k = min(len(g.prefix_ok), len(t.step_scores))
            labels.extend(int(v) for v in g.prefix_ok[:k])
            scores.extend(t.step_scores[:k])
    out["prm_step_auc"] = auc(scores, labels)
    out["prm_steps_graded"] = len(labels)
    return out


def plot_accuracy(cmp: Comparison, path: str | Path) -> Path:
    """Accuracy vs N, one line per method (single sample as a dashed baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    base = cmp.row("single sample", 1).accuracy
    for method in dict.fromkeys(r.method for r in cmp.rows if r.method != "single sample"):
        pts = [(1, base)] + sorted((r.n, r.accuracy) for r in cmp.rows if r.method == method)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=method)
    ax.axhline(100 * base, ls="--", color="grey", label="single sample")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (samples / beams / particles)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"sgl-tts tiny models, {cmp.problems} test problems, T={cmp.temperature}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def measure(generator: str | Path | None = None, prm: str | Path | None = None, *, count: int = task.TEST_SIZE,
            ns: Sequence[int] = (1, 4, 16), beam_width: int = DEFAULT_WIDTH, temperature: float = DEFAULT_TEMPERATURE,
            aggregation: str = DEFAULT_AGGREGATION, seed: int = 0, layout=None) -> Comparison:
    """:func:`compare` on the first ``count`` test problems, with the generator and the PRM folders
    (default: the shipped ones) on :class:`~sgl_tts.LocalBackend` engines laid out as ``layout``
    (default: as :func:`~sgl_tts.backends.layout.choose_engine` lays best-of-N out with ``count`` in
    flight) (``sgl-tts quality``)."""
    from sgl_tts import LocalBackend
    from sgl_tts.backends.layout import choose_engine
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    layout = layout or choose_engine("auto", tree_search=False, in_flight=count)
    gen = LocalBackend(generator or shipped_model("generator"), seed=seed, **layout.options())
    try:
        prm_backend = LocalBackend(prm or shipped_model("prm"), seed=seed, **layout.prm_options())
    except BaseException:
        gen.shutdown()
        raise
    try:
        return compare(gen, StepTagPRM(prm_backend), task.test_split()[:count], ns=ns, beam_width=beam_width,
                       temperature=temperature, aggregation=aggregation, seed=seed)
    finally:
        gen.shutdown()
        prm_backend.shutdown()
