"""Group abort at scale on a live SGLang server (the ``generator`` of the ``live`` fixture, plugin on):
4,000 requests in 10 search groups, all in flight at once, aborted group by group with one
``/abort_request {"rid": "tts/<group>/"}`` each. Every request answers (abort, or a normal finish
before its group's abort), none is aborted before its own group, nothing hangs, and afterwards the
scheduler holds no request and no KV and the tokenizer manager no request state.

And the scheduler's time in SGLang's ``Scheduler.abort_request`` for all ten groups (py-spy samples of
the live scheduler) stays under twice what one AbortReq per request costs it for the first group
alone (SGLang's own function on such a queue in this process,
:func:`sgl_tts.bench.group_abort.scheduler_cost`). The per-request path scans every queue once per
request, O(group x queue): its ten groups cost ~5.5 times its first (10+9+...+1 tenths of the queue
scanned once per request of a group, against the whole queue), so it fails this bound at any size;
one AbortReq per group scans once per group. 4,000 requests keep both sides of the bound clear of
each other and of py-spy's 10 ms samples in half the time 10,000 took (2-core Xeon under load: the
bound 0.6-0.8 s; the live scheduler's time in abort_request 0.11 s, and 10.8 s with the server's
``SGLANG_TTS_GROUP_ABORT=per-request``, which fails)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from sgl_tts.bench.group_abort import (PROMPT_IDS, SchedulerSampler, abort_group_timed, finish_reason,
                                       is_empty, loads, post_json, scheduler_cost, session, start_all,
                                       tagged_bodies, wait_empty)

pytestmark = pytest.mark.server

GROUPS = 10
PER_GROUP = 400
TOKENS = 480            # the generator's context is 512: the requests run far longer than the test
ANSWER_TIMEOUT = 120.0  # per group, from its abort call until its last request answered


def scheduler_pid(live, name: str) -> int | None:
    """The running scheduler process of ``name`` (from the plugin's start records)."""
    pids = [r["pid"] for r in live.metrics_records(name) if r["event"] == "start"]
    return next((pid for pid in reversed(pids) if os.path.exists(f"/proc/{pid}")), None)


def test_4000_requests_aborted_group_by_group_all_answer_and_leave_nothing(live, tmp_path):
    url = live.url("generator")
    sampler = SchedulerSampler(scheduler_pid(live, "generator"), tmp_path / "scheduler.pyspy.txt")
    # ga1 and ga10 both: the prefix tts/ga1/ must not reach tts/ga10/...
    names = [f"ga{g}" for g in range(1, GROUPS + 1)]
    groups = {name: tagged_bodies(name, PER_GROUP, TOKENS) for name in names}
    group_of = {b["rid"]: name for name, bodies in groups.items() for b in bodies}
    rows, checks = [], []

    async def scenario():
        async with session(total_timeout=900) as sess:
            flight = await start_all(sess, url, groups, timeout=300)
            stages["queue"] = time.monotonic() - t0
            with sampler:
                await abort_all(sess, flight)
            stages["aborts"] = time.monotonic() - t0 - stages["queue"]
            results = {rid: task.result() for rid, task in flight.tasks.items()}
            final = await wait_empty(url, timeout=60)
            # no request state left in the tokenizer manager. Its generate_request first registers
            # every rid of a request in rid_to_state, refusing one it still holds ("Duplicate
            # request ID detected"), and only then validates the lengths: one batch of all 4,000
            # rids asking for more tokens than the context holds must fail on the length, not on a
            # rid (and costs no compute) ...
            all_rids = list(group_of)
            leak = await post_json(sess, url, "/generate", {
                "input_ids": [PROMPT_IDS] * len(all_rids), "rid": all_rids,
                "sampling_params": {"max_new_tokens": 4096}})
            # ... and a few of the rids, from every group, are served again
            some = [groups[name][i]["rid"] for name in names for i in (0, 1, PER_GROUP - 1)]
            again = await post_json(sess, url, "/generate", {
                "input_ids": [PROMPT_IDS] * len(some), "rid": some, "sampling_params": {"max_new_tokens": 1}})
            return flight, results, final, leak, again

    async def abort_all(sess, flight):
        for name in names:
            rids = [b["rid"] for b in groups[name]]
            rows.append(await abort_group_timed(sess, url, flight, name, rids, timeout=ANSWER_TIMEOUT))
            # the groups not aborted yet are still there, untouched: the scheduler holds every one
            # of their requests that has not finished normally. /v1/loads is a snapshot the
            # scheduler publishes at each batch, so it may lag a step: read until it caught up
            later = [r for r, g in group_of.items() if names.index(g) > names.index(name)]
            deadline = time.monotonic() + 30
            while True:
                before = sum(r not in flight.answered_at for r in later)
                ld = await asyncio.get_running_loop().run_in_executor(None, loads, url)
                held = ld["num_running_reqs"] + ld["num_waiting_reqs"]
                if held <= before or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            after = sum(r not in flight.answered_at for r in later)
            checks.append((name, held, before, after))

    t0 = time.monotonic()
    stages: dict[str, float] = {}
    flight, results, final, leak, again = asyncio.run(scenario())
    elapsed = time.monotonic() - t0

    assert len(results) == GROUPS * PER_GROUP
    reasons = {rid: finish_reason(res) for rid, res in results.items()}
    counts = {k: list(reasons.values()).count(k) for k in set(reasons.values())}
    # every request answered with abort, or finished normally (length) before its group's abort
    assert set(counts) <= {"abort", "length"}, counts
    assert counts.get("abort", 0) >= GROUPS * PER_GROUP * 0.9, counts
    abort_at = {row["group"]: row["abort_at"] for row in rows}
    early = [rid for rid, why in reasons.items()
             if why == "abort" and flight.answered_at[rid] < abort_at[group_of[rid]]]
    assert not early, f"{len(early)} requests aborted before their own group was, e.g. {early[:5]}"
    for row in rows:
        assert sum(row["finish_reasons"].values()) == PER_GROUP, row
    # an aborted group leaves the later groups in the scheduler (normal finishes aside: a request
    # leaves the scheduler a moment before its answer arrives, so held <= unanswered)
    for name, held, before, after in checks:
        assert after - 50 <= held <= before, (name, held, before, after, checks)
    assert checks[-1][1:] == (0, 0, 0)
    assert is_empty(final), final
    assert final["num_used_tokens"] == 0 and final["num_running_reqs"] == 0 and final["num_waiting_reqs"] == 0
    status, body = leak
    assert status == 400 and "context length" in str(body) and "Duplicate request ID" not in str(body), leak
    status, body = again
    assert status == 200 and [finish_reason((200, r)) for r in body] == ["length"] * len(body), again
    # the scheduler's own time in Scheduler.abort_request, all ten groups, against what one AbortReq
    # per request costs SGLang's Scheduler.abort_request for the first group alone on such a queue
    spy = sampler.seconds()
    per_request_first_group = scheduler_cost(GROUPS * PER_GROUP, GROUPS, repeat=1, paths=["per-request"],
                                             abort_groups=1)[0]["first_group_s"]
    if spy["sampled_s"]:
        assert spy["in_abort_request_s"] < 2 * per_request_first_group, (spy, per_request_first_group)
    else:
        print(f"\npy-spy could not sample the scheduler ({spy}): the scheduler-cost check is skipped")
    print(f"\nscheduler in Scheduler.abort_request: {spy['in_abort_request_s']} s of {spy['sampled_s']} s "
          f"sampled (one AbortReq per request: {per_request_first_group:.2f} s for the first group)")
    if flight.resent:
        print(f"{len(flight.resent)} requests were reset before the server accepted them and sent again, "
              f"e.g. {flight.resent[:3]}")
    print(f"{GROUPS * PER_GROUP:,} requests in {elapsed:.0f} s (queued in {stages['queue']:.0f} s, {GROUPS} "
          f"group aborts in {stages['aborts']:.0f} s): {counts}; per group (s): "
          + ", ".join(f"{r['all_answered_s']:.2f}" for r in rows))
