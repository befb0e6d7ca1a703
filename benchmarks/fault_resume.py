"""Benchmark: faults while many searches are in flight (issue 30, deliverable 6).

A real ``sgl-tts run`` of ``--problems`` problems with ``--in-flight`` of them in flight runs against
live CPU SGLang servers (the shipped tiny generator with the sgl-tts plugin, and the tiny PRM), started
here with :class:`sgl_tts.launch.live_servers.LiveServers`. The generator is SIGKILLed (its whole process
group, :meth:`LiveServers.kill`) ``--kills`` times at seeded random points — once the output file
holds a randomly drawn number of finished lines — and restarted on the same port; after each kill
the same ``sgl-tts run`` command is run again, until a run completes. Then it checks:

* every killed run exits by itself within ``--exit-timeout`` seconds with exit code 1 and exactly
  one ``sgl-tts run: error:`` line (no traceback), and leaves nothing on the PRM server;
* every line of the output JSONL is valid JSON, every problem id is in it exactly once (0 lost,
  0 duplicated), and each run kept the lines the runs before it wrote, byte for byte;
* the final run exits 0, reports resuming, and its ``<output>.summary.json`` counts every problem;
* afterwards neither server has a request running or waiting (:func:`settled_loads`).

The driver watches the output file's line count every ``--poll`` seconds (0.5 by default) to decide
when to kill: a modest-interval poll in the driver, not in the code under test. It prints the report
as JSON and writes it to ``--report``; the exit status is 0 when every check passed.

    ./dev.sh run python benchmarks/fault_resume.py --problems 1000 --in-flight 32 --kills 3 --seed 0 \\
        --report /tmp/fault_resume.json

:func:`fault_run` is the driver itself; ``tests/test_live_fault_resume.py`` runs a short variant.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
ERROR_PREFIX = "sgl-tts run: error:"
SLOW_EXIT = 10.0  # s after the kill: a killed run still running then has its stacks taken (py-spy)


@dataclasses.dataclass
class RunAttempt:
    """One ``sgl-tts run`` process: what it found, what happened to it, how it ended."""

    lines_at_start: int
    kill_at: int | None            # the drawn line count at which the generator is killed (None: no kill)
    killed_at_lines: int | None = None   # lines in the output when the generator was killed
    killed_after_s: float | None = None  # seconds from this run's start to the kill
    exit_code: int | None = None
    exit_seconds: float | None = None    # from the kill (or the start, without one) to the exit
    lines_at_end: int = 0
    error_lines: list[str] = dataclasses.field(default_factory=list)
    traceback: bool = False
    stderr_lines: int = 0          # non-empty stderr lines in all (logged per-problem failures included)
    stderr_tail: str = ""
    stdout_tail: str = ""
    resuming: str | None = None    # its "resuming OUTPUT: k of N problems already done" line
    prefix_kept: bool = True       # the output it started from is still the start of the file
    prm_leftover: int | None = None  # PRM requests running + waiting once the (killed) run exited
    slow_exit_stacks: str | None = None  # py-spy's dump of a killed run still running SLOW_EXIT s after the kill


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def draw_kill_points(problems: int, in_flight: int, kills: int, seed: int) -> list[int]:
    """``kills`` distinct line counts, sorted, at which to kill the generator: after at least one
    finished problem and while at least ``in_flight`` problems are still to finish, so every kill
    cuts a full set of searches in flight."""
    lo, hi = 1, problems - in_flight
    if kills and hi - lo + 1 < kills:
        raise ValueError(f"{problems} problems with {in_flight} in flight leave no room for {kills} kills; "
                         f"give more problems")
    return sorted(random.Random(seed).sample(range(lo, hi + 1), kills))


def run_command(problems_path: Path, output: Path, generator: str, prm: str, *, program: str, n: int,
                beam_width: int, in_flight: int, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "sgl_tts.cli", "run", "--problems", str(problems_path), "--output", str(output),
           "--program", program, "--n", str(n), "--in-flight", str(in_flight), "--seed", str(seed),
           "--generator", generator, "--prm", prm, "--no-progress"]
    if program in ("beam_search", "dvts", "mcts"):
        cmd += ["--beam-width", str(beam_width)]
    return cmd


def write_problems(workdir: Path, problems: int) -> tuple[Path, list[str]]:
    """The scenario's dataset: the fixed test split first, then further distinct problems from a seed
    of their own; its path and the problems' ids in order."""
    from sgl_tts.tiny import task

    path = workdir / "problems.jsonl"
    drawn = task.test_split()[:problems]
    if len(drawn) < problems:
        drawn += task.generate(problems - len(drawn), "fault-resume", exclude={p.question for p in drawn})
    task.write_jsonl(drawn, path)
    return path, [json.loads(line)["id"] for line in path.read_text().splitlines()]


def run_once(cmd: list[str], output: Path, att: RunAttempt, servers, generator: str, *, number: int, poll: float,
             exit_timeout: float, run_timeout: float, log) -> bool:
    """One ``sgl-tts run``: SIGKILL the generator once the output has ``att.kill_at`` lines (if set),
    wait for the run to exit and fill ``att`` in. True when the generator was killed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    before = output.read_bytes() if output.exists() else b""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # drain both pipes in the background: a chatty run must not block on a full pipe
    out_buf: list[str] = []
    err_buf: list[str] = []
    readers = [_drain(proc.stdout, out_buf), _drain(proc.stderr, err_buf)]
    killed_at = None
    if att.kill_at is not None:
        while proc.poll() is None and time.perf_counter() - started < run_timeout:
            if count_lines(output) >= att.kill_at:
                break
            time.sleep(poll)   # the driver's watch on the output file (see the module docstring)
        if proc.poll() is None and count_lines(output) >= att.kill_at:
            servers.kill(generator)              # SIGKILL, the whole process group
            killed_at = time.perf_counter()
            att.killed_at_lines = count_lines(output)
            att.killed_after_s = round(killed_at - started, 2)
            log(f"fault-resume: run {number}: generator SIGKILLed at {att.killed_at_lines} finished lines "
                f"({att.killed_after_s} s into the run)")
    try:
        if killed_at is not None:
            att.slow_exit_stacks = _stacks_if_slow(proc, min(SLOW_EXIT, exit_timeout))
        proc.wait(timeout=exit_timeout - (time.perf_counter() - killed_at) if killed_at is not None else
                  max(1.0, run_timeout - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        log(f"fault-resume: run {number} did not exit in time: killing it")
        proc.kill()
        proc.wait()
    for r in readers:
        r.join(timeout=10)
    stderr, stdout = "".join(err_buf), "".join(out_buf)
    att.exit_code = proc.returncode
    att.exit_seconds = round(time.perf_counter() - (killed_at or started), 2)
    att.lines_at_end = count_lines(output)
    att.error_lines = [ln for ln in stderr.splitlines() if ln.startswith(ERROR_PREFIX)]
    att.traceback = "Traceback" in stderr
    att.stderr_lines = sum(1 for ln in stderr.splitlines() if ln.strip())
    att.stderr_tail, att.stdout_tail = stderr[-3000:], stdout[-3000:]
    att.resuming = next((ln for ln in stdout.splitlines() if ln.startswith("resuming ")), None)
    after = output.read_bytes() if output.exists() else b""
    att.prefix_kept = after.startswith(before)
    return killed_at is not None


def check_output(output: Path, ids: list[str]) -> dict:
    """What the output holds: its lines, problems lost or written twice, ids it should not have,
    corrupt or torn lines, and the summary's counts."""
    raw = output.read_bytes() if output.exists() else b""
    text_lines = raw.decode("utf-8", errors="replace").split("\n")
    torn = text_lines.pop() != ""          # bytes after the last newline
    corrupt, seen = 0, collections.Counter()
    for line in text_lines:
        try:
            rec = json.loads(line)
            seen[rec["id"]] += 1
        except (json.JSONDecodeError, KeyError, TypeError):
            corrupt += 1
    summary_path = output.with_suffix(".summary.json")
    summary = json.loads(summary_path.read_text())["summary"] if summary_path.exists() else None
    return {"lines": len(text_lines), "lost": sum(1 for i in ids if seen[i] == 0),
            "duplicated": sum(c - 1 for c in seen.values() if c > 1),
            "unknown_ids": sorted(set(seen) - set(ids)), "corrupt": corrupt + torn,
            "summary_problems": summary and summary["problems"], "summary_graded": summary and summary["graded"],
            "accuracy": summary and summary["accuracy"]}


def fault_run(servers, generator: str, prm_url: str, workdir: Path, *, problems: int, in_flight: int,
              kills: int, seed: int, program: str = "best_of_n", n: int = 4, beam_width: int = 2,
              poll: float = 0.5, exit_timeout: float = 120.0, run_timeout: float = 7200.0,
              log=print) -> dict:
    """Run the fault scenario (module docstring) against ``servers`` (a :class:`LiveServers` whose
    server ``generator`` is killed and restarted) and the PRM at ``prm_url``; return the raw facts
    (runs, output lines, checks). Raises nothing for a failed check: the caller judges the report."""
    from sgl_tts.launch.live_servers import settled_loads

    workdir.mkdir(parents=True, exist_ok=True)
    problems_path, ids = write_problems(workdir, problems)
    output = workdir / "run.jsonl"
    for stale in (output, output.with_suffix(".summary.json")):
        stale.unlink(missing_ok=True)
    gen_url = servers.url(generator)
    cmd = run_command(problems_path, output, gen_url, prm_url, program=program, n=n, beam_width=beam_width,
                      in_flight=in_flight, seed=seed)
    points = collections.deque(draw_kill_points(problems, in_flight, kills, seed))
    log(f"fault-resume: {problems} problems, {in_flight} in flight, kill points (finished lines) {list(points)}")
    attempts: list[RunAttempt] = []
    t0 = time.perf_counter()
    while len(attempts) <= kills + 1:
        lines_at_start = count_lines(output)
        # a point the output already passed (the previous run overshot it) fires at the next line
        att = RunAttempt(lines_at_start=lines_at_start, kill_at=max(points[0], lines_at_start + 1) if points else None)
        attempts.append(att)
        killed = run_once(cmd, output, att, servers, generator, number=len(attempts), poll=poll, exit_timeout=exit_timeout,
                          run_timeout=run_timeout, log=log)
        log(f"fault-resume: run {len(attempts)} exited {att.exit_code} after {att.exit_seconds} s"
            f"{' from the kill' if killed else ''}; {att.lines_at_end} lines"
            + (f"; {att.error_lines[0][:200]}" if att.error_lines else ""))
        if att.slow_exit_stacks:
            log(f"fault-resume: run {len(attempts)} still running {SLOW_EXIT:g} s after the kill; its stacks:\n"
                + att.slow_exit_stacks)
        if not killed:
            break
        points.popleft()
        att.prm_leftover = _leftover(settled_loads(prm_url, timeout=10))
        restart = time.perf_counter()
        servers.start(generator)                   # back on the same port
        if att.exit_code != 1:
            log("fault-resume: a killed run did not exit with code 1: stopping")
            break
        log(f"fault-resume: generator restarted ({time.perf_counter() - restart:.1f} s)")
    else:
        log("fault-resume: giving up: more runs than kills + 1")
    leftover = {"generator": _leftover(settled_loads(gen_url)), "prm": _leftover(settled_loads(prm_url))}
    return {
        "problems": problems, "in_flight": in_flight, "program": program, "n": n,
        **({"beam_width": beam_width} if program in ("beam_search", "dvts", "mcts") else {}),
        "seed": seed, "kills_requested": kills,
        "kills": sum(a.killed_at_lines is not None for a in attempts), "reruns": len(attempts) - 1,
        **check_output(output, ids), "leftover_requests": leftover, "seconds": round(time.perf_counter() - t0, 1),
        "runs": [dataclasses.asdict(a) for a in attempts], "run_command": " ".join(cmd),
    }


def _stacks_if_slow(proc: subprocess.Popen, after: float) -> str | None:
    """Every thread's stack in ``proc``, Python and native (``py-spy dump --native``), if it is still
    running ``after`` seconds on, else None: what a killed run that is slow to exit is waiting for."""
    try:
        proc.wait(timeout=after)
        return None
    except subprocess.TimeoutExpired:
        pass
    try:
        spy = Path(sys.executable).with_name("py-spy")
        dump = subprocess.run([str(spy) if spy.exists() else "py-spy", "dump", "--native", "--pid", str(proc.pid)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy dump failed: {exc!r}"
    if proc.poll() is not None:   # it exited while py-spy looked
        return None
    return (dump.stdout + dump.stderr)[-12000:]


def _drain(stream, buf: list[str]):
    import threading

    def pump():
        for chunk in iter(lambda: stream.read(4096), ""):
            buf.append(chunk)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def _leftover(ld: dict) -> int:
    return int(ld["num_running_reqs"]) + int(ld["num_waiting_reqs"])


def failed_checks(report: dict, exit_timeout: float) -> list[str]:
    """Every property the scenario must have that ``report`` lacks (empty: all hold)."""
    bad = []
    runs = report["runs"]
    if report["kills"] != report["kills_requested"]:
        bad.append(f"{report['kills']} kills happened, {report['kills_requested']} were asked for")
    for i, r in enumerate(runs[:-1], 1):
        if r["killed_at_lines"] is None:
            bad.append(f"run {i} was not killed but did not complete")
            continue
        if r["exit_code"] != 1 or r["exit_seconds"] > exit_timeout:
            bad.append(f"killed run {i} exited {r['exit_code']} after {r['exit_seconds']} s")
        if len(r["error_lines"]) != 1 or r["traceback"]:
            bad.append(f"killed run {i}: {len(r['error_lines'])} error lines, traceback {r['traceback']}")
        if r["prm_leftover"]:
            bad.append(f"killed run {i} left {r['prm_leftover']} requests on the PRM")
    for i, r in enumerate(runs, 1):
        if not r["prefix_kept"]:
            bad.append(f"run {i} changed lines written before it")
    last = runs[-1]
    if last["killed_at_lines"] is not None or last["exit_code"] != 0:
        bad.append(f"the last run exited {last['exit_code']} (killed: {last['killed_at_lines'] is not None})")
    elif len(runs) > 1 and not (last["resuming"] or "").endswith(
            f": {last['lines_at_start']} of {report['problems']} problems already done"):
        bad.append(f"the last run did not report resuming from {last['lines_at_start']} lines: {last['resuming']!r}")
    for key in ("lost", "duplicated", "corrupt"):
        if report[key]:
            bad.append(f"{key}: {report[key]}")
    if report["unknown_ids"]:
        bad.append(f"ids not in the dataset: {report['unknown_ids'][:5]}")
    if report["lines"] != report["problems"] or report["summary_problems"] != report["problems"] \
            or report["summary_graded"] != report["problems"]:
        bad.append(f"{report['lines']} lines, summary counts {report['summary_problems']} problems "
                   f"({report['summary_graded']} graded) of {report['problems']}")
    if any(report["leftover_requests"].values()):
        bad.append(f"requests left on the servers: {report['leftover_requests']}")
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=1000)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="kill points and the run's sampling seed")
    ap.add_argument("--program", default="best_of_n", choices=("best_of_n", "beam_search", "dvts"))
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--beam-width", type=int, default=2)
    ap.add_argument("--kv-bytes", type=int, default=256 << 20, help="each server's KV pool")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the output file")
    ap.add_argument("--exit-timeout", type=float, default=120.0,
                    help="seconds a run may take to exit once its generator is killed")
    ap.add_argument("--workdir", default=None, help="servers' logs, problems and output (default: a temp dir)")
    ap.add_argument("--report", default="/tmp/fault_resume.json")
    args = ap.parse_args(argv)

    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.machine import describe
    from sgl_tts.models import shipped_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault-resume-"))
    specs = {"generator": LiveServer(str(shipped_model("generator")), policy="prefix-aware", kv_bytes=args.kv_bytes,
                                     extra=("--tts-seeded-sampling",)),
             "prm": LiveServer(str(shipped_model("prm")), kv_bytes=args.kv_bytes)}
    t0 = time.perf_counter()
    with LiveServers(specs, workdir / "servers") as servers:
        servers.url("generator")
        prm_url = servers.url("prm")
        print(f"fault-resume: servers up in {time.perf_counter() - t0:.0f} s (logs: {workdir / 'servers'})", flush=True)
        report = fault_run(servers, "generator", prm_url, workdir, problems=args.problems, in_flight=args.in_flight,
                           kills=args.kills, seed=args.seed, program=args.program, n=args.n,
                           beam_width=args.beam_width, poll=args.poll, exit_timeout=args.exit_timeout,
                           log=lambda msg: print(msg, flush=True))
    (workdir / "raw_report.json").write_text(json.dumps(report, indent=1) + "\n")   # stderr tails included
    bad = failed_checks(report, args.exit_timeout)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "ok": not bad, "failed_checks": bad,
        **{k: report[k] for k in ("problems", "in_flight", "program", "n", "seed", "kills", "reruns", "lost",
                                  "duplicated", "corrupt", "leftover_requests", "seconds")},
        "problems_per_s": round(report["problems"] / report["seconds"], 2) if report["seconds"] else None,
        "killed_runs": [{k: r[k] for k in ("lines_at_start", "killed_at_lines", "killed_after_s", "exit_code",
                                            "exit_seconds", "lines_at_end", "prm_leftover", "stderr_lines")} | {
                             "error": r["error_lines"][0] if r["error_lines"] else None}
                        for r in report["runs"] if r["killed_at_lines"] is not None],
        "final_run": {k: report["runs"][-1][k] for k in ("lines_at_start", "exit_code", "exit_seconds")},
        "summary": {"problems": report["summary_problems"], "graded": report["summary_graded"],
                    "accuracy": report["accuracy"]},
        "machine": describe(), "date": dt.date.today().isoformat(), "revision": rev,
        "command": "./dev.sh run python benchmarks/fault_resume.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "run_command": report["run_command"],
    }
    text = json.dumps(record, indent=1)
    print(text)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(text + "\n")
    for b in bad:
        print(f"fault-resume: FAILED: {b}", file=sys.stderr)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
