"""``sgl-tts run``: one TTS program over a JSONL dataset, resumable, with a summary and plots.

One :class:`RunConfig` holds every setting; it loads from YAML (``--config run.yaml``) and any field
is overridden from the command line (``--beam-width 8``), search-and-learn style: defaults < YAML <
flags. Problems are JSONL lines ``{"question": str, "answer": optional, "id": optional}``; without
``--problems`` the embedded tiny task's test split is used. Problems run with ``in_flight`` of them in
flight at once (:func:`sgl_tts.runner.run_continuously`), and each finished problem is appended to
the output JSONL as one line the moment it finishes (flushed and synced), so a killed run loses at
most the problems in flight: run the same command again and it skips every problem already written.

The summary is computed from the output file (so a resumed run summarises all its problems):
accuracy of the top-1 majority vote, the PRM-weighted vote and the best PRM score; pass@N (some
trajectory right); accuracy at every N' = 2^k <= N from the same run by subsampling (the first N'
trajectories: for best-of-N exactly what a run with N' samples gives, because sample i's seed depends
on i only; for tree searches an estimate); precise goodput (seed 000 §6.1: mean tokens per
trajectory / mean trajectory completion time); per-problem completion latency; tokens generated vs
kept in the returned trajectories.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import sys
import time
import typing
from pathlib import Path
from typing import Any, Iterator, Sequence

from sgl_tts import registry
from sgl_tts.frontend import end_stream_executors
from sgl_tts.search import AGGREGATIONS, BOXED, STEP_DELIMITER, SearchResult, top_k, vote

logger = logging.getLogger(__name__)

# kept for old imports: the programs as registered at import (sgl_tts.registry holds them, later ones too)
PROGRAMS = registry.names()
MCTS_SETTINGS = registry.MCTS_SETTINGS   # MCTS's own settings and their defaults (registry)
PRM_KINDS = ("step_tag", "reward_head")
RULES = ("majority", "prm_weighted", "prm_best")


class RunError(Exception):
    """A bad input or a failed run: its message is one line naming the problem and the fix.

    ``settings``: the :class:`RunConfig` fields a bad-setting error is about (so an error caused by a
    config file's key can name the file and the key's line).
    """

    def __init__(self, message: str, settings: Sequence[str] = ()):
        super().__init__(message)
        self.settings = tuple(settings)


@dataclasses.dataclass
class RunConfig:
    """Every setting of ``sgl-tts run`` (YAML keys and ``--flags`` have these names, ``_`` or ``-``).

    Attributes:
        problems: JSONL dataset; ``None``: the embedded tiny task's test split.
        output: results JSONL, one line per finished problem (appended to on a rerun).
        limit: run only the first ``limit`` problems.
        program: ``beam_search``, ``dvts``, ``best_of_n``, ``self_consistency`` (majority vote,
            no PRM) or ``mcts``.
        n: the budget N: beams (beam search, DVTS), samples (best-of-N) or rollouts (MCTS).
        beam_width: M, children per kept beam (beam search), per subtree (DVTS) or per expansion (MCTS).
        max_depth: most steps of a tree search.
        step_tokens: token limit of a step; several values are a per-depth schedule.
        max_tokens: token limit of a whole best-of-N sample.
        temperature: sampling temperature.
        aggregation: step scores to one score: ``last``, ``min``, ``prod`` or ``mean``.
        branching: beam search children per beam: ``equal`` or ``proportional`` (dynamic branching).
        lookahead: beam search lookahead rollout steps (0: none).
        filter_duplicates: beam search drops an open candidate whose path equals an earlier one's.
        semantics: beam search as sgl-tts defines it (``sgl-tts``) or as huggingface/search-and-learn
            runs it (``search-and-learn``; see ``programs/beam_search.py`` for every difference).
        sort_completed: search-and-learn semantics: return the N best completed beams, not the first N.
        speculative: speculative beam extension of beam search and DVTS: ``off``, ``exact`` (every
            trajectory is the plain search's) or ``truncate`` (FlashTTS's R mode, an approximation);
            with LookAhead verification (see :mod:`sgl_tts.pipeline`).
        overlap_verification: beam search and DVTS send a beam's PRM request as soon as its step ends.
        parallel: MCTS rollouts in flight at once (WU-PUCT; 1: serial and deterministic).
        c_puct: MCTS exploration weight.
        threshold: MCTS acceptance threshold of both early exits.
        positive_exit: MCTS stops once a finished trajectory reaches the threshold.
        negative_exit: MCTS stops once every leaf is below the threshold (aggregation min or prod).
        futility: MCTS negative exit compares a leaf's aggregated score (``path``) or its own step
            score (``step``, seed 004's rule) with the threshold.
        first_step_cutoff: MCTS selective futility check: leaves whose first step scored below it are
            left out of the negative-exit check.
        seed: sampling seed of the run (each sample's seed derives from it).
        delimiter: step delimiter.
        answer_pattern: regex whose first group is the answer.
        generator: generator model folder or SGLang server URL; ``None``: the embedded default.
        runtime: ``auto``, ``server``, ``cuda`` or ``cpu`` (see :func:`sgl_tts.connect`).
        cpu_engine: where the CPU backend's models run: ``thread``, ``process`` (a child process
            each) or ``auto`` (a process for tree searches with 8+ in flight; see
            :func:`sgl_tts.backends.local.choose_engine_in`).
        prm: PRM model folder or SGLang server URL; ``None``: the shipped tiny PRM; ``"none"``: no
            PRM (best-of-N then ranks nothing and picks the majority).
        prm_kind: ``step_tag`` (P(good) after each step tag) or ``reward_head`` (a classifier /
            reward head read at the end of each step prefix).
        prm_tokenizer: tokenizer folder of a PRM served by URL (default: the server's model path).
        prm_good: label token of a good step (step-tag PRMs); prm_bad: of a bad step.
        prm_tag: the step tag a step-tag PRM reads after each step.
        in_flight: problems in flight at once.
        plot: save accuracy-vs-N and goodput figures to this PNG (``None``: no plot).
        progress: show a progress bar.
    """

    problems: str | None = None
    output: str = "sgl-tts-run.jsonl"
    limit: int | None = None
    program: str = "beam_search"
    n: int = 16
    beam_width: int = 4
    max_depth: int = 40
    step_tokens: list[int] = dataclasses.field(default_factory=lambda: [64])
    max_tokens: int = 256
    temperature: float = 0.8
    aggregation: str = "last"
    branching: str = "equal"
    lookahead: int = 0
    filter_duplicates: bool = False
    semantics: str = "sgl-tts"
    sort_completed: bool = False
    speculative: str = "off"
    overlap_verification: bool = False
    parallel: int = 1
    c_puct: float = 1.0
    threshold: float = 0.9
    positive_exit: bool = True
    negative_exit: bool = False
    futility: str = "path"
    first_step_cutoff: float | None = None
    seed: int = 0
    delimiter: str = STEP_DELIMITER
    answer_pattern: str = BOXED
    generator: str | None = None
    runtime: str = "auto"
    cpu_engine: str = "auto"
    prm: str | None = None
    prm_kind: str = "step_tag"
    prm_tokenizer: str | None = None
    prm_good: str = "+"
    prm_bad: str = "-"
    prm_tag: str = STEP_DELIMITER
    in_flight: int = 8
    plot: str | None = None
    progress: bool = True

    # Settings that do not change any result (a run may resume under different values of these). The
    # dataset's path is one: a resumed run checks each written problem's question instead.
    NOT_IN_RUN_KEY: typing.ClassVar[tuple[str, ...]] = (
        "problems", "output", "limit", "in_flight", "plot", "progress", "runtime", "cpu_engine")
    # Settings added after runs were written: at their default they stay out of the run key, so an
    # earlier run (which behaved as the default) still resumes. Programs' own settings (registry) too.
    KEYED_WHEN_SET: typing.ClassVar[dict[str, Any]] = {
        "filter_duplicates": False, "semantics": "sgl-tts", "sort_completed": False,
        # never change a kept beam (exact); truncate changes samples, so it is keyed
        "speculative": "off", "overlap_verification": False}
    # Settings that never change a result: the same key with them on or off (a run may resume either way).
    SAME_RESULTS: typing.ClassVar[dict[str, tuple[Any, ...]]] = {
        "speculative": ("off", "exact"), "overlap_verification": (False, True)}

    @classmethod
    def from_sources(cls, yaml_path: str | None = None, overrides: dict[str, Any] | None = None
                     ) -> "RunConfig":
        """Defaults, then the YAML file's keys, then ``overrides`` (already typed). A bad setting that
        came from the file is reported as ``config file PATH line N: ...`` (N: its key's line)."""
        values: dict[str, Any] = {}
        lines: dict[str, int] = {}
        if yaml_path is not None:
            values, lines = read_yaml(yaml_path)
        values.update(overrides or {})
        cfg = cls(**values)
        try:
            cfg.validate()
        except RunError as exc:
            from_file = [lines[n] for n in exc.settings if n in lines and n not in (overrides or {})]
            if not from_file:
                raise
            raise RunError(f"config file {Path(yaml_path)} line {min(from_file)}: {exc}", exc.settings) from None
        return cfg

    def validate(self) -> None:
        def bad(msg: str, *settings: str) -> None:
            raise RunError(msg, settings)

        spec = registry.find(self.program)
        if spec is None:
            bad(f"unknown program {self.program!r}; choose one of {', '.join(registry.names())}", "program")
        for name in ("n", "beam_width", "max_depth", "max_tokens", "in_flight"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}", name)
        if self.limit is not None and self.limit < 1:
            bad(f"limit must be a positive integer, got {self.limit}", "limit")
        if not self.step_tokens or any(not isinstance(x, int) or x < 1 for x in self.step_tokens):
            bad(f"step_tokens must be positive integers, got {self.step_tokens!r}", "step_tokens")
        if self.aggregation not in AGGREGATIONS:
            bad(f"unknown aggregation {self.aggregation!r}; choose one of {', '.join(AGGREGATIONS)}", "aggregation")
        if self.branching not in ("equal", "proportional"):
            bad(f"unknown branching {self.branching!r}; choose equal or proportional", "branching")
        if self.lookahead < 0:
            bad(f"lookahead must be >= 0, got {self.lookahead}", "lookahead")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.semantics not in ("sgl-tts", "search-and-learn"):
            bad(f"unknown semantics {self.semantics!r}; choose sgl-tts or search-and-learn", "semantics")
        if self.program != "beam_search" and (self.semantics != "sgl-tts" or self.filter_duplicates
                                              or self.sort_completed):
            bad("semantics, filter_duplicates and sort_completed are beam_search settings",
                "program", "semantics", "filter_duplicates", "sort_completed")
        if self.semantics == "search-and-learn" and (self.branching != "equal" or self.lookahead):
            bad("semantics search-and-learn has no branching or lookahead (its beam search never reads "
                "its lookahead steps)", "semantics", "branching", "lookahead")
        if self.sort_completed and self.semantics != "search-and-learn":
            bad("sort_completed needs semantics search-and-learn", "sort_completed", "semantics")
        if self.speculative not in ("off", "exact", "truncate"):
            bad(f"unknown speculative mode {self.speculative!r}; choose off, exact or truncate", "speculative")
        if (self.speculative != "off" or self.overlap_verification) and (
                self.program not in ("beam_search", "dvts") or self.semantics != "sgl-tts"):
            bad("speculative and overlap_verification are settings of beam_search and dvts (sgl-tts semantics)",
                "speculative", "overlap_verification", "program", "semantics")
        others: dict[str, list[str]] = {}   # another program's own settings, off their defaults
        for k, (owner, default) in registry.own_settings().items():
            if owner != self.program and getattr(self, k) != default:
                others.setdefault(owner, []).append(k)
        for owner, changed in others.items():
            bad(f"{', '.join(changed)}: settings of program {owner}", *changed)
        if spec.prm == "required" and self.uses_prm is False:
            bad(f"{self.program} needs a PRM; drop prm: none (or use program self_consistency)", "program", "prm")
        if spec.check is not None:
            spec.check(self, bad)
        if self.prm_kind not in PRM_KINDS:
            bad(f"unknown prm_kind {self.prm_kind!r}; choose one of {', '.join(PRM_KINDS)}", "prm_kind")
        if self.runtime not in ("auto", "server", "cuda", "cpu"):
            bad(f"unknown runtime {self.runtime!r}; choose auto, server, cuda or cpu", "runtime")
        if self.cpu_engine not in ("auto", "thread", "process"):
            bad(f"unknown cpu_engine {self.cpu_engine!r}; choose auto, thread or process", "cpu_engine")

    @property
    def engine_in(self) -> str:
        """Where a CPU backend opened for this run runs its engines (``cpu_engine`` resolved)."""
        from sgl_tts.backends.local import choose_engine_in

        spec = registry.find(self.program)
        return choose_engine_in(self.cpu_engine, tree_search=spec is not None and spec.budget != "samples",
                                in_flight=self.in_flight)

    @property
    def uses_prm(self) -> bool:
        spec = registry.find(self.program)   # (an unknown program: validate() names it)
        return (spec is None or spec.prm != "none") and (self.prm is None or self.prm.lower() != "none")

    def run_key(self) -> str:
        """A short hash of every setting that changes results (a resumed run must match it)."""
        keyed_when_set = {**self.KEYED_WHEN_SET, **{k: d for k, (_, d) in registry.own_settings().items()}}
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NOT_IN_RUN_KEY
                  and not (k in keyed_when_set and v == keyed_when_set[k])
                  and not (k in self.SAME_RESULTS and v in self.SAME_RESULTS[k])}
        if self.program == "beam_search" and self.semantics == "sgl-tts":
            # its step seeds are keyed by (depth, parent, child) since issue 18 (before: by beam index),
            # so a run written before samples differently and does not resume into this one
            fields["seeds"] = SEED_SCHEME
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def program_arguments(self, question: str, prm) -> dict[str, Any]:
        """The keyword arguments of the chosen program for one question (its registry record's)."""
        return registry.program(self.program).arguments(self, question, prm)


SEED_SCHEME = "depth-parent-ordinal"


def program_function(name: str):
    """The ``@sgl.function`` behind a program name (its registry record's)."""
    return registry.program(name).load()


# ------------------------------------------------------------------------------------- config I/O
def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A config file's settings, checked against :class:`RunConfig`'s fields."""
    return read_yaml(path)[0]


def read_yaml(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, int]]:
    """A config file's settings (checked against :class:`RunConfig`'s fields) and the line each
    setting's key is on. Every error is one line: ``config file PATH line N: what is wrong``."""
    import yaml

    p = Path(path)
    where = f"config file {p}"
    fix = "pass --config PATH to a YAML file of RunConfig keys"
    text = utf8_text(read_input(p, where, fix), where)
    try:
        loader = yaml.SafeLoader(text)   # checks the characters already
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise RunError(f"{where} {_yaml_error(exc, text)}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise RunError(f"{where} must be a mapping of settings, got {type(data).__name__}")
    key_lines = {}
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode):
            key_lines[str(key_node.value).replace("-", "_")] = key_node.start_mark.line + 1
    known = {f.name: f for f in dataclasses.fields(RunConfig)}
    out, lines = {}, {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        at = f"{where} line {key_lines[name]}" if name in key_lines else where
        if name not in known:
            raise RunError(f"{at}: unknown setting {key!r}; known settings: {', '.join(known)}")
        try:
            out[name] = _coerce(known[name], value)
        except (TypeError, ValueError) as exc:
            raise RunError(f"{at}: {key}: {exc}") from None
        if name in key_lines:
            lines[name] = key_lines[name]
    return out, lines


def _yaml_error(exc: Exception, text: str) -> str:
    """``line N: not valid YAML: ...`` from a PyYAML error (its lines are 0-based)."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        line = exc.problem_mark.line + 1
        what = exc.problem or str(exc).splitlines()[0]
        if exc.context and exc.context_mark is not None and exc.context_mark.line + 1 != line:
            what += f" ({exc.context} that began on line {exc.context_mark.line + 1})"
        return f"line {line}: not valid YAML: {what}"
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        return f"line {line}: not valid YAML: {str(exc).splitlines()[0]}"
    return f"is not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def read_input(path: Path, where: str, fix: str) -> bytes:
    """The bytes of an input file; a missing file, a directory or an unreadable file is a
    :class:`RunError` naming ``where`` (e.g. ``problems file PATH``) and ``fix``."""
    if path.is_dir():
        raise RunError(f"{where} is a directory; {fix}")
    if not path.is_file():
        raise RunError(f"{where} not found; {fix}")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise RunError(f"{where} cannot be read: {exc.strerror or exc}; {fix}") from None


def utf8_text(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped); bytes that are not UTF-8 are a
    :class:`RunError` ``WHERE line N: not UTF-8 text (byte 0x.. at column C)``."""
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise RunError(f"{where} line {line}: not UTF-8 text (byte 0x{data[at]:02x} at column {column}); "
                       f"save the file as UTF-8") from None


def _field_kind(field: dataclasses.Field) -> str:
    hint = typing.get_type_hints(RunConfig)[field.name]
    if hint is bool:
        return "bool"
    if hint in (int, int | None):
        return "int"
    if hint in (float, float | None):
        return "float"
    if hint == list[int]:
        return "ints"
    return "str"


def _coerce(field: dataclasses.Field, value: Any) -> Any:
    """A YAML or command-line value as the field's type (``"none"`` for optional fields is None)."""
    kind = _field_kind(field)
    optional = field.default is None
    if value is None or (optional and isinstance(value, str) and value.lower() in ("null", "~")):
        if not optional:
            raise ValueError("cannot be empty")
        return None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1"):
            return True
        if str(value).lower() in ("false", "no", "0"):
            return False
        raise ValueError(f"expected true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if kind == "ints":
        items = value if isinstance(value, list) else str(value).split(",")
        try:
            return [int(x) for x in items if str(x).strip()]
        except ValueError:
            raise ValueError(f"expected integers (a list, or comma-separated), got {value!r}") from None
    return str(value)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` plus one ``--flag`` per :class:`RunConfig` field (only given flags override)."""
    parser.add_argument("--config", default=None, help="YAML file of settings (flags override it)")
    docs = _field_docs()
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _field_kind(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{docs.get(f.name, '')} (default: {default!r})".strip()
        if kind == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=argparse.SUPPRESS,
                                metavar=f.name.upper(), help=help_text.replace("%", "%%"))


def _field_docs() -> dict[str, str]:
    """Each field's line from the Attributes section of RunConfig's docstring."""
    docs, current = {}, None
    for line in (RunConfig.__doc__ or "").splitlines():
        s = line.strip()
        head = s.split(":", 1)
        if len(head) == 2 and head[0] in {f.name for f in dataclasses.fields(RunConfig)}:
            current = head[0]
            docs[current] = head[1].strip()
        elif current and s:
            docs[current] += " " + s
    return docs


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The config from ``--config`` and the flags given on the command line."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    overrides = {}
    for name, value in vars(args).items():
        if name in fields:
            try:
                overrides[name] = _coerce(fields[name], value)
            except (TypeError, ValueError) as exc:
                raise RunError(f"--{name.replace('_', '-')}: {exc}") from None
    return RunConfig.from_sources(args.config, overrides)


# -------------------------------------------------------------------------------------- problems
@dataclasses.dataclass(frozen=True)
class ProblemRecord:
    index: int
    id: str
    question: str
    answer: str | None


def read_problems(path: str | os.PathLike | None, limit: int | None = None) -> list[ProblemRecord]:
    """The dataset's problems, every line checked before any is run."""
    if path is None:
        from sgl_tts import task
        problems = task.test_split()
        records = [ProblemRecord(i, f"arith-test-{i}", p.question, str(p.answer))
                   for i, p in enumerate(problems)]
        return records[:limit] if limit else records
    p = Path(path)
    fix = 'each line must be a JSON object {"question": "...", "answer": "..." (optional)}'
    text = utf8_text(read_input(p, f"problems file {p}", f"pass --problems PATH to a JSONL file ({fix})"), str(p))
    out: list[ProblemRecord] = []
    for lineno, line in enumerate(text.split("\n"), 1):   # JSON Lines: \n ends a line (\r\n too)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunError(f"{p} line {lineno}: not valid JSON ({exc.msg}); {fix}") from None
        if not isinstance(rec, dict):
            raise RunError(f"{p} line {lineno}: expected a JSON object, got "
                           f"{type(rec).__name__}; {fix}")
        if "question" not in rec:
            raise RunError(f"{p} line {lineno}: no \"question\" field; {fix}")
        q = rec["question"]
        if not isinstance(q, str) or not q.strip():
            raise RunError(f"{p} line {lineno}: \"question\" must be a non-empty string; {fix}")
        answer = rec.get("answer")
        if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
            raise RunError(f"{p} line {lineno}: \"answer\" must be a string or a number, got "
                           f"{type(answer).__name__}; {fix}")
        pid = rec.get("id")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
            raise RunError(f"{p} line {lineno}: \"id\" must be a string or an integer, got "
                           f"{type(pid).__name__}; {fix}")
        pid = str(len(out) if pid is None else pid)
        out.append(ProblemRecord(len(out), pid, q, None if answer is None else str(answer).strip()))
        if limit and len(out) >= limit:
            break
    if not out:
        raise RunError(f"{p} has no problems; {fix}")
    return out


# ---------------------------------------------------------------------------------------- output
def subsample_sizes(n: int) -> list[int]:
    """Every 2^k <= n, then n itself."""
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def answers_at(result: SearchResult, size: int) -> dict[str, str | None]:
    """Best-of-N's selection rules (majority, PRM-weighted vote, best PRM score; ties to the earlier
    trajectory) applied to the first ``size`` trajectories of a result."""
    trajs = result.trajectories[:size]
    if not trajs:
        return {rule: None for rule in RULES}
    answers = [t.answer for t in trajs]
    scores = [t.score for t in trajs]
    return {"majority": vote(answers), "prm_weighted": vote(answers, scores),
            "prm_best": trajs[top_k(scores, 1)[0]].answer}


def result_record(problem: ProblemRecord, result: SearchResult, cfg: RunConfig, prm_used: bool
                  ) -> dict[str, Any]:
    """One output line: the problem, the program's answers, every trajectory and the costs."""
    rules = RULES if prm_used else ("majority",)
    answers = {r: result.answers.get(r) for r in rules}
    # at N itself: the program's own answers; below N: the first N' trajectories (best-of-N's rules)
    sub = {str(k): {r: a for r, a in (answers if k == cfg.n else answers_at(result, k)).items()
                    if r in rules} for k in subsample_sizes(cfg.n)}
    rec: dict[str, Any] = {
        "index": problem.index, "id": problem.id, "question": problem.question,
        "reference": problem.answer, "answer": result.answer, "answers": answers,
        "subsampled": sub, "run_key": cfg.run_key(),
        "tokens_generated": result.tokens_generated, "tokens_kept": result.tokens_kept,
        "tokens_speculative": result.tokens_speculative, "tokens_reused": result.tokens_reused,
        "seconds": round(result.seconds, 4),
        "seconds_generating": round(result.seconds_generating, 4),
        "seconds_verifying": round(result.seconds_verifying, 4),
        **({"exit_reason": result.exit_reason} if result.exit_reason is not None else {}),
        "trajectories": [{"steps": t.steps, "step_scores": [round(x, 6) for x in t.step_scores],
                          "score": round(t.score, 6), "answer": t.answer, "tokens": t.tokens,
                          "finished": t.finished, "seconds": round(t.seconds, 4)}
                         for t in result.trajectories],
    }
    if problem.answer is not None:
        rec["correct"] = {r: a == problem.answer for r, a in answers.items()}
        rec["pass"] = any(t.answer == problem.answer for t in result.trajectories)
    return rec


def read_results(path: Path, run_key: str, problems: Sequence[ProblemRecord]) -> dict[int, dict]:
    """Finished problems already in ``path``: a torn last line (a crash mid-write) is cut off; a file
    written by a different config or dataset is an error rather than mixed into."""
    if not path.exists():
        return {}
    data = read_input(path, f"output file {path}", "pass --output PATH to a JSONL file")
    good_end = data.rfind(b"\n") + 1
    if good_end < len(data):
        logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path,
                       len(data) - good_end)
        with path.open("r+b") as fh:
            fh.truncate(good_end)
    by_index = {p.index: p for p in problems}
    done: dict[int, dict] = {}
    for lineno, line in enumerate(utf8_text(data[:good_end], str(path)).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise RunError(f"{path} line {lineno} is not valid JSON: it is not an sgl-tts run output; "
                           f"choose another --output") from None
        if rec.get("run_key") != run_key:
            raise RunError(f"{path} holds results of different settings (run key {rec.get('run_key')}, "
                           f"these settings {run_key}); use another --output or delete the file")
        p = by_index.get(rec.get("index"))
        if p is None or p.question != rec.get("question"):
            if p is None and rec.get("index", -1) >= len(problems):
                continue  # beyond --limit: kept in the file, left out of this summary
            raise RunError(f"{path} line {lineno} is for a different problem set (problem "
                           f"{rec.get('index')} differs); use another --output or delete the file")
        done[p.index] = rec
    return done


def append_line(fh, record: dict) -> None:
    fh.write(json.dumps(record) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


# --------------------------------------------------------------------------------------- summary
@dataclasses.dataclass
class Summary:
    problems: int
    graded: int
    accuracy: dict[str, float]
    pass_at_n: float | None
    accuracy_at: dict[str, dict[str, float]]
    goodput_tokens_per_s: float
    mean_tokens_per_trajectory: float
    mean_trajectory_seconds: float
    latency_seconds: dict[str, float]
    tokens_generated: int
    tokens_kept: int
    n: int
    exact_subsampling: bool = True  # best-of-N: the first N' samples are a run at N'
    tokens_speculative: int = 0     # of tokens_generated: by speculative requests
    tokens_reused: int = 0          # of those: taken over by a kept child
    seconds_generating: float = 0.0  # summed over problems: waiting for steps (step-wise searches)
    seconds_verifying: float = 0.0   # waiting for scores once a depth's last step ended
    exits: dict[str, int] = dataclasses.field(default_factory=dict)   # MCTS: problems per exit reason

    def table(self) -> str:
        lines = [f"problems: {self.problems} ({self.graded} with a reference answer)"]
        if self.graded:
            rules = list(self.accuracy)
            lines.append("| selection | " + " | ".join(f"N={k}" for k in self.accuracy_at) + " |")
            lines.append("| --- |" + " ---: |" * len(self.accuracy_at))
            for r in rules:
                lines.append(f"| {r} | " + " | ".join(f"{100 * v[r]:.1f}%"
                                                        for v in self.accuracy_at.values()) + " |")
            lines.append(f"pass@{self.n}: {100 * (self.pass_at_n or 0):.1f}%")
            if not self.exact_subsampling:
                lines.append(f"(N < {self.n}: the first trajectories of the N={self.n} tree search, "
                             f"which share ancestors; not what a search with fewer beams would give)")
        lat = self.latency_seconds
        lines.append(f"precise goodput: {self.goodput_tokens_per_s:.1f} tokens/s "
                     f"({self.mean_tokens_per_trajectory:.1f} tokens per trajectory / "
                     f"{self.mean_trajectory_seconds:.2f} s mean trajectory completion)")
        lines.append(f"completion latency per problem: mean {lat['mean']:.2f} s, p50 {lat['p50']:.2f} s, "
                     f"p90 {lat['p90']:.2f} s, max {lat['max']:.2f} s")
        kept = self.tokens_kept / self.tokens_generated if self.tokens_generated else 0.0
        lines.append(f"tokens generated {self.tokens_generated}, kept in returned trajectories "
                     f"{self.tokens_kept} ({100 * kept:.0f}%; a shared ancestor counts once per "
                     f"trajectory)")
        if self.tokens_speculative:
            lines.append(f"speculative tokens {self.tokens_speculative} ({self.tokens_reused} reused by kept "
                         f"children, {self.tokens_speculative - self.tokens_reused} wasted); normal "
                         f"{self.tokens_generated - self.tokens_speculative}")
        if self.seconds_generating or self.seconds_verifying:
            lines.append(f"waiting per problem: generator {self.seconds_generating / max(1, self.problems):.2f} s, "
                         f"verifier {self.seconds_verifying / max(1, self.problems):.2f} s")
        if self.exits:
            lines.append("exits: " + ", ".join(f"{k} {v}" for k, v in sorted(self.exits.items())))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default); 0 for no values."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[dict], n: int, program: str = "best_of_n") -> Summary:
    """The run's summary from its output records (see the module docstring)."""
    graded = [r for r in records if r.get("reference") is not None]
    rules = list(records[0]["answers"]) if records else list(RULES)
    accuracy = {rule: sum(r["correct"][rule] for r in graded) / len(graded) if graded else 0.0
                for rule in rules}
    accuracy_at = {}
    for size in subsample_sizes(n):
        accuracy_at[str(size)] = {
            rule: (sum(r["subsampled"][str(size)][rule] == r["reference"] for r in graded) / len(graded)
                   if graded else 0.0) for rule in rules}
    trajs = [t for r in records for t in r["trajectories"]]
    mean_tokens = statistics.fmean(t["tokens"] for t in trajs) if trajs else 0.0
    mean_secs = statistics.fmean(t["seconds"] for t in trajs) if trajs else 0.0
    lat = [r["seconds"] for r in records]
    return Summary(
        problems=len(records), graded=len(graded), accuracy=accuracy,
        pass_at_n=(sum(r["pass"] for r in graded) / len(graded)) if graded else None,
        accuracy_at=accuracy_at, goodput_tokens_per_s=mean_tokens / mean_secs if mean_secs else 0.0,
        mean_tokens_per_trajectory=mean_tokens, mean_trajectory_seconds=mean_secs,
        latency_seconds={"mean": statistics.fmean(lat) if lat else 0.0, "p50": quantile(lat, 0.5),
                         "p90": quantile(lat, 0.9), "max": max(lat, default=0.0)},
        tokens_generated=sum(r["tokens_generated"] for r in records),
        tokens_kept=sum(r["tokens_kept"] for r in records), n=n,
        exact_subsampling=getattr(registry.find(program), "budget", None) == "samples",
        tokens_speculative=sum(r.get("tokens_speculative", 0) for r in records),
        tokens_reused=sum(r.get("tokens_reused", 0) for r in records),
        seconds_generating=sum(r.get("seconds_generating", 0.0) for r in records),
        seconds_verifying=sum(r.get("seconds_verifying", 0.0) for r in records),
        exits=dict(collections.Counter(r["exit_reason"] for r in records if "exit_reason" in r)))


def plot_summary(summary: Summary, records: Sequence[dict], path: str | os.PathLike, title: str) -> Path:
    """Two panels: accuracy vs N (each selection rule, subsampled) and per-problem precise goodput
    against completion latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (acc, gp) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [int(k) for k in summary.accuracy_at]
    for rule in summary.accuracy:
        acc.plot(sizes, [100 * summary.accuracy_at[str(k)][rule] for k in sizes], marker="o", label=rule)
    if summary.pass_at_n is not None:
        acc.plot([sizes[-1]], [100 * summary.pass_at_n], marker="*", ls="", color="k",
                 label=f"pass@{summary.n}")
    acc.set_xscale("log", base=2)
    acc.set_ylim(0, 102)
    acc.set_xlabel("N (first N samples of one run)" if summary.exact_subsampling else
                   f"N (first N trajectories of one N={summary.n} tree search: not a search at N)")
    acc.set_ylabel("accuracy (%)")
    acc.grid(alpha=0.3)
    acc.legend()
    acc.set_title(f"accuracy vs N ({summary.graded} graded problems)")
    xs, ys = [], []
    for r in records:
        ts = r["trajectories"]
        secs = statistics.fmean(t["seconds"] for t in ts) if ts else 0.0
        if secs > 0:
            xs.append(r["seconds"])
            ys.append(statistics.fmean(t["tokens"] for t in ts) / secs)
    gp.scatter(xs, ys, s=12, alpha=0.6)
    gp.axhline(summary.goodput_tokens_per_s, color="C1", ls="--",
               label=f"run: {summary.goodput_tokens_per_s:.1f} tokens/s")
    gp.set_xlabel("problem completion latency (s)")
    gp.set_ylabel("precise goodput (tokens/s)")
    gp.grid(alpha=0.3)
    gp.legend()
    gp.set_title("precise goodput per problem")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------- run
def open_prm(cfg: RunConfig):
    """The PRM scorer the config names (``None`` when the run uses none)."""
    if not cfg.uses_prm:
        return None, None
    from sgl_tts.prm import RewardHeadPRM, StepTagPRM

    target = cfg.prm
    if target is None:
        from sgl_tts.models import shipped_model
        target = shipped_model("prm")
        if target is None:
            raise RunError("no PRM: this source tree ships no trained PRM; pass --prm PATH or URL "
                           "(or --prm none for self-consistency)")
    target = str(target)
    if target.startswith(("http://", "https://")):
        from sgl_tts.backends import SGLangEndpoint
        backend = SGLangEndpoint(target.rstrip("/"), tokenizer_path=cfg.prm_tokenizer)
    elif cfg.prm_kind == "reward_head":
        from sgl_tts.backends.classifier import LocalClassifier
        backend = LocalClassifier(target)
    else:
        from sgl_tts.backends import LocalBackend
        backend = LocalBackend(target, seed=cfg.seed, engine_in=cfg.engine_in)
    try:
        if cfg.prm_kind == "reward_head":
            prm = RewardHeadPRM(backend, tag=cfg.prm_tag)
        else:
            prm = StepTagPRM(backend, good=cfg.prm_good, bad=cfg.prm_bad, tag=cfg.prm_tag)
    except Exception:
        backend.shutdown()
        raise
    return prm, backend


def check_prm(prm, question: str, where: str) -> None:
    """Score one short step before the run, so a broken PRM fails once, clearly, up front."""
    try:
        got = prm.score(question, [["1"]])
        if len(got) != 1 or len(got[0]) != 1:
            raise ValueError(f"expected one score for one step, got {got!r}")
    except Exception as exc:
        raise RunError(f"the PRM ({where}) failed to score a test step: {exc}; check --prm, "
                       f"--prm-kind and that its server is up") from exc


def run(cfg: RunConfig, *, generator=None, prm=None, stream=sys.stdout) -> tuple[Summary, list[dict]]:
    """Run ``cfg`` and return its summary and every record in the output (old and new).

    ``generator``/``prm`` may be given (e.g. a :class:`sgl_tts.testing.ScriptedBackend`); otherwise
    they are opened from the config and closed at the end.
    """
    from sgl_tts.runner import run_continuously

    problems = read_problems(cfg.problems, cfg.limit)
    out_path = Path(cfg.output)
    done = read_results(out_path, cfg.run_key(), problems)
    todo = [p for p in problems if p.index not in done]
    if done:
        print(f"resuming {out_path}: {len(done)} of {len(problems)} problems already done", file=stream)
    owned = []
    try:
        if todo and generator is None:
            import sgl_tts
            generator = sgl_tts.connect(cfg.generator, runtime=cfg.runtime,
                                        local_options={"engine_in": cfg.engine_in})
            owned.append(generator)
        if todo and prm is None and cfg.uses_prm:
            prm, prm_backend = open_prm(cfg)
            owned.append(prm_backend)
        if todo and cfg.uses_prm:
            check_prm(prm, todo[0].question, cfg.prm or "the shipped PRM")
        program = program_function(cfg.program)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        failure = None
        with out_path.open("a", encoding="utf-8") as fh:
            stop = False

            def argument_sets() -> Iterator[dict[str, Any]]:
                for p in todo:
                    if stop:
                        return
                    yield cfg.program_arguments(p.question, prm)

            outcomes = run_continuously(program, argument_sets(), backend=generator,
                                        in_flight=cfg.in_flight, total=len(todo),
                                        progress=cfg.progress and bool(todo))
            for i, outcome in outcomes:
                problem = todo[i]
                err = outcome if isinstance(outcome, BaseException) else outcome.error()
                if err is not None:
                    logger.info("problem %s failed: %r", problem.id, err)   # the first is the run's one error line
                    if failure is None:
                        failure = (problem, err)
                    stop = True  # no new problems; the ones in flight still finish and are written
                    continue
                rec = result_record(problem, outcome.ret_value, cfg, cfg.uses_prm)
                append_line(fh, rec)
                done[problem.index] = rec
        if failure is not None:
            problem, err = failure
            raise RunError(f"problem {problem.id} (line {problem.index + 1}) failed: "
                           f"{type(err).__name__}: {err}; {len(done)} of {len(problems)} problems are "
                           f"in {out_path}; fix the cause and rerun the same command to resume")
    finally:
        for be in owned:
            if be is not None:
                be.shutdown()
    records = [done[p.index] for p in problems if p.index in done]
    return summarize(records, cfg.n, cfg.program), records


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts run``."""
    ap = argparse.ArgumentParser(
        prog="sgl-tts run", description="Run a TTS program over a JSONL dataset (resumable), then "
        "summarise accuracy, pass@N, accuracy vs N, goodput and latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        import transformers
        import warnings

        # a failed request is reported once, by the error line below; SGLang's interpreter would also
        # print a traceback per fork worker it stopped
        warnings.filterwarnings("ignore", message="Error in stream_executor")

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    t0 = time.perf_counter()
    try:
        cfg = config_from_args(args)
        summary, records = run(cfg)
    except (RunError, OSError, ValueError) as exc:   # OSError: ConnectionError, FileNotFoundError, ...
        logger.debug("sgl-tts run failed", exc_info=True)
        # one line, always: a multi-line message (a server's reply, say) is joined
        message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"sgl-tts run: error: {message or type(exc).__name__}", file=sys.stderr)
        # a search that failed mid-way left fork workers waiting (non-daemon threads): without this
        # the process can outlive its error (seen once in CI after a generator was killed)
        end_stream_executors()
        return 1
    from sgl_tts.machine import describe

    plot = None
    if cfg.plot:
        title = f"{cfg.program}, N={cfg.n}" + (f", M={cfg.beam_width}" if registry.program(cfg.program).budget == "beams" else "")
        plot = str(plot_summary(summary, records, cfg.plot, title))
    info = {"config": dataclasses.asdict(cfg), "summary": summary.to_json(), "output": cfg.output,
            "plot": plot, "seconds": round(time.perf_counter() - t0, 2), "machine": describe(),
            "date": time.strftime("%Y-%m-%d")}
    summary_path = Path(cfg.output).with_suffix(".summary.json")
    summary_path.write_text(json.dumps(info, indent=1) + "\n")
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"sgl-tts run: {cfg.program} N={cfg.n} on {cfg.problems or 'the embedded test split'}"
          f" -> {cfg.output}")
    print(summary.table())
    if plot:
        print(f"plot: {plot}")
    print(f"summary: {summary_path}; {info['seconds']:.1f} s on {info['machine']}")
    return 0


__all__ = ["PROGRAMS", "ProblemRecord", "RunConfig", "RunError", "Summary", "add_config_arguments", "quantile",
           "answers_at", "config_from_args", "load_yaml", "main", "plot_summary", "read_problems",
           "read_results", "read_yaml", "result_record", "run", "subsample_sizes", "summarize"]
