"""Group abort on a live server: how long aborting search groups takes, the plugin's two paths.

Queues ``N`` requests in ``G`` search groups on a real SGLang CPU server (with the sgl-tts plugin,
``sgl_tts.launch.live_servers``), one HTTP ``/generate`` per request, all in flight at once; once every
request is inside the scheduler (running or waiting) it aborts the groups one after another with
``/abort_request {"rid": "tts/<group>/"}`` and times, per group, the abort call and the time from the
call until every request of the group has answered, while py-spy samples how long the scheduler
spends inside SGLang's ``Scheduler.abort_request``. Then it checks the server is empty. Before the
servers, :func:`scheduler_cost` times SGLang's ``Scheduler.abort_request`` itself in this process
on the same queue sizes (``--scheduler-only``: that part alone).

Paths (the server's ``SGLANG_TTS_GROUP_ABORT``, :mod:`sgl_tts.plugin.scheduling.abort`): ``one`` (the default: one
``AbortReq`` with the group's prefix, which SGLang's scheduler matches in one pass over its queues)
and ``per-request`` (the first version: one ``AbortReq`` per live request of the group, each scanning
every queue).

    ./dev.sh run python benchmarks/group_abort.py --sizes 1000,5000,10000 --groups 10 \\
        --out docs/benchmarks/group_abort.run1.json

(the command line is the script's; this module is what it and the live test use).

The helpers (:func:`tagged_bodies`, :func:`start_all`, :func:`loads`, ...) serve the live test
``tests/test_live_group_abort.py`` too.
"""

from __future__ import annotations

import asyncio
import errno
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from sgl_tts.launch.live_servers import in_flight, loads
from sgl_tts.protocol import SearchTag, group_prefix

PATHS = ("per-request", "one")
PROMPT_IDS = [17, 42, 101, 7, 64, 230, 15, 88, 9, 151, 33, 72, 5, 120, 61, 200]   # vocab 284


def is_empty(ld: dict) -> bool:
    return (ld["num_running_reqs"] == 0 and ld["num_waiting_reqs"] == 0 and ld["num_used_tokens"] == 0
            and not any(ld.get("queues", {}).values()))


def tagged_bodies(group: str, n: int, tokens: int, prompt: Sequence[int] = PROMPT_IDS) -> list[dict]:
    """``n`` greedy requests of search group ``group``, rids ``tts/<group>/0/<i>``, each generating
    ``tokens`` tokens (EOS ignored) after a shared token-id prompt (no tokenizer work)."""
    out = []
    for i in range(n):
        tag = SearchTag(group=group, depth=0, parent=-1, beam=i)
        out.append({"input_ids": list(prompt), "rid": tag.rid(), "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0,
            "custom_params": tag.custom_params()}})
    return out


def session(total_timeout: float = 1800.0):
    import aiohttp

    # no connection limit (aiohttp's default is 100): every request is in flight at once; and no
    # connection reuse: a pooled connection idle for uvicorn's keep-alive (5 s) can be closed by the
    # server just as the next call (an abort) goes out on it (aiohttp: ServerDisconnectedError)
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total_timeout),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def post_json(sess, url: str, path: str, body: dict) -> tuple[int, Any]:
    async with sess.post(url + path, json=body) as res:
        text = await res.text()
        try:
            return res.status, json.loads(text)
        except ValueError:
            return res.status, text


class Flight:
    """Requests in flight: one task per request, and when each answered (``time.monotonic``)."""

    def __init__(self):
        self.tasks: dict[str, asyncio.Task] = {}
        self.answered_at: dict[str, float] = {}
        self.resent: list[str] = []

    def start(self, sess, url: str, bodies: Sequence[dict]) -> None:
        for body in bodies:
            rid = body["rid"]

            async def one(body=body, rid=rid):
                try:
                    try:
                        return await post_json(sess, url, "/generate", body)
                    except OSError as e:   # aiohttp's ClientOSError is one
                        if e.errno != errno.ECONNRESET:
                            raise
                        # 10,000 connections at once overflow uvicorn's listen backlog (2,048); a
                        # connection the server never accepted is dropped after the kernel's SYN-ACK
                        # retries and reset when its request arrives (seen once in CI). Such a request
                        # never reached the server, so it is sent once more; had the server seen it,
                        # the resend fails loudly ("Duplicate request ID"), it is not lost quietly
                        self.resent.append(rid)
                        return await post_json(sess, url, "/generate", body)
                finally:
                    self.answered_at[rid] = time.monotonic()
            self.tasks[rid] = asyncio.ensure_future(one())

    def answered(self) -> int:
        return len(self.answered_at)

    async def results(self, rids: Sequence[str]) -> dict[str, tuple[int, Any]]:
        got = await asyncio.gather(*(self.tasks[r] for r in rids))
        return dict(zip(rids, got))


async def start_all(sess, url: str, groups: dict[str, list[dict]], *, timeout: float = 600.0) -> Flight:
    """Send every body (all groups at once) and return when each request is either inside the
    scheduler (running or waiting) or already answered."""
    flight = Flight()
    for bodies in groups.values():
        flight.start(sess, url, bodies)
    total = sum(len(b) for b in groups.values())
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    while True:
        inside = await loop.run_in_executor(None, in_flight, url)
        if inside + flight.answered() >= total:
            return flight
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {inside} of {total} requests reached the scheduler "
                               f"({flight.answered()} answered) within {timeout:.0f} s")
        await asyncio.sleep(0.2)


def finish_reason(result: tuple[int, Any]) -> str:
    status, obj = result
    if status != 200 or not isinstance(obj, dict):
        return f"http {status}: {str(obj)[:200]}"
    return obj["meta_info"]["finish_reason"]["type"]


async def abort_group_timed(sess, url: str, flight: Flight, group: str, rids: Sequence[str], *,
                            timeout: float | None = None) -> dict:
    """Abort ``group`` and wait for every one of ``rids`` (at most ``timeout`` seconds): the abort
    call's time, the time until the first and the last request answered, and the finish reasons."""
    t0 = time.monotonic()
    status, _ = await post_json(sess, url, "/abort_request", {"rid": group_prefix(group)})
    t_call = time.monotonic() - t0
    if status != 200:
        raise RuntimeError(f"/abort_request answered {status}")
    try:
        results = await asyncio.wait_for(flight.results(rids), timeout)
    except asyncio.TimeoutError:
        left = [r for r in rids if r not in flight.answered_at]
        raise TimeoutError(f"{len(left)} of {len(rids)} requests of group {group} had no answer "
                           f"{timeout:.0f} s after its abort (first: {left[:3]})") from None
    t_all = max(flight.answered_at[r] for r in rids) - t0
    t_first = min(flight.answered_at[r] for r in rids) - t0
    reasons: dict[str, int] = {}
    for res in results.values():
        reason = finish_reason(res)
        reasons[reason] = reasons.get(reason, 0) + 1
    return {"group": group, "requests": len(rids), "abort_at": t0, "abort_call_s": round(t_call, 4),
            "first_answered_s": round(max(t_first, 0.0), 4), "all_answered_s": round(max(t_all, 0.0), 4),
            "finish_reasons": reasons}


async def wait_empty(url: str, timeout: float = 120.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    while True:
        ld = await loop.run_in_executor(None, loads, url)
        if is_empty(ld):
            return ld
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is not empty {timeout:.0f} s after the aborts: {ld}")
        await asyncio.sleep(0.2)


class SchedulerSampler:
    """py-spy (``record --nonblocking``) on a scheduler process while the groups are aborted: how many
    seconds of its main thread went into SGLang's ``Scheduler.abort_request`` (time the scheduler
    did not spend on forward passes). ``None`` figures when py-spy is missing or may not attach."""

    # a frame of SGLang's Scheduler.abort_request in py-spy's raw output: py-spy 0.4 writes
    # "Scheduler.abort_request (scheduler.py:3875)" (the file's base name, or a longer path)
    FRAME = re.compile(r"(?:^|;)(?:Scheduler\.)?abort_request \((?:[^;()]*/)?scheduler\.py:\d+\)")

    def __init__(self, pid: int | None, out: Path, rate: int = 100):
        import shutil

        self.pid, self.out, self.rate = pid, out, rate
        self.exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.proc = None

    def __enter__(self) -> "SchedulerSampler":
        import subprocess

        if self.pid is not None and Path(self.exe).exists():
            self.proc = subprocess.Popen([self.exe, "record", "--nonblocking", "-p", str(self.pid), "-r",
                                          str(self.rate), "-f", "raw", "-o", str(self.out)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)   # attached before the first abort
        return self

    def __exit__(self, *exc) -> None:
        import signal
        import subprocess

        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)   # py-spy writes its file on SIGINT
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def seconds(self) -> dict:
        """``sampled_s`` (the scheduler's busy samples) and ``in_abort_request_s``."""
        if self.proc is None or not self.out.exists():
            return {"sampled_s": None, "in_abort_request_s": None}
        total = inside = 0
        for line in self.out.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            total += int(count)
            if self.FRAME.search(stack):
                inside += int(count)
        return {"sampled_s": round(total / self.rate, 2), "in_abort_request_s": round(inside / self.rate, 3)}


async def run_case(url: str, n: int, n_groups: int, tokens: int, tag: str, *,
                   scheduler_pid: int | None = None, workdir: Path | None = None) -> dict:
    """One measurement: ``n`` requests in ``n_groups`` groups, every group aborted in turn (the
    scheduler sampled by py-spy meanwhile when its pid is given)."""
    per = n // n_groups
    groups = {f"{tag}-g{g}": tagged_bodies(f"{tag}-g{g}", per, tokens) for g in range(n_groups)}
    sampler = SchedulerSampler(scheduler_pid, Path(workdir or tempfile.gettempdir()) / f"{tag}.pyspy.txt")
    async with session() as sess:
        t0 = time.monotonic()
        flight = await start_all(sess, url, groups)
        queued_s = time.monotonic() - t0
        ld = loads(url)
        rows = []
        with sampler:
            t1 = time.monotonic()
            for group, bodies in groups.items():
                rows.append(await abort_group_timed(sess, url, flight, group, [b["rid"] for b in bodies]))
            total_s = time.monotonic() - t1
        final = await wait_empty(url)
    for row in rows:
        row.pop("abort_at")   # a monotonic clock reading, meaningless in a report
    return {"requests": per * n_groups, "groups": n_groups, "max_new_tokens": tokens,
            "queue_s": round(queued_s, 2), "running_at_abort": ld["num_running_reqs"],
            "waiting_at_abort": ld["num_waiting_reqs"], "aborts_total_s": round(total_s, 3),
            "scheduler": sampler.seconds(), "per_group": rows, "empty_after": is_empty(final),
            "resent_after_reset": len(flight.resent)}


def summarize(case: dict) -> dict:
    rows = case["per_group"]
    answered = [r["all_answered_s"] for r in rows]
    calls = [r["abort_call_s"] for r in rows]
    reasons: dict[str, int] = {}
    for r in rows:
        for k, v in r["finish_reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    return {"requests": case["requests"], "groups": case["groups"],
            "first_group_s": answered[0], "median_group_s": round(statistics.median(answered), 4),
            "max_group_s": max(answered), "sum_groups_s": round(sum(answered), 3),
            "median_call_s": round(statistics.median(calls), 4), "max_call_s": max(calls),
            "running_at_abort": case["running_at_abort"], "waiting_at_abort": case["waiting_at_abort"],
            "finish_reasons": reasons, "empty_after": case["empty_after"], "aborts_total_s": case["aborts_total_s"],
            "scheduler_in_abort_s": case["scheduler"]["in_abort_request_s"],
            "scheduler_sampled_s": case["scheduler"]["sampled_s"]}


class _Req:
    """What ``Scheduler.abort_request`` reads of a queued or running request."""

    __slots__ = ("rid", "mamba_pool_idx", "to_finish")

    def __init__(self, rid: str):
        self.rid, self.mamba_pool_idx, self.to_finish = rid, None, None

    def finished(self) -> bool:
        return False


def _scheduler_stub(waiting: list, running: list, sent: list):
    """The state SGLang 0.5.15's ``Scheduler.abort_request`` touches on a plain (non-disaggregated,
    no hicache, no chunked request) CPU server; answers to the tokenizer are pickled as ZMQ would."""
    import pickle
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import DisaggregationMode

    def send_output(obj, req=None):
        sent.append(pickle.dumps(obj))

    grammar_queue: list = []
    return SimpleNamespace(
        chunked_req=None, waiting_queue=waiting, enable_hicache_storage=False,
        ipc_channels=SimpleNamespace(send_to_tokenizer=SimpleNamespace(send_output=send_output)),
        disaggregation_mode=DisaggregationMode.NULL,
        grammar_manager=SimpleNamespace(abort_requests=lambda r: [q for q in grammar_queue if q]),
        cur_batch=None, running_batch=SimpleNamespace(reqs=running))


def scheduler_cost(n: int, n_groups: int, running: int = 40, repeat: int = 3, *,
                   paths: Sequence[str] = PATHS, abort_groups: int | None = None) -> list[dict]:
    """Seconds SGLang's real ``Scheduler.abort_request`` spends aborting every group in turn, on
    ``n`` queued requests in ``n_groups`` groups (``running`` of them in the running batch, the rest
    waiting): one ``AbortReq`` per request (``per-request``) vs one per group (``one``). All of a
    group's AbortReqs reach the scheduler together, so this is the time one scheduler iteration
    spends in them. Best of ``repeat``; ``abort_groups``: only the first so many groups."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.scheduler import Scheduler

    per = n // n_groups
    rids = [[SearchTag(f"g{g}", 0, -1, i).rid() for i in range(per)] for g in range(n_groups)]
    out = []
    for path in paths:
        best: list[float] | None = None
        for _ in range(repeat):
            reqs = [_Req(r) for group in rids for r in group]
            run, wait = reqs[:running], reqs[running:]
            sent: list = []
            stub = _scheduler_stub(wait, run, sent)
            times = []
            for g in range(n_groups if abort_groups is None else abort_groups):
                msgs = ([AbortReq(rid=r) for r in rids[g]] if path == "per-request"
                        else [AbortReq(rid=group_prefix(f"g{g}"))])
                t = time.perf_counter()
                for m in msgs:
                    Scheduler.abort_request(stub, m)
                times.append(time.perf_counter() - t)
                stub.running_batch.reqs = [r for r in run if r.to_finish is None]   # finished next step
            if abort_groups is None and (stub.waiting_queue or stub.running_batch.reqs
                                         or len(sent) != n - running):
                raise AssertionError(f"{path}: {len(stub.waiting_queue)} waiting, "
                                     f"{len(stub.running_batch.reqs)} running left, {len(sent)} answers")
            if best is None or sum(times) < sum(best):
                best = times
        out.append({"path": path, "requests": per * n_groups, "groups": n_groups, "running": running,
                    "first_group_s": round(best[0], 5), "max_group_s": round(max(best), 5),
                    "all_groups_s": round(sum(best), 5)})
    return out
