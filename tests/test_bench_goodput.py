"""``sgl-tts bench`` without a GPU: the trace-driven searches against SGLang look-alike servers (the
client, programs and PRM are the real ones), the kept-beam check, the report, resume, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import random
import threading
from pathlib import Path

import pytest

from sgl_tts.cli.bench import main as bench_main
from sgl_tts.bench.dummy_models import write_word_tokenizer
from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput import measure_limit, run_side
from sgl_tts.bench.goodput_report import format_report, summarize
from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.bench.goodput_store import RecordWriter, read_records
from sgl_tts.bench.goodput_trace import StepRegistry
from sgl_tts.launch.cpu_serving import CPU_ENV
from sgl_tts.launch.live_servers import free_port
from sgl_tts.search import SearchTag

from test_endpoint import ModelServer

VOCAB = 500
TRACE = {"median_tokens": 6.0, "sigma": 0.6, "min_tokens": 2, "max_tokens": 20, "end_probability": 0.3,
         "max_depth": 6}


class WordGenerator(ModelServer):
    """A generator look-alike: ``max_new_tokens`` random words of the word tokenizer (its own random
    stream, so two of them write different text for the same search), half the prompt "cached"."""

    def __init__(self, folder, seed, short_by=0):
        super().__init__(None, folder)
        self.rng = random.Random(seed)
        self.lock2 = threading.Lock()
        self.short_by = short_by   # a server whose limits cut steps short

    def one(self, text, params):
        n = max(1, int(params["max_new_tokens"]) - self.short_by)
        with self.lock2:
            words = " ".join(f"t{self.rng.randrange(VOCAB - 4)}" for _ in range(n))
        prompt = len(text.split())
        return {"text": words, "meta_info": {"prompt_tokens": prompt, "cached_tokens": prompt // 2,
                                             "completion_tokens": n,
                                             "finish_reason": {"type": "length", "length": n}}}

    def respond(self, path, body):
        if path == "/abort_request":        # as a server without the plugin: nothing to abort here
            return ({},)
        if path == "/set_internal_state":   # SGLang's bare flag: no plugin to change a class
            return (False,)
        if isinstance(body["text"], list):
            return ([self.one(t, body["sampling_params"]) for t in body["text"]],)
        return (self.one(body["text"], body["sampling_params"]),)


class WordPRM(ModelServer):
    """A step-tag PRM look-alike in SGLang 0.5.15's logprob layout (constant log-probabilities)."""

    def __init__(self, folder):
        super().__init__(None, folder)

    def respond(self, path, body):
        out = []
        for ids, start, wanted in zip(body["input_ids"], body["logprob_start_len"], body["token_ids_logprob"]):
            entries = [None] + [[[-0.5, t, None] for t in wanted] for _ in range(start + 1, len(ids))]
            out.append({"text": "", "meta_info": {"input_token_ids_logprobs": entries, "prompt_tokens": len(ids),
                                                  "cached_tokens": len(ids) - 10, "completion_tokens": 0}})
        return (out,)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One ``--models-dir`` for the module's commands: the first to need the two 1.5B folders writes
    them (their 152k-word tokenizer costs seconds), the others only read them.
    test_dry_run_prints_a_stock_and_an_sgl_tts_pair checks the writing itself in a folder of its own."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    folder = tmp_path_factory.mktemp("words")
    write_word_tokenizer(folder, VOCAB)
    return folder


def settings(**kw):
    base = dict(algorithms=("beam_search", "dvts"), n=(4, 8), problems=2, beam_width=2, prompt_tokens=12,
                trace=TRACE, planned_batch=6, limit_tokens=5)
    return BenchSettings(**{**base, **kw})


def run_two_sides(words, cfg):
    servers = {"stock": (WordGenerator(words, 1), WordPRM(words)),
               "sgl-tts": (WordGenerator(words, 2), WordPRM(words))}
    records = []
    try:
        for side, (gen, prm) in servers.items():
            run_side(side, gen.url, prm.url, cfg, prm_tokenizer=str(words), generator_tokenizer=str(words),
                     vocab=VOCAB - 4, write=records.append, progress=False)
        measure_limit(servers["sgl-tts"][0].url, cfg, vocab=VOCAB - 4, write=records.append)
    finally:
        for pair in servers.values():
            for srv in pair:
                srv.close()
    return records, servers


def test_both_sides_keep_the_same_beams_though_their_text_differs(words):
    cfg = settings()
    records, servers = run_two_sides(words, cfg)
    trace = cfg.step_trace()
    searches = [r for r in records if r["kind"] == "search"]
    assert len(searches) == 2 * 2 * 2 * 2   # sides x algorithms x n x problems
    # the sides wrote different text, yet every search kept the same beams
    texts = {side: [b["text"] for b in pair[0].bodies if isinstance(b["text"], str)]
             for side, pair in servers.items()}
    assert texts["stock"] != texts["sgl-tts"]
    rows = summarize(records, cfg)
    assert [(r.algorithm, r.n, r.match) for r in rows] == [("beam_search", 4, True), ("beam_search", 8, True),
                                                           ("dvts", 4, True), ("dvts", 8, True)]
    # every step asked for exactly the trace's tokens, EOS off, no stop string, tagged for the plugin
    steps = [b for b in servers["stock"][0].bodies if b["sampling_params"].get("max_new_tokens")]
    assert len(steps) > 100   # (the others: the frontend's prefix-cache fills at each fork)
    for body in steps:
        sp = body["sampling_params"]
        assert sp["ignore_eos"] is True and sp["stop"] == []
        assert set(sp["custom_params"]) >= {"tts_group", "tts_depth", "tts_beam"}
    # a kept trajectory's tokens are the trace's lengths along its path; its score is the trace's
    for r in searches:
        group = f"{r['algorithm']}-n{r['n']}-p{r['problem']}"
        for path, finished, tokens, score in r["kept"]:
            assert tokens == sum(trace.step_tokens(group, path[:k + 1], k) for k in range(len(path)))
            assert score == round(trace.score(group, path, len(path) - 1), 9)
            assert finished == trace.ends(group, path, len(path) - 1) or len(path) == trace.max_depth
    # the verifier did real work: every PRM request came through the PRM server, with a tag after
    # every step of its path (one step per request would mean the later steps went unscored)
    assert all(r["prm"]["requests"] > 0 and r["verifier_seconds"] > 0 for r in searches)
    tags = [ids.count(VOCAB - 1) for pair in servers.values() for b in pair[1].bodies for ids in b["input_ids"]]
    assert max(tags) >= 3 and min(tags) >= 1
    gen = [r["generator"] for r in searches if r["side"] == "stock"]
    assert rows[0].sides["stock"].problems == 2
    # hit rate = cached / prompt tokens, as the server reported them (cached = prompt // 2 here)
    mine = [r for r in searches if r["side"] == "stock" and r["algorithm"] == "beam_search" and r["n"] == 4]
    assert rows[0].sides["stock"].generator_hit_rate == pytest.approx(
        sum(r["generator"]["cached_tokens"] for r in mine) / sum(r["generator"]["prompt_tokens"] for r in mine))
    assert all(g["completion_tokens"] > 0 for g in gen)
    limits = [r for r in records if r["kind"] == "limit"]
    assert [(r["batch"], r["tokens"]) for r in limits] == [(4, 20), (6, 30)]   # min(n, planned batch 6)
    assert all(r.limit_goodput and r.limit_goodput > 0 for r in rows)


def sglang_accepts(body: dict, vocab: int) -> None:
    """Parse a request body as SGLang 0.5.15's server does (``GenerateReqInput``, then
    ``SamplingParams(**sampling_params).verify``); raises on anything it would refuse."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
    for sp in params:
        SamplingParams(**(sp or {})).verify(vocab)


def test_every_request_the_benchmark_sends_is_one_sglang_accepts(words):
    # with the word tokenizer's specials banned, as --device cpu does (SGLang checks logit_bias' ids)
    banned = tuple(range(VOCAB - 4, VOCAB))
    cfg = settings(n=(4,), problems=1, banned_token_ids=banned)
    _, servers = run_two_sides(words, cfg)
    kinds = set()
    for gen, prm in servers.values():
        for body in gen.bodies + prm.bodies:
            sglang_accepts(body, VOCAB)
            kind = ("prm" if "input_ids" in body else "limit" if isinstance(body["text"], list)
                    else "step" if body["sampling_params"].get("max_new_tokens") else "prefix")
            kinds.add(kind)
            if kind == "step":   # every step request keeps the generator off the specials
                bias = body["sampling_params"]["logit_bias"]
                assert sorted(int(k) for k in bias) == list(banned) and max(bias.values()) <= -1e3
    assert kinds == {"prm", "limit", "step", "prefix"}
    with pytest.raises(ValueError):   # an id outside the vocabulary is refused
        sglang_accepts({"text": "t1", "sampling_params": {"max_new_tokens": 1, "logit_bias": {str(VOCAB): -1e4}}},
                       VOCAB)
    with pytest.raises(ValueError):   # the check can fail: SGLang refuses a negative length
        sglang_accepts({"text": "t1", "sampling_params": {"max_new_tokens": -1}}, VOCAB)


def test_a_differing_kept_beam_is_reported_with_its_problem(words):
    cfg = settings(algorithms=("beam_search",), n=(4,))
    records, _ = run_two_sides(words, cfg)
    victim = next(r for r in records if r["kind"] == "search" and r["side"] == "sgl-tts" and r["problem"] == 1)
    victim["kept"] = victim["kept"][1:]
    rows = summarize(records, cfg)
    assert (rows[0].match, rows[0].mismatched) == (False, [1])
    assert "| DIFFER: problems 1 |" in format_report(rows)


def test_a_server_that_cuts_a_step_short_stops_the_benchmark_with_the_fork_s_error(words):
    gen, prm = WordGenerator(words, 1, short_by=2), WordPRM(words)
    try:
        with pytest.raises(BenchError, match=r"search beam_search-n4-p0 failed: BenchError\(\"search "
                                             r"'beam_search-n4-p0': the server generated \d+ of the \d+ tokens asked"):
            run_side("stock", gen.url, prm.url, settings(algorithms=("beam_search",), n=(4,), problems=1),
                     prm_tokenizer=str(words), generator_tokenizer=str(words), vocab=VOCAB - 4,
                     write=lambda r: None, progress=False)
    finally:
        gen.close()
        prm.close()


def test_steps_end_before_the_context_length(words):
    # the prompt (12), the margin (64) and the PRM's tags (max depth 6 + 2) leave 25 tokens of path
    cfg = settings(algorithms=("beam_search",), n=(4,), problems=1, context_tokens=12 + 64 + 8 + 25)
    records, _ = run_two_sides(words, cfg)
    search = next(r for r in records if r["kind"] == "search")
    # no kept path is longer, and every kept one finished
    assert all(tokens <= 25 and finished for _, finished, tokens, _ in search["kept"])


def _record(side, n, problem, *, tokens, seconds):
    """A search that kept two trajectories of ``2 * tokens`` in all: one ended at depth 0 (a fifth),
    one at depth 1; 100 tokens were generated at depth 0 and 300 at depth 1."""
    return {"kind": "search", "side": side, "algorithm": "beam_search", "n": n, "problem": problem,
            "seconds": seconds, "verifier_seconds": seconds / 4, "generator_seconds": seconds * 3 / 4,
            "tokens_generated": 400, "tokens_kept": tokens * 2, "trajectories": 2,
            "trajectory_tokens": tokens * 2, "trajectory_seconds": seconds * 2, "depth_tokens": [100, 300],
            "generator": {"requests": 8, "prompt_tokens": 1000, "cached_tokens": 750, "completion_tokens": 400},
            "prm": {"requests": 8, "prompt_tokens": 1000, "cached_tokens": 500, "completion_tokens": 0},
            "kept": [[[0], True, tokens * 2 // 5, 0.5], [[1, 2], True, tokens * 2 - tokens * 2 // 5, 0.4]]}


def test_the_report_computes_precise_goodput_and_the_limit_by_hand():
    cfg = BenchSettings(algorithms=("beam_search",), n=(8,), problems=2, planned_batch=4)
    records = [_record("stock", 8, 0, tokens=100, seconds=2.0), _record("stock", 8, 1, tokens=300, seconds=6.0),
               _record("sgl-tts", 8, 0, tokens=100, seconds=1.0), _record("sgl-tts", 8, 1, tokens=300, seconds=3.0),
               {"kind": "limit", "batch": 4, "tokens": 1000, "seconds": 1.0, "tokens_per_s": 1000.0}]
    # a speculative side records what the program waited for, and its speculative tokens
    spec = "sgl-tts+spec+lookahead+overlap"
    for problem, (tokens, seconds) in enumerate([(100, 1.0), (300, 3.0)]):
        records.append({**_record(spec, 8, problem, tokens=tokens, seconds=seconds),
                        "waited_generating": seconds * 0.9, "waited_verifying": seconds * 0.1,
                        "tokens_speculative": 50 * (problem + 1), "tokens_reused": 30 * (problem + 1)})
    # a controlled side that declined every branch: no speculative tokens, its declines counted
    for problem, (tokens, seconds) in enumerate([(100, 1.0), (300, 3.0)]):
        records.append({**_record("sgl-tts+auto", 8, problem, tokens=tokens, seconds=seconds),
                        "branches": {"started": 0, "declined": 4 + 2 * problem, "stopped": 0,
                                     "stood_down": {"costs more than it saves": 4 + 2 * problem}}})
    (row,) = summarize(records, cfg)
    # stock: (2*100 + 2*300) tokens over (2*2 + 2*6) trajectory-seconds = 50 tok/s; sgl-tts 100 tok/s
    assert row.sides["stock"].goodput == pytest.approx(50.0)
    assert row.sides["sgl-tts"].goodput == pytest.approx(100.0)
    # limit at 1000 tok/s, depth by depth: a depth-0 trajectory is done at 100/1000 = 0.1 s, a depth-1
    # one at 400/1000 = 0.4 s; (200 + 600) kept tokens over 2 x (0.1 + 0.4) s = 800 tok/s
    assert row.limit_goodput == pytest.approx(800.0) and row.limit_batch == 4
    assert row.match is True
    lines = format_report([row]).splitlines()
    assert lines[0].startswith("| algorithm | n | side |")
    assert lines[2] == ("| beam_search | 8 | stock | 2 | 50.0 | 1.00x | 4.00 | 3.00 | 1.00 | 400 | - | 400 | "
                        "75.0% | 50.0% | 800 (b=4) | 6% | match |")
    assert lines[3] == ("| beam_search | 8 | sgl-tts | 2 | 100.0 | 2.00x | 2.00 | 1.50 | 0.50 | 400 | - | 400 | "
                        "75.0% | 50.0% | 800 (b=4) | 12% | match |")
    # generator: the mean of (seconds - waited for the PRM) = (0.9 + 2.7) / 2; speculative 75 (45 reused)
    assert lines[4] == (f"| beam_search | 8 | {spec} | 2 | 100.0 | 2.00x | 2.00 | 1.80 | 0.20 | 400 | 75 (45) | "
                        "400 | 75.0% | 50.0% | 800 (b=4) | 12% | match |")
    assert row.sides["sgl-tts+auto"].branches_declined == 5 and row.sides["sgl-tts+auto"].branches_started == 0
    assert lines[5] == ("| beam_search | 8 | sgl-tts+auto | 2 | 100.0 | 2.00x | 2.00 | 1.50 | 0.50 | 400 | 0 (0); 5 declined | "
                        "400 | 75.0% | 50.0% | 800 (b=4) | 12% | match |")
    # a pressured CPU run's goodputs lie below 1 tok/s: two places there (".1f" read 0.4 against 0.7
    # for 1.82x, and the limit ".0f" read 0)
    slow = dataclasses.replace(row, limit_goodput=0.525,
                               sides={"stock": dataclasses.replace(row.sides["stock"], goodput=0.4449)})
    assert format_report([slow]).splitlines()[2] == (
        "| beam_search | 8 | stock | 2 | 0.44 | 1.00x | 4.00 | 3.00 | 1.00 | 400 | - | 400 | "
        "75.0% | 50.0% | 0.53 (b=4) | 85% | match |")


def test_the_registry_places_steps_by_their_parent_and_refuses_what_it_cannot_place():
    reg = StepRegistry()
    assert reg.place("q words\n\n", SearchTag("g", 0, -1, 3)) == ((3,), 0)
    reg.add(" t1 t2 ", "g", (3,), 2, 2)
    assert reg.place("q words\n\nt1 t2\n\n", SearchTag("g", 1, 3, 5)) == ((3, 5), 2)
    assert reg.node("t1 t2") == ("g", (3,))
    reg.add("t4 t5 t6", "g", (3, 5), 5, 3)
    assert reg.depth_tokens == {0: 2, 1: 3}
    with pytest.raises(BenchError, match="does not continue a step this benchmark generated"):
        reg.place("q words\n\nt9 t9\n\n", SearchTag("g", 1, 0, 0))
    with pytest.raises(BenchError, match="generated the same text 't1 t2'"):
        reg.add("t1 t2", "g", (4,), 2, 2)
    with pytest.raises(BenchError, match="did not generate: 'zzz'"):
        reg.node("zzz")


@pytest.mark.parametrize("kw, message", [
    ({"algorithms": ("mcts",)}, "unknown algorithm 'mcts'; choose from beam_search, dvts"),
    ({"n": (8, 0)}, r"every n must be >= 1, got \[8, 0\]"),
    ({"n": (2,), "beam_width": 4}, r"DVTS needs n >= beam_width \(4\); got n = 2"),
    ({"trace": {"sigma": -1}}, "median_tokens must be > 0 and sigma >= 0"),
    ({"problems": 0}, "beam_width, problems and prompt_tokens must be >= 1"),
])
def test_bad_settings_are_refused_with_the_reason(kw, message):
    with pytest.raises(ValueError, match=message):
        BenchSettings(**kw)


def test_records_resume_only_for_the_same_settings_and_a_torn_line_is_dropped(tmp_path):
    cfg = BenchSettings(n=(8,), problems=1)
    out = tmp_path / "run.jsonl"
    write = RecordWriter(out, cfg)
    write({"kind": "limit", "batch": 8, "tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0})
    with open(out, "a") as fh:
        fh.write('{"kind": "sea')   # a crash mid-line
    got = read_records(out, cfg)
    assert [r["kind"] for r in got] == ["limit"]
    RecordWriter(out, cfg, got)({"kind": "limit", "batch": 16, "tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0})
    assert [r["batch"] for r in read_records(out, cfg)] == [8, 16]   # the torn line is gone
    with pytest.raises(BenchError) as err:
        read_records(out, BenchSettings(n=(16,), problems=1))
    # what differs, and no advice to delete the records (--report-only meets this too)
    assert str(err.value) == (f"{out} holds a run of other settings (n: [8] there, [16] here) (--report-only "
                              "rebuilds its report with them), or pick another --output")
    with open(out, "a") as fh:   # a run record names the command that wrote the file
        fh.write(json.dumps({"kind": "run", "command": "sgl-tts bench --n 8"}) + "\n")
    with pytest.raises(BenchError, match=r"other settings \(n: \[8\] there, \[16\] here\); it was written by "
                                         r"`sgl-tts bench --n 8`: give that command's flags again \(--report-only"):
        read_records(out, BenchSettings(n=(16,), problems=1))


def test_a_run_that_adds_algorithms_or_n_extends_the_records_and_anything_else_is_refused(tmp_path):
    """--algorithms beam_search dvts on an output of beam_search (issue 64's second cell): the settings
    line is widened, the records kept (the resume skips them); a run that drops an algorithm or
    changes another setting is still refused, and the file is left as it was."""
    cfg = BenchSettings(algorithms=("beam_search",), n=(16,), problems=2)
    out = tmp_path / "run.jsonl"
    RecordWriter(out, cfg)({"kind": "limit", "batch": 8, "tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0})
    before = out.read_bytes()
    for other in (BenchSettings(algorithms=("dvts",), n=(16,), problems=2),          # beam_search dropped
                  BenchSettings(algorithms=("beam_search", "dvts"), n=(16,), problems=3)):
        with pytest.raises(BenchError, match="holds a run of other settings"):
            read_records(out, other)
        assert out.read_bytes() == before
    wider = BenchSettings(algorithms=("beam_search", "dvts"), n=(16, 64), problems=2)
    assert [r["batch"] for r in read_records(out, wider)] == [8]
    header = json.loads(out.read_text().splitlines()[0])
    assert header["settings"] == json.loads(json.dumps(wider.to_json()))
    assert out.read_bytes().split(b"\n", 1)[1] == before.split(b"\n", 1)[1]
    assert not list(tmp_path.glob("*.widening"))
    with pytest.raises(BenchError, match=r"algorithms: \['beam_search', 'dvts'\] there, \['beam_search'\] here"):
        read_records(out, cfg)                   # and no narrowing back


def test_a_load_run_that_adds_rates_extends_the_records_and_one_that_drops_one_is_refused(tmp_path):
    """The load mode: --arrivals 0.1,0.2,0.4 on an output of 0.1,0.2 (DVTS n = 16 never saturated
    there) widens the settings line and keeps the blocks; dropping a rate or leaving the load mode is
    refused, the file untouched."""
    load = BenchSettings(algorithms=("dvts",), n=(16,), problems=2, arrivals=(0.1, 0.2))
    out = tmp_path / "load.jsonl"
    block = {"kind": "load_block", "side": "stock", "algorithm": "dvts", "n": 16, "rate": 0.1, "attempt": "a"}
    RecordWriter(out, load)(block)
    before = out.read_bytes()
    for other in (BenchSettings(algorithms=("dvts",), n=(16,), problems=2, arrivals=(0.2, 0.4)),   # 0.1 dropped
                  BenchSettings(algorithms=("dvts",), n=(16,), problems=2),                        # one at a time
                  BenchSettings(algorithms=("dvts",), n=(16,), problems=2, arrivals=(0.1, 0.2, 0.4),
                                latency_bound=2.0)):
        with pytest.raises(BenchError, match="holds a run of other settings"):
            read_records(out, other)
        assert out.read_bytes() == before
    more = BenchSettings(algorithms=("dvts",), n=(16,), problems=2, arrivals=(0.1, 0.2, 0.4))
    assert read_records(out, more) == [block]
    assert json.loads(out.read_text().splitlines()[0])["settings"]["arrivals"] == [0.1, 0.2, 0.4]


def _dry(capsys, *extra):
    code = bench_main(["--generator", "qwen2.5-math-1.5b", "--prm", "skywork-prm-1.5b", "--gpu-memory",
                       "0.4*24GiB", "--n", "8", "64", "--dry-run", *extra])
    return code, capsys.readouterr()


def test_dry_run_prints_a_stock_and_an_sgl_tts_pair(tmp_path, capsys):
    code, out = _dry(capsys, "--models-dir", str(tmp_path))
    assert code == 0, out.err
    lines = out.out.splitlines()
    settings_line = json.loads(lines[0])
    assert settings_line["n"] == [8, 64] and settings_line["context_tokens"] == 4096
    cmds = dict(zip(lines[1::2], lines[2::2]))
    assert list(cmds) == ["# stock generator", "# stock prm", "# sgl-tts generator", "# sgl-tts prm"]
    for name, cmd in cmds.items():
        assert "--load-format dummy" in cmd and "--attention-backend triton" in cmd
        assert cmd.startswith("SGLANG_PLUGINS=sgl-tts SGLANG_TTS_OBSERVE_ONLY=1 ") == name.startswith("# stock")   # scheduling plugin-free, observed
        assert ("--tts-policy prefix-aware" in cmd) == (name == "# sgl-tts generator")
        # the planned generator batch is a cap; the PRM only prefills, its pool is its limit
        assert ("--max-running-requests" in cmd) == (name == "# sgl-tts generator")
    # the H200 run's configuration (issue 37): both models batch all 64 requests of an iteration (the
    # problem's 300 tokens shared, a path by 4 siblings), and the rest of the budget goes to both
    # caches by need, which here is the stock split itself (before: a 4,096-token PRM pool, batch 1)
    pools = {name: int(cmd.split("--max-total-tokens ")[1].split()[0]) for name, cmd in cmds.items()}
    assert pools["# sgl-tts prm"] == pools["# sgl-tts generator"] == pools["# stock prm"] == 53350
    assert "--max-running-requests 64 " in cmds["# sgl-tts generator"]
    tok = tmp_path / "qwen2.5-math-1.5b" / "tokenizer"
    assert (tok / "tokenizer.json").exists()
    assert f"--tokenizer-path {tok}" in cmds["# stock generator"] and f"--tokenizer-path {tok}" in cmds["# sgl-tts generator"]


def test_the_stock_sides_run_sglang_s_own_policies_without_the_plugin(tmp_path, capsys):
    """What a user would pick instead of the plugin (issue 32): stock SGLang under fcfs (its
    default), lpm and dfs-weight, on both servers, the same pools; every generator serves SGLang's
    counters (--enable-metrics); the sgl-tts side is unchanged."""
    code = bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5",
                       "--sides", "stock", "stock-lpm", "stock-dfs-weight", "sgl-tts"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    cmds = dict(zip(lines[1::2], lines[2::2]))
    assert list(cmds) == [f"# {side} {server}" for side in ("stock", "stock-lpm", "stock-dfs-weight", "sgl-tts")
                          for server in ("generator", "prm")]
    policy = lambda cmd: cmd.split("--schedule-policy ")[1].split()[0] if "--schedule-policy" in cmd else None  # noqa: E731
    pool = lambda cmd: cmd.split("--max-total-tokens ")[1].split()[0]  # noqa: E731
    for name, cmd in cmds.items():
        side, server = name[2:].split()
        assert ("SGLANG_PLUGINS=sgl-tts SGLANG_TTS_OBSERVE_ONLY=1 " in cmd) == (side != "sgl-tts") and ("--tts-policy" in cmd) == (name == "# sgl-tts generator")
        assert policy(cmd) == {"stock": None, "stock-lpm": "lpm", "stock-dfs-weight": "dfs-weight", "sgl-tts": None}[side]
        assert ("--enable-metrics" in cmd) == (server == "generator")
        assert pool(cmd) == pool(cmds[f"# sgl-tts {server}"])


def test_sides_whose_servers_are_the_same_commands_share_one_start_of_them(tmp_path, capsys):
    """A server start costs about a minute on the lent GPU (a lease has fifteen): sides that differ only
    in the program's settings (sgl-tts, +overlap, +auto+overlap) run on one start of the sgl-tts servers,
    in the order of the group's first side; stock sides of one policy would too; a locality side never
    shares (its eviction state lives on the radix tree), not even with a locality side of the same flags."""
    from sgl_tts.bench.command import server_groups

    sides = ["stock", "sgl-tts", "stock-lpm", "sgl-tts+overlap", "sgl-tts+locality", "sgl-tts+locality+overlap",
             "sgl-tts+auto+overlap", "stock"]
    code = bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5",
                       "--sides", *sides])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()[1:]
    assert [x for x in lines if x.startswith("#")] == [
        "# stock generator", "# stock prm",
        "# sgl-tts generator", "# sgl-tts prm",
        "# sgl-tts+overlap: on the sgl-tts servers, started once; both radix caches flushed before it",
        "# sgl-tts+auto+overlap: on the sgl-tts servers, started once; both radix caches flushed before it",
        "# stock-lpm generator", "# stock-lpm prm",
        "# sgl-tts+locality generator", "# sgl-tts+locality prm",
        "# sgl-tts+locality+overlap generator", "# sgl-tts+locality+overlap prm"]
    # the same commands are the rule, not the names: two sides of equal specs share, others do not
    a, b = [object()], [object()]
    assert server_groups(["x", "y", "z", "w"], {"x": a, "y": b, "z": list(a), "w": b}) == [["x", "z"], ["y", "w"]]
    assert server_groups(["sgl-tts+locality", "sgl-tts+locality+overlap"],
                         {"sgl-tts+locality": a, "sgl-tts+locality+overlap": a}) == [
        ["sgl-tts+locality"], ["sgl-tts+locality+overlap"]]


def test_the_locality_sides_run_the_policy_or_one_rule_on_both_servers(tmp_path, capsys):
    """The locality ablation (issue 32): sgl-tts+locality runs both rules on both servers, the
    -eviction and -order sides one rule alone (--tts-locality-rules), -families both with whole-family
    admission, on the sgl-tts pools; so do sgl-tts+locality+overlap and -overlap-by-family (both rules;
    their programs overlap verification) and -families+overlap-by-family."""
    code = bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5",
                       "--sides", "sgl-tts+locality", "sgl-tts+locality-eviction", "sgl-tts+locality-order",
                       "sgl-tts+locality-families", "sgl-tts+locality+overlap", "sgl-tts+locality+overlap-by-family",
                       "sgl-tts+locality-families+overlap-by-family"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    cmds = dict(zip(lines[1::2], lines[2::2]))
    rules = {"sgl-tts+locality": None, "sgl-tts+locality-eviction": "eviction", "sgl-tts+locality-order": "order",
             "sgl-tts+locality-families": "families", "sgl-tts+locality+overlap": None,
             "sgl-tts+locality+overlap-by-family": None, "sgl-tts+locality-families+overlap-by-family": "families"}
    assert list(cmds) == [f"# {side} {server}" for side in rules for server in ("generator", "prm")]
    for name, cmd in cmds.items():
        side, server = name[2:].split()
        assert "--tts-policy locality " in cmd and "SGLANG_TTS_OBSERVE_ONLY" not in cmd, name
        got = cmd.split("--tts-locality-rules ")[1].split()[0] if "--tts-locality-rules" in cmd else None
        assert got == rules[side], name
        assert ("--tts-metrics-file" in cmd) == (server == "generator"), name


def test_the_search_first_sides_order_by_search_on_both_servers_without_aging(tmp_path, capsys):
    """sgl-tts+search-first (issue 64) runs --tts-admission search with the prefix-aware policy and no
    aging on both servers (the PRM's queue holds many searches too), on the sgl-tts pools; its
    +overlap twin the same servers, started for it (a server policy side never shares)."""
    code = bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5",
                       "--sides", "sgl-tts", "sgl-tts+search-first", "sgl-tts+search-first+overlap"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    cmds = dict(zip(lines[1::2], lines[2::2]))
    assert list(cmds) == [f"# {side} {server}" for side in ("sgl-tts", "sgl-tts+search-first",
                                                            "sgl-tts+search-first+overlap")
                          for server in ("generator", "prm")]
    for name, cmd in cmds.items():
        searched = "search-first" in name
        assert ("--tts-admission search" in cmd) == searched, name
        assert ("--tts-max-wait off" in cmd) == searched, name
        if searched or name.endswith("generator"):
            assert "--tts-policy prefix-aware " in cmd, name
        else:
            assert "--tts-policy" not in cmd, name       # the plain sgl-tts side's PRM runs no order


def test_pressure_runs_the_measured_budget_of_its_n_the_shared_prompt_and_every_policy(tmp_path, capsys):
    """--pressure (issue 32): n = 256's recorded budget (28 MiB, both pools of a side), a 512-token
    prompt, SGLang's three policies then sgl-tts, sgl-tts+locality, sgl-tts+locality+overlap and
    sgl-tts+locality+overlap-by-family; the
    stock generator's pool is half of 28 MiB in the tiny generator's KV (4 layers, 2 KV heads of 64,
    float16): 7,168 tokens."""
    code = bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5",
                       "--pressure", "--n", "256", "--algorithms", "beam_search"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    cfg = json.loads(lines[0])
    assert (cfg["n"], cfg["prompt_tokens"], cfg["algorithms"]) == ([256], 512, ["beam_search"])
    cmds = dict(zip(lines[1::2], lines[2::2]))
    assert [name.split()[1] for name in list(cmds)[::2]] == ["stock", "stock-lpm", "stock-dfs-weight", "sgl-tts",
                                                              "sgl-tts+locality", "sgl-tts+locality+overlap",
                                                              "sgl-tts+locality+overlap-by-family"]
    assert {int(cmd.split("--max-total-tokens ")[1].split()[0]) for name, cmd in cmds.items()
            if name.endswith("generator")} == {14 * 2 ** 20 // (4 * 2 * 2 * 64 * 2)} == {7168}
    # --sides still chooses the sides
    assert bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5",
                       "--pressure", "--n", "128", "--sides", "stock-lpm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1::2] == ["# stock-lpm generator", "# stock-lpm prm"]
    assert int(lines[2].split("--max-total-tokens ")[1].split()[0]) == 2 ** 23 // (4 * 2 * 2 * 64 * 2)
    # n = 64: 11.125 MiB, of which the stock sides give the generator 0.37 (2,107 tokens) and the PRM the
    # rest, one whole 2,048-token context of its 3,584-byte tokens (2,050)
    assert bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.37",
                       "--pressure", "--n", "64", "--sides", "stock-lpm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split("--max-total-tokens ")[1].split()[0]) for line in lines[2::2]] == [
        int(0.37 * 11.125 * 2 ** 20) // 2048, int(0.63 * 11.125 * 2 ** 20) // 3584] == [2107, 2050]


@pytest.mark.parametrize("extra, message", [
    ([], "--pressure needs --n (its budgets are measured for n = 64: 11.125MiB, n = 128: 16MiB, n = 256: 28MiB)"),
    (["--n", "128", "256"], "--pressure: n = 128, 256 run at different budgets (n = 64: 11.125MiB, n = 128: 16MiB, "
                            "n = 256: 28MiB); run one budget at a time"),
    (["--n", "64", "128"], "--pressure: n = 64, 128 run at different budgets (n = 64: 11.125MiB, n = 128: 16MiB, "
                           "n = 256: 28MiB); run one budget at a time"),
    (["--n", "64", "32"], "--pressure: no budget measured for n = 32 (n = 64: 11.125MiB, n = 128: 16MiB, n = 256: "
                          "28MiB); give --kv-memory and --prompt-tokens without --pressure"),
    (["--n", "64", "--kv-memory", "24MiB"], "--pressure sets --kv-memory 11.125MiB at n = 64; leave --kv-memory out "
                                            "(got 24MiB)"),
    (["--n", "64", "--stock-split", "0.5"], "--pressure sets --stock-split 0.37 at n = 64; leave --stock-split out "
                                            "(got 0.5)"),
    (["--n", "64", "--prompt-tokens", "64"], "--pressure sets --prompt-tokens 512 at n = 64; leave --prompt-tokens "
                                             "out (got 64)"),
    (["--n", "64", "--device", "cuda", "--generator", "g", "--prm", "p"], "--pressure is a --device cpu workload"),
])
def test_pressure_refuses_what_contradicts_its_measured_settings(tmp_path, capsys, extra, message):
    argv = ["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--pressure", *extra]
    with pytest.raises(SystemExit) as exc:
        bench_main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"sgl-tts bench: error: {message}"


def test_dry_run_on_the_cpu_runs_both_sides_with_the_same_cpu_flags_and_a_shorter_trace(tmp_path, capsys):
    from sgl_tts.bench.command import CPU_TRACE

    code = bench_main(["--device", "cpu", "--models-dir", str(tmp_path), "--dry-run", "--sgl-tts-split", "0.5"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    cfg = json.loads(lines[0])
    # the CPU defaults: n 8/32/64, one problem, the trace's shape scaled down, the specials banned
    assert (cfg["n"], cfg["problems"], cfg["prompt_tokens"], cfg["trace"]) == ([8, 32, 64], 1, 64, CPU_TRACE)
    assert cfg["context_tokens"] == 2048 and cfg["planned_batch"] == 64
    assert cfg["banned_token_ids"] == [4092, 4093, 4094, 4095]
    shape = BenchSettings(**cfg).step_trace().describe()
    assert 45 < shape["mean_tokens"] < 60 and shape["p99_tokens"] > 8 * shape["p50_tokens"]   # still heavy-tailed
    cmds = dict(zip(lines[1::2], lines[2::2]))
    assert list(cmds) == ["# stock generator", "# stock prm", "# sgl-tts generator", "# sgl-tts prm"]
    env = f"SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS={CPU_ENV['OMP_NUM_THREADS']} "   # both sides alike
    for name, cmd in cmds.items():
        # the SGLang model modules neither tiny Qwen2 needs are skipped (cpu_serving.model_registry_env)
        skipped = re.search(r" SGLANG_DISABLED_MODEL_ARCHS=(\S+) ", cmd).group(1).split(",")
        assert "llama" in skipped and "qwen2" not in skipped
        cmd = re.sub(r"SGLANG_DISABLED_MODEL_ARCHS=\S+ ", "", cmd)
        assert cmd.startswith(env + "SGLANG_PLUGINS=sgl-tts SGLANG_TTS_OBSERVE_ONLY=1 " if name.startswith("# stock") else env + "/")
        assert "--device cpu" in cmd and "--grammar-backend none" in cmd and "--sleep-on-idle" in cmd
        assert "--load-format dummy" in cmd and "--attention-backend" not in cmd
        assert "--mem-fraction-static" not in cmd and "--max-running-requests" not in cmd   # no planning
        assert ("--tts-policy prefix-aware" in cmd) == (name == "# sgl-tts generator")
        model = "tiny-cpu-prm" if name.endswith("prm") else "tiny-cpu-generator"
        assert f"--model-path {tmp_path / model} " in cmd
        assert f"--tokenizer-path {tmp_path / model / 'tokenizer'}" in cmd
    # both sides split the default 1 GiB of KV alike: half each, in tokens of each model's KV size
    pool = lambda cmd: int(cmd.split("--max-total-tokens ")[1].split()[0])  # noqa: E731
    assert pool(cmds["# stock generator"]) == pool(cmds["# sgl-tts generator"]) == 2 ** 29 // (4 * 2 * 2 * 64 * 2)
    assert pool(cmds["# stock prm"]) == pool(cmds["# sgl-tts prm"]) == 2 ** 29 // (7 * 2 * 2 * 64 * 2)


def test_the_gpu_device_still_needs_its_models(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["--dry-run"])
    assert exc.value.code == 2
    assert "--generator and --prm are required with --device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--stock-split", "1.5"], "the generator's share must be in (0, 1), got 1.5"),
    (["--n", "2", "--beam-width", "4"], "DVTS needs n >= beam_width (4); got n = 2"),
])
def test_bad_arguments_fail_with_one_line(models, capsys, extra, message):
    code, out = _dry(capsys, "--models-dir", str(models), *extra)
    assert code == 1 and out.err == f"sgl-tts bench: error: {message}\n"


def test_the_reports_header_is_the_runs_that_measured():
    """A report describes the runs its records came from: the first run's plan and pools, every run's
    machine, date and command (each once, in the order they ran); it names the invocation that rebuilt
    it only when that is none of the runs, and which settings differ when the runs disagree."""
    from sgl_tts.bench.command import measured_header, run_record

    def header(machine, date, command, pools=53350):
        return {"generator": "g", "prm": "p", "budget": "9.6 GiB", "machine": machine, "date": date,
                "command": command, "pools": {"prm": pools}}

    gpu1 = header("H200", "2026-11-27", "sgl-tts bench --stop-after 400")
    gpu2 = header("H200", "2026-11-27", "sgl-tts bench --stop-after 140")
    # rebuilt on a CPU by a later checkout whose planner gives other pools
    cpu = header("2-core CPU", "2026-11-28", "sgl-tts bench --report-only", pools=4096)
    records = [run_record(gpu1), {"kind": "search"}, run_record(gpu2), {"kind": "search"}]
    got = measured_header(cpu, records)
    assert (got["machine"], got["date"], got["command"]) == ("H200", "2026-11-27", "sgl-tts bench --stop-after 400")
    assert got["commands"] == ["sgl-tts bench --stop-after 400", "sgl-tts bench --stop-after 140"]
    assert got["pools"] == {"prm": 53350}   # the run's plan, not the rebuilding checkout's
    assert got["rebuilt"] == {"machine": "2-core CPU", "date": "2026-11-28", "command": "sgl-tts bench --report-only"}
    assert "differ" not in got and "kind" not in got and cpu["pools"] == {"prm": 4096}
    # the run that measured reports itself: nothing rebuilt
    assert "rebuilt" not in measured_header(gpu2, records)
    # two machines and two plans: both machines named, in order, and the differing setting named
    other = header("A100", "2026-11-26", "x", pools=9000)
    mixed = measured_header(cpu, [run_record(other), run_record(gpu1)])
    assert (mixed["machine"], mixed["date"]) == ("A100; H200", "2026-11-26; 2026-11-27")
    assert mixed["differ"] == ["pools"] and mixed["pools"] == {"prm": 9000}
    # records written before run records existed: this invocation's header, nothing claimed
    assert measured_header(cpu, [{"kind": "search"}]) is cpu


def test_report_only_needs_records(tmp_path, models, capsys):
    code = bench_main(["--generator", "qwen2.5-math-1.5b", "--prm", "skywork-prm-1.5b", "--n", "8",
                       "--models-dir", str(models), "--output", str(tmp_path / "none.jsonl"), "--report-only"])
    assert code == 1
    assert capsys.readouterr().err == f"sgl-tts bench: error: {tmp_path / 'none.jsonl'} holds no records to report\n"


# ------------------------------------------------------- the whole command, servers as child processes
FAKE_LAUNCH_SERVER = r'''
"""Stands in for ``python -m sglang.launch_server``: /health, /get_model_info and /generate as SGLang
answers them (random words for a generator, step-tag log-probabilities for a model named *prm*)."""
import argparse, json, os, random, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--tokenizer-path"):
    ap.add_argument(flag)
ap.add_argument("--port", type=int)
args, _ = ap.parse_known_args()
with open(os.environ["FAKE_SGLANG_LOG"], "a") as fh:
    fh.write(json.dumps({"argv": sys.argv[1:], "plugins": os.environ.get("SGLANG_PLUGINS"),
                         "observe_only": os.environ.get("SGLANG_TTS_OBSERVE_ONLY"),
                         "pid": os.getpid()}) + "\n")
vocab = json.load(open(os.path.join(args.model_path, "config.json")))["vocab_size"] - 4
is_prm = "prm" in os.path.basename(args.model_path)
rng, lock = random.Random(os.getpid()), threading.Lock()
# FAKE_DIE_AFTER: the plugin side's generator crashes after that many requests
die_after = int(os.environ.get("FAKE_DIE_AFTER", "0")) if "--tts-policy" in sys.argv and not is_prm else 0
served = [0]
# FAKE_HOLD_AFTER: the plugin side's generator holds every request after that many (a search caught
# mid-flight), and says so in FAKE_SGLANG_LOG + ".held"
hold_after = int(os.environ.get("FAKE_HOLD_AFTER", "0")) if "--tts-policy" in sys.argv and not is_prm else 0

def generate(text, sp):
    n = int(sp.get("max_new_tokens", 0))
    with lock:
        words = " ".join(f"t{rng.randrange(vocab)}" for _ in range(n))
    p = len(text.split())
    return {"text": words, "meta_info": {"prompt_tokens": p, "cached_tokens": p // 2, "completion_tokens": n,
                                         "finish_reason": {"type": "length", "length": n}}}

def logprobs(ids, start, wanted):
    entries = [None] + [[[-0.5, t, None] for t in wanted] for _ in range(start + 1, len(ids))]
    return {"text": "", "meta_info": {"input_token_ids_logprobs": entries, "prompt_tokens": len(ids),
                                      "cached_tokens": 0, "completion_tokens": 0}}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/metrics":   # SGLang's counters, with --enable-metrics only (as SGLang)
            if "--enable-metrics" not in sys.argv:
                self.send_error(404)
                return
            # in SGLang's exposition format: one counter under two label sets, comments, one never set
            data = (f"# HELP sglang:evicted_tokens_total x\n# TYPE sglang:evicted_tokens_total counter\n"
                    f'sglang:evicted_tokens_total{{cache_type="RadixCache"}} {3.0 * served[0]}\n'
                    f'sglang:evicted_tokens_total{{cache_type="Other"}} {1.0 * served[0]}\n'
                    f'sglang:num_retracted_requests_total{{model_name="m"}} {float(served[0] // 10)}\n'
                    )
            if os.environ.get("SGLANG_PLUGINS") != "none":   # the observer, as the plugin names it
                data += (f"sgl_tts_recomputed_blocks_total {2.0 * served[0]}\n"
                         f"sgl_tts_prefill_computed_tokens_total {100.0 * served[0]}\n"
                         f'sgl_tts_scheduler_rounds_total{{mode="prefill"}} {1.0 * served[0]}\n'
                         f'sgl_tts_scheduler_rounds_total{{mode="decode"}} {3.0 * served[0]}\n'
                         f'sgl_tts_scheduler_round_seconds_total{{mode="prefill"}} {0.002 * served[0]}\n'
                         f'sgl_tts_scheduler_round_seconds_total{{mode="decode"}} {0.0006 * served[0]}\n')
            data = data.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send({"model_path": args.model_path, "is_generation": True})
    def do_POST(self):
        if self.path.startswith("/flush_cache"):   # FAKE_FLUSH_FAILS: refused, as SGLang with requests pending
            refused = os.environ.get("FAKE_FLUSH_FAILS") == "1"
            data = b"Timed out waiting for idle state." if refused else b"Cache flushed."
            self.send_response(400 if refused else 200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        served[0] += 1
        if die_after and served[0] > die_after:
            print("CUDA error: an illegal memory access was encountered", flush=True)
            os._exit(3)
        if hold_after and served[0] > hold_after:
            open(os.environ["FAKE_SGLANG_LOG"] + ".held", "w").close()
            threading.Event().wait()
        if "input_ids" in body:
            self.send([logprobs(*x) for x in zip(body["input_ids"], body["logprob_start_len"],
                                                 body["token_ids_logprob"])])
        elif isinstance(body["text"], list):
            self.send([generate(t, body["sampling_params"]) for t in body["text"]])
        else:
            self.send(generate(body["text"], body["sampling_params"]))

class S(ThreadingHTTPServer):
    request_queue_size, daemon_threads = 256, True

print("The server is fired up and ready to roll!", flush=True)
S((args.host, args.port), H).serve_forever()
'''


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """Child processes run ``python -m sglang.launch_server`` from a stand-in package (the test's own
    process keeps the real SGLang)."""
    import sglang

    real = Path(sglang.__file__).parent
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    # the real package behind the stand-in's launch_server: a client started with this path needs its
    # names; the stand-in server itself needs none of them, and importing them (torch, transformers)
    # cost each of the module's 14 server starts seconds
    (pkg / "__init__.py").write_text(f"import sys as _sys\n__path__.append({str(real)!r})\n"
                                     f"if _sys.orig_argv[1:3] != ['-m', 'sglang.launch_server']:\n"
                                     f"    exec(compile(open({str(real / '__init__.py')!r}).read(), "
                                     f"{str(real / '__init__.py')!r}, 'exec'))\n")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    log = tmp_path / "launches.jsonl"
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "fake"),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    return log


def _bench_args(tmp_path, models, *extra):
    return (["--generator", "qwen2.5-math-1.5b", "--prm", "skywork-prm-1.5b", "--gpu-memory",
                       "0.4*24GiB", "--n", "4", "8", "--problems", "1", "--beam-width", "2", "--prompt-tokens", "10",
                       "--trace-median", "6", "--trace-sigma", "0.5", "--trace-max-tokens", "20",
                       "--trace-max-depth", "6", "--limit-tokens", "4", "--server-args", "",
                       "--generator-port", str(free_port()), "--prm-port", str(free_port()),
                       "--models-dir", str(models), "--output", str(tmp_path / "run.jsonl"),
                       "--health-timeout", "60", "--no-progress", *extra])


def _bench(tmp_path, models, *extra):
    return bench_main(_bench_args(tmp_path, models, *extra))


def _launches(log):
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _wait_until_held(proc, log, timeout: float = 120.0) -> None:
    """Wait until the fake plugin-side generator holds its requests (``FAKE_HOLD_AFTER``): the
    command ``proc`` is then certainly mid-run."""
    import time

    held = Path(str(log) + ".held")
    deadline = time.monotonic() + timeout
    while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held.exists(), proc.communicate(timeout=60)[1][-3000:] if proc.poll() is not None else "never held"


def test_the_command_runs_both_sides_resumes_after_a_crash_and_reports(tmp_path, models, fake_sglang, monkeypatch, capsys):
    # the sgl-tts side's generator dies after 40 requests: the stock side's searches are kept
    monkeypatch.setenv("FAKE_DIE_AFTER", "40")
    assert _bench(tmp_path, models) == 1
    err = capsys.readouterr().err
    assert "sgl-tts bench: error: sgl-tts: the generator server exited with code 3 during the searches" in err
    assert "CUDA error: an illegal memory access" in err and "run again to resume" in err
    # the failed program's forks are stopped (SGLang's non-daemon workers), so the process can exit
    workers = [t for t in threading.enumerate() if t.name.endswith("(run)") and not t.daemon]
    for t in workers:
        t.join(timeout=10)
    assert not [t for t in workers if t.is_alive()]
    launches = _launches(fake_sglang)
    assert [("--tts-policy" in x["argv"], x["plugins"]) for x in launches] == [
        (False, "sgl-tts"), (False, "sgl-tts"), (True, None), (False, None)]   # stock gen, PRM; sgl-tts gen, PRM
    assert [x["observe_only"] for x in launches] == ["1", "1", None, None]
    kept = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert {(r["side"], r["algorithm"], r["n"]) for r in kept if r["kind"] == "search"} >= {
        ("stock", a, n) for a in ("beam_search", "dvts") for n in (4, 8)}
    # again without the crash: only the sgl-tts side starts, and finishes
    monkeypatch.delenv("FAKE_DIE_AFTER")
    assert _bench(tmp_path, models) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    again = _launches(fake_sglang)[len(launches):]
    assert [("--tts-policy" in x["argv"], x["plugins"]) for x in again] == [(True, None), (False, None)]
    assert all("--tokenizer-path" in x["argv"] and "--load-format" in x["argv"] for x in again)
    records = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()][1:]
    searches = sorted((r["side"], r["algorithm"], r["n"]) for r in records if r["kind"] == "search")
    assert searches == sorted((s, a, n) for s in ("stock", "sgl-tts") for a in ("beam_search", "dvts") for n in (4, 8))
    summary = json.loads((tmp_path / "run.summary.json").read_text())
    assert [(r["algorithm"], r["n"], r["kept_beams_match"]) for r in summary["rows"]] == [
        ("beam_search", 4, True), ("beam_search", 8, True), ("dvts", 4, True), ("dvts", 8, True)]
    assert all(r["limit_goodput"] > 0 for r in summary["rows"])
    # SGLang's counters (the stand-in: 3 + 1 evicted tokens per request under two label sets), read
    # before and after each side's searches: one record per side that finished its searches
    counted = [r for r in records if r["kind"] == "counters"]
    assert [r["side"] for r in counted] == ["stock", "sgl-tts"]
    for side, c in summary["server_counters"].items():
        assert c["evicted_tokens"] > 0 and c["evicted_tokens"] % 4 == 0 and c["retracted_prompt_tokens"] == 0, side
        # the observer's counters on every side (stock: the plugin observe-only), per request served:
        # 2 recomputed blocks, 100 prefilled tokens, 1 prefill round of 2 ms and 3 decode rounds of 0.2 ms
        served = c["evicted_tokens"] / 4
        assert (c["recomputed_blocks"], c["prefill_computed_tokens"]) == (2 * served, 100 * served), side
        assert (c["prefill_rounds"], c["decode_rounds"]) == (served, 3 * served), side
    md = (tmp_path / "run.md").read_text()
    assert ("| side | generator tokens evicted | requests retracted | their prompt tokens | recomputed prompt tokens "
            "| prefill tokens computed | scheduler ms per prefill round | scheduler ms per round |") in md
    stock = summary["server_counters"]["stock"]
    assert (f"| stock | {stock['evicted_tokens']:.0f} | {stock['retracted_requests']:.0f} | 0 | "
            f"{32 * stock['evicted_tokens'] / 4:.0f} | {100 * stock['evicted_tokens'] / 4:.0f} | 2.000 | 0.650 |") in md
    assert md == out.rstrip("\n") + "\n" or md.rstrip() in out
    assert "- machine: " in md and "- date: " in md and "- command: `sgl-tts bench --generator qwen2.5-math-1.5b" in md
    assert (tmp_path / "run.png").stat().st_size > 10_000
    # a third run has nothing to do: no server starts, the same report
    assert _bench(tmp_path, models) == 0
    assert len(_launches(fake_sglang)) == len(launches) + 2
    # each run wrote where, when and how it ran; a report rebuilt on another machine still names the
    # machine that measured, and says where it was rebuilt
    from sgl_tts.machine import describe
    runs = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines() if '"kind": "run"' in x]
    assert len(runs) == 3 and {r["machine"] for r in runs} == {describe()}
    capsys.readouterr()
    monkeypatch.setattr("sgl_tts.machine.describe", lambda: "a laptop")
    assert _bench(tmp_path, models, "--report-only") == 0
    md = (tmp_path / "run.md").read_text()
    assert f"- machine: {runs[0]['machine']}\n" in md
    assert "- command: " + "; then ".join(f"`{r['command']}`" for r in runs) + "\n" in md
    rebuilt = [line for line in md.splitlines() if line.startswith("- report rebuilt")]
    assert len(rebuilt) == 1 and ", a laptop, `sgl-tts bench --generator" in rebuilt[0]
    assert rebuilt[0].endswith("--report-only`")
    assert json.loads((tmp_path / "run.summary.json").read_text())["header"]["machine"] == runs[0]["machine"]


def test_stop_after_leaves_the_rest_for_the_next_run(tmp_path, models, fake_sglang, capsys):
    assert _bench(tmp_path, models, "--stop-after", "0") == 3
    assert "--stop-after reached with work left (9 searches or measurements)" in capsys.readouterr().err
    assert _launches(fake_sglang) == []   # no server was started for nothing


def test_a_server_that_refuses_the_flush_between_two_sides_stops_the_run_naming_them(tmp_path, models, fake_sglang,
                                                                                    monkeypatch, capsys):
    """Two sides on one start of the servers: the first side's searches are kept, and a server that
    does not empty its cache before the second (SGLang answers 400 when it stays busy) stops the run
    with the side and the server's reason, rather than measuring the second side on a warm cache."""
    monkeypatch.setenv("FAKE_FLUSH_FAILS", "1")
    one = ("--n", "4", "--algorithms", "beam_search", "--sides", "sgl-tts", "sgl-tts+overlap")
    assert _bench(tmp_path, models, *one) == 1
    err = capsys.readouterr().err
    assert ("sgl-tts+overlap: the generator server did not flush its cache between two sides: Timed out "
            "waiting for idle state.") in err
    assert len(_launches(fake_sglang)) == 2   # one start of the pair
    records = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [(r["side"], r["algorithm"]) for r in records if r["kind"] == "search"] == [("sgl-tts", "beam_search")]


def test_sigterm_mid_search_stops_both_sides_servers_ends_the_forks_and_keeps_what_finished(tmp_path, models,
                                                                                           fake_sglang, monkeypatch):
    """``timeout`` or a job runner ends the command with SIGTERM: the servers (own process groups)
    must not outlive it, and a search caught mid-flight has its forks' workers (SGLang's non-daemon
    executor threads) ended too, so the command exits with 130 instead of waiting on them forever.
    (One command for both: each check once had a test and a command of its own.)"""
    import os
    import signal
    import subprocess
    import sys

    # the stock side runs to its end; the plugin side's generator then holds its requests after the
    # fifth, so the signal finds the command mid-run (a fixed wait once lost the race: the whole
    # command had finished before the signal came, and exited 0): that side's first search (n=4) has
    # its 4 first steps and one second step answered, then the rest is held: one fork waits idle for
    # work while the others wait on the server
    monkeypatch.setenv("FAKE_HOLD_AFTER", "5")
    # A signal that lands inside ``ProgramState.__del__`` (or between a fork's executor and its state)
    # is swallowed there, and that executor's worker is never ended; make every state's end go missing
    # so the command cannot rely on it
    code = ("import sys; from sglang.lang.interpreter import ProgramState; ProgramState.__del__ = lambda self: None; "
            "from sgl_tts.cli import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", code, "bench", *_bench_args(tmp_path, models, "--n", "4")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_until_held(proc, fake_sglang)
    assert len(_launches(fake_sglang)) == 4   # both sides' generator and PRM
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "stopped; finished searches are kept in" in err, err[-3000:]
    # (the command reaps each server it stops, so a server still there outlived it)
    for launch in _launches(fake_sglang):
        with pytest.raises(ProcessLookupError):
            os.kill(launch["pid"], 0)
    # what finished is kept: the stock side's searches, and none of the side the signal stopped
    records = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert sorted((r["side"], r["algorithm"]) for r in records if r.get("kind") == "search") == [
        ("stock", "beam_search"), ("stock", "dvts")]


def test_the_device_call_script_resumes_and_copies_its_files_out(tmp_path, models):
    """tools/gpu/bench-call.sh as a device call runs it (python3 on PATH, $OUT set), with no time
    left: it plans, starts nothing, exits 3 and still hands back its log, report and records."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "SGLANG_TTS_SITE": str(tmp_path / "site"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "SGLANG_TTS_BENCH_EXTRA": f"--models-dir {models}"}
    run = subprocess.run(["bash", str(root / "tools" / "gpu" / "bench-call.sh"), "1.5b+1.5b", "0"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stdout + run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["1.5b+1.5b.jsonl", "1.5b+1.5b.log", "1.5b+1.5b.md",
                                                      "1.5b+1.5b.summary.json"]
    settings = json.loads((out / "1.5b+1.5b.jsonl").read_text().splitlines()[0])["settings"]
    assert settings["n"] == [8, 64, 512] and settings["problems"] == 1
    assert "--stop-after reached with work left" in (out / "1.5b+1.5b.log").read_text()
    bad = subprocess.run(["bash", str(root / "tools" / "gpu" / "bench-call.sh"), "70b+70b"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown config 70b+70b" in bad.stderr


def test_speculative_sides_keep_the_stock_sides_beams_and_report_their_tokens(words):
    """The ablation's sides (speculation exact, + LookAhead, + overlapped verification) run the same
    trace: every kept beam is the stock side's, and the records carry the speculative tokens."""
    from sgl_tts.bench.sides import ALL_SIDES

    cfg = settings(algorithms=("beam_search", "dvts"), n=(4,), problems=2)
    sides = [s for s in ALL_SIDES if s == "stock" or "+spec" in s]
    records = []
    servers = {side: (WordGenerator(words, k + 1), WordPRM(words)) for k, side in enumerate(sides)}
    try:
        for side, (gen, prm) in servers.items():
            run_side(side, gen.url, prm.url, cfg, prm_tokenizer=str(words), generator_tokenizer=str(words),
                     vocab=VOCAB - 4, write=records.append, progress=False)
    finally:
        for pair in servers.values():
            for srv in pair:
                srv.close()
    rows = summarize(records, cfg)
    assert [(r.algorithm, r.n, r.match, sorted(r.sides)) for r in rows] == \
        [(a, 4, True, sorted(sides)) for a in ("beam_search", "dvts")]
    spec = [r for r in records if r["kind"] == "search" and r["side"] != "stock"]
    assert all(r["tokens_speculative"] > 0 for r in spec)
    assert sum(r["tokens_reused"] for r in spec) > 0
    assert all(r["tokens_reused"] <= r["tokens_speculative"] <= r["tokens_generated"] for r in spec)
    report = format_report(rows)
    assert "sgl-tts+spec+lookahead+overlap" in report and "speculative (reused)" in report


def test_each_side_s_program_arguments_come_from_the_registry_as_sgl_tts_run_gives_them():
    """A side's searches get the arguments `sgl-tts run` would give for its settings: the trace's
    depth and step cap, the bench's width, temperature and seed, the side's speculation, and every
    other argument at the program's own default (what the hand-written mapping ran before)."""
    import inspect

    from sgl_tts.bench.sides import ALL_SIDES, run_config
    from sgl_tts.experiment import program_function
    from sgl_tts.search.speculation import Speculation

    cfg = settings()
    trace = cfg.step_trace()
    policies = {}
    for side in ALL_SIDES:
        for algorithm in cfg.algorithms:
            args = run_config(side, algorithm, 8, cfg, trace).program_arguments("q", "the prm")
            own = dict(question="q", prm="the prm", num_beams=8, beam_width=cfg.beam_width, max_depth=trace.max_depth,
                       step_tokens=trace.max_tokens, sampling_temperature=cfg.temperature, seed=cfg.seed)
            assert {k: args[k] for k in own} == own, (side, algorithm)
            params = inspect.signature(program_function(algorithm).func).parameters
            rest = {k: v for k, v in args.items()
                    if k not in own and k not in ("speculative", "overlap_verification", "overlap_by_family")}
            assert rest == {k: params[k].default for k in rest}, (side, algorithm)
            policies[side, algorithm] = (Speculation.of(args.get("speculative", False)),
                                         args.get("overlap_verification", False) + args.get("overlap_by_family", False))
    for algorithm in cfg.algorithms:
        # the three stock sides, the sgl-tts client on stock servers (stock+overlap), then sgl-tts, its ablation, sgl-tts+locality, its two rules alone and
        # with whole families (server policies only), sgl-tts+auto (the controller; its curve is
        # measured when the side starts: none here, so the search is left to measure its server's) and sgl-tts+overlap (overlapped verification
        # alone), the two together, and overlap on the locality servers, by beam then by family, and by
        # family with whole families, then overlap beam by beam with whole families, then the oldest
        # search first without and with overlap (1: overlapped verification, 2: overlapped by family)
        assert [policies[side, algorithm] for side in ALL_SIDES] == [
            (None, 0), (None, 0), (None, 0), (None, 1), (None, 0), (Speculation(lookahead=False), 0),
            (Speculation(), 0), (Speculation(), 1), (None, 0), (None, 0), (None, 0), (None, 0),
            (Speculation(controlled=True, verifier_shares_device=True, measure_curve=True), 0), (None, 1),
            (Speculation(controlled=True, verifier_shares_device=True, measure_curve=True), 1), (None, 1),
            (None, 2), (None, 2), (None, 1), (None, 0), (None, 1)]


def test_sglang_s_own_counters_are_read_from_its_exposition():
    """The counter names are SGLang 0.5.15's: its own radix-cache metrics collector (evicting twice
    under one cache type, once under another) writes the eviction counter's text, into a registry of
    its own (through SGLang's own hook for other metric classes: Prometheus' default registry takes a
    name once per process); the retraction counters, whose collector needs a whole server's
    arguments, are written as SGLang's exposition writes them, by the names its collector registers.
    The bench sums label sets."""
    import functools
    import inspect

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from sglang.srt.observability import metrics_collector

    from sgl_tts.bench.server_counters import (COUNTERS, OBSERVER_COUNTERS, delta, format_counters, parse_counters,
                                               per_side)

    source = inspect.getsource(metrics_collector)
    assert all(f'name="{metric}"' in source for metric in COUNTERS.values())
    registry = CollectorRegistry()

    class Collector(metrics_collector.RadixCacheMetricsCollector):
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    a = Collector(labels={"cache_type": "RadixCache"})
    a.increment_eviction_num_tokens(5)
    a.increment_eviction_num_tokens(7)
    a.eviction_num_tokens.labels(cache_type="HiRadixCache").inc(1)
    text = generate_latest(registry).decode()
    text += ('# HELP sglang:num_retracted_requests_total x\n# TYPE sglang:num_retracted_requests_total counter\n'
             'sglang:num_retracted_requests_total{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",'
             'tp_rank="0"} 3.0\nsglang:num_retracted_input_tokens_total{model_name="m"} 400.0\n'
             'sglang:num_retracted_output_tokens_total{model_name="m"} 44.0\n')
    got = parse_counters(text)
    unobserved = dict.fromkeys(OBSERVER_COUNTERS)   # a server without the sgl-tts observer has none of its series
    sglang_own = {"evicted_tokens": 13.0, "retracted_requests": 3.0, "retracted_prompt_tokens": 400.0}
    assert got == {**sglang_own, **unobserved}
    assert parse_counters("# nothing set yet\n") == {"evicted_tokens": 0.0, "retracted_requests": 0.0,
                                                     "retracted_prompt_tokens": 0.0, **unobserved}
    assert delta({"evicted_tokens": 3.0, "retracted_requests": 1.0, "retracted_prompt_tokens": 100.0}, got) == {
        "evicted_tokens": 10.0, "retracted_requests": 2.0, "retracted_prompt_tokens": 300.0, **unobserved}
    # a side resumed after a crash has one record per part that ran: summed
    sides = per_side([{"kind": "counters", "side": "stock", **got}, {"kind": "search", "side": "stock"},
                      {"kind": "counters", "side": "stock", **got}, {"kind": "counters", "side": "sgl-tts", **got}])
    assert sides["stock"] == {**{k: 2 * v for k, v in sglang_own.items()}, **unobserved} and sides["sgl-tts"] == got
    assert format_counters(sides, ["stock", "stock-lpm", "sgl-tts"]).splitlines()[2:] == [
        "| stock | 26 | 6 | 800 | - | - | - | - |", "| sgl-tts | 13 | 3 | 400 | - | - | - | - |"]


# what a live observe-only CPU server (tests/test_live_observer.py's) answered on /metrics, as Prometheus'
# multiprocess collector names the observer's counters there: a ``_total`` suffix, the ``mode`` label
OBSERVER_EXPOSITION = """\
# HELP sgl_tts_scheduler_rounds_total scheduler rounds that formed a batch (get_next_batch_to_run)
# TYPE sgl_tts_scheduler_rounds_total counter
sgl_tts_scheduler_rounds_total{mode="prefill"} 7.0
sgl_tts_scheduler_rounds_total{mode="decode"} 20.0
# HELP sgl_tts_scheduler_round_seconds_total seconds the scheduler spent forming those batches
# TYPE sgl_tts_scheduler_round_seconds_total counter
sgl_tts_scheduler_round_seconds_total{mode="prefill"} 0.0210616840047296137
sgl_tts_scheduler_round_seconds_total{mode="decode"} 0.0028481830009259284
# HELP sgl_tts_prefill_cached_tokens_total prompt tokens served from the prefix cache
# TYPE sgl_tts_prefill_cached_tokens_total counter
sgl_tts_prefill_cached_tokens_total 15.0
# HELP sgl_tts_prefill_computed_tokens_total prompt tokens prefilled
# TYPE sgl_tts_prefill_computed_tokens_total counter
sgl_tts_prefill_computed_tokens_total 1301.0
# HELP sgl_tts_recomputed_blocks_total prefix blocks computed again (thrashing)
# TYPE sgl_tts_recomputed_blocks_total counter
sgl_tts_recomputed_blocks_total 26.0
# HELP sgl_tts_evicted_tokens_total tokens evicted from the radix cache
# TYPE sgl_tts_evicted_tokens_total counter
sgl_tts_evicted_tokens_total 863.0
sglang:evicted_tokens_total{cache_type="RadixCache",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 863.0
sglang:cuda_graph_passes_total{engine_type="unified",mode="prefill_none",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 7.0
sgl_tts_batch_size_sum 27.0
sgl_tts_batch_size_bucket{le="1.0"} 27.0
"""


def test_the_observer_s_counters_are_read_from_the_multiprocess_exposition():
    """The sgl-tts observer's counters (every side's: the stock sides run the plugin observe-only) as
    the live server names them: recomputed prompt tokens are the recomputed blocks x 16 (block-granular),
    the rounds are split by their ``mode`` label, and other series that share a name's start or a
    label (``sgl_tts_evicted_tokens_total``, SGLang's ``mode="prefill_none"``) are not counted."""
    from sgl_tts.bench.server_counters import (BLOCK_TOKENS, delta, format_counters, ms_per_round, parse_counters,
                                               per_side, recomputed_prompt_tokens)

    got = parse_counters(OBSERVER_EXPOSITION)
    assert got == {"evicted_tokens": 863.0, "retracted_requests": 0.0, "retracted_prompt_tokens": 0.0,
                   "recomputed_blocks": 26.0, "prefill_computed_tokens": 1301.0, "prefill_rounds": 7.0,
                   "decode_rounds": 20.0, "prefill_round_seconds": 0.0210616840047296137,
                   "decode_round_seconds": 0.0028481830009259284}
    assert BLOCK_TOKENS == 16 and recomputed_prompt_tokens(got) == 416.0
    assert ms_per_round(got, ("prefill",)) == pytest.approx(3.00881, abs=1e-5)
    assert ms_per_round(got) == pytest.approx(1000 * (0.0210616840047296137 + 0.0028481830009259284) / 27)
    start = {**got, "recomputed_blocks": 6.0, "prefill_rounds": 2.0, "prefill_round_seconds": 0.0010616840047296137}
    side = delta(start, got)
    assert (side["recomputed_blocks"], side["prefill_rounds"], side["decode_rounds"]) == (20.0, 5.0, 0.0)
    assert ms_per_round(side, ("prefill",)) == pytest.approx(4.0) and ms_per_round(side) == pytest.approx(4.0)
    assert ms_per_round({**side, "prefill_rounds": 0.0}) is None     # no round, no time per round
    # records written before the observer was read (no such fields) report "-", alone or mixed in
    old = {"kind": "counters", "side": "stock", "evicted_tokens": 5.0, "retracted_requests": 0.0,
           "retracted_prompt_tokens": 0.0}
    sides = per_side([old, {"kind": "counters", "side": "sgl-tts", **side},
                      {"kind": "counters", "side": "stock-lpm", **side}, {**old, "side": "stock-lpm"}])
    assert sides["stock"]["recomputed_blocks"] is None and sides["stock-lpm"]["prefill_rounds"] is None
    assert sides["stock-lpm"]["evicted_tokens"] == 5.0
    assert format_counters(sides, ["stock", "stock-lpm", "sgl-tts"]).splitlines()[2:] == [
        "| stock | 5 | 0 | 0 | - | - | - | - |", "| stock-lpm | 5 | 0 | 0 | - | - | - | - |",
        "| sgl-tts | 0 | 0 | 0 | 320 | 0 | 4.000 | 4.000 |"]


def test_the_plot_draws_every_side_that_ran(tmp_path, monkeypatch):
    """Each side that ran has its goodput line and its latency bar, whatever its place in ALL_SIDES
    (a fixed list of five styles zipped with ALL_SIDES once left every later side, the locality
    and overlap sides among them, out of the goodput panel)."""
    import matplotlib.figure

    from sgl_tts.bench.goodput_report import ReportRow, SideRow, plot_report
    from sgl_tts.bench.sides import ALL_SIDES

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def look_then_save(fig, *args, **kwargs):
        top, bottom = fig.axes[0], fig.axes[1]
        drawn["lines"] = [line.get_label() for line in top.get_lines()]
        drawn["markers"] = [line.get_marker() for line in top.get_lines()]
        drawn["bars"] = [t.get_text() for t in bottom.get_xticklabels()]
        drawn["title"] = fig.get_suptitle()
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", look_then_save)
    ran = ["stock", "stock-dfs-weight", "sgl-tts+locality", "sgl-tts+locality+overlap"]
    rows = [ReportRow("beam_search", n, {side: SideRow(1, 1.0 + i, 10.0, 8.0, 2.0, 100, 50, 0.9, 0.8)
                                         for i, side in enumerate(ran)}, 3.0, n, True, []) for n in (64, 128)]
    plot_report(rows, tmp_path / "p.png", title="x " * 200)
    assert drawn["lines"] == [s for s in ALL_SIDES if s in ran] + ["generator-bound limit"]
    # every line has a marker, the limit's too: a run of one n draws single points
    assert all(m not in ("None", "", " ", None) for m in drawn["markers"]), drawn["markers"]
    assert len(drawn["bars"]) == 2 * len(ran)
    assert max(len(line) for line in drawn["title"].splitlines()) <= 15 * 6


def test_a_server_that_never_says_its_cached_tokens_has_no_hit_rate():
    """SGLang's /classify answers (a step-pooled PRM's) carry no cached tokens: its hit rate is
    unknown (the report says n/a), not 0; records written before the count say it for every answer."""
    import dataclasses

    from sgl_tts.bench.goodput_report import _share, _side_row
    from sgl_tts.bench.goodput_trace import Meter

    said, silent = Meter(), Meter()
    said.add({"prompt_tokens": 10, "cached_tokens": 4})
    silent.add({"prompt_tokens": 10})
    assert (said.cached_reported, silent.cached_reported) == (1, 0)
    old = dataclasses.asdict(said)
    del old["cached_reported"]

    def row(prm: dict):
        return _side_row([{"trajectory_seconds": 1.0, "trajectory_tokens": 5, "seconds": 1.0,
                           "generator_seconds": 0.5, "verifier_seconds": 0.5, "tokens_generated": 5,
                           "tokens_kept": 5, "generator": dataclasses.asdict(said), "prm": prm}])

    assert row(dataclasses.asdict(said)).prm_hit_rate == row(old).prm_hit_rate == pytest.approx(0.4)
    assert row(dataclasses.asdict(silent)).prm_hit_rate is None
    assert (_share(None), _share(0.4)) == ("n/a", "40.0%")
