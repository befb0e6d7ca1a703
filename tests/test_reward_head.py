"""Reward-head PRMs (a value / classifier head read at the last token of each step prefix): on the
CPU through LocalClassifier and through SGLang's ``/classify`` wire format.

The model is the shipped step-tag PRM rewritten as a two-class sequence classifier whose head rows
are the LM head's ``-``/``+`` rows, so its class-1 probability at each step's tag must equal the
step-tag PRM's score there: an exact expectation for a real classifier-head checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest

from sgl_tts import LocalBackend, SGLangEndpoint
from sgl_tts.tiny import task
from sgl_tts.backends.classifier import LocalClassifier
from sgl_tts.models import shipped_model
from sgl_tts.models.reward_head import write_reward_head
from sgl_tts.prm import PRMScorer, RewardHeadPRM, StepTagPRM, head_score, tag_positions

from test_endpoint import ModelServer


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return write_reward_head(shipped_model("prm"), tmp_path_factory.mktemp("rh") / "reward-head")


@pytest.fixture(scope="module")
def step_tag():
    be = LocalBackend(shipped_model("prm"))
    yield StepTagPRM(be, cache=False)
    be.shutdown()


def batches():
    for p in task.test_split()[:5]:
        steps = p.step_texts()
        slipped = [steps[0].replace("=", "=1")] + steps[1:]
        yield p.question, [steps, steps[:2], slipped, ["Step 1: no\n\ntag"]]


def test_a_reward_head_scores_like_the_step_tag_prm_it_was_made_from(reward_model, step_tag):
    prm = RewardHeadPRM(LocalClassifier(reward_model))
    assert isinstance(prm, PRMScorer)
    lows = 0
    for question, batch in batches():
        got, want = prm.score(question, batch), step_tag.score(question, batch)
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=1e-4)
        assert got[3] == [0.0]  # a step holding the tag cannot be scored: zero, not a failure
        lows += got[2][0] < 0.5 < got[0][0]
    assert lows == 5  # the changed digit is caught through the head as well


def test_reward_head_cache_sends_each_step_prefix_once(reward_model):
    clf = LocalClassifier(reward_model)
    prm = RewardHeadPRM(clf)
    p = task.test_split()[7]
    steps = p.step_texts()
    for k in range(1, len(steps) + 1):
        prm.score(p.question, [steps[:k]] * 3)   # three beams sharing a path
    # each step prefix is sent once: the three copies in a batch go together, and later depths
    # find the earlier prefixes in the cache
    assert clf.forwarded_inputs == prm.scored_steps == len(steps)
    assert prm.cached_steps == 3 * sum(range(len(steps)))


def test_head_score_reads_one_logit_or_class_logits():
    assert head_score([0.0]) == 0.5
    assert head_score([2.0]) == pytest.approx(1 / (1 + math.exp(-2)))
    assert head_score([0.0, math.log(3)]) == pytest.approx(0.75)
    assert head_score([1.0, 0.0, 1.0], positive_label=2) == pytest.approx(math.e / (2 * math.e + 1))
    with pytest.raises(ValueError, match="positive_label 2 is not one of the head's 2 classes"):
        head_score([0.0, 1.0], positive_label=2)


def test_a_wrong_kind_of_model_is_refused_with_the_fix(reward_model, tmp_path):
    with pytest.raises(ValueError, match="Qwen2ForCausalLM, not a reward / classifier-head model.*"
                                         "--prm-kind step_tag"):
        LocalClassifier(shipped_model("prm"))
    with pytest.raises(ValueError, match="is a Qwen2ForSequenceClassification, not a \\*ForCausalLM PRM"):
        write_reward_head(reward_model, tmp_path / "again")
    assert not (tmp_path / "again").exists()
    with pytest.raises(FileNotFoundError, match="no model at"):
        LocalClassifier(tmp_path / "missing")


class ClassifyServer(ModelServer):
    """Answers ``/classify`` as SGLang 0.5.15 does for a ``*ForSequenceClassification`` model (a batch
    of ``input_ids`` gives a list of ``{"embedding": head output at the last token, "meta_info"}``,
    no softmax), computing the rows with transformers' own sequence-classification forward."""

    is_generation = False

    def __init__(self, model_path):
        import torch
        from transformers import AutoModelForSequenceClassification

        super().__init__(AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch.float32),
                         model_path)

    def respond(self, path, body):
        if path != "/classify":
            return {"error": "not a generation model"}, 400
        return ([{"embedding": self.row(ids), "meta_info": {"id": str(i), "prompt_tokens": len(ids)}}
                 for i, ids in enumerate(body["input_ids"])],)

    def row(self, ids):
        import torch

        with torch.no_grad():  # one sequence, no padding: transformers pools its last token
            return self.model(torch.tensor([ids])).logits[0].float().tolist()


def test_reward_head_prm_through_an_sglang_classify_endpoint(reward_model, step_tag):
    srv = ClassifyServer(reward_model)
    try:
        endpoint = SGLangEndpoint(srv.url)
        prm = RewardHeadPRM(endpoint, cache=False)
        for question, batch in batches():
            for g, w in zip(prm.score(question, batch), step_tag.score(question, batch)):
                assert g == pytest.approx(w, abs=1e-4)
        path, body = srv.paths[-1], srv.bodies[-1]
        ids, tags = tag_positions(endpoint.tokenizer, question, batch[0])
        # one input per step, each ending at its step's tag, all in one request
        assert path == "/classify" and body["input_ids"][:len(tags)] == [ids[:t + 1] for t in tags]
        assert len(body["input_ids"]) == len(batch[0]) + 2 + len(batch[2])
    finally:
        srv.close()


@pytest.mark.gpu
def test_reward_head_on_a_real_sglang_server(reward_model, step_tag):
    """SGLang serves the converted checkpoint as Qwen2ForSequenceClassification (its /classify, GPU
    kernels, bf16) and the scores match the CPU step-tag PRM."""
    import sgl_tts

    server = sgl_tts.connect(reward_model, attention_backend="triton", sampling_backend="pytorch",
                             grammar_backend="none", mem_fraction_static=0.2,
                             disable_cuda_graph=True)
    try:
        prm = RewardHeadPRM(server, cache=False)
        for question, batch in batches():
            for g, w in zip(prm.score(question, batch), step_tag.score(question, batch)):
                assert g == pytest.approx(w, abs=0.05)
    finally:
        server.shutdown()


def test_sgl_tts_run_with_a_reward_head_prm_picks_what_the_step_tag_prm_picks(reward_model, tmp_path):
    """The same beam-search run scored by the step-tag PRM and by its classifier-head twin makes the
    same selections (scores agree to 1e-4; a flip would need a near-tie)."""
    from sgl_tts.cli import run as run_command

    problems = tmp_path / "problems.jsonl"
    task.write_jsonl(task.test_split()[:3], problems)
    out = {}
    for kind, prm in (("step_tag", shipped_model("prm")), ("reward_head", reward_model)):
        out[kind] = tmp_path / f"{kind}.jsonl"
        assert run_command.main(["--problems", str(problems), "--output", str(out[kind]), "--n", "4",
                                "--beam-width", "2", "--prm", str(prm), "--prm-kind", kind,
                                "--no-progress", "--json"]) == 0
    a, b = ([json.loads(x) for x in out[k].read_text().splitlines()] for k in ("step_tag", "reward_head"))
    key = lambda r: (r["index"], r["answers"], [t["steps"] for t in r["trajectories"]])  # noqa: E731
    assert sorted(map(key, a)) == sorted(map(key, b))
