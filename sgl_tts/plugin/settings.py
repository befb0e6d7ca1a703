"""The plugin's server flags: the "test-time scaling" group of ``python -m sglang.launch_server``.

Values reach every scheduler process twice over: as attributes of the pickled ``ServerArgs`` and as
``SGLANG_TTS_*`` environment variables that spawned children inherit (an in-process ``sglang.Engine``,
which takes no plugin keywords, is configured through the same variables). Not ``SGL_``: SGLang
rewrites every ``SGL_*`` variable to ``SGLANG_*`` with a deprecation warning in each of its processes
(``sglang.srt.environ``), which also keeps the old names working there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Mapping

POLICIES = ("off", "prefix-aware", "locality")
CPU_ATTENTION = ("native", "ragged")   # --tts-cpu-attention (sgl_tts.plugin.attention.cpu_attention)
# --tts-locality-rules: which of the locality policy's rules act (sgl_tts.plugin.scheduling.residency): its two
# rules (both), one alone to measure what each contributes (the ablation of issue 32), or both plus
# whole-family admission (families)
LOCALITY_RULES = ("both", "eviction", "order", "families")
# --tts-admission: what comes first within a request class (sgl_tts.plugin.scheduling.policy): the requests'
# own order (request), or the oldest search's requests before a newer search's (search, issue 64)
ADMISSIONS = ("request", "search")
# --tts-sparse-attention (sgl_tts.plugin.attention.sparse_attention): seed 003's asynchronous selection, the
# same selection with the current query (synchronous), Quest's pages with the current query
SPARSE_MODES = ("off", "async", "sync", "quest")
# --tts-sparse-frame: where async predicts the next query (sgl_tts.plugin.attention.sparse_decoding)
SPARSE_FRAMES = ("rotary", "query")
# --tts-sparse-worker: where async's choice runs (sgl_tts.plugin.attention.sparse_worker)
SPARSE_WORKERS = ("process", "thread")
# --tts-sparse-stand-down: whether rows attend densely where sparse measured slower (sgl_tts.plugin.attention.sparse_payoff)
SPARSE_STAND_DOWN = ("auto", "off")


@dataclasses.dataclass(frozen=True)
class SparseSettings:
    """Query-aware sparse decode attention (seed 003, AsyncSpade; :mod:`sgl_tts.plugin.attention.sparse_attention`).

    Attributes:
        mode: ``off``; ``async`` (the next step's tokens chosen beside the current step from a
            predicted query); ``sync`` (the same token-level choice from the current query, in the
            step); ``quest`` (Quest's page-level choice from the current query).
        budget: tokens a decode row attends to: an integer >= 1, or a fraction in (0, 1) of the
            row's context (rounded up). Sinks and recent tokens count in it.
        windows: the window sizes of the next-query regression (``async``).
        ridge: the ridge term, relative to the window's mean squared query norm.
        sink: the first positions always kept; recent: the last positions always kept.
        dense_below: rows with a shorter context attend densely (so do rows whose budget covers
            their context, and prefill).
        dense_layers: the first layers always attend densely (Quest keeps its first two dense: their
            attention follows the current token's content, which no earlier query predicts).
        measure: also choose each sparse row's tokens with its current query (as ``sync`` does) and
            count how many of them the row's selection has (the seed's overlap ratio, per layer, in
            the counters): the quality of the selection, at the cost of a ``sync`` choice per row.
        frame: ``rotary`` (default): ``async`` predicts the next query with the recent queries
            rotated back to position 0 and turns the prediction to the next position; ``query``: on
            the rotated queries themselves (the seed's literal reading).
        worker: where ``async`` chooses: ``process`` (default) or ``thread``.
        stand_down: ``auto`` (default): rows attend densely at context lengths where this server
            measured sparse attention no faster than dense (:mod:`sgl_tts.plugin.attention.sparse_payoff`);
            ``off``: every eligible row attends sparsely (what the quality measurements want).
    """

    mode: str = "off"
    budget: float = 0.5
    windows: tuple = (4, 8, 16)
    ridge: float = 0.01
    sink: int = 4
    recent: int = 16
    dense_below: int = 1024
    dense_layers: int = 2
    frame: str = "rotary"
    measure: bool = False
    worker: str = "process"
    stand_down: str = "auto"

    def __post_init__(self):
        if self.stand_down not in SPARSE_STAND_DOWN:
            raise ValueError(f"--tts-sparse-stand-down must be one of {', '.join(SPARSE_STAND_DOWN)}, "
                             f"got {self.stand_down!r}")
        if self.worker not in SPARSE_WORKERS:
            raise ValueError(f"--tts-sparse-worker must be one of {', '.join(SPARSE_WORKERS)}, got {self.worker!r}")
        if self.frame not in SPARSE_FRAMES:
            raise ValueError(f"--tts-sparse-frame must be one of {', '.join(SPARSE_FRAMES)}, got {self.frame!r}")
        if self.mode not in SPARSE_MODES:
            raise ValueError(f"--tts-sparse-attention must be one of {', '.join(SPARSE_MODES)}, got {self.mode!r}")
        b = self.budget
        if isinstance(b, float) and b >= 1 and b == int(b):        # 64.0 (JSON, YAML) is 64 tokens
            object.__setattr__(self, "budget", b := int(b))
        tokens = isinstance(b, int) and not isinstance(b, bool) and b >= 1
        if not (tokens or (isinstance(b, float) and 0 < b < 1)):
            raise ValueError(f"--tts-sparse-budget must be a number of tokens (>= 1) or a fraction in (0, 1), "
                             f"got {b!r}")
        windows = tuple(self.windows)
        if not windows or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in windows):
            raise ValueError(f"--tts-sparse-windows must be positive integers, got {self.windows!r}")
        object.__setattr__(self, "windows", tuple(sorted(set(windows))))
        if not (isinstance(self.ridge, (int, float)) and self.ridge > 0):
            raise ValueError(f"--tts-sparse-ridge must be positive, got {self.ridge!r}")
        for name in ("sink", "recent"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--tts-sparse-{name} must be a non-negative integer, got {v!r}")
        if self.recent < 1:
            raise ValueError("--tts-sparse-recent must be at least 1 (a row's own newest token)")
        if isinstance(self.budget, int) and self.budget < self.sink + self.recent:
            raise ValueError(f"--tts-sparse-budget {self.budget} is smaller than the tokens always kept "
                             f"(--tts-sparse-sink {self.sink} + --tts-sparse-recent {self.recent})")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise ValueError(f"--tts-sparse-dense-layers must be a non-negative integer, got {self.dense_layers!r}")
        if isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int) or self.dense_below < 1:
            raise ValueError(f"--tts-sparse-dense-below must be a positive integer, got {self.dense_below!r}")

    @property
    def history(self) -> int:
        """Queries kept per row and layer: the longest window and the newest query."""
        return max(self.windows) + 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SparseSettings":
        try:
            fields = json.loads(text)
            return cls(**{**fields, "windows": tuple(fields.get("windows", cls.windows))})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"SGLANG_TTS_SPARSE is not a sparse-attention setting: {text!r} ({exc})") from None

    def args(self) -> list[str]:
        """The flags off their defaults."""
        d, out = SparseSettings(), []
        for name in ("mode", "budget", "windows", "ridge", "sink", "recent", "dense_below", "dense_layers", "frame",
                     "measure", "worker", "stand_down"):
            v = getattr(self, name)
            if v != getattr(d, name):
                flag = "--tts-sparse-attention" if name == "mode" else "--tts-sparse-" + name.replace("_", "-")
                if name == "measure":
                    out.append("--tts-sparse-measure")
                else:
                    out += [flag, ",".join(map(str, v)) if name == "windows" else str(v)]
        return out


@dataclasses.dataclass(frozen=True)
class TTSSettings:
    """The plugin's settings (all off by default: the server then behaves exactly as stock SGLang).

    Attributes:
        policy: ``off``, ``prefix-aware`` (order the waiting queue: siblings together, parents in a
            stable order, greedy longest shared prefix, request classes; any queue length) or
            ``locality`` (``prefix-aware``, and under KV pressure: eviction by next use in the
            waiting order, resident families admitted first; :mod:`sgl_tts.plugin.scheduling.residency`).
        dedup_tokens: with ``prefix-aware``, when consecutive waiting requests share at least this
            many tokens that are not cached yet, only the first prefills them this round.
        metrics_file: write scheduler metrics (JSONL) to ``<metrics_file>.<pid>`` per scheduler
            process (works with either policy: compare stock and prefix-aware runs). SGLang's
            ``--enable-metrics`` adds the ``sgl_tts_*`` Prometheus series only with this or with
            ``policy="prefix-aware"``, never alone.
        seeded_sampling: a request's ``sampling_seed`` decides its samples (SGLang 0.5.15 honours
            seeds only with ``--enable-deterministic-inference``, which its CPU attention backends
            refuse); see :mod:`sgl_tts.plugin.scheduling.seeding`.
        max_wait: with ``prefix-aware``, a normal or boosted request that has waited this many
            seconds goes first (oldest first): the aging bound against starvation. ``None``: never.
        cpu_attention: ``native`` (SGLang's ``torch_native`` attention, one call per sequence) or
            ``ragged`` (:mod:`sgl_tts.plugin.attention.cpu_attention`: decode rows batched by length, extends
            over their new tokens only; equal to float rounding). Acts where the server runs
            ``torch_native`` (the CPU); elsewhere nothing changes.
        sparse: :class:`SparseSettings` (``--tts-sparse-*``), query-aware sparse decode attention
            where the server runs ``torch_native``; it implies ``ragged`` for the dense part.
        admission: with ``prefix-aware`` or ``locality``, ``request`` (default: within a class the
            order above, across searches) or ``search``: within a class (and priority) every waiting
            request of the search seen first goes before any of a search seen later, each search's
            requests in the order above; aged requests go first as ever, oldest search first. Many
            searches on one server then finish one after another instead of all slowing together,
            and the pool holds the older searches' trees (issue 64).
    """

    policy: str = "off"
    dedup_tokens: int = 32
    metrics_file: str | None = None
    seeded_sampling: bool = False
    max_wait: float | None = 5.0
    cpu_attention: str = "native"
    locality_rules: str = "both"
    sparse: SparseSettings = SparseSettings()
    admission: str = "request"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"--tts-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not isinstance(self.dedup_tokens, int) or self.dedup_tokens < 1:
            raise ValueError(f"--tts-dedup-tokens must be a positive integer, got {self.dedup_tokens!r}")
        if self.max_wait is not None and not (isinstance(self.max_wait, (int, float)) and self.max_wait > 0):
            raise ValueError(f"--tts-max-wait must be a positive number of seconds or 'off', got {self.max_wait!r}")
        if self.cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"--tts-cpu-attention must be one of {', '.join(CPU_ATTENTION)}, "
                             f"got {self.cpu_attention!r}")
        if self.locality_rules not in LOCALITY_RULES:
            raise ValueError(f"--tts-locality-rules must be one of {', '.join(LOCALITY_RULES)}, "
                             f"got {self.locality_rules!r}")
        if self.locality_rules != "both" and self.policy != "locality":
            raise ValueError(f"--tts-locality-rules {self.locality_rules} acts only with --tts-policy locality "
                             f"(the server runs --tts-policy {self.policy})")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"--tts-admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.admission != "request" and not self.active:
            raise ValueError(f"--tts-admission {self.admission} orders the waiting queue and needs --tts-policy "
                             f"prefix-aware or locality (the server runs --tts-policy {self.policy})")

    @property
    def by_search(self) -> bool:
        """Whether the oldest search's requests go first within a class (``--tts-admission search``)."""
        return self.admission == "search"

    @property
    def active(self) -> bool:
        return self.policy != "off"

    @property
    def evicts_by_next_use(self) -> bool:
        """The locality policy's first rule: the radix cache evicts by next use under pressure."""
        return self.policy == "locality" and self.locality_rules in ("both", "eviction", "families")

    @property
    def resident_first(self) -> bool:
        """The locality policy's second rule: resident families are admitted first under pressure."""
        return self.policy == "locality" and self.locality_rules in ("both", "order", "families")

    @property
    def admits_whole_families(self) -> bool:
        """The locality policy's third rule (with ``families``): under pressure, while anything runs, a
        family waits until the whole of it fits without evicting a later family's prefix."""
        return self.policy == "locality" and self.locality_rules == "families"

    @property
    def any_on(self) -> bool:
        """Whether any ``--tts-*`` flag asks the plugin to act (all off: stock SGLang)."""
        return (self.active or bool(self.metrics_file) or self.seeded_sampling or self.cpu_attention != "native"
                or self.sparse.mode != "off")

    def args(self) -> list[str]:
        """These settings as ``launch_server`` flags, the ones off their defaults only (so a server
        given none of them, or ``SGLANG_PLUGINS=none``, sees no ``--tts-*`` flag at all)."""
        d = TTSSettings()
        out = ["--tts-policy", self.policy] if self.policy != d.policy else []
        if self.dedup_tokens != d.dedup_tokens:
            out += ["--tts-dedup-tokens", str(self.dedup_tokens)]
        if self.seeded_sampling:
            out.append("--tts-seeded-sampling")
        if self.max_wait != d.max_wait:
            out += ["--tts-max-wait", "off" if self.max_wait is None else repr(float(self.max_wait))]
        if self.metrics_file:
            out += ["--tts-metrics-file", str(self.metrics_file)]
        if self.cpu_attention != d.cpu_attention:
            out += ["--tts-cpu-attention", self.cpu_attention]
        if self.locality_rules != d.locality_rules:
            out += ["--tts-locality-rules", self.locality_rules]
        if self.admission != d.admission:
            out += ["--tts-admission", self.admission]
        return out + self.sparse.args()

    def env(self) -> dict[str, str]:
        env = {"SGLANG_TTS_POLICY": self.policy, "SGLANG_TTS_DEDUP_TOKENS": str(self.dedup_tokens)}
        if self.metrics_file:
            env["SGLANG_TTS_METRICS_FILE"] = self.metrics_file
        if self.seeded_sampling:
            env["SGLANG_TTS_SEEDED_SAMPLING"] = "1"
        env["SGLANG_TTS_MAX_WAIT"] = "off" if self.max_wait is None else repr(float(self.max_wait))
        env["SGLANG_TTS_CPU_ATTENTION"] = self.cpu_attention
        env["SGLANG_TTS_LOCALITY_RULES"] = self.locality_rules
        env["SGLANG_TTS_SPARSE"] = self.sparse.to_json()
        env["SGLANG_TTS_ADMISSION"] = self.admission
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TTSSettings":
        env = os.environ if environ is None else environ
        try:
            dedup = int(env.get("SGLANG_TTS_DEDUP_TOKENS", cls.dedup_tokens))
        except ValueError:
            raise ValueError(f"SGLANG_TTS_DEDUP_TOKENS must be an integer, got "
                             f"{env.get('SGLANG_TTS_DEDUP_TOKENS')!r}") from None
        return cls(env.get("SGLANG_TTS_POLICY", cls.policy), dedup, env.get("SGLANG_TTS_METRICS_FILE") or None,
                   env.get("SGLANG_TTS_SEEDED_SAMPLING", "") == "1",
                   parse_max_wait(env.get("SGLANG_TTS_MAX_WAIT", str(cls.max_wait))),
                   env.get("SGLANG_TTS_CPU_ATTENTION", cls.cpu_attention),
                   env.get("SGLANG_TTS_LOCALITY_RULES", cls.locality_rules),
                   SparseSettings.from_json(env["SGLANG_TTS_SPARSE"]) if env.get("SGLANG_TTS_SPARSE")
                   else SparseSettings(), env.get("SGLANG_TTS_ADMISSION", cls.admission))

    @classmethod
    def of(cls, server_args: Any) -> "TTSSettings":
        """The settings a scheduler runs with: ``ServerArgs`` attributes, else the environment."""
        if hasattr(server_args, "tts_policy"):
            return cls(server_args.tts_policy, server_args.tts_dedup_tokens,
                       getattr(server_args, "tts_metrics_file", None),
                       bool(getattr(server_args, "tts_seeded_sampling", False)),
                       getattr(server_args, "tts_max_wait", cls.max_wait),
                       getattr(server_args, "tts_cpu_attention", cls.cpu_attention),
                       getattr(server_args, "tts_locality_rules", cls.locality_rules),
                       getattr(server_args, "tts_sparse", None) or SparseSettings(),
                       getattr(server_args, "tts_admission", cls.admission))
        return cls.from_env()


def parse_max_wait(text: str) -> float | None:
    """``--tts-max-wait``: seconds (> 0), or ``off``."""
    if str(text).strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (> 0) or 'off', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds (> 0) or 'off', got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected tokens (>= 1) or a fraction in (0, 1), got {text!r}") from None
    return int(value) if value >= 1 and value == int(value) else value


def _windows(text: str) -> tuple:
    try:
        return tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated window sizes, got {text!r}") from None


def _sparse_default() -> SparseSettings:
    env = os.environ.get("SGLANG_TTS_SPARSE")
    return SparseSettings.from_json(env) if env else SparseSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the "test-time scaling (sgl-tts)" flag group."""
    if any(a.dest == "tts_policy" for a in parser._actions):
        return  # already added (a parser built twice in one process)
    group = parser.add_argument_group(
        "test-time scaling (sgl-tts)",
        "Scheduling for tree-search programs (best-of-N, beam search, DVTS, MCTS) whose requests "
        "carry sgl-tts search metadata; see sgl-tts docs/SCHEDULER_PLUGIN.md.")
    group.add_argument("--tts-policy", choices=POLICIES, default=os.environ.get("SGLANG_TTS_POLICY", "off"),
                       help="off: stock SGLang scheduling. prefix-aware: admit siblings of one parent "
                            "together, keep parents in a stable order across iterations, greedily "
                            "maximise the prefix shared with the previous admission, boosted requests "
                            "first and speculative ones only into free slots; any queue length. "
                            "locality: prefix-aware, and while less than a quarter of the KV pool is "
                            "free, evict what the waiting queue needs last and admit families whose "
                            "prefix is cached first.")
    group.add_argument("--tts-dedup-tokens", type=_positive_int,
                       default=int(os.environ.get("SGLANG_TTS_DEDUP_TOKENS", "32")),
                       help="with --tts-policy prefix-aware: requests sharing at least this many "
                            "uncached tokens with the request before them wait one round, so the "
                            "shared prefix is prefilled once (default 32)")
    group.add_argument("--tts-metrics-file", default=os.environ.get("SGLANG_TTS_METRICS_FILE") or None,
                       metavar="PATH",
                       help="write scheduler metrics (batch sizes, KV occupancy, prefill tokens per "
                            "request, prefix-cache hits, evictions, recomputed blocks) as JSONL to "
                            "PATH.<pid>, one file per scheduler process; summarise with `sgl-tts "
                            "scheduler-stats PATH.*`. With SGLang's --enable-metrics the counters are "
                            "also sgl_tts_* Prometheus metrics on /metrics (as they are with "
                            "--enable-metrics --tts-policy prefix-aware and no file); --enable-metrics "
                            "alone adds none (stock SGLang)")
    group.add_argument("--tts-seeded-sampling", action="store_true",
                       default=os.environ.get("SGLANG_TTS_SEEDED_SAMPLING", "") == "1",
                       help="a request's sampling_seed decides its samples, whatever its batch (stock "
                            "SGLang 0.5.15 ignores seeds unless --enable-deterministic-inference, which "
                            "the CPU backends refuse); unseeded requests draw a random seed. Needs the "
                            "pytorch sampling backend (the CPU default; --sampling-backend pytorch on a GPU)")
    group.add_argument("--tts-max-wait", type=parse_max_wait, metavar="SECONDS",
                       default=parse_max_wait(os.environ.get("SGLANG_TTS_MAX_WAIT", "5")),
                       help="with --tts-policy prefix-aware: a normal or boosted request that has "
                            "waited this long is admitted before anything else, oldest first (the "
                            "bound against one search starving another; default 5, 'off' for none)")
    group.add_argument("--tts-cpu-attention", choices=CPU_ATTENTION,
                       default=os.environ.get("SGLANG_TTS_CPU_ATTENTION", "native"),
                       help="where the server runs SGLang's torch_native attention (the CPU): native "
                            "keeps it; ragged batches decode rows of similar length into one call and "
                            "extends a cached prefix by attending with its new tokens only (equal to "
                            "float rounding, several times faster for tree searches' one-token steps)")
    group.add_argument("--tts-locality-rules", choices=LOCALITY_RULES,
                       default=os.environ.get("SGLANG_TTS_LOCALITY_RULES", "both"),
                       help="with --tts-policy locality: both rules (default), or one alone to measure "
                            "what it contributes: eviction (evict what the waiting queue needs last) or "
                            "order (admit families whose prefix is cached first); families: both, and "
                            "while anything runs a family is admitted only when all of it fits without "
                            "evicting the cached prefix of a family waiting after it")
    group.add_argument("--tts-admission", choices=ADMISSIONS,
                       default=os.environ.get("SGLANG_TTS_ADMISSION", "request"),
                       help="with --tts-policy prefix-aware or locality: request (default) orders a class's "
                            "waiting requests across searches; search puts every waiting request of the "
                            "search seen first before any of a later search (many searches at once then "
                            "finish one after another instead of all slowing together)")
    _add_sparse_arguments(group)


def _add_sparse_arguments(group) -> None:
    """The ``--tts-sparse-*`` flags (:class:`SparseSettings`)."""
    sparse = _sparse_default()
    group.add_argument("--tts-sparse-attention", choices=SPARSE_MODES, default=sparse.mode,
                       help="where the server runs SGLang's torch_native attention (the CPU): query-aware "
                            "sparse decode attention (seed 003). async: each decode row attends to the "
                            "tokens a predicted query chose beside the previous step; sync: the same choice "
                            "from the current query, in the step; quest: Quest's 16-token pages from the "
                            "current query; off (default): dense")
    group.add_argument("--tts-sparse-budget", type=_budget, default=sparse.budget, metavar="TOKENS|FRACTION",
                       help="tokens a sparse decode row attends to, or that fraction of its context "
                            "(default 0.5)")
    group.add_argument("--tts-sparse-windows", type=_windows, default=sparse.windows, metavar="W,W,...",
                       help="window sizes of the next-query regression (default 4,8,16)")
    group.add_argument("--tts-sparse-ridge", type=float, default=sparse.ridge,
                       help="ridge term of the regression, relative to the queries' mean square (default 0.01)")
    group.add_argument("--tts-sparse-sink", type=int, default=sparse.sink,
                       help="first tokens every sparse row keeps (default 4)")
    group.add_argument("--tts-sparse-recent", type=int, default=sparse.recent,
                       help="last tokens every sparse row keeps (default 16)")
    group.add_argument("--tts-sparse-dense-below", type=_positive_int, default=sparse.dense_below,
                       metavar="TOKENS", help="rows with a shorter context attend densely (default 1024)")
    group.add_argument("--tts-sparse-dense-layers", type=int, default=sparse.dense_layers, metavar="N",
                       help="the first N layers always attend densely (default 2, as Quest)")
    group.add_argument("--tts-sparse-measure", action="store_true", default=sparse.measure,
                       help="also choose each sparse row's tokens from its current query and count the "
                            "overlap with what it attended to (per layer, in the counters file "
                            "--tts-metrics-file PATH.sparse.<pid>); costs a sync choice per row")
    group.add_argument("--tts-sparse-frame", choices=SPARSE_FRAMES, default=sparse.frame,
                       help="async: predict the next query in the rotary frame (recent queries rotated back "
                            "to position 0, the prediction turned to the next position; default) or on the "
                            "rotated queries themselves (query, the seed's reading)")
    group.add_argument("--tts-sparse-worker", choices=SPARSE_WORKERS, default=sparse.worker,
                       help="async: choose in a process of its own, the key pools in shared memory (process, "
                            "default: seed 003's cache rank), or in a thread of the scheduler (thread: it "
                            "shares the scheduler's interpreter lock)")
    group.add_argument("--tts-sparse-stand-down", choices=SPARSE_STAND_DOWN, default=sparse.stand_down,
                       help="auto (default): rows attend densely at context lengths where the server measured "
                            "sparse attention no faster than dense (timed from its own steps, measured again "
                            "every 64 steps); off: every eligible row attends sparsely")


def sparse_from_args(args: argparse.Namespace) -> SparseSettings:
    """The ``--tts-sparse-*`` flags as :class:`SparseSettings` (defaults where a flag is absent)."""
    d = SparseSettings()
    return SparseSettings(getattr(args, "tts_sparse_attention", d.mode), getattr(args, "tts_sparse_budget", d.budget),
                          tuple(getattr(args, "tts_sparse_windows", d.windows)),
                          getattr(args, "tts_sparse_ridge", d.ridge), getattr(args, "tts_sparse_sink", d.sink),
                          getattr(args, "tts_sparse_recent", d.recent),
                          getattr(args, "tts_sparse_dense_below", d.dense_below),
                          getattr(args, "tts_sparse_dense_layers", d.dense_layers),
                          getattr(args, "tts_sparse_frame", d.frame),
                          bool(getattr(args, "tts_sparse_measure", d.measure)),
                          getattr(args, "tts_sparse_worker", d.worker),
                          getattr(args, "tts_sparse_stand_down", d.stand_down))


def apply(server_args: Any, args: argparse.Namespace) -> TTSSettings:
    """Validate the parsed flags against the rest of the server's settings, store them on
    ``server_args`` and mirror them into the environment for child processes."""
    settings = TTSSettings(getattr(args, "tts_policy", "off"), getattr(args, "tts_dedup_tokens", 32),
                           getattr(args, "tts_metrics_file", None), bool(getattr(args, "tts_seeded_sampling", False)),
                           getattr(args, "tts_max_wait", TTSSettings.max_wait),
                           getattr(args, "tts_cpu_attention", TTSSettings.cpu_attention),
                           getattr(args, "tts_locality_rules", TTSSettings.locality_rules),
                           sparse_from_args(args), getattr(args, "tts_admission", TTSSettings.admission))
    if settings.active and getattr(server_args, "disable_radix_cache", False):
        raise ValueError("--tts-policy prefix-aware orders requests by their cached prefixes and needs "
                         "the radix cache: drop --disable-radix-cache (or use --tts-policy off)")
    server_args.tts_policy = settings.policy
    server_args.tts_dedup_tokens = settings.dedup_tokens
    if settings.seeded_sampling and getattr(server_args, "sampling_backend", None) not in (None, "pytorch"):
        raise ValueError(f"--tts-seeded-sampling needs --sampling-backend pytorch (the server uses "
                         f"{server_args.sampling_backend!r}, which ignores or refuses per-request seeds)")
    server_args.tts_metrics_file = settings.metrics_file
    server_args.tts_seeded_sampling = settings.seeded_sampling
    server_args.tts_max_wait = settings.max_wait
    server_args.tts_cpu_attention = settings.cpu_attention
    server_args.tts_locality_rules = settings.locality_rules
    server_args.tts_sparse = settings.sparse
    server_args.tts_admission = settings.admission
    os.environ.update(settings.env())
    return settings


__all__ = ["ADMISSIONS", "CPU_ATTENTION", "LOCALITY_RULES", "POLICIES", "SPARSE_FRAMES", "SPARSE_MODES", "SPARSE_STAND_DOWN", "SPARSE_WORKERS", "SparseSettings", "TTSSettings",
           "add_arguments", "apply", "sparse_from_args"]
