"""The PRM architectures SGLang does not serve, served by the plugin's step-pooled model classes on
live CPU servers: every step's score of a trajectory in one request, equal to a plain-torch forward
of the architecture (transformers' Qwen2 body, the head written out here) at the positions the
model card defines, with the radix cache reusing what siblings and earlier depths sent.

The checkpoints are tiny, random and in the real formats (:func:`sgl_tts.models.prm_checkpoints.write_tiny_prm`).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from sgl_tts import SGLangEndpoint
from sgl_tts.prm import StepPooledPRM
from sgl_tts.tiny import task

pytestmark = [pytest.mark.server, pytest.mark.live_servers("extra")]

FORMATS = ("qwen2.5-math-prm", "skywork-prm")
CAUSAL = ("math-shepherd", "rlhflow")   # causal-LM PRMs in their own layouts, on stock SGLang
QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@pytest.fixture(scope="module")
def prm_servers(live):
    # the end-to-end runs need the generator: all five start at once
    live.warm(*FORMATS, *CAUSAL, "generator")
    yield live
    live.stop(*FORMATS, *CAUSAL)


class Reference:
    """The architecture's forward in plain torch, from the checkpoint's own tensors."""

    def __init__(self, path):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoTokenizer, Qwen2Model

        self.torch, self.tok = torch, AutoTokenizer.from_pretrained(path)
        self.w = load_file(f"{path}/model.safetensors")
        self.body = Qwen2Model(AutoConfig.from_pretrained(path)).eval()
        self.body.load_state_dict({k[len("model."):]: v for k, v in self.w.items() if k.startswith("model.")})

    def inputs(self, fmt: str, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """Input ids and the scored positions as each model card defines them."""
        tok = self.tok
        if fmt == "qwen2.5-math-prm":
            # the card: system, user, assistant = steps joined and closed by <extra_0>; scores at <extra_0>
            text = tok.apply_chat_template([{"role": "system", "content": QWEN_SYSTEM},
                                            {"role": "user", "content": question},
                                            {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"}],
                                           tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            sep = tok.convert_tokens_to_ids("<extra_0>")
            return ids, [i for i, t in enumerate(ids) if t == sep]
        # Skywork's prepare_input: BOS + problem + "\n", then each step's ids and the "\n" token, flagged
        ids = tok.encode(tok.bos_token + question + "\n", add_special_tokens=False)
        nl, flags = tok.encode("\n", add_special_tokens=False)[-1], []
        for s in steps:
            ids = ids + tok.encode(s, add_special_tokens=False) + [nl]
            flags.append(len(ids) - 1)
        return ids, flags

    def scores(self, fmt: str, question: str, steps: list[str]) -> list[float]:
        torch, w = self.torch, self.w
        ids, at = self.inputs(fmt, question, steps)
        with torch.no_grad():
            h = self.body(torch.tensor([ids])).last_hidden_state[0, at]
            if fmt == "qwen2.5-math-prm":
                logits = torch.relu(h @ w["score.0.weight"].T + w["score.0.bias"]) @ w["score.2.weight"].T + w["score.2.bias"]
                return torch.softmax(logits, -1)[:, 1].tolist()
            return torch.sigmoid(h @ w["v_head.summary.weight"].T + w["v_head.summary.bias"])[:, 0].tolist()


def cached_tokens(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sglang:cached_tokens_total"))


def depths(problem) -> list[list[list[str]]]:
    """Three depths of a small tree: two siblings per parent, one of them with a slipped digit."""
    steps = problem.step_texts()
    slip = lambda s: s.replace("=", "=1", 1)   # noqa: E731
    d1 = [steps[:1], [slip(steps[0])]]
    d2 = [p + [steps[1]] for p in d1] + [p + [slip(steps[1])] for p in d1]
    d3 = [p + [steps[2]] for p in d2[:2]] + [d2[0] + [slip(steps[2])]]
    return [d1, d2, d3]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_step_is_scored_in_one_request_per_trajectory_like_the_reference(fmt, prm_servers):
    path, url = prm_servers.specs[fmt].model, prm_servers.url(fmt)
    ref = Reference(path)
    prm = StepPooledPRM(SGLangEndpoint(url, tokenizer_path=path), fmt)
    for problem in task.test_split()[:3]:
        q = problem.question
        for k, batch in enumerate(depths(problem), start=1):
            for s in batch:   # the card's input, cut after the last scored token (causal: nothing after it counts)
                ids, at = ref.inputs(fmt, q, s)
                assert prm.format.encode(ref.tok, q, s) == (ids[:at[-1] + 1], at)
            sent, before = prm.requests, cached_tokens(url)
            got = prm.score(q, batch)
            for g, steps in zip(got, batch):
                assert g == pytest.approx(ref.scores(fmt, q, steps), abs=1e-4)
            assert prm.requests - sent == len(batch)   # one request per new trajectory, every step in it
            if k > 1:   # each input's prefix through its previous step token was computed at depth k - 1
                reused = sum(ref.inputs(fmt, q, s[:-1])[1][-1] + 1 for s in batch)
                assert cached_tokens(url) - before >= reused
    assert prm.re_asked == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_steps_the_radix_cache_already_held_are_asked_again_and_still_equal_the_reference(fmt, prm_servers):
    path, url = prm_servers.specs[fmt].model, prm_servers.url(fmt)
    ref = Reference(path)
    problem = task.test_split()[5]
    q, steps = problem.question + " (again)", problem.step_texts()
    warm = StepPooledPRM(SGLangEndpoint(url, tokenizer_path=path), fmt)
    warm.score(q, [steps[:2]])          # the server now holds steps 1-2 of this trajectory
    cold = StepPooledPRM(SGLangEndpoint(url, tokenizer_path=path), fmt, cache=False)
    got = cold.score(q, [steps[:3]])    # asks for all three: the server computes only step 3's tokens
    assert got[0] == pytest.approx(ref.scores(fmt, q, steps[:3]), abs=1e-4)
    assert cold.re_asked == 2 and cold.requests == 3


def test_the_servers_run_the_plugins_classes_without_is_embedding(prm_servers):
    for fmt, arch in zip(FORMATS, ("Qwen2ForProcessRewardModel", "Qwen2ForPrmModel")):
        log = prm_servers.log_path(fmt).read_text()
        assert f"sgl-tts: {arch} pools at step token id" in log
        assert "--is-embedding" not in " ".join(prm_servers.command(fmt).command)


@pytest.mark.parametrize("fmt", FORMATS)
def test_beam_search_runs_end_to_end_with_the_prm_found_from_the_servers_architecture(fmt, prm_servers, tmp_path):
    """``sgl-tts run`` with ``--prm URL`` and no ``--prm-kind``: the step-pooled scorer is picked
    from ``/model_info``, and every kept trajectory's step scores are the reference forward's."""
    from sgl_tts.cli import run as run_command

    path, url = prm_servers.specs[fmt].model, prm_servers.url(fmt)
    problems, out = tmp_path / "problems.jsonl", tmp_path / "out.jsonl"
    task.write_jsonl(task.test_split()[:2], problems)
    assert run_command.main(["--problems", str(problems), "--output", str(out), "--n", "4", "--beam-width", "2",
                             "--generator", prm_servers.url("generator"), "--prm", url,
                             "--no-progress", "--json"]) == 0
    ref, checked = Reference(path), 0
    for rec in map(json.loads, out.read_text().splitlines()):
        for t in rec["trajectories"]:
            if t["steps"]:
                assert t["step_scores"] == pytest.approx(ref.scores(fmt, rec["question"], t["steps"]), abs=1e-4)
                checked += 1
    assert checked >= 4


@pytest.mark.parametrize("fmt", CAUSAL)
def test_a_causal_lm_prm_on_stock_sglang_scores_each_depth_in_one_call_like_its_card(fmt, prm_servers):
    """The family's layout read from the server's tokenizer (Math-Shepherd's ``ки``, RLHFlow's Llama-3
    chat template): each depth's trajectories in one batched ``/generate``, the scores its model
    card's procedure gives, what earlier depths sent reused."""
    from sgl_tts.prm import StepTagPRM
    from sgl_tts.prm.formats import STEP_TAG_LAYOUTS, step_tag_layout_for
    from tests.test_prm_models import CAUSAL_REFERENCES

    path, url = prm_servers.specs[fmt].model, prm_servers.url(fmt)
    endpoint = SGLangEndpoint(url, tokenizer_path=path)
    layout = step_tag_layout_for(endpoint.tokenizer)
    assert layout is STEP_TAG_LAYOUTS[fmt]
    calls = []
    post = endpoint.scoring.post
    endpoint.scoring.post = lambda route, body: calls.append(route) or post(route, body)   # counts the real calls
    prm = StepTagPRM(endpoint, layout=layout)
    problem = task.test_split()[1]
    q = problem.question
    for k, batch in enumerate(depths(problem), start=1):
        before, sent = cached_tokens(url), len(calls)
        got = prm.score(q, batch)
        for g, steps in zip(got, batch):
            assert g == pytest.approx(CAUSAL_REFERENCES[fmt](path, q, steps), abs=1e-4)
        assert calls[sent:] == ["/generate"]   # the whole depth in one call
        if k > 1:   # every input extends one the previous depth sent
            reused = sum(len(layout.encode(endpoint.tokenizer, q, s[:-1])[0]) for s in batch)
            assert cached_tokens(url) - before >= reused


@pytest.mark.parametrize("fmt", CAUSAL)
def test_beam_search_runs_end_to_end_on_a_causal_lm_prm_found_from_its_server(fmt, prm_servers, tmp_path):
    from sgl_tts.cli import run as run_command
    from tests.test_prm_models import CAUSAL_REFERENCES

    path, url = prm_servers.specs[fmt].model, prm_servers.url(fmt)
    problems, out = tmp_path / "problems.jsonl", tmp_path / "out.jsonl"
    task.write_jsonl(task.test_split()[:2], problems)
    assert run_command.main(["--problems", str(problems), "--output", str(out), "--n", "4", "--beam-width", "2",
                             "--generator", prm_servers.url("generator"), "--prm", url,
                             "--no-progress", "--json"]) == 0
    checked = 0
    for rec in map(json.loads, out.read_text().splitlines()):
        for t in rec["trajectories"]:
            if t["steps"]:
                assert t["step_scores"] == pytest.approx(CAUSAL_REFERENCES[fmt](path, rec["question"], t["steps"]),
                                                         abs=1e-4)
                checked += 1
    assert checked >= 4
