"""The program registry: one record per TTS program, read by ``sgl-tts run``, ``serve-search``, the
quality comparison and the benchmarks.

A record says what a program is called, where its ``@sgl.function`` lives (imported on first use, so
reading the registry loads no program), whether it needs a PRM, which settings only it reads (with
their defaults), how a run's settings check against it, and how they become the function's keyword
arguments for one question.

**Adding a program** is one module plus one registration:

1. write ``programs/my_search.py`` with ``@sgl.function def my_search(s, question, prm, ...)``; if it
   has options to check, check them in one options dataclass (as :mod:`sgl_tts.search.options` does
   for beam search and DVTS, :class:`sgl_tts.mcts.MCTSConfig` for MCTS) that the program builds
   before it generates and the record's ``check`` builds from a run's settings: one set of checks,
   one wording, in the program and in ``sgl-tts run``;
2. if it reads settings no other program has, add them to :class:`sgl_tts.experiment.RunConfig`
   (a YAML key and a ``--flag`` each, documented there) and list them, with their defaults, in its
   record's ``settings``: another program given one off its default is refused, and a run written
   before they existed still resumes (they stay out of the run key at their defaults);
3. register it here::

       register(ProgramSpec(
           "my_search", "programs.my_search:my_search", prm="required", budget="beams",
           summary="what it does, in one line",
           settings={"my_width": 2},
           arguments=lambda cfg, question, prm: dict(_common(cfg, question), prm=prm, width=cfg.my_width),
           check=_check_my_search))   # cfg, bad -> None: bad(message, *settings) refuses

``sgl-tts run --program my_search``, ``serve-search``'s model ``my_search`` and the quality comparison
then know it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

#: a program's PRM: it cannot run without one, may use one, or never reads one
PRM_USES = ("required", "optional", "none")
#: what a program's budget N counts: beams kept per step (M = children per beam), whole samples (each
#: drawn alone: the first k of N samples are a run at budget k) or rollouts (M = children per expansion)
BUDGETS = ("beams", "samples", "rollouts")


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One program.

    Attributes:
        name: what runs and requests call it.
        function: ``module:attribute`` of its ``@sgl.function``.
        prm: ``required``, ``optional`` or ``none`` (see :data:`PRM_USES`).
        budget: what its N counts (see :data:`BUDGETS`).
        summary: one line for listings.
        settings: the run settings only this program reads, with their defaults.
        arguments: ``(cfg, question, prm) -> kwargs`` of the function for one question.
        check: ``(cfg, bad) -> None``, the program's own checks of a run's settings; ``bad(message,
            *settings)`` refuses them, naming the settings the message is about.
    """

    name: str
    function: str
    prm: str
    budget: str
    summary: str
    arguments: Callable[[Any, str, Any], dict[str, Any]]
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    check: Callable[[Any, Callable[..., None]], None] | None = None

    def __post_init__(self):
        if self.prm not in PRM_USES:
            raise ValueError(f"program {self.name}: prm must be one of {', '.join(PRM_USES)}, got {self.prm!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"program {self.name}: budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        if ":" not in self.function:
            raise ValueError(f"program {self.name}: function must be 'module:attribute', got {self.function!r}")

    def load(self) -> Any:
        """The program's ``@sgl.function``."""
        module, attr = self.function.split(":")
        return getattr(importlib.import_module(module), attr)


_PROGRAMS: dict[str, ProgramSpec] = {}


def register(spec: ProgramSpec) -> ProgramSpec:
    """Add a program (a name can be registered once)."""
    if spec.name in _PROGRAMS:
        raise ValueError(f"program {spec.name!r} is registered already")
    clash = {k for other in _PROGRAMS.values() for k in other.settings} & set(spec.settings)
    if clash:
        raise ValueError(f"program {spec.name!r}: settings {', '.join(sorted(clash))} belong to another program")
    _PROGRAMS[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """Every registered program's name, in registration order."""
    return tuple(_PROGRAMS)


def program(name: str) -> ProgramSpec:
    """The record of ``name`` (``KeyError`` naming the choices)."""
    try:
        return _PROGRAMS[name]
    except KeyError:
        raise KeyError(f"unknown program {name!r}; choose one of {', '.join(_PROGRAMS)}") from None


def find(name: str) -> ProgramSpec | None:
    """The record of ``name``, or ``None`` for an unknown name."""
    return _PROGRAMS.get(name)


def own_settings() -> dict[str, tuple[str, Any]]:
    """Every program-only setting: name -> (its program, its default)."""
    return {k: (p.name, v) for p in _PROGRAMS.values() for k, v in p.settings.items()}


# ------------------------------------------------------------------------------ the programs

def _common(cfg: Any, question: str) -> dict[str, Any]:
    return dict(question=question, sampling_temperature=cfg.temperature, seed=cfg.seed,
                delimiter=cfg.delimiter, answer_pattern=cfg.answer_pattern)


def _steps(cfg: Any) -> int | list[int]:
    return cfg.step_tokens[0] if len(cfg.step_tokens) == 1 else list(cfg.step_tokens)


def _tree(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    """Beam search's and DVTS's shared arguments."""
    out = dict(_common(cfg, question), prm=prm, num_beams=cfg.n, beam_width=cfg.beam_width,
               max_depth=cfg.max_depth, step_tokens=_steps(cfg), aggregation=cfg.aggregation)
    if cfg.speculative == "auto":
        out.update(speculative=cfg.auto_speculation())
    elif cfg.speculative != "off":
        out.update(speculative=cfg.speculative)
    if cfg.overlap_verification:
        out.update(overlap_verification=True)
    if cfg.overlap_by_family:
        out.update(overlap_by_family=True)
    return out


#: beam search's own settings (other programs refuse them off these defaults)
BEAM_SEARCH_SETTINGS = {"semantics": "sgl-tts", "filter_duplicates": False, "sort_completed": False,
                        "accept_threshold": None}


def _beam_search_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    out = dict(_tree(cfg, question, prm), branching=cfg.branching, lookahead=cfg.lookahead,
               filter_duplicates=cfg.filter_duplicates, semantics=cfg.semantics, sort_completed=cfg.sort_completed)
    if cfg.accept_threshold is not None:
        out.update(accept_threshold=cfg.accept_threshold)
    return out


#: a program parameter's name as a run setting, where they differ
_SETTING_OF = {"num_beams": "n", "pick": "particle_pick"}


def _check_options(cfg: Any, bad: Callable[..., None], options: type, **own: Any) -> None:
    """Build the tree search's options object (:mod:`sgl_tts.search.options`) from a run's settings:
    the program's own checks, with its own messages, naming the run's settings."""
    from sgl_tts.search.options import OptionError

    try:
        options(num_beams=cfg.n, beam_width=cfg.beam_width, max_depth=cfg.max_depth, step_tokens=_steps(cfg),
                aggregation=cfg.aggregation, speculative=cfg.speculative if cfg.speculative != "off" else False,
                overlap_verification=cfg.overlap_verification, overlap_by_family=cfg.overlap_by_family, **own)
    except OptionError as exc:
        bad(str(exc), *(_SETTING_OF.get(name, name) for name in exc.options))


def _check_beam_search(cfg: Any, bad: Callable[..., None]) -> None:
    from sgl_tts.search.options import BeamSearchOptions

    _check_options(cfg, bad, BeamSearchOptions, branching=cfg.branching, lookahead=cfg.lookahead,
                   semantics=cfg.semantics, filter_duplicates=cfg.filter_duplicates,
                   sort_completed=cfg.sort_completed, accept_threshold=cfg.accept_threshold)


def _check_dvts(cfg: Any, bad: Callable[..., None]) -> None:
    from sgl_tts.search.options import DVTSOptions

    _check_options(cfg, bad, DVTSOptions)


def _sampling_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), num_samples=cfg.n, prm=prm if cfg.uses_prm else None,
                aggregation=cfg.aggregation, max_tokens=cfg.max_tokens)


#: particle filtering's own settings (``programs/particle_filtering.py``)
PARTICLE_FILTERING_SETTINGS = {"resampling": "multinomial", "weight_temperature": 1.0, "particle_pick": "best"}


def _particle_filtering_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), prm=prm, num_particles=cfg.n, max_depth=cfg.max_depth,
                step_tokens=_steps(cfg), aggregation=cfg.aggregation, resampling=cfg.resampling,
                weight_temperature=cfg.weight_temperature, pick=cfg.particle_pick)


def _check_particle_filtering(cfg: Any, bad: Callable[..., None]) -> None:
    from sgl_tts.search.options import ParticleFilteringOptions

    _check_options(cfg, bad, ParticleFilteringOptions, resampling=cfg.resampling,
                   weight_temperature=cfg.weight_temperature, pick=cfg.particle_pick)


#: DeepConf's own settings (``programs/deepconf.py``; its token limit is the run's ``max_tokens``)
DEEPCONF_SETTINGS = {"deepconf_mode": "online", "keep_fraction": 0.9, "confidence_window": 16,
                     "confidence_top_k": 20, "confidence_measure": "lowest_group", "warmup_samples": 4,
                     "consensus": 0.95, "chunk_tokens": 0}
#: DeepConf's parameter of each of its settings
_DEEPCONF_PARAMETERS = {"deepconf_mode": "mode", "keep_fraction": "keep_fraction", "confidence_window": "window",
                        "confidence_top_k": "top_logprobs", "confidence_measure": "measure",
                        "warmup_samples": "warmup", "consensus": "consensus", "chunk_tokens": "chunk_tokens"}


def _deepconf_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), num_samples=cfg.n, max_tokens=cfg.max_tokens,
                **{param: getattr(cfg, setting) for setting, param in _DEEPCONF_PARAMETERS.items()})


def _check_deepconf(cfg: Any, bad: Callable[..., None]) -> None:
    from sgl_tts.search.options import DeepConfOptions, OptionError

    setting_of = {param: setting for setting, param in _DEEPCONF_PARAMETERS.items()} | {
        "num_samples": "n", "max_tokens": "max_tokens"}
    try:
        DeepConfOptions(num_samples=cfg.n, max_tokens=cfg.max_tokens,
                        **{param: getattr(cfg, setting) for setting, param in _DEEPCONF_PARAMETERS.items()})
    except OptionError as exc:
        bad(str(exc), *(setting_of.get(name, name) for name in exc.options))


MCTS_SETTINGS = {"parallel": 1, "c_puct": 1.0, "threshold": 0.9, "positive_exit": True, "negative_exit": False,
                 "futility": "path", "first_step_cutoff": None}


def _mcts_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), prm=prm, num_rollouts=cfg.n, expansion_width=cfg.beam_width,
                max_depth=cfg.max_depth, step_tokens=_steps(cfg), aggregation=cfg.aggregation,
                **{k: getattr(cfg, k) for k in MCTS_SETTINGS})


def _check_mcts(cfg: Any, bad: Callable[..., None]) -> None:
    if cfg.parallel < 1:
        bad(f"parallel must be a positive integer, got {cfg.parallel}", "parallel")
    from sgl_tts.mcts import MCTSConfig
    try:
        MCTSConfig(num_rollouts=cfg.n, expansion_width=cfg.beam_width, c_puct=cfg.c_puct,
                   aggregation=cfg.aggregation, threshold=cfg.threshold, positive_exit=cfg.positive_exit,
                   negative_exit=cfg.negative_exit, futility=cfg.futility,
                   first_step_cutoff=cfg.first_step_cutoff, max_depth=cfg.max_depth)
    except ValueError as exc:
        bad(str(exc), "program", "n", "beam_width", "aggregation", "max_depth", *MCTS_SETTINGS)


register(ProgramSpec("beam_search", "programs.beam_search:beam_search", prm="required", budget="beams",
                     summary="PRM beam search: keep N beams, M children each, the best N by PRM score",
                     arguments=_beam_search_arguments, settings=BEAM_SEARCH_SETTINGS, check=_check_beam_search))
register(ProgramSpec("dvts", "programs.dvts:dvts", prm="required", budget="beams",
                     summary="diverse verifier tree search: N/M independent subtrees, greedy in each",
                     arguments=_tree, check=_check_dvts))
register(ProgramSpec("best_of_n", "programs.best_of_n:best_of_n", prm="optional", budget="samples",
                     summary="N whole samples, the best by PRM score (or the majority without a PRM)",
                     arguments=_sampling_arguments))
register(ProgramSpec("self_consistency", "programs.best_of_n:best_of_n", prm="none", budget="samples",
                     summary="N whole samples, the majority answer",
                     arguments=_sampling_arguments))
register(ProgramSpec("mcts", "programs.mcts:mcts", prm="required", budget="rollouts",
                     summary="Monte Carlo tree search over steps, PRM-scored, with early exits",
                     arguments=_mcts_arguments, settings=MCTS_SETTINGS, check=_check_mcts))
register(ProgramSpec("particle_filtering", "programs.particle_filtering:particle_filtering", prm="required",
                     budget="beams",
                     summary="particle filtering: N particles weighted by PRM scores, resampled every step",
                     arguments=_particle_filtering_arguments, settings=PARTICLE_FILTERING_SETTINGS,
                     check=_check_particle_filtering))
register(ProgramSpec("deepconf", "programs.deepconf:deepconf", prm="none", budget="samples",
                     summary="DeepConf: N samples voted by their token confidence, low-confidence ones "
                             "filtered (offline) or stopped early (online)",
                     arguments=_deepconf_arguments, settings=DEEPCONF_SETTINGS, check=_check_deepconf))

__all__ = ["BEAM_SEARCH_SETTINGS", "BUDGETS", "DEEPCONF_SETTINGS", "MCTS_SETTINGS", "PARTICLE_FILTERING_SETTINGS", "PRM_USES", "ProgramSpec", "find", "names", "own_settings", "program", "register"]
