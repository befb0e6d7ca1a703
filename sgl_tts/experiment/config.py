"""``sgl-tts run``'s settings: :class:`RunConfig` (validation, the run key, the program's arguments
through the registry), reading it from YAML and flags (defaults < YAML < flags), and the one-line
:class:`RunError`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

from sgl_tts import records, registry
from sgl_tts.search import AGGREGATIONS, BOXED, STEP_DELIMITER
from sgl_tts.search.options import (DEFAULT_AGGREGATION, DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, DEFAULT_MAX_TOKENS,
                                    DEFAULT_STEP_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_WIDTH)
from sgl_tts.search.speculation import SPECULATION_PRESETS

# kept for old imports: the programs as registered at import (sgl_tts.registry holds them, later ones too)
PROGRAMS = registry.names()
MCTS_SETTINGS = registry.MCTS_SETTINGS   # MCTS's own settings and their defaults (registry)
PRM_KINDS = ("auto", "step_tag", "reward_head", "step_pooled")
RULES = ("majority", "prm_weighted", "prm_best")


class RunError(Exception):
    """A bad input or a failed run: its message is one line naming the problem and the fix.

    ``settings``: the :class:`RunConfig` fields a bad-setting error is about (so an error caused by a
    config file's key can name the file and the key's line).
    """

    def __init__(self, message: str, settings: Sequence[str] = ()):
        super().__init__(message)
        self.settings = tuple(settings)


def program_settings(cls: type) -> type:
    """``cls`` as a dataclass, with a field for each registered program's own settings (the
    :func:`~sgl_tts.search.options.run_setting` fields of its options dataclass: the same name,
    type and default), after its own fields. The run key hashes them by these names, as it did when
    ``RunConfig`` listed them itself (the pinned keys stay)."""
    for name, (_, f) in registry.setting_fields().items():
        if name in cls.__annotations__:
            raise TypeError(f"{cls.__name__}.{name} is a program's setting already (its options class holds it)")
        cls.__annotations__[name] = f.type
        setattr(cls, name, f.default)
    return dataclasses.dataclass(cls)


@program_settings
class RunConfig:
    """Every setting of ``sgl-tts run`` (YAML keys and ``--flags`` have these names, ``_`` or ``-``):
    the settings every program shares, below, and each registered program's own settings, the
    :func:`~sgl_tts.search.options.run_setting` fields of its options dataclass (their home: name,
    default, checks and documentation; :func:`program_settings` adds them to this class).

    Attributes:
        problems: JSONL dataset; ``None``: the embedded tiny task's test split.
        output: results JSONL, one line per finished problem (appended to on a rerun).
        limit: run only the first ``limit`` problems.
        program: ``beam_search``, ``dvts``, ``best_of_n``, ``self_consistency`` (majority vote,
            no PRM), ``particle_filtering``, ``deepconf`` (confidence-weighted vote, no PRM) or ``mcts``.
        n: the budget N: beams (beam search, DVTS), particles (particle filtering), samples
            (best-of-N, DeepConf) or rollouts (MCTS).
        beam_width: M, children per kept beam (beam search), per subtree (DVTS) or per expansion (MCTS).
        max_depth: most steps of a tree search.
        step_tokens: token limit of a step; several values are a per-depth schedule.
        max_tokens: token limit of a whole best-of-N sample.
        temperature: sampling temperature.
        aggregation: step scores to one score: ``last``, ``min``, ``prod`` or ``mean``.
        speculative: speculative beam extension of beam search and DVTS: ``off``, ``exact`` (every
            trajectory is the plain search's) or ``truncate`` (FlashTTS's R mode, an approximation);
            with LookAhead verification (see :mod:`sgl_tts.search.pipeline`); ``exact-no-lookahead``:
            exact, without LookAhead verification; ``auto``: exact, each branch started only where a
            measured decode curve says it pays (:mod:`sgl_tts.search.speculation_cost`).
        speculation_curve: ``auto``'s decode curve: ``measure`` (the generator server's, measured when
            the run starts and cached per server: :mod:`sgl_tts.launch.decode_curve`; a CPU backend
            is no server to measure, so the run is refused), ``none`` (no curve: no branch starts), or
            a JSON file with ``points: [[batch, seconds], ...]``.
        verifier_shares_device: ``auto`` stops running branches at a depth's barrier when the PRM
            shares the generator's device: ``yes``, ``no`` or ``auto`` (both on one host).
        verifier_slowdown: where the PRM shares the device, ``auto``'s measure of what a branch
            running beside the verification costs it: ``measure`` (the PRM server's slowdown beside
            the generator server's decoding, measured when the run starts and cached per pair:
            :mod:`sgl_tts.launch.verifier_slowdown`; a branch keeps running only where it saves more),
            ``none`` (every running branch stops at the barrier), or a JSON file with ``points:
            [[rows, seconds], ...]``.
        overlap_verification: beam search and DVTS send a beam's PRM request as soon as its step ends.
        overlap_by_family: with ``overlap_verification``, a family's PRM requests (one parent's
            children) go together once every sibling's step ended, so that a PRM whose KV cache is
            under pressure computes their shared path once (:mod:`sgl_tts.search.pipeline`).
        seed: sampling seed of the run (each sample's seed derives from it).
        delimiter: step delimiter.
        answer_pattern: regex whose first group is the answer.
        generator: generator model folder or SGLang server URL; ``None``: the embedded default.
        runtime: ``auto``, ``server``, ``cuda`` or ``cpu`` (see :func:`sgl_tts.connect`).
        cpu_engine: where the CPU backend's models run: ``thread``, ``process`` (a child process
            each) or ``auto`` (processes from 8 in flight; see
            :func:`sgl_tts.backends.layout.choose_engine`).
        cpu_replicas: generator engines, each in a process of its own, requests routed by prompt
            prefix (:mod:`sgl_tts.backends.replicas`); ``None``: one per core where ``auto`` chose
            processes (a tree search with 64+ in flight: one), else 1.
        prm: PRM model folder or SGLang server URL; ``None``: the shipped tiny PRM; ``"none"``: no
            PRM (best-of-N then ranks nothing and picks the majority).
        prm_kind: ``auto`` (from the PRM's architecture, :func:`sgl_tts.prm.detect.detect_prm`),
            ``step_tag`` (P(good) after each step tag), ``reward_head`` (a classifier / reward head
            read at the end of each step prefix) or ``step_pooled`` (Qwen2.5-Math-PRM, Skywork-o1-Open-PRM
            served by SGLang with the sgl-tts plugin: every step's score in one request).
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
    n: int = DEFAULT_BUDGET
    beam_width: int = DEFAULT_WIDTH
    max_depth: int = DEFAULT_MAX_DEPTH
    step_tokens: list[int] = dataclasses.field(default_factory=lambda: [DEFAULT_STEP_TOKENS])
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    aggregation: str = DEFAULT_AGGREGATION
    speculative: str = "off"
    overlap_verification: bool = False
    overlap_by_family: bool = False
    speculation_curve: str = "measure"
    verifier_shares_device: str = "auto"
    verifier_slowdown: str = "measure"
    seed: int = 0
    delimiter: str = STEP_DELIMITER
    answer_pattern: str = BOXED
    generator: str | None = None
    runtime: str = "auto"
    cpu_engine: str = "auto"
    cpu_replicas: int | None = None
    prm: str | None = None
    prm_kind: str = "auto"
    prm_tokenizer: str | None = None
    prm_good: str = "+"
    prm_bad: str = "-"
    prm_tag: str = STEP_DELIMITER
    in_flight: int = 8
    plot: str | None = None
    progress: bool = True
    # + every program's own settings (program_settings, at the end of this class)

    # Settings that do not change any result (a run may resume under different values of these). The
    # dataset's path is one: a resumed run checks each written problem's question instead.
    NOT_IN_RUN_KEY: typing.ClassVar[tuple[str, ...]] = (
        "problems", "output", "limit", "in_flight", "plot", "progress", "runtime", "cpu_engine",
        "cpu_replicas", "speculation_curve", "verifier_shares_device", "verifier_slowdown")
    # Settings added after runs were written: at their default they stay out of the run key, so an
    # earlier run (which behaved as the default) still resumes. Programs' own settings (registry) too:
    # beam search's semantics, filter_duplicates, sort_completed and accept_threshold, MCTS's settings.
    KEYED_WHEN_SET: typing.ClassVar[dict[str, Any]] = {
        # never change a kept beam (exact); truncate changes samples, so it is keyed
        "speculative": "off", "overlap_verification": False, "overlap_by_family": False}
    # Settings that never change a result: the same key with them on or off (a run may resume either way).
    SAME_RESULTS: typing.ClassVar[dict[str, tuple[Any, ...]]] = {
        "speculative": ("off", "exact", "exact-no-lookahead", "auto"), "overlap_verification": (False, True),
        "overlap_by_family": (False, True)}

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
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.speculative not in ("off", *SPECULATION_PRESETS):
            bad(f"unknown speculative mode {self.speculative!r}; choose off, {', '.join(SPECULATION_PRESETS)}",
                "speculative")
        if (self.speculative != "off" or self.overlap_verification or self.overlap_by_family) \
                and self.program not in ("beam_search", "dvts"):
            bad("speculative, overlap_verification and overlap_by_family are settings of beam_search and dvts",
                "speculative", "overlap_verification", "overlap_by_family", "program")
        if self.verifier_shares_device not in ("auto", "yes", "no"):
            bad(f"verifier_shares_device must be auto, yes or no, got {self.verifier_shares_device!r}",
                "verifier_shares_device")
        if (self.speculation_curve, self.verifier_shares_device, self.verifier_slowdown) != ("measure", "auto", "measure") \
                and self.speculative != "auto":
            bad("speculation_curve, verifier_shares_device and verifier_slowdown are settings of speculative: auto",
                "speculation_curve", "verifier_shares_device", "verifier_slowdown", "speculative")
        if self.verifier_slowdown not in ("measure", "none"):
            from sgl_tts.server_costs import VerifierSlowdown

            try:
                VerifierSlowdown.load(self.verifier_slowdown)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                bad(f"verifier_slowdown {self.verifier_slowdown!r}: not a verifier slowdown file ({exc}); "
                    "give measure, none or a JSON file with points: [[rows, seconds], ...] (rows 0 first)",
                    "verifier_slowdown")
        if self.speculation_curve not in ("measure", "none"):
            from sgl_tts.server_costs import DecodeCurve

            try:
                DecodeCurve.load(self.speculation_curve)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                bad(f"speculation_curve {self.speculation_curve!r}: not a decode curve file ({exc}); "
                    "give measure, none or a JSON file with points: [[batch, seconds], ...]", "speculation_curve")
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
        if self.cpu_replicas is not None and self.cpu_replicas < 1:
            bad(f"cpu_replicas must be at least 1, got {self.cpu_replicas}", "cpu_replicas")

    @property
    def engine_layout(self):
        """How a CPU backend opened for this run lays its engines out (``cpu_engine`` resolved for the
        program and ``in_flight``): a :class:`~sgl_tts.backends.local.EngineLayout`."""
        from sgl_tts.backends.layout import choose_engine

        spec = registry.find(self.program)
        try:
            return choose_engine(self.cpu_engine, tree_search=spec is not None and spec.budget != "samples",
                                 in_flight=self.in_flight, replicas=self.cpu_replicas)
        except ValueError as exc:
            raise RunError(f"cpu_replicas: {exc}", ("cpu_replicas", "cpu_engine")) from None

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
        if fields.get("prm_kind") == "auto":
            # keyed as step_tag, the default before auto: auto reads a causal-LM PRM as step_tag did (runs
            # written then still resume), and a PRM auto reads otherwise is another model, another path
            fields["prm_kind"] = "step_tag"
        if self.program == "beam_search" and self.semantics == "sgl-tts":
            # its step seeds are keyed by (depth, parent, child) since issue 18 (before: by beam index),
            # so a run written before samples differently and does not resume into this one
            fields["seeds"] = SEED_SCHEME
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def shares_device(self) -> bool:
        """Whether the PRM runs on the generator's device (``verifier_shares_device``; ``auto``: both
        served from one host, a CPU backend being this one)."""
        if self.verifier_shares_device != "auto":
            return self.verifier_shares_device == "yes"
        return _host(self.generator) == _host(self.prm)

    def auto_speculation(self):
        """``speculative: auto`` as the programs' policy: exact speculation under the cost controller,
        on the curve of ``speculation_curve`` (``none``: no curve, so nothing starts and the searches
        say why; ``measure`` left unresolved: the search measures its generator server's, and refuses
        a generator that is no server)."""
        from sgl_tts.search.speculation import Speculation
        from sgl_tts.server_costs import DecodeCurve, VerifierSlowdown

        curve = None if self.speculation_curve in ("measure", "none") else DecodeCurve.load(self.speculation_curve)
        slowdown = None if self.verifier_slowdown in ("measure", "none") else VerifierSlowdown.load(self.verifier_slowdown)
        return Speculation(controlled=True, curve=curve, verifier_shares_device=self.shares_device, slowdown=slowdown,
                           measure_curve=self.speculation_curve == "measure")

    def program_arguments(self, question: str, prm) -> dict[str, Any]:
        """The keyword arguments of the chosen program for one question (its registry record's)."""
        return registry.program(self.program).arguments(self, question, prm)


_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _host(where: str | None) -> str:
    """The host serving a model: a URL's host (this machine's names as one), else this machine."""
    if where and "://" in where:
        from urllib.parse import urlsplit

        host = urlsplit(where).hostname or ""
        return "local" if host in _LOCAL_HOSTS else host
    return "local"


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
    try:
        return records.utf8_text(data, where)
    except ValueError as exc:
        raise RunError(f"{exc}; save the file as UTF-8") from None


def field_kind(field: dataclasses.Field) -> str:
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
    kind = field_kind(field)
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


def config_from_options(config: str | os.PathLike | None, options: Mapping[str, Any]) -> RunConfig:
    """The config from a YAML file (``config``, or None) with ``options`` over it: command-line values
    by field name (others are ignored), each read as its field's kind (``"4,8"`` for a list of ints,
    say); a bad one raises :class:`RunError` naming its flag."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    overrides = {}
    for name, value in options.items():
        if name in fields:
            try:
                overrides[name] = _coerce(fields[name], value)
            except (TypeError, ValueError) as exc:
                raise RunError(f"--{name.replace('_', '-')}: {exc}") from None
    return RunConfig.from_sources(config, overrides)
