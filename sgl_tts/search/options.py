"""The programs' options: each setting's one home (its name, default, checks and documentation).

A program builds its options object first (:class:`BeamSearchOptions`, :class:`DVTSOptions`,
:class:`ParticleFilteringOptions`, :class:`DeepConfOptions`; MCTS has
:class:`sgl_tts.mcts.MCTSConfig`), so a bad option fails before any generation; ``sgl-tts run``
builds the same object from its settings (the program registry's checks), so a run is refused with
the very message the program would give, before a server is opened. An :class:`OptionError` names
the parameters it is about.

A field made with :func:`run_setting` is also a setting of ``sgl-tts run`` under the same name (a
YAML key, a ``--flag`` and a :class:`~sgl_tts.experiment.RunConfig` field, documented by the line of
the class's ``Attributes`` section). The settings every program shares (the budget N, the width M,
the limits, the temperature) are :class:`~sgl_tts.experiment.RunConfig`'s own; their defaults are
the ``DEFAULT_*`` constants here, which the programs' signatures read too. A program's parameter has
its setting's name, but for three: ``sgl-tts run``'s ``n`` is the program's ``num_beams``,
``num_particles``, ``num_samples`` or ``num_rollouts`` (the name says what N counts:
``ProgramSpec.budget``), ``temperature`` is ``sampling_temperature`` (SGLang's ``run()`` keeps
``n`` and ``temperature`` for its own sampling parameters, so a program cannot take them), and
``beam_width`` is MCTS's ``expansion_width``. The registry maps them (``sgl_tts.registry``), in one
place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from sgl_tts.search.steps import aggregate, step_limit

#: the defaults of the settings every program shares (one home: the options below, the programs'
#: signatures, ``sgl-tts run`` and ``serve-search`` read them here)
DEFAULT_BUDGET = 16          # N: beams, particles, samples or rollouts
DEFAULT_WIDTH = 4            # M: children per kept beam / per expansion
DEFAULT_MAX_DEPTH = 40       # most steps of a step-wise search
DEFAULT_STEP_TOKENS = 64     # token limit of a step
DEFAULT_MAX_TOKENS = 256     # token limit of a whole sample
DEFAULT_TEMPERATURE = 0.8    # sampling temperature
DEFAULT_AGGREGATION = "last"  # step scores to one score (MCTS's own default: min)

#: what marks a :func:`run_setting` field (its value: ``own`` or ``always_keyed``)
RUN_SETTING = "run_setting"


def run_setting(default: Any, *, always_keyed: bool = False) -> Any:
    """A program's option that is also a ``sgl-tts run`` setting of that program alone.

    Another program's run given it off this default is refused, and at this default it stays out
    of the run key (runs written before it existed still resume). ``always_keyed``: a setting every
    run had before the program registry (beam search's ``branching`` and ``lookahead``): every
    run's key holds it, so other programs are not refused it (their pinned keys hold its default).
    """
    return dataclasses.field(default=default, metadata={RUN_SETTING: "always_keyed" if always_keyed else "own"})


def run_settings(options: type) -> dict[str, dataclasses.Field]:
    """An options dataclass's :func:`run_setting` fields, by name, in field order."""
    return {f.name: f for f in dataclasses.fields(options) if RUN_SETTING in f.metadata}


BRANCHING = ("equal", "proportional")
SEMANTICS = ("sgl-tts", "search-and-learn")
RESAMPLING = ("multinomial", "systematic")   # particle filtering's draws
PICKS = ("best", "weighted_vote")            # particle filtering's own answer
DEEPCONF_MODES = ("online", "offline")       # DeepConf: early stopping with a warm-up, or filter all N
CONFIDENCE_MEASURES = ("lowest_group", "bottom_10", "tail", "mean")   # DeepConf's trace confidences


class OptionError(ValueError):
    """A program's options refused: the message, and the parameters (``options``) it is about."""

    def __init__(self, message: str, *options: str):
        super().__init__(message)
        self.options = options


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type: also a ``TypeError``, as SGLang's prefix tracer expects of a
    program traced with placeholder arguments (it stops tracing there)."""


@dataclasses.dataclass(frozen=True)
class TreeSearchOptions:
    """What beam search and DVTS share: N beams, M children per kept beam, the depth limit, the step
    limit (an int or a per-depth schedule), how step scores aggregate, and the two latency policies
    (speculation: ``False``/``True``, a preset name or a :class:`~sgl_tts.search.speculation.Speculation`;
    overlapped verification, by beam or, ``overlap_by_family``, by family)."""

    num_beams: int = DEFAULT_BUDGET
    beam_width: int = DEFAULT_WIDTH
    max_depth: int = DEFAULT_MAX_DEPTH
    step_tokens: int | Sequence[int] = DEFAULT_STEP_TOKENS
    aggregation: str = DEFAULT_AGGREGATION
    speculative: Any = False
    overlap_verification: bool = False
    overlap_by_family: bool = False

    def __post_init__(self):
        if self.num_beams < 1 or self.beam_width < 1:
            raise OptionError(f"{self.program} needs N >= 1 beams and a beam width M >= 1, got N={self.num_beams} "
                              f"and M={self.beam_width}", "num_beams", "beam_width")
        if self.max_depth < 1:
            raise OptionError(f"max_depth must be >= 1, got {self.max_depth}", "max_depth")
        try:
            aggregate([1.0], self.aggregation)
        except ValueError as exc:
            raise OptionError(str(exc), "aggregation") from None
        try:
            step_limit(self.step_tokens, 0)
        except ValueError as exc:
            raise OptionError(str(exc), "step_tokens") from None
        if self.overlap_by_family and not self.overlap_verification:
            raise OptionError("overlap_by_family is a way of overlapped verification: it needs "
                              "overlap_verification=True", "overlap_by_family", "overlap_verification")
        from sgl_tts.search.speculation import Speculation

        try:
            Speculation.of(self.speculative)
        except (TypeError, ValueError) as exc:
            raise OptionError(str(exc), "speculative") from None

    @property
    def program(self) -> str:
        return "tree search"


@dataclasses.dataclass(frozen=True)
class BeamSearchOptions(TreeSearchOptions):
    """Beam search's options (``programs/beam_search.py`` says more of each).

    Attributes:
        branching: beam search children per beam: ``equal`` or ``proportional`` (dynamic branching).
        lookahead: beam search lookahead rollout steps (0: none).
        semantics: beam search as sgl-tts defines it (``sgl-tts``) or as huggingface/search-and-learn
            runs it (``search-and-learn``; see ``programs/beam_search.py`` for every difference).
        filter_duplicates: beam search drops an open candidate whose path equals an earlier one's.
        sort_completed: search-and-learn semantics: return the N best completed beams, not the first N.
        accept_threshold: beam search positive early exit: stop after the first depth at which a
            finished trajectory scores at least this (``None``: off).
    """

    branching: str = run_setting("equal", always_keyed=True)
    lookahead: int = run_setting(0, always_keyed=True)
    semantics: str = run_setting("sgl-tts")
    filter_duplicates: bool = run_setting(False)
    sort_completed: bool = run_setting(False)
    accept_threshold: float | None = run_setting(None)

    def __post_init__(self):
        super().__post_init__()
        if self.branching not in BRANCHING:
            raise OptionError(f"unknown branching {self.branching!r}; choose one of {list(BRANCHING)}", "branching")
        if self.lookahead < 0:
            raise OptionError(f"lookahead must be >= 0, got {self.lookahead}", "lookahead")
        if self.semantics not in SEMANTICS:
            raise OptionError(f"unknown semantics {self.semantics!r}; choose one of {list(SEMANTICS)}", "semantics")
        if self.accept_threshold is not None and not 0.0 <= self.accept_threshold <= 1.0:
            raise OptionError(f"accept_threshold must lie in [0, 1] (a PRM score), got {self.accept_threshold}",
                              "accept_threshold")
        if self.semantics == "search-and-learn":
            if self.branching != "equal" or self.lookahead:
                raise OptionError("semantics='search-and-learn' has no branching or lookahead options (its beam "
                                  "search never reads its lookahead steps)", "semantics", "branching", "lookahead")
            if self.accept_threshold is not None:
                raise OptionError("accept_threshold (positive early exit) belongs to the default semantics",
                                  "accept_threshold", "semantics")
            if self.speculative or self.overlap_verification:
                raise OptionError("semantics='search-and-learn' runs search-and-learn's own loop; speculative and "
                                  "overlap_verification belong to the default semantics",
                                  "semantics", "speculative", "overlap_verification")
        elif self.sort_completed:
            raise OptionError("sort_completed belongs to semantics='search-and-learn' (the default mode returns "
                              "every finished trajectory)", "sort_completed", "semantics")

    @property
    def program(self) -> str:
        return "beam search"


@dataclasses.dataclass(frozen=True)
class DVTSOptions(TreeSearchOptions):
    """DVTS's options: N/M independent subtrees of M children, so N >= M."""

    def __post_init__(self):
        super().__post_init__()
        if self.num_beams < self.beam_width:
            raise OptionError(f"DVTS needs N >= M (at least one subtree of M beams), got N={self.num_beams} and "
                              f"M={self.beam_width}", "num_beams", "beam_width")

    @property
    def program(self) -> str:
        return "DVTS"


@dataclasses.dataclass(frozen=True)
class ParticleFilteringOptions(TreeSearchOptions):
    """Particle filtering's options: N particles (``num_beams``; ``beam_width`` is not read), the step
    and depth limits, the aggregation, and its own three (``programs/particle_filtering.py`` says
    more of each).

    Attributes:
        resampling: particle filtering's draws: ``multinomial`` (its_hub's) or ``systematic``.
        weight_temperature: particle filtering divides a particle's log-weight (the logit of its
            aggregated score) by it before the softmax (1: its_hub's weights).
        particle_pick: particle filtering's own answer: ``best`` (the highest-weighted particle) or
            ``weighted_vote`` (the answer holding the most probability); both are reported.
    """

    resampling: str = run_setting("multinomial")
    weight_temperature: float = run_setting(1.0)
    particle_pick: str = run_setting("best")

    def __post_init__(self):
        super().__post_init__()
        if self.resampling not in RESAMPLING:
            raise OptionError(f"unknown resampling {self.resampling!r}; choose one of {list(RESAMPLING)}", "resampling")
        if not self.weight_temperature > 0 or math.isinf(self.weight_temperature):
            raise OptionError(f"weight_temperature must be a positive number, got {self.weight_temperature}",
                              "weight_temperature")
        if self.particle_pick not in PICKS:
            raise OptionError(f"unknown particle_pick {self.particle_pick!r}; choose one of {list(PICKS)}",
                              "particle_pick")
        if self.speculative or self.overlap_verification:
            raise OptionError("particle filtering has no speculative or overlap_verification policy yet "
                              "(beam search and DVTS have)", "speculative", "overlap_verification")

    @property
    def program(self) -> str:
        return "particle filtering"


@dataclasses.dataclass(frozen=True)
class DeepConfOptions:
    """DeepConf's options (``programs/deepconf.py`` defines the confidences): N samples, the sample's
    token limit, and its own eight.

    Attributes:
        deepconf_mode: DeepConf ``online`` (a warm-up sets a confidence threshold, later samples stop
            below it, sampling stops at consensus) or ``offline`` (all N, the least confident filtered).
        keep_fraction: DeepConf's kept share eta (offline: the most confident; online: the threshold
            is the warm-up's ``1 - eta`` quantile); 0.1 is DeepConf-low, 0.9 DeepConf-high.
        confidence_window: DeepConf's group size in tokens (a group confidence averages that many).
        confidence_top_k: DeepConf's token confidence averages this many top log-probabilities.
        confidence_measure: DeepConf's sample confidence offline: ``lowest_group``, ``bottom_10``,
            ``tail`` or ``mean`` (online reads ``lowest_group``).
        warmup_samples: online DeepConf's warm-up samples (run whole; they set the threshold).
        consensus: online DeepConf stops sampling once the vote's leader holds this share of the weight.
        chunk_tokens: online DeepConf's check of a running sample's confidence: 0 at every token, inside
            generation (a custom logit processor; a server needs ``--enable-custom-logit-processor``),
            else after every this many tokens (chunks: any server).
    """

    num_samples: int = DEFAULT_BUDGET
    max_tokens: int = DEFAULT_MAX_TOKENS
    deepconf_mode: str = run_setting("online")
    keep_fraction: float = run_setting(0.9)
    confidence_window: int = run_setting(16)
    confidence_top_k: int = run_setting(20)
    confidence_measure: str = run_setting("lowest_group")
    warmup_samples: int = run_setting(4)
    consensus: float = run_setting(0.95)
    chunk_tokens: int = run_setting(0)

    def __post_init__(self):
        for name in ("num_samples", "confidence_window", "confidence_top_k", "warmup_samples", "chunk_tokens",
                     "max_tokens"):
            value = getattr(self, name)
            least = 0 if name == "chunk_tokens" else 1   # 0: stop at the token (a logit processor)
            kind = "a non-negative" if least == 0 else "a positive"
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionTypeError(f"DeepConf's {name} must be {kind} integer, got {value!r}", name)
            if value < least:
                raise OptionError(f"DeepConf's {name} must be {kind} integer, got {value!r}", name)
        if self.deepconf_mode not in DEEPCONF_MODES:
            raise OptionError(f"unknown DeepConf mode {self.deepconf_mode!r}; choose one of {list(DEEPCONF_MODES)}",
                              "deepconf_mode")
        if not 0 < self.keep_fraction <= 1:
            raise OptionError(f"keep_fraction must be in (0, 1], got {self.keep_fraction}", "keep_fraction")
        if not 0 < self.consensus <= 1:
            raise OptionError(f"consensus must be in (0, 1], got {self.consensus}", "consensus")
        if self.confidence_measure not in CONFIDENCE_MEASURES:
            raise OptionError(f"unknown confidence measure {self.confidence_measure!r}; choose one of "
                              f"{list(CONFIDENCE_MEASURES)}", "confidence_measure")
        if self.deepconf_mode == "online" and self.confidence_measure != "lowest_group":
            raise OptionError(f"online DeepConf stops a sample on its running group confidence, so it reads "
                              f"lowest_group confidence; confidence_measure {self.confidence_measure!r} is for "
                              f"deepconf_mode offline", "confidence_measure", "deepconf_mode")


__all__ = ["BRANCHING", "BeamSearchOptions", "CONFIDENCE_MEASURES", "DEEPCONF_MODES", "DEFAULT_AGGREGATION",
           "DEFAULT_BUDGET",
           "DEFAULT_MAX_DEPTH", "DEFAULT_MAX_TOKENS", "DEFAULT_STEP_TOKENS", "DEFAULT_TEMPERATURE", "DEFAULT_WIDTH",
           "DVTSOptions", "DeepConfOptions", "OptionError", "OptionTypeError", "PICKS", "ParticleFilteringOptions",
           "RESAMPLING", "RUN_SETTING", "SEMANTICS", "TreeSearchOptions", "run_setting", "run_settings"]
