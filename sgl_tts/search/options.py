"""The tree searches' options, checked in one place.

A program builds its options object first (:class:`BeamSearchOptions`, :class:`DVTSOptions`; MCTS has
:class:`sgl_tts.mcts.MCTSConfig`), so a bad option fails before any generation; ``sgl-tts run``
builds the same object from its settings (the program registry's checks), so a run is refused with
the very message the program would give, before a server is opened. An :class:`OptionError` names
the parameters it is about (the registry maps them to the run's setting names).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from sgl_tts.search.steps import aggregate, step_limit

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
    (speculation: ``False``/``True``, a preset name or a :class:`~sgl_tts.search.pipeline.Speculation`;
    overlapped verification, by beam or, ``overlap_by_family``, by family)."""

    num_beams: int = 16
    beam_width: int = 4
    max_depth: int = 40
    step_tokens: int | Sequence[int] = 64
    aggregation: str = "last"
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
        from sgl_tts.search.pipeline import Speculation

        try:
            Speculation.of(self.speculative)
        except (TypeError, ValueError) as exc:
            raise OptionError(str(exc), "speculative") from None

    @property
    def program(self) -> str:
        return "tree search"


@dataclasses.dataclass(frozen=True)
class BeamSearchOptions(TreeSearchOptions):
    """Beam search's options (``programs/beam_search.py`` documents each)."""

    branching: str = "equal"
    lookahead: int = 0
    semantics: str = "sgl-tts"
    filter_duplicates: bool = False
    sort_completed: bool = False
    accept_threshold: float | None = None

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
    and depth limits, the aggregation, and its own three (``programs/particle_filtering.py``
    documents each)."""

    resampling: str = "multinomial"
    weight_temperature: float = 1.0
    pick: str = "best"

    def __post_init__(self):
        super().__post_init__()
        if self.resampling not in RESAMPLING:
            raise OptionError(f"unknown resampling {self.resampling!r}; choose one of {list(RESAMPLING)}", "resampling")
        if not self.weight_temperature > 0 or math.isinf(self.weight_temperature):
            raise OptionError(f"weight_temperature must be a positive number, got {self.weight_temperature}",
                              "weight_temperature")
        if self.pick not in PICKS:
            raise OptionError(f"unknown pick {self.pick!r}; choose one of {list(PICKS)}", "pick")
        if self.speculative or self.overlap_verification:
            raise OptionError("particle filtering has no speculative or overlap_verification policy yet "
                              "(beam search and DVTS have)", "speculative", "overlap_verification")

    @property
    def program(self) -> str:
        return "particle filtering"


@dataclasses.dataclass(frozen=True)
class DeepConfOptions:
    """DeepConf's options (``programs/deepconf.py`` documents each): N samples, the mode, the kept
    fraction, the confidence window and top-k, the offline measure, the online warm-up, consensus
    and check interval (0: every token, inside generation), and the sample's token limit."""

    num_samples: int = 16
    mode: str = "online"
    keep_fraction: float = 0.9
    window: int = 16
    top_logprobs: int = 20
    measure: str = "lowest_group"
    warmup: int = 4
    consensus: float = 0.95
    chunk_tokens: int = 0
    max_tokens: int = 256

    def __post_init__(self):
        for name in ("num_samples", "window", "top_logprobs", "warmup", "chunk_tokens", "max_tokens"):
            value = getattr(self, name)
            least = 0 if name == "chunk_tokens" else 1   # 0: stop at the token (a logit processor)
            kind = "a non-negative" if least == 0 else "a positive"
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionTypeError(f"DeepConf's {name} must be {kind} integer, got {value!r}", name)
            if value < least:
                raise OptionError(f"DeepConf's {name} must be {kind} integer, got {value!r}", name)
        if self.mode not in DEEPCONF_MODES:
            raise OptionError(f"unknown DeepConf mode {self.mode!r}; choose one of {list(DEEPCONF_MODES)}", "mode")
        if not 0 < self.keep_fraction <= 1:
            raise OptionError(f"keep_fraction must be in (0, 1], got {self.keep_fraction}", "keep_fraction")
        if not 0 < self.consensus <= 1:
            raise OptionError(f"consensus must be in (0, 1], got {self.consensus}", "consensus")
        if self.measure not in CONFIDENCE_MEASURES:
            raise OptionError(f"unknown confidence measure {self.measure!r}; choose one of "
                              f"{list(CONFIDENCE_MEASURES)}", "measure")
        if self.mode == "online" and self.measure != "lowest_group":
            raise OptionError(f"online DeepConf stops a sample on its running group confidence, so it reads "
                              f"lowest_group confidence; measure {self.measure!r} is for mode offline",
                              "measure", "mode")


__all__ = ["BRANCHING", "BeamSearchOptions", "CONFIDENCE_MEASURES", "DEEPCONF_MODES", "DVTSOptions",
           "DeepConfOptions", "OptionError", "OptionTypeError", "PICKS", "ParticleFilteringOptions",
           "RESAMPLING", "SEMANTICS", "TreeSearchOptions"]
