"""``sgl-tts load``: many searches arriving at once, as a server sees them (seed 004 §5, Fig. 7-8).

Problems arrive with Poisson arrivals at each given rate; every *side* serves the same problems at the
same arrival times against the same generator and PRM servers, one side and rate after another:

- ``beam_search``: beam search with positive early exit (``accept_threshold``), at most M jobs at once;
- ``mcts``: vanilla MCTS, one rollout at a time per job, no early exit, at most M jobs at once;
- ``mcts+pe``: + positive early exit;
- ``mcts+pe+ne``: + negative early exit;
- ``mcts+pe+ne+boost``: + parallelism-degree control and boosting (:mod:`sgl_tts.mcts.jobs`):
  at most M rollouts over all jobs, split by Algorithm 1; boosted jobs' requests go in the plugin's
  ``boosted`` class.

Per side and rate it reports end-to-end latency (arrival to answer, queueing included) p50 and p99,
throughput (jobs finished over the time from the first arrival to the last answer) and accuracy with
a binomial tolerance (two standard errors). Every side samples the same texts (seeds belong to tree
positions, and the generator it starts honours them: ``--tts-seeded-sampling``; a ``--generator-url``
must run with it too), so both servers' prefix caches are flushed before each block. Each finished (side, rate) block is appended to a JSONL
file at once; a rerun with the same settings skips the blocks already there.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sgl_tts.bench.arrivals import poisson_arrivals
from sgl_tts.experiment import quantile
from sgl_tts.records import RecordStore

logger = logging.getLogger(__name__)

SIDES = ("beam_search", "mcts", "mcts+pe", "mcts+pe+ne", "mcts+pe+ne+boost")
VERIFIERS = ("prm", "checker")


@dataclasses.dataclass(frozen=True)
class LoadSettings:
    """One load run's settings (every side shares them).

    Attributes:
        rates: arrival rates, problems per second.
        problems: problems per side and rate (the embedded test split's first ones).
        max_jobs: M: jobs running at once (and, with boosting, rollouts in flight over all jobs).
        rollouts: MCTS rollout budget per problem.
        expansion_width: MCTS children per expansion.
        max_depth: most steps of a trajectory.
        step_tokens: token limit of a step.
        threshold: acceptance threshold (both early exits; beam search's positive exit).
        aggregation: trajectory score (``min`` or ``prod``: the negative exit needs one of them).
        first_step_cutoff: MCTS selective futility check (``None``: off).
        beams, beam_width: beam search's N and M.
        temperature: sampling temperature.
        seed: sampling and arrival seed.
        sides: which sides to run, in order.
        workload: the problems, in arrival order: a split of :func:`sgl_tts.tiny.task.split`
            (``test``, ``hard``, ``mixed``: the two alternating) or a JSONL file ``sgl-tts workload`` wrote.
        verifier: ``prm`` (the step-tag PRM on its server) or ``checker`` (the task's checker as a PRM,
            :class:`sgl_tts.tiny.checker_prm.CheckerPRM`: a what-if with a verifier that sees every
            mistake; no PRM server is started).
    """

    rates: tuple[float, ...] = (0.25, 0.5, 1.0)
    problems: int = 24
    max_jobs: int = 4
    rollouts: int = 8
    expansion_width: int = 3
    max_depth: int = 10
    step_tokens: int = 48
    threshold: float = 0.8
    aggregation: str = "min"
    first_step_cutoff: float | None = None
    beams: int = 8
    beam_width: int = 2
    temperature: float = 0.8
    seed: int = 0
    sides: tuple[str, ...] = SIDES
    workload: str = "test"
    verifier: str = "prm"

    def __post_init__(self):
        from sgl_tts.tiny import task

        if self.verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {', '.join(VERIFIERS)}, got {self.verifier!r}")
        if self.workload not in task.SPLITS and not self.workload.endswith(".jsonl"):
            raise ValueError(f"workload must be one of {', '.join(task.SPLITS)} or a .jsonl file, got "
                             f"{self.workload!r}")
        bad = [s for s in self.sides if s not in SIDES]
        if bad:
            raise ValueError(f"unknown side {bad[0]!r}; choose from {', '.join(SIDES)}")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.problems < 1 or self.max_jobs < 1:
            raise ValueError("problems and max_jobs must be >= 1")
        if self.aggregation not in ("min", "prod"):
            raise ValueError(f"aggregation must be min or prod (the negative early exit needs one), got "
                             f"{self.aggregation!r}")

    def key(self) -> str:
        """What a record must match to be reused (everything but the sides and rates to run)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("sides", "rates")}
        for name, default in (("workload", "test"), ("verifier", "prm")):
            if fields[name] == default:
                del fields[name]   # the runs recorded before these settings existed keep their key
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def load_problems(s: LoadSettings) -> list:
    """The first ``s.problems`` problems of the settings' workload."""
    from sgl_tts.tiny import task

    if s.workload in task.SPLITS:
        return task.split(s.workload, s.problems)
    probs = task.read_jsonl(s.workload)
    if len(probs) < s.problems:
        raise ValueError(f"{s.workload} holds {len(probs)} problems, the run asks for {s.problems}")
    return probs[:s.problems]


def side_config(side: str, s: LoadSettings):
    """``sgl-tts run``'s settings for one side's program (its arguments come from the registry)."""
    from sgl_tts.experiment import RunConfig, RunError

    common = dict(max_depth=s.max_depth, step_tokens=[s.step_tokens], temperature=s.temperature,
                  aggregation=s.aggregation, seed=s.seed, progress=False)
    if side == "beam_search":
        cfg = RunConfig(program="beam_search", n=s.beams, beam_width=s.beam_width, accept_threshold=s.threshold,
                        **common)
    else:
        negative = "+ne" in side
        cfg = RunConfig(program="mcts", n=s.rollouts, beam_width=s.expansion_width, threshold=s.threshold,
                        positive_exit="+pe" in side, negative_exit=negative,
                        first_step_cutoff=s.first_step_cutoff if negative else None, **common)
    try:
        cfg.validate()
    except RunError as exc:
        raise ValueError(f"side {side}: {exc}") from None
    return cfg


def side_program(side: str, s: LoadSettings) -> tuple[Any, dict[str, Any], bool]:
    """The program, its options (but the question and the PRM) and whether the scheduler boosts, for
    one side."""
    from sgl_tts.experiment import program_function

    cfg = side_config(side, s)
    options = {k: v for k, v in cfg.program_arguments("", None).items() if k not in ("question", "prm")}
    return program_function(cfg.program), options, side.endswith("+boost")


def run_block(side: str, rate: float, problems: Sequence[Any], generator_url: str, prm, s: LoadSettings,
              on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Serve ``problems`` arriving at ``rate`` on one side; one record per problem."""
    from sgl_tts.backends import SGLangEndpoint
    from sgl_tts.mcts.jobs import BoostPolicy, JobScheduler

    program, opts, boosting = side_program(side, s)
    gen = SGLangEndpoint(generator_url)

    def boost(group: str) -> None:
        gen.set_class(group, "boosted")

    sched = JobScheduler(BoostPolicy(max_rollouts=s.max_jobs, boosting=boosting), s.threshold,
                         boost=boost if boosting else None)
    arrivals = poisson_arrivals(rate, len(problems), s.seed)
    t0 = time.monotonic()
    records: list[dict | None] = [None] * len(problems)
    errors: list[BaseException] = []
    by_id: dict[int, int] = {}

    def serve(job, index: int) -> None:
        p = problems[index]
        kwargs = dict(opts, question=p.question, prm=prm, search_group=job.group)
        if side != "beam_search":
            kwargs["control"] = sched.control(job)
        try:
            res = program.run(backend=gen, **kwargs).ret_value
            if res is None:
                raise RuntimeError(f"{side} on problem {index} returned nothing")
        except BaseException as exc:   # recorded and raised after the block: nothing else is lost
            errors.append(exc)
            sched.finish(job)
            return
        sched.finish(job)
        tree = res.tree
        rec = {"side": side, "rate": rate, "problem": index, "key": s.key(),
               "level": getattr(p, "level", None), "hard": _is_hard(p),
               "arrival": round(job.arrival - t0, 4), "started": round(job.started - t0, 4),
               "finished": round(job.finished - t0, 4), "latency": round(job.finished - job.arrival, 4),
               "answer": res.answer, "reference": None if p.answer is None else str(p.answer),
               "correct": p.answer is not None and res.answer == str(p.answer),
               "tokens": res.tokens_generated, "exit_reason": res.exit_reason, "boosted": job.boosted,
               "cancelled": len(tree.cancelled) if tree is not None else 0,
               # how far the search got: rollouts returned, nodes made, the deepest node
               "rollouts": len(tree.returned) if tree is not None else None,
               "nodes": len(tree.nodes) - 1 if tree is not None else None,
               "depth": max(n.depth for n in tree.nodes) if tree is not None else None}
        records[index] = rec
        if on_done is not None:
            on_done(rec)

    threads: list[threading.Thread] = []
    submitted = 0
    while submitted < len(problems) or sched.pending or sched.running:
        seen = sched.changed.seen()   # before looking: a finish after this ends the wait below
        now = time.monotonic() - t0
        while submitted < len(problems) and arrivals[submitted] <= now:
            job = sched.submit(f"load-{side}-{rate}-{submitted}-{s.seed}", arrival=t0 + arrivals[submitted])
            by_id[job.id] = submitted
            submitted += 1
        for job in sched.admit():
            th = threading.Thread(target=serve, args=(job, by_id[job.id]), daemon=True)
            th.start()
            threads.append(th)
        if submitted < len(problems) or sched.pending or sched.running:
            # asleep until the next arrival or a finished job (which may free an admission slot)
            nxt = arrivals[submitted] - (time.monotonic() - t0) if submitted < len(problems) else None
            sched.changed.wait(seen, None if nxt is None else max(0.0, nxt))
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [r for r in records if r is not None]


def _is_hard(problem) -> bool:
    from sgl_tts.tiny import task

    return isinstance(problem, task.Problem) and task.is_hard(problem)


# ------------------------------------------------------------------------------------- report
@dataclasses.dataclass(frozen=True)
class PartRow:
    """One side and rate on one part of a mixed stream (``hard`` or ``test`` problems)."""

    side: str
    rate: float
    part: str
    jobs: int
    accuracy: float
    tolerance: float
    tokens: float
    exits: dict[str, int]
    futile_depth: float | None    # mean deepest node of the searches the negative exit stopped
    futile_rollouts: float | None  # mean rollouts they had returned
    accepted_wrong: int = 0       # searches the positive exit accepted with a wrong answer


@dataclasses.dataclass(frozen=True)
class LoadRow:
    side: str
    rate: float
    jobs: int
    p50: float
    p99: float
    throughput: float        # jobs per second
    accuracy: float
    tolerance: float         # two binomial standard errors
    tokens: float            # mean tokens generated per job
    exits: dict[str, int]
    offered: float | None = None   # jobs over the span of their arrivals: the rate the run really offered

    @property
    def sustained(self) -> bool:
        """Kept up with the arrivals: finished at least 90% as fast as they came. "As they came" is the
        rate the arrivals of this run offered (a few dozen Poisson arrivals can span 20% more or less
        than jobs / rate, and no server can finish faster than its jobs arrive); the nominal rate when
        there is a single job."""
        return self.throughput >= 0.9 * (self.offered or self.rate)


def _tolerance(acc: float, n: int) -> float:
    """Two binomial standard errors."""
    return 2 * math.sqrt(max(acc * (1 - acc), 1e-12) / n)


def summarize_parts(records: Sequence[dict]) -> list[PartRow]:
    """Per side, rate and part (``hard``/``test``; records without ``hard`` are test problems)."""
    blocks: dict[tuple[str, float, str], list[dict]] = collections.defaultdict(list)
    for r in records:
        blocks[(r["side"], r["rate"], "hard" if r.get("hard") else "test")].append(r)
    rows = []
    for (side, rate, part), recs in blocks.items():
        acc = sum(r["correct"] for r in recs) / len(recs)
        futile = [r for r in recs if r["exit_reason"] == "futile" and r.get("depth") is not None]
        rows.append(PartRow(side, rate, part, len(recs), acc, _tolerance(acc, len(recs)),
                            sum(r["tokens"] for r in recs) / len(recs),
                            dict(collections.Counter(r["exit_reason"] or "completed" for r in recs)),
                            sum(r["depth"] for r in futile) / len(futile) if futile else None,
                            sum(r["rollouts"] for r in futile) / len(futile) if futile else None,
                            sum(r["exit_reason"] == "accepted" and not r["correct"] for r in recs)))
    order = {s: i for i, s in enumerate(SIDES)}
    return sorted(rows, key=lambda r: (r.rate, order[r.side], r.part))


def summarize(records: Sequence[dict]) -> list[LoadRow]:
    blocks: dict[tuple[str, float], list[dict]] = collections.defaultdict(list)
    for r in records:
        blocks[(r["side"], r["rate"])].append(r)
    rows = []
    for (side, rate), recs in blocks.items():
        lat = [r["latency"] for r in recs]
        span = max(r["finished"] for r in recs) - min(r["arrival"] for r in recs)
        arriving = max(r["arrival"] for r in recs) - min(r["arrival"] for r in recs)
        acc = sum(r["correct"] for r in recs) / len(recs)
        rows.append(LoadRow(side, rate, len(recs), quantile(lat, 0.5), quantile(lat, 0.99),
                            len(recs) / span if span > 0 else 0.0, acc, _tolerance(acc, len(recs)),
                            sum(r["tokens"] for r in recs) / len(recs),
                            dict(collections.Counter(r["exit_reason"] or "completed" for r in recs)),
                            len(recs) / arriving if arriving > 0 else None))
    order = {s: i for i, s in enumerate(SIDES)}
    return sorted(rows, key=lambda r: (r.rate, order[r.side]))


def compare_at(rows: Sequence[LoadRow], rate: float, base: str, full: str = "mcts+pe+ne+boost") -> dict | None:
    """``full`` against ``base`` at one rate: p99 lower, throughput higher, accuracy within tolerance."""
    b = next((r for r in rows if r.side == base and r.rate == rate), None)
    f = next((r for r in rows if r.side == full and r.rate == rate), None)
    if b is None or f is None:
        return None
    return {"rate": rate, "base": base, "p99_lower": b.p99 / f.p99 if f.p99 else None,
            "throughput_higher": f.throughput / b.throughput if b.throughput else None,
            "accuracy": (b.accuracy, f.accuracy),
            "accuracy_within_tolerance": f.accuracy >= b.accuracy - max(b.tolerance, f.tolerance)}


def headline(rows: Sequence[LoadRow], base: str = "mcts", full: str = "mcts+pe+ne+boost") -> dict | None:
    """The full system against vanilla MCTS at the highest rate vanilla sustains (else its lowest)."""
    base_rows = [r for r in rows if r.side == base]
    if not base_rows:
        return None
    held = [r for r in base_rows if r.sustained]
    b = max(held, key=lambda r: r.rate) if held else min(base_rows, key=lambda r: r.rate)
    f = next((r for r in rows if r.side == full and r.rate == b.rate), None)
    if f is None:
        return None
    return {"rate": b.rate, "sustained": b.sustained, "p99_lower": b.p99 / f.p99 if f.p99 else None,
            "throughput_higher": f.throughput / b.throughput if b.throughput else None,
            "accuracy": (b.accuracy, f.accuracy),
            "accuracy_within_tolerance": f.accuracy >= b.accuracy - max(b.tolerance, f.tolerance)}


def format_report(rows: Sequence[LoadRow]) -> str:
    lines = ["| rate (/s) | side | jobs | p50 (s) | p99 (s) | offered (/s) | throughput (/s) | accuracy | tokens/job | exits |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        exits = ", ".join(f"{k} {v}" for k, v in sorted(r.exits.items()))
        offered = "" if r.offered is None else f"{r.offered:.3f}"
        lines.append(f"| {r.rate:g} | {r.side} | {r.jobs} | {r.p50:.1f} | {r.p99:.1f} | {offered} | {r.throughput:.3f}"
                     f"{'' if r.sustained else ' (not sustained)'} | {100 * r.accuracy:.0f}% ± "
                     f"{100 * r.tolerance:.0f} | {r.tokens:.0f} | {exits} |")
    h = headline(rows)
    if h is not None:
        lines.append("")
        lines.append(f"At {h['rate']:g}/s ({'the highest rate vanilla MCTS sustains' if h['sustained'] else 'vanilla MCTS sustains none; its lowest rate'}): "
                     f"p99 {h['p99_lower']:.2f}x lower, throughput {h['throughput_higher']:.2f}x higher with "
                     f"PE+NE+boosting; accuracy {100 * h['accuracy'][0]:.0f}% -> {100 * h['accuracy'][1]:.0f}% "
                     f"({'within' if h['accuracy_within_tolerance'] else 'OUTSIDE'} the binomial tolerance)")
    for rate in sorted({r.rate for r in rows}):
        c = compare_at(rows, rate, "mcts+pe")
        if c is not None and c["p99_lower"] and c["throughput_higher"]:
            lines.append(f"At {rate:g}/s against PE alone: p99 {c['p99_lower']:.2f}x lower, throughput "
                         f"{c['throughput_higher']:.2f}x higher; accuracy {100 * c['accuracy'][0]:.0f}% -> "
                         f"{100 * c['accuracy'][1]:.0f}% ({'within' if c['accuracy_within_tolerance'] else 'OUTSIDE'} "
                         f"the binomial tolerance)")
    return "\n".join(lines)


def format_parts(parts: Sequence[PartRow]) -> str:
    """The mixed stream's two parts side by side: accuracy, tokens, exits, how many searches the positive
    exit accepted with a wrong answer, and where the negative exit stopped searches (how deep their
    trees were and how many rollouts had returned)."""
    lines = ["| rate (/s) | side | part | jobs | accuracy | tokens/job | exits | accepted wrong | futile at depth | rollouts before futile |",
             "| ---: | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in parts:
        exits = ", ".join(f"{k} {v}" for k, v in sorted(r.exits.items()))
        fd = "" if r.futile_depth is None else f"{r.futile_depth:.1f}"
        fr = "" if r.futile_rollouts is None else f"{r.futile_rollouts:.1f}"
        lines.append(f"| {r.rate:g} | {r.side} | {r.part} | {r.jobs} | {100 * r.accuracy:.0f}% ± "
                     f"{100 * r.tolerance:.0f} | {r.tokens:.0f} | {exits} | {r.accepted_wrong} | {fd} | {fr} |")
    return "\n".join(lines)


def plot_report(rows: Sequence[LoadRow], path: str | Path, title: str = "") -> Path:
    """p50 (solid) and p99 (dashed) latency against arrival rate, one colour per side (seed 004 Fig. 7)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, side in enumerate(s for s in SIDES if any(r.side == s for r in rows)):
        pts = sorted((r.rate, r.p50, r.p99) for r in rows if r.side == side)
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=color, label=f"{side} p50")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "--s", color=color, alpha=0.6, label=f"{side} p99")
    ax.set_xlabel("arrival rate (problems / s)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_yscale("log")
    ax.set_title(title or "latency under load")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------- command
def record_store(path: Path, key: str) -> RecordStore:
    """``sgl-tts load``'s (and ``bench-frontend``'s) records file as a :class:`~sgl_tts.records.RecordStore`:
    every record carries its settings' ``key``; the records of other settings stay in the file, unread."""
    return RecordStore(path, key, field="key", other_keys="skip", what="a load or frontend benchmark's records")


def read_records(path: Path, key: str) -> list[dict]:
    """Records already written with the same settings (a torn last line is dropped); a line that is not
    a JSON object is a :class:`~sgl_tts.records.StoreError` (a ``ValueError``) naming it."""
    return record_store(path, key).read()


def server_specs(generator, prm) -> dict:
    """The servers ``run_load`` starts when none is given: the generator with the plugin's prefix-aware
    order and **seeded sampling** (SGLang 0.5.15 drops a request's ``sampling_seed`` on the CPU
    otherwise, and then no two sides sample the same tree: issue 34's first run), and the PRM."""
    from sgl_tts.launch.live_servers import LiveServer

    return {"generator": LiveServer(str(generator), policy="prefix-aware", kv_bytes=256 << 20, seeded_sampling=True),
            "prm": LiveServer(str(prm), kv_bytes=256 << 20)}


def run_load(s: LoadSettings, output: str | Path, *, generator_url: str | None = None, prm_url: str | None = None,
             progress: bool = True) -> list[LoadRow]:
    """Every (side, rate) block not yet in ``output``.jsonl, against the servers given or, for those not
    given, the tiny generator (plugin on) and PRM started here on the CPU; each block is appended as it
    finishes. Writes the table to ``output``.md and the plot to ``output``.png; returns the rows."""
    from tqdm import tqdm

    from sgl_tts.tiny import task
    from sgl_tts.backends import SGLangEndpoint
    from sgl_tts.prm import StepTagPRM

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = record_store(out.with_suffix(".jsonl"), s.key())
    records = store.read()
    done = {(r["side"], r["rate"]) for r in records}
    problems = load_problems(s)
    servers = None
    checker = s.verifier == "checker"
    try:
        gen_url, prm_at = generator_url, prm_url
        if gen_url is None or (prm_at is None and not checker):
            import tempfile

            from sgl_tts.launch.live_servers import LiveServer, LiveServers
            from sgl_tts.models import shipped_model
            specs = {k: v for k, v in server_specs(shipped_model("generator"), shipped_model("prm")).items()
                     if k == "generator" or (prm_at is None and not checker)}
            servers = LiveServers(specs, tempfile.mkdtemp(prefix="sgl-tts-load-"))
            gen_url = gen_url or servers.url("generator")
            if not checker:
                prm_at = prm_at or servers.url("prm")
        if checker:
            from sgl_tts.tiny.checker_prm import CheckerPRM

            prm, flushed = CheckerPRM(problems), (gen_url,)
        else:
            prm, flushed = StepTagPRM(SGLangEndpoint(prm_at)), (gen_url, prm_at)
        blocks = [(side, rate) for rate in s.rates for side in s.sides if (side, rate) not in done]
        bar = tqdm(total=len(blocks) * s.problems, disable=not progress, desc="load", unit="job")
        for side, rate in blocks:
            bar.set_postfix_str(f"{side} @ {rate:g}/s")
            # every side samples the same texts (position seeds): a cache warmed by the block before
            # would serve this one's prefixes for free
            for url in flushed:
                flush_cache(url)
            recs = run_block(side, rate, problems, gen_url, prm, s, on_done=lambda r: bar.update(1))
            for r in recs:
                store.append(r)
            records += recs
        bar.close()
    finally:
        if servers is not None:
            servers.stop_all()
    mine = [r for r in records if r["side"] in s.sides and r["rate"] in s.rates]
    rows = summarize(mine)
    text = format_report(rows) + "\n"
    if any(r.get("hard") for r in mine):
        text += "\nBy part of the stream:\n\n" + format_parts(summarize_parts(mine)) + "\n"
    out.with_suffix(".md").write_text(text)
    stream = ("" if s.workload == "test" else f", {Path(s.workload).stem} problems") + \
        (", checker as PRM" if checker else "")
    plot_report(rows, out.with_suffix(".png"),
                f"MCTS under load, M={s.max_jobs}, {s.rollouts} rollouts{stream} (CPU, tiny models)")
    return rows


__all__ = ["LoadRow", "LoadSettings", "PartRow", "SIDES", "VERIFIERS", "compare_at", "format_parts", "format_report", "headline",
           "load_problems", "plot_report", "summarize_parts",
           "poisson_arrivals", "quantile", "run_block", "run_load", "side_config", "side_program", "summarize"]
