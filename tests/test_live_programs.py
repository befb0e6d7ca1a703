"""Every program through SGLangEndpoint on the live generator, scored by the live PRM server, against
the same program on LocalBackend: accuracy on 20 test problems (12 for the variants) agrees within a
binomial tolerance, and every step score the live PRM gave equals the local PRM's to 1e-3. The local
reference runs on one generator and PRM opened for the module, beside the live run. The
reward-head PRM through a live ``/classify`` server scores as the step-tag PRM does."""

from __future__ import annotations

import concurrent.futures as cf
import os
import dataclasses
import math

import pytest

from sgl_tts.tiny import task
from sgl_tts.backends import LocalBackend, SGLangEndpoint
from sgl_tts.experiment import RunConfig, run
from sgl_tts.models import shipped_model
from sgl_tts.prm import RewardHeadPRM, StepTagPRM

pytestmark = pytest.mark.server

PROBLEMS = 20   # the live runs are most of this file's ~3 minutes; CI runs it on 2 busy cores
# (program, settings): beam search and its variants, DVTS, best-of-N, particle filtering, all at N = 4
CASES = {
    "beam_search": dict(program="beam_search", n=4, beam_width=2),
    "beam_search_proportional": dict(program="beam_search", n=4, beam_width=2, branching="proportional"),
    "beam_search_schedule": dict(program="beam_search", n=4, beam_width=2, step_tokens=[8, 64]),
    "beam_search_lookahead": dict(program="beam_search", n=4, beam_width=2, lookahead=1),
    "beam_search_search_and_learn": dict(program="beam_search", n=4, beam_width=2, semantics="search-and-learn",
                                         filter_duplicates=True, max_depth=8),
    "dvts": dict(program="dvts", n=4, beam_width=2),
    "best_of_n": dict(program="best_of_n", n=4),
    "particle_filtering": dict(program="particle_filtering", n=4, resampling="systematic"),
}
# the variants cost more per problem (lookahead rolls out every candidate): fewer problems
PROBLEMS_OF = {"beam_search_lookahead": 12, "beam_search_schedule": 12, "beam_search_proportional": 12,
               "beam_search_search_and_learn": 12, "particle_filtering": 12}


def binomial_tolerance(p: float, n: int) -> float:
    """Three standard errors of the difference of two independent accuracies over n problems each
    (0.47 at p = 0.5, n = 20): two runs sample independently, so only this much agreement is owed."""
    p = min(max(p, 1 / n), 1 - 1 / n)
    return 3 * math.sqrt(2 * p * (1 - p) / n)


IN_FLIGHT = 16


@pytest.fixture(scope="module")
def local_backends():
    """The local runs' generator and PRM, opened once for every case as ``sgl-tts run`` opens them
    for 16 searches in flight (engines in processes, the generator one per core)."""
    import sgl_tts
    from sgl_tts.experiment.driver import open_prm

    cfg = RunConfig(**CASES["beam_search"], in_flight=IN_FLIGHT, seed=3)
    generator = sgl_tts.connect(None, local_options=cfg.engine_layout.options())
    prm, prm_backend = open_prm(cfg)
    yield generator, prm
    generator.shutdown()
    prm_backend.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_program_on_live_servers_matches_local(case, live, local_backends, local_prm, tmp_path):
    limit = PROBLEMS_OF.get(case, PROBLEMS)
    # 16 problems in flight: the server batches their requests (one request decodes ~6x slower on
    # SGLang's CPU path than on LocalBackend; 64 at once run near the server's peak)
    base = RunConfig(**CASES[case], limit=limit, in_flight=IN_FLIGHT, progress=False, seed=3)
    local = dataclasses.replace(base, output=str(tmp_path / "local.jsonl"))
    remote = dataclasses.replace(base, output=str(tmp_path / "live.jsonl"), generator=live.url("generator"),
                                 prm=live.url("prm"))
    # the local reference runs beside the live run: the live run leaves the cores idle between its
    # steps (one OpenMP thread per server, HTTP round trips), the local engines fill them
    with cf.ThreadPoolExecutor(1) as pool:
        generator, prm = local_backends
        reference = pool.submit(run, local, generator=generator, prm=prm)
        s_live, records = run(remote)
        s_local, _ = reference.result()
    assert s_live.problems == s_local.problems == limit
    for rule in ("majority", "prm_weighted"):
        a, b = s_live.accuracy[rule], s_local.accuracy[rule]
        assert abs(a - b) <= binomial_tolerance((a + b) / 2, limit), (rule, a, b)
    # the live PRM's step scores are the local PRM's, step prefix by step prefix
    checked = 0
    for rec in records:
        trajectories = [t for t in rec["trajectories"] if t["steps"]]
        want = local_prm.score(rec["question"], [t["steps"] for t in trajectories])
        for t, w in zip(trajectories, want):
            assert len(t["step_scores"]) == len(w)
            assert max(abs(a - b) for a, b in zip(t["step_scores"], w)) < 1e-3, (rec["question"], t["steps"])
            checked += len(w)
    assert checked >= limit * 2


def _slipped(solution: str) -> list[list[str]]:
    good = solution.split("\n\n")
    bad = list(good)
    bad[1] = bad[1][:-1] + str((int(bad[1][-1]) + 1) % 10)   # a slipped digit in step 2
    return [good, bad, good[:2]]


def test_step_tag_prm_on_live_server_scores_as_local(live, local_prm):
    remote = StepTagPRM(SGLangEndpoint(live.url("prm")))
    for p in task.test_split()[:6]:
        batch = _slipped(p.solution())
        want = local_prm.score(p.question, batch)
        got = remote.score(p.question, batch)
        for g, w in zip(got, want):
            assert len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w)) < 1e-3, (p.question, g, w)
        assert want[1][1] < want[0][1]   # and the scores mean something: the slipped step scores lower


def test_reward_head_prm_on_live_classify_scores_as_the_step_tag_prm(live, tiny_model_path):
    # the reward-head form of a (random, seeded) tiny Qwen2 served at /classify: the head's P(good)
    # at each step end must be the step-tag P(+) of the model it was written from
    from sgl_tts.backends.classifier import LocalClassifier

    endpoint = SGLangEndpoint(live.url("reward_head"))
    head = RewardHeadPRM(endpoint)
    local = LocalBackend(str(tiny_model_path))
    try:
        tag = StepTagPRM(local)
        for p in task.test_split()[:6]:
            batch = _slipped(p.solution())
            want, got = tag.score(p.question, batch), head.score(p.question, batch)
            for g, w in zip(got, want):
                assert len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w)) < 1e-3, (p.question, g, w)
        # the random model's P(good) underflows to 0 everywhere, so compare the head's raw logits too:
        # /classify's two class logits at the end of every step prefix equal the local classifier's
        ids = [endpoint.encode(p.question + "\n\n" + "\n\n".join(p.solution().split("\n\n")[:k]) + "\n\n")
               for p in task.test_split()[:4] for k in (1, 2, 3)]
        got_logits = endpoint.classify(ids)
        want_logits = LocalClassifier(str(live.specs["reward_head"].model)).classify(ids)
        assert all(len(g) == 2 for g in got_logits)
        for g, w in zip(got_logits, want_logits):
            assert max(abs(a - b) for a, b in zip(g, w)) < 1e-3 * max(1.0, max(abs(x) for x in w)), (g, w)
        assert len({round(g[1] - g[0], 3) for g in got_logits}) > 3     # they vary with the input
    finally:
        local.shutdown()


def test_cpu_serving_refuses_the_tiny_prms_classifier_form(tmp_path):
    from sgl_tts.launch.cpu_serving import cpu_server_flags
    from sgl_tts.models.reward_head import write_reward_head

    head = write_reward_head(shipped_model("prm"), tmp_path / "head")
    with pytest.raises(ValueError, match="cannot serve this classifier right on the CPU"):
        cpu_server_flags(head, 64 << 20)


def test_cpu_servers_skip_the_sglang_model_modules_their_models_do_not_use(tmp_path, monkeypatch):
    """The environment a CPU server gets (``model_registry_env``) keeps the modules serving its
    model's architecture and SGLang's transformers fallback, adds to what the user disabled, and
    skips nothing for an architecture no SGLang module serves; SGLang's own registry, read under it,
    still has the generator's class and no longer Llama's."""
    import json
    import subprocess
    import sys

    from sgl_tts.launch.cpu_serving import model_registry_env

    monkeypatch.delenv("SGLANG_DISABLED_MODEL_ARCHS", raising=False)
    env = model_registry_env(shipped_model("generator"), shipped_model("prm"))
    skipped = env["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    assert {"llama", "qwen2_rm", "deepseek_v2"} <= set(skipped) and len(skipped) > 150
    assert not {"qwen2", "transformers", "registry"} & set(skipped)
    monkeypatch.setenv("SGLANG_DISABLED_MODEL_ARCHS", "my_model")
    assert model_registry_env(shipped_model("generator"))["SGLANG_DISABLED_MODEL_ARCHS"].split(",") \
        == sorted([*skipped, "my_model"])
    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    assert model_registry_env(alien) == model_registry_env(shipped_model("generator"), alien) == {}

    probe = ("import json; from sglang.srt.models.registry import ModelRegistry; "
             "print(json.dumps(sorted(ModelRegistry.get_supported_archs())))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "none", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    archs = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"Qwen2ForCausalLM", "TransformersForCausalLM"} <= archs and "LlamaForCausalLM" not in archs
