"""The plugin's step-pooled PRM classes without a server: the pooling, the registration with SGLang's
real ``ModelRegistry`` and ``is_generation_model``, the weight check, the input formats and the tiny
checkpoints (their live serving: tests/test_live_prm_models.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from sgl_tts.models.prm_checkpoints import write_tiny_prm
from sgl_tts.plugin import model_registry
from sgl_tts.plugin.models.step_pooling import pool_steps
from sgl_tts.prm import FORMATS, StepPooledPRM


def test_pool_steps_reads_the_head_at_each_step_token_and_splits_by_request():
    # three requests of 4, 3 and 2 tokens; step token 7 at flat positions 1, 3 (first), none (second), 7 (third)
    ids = torch.tensor([5, 7, 5, 7, 1, 2, 3, 7, 4])
    hidden = torch.arange(9, dtype=torch.float32).unsqueeze(1).repeat(1, 2)   # row i = [i, i]
    head = nn.Linear(2, 1)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 10.0]]))
        head.bias.fill_(0.5)
    rows = pool_steps(hidden, ids, [4, 3, 2], 7, head)
    assert [r.shape[0] for r in rows] == [2, 0, 1]
    assert rows[0].squeeze(1).tolist() == [11.5, 33.5] and rows[2].squeeze(1).tolist() == [77.5]
    assert all(r.dtype == torch.float32 for r in rows)


def test_the_plugins_architectures_embed_and_others_are_sglangs_answer():
    calls = []

    def original(archs, is_embedding=False):
        calls.append((archs, is_embedding))
        return not is_embedding

    assert model_registry.is_generation_model(original, ["Qwen2ForProcessRewardModel"]) is False
    assert model_registry.is_generation_model(original, ["Qwen2ForPrmModel"], False) is False
    assert calls == []
    assert model_registry.is_generation_model(original, ["Qwen2ForCausalLM"], False) is True
    assert model_registry.is_generation_model(original, ["Qwen2ForCausalLM"], True) is False
    assert calls == [(["Qwen2ForCausalLM"], False), (["Qwen2ForCausalLM"], True)]


def test_a_prm_class_that_cannot_load_refuses_the_server_naming_the_cause(monkeypatch):
    monkeypatch.setitem(model_registry.ARCHITECTURES, "Qwen2ForPrmModel", "sgl_tts.plugin.models.no_such_module")
    with pytest.raises(model_registry.UnservablePRM,
                       match=r"cannot serve Qwen2ForPrmModel: its model class \(sgl_tts\.plugin\.models\.no_such_module\) "
                             r"failed to load: ModuleNotFoundError"):
        model_registry.is_generation_model(lambda *a: True, ["Qwen2ForPrmModel"])


REGISTERED = """
import json, sys
from sgl_tts.plugin import register
if sys.argv[1] == "registry-first":
    import sglang.srt.models.registry
register()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.configs import model_config
from sglang.srt.models.registry import ModelRegistry
archs = ModelRegistry.get_supported_archs()
print(json.dumps({"archs": [a for a in ("Qwen2ForProcessRewardModel", "Qwen2ForPrmModel") if a in archs],
                  "cls": ModelRegistry.resolve_model_cls(["Qwen2ForPrmModel"])[0].__module__,
                  "generates": [model_config.is_generation_model([a]) for a in ("Qwen2ForPrmModel", "Qwen2ForCausalLM")]}))
"""


def test_after_the_plugin_registers_sglangs_registry_lists_both_prm_classes(tmp_path):
    """Both orders: the plugin registers before SGLang's registry is imported (the variable does it)
    and after (registered directly); each in a fresh process, the two at once."""
    env = {k: v for k, v in __import__("os").environ.items() if k != model_registry.ENV}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    procs = [subprocess.Popen([sys.executable, "-c", REGISTERED, order], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for order in ("plugin-first", "registry-first")]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got == {"archs": ["Qwen2ForProcessRewardModel", "Qwen2ForPrmModel"],
                       "cls": "sgl_tts.plugin.models.qwen2_prm", "generates": [False, True]}


def bare(cls, hidden: int = 4):
    """An instance of ``cls`` with its head and no body (the body needs SGLang's distributed state)."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    obj.config = types.SimpleNamespace(tie_word_embeddings=False)
    obj.model = nn.Module()
    obj.make_head(types.SimpleNamespace(hidden_size=hidden, num_labels=2))
    return obj


def test_loading_fills_the_head_from_the_checkpoints_names_and_refuses_a_checkpoint_without_it():
    from sgl_tts.plugin.models.qwen2_prm import Qwen2ForPrmModel, Qwen2ForProcessRewardModel

    sky = bare(Qwen2ForPrmModel)
    w, b = torch.arange(4.0).unsqueeze(0), torch.tensor([0.25])
    sky.load_weights([("v_head.summary.weight", w), ("v_head.summary.bias", b), ("lm_head.weight", torch.ones(9, 4))])
    assert torch.equal(sky.v_head.summary.weight, w) and torch.equal(sky.v_head.summary.bias, b)
    with pytest.raises(ValueError, match=r"no v_head\.summary\.bias: it is not a Qwen2ForPrmModel"):
        bare(Qwen2ForPrmModel).load_weights([("v_head.summary.weight", w)])
    with pytest.raises(ValueError, match=r"no score\.0\.weight, score\.0\.bias, score\.2\.weight, score\.2\.bias"):
        bare(Qwen2ForProcessRewardModel).load_weights([("lm_head.weight", torch.ones(9, 4))])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny-prms")
    return {f: AutoTokenizer.from_pretrained(write_tiny_prm(f, root / f)) for f in FORMATS}


def test_the_tiny_checkpoints_carry_the_real_architectures_weight_names_and_tokens(tiny, tmp_path):
    from safetensors import safe_open

    for fmt, arch, head in (("qwen2.5-math-prm", "Qwen2ForProcessRewardModel", {"score.0.weight", "score.0.bias",
                                                                               "score.2.weight", "score.2.bias"}),
                            ("skywork-prm", "Qwen2ForPrmModel", {"v_head.summary.weight", "v_head.summary.bias"})):
        path = tiny[fmt].name_or_path
        assert json.loads(open(f"{path}/config.json").read())["architectures"] == [arch]
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            names = set(f.keys())
        assert {n for n in names if not n.startswith("model.")} == head
        assert "model.embed_tokens.weight" in names and not any(n.startswith("lm_head") for n in names)
    assert tiny["qwen2.5-math-prm"].convert_tokens_to_ids("<extra_0>") == len(tiny["qwen2.5-math-prm"]) - 1
    assert tiny["skywork-prm"].bos_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="unknown PRM format 'bert'; the formats are qwen2.5-math-prm, "
                                         "skywork-prm, math-shepherd, rlhflow"):
        write_tiny_prm("bert", tmp_path / "x")


def test_a_skywork_step_of_several_lines_is_scored_at_its_last_newline(tiny):
    tok, fmt = tiny["skywork-prm"], FORMATS["skywork-prm"]
    nl = tok.encode("\n", add_special_tokens=False)
    ids, ends = fmt.encode(tok, "Q?", ["a = 1", "b = 2\nso c = 3"])
    enc = lambda t: tok.encode(t, add_special_tokens=False)   # noqa: E731
    want = enc("<|endoftext|>Q?\n") + enc("a = 1") + nl + enc("b = 2") + nl + enc("so c = 3") + nl
    assert ids == want
    assert ends == [len(enc("<|endoftext|>Q?\n") + enc("a = 1")), len(want) - 1]


def test_a_step_holding_the_qwen_step_token_scores_zero_without_a_request(tiny):
    class NoServer:
        tokenizer = tiny["qwen2.5-math-prm"]

        def step_rows(self, inputs):
            raise AssertionError(f"nothing to send, got {inputs}")

    prm = StepPooledPRM(NoServer(), "qwen2.5-math-prm")
    assert prm.score("Q?", [["a<extra_0>b", "c"]]) == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="unknown step-pooled PRM format 'rlhflow'"):
        StepPooledPRM(NoServer(), "rlhflow")


def test_the_scorer_is_found_from_the_architecture_and_an_unknown_one_is_refused(tiny, tmp_path):
    from sgl_tts.experiment.config import RunConfig, RunError
    from sgl_tts.experiment.driver import open_prm
    from sgl_tts.models import shipped_model
    from sgl_tts.models.reward_head import write_reward_head
    from sgl_tts.prm.detect import DetectedPRM, detect_prm

    qwen, sky = (tiny[f].name_or_path for f in FORMATS)
    assert detect_prm(qwen) == DetectedPRM("step_pooled", "qwen2.5-math-prm", "Qwen2ForProcessRewardModel")
    assert detect_prm(sky) == DetectedPRM("step_pooled", "skywork-prm", "Qwen2ForPrmModel")
    assert detect_prm(shipped_model("prm")) == DetectedPRM("step_tag", None, "Qwen2ForCausalLM")
    head = write_reward_head(shipped_model("prm"), tmp_path / "head")
    assert detect_prm(head) == DetectedPRM("reward_head", None, "Qwen2ForSequenceClassification")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match=r"bert: BertModel is not a PRM sgl-tts can read; supported: "
                                         r"Qwen2ForProcessRewardModel \(Qwen2.5-Math-PRM\), Qwen2ForPrmModel"):
        detect_prm(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"no model at .*nowhere"):
        detect_prm(tmp_path / "nowhere")
    with pytest.raises(RunError, match=r"is a skywork-prm PRM: SGLang serves it, with the sgl-tts plugin installed "
                                       r"\(sgl-tts serve --prm .*\); pass the server's URL as --prm"):
        open_prm(RunConfig(prm=sky))
    with pytest.raises(RunError, match="prm_kind step_pooled: .* is a Qwen2ForCausalLM, not a step-pooled PRM"):
        open_prm(RunConfig(prm=str(shipped_model("prm")), prm_kind="step_pooled"))
    prm, backend = open_prm(RunConfig(prm=str(head)))
    try:
        assert type(prm).__name__ == "RewardHeadPRM"
    finally:
        backend.shutdown()


def test_serve_on_the_cpu_asks_for_a_split_for_a_step_pooled_prm_and_serves_it_with_the_plugin(tiny, capsys):
    from sgl_tts.cli import serve

    sky = tiny["skywork-prm"].name_or_path
    assert serve.main(["--device", "cpu", "--prm", sky, "--dry-run"]) == 1
    assert ("is a step-pooled PRM, which the CPU planner cannot profile yet (its profile decodes): "
            "give --generator-share (e.g. 0.5)") in capsys.readouterr().err
    assert serve.main(["--device", "cpu", "--prm", sky, "--generator-share", "0.5", "--dry-run"]) == 0
    prm_line = [line for line in capsys.readouterr().out.splitlines() if "--port 30001" in line][0]
    assert f"--model-path {sky} " in prm_line and "SGLANG_PLUGINS" not in prm_line and "--is-embedding" not in prm_line


def math_shepherd_reference(path, question: str, steps: list[str]) -> list[float]:
    """Math-Shepherd's model card in plain transformers: ``f"{question} {output}"``, the output's steps
    each closed by " ки" and joined by newlines; at every ``ки`` (the last token of "ки" encoded), the
    softmax over the logits of "+ -"'s tokens after BOS, the first one's share."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    candidates, tag = tok.encode("+ -")[1:], tok.encode("ки")[-1]
    ids = torch.tensor([tok.encode(f"{question} " + "\n".join(f"{s} ки" for s in steps))])
    with torch.no_grad():
        scores = model(ids).logits[:, :, candidates].softmax(-1)[:, :, 0]
    return scores[ids == tag].tolist()


def rlhflow_reference(path, question: str, steps: list[str]) -> list[float]:
    """RLHFlow's PRM card in plain transformers: step by step, the conversation so far (the first user
    turn the question, a space and step 1; each step answered "+") through the chat template; the
    softmax over the logits of "+" and "-" (each the last token of itself encoded) 3 tokens from the
    end, the first one's share."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    candidates = [tok.encode("+")[-1], tok.encode("-")[-1]]
    conversation, scores = [], []
    for k, step in enumerate(steps):
        conversation += [{"content": f"{question} {step}" if k == 0 else step, "role": "user"},
                         {"content": "+", "role": "assistant"}]
        ids = tok.apply_chat_template(conversation, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            scores.append(model(ids).logits[:, -3, candidates].softmax(-1)[0, 0].item())
    return scores


CAUSAL_REFERENCES = {"math-shepherd": math_shepherd_reference, "rlhflow": rlhflow_reference}
CAUSAL_ARCHITECTURES = {"math-shepherd": "MistralForCausalLM", "rlhflow": "LlamaForCausalLM"}


@pytest.mark.parametrize("fmt", CAUSAL_REFERENCES)
def test_a_causal_lm_prm_of_a_known_family_is_found_from_its_tokenizer_and_read_its_cards_way(fmt, tmp_path):
    from sgl_tts.experiment.config import RunConfig
    from sgl_tts.experiment.driver import open_prm
    from sgl_tts.prm.detect import DetectedPRM, detect_prm
    from sgl_tts.prm.formats import STEP_TAG_LAYOUTS
    from sgl_tts.tiny import task

    path = write_tiny_prm(fmt, tmp_path / fmt)
    assert detect_prm(path) == DetectedPRM("step_tag", fmt, CAUSAL_ARCHITECTURES[fmt])
    problem = task.test_split()[0]
    q, steps = problem.question, problem.step_texts()
    batch = [steps[:1], steps[:2], [steps[0], steps[1].replace("=", "=1", 1)], steps[:3]]
    prm, backend = open_prm(RunConfig(prm=str(path)))
    try:
        assert prm.layout is STEP_TAG_LAYOUTS[fmt]
        got = prm.score(q, batch)
        for g, trajectory in zip(got, batch):
            assert g == pytest.approx(CAUSAL_REFERENCES[fmt](path, q, trajectory), abs=1e-4)
        assert len({round(x, 6) for g in got for x in g}) > 3   # the scores vary with the input
    finally:
        backend.shutdown()
    prm, backend = open_prm(RunConfig(prm=str(path), prm_tag="\n"))   # a tag of the user's: the project's layout
    try:
        assert prm.layout is None and prm.tag == "\n"
    finally:
        backend.shutdown()


def test_the_tiny_causal_prms_carry_their_families_tokens_and_a_step_holding_the_tag_scores_zero(tmp_path):
    from transformers import AutoTokenizer

    from sgl_tts.prm import StepTagPRM
    from sgl_tts.prm.formats import STEP_TAG_LAYOUTS

    ms = write_tiny_prm("math-shepherd", tmp_path / "ms")
    vocab = json.loads((ms / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"▁ки", "▁+", "▁-", "<s>", "<0x0A>"} <= set(vocab)
    rl = AutoTokenizer.from_pretrained(write_tiny_prm("rlhflow", tmp_path / "rl"))
    text = rl.apply_chat_template([{"role": "user", "content": " Q? s "}, {"role": "assistant", "content": "+"}],
                                  tokenize=False)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nQ? s<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n+<|eot_id|>")

    class NoServer:
        tokenizer = AutoTokenizer.from_pretrained(ms)

        def next_token_logprobs(self, prompts, positions, token_ids):
            raise AssertionError(f"nothing to send, got {prompts}")

    prm = StepTagPRM(NoServer(), layout=STEP_TAG_LAYOUTS["math-shepherd"])
    assert prm.score("Q?", [["a ки b", "c"]]) == [[0.0, 0.0]]
