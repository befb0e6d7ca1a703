"""Train the project's tiny generator and tiny PRM for the arithmetic task (``sgl-tts train-tiny``).

Stages, each saved as a Hugging Face folder so a crash loses at most the stage in progress:

1. tokenizer: Qwen2-format byte-level BPE with merges for the task's words (one digit per token);
2. generator: a Qwen2 causal LM trained on reference solutions of fresh training problems;
3. PRM: a copy of the generator, output embedding untied, fine-tuned so that at each step tag
   (the ``"\\n\\n"`` after a step) the next-token mass goes to ``"+"`` for a step that is still
   correct and ``"-"`` otherwise; data: the generator's own samples graded by the checker, correct
   references, and references with one injected error.

Fixed seeds throughout; runs on a 2-core CPU. CI never runs this (it uses the shipped weights).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from sgl_tts import task
from sgl_tts.models.tiny import TinyModelSpec, word_merges, write_byte_level_tokenizer

logger = logging.getLogger(__name__)

TASK_WORDS = ["Step", "Compute", "The", " answer", " is", " \\", "boxed", "\n\n"]
GENERATOR_SPEC = TinyModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512)


@dataclasses.dataclass
class TrainConfig:
    """Knobs of one training stage (defaults: the generator stage)."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.05
    min_lr_ratio: float = 0.1
    seed: int = 0
    log_every: int = 50


def write_task_tokenizer(path: str | Path) -> int:
    return write_byte_level_tokenizer(path, word_merges(TASK_WORDS))


def new_generator(path: str | Path, seed: int = 0):
    """A freshly initialised generator (seeded) with the task tokenizer, written to ``path``."""
    from sgl_tts.models.tiny import build_tiny_model

    build_tiny_model(path, GENERATOR_SPEC, seed=seed, merges=word_merges(TASK_WORDS))
    return Path(path)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(model, cfg: TrainConfig):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.98))


def _pad(seqs: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


def generator_batches(tokenizer, cfg: TrainConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, labels): prompt + reference solution + EOS; loss on the answer."""
    stream = task.train_stream(f"{task.TRAIN_SEED}-gen-{cfg.seed}")
    eos = tokenizer.eos_token_id
    while True:
        ids, labels = [], []
        for _ in range(cfg.batch_size):
            p = next(stream)
            q = tokenizer.encode(task.prompt(p.question))
            a = tokenizer.encode(p.solution()) + [eos]
            ids.append(q + a)
            labels.append([-100] * len(q) + a)
        input_ids = _pad(ids, eos)
        mask = _pad([[1] * len(s) for s in ids], 0)
        yield input_ids, mask, _pad(labels, -100)


def _fit(path: Path, cfg: TrainConfig, desc: str, batches, loss_of, *,
         checkpoints: Sequence[int] = (), progress: bool = True) -> Path:
    """The training loop both stages share: AdamW with warm-up + cosine, bf16 autocast, clipping.

    ``batches(tokenizer)`` yields batches; ``loss_of(model, batch)`` returns the scalar loss. The model
    folder at ``path`` is trained in place (and saved as ``path``-stepN at ``checkpoints``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = _optimizer(model, cfg)
    stream = batches(tok)
    bar = tqdm(range(cfg.steps), desc=desc, disable=not progress)
    t0, ema = time.perf_counter(), None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        batch = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = float(loss) if ema is None else 0.95 * ema + 0.05 * float(loss)
        bar.set_postfix(loss=f"{ema:.4f}")
        if (step + 1) % cfg.log_every == 0:
            logger.info("%s step %d loss %.4f (%.1fs)", desc, step + 1, ema, time.perf_counter() - t0)
        if step + 1 in checkpoints:
            save_model(model, tok, path.with_name(f"{path.name}-step{step + 1}"))
    save_model(model, tok, path)
    return path


def train_generator(path: str | Path, cfg: TrainConfig, *, checkpoints: Sequence[int] = (),
                    progress: bool = True) -> Path:
    """Train the generator folder at ``path`` in place: next-token loss on the reference solution."""
    return _fit(Path(path), cfg, "generator", lambda tok: generator_batches(tok, cfg),
                lambda model, b: model(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss,
                checkpoints=checkpoints, progress=progress)


def save_model(model, tokenizer, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save weights in ``dtype`` (bf16 keeps the shipped folders under 10 MB) plus the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = model.training
    model.eval()
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.train(state)
    return path


# ----------------------------------------------------------------------------------------- PRM
PLUS, MINUS = "+", "-"


def prm_text(question: str, steps: Sequence[str]) -> str:
    """PRM input: the prompt, then every step followed by the step tag (a blank line)."""
    return task.prompt(question) + "".join(s + task.STEP_SEPARATOR for s in steps)


def tag_positions(tokenizer, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
    """Token ids of the PRM input and the positions of its step tags (one per step)."""
    for st in steps:
        if task.STEP_SEPARATOR in st or st != st.strip("\n"):
            raise ValueError(f"a step must not contain a blank line or start/end with a newline: {st!r}")
    ids = tokenizer.encode(prm_text(question, steps))
    tag = tokenizer.encode(task.STEP_SEPARATOR)
    if len(tag) != 1:
        raise ValueError("the step tag must be a single token for this tokenizer")
    start = len(tokenizer.encode(task.prompt(question)))
    pos = [i for i in range(start, len(ids)) if ids[i] == tag[0]]
    if len(pos) != len(steps):
        raise ValueError(f"expected {len(steps)} step tags, found {len(pos)}")
    return ids, pos


def corrupt(problem: task.Problem, rng: random.Random) -> list[str]:
    """The reference steps with one injected error, carried on consistently or not."""
    for _ in range(100):
        steps = _corrupt_once(problem, rng)
        if not all(task.grade(problem, task.STEP_SEPARATOR.join(steps)).step_ok):
            return steps
    raise RuntimeError(f"could not inject an error into {problem.question}")


def _corrupt_once(problem: task.Problem, rng: random.Random) -> list[str]:
    steps = problem.step_texts()
    vals = problem.values
    k = rng.randrange(len(problem.ops))
    op, y = problem.ops[k]
    x, z = vals[k], vals[k + 1]
    kind = rng.choice(["result", "result", "operand", "carry", "op"])
    if kind == "result":
        digits = list(str(z))
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        wrong = int("".join(digits))
        steps[k] = f"Step {k + 1}: {x}{op}{y}={wrong}"
    elif kind == "operand":
        y2 = max(1, y + rng.choice([-3, -2, -1, 1, 2, 3]))
        wrong = task.apply(x, op, y2)
        steps[k] = f"Step {k + 1}: {x}{op}{y2}={wrong}"
    elif kind == "carry":
        x2 = max(0, x + rng.choice([-10, -2, -1, 1, 2, 10]))
        wrong = task.apply(x2, op, y)
        steps[k] = f"Step {k + 1}: {x2}{op}{y}={wrong}"
    else:
        op2 = rng.choice([o for o in "+-*" if o != op])
        wrong = task.apply(x, op2, y)
        steps[k] = f"Step {k + 1}: {x}{op2}{y}={wrong}"
    if rng.random() < 0.7:  # carry the wrong value on, as a model would
        v = wrong
        for j in range(k + 1, len(problem.ops)):
            o, yy = problem.ops[j]
            nv = task.apply(v, o, yy)
            steps[j] = f"Step {j + 1}: {v}{o}{yy}={nv}"
            v = nv
        steps[-1] = task.answer_step(v)
    return steps


def prm_examples(tokenizer, pool: Sequence[tuple[task.Problem, str]], seed: int,
                 mix: tuple[float, float, float] = (0.5, 0.2, 0.3)) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """Endless (ids, tag positions, labels 1/0): graded generator samples from ``pool``, correct
    references and corrupted references, in proportions ``mix``."""
    rng = random.Random(f"prm-{seed}")
    stream = task.train_stream(f"{task.TRAIN_SEED}-prm-{seed}")
    while True:
        r = rng.random()
        if r < mix[0] and pool:
            problem, text = pool[rng.randrange(len(pool))]
            g = task.grade(problem, text)
            steps, labels = list(g.steps), [int(v) for v in g.prefix_ok]
            if not steps:
                continue
        else:
            problem = next(stream)
            steps = problem.step_texts() if r < mix[0] + mix[1] else corrupt(problem, rng)
            labels = [int(v) for v in task.grade(problem, task.STEP_SEPARATOR.join(steps)).prefix_ok]
        try:
            ids, pos = tag_positions(tokenizer, problem.question, steps)
        except ValueError:
            continue  # a sample whose text breaks the tag structure (e.g. stray newlines)
        yield ids, pos, labels


def new_prm(generator: str | Path, path: str | Path) -> Path:
    """The PRM starts as a copy of the generator with an untied output embedding
    (``+``/``-`` are also operators in the problems, so their input embeddings must not move)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(generator)
    model = AutoModelForCausalLM.from_pretrained(generator, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight.data.copy_(model.get_input_embeddings().weight.data)
    model.lm_head = head
    return save_model(model, tok, path, dtype=torch.float32)


def prm_batches(tokenizer, pool: Sequence[tuple[task.Problem, str]], cfg: TrainConfig):
    """Collated PRM batches: (input_ids, attention_mask, rows, cols, labels) of every step tag."""
    examples = prm_examples(tokenizer, pool, cfg.seed)
    while True:
        batch = [next(examples) for _ in range(cfg.batch_size)]
        yield (_pad([b[0] for b in batch], tokenizer.eos_token_id),
               _pad([[1] * len(b[0]) for b in batch], 0),
               torch.tensor([i for i, b in enumerate(batch) for _ in b[1]]),
               torch.tensor([p for b in batch for p in b[1]]),
               torch.tensor([lab for b in batch for lab in b[2]], dtype=torch.float32))


def train_prm(path: str | Path, pool: Sequence[tuple[task.Problem, str]], cfg: TrainConfig,
              progress: bool = True) -> Path:
    """Fine-tune the PRM folder at ``path``: 2-way cross-entropy over {+, -} at every step tag."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    plus, minus = tok.convert_tokens_to_ids(PLUS), tok.convert_tokens_to_ids(MINUS)

    def loss_of(model, b):
        input_ids, mask, rows, cols, target = b
        hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[rows, cols])[:, [plus, minus]].float()
        return torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0] - logits[:, 1], target)

    return _fit(Path(path), cfg, "prm", lambda t: prm_batches(t, pool, cfg), loss_of, progress=progress)


def prm_step_scores(backend, question: str, steps_list: Sequence[Sequence[str]]) -> list[list[float]]:
    """P(+) / (P(+) + P(-)) at every step tag, one forward per trajectory (batched on the engine)."""
    tok = backend.tokenizer
    plus, minus = tok.convert_tokens_to_ids(PLUS), tok.convert_tokens_to_ids(MINUS)
    prompts, positions, keep = [], [], []
    for steps in steps_list:
        try:
            ids, pos = tag_positions(tok, question, steps)
        except ValueError:
            keep.append(False)
            continue
        keep.append(bool(steps))
        if steps:
            prompts.append(ids)
            positions.append(pos)
    rows = backend.next_token_logprobs(prompts, positions, [plus, minus]) if prompts else []
    out, it = [], iter(rows)
    for ok in keep:
        if not ok:
            out.append([0.0])
            continue
        out.append([1.0 / (1.0 + math.exp(b - a)) for a, b in next(it)])
    return out


# -------------------------------------------------------------------------------- evaluation
def sample_solutions(backend, problems: Sequence[task.Problem], samples: int, *, temperature: float,
                     seed: int, max_new_tokens: int = 160, progress: bool = False) -> list[list[str]]:
    """``samples`` seeded completions per problem from a LocalBackend's engine, all in flight at once."""
    from sgl_tts.backends.engine import SamplingSpec

    futs = []
    for i, p in enumerate(problems):
        ids = backend.encode(task.prompt(p.question))
        for j in range(samples):
            spec = SamplingSpec(max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=seed * 1_000_003 + i * 1009 + j)
            futs.append(backend.engine.submit(ids, spec))
    texts = [f.result().text for f in tqdm(futs, desc="sampling", disable=not progress)]
    return [texts[i * samples:(i + 1) * samples] for i in range(len(problems))]


def accuracy(problems: Sequence[task.Problem], texts: Sequence[str]) -> float:
    return sum(task.grade(p, t).answer_ok for p, t in zip(problems, texts)) / max(1, len(problems))


def sample_pool(generator: str | Path, count: int, samples: int, *, temperature: float, seed: int,
                progress: bool = True) -> list[tuple[task.Problem, str]]:
    """The generator's own solutions to ``count`` training problems (PRM training data)."""
    from sgl_tts import LocalBackend

    stream = task.train_stream(f"{task.TRAIN_SEED}-pool-{seed}")
    problems = [next(stream) for _ in range(count)]
    backend = LocalBackend(generator, max_running=512, seed=seed)
    try:
        texts = sample_solutions(backend, problems, samples, temperature=temperature, seed=seed,
                                 progress=progress)
    finally:
        backend.shutdown()
    return [(p, t) for p, ts in zip(problems, texts) for t in ts]


@dataclasses.dataclass
class TinyRecipe:
    """Everything ``sgl-tts train-tiny`` does, with its fixed seeds."""

    generator_steps: int = 1500
    generator_batch: int = 64
    prm_steps: int = 1200
    prm_batch: int = 32
    prm_lr: float = 5e-4
    pool_problems: int = 3000
    pool_samples: int = 4
    pool_temperature: float = 0.8
    seed: int = 0


def train_tiny(out: str | Path, recipe: TinyRecipe = TinyRecipe(), progress: bool = True) -> dict:
    """Train generator and PRM into ``out``/generator and ``out``/prm. Finished stages are skipped on a
    rerun (each writes a ``.done`` marker), so an interrupted run resumes."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen, prm = out / "generator", out / "prm"
    timings = {}
    t = time.perf_counter()
    if not (gen / ".done").exists():
        new_generator(gen, seed=recipe.seed)
        train_generator(gen, TrainConfig(steps=recipe.generator_steps, batch_size=recipe.generator_batch,
                                         seed=recipe.seed), progress=progress)
        (gen / ".done").write_text(json.dumps(dataclasses.asdict(recipe)))
    timings["generator_s"] = time.perf_counter() - t
    t = time.perf_counter()
    pool_file = out / "prm-pool.jsonl"
    if not pool_file.exists():
        pool = sample_pool(gen, recipe.pool_problems, recipe.pool_samples,
                           temperature=recipe.pool_temperature, seed=recipe.seed, progress=progress)
        tmp = pool_file.with_suffix(".tmp")
        with tmp.open("w") as f:
            for p, text in pool:
                f.write(json.dumps({**p.to_record("pool"), "sample": text}) + "\n")
        tmp.replace(pool_file)
    pool = [(task.Problem.from_record(r), r["sample"])
            for r in map(json.loads, pool_file.read_text().splitlines())]
    timings["pool_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if not (prm / ".done").exists():
        new_prm(gen, prm)
        train_prm(prm, pool, TrainConfig(steps=recipe.prm_steps, batch_size=recipe.prm_batch,
                                         lr=recipe.prm_lr, warmup=50, seed=recipe.seed),
                  progress=progress)
        (prm / ".done").write_text(json.dumps(dataclasses.asdict(recipe)))
    timings["prm_s"] = time.perf_counter() - t
    return timings


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="sgl-tts train-tiny", description=train_tiny.__doc__)
    ap.add_argument("--out", required=True, help="folder for generator/, prm/ and the PRM data pool")
    d = TinyRecipe()
    for f in dataclasses.fields(TinyRecipe):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)),
                        default=getattr(d, f.name))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    recipe = TinyRecipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyRecipe)})
    timings = train_tiny(args.out, recipe)
    print(json.dumps({"out": str(args.out), "recipe": dataclasses.asdict(recipe), **timings}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["GENERATOR_SPEC", "TASK_WORDS", "TinyRecipe", "TrainConfig", "accuracy", "corrupt",
           "new_generator", "new_prm", "prm_step_scores", "sample_pool", "sample_solutions",
           "save_model", "tag_positions", "train_generator", "train_prm", "train_tiny",
           "write_task_tokenizer"]
