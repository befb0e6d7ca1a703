"""The program registry: one record per TTS program, read by ``sgl-tts run``, ``serve-search``, the
quality comparison and the benchmarks.

A record says what a program is called, where its ``@sgl.function`` lives (imported on first use, so
reading the registry loads no program), whether it needs a PRM, which settings only it reads (with
their defaults), how a run's settings check against it, and how they become the function's keyword
arguments for one question.

**Adding a program** is one module, one options dataclass and one registration:

1. write ``programs/my_search.py`` with ``@sgl.function def my_search(s, question, prm, ...)``;
2. give it one options dataclass (as :mod:`sgl_tts.search.options` does for beam search, DVTS,
   particle filtering and DeepConf, :class:`sgl_tts.mcts.MCTSConfig` for MCTS), the home of its
   settings: the program builds it before it generates and the record's ``check`` builds it from a
   run's settings (one set of checks, one wording). A setting no other program has is a field made
   with :func:`~sgl_tts.search.options.run_setting` (its default), documented in the class's
   ``Attributes``: :class:`sgl_tts.experiment.RunConfig` then has it, with a YAML key and a
   ``--flag`` of its name; another program given it off its default is refused, and a run written
   before it existed still resumes (it stays out of the run key at its default). The program's
   parameter has the same name (and reads its default from the options class);
3. register it here (before :mod:`sgl_tts.experiment.config` is imported: ``RunConfig`` is built
   then)::

       register(ProgramSpec(
           "my_search", "programs.my_search:my_search", prm="required", budget="beams",
           summary="what it does, in one line", options=MySearchOptions,
           arguments=lambda cfg, question, prm: dict(_common(cfg, question), prm=prm,
                                                     **_own(cfg, MySearchOptions)),
           check=_check_my_search))   # cfg, bad -> None: bad(message, *settings) refuses

``sgl-tts run --program my_search``, ``serve-search``'s model ``my_search`` and the quality comparison
then know it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

from sgl_tts.mcts.tree import MCTSConfig
from sgl_tts.search.options import (RUN_SETTING, BeamSearchOptions, DVTSOptions, DeepConfOptions, OptionError,
                                    ParticleFilteringOptions, run_settings)

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
        settings: the run settings only this program reads, with their defaults; given ``options``,
            its :func:`~sgl_tts.search.options.run_setting` fields (but the ``always_keyed`` ones).
        options: the program's options dataclass, the home of its own settings: each
            :func:`~sgl_tts.search.options.run_setting` field is a ``sgl-tts run`` setting (a
            :class:`~sgl_tts.experiment.RunConfig` field, a YAML key and a ``--flag``) of that name,
            default and documentation.
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
    options: type | None = None

    def __post_init__(self):
        if self.options is not None and not self.settings:
            own = {k: f.default for k, f in run_settings(self.options).items() if f.metadata[RUN_SETTING] == "own"}
            object.__setattr__(self, "settings", own)
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
    if spec.options is not None:   # (an options class two programs share, as DVTS's, adds none twice)
        clash |= set(run_settings(spec.options)) & {k for k, (owner, _) in setting_fields().items()
                                                    if owner.options is not spec.options}
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


def setting_fields() -> dict[str, tuple[ProgramSpec, dataclasses.Field]]:
    """Every program's own ``sgl-tts run`` settings as they are declared, in registration order:
    name -> (its program's record, its options field: type, default, ``always_keyed`` or not)."""
    out: dict[str, tuple[ProgramSpec, dataclasses.Field]] = {}
    for p in _PROGRAMS.values():
        if p.options is not None:
            for name, f in run_settings(p.options).items():
                out.setdefault(name, (p, f))
    return out


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


def _own(cfg: Any, options: type) -> dict[str, Any]:
    """A run's values of the program's own settings (its options' run settings: the same names)."""
    return {k: getattr(cfg, k) for k in run_settings(options)}


def _beam_search_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    out = dict(_tree(cfg, question, prm), **_own(cfg, BeamSearchOptions))
    if cfg.accept_threshold is None:   # (as before the setting existed: the program's default)
        del out["accept_threshold"]
    return out


#: a program parameter's name as a run setting, where they differ: the budget N and MCTS's width M
_SETTING_OF = {"num_beams": "n", "num_samples": "n", "num_rollouts": "n", "expansion_width": "beam_width"}


def _check_options(cfg: Any, bad: Callable[..., None], options: type) -> None:
    """Build a step-wise search's options object (:mod:`sgl_tts.search.options`) from a run's settings:
    the program's own checks, with its own messages, naming the run's settings."""
    try:
        options(num_beams=cfg.n, beam_width=cfg.beam_width, max_depth=cfg.max_depth, step_tokens=_steps(cfg),
                aggregation=cfg.aggregation, speculative=cfg.speculative if cfg.speculative != "off" else False,
                overlap_verification=cfg.overlap_verification, overlap_by_family=cfg.overlap_by_family,
                **_own(cfg, options))
    except OptionError as exc:
        bad(str(exc), *(_SETTING_OF.get(name, name) for name in exc.options))


def _check_beam_search(cfg: Any, bad: Callable[..., None]) -> None:
    _check_options(cfg, bad, BeamSearchOptions)


def _check_dvts(cfg: Any, bad: Callable[..., None]) -> None:
    _check_options(cfg, bad, DVTSOptions)


def _sampling_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), num_samples=cfg.n, prm=prm if cfg.uses_prm else None,
                aggregation=cfg.aggregation, max_tokens=cfg.max_tokens)


def _particle_filtering_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), prm=prm, num_particles=cfg.n, max_depth=cfg.max_depth,
                step_tokens=_steps(cfg), aggregation=cfg.aggregation, **_own(cfg, ParticleFilteringOptions))


def _check_particle_filtering(cfg: Any, bad: Callable[..., None]) -> None:
    _check_options(cfg, bad, ParticleFilteringOptions)


def _deepconf_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), num_samples=cfg.n, max_tokens=cfg.max_tokens, **_own(cfg, DeepConfOptions))


def _check_deepconf(cfg: Any, bad: Callable[..., None]) -> None:
    try:
        DeepConfOptions(num_samples=cfg.n, max_tokens=cfg.max_tokens, **_own(cfg, DeepConfOptions))
    except OptionError as exc:
        bad(str(exc), *(_SETTING_OF.get(name, name) for name in exc.options))


def _mcts_arguments(cfg: Any, question: str, prm: Any) -> dict[str, Any]:
    return dict(_common(cfg, question), prm=prm, num_rollouts=cfg.n, expansion_width=cfg.beam_width,
                max_depth=cfg.max_depth, step_tokens=_steps(cfg), aggregation=cfg.aggregation,
                **_own(cfg, MCTSConfig))


def _check_mcts(cfg: Any, bad: Callable[..., None]) -> None:
    try:
        MCTSConfig(num_rollouts=cfg.n, expansion_width=cfg.beam_width, aggregation=cfg.aggregation,
                   max_depth=cfg.max_depth, **_own(cfg, MCTSConfig))
    except ValueError as exc:
        bad(str(exc), "program", "n", "beam_width", "aggregation", "max_depth", *run_settings(MCTSConfig))


register(ProgramSpec("beam_search", "programs.beam_search:beam_search", prm="required", budget="beams",
                     summary="PRM beam search: keep N beams, M children each, the best N by PRM score",
                     arguments=_beam_search_arguments, options=BeamSearchOptions, check=_check_beam_search))
register(ProgramSpec("dvts", "programs.dvts:dvts", prm="required", budget="beams",
                     summary="diverse verifier tree search: N/M independent subtrees, greedy in each",
                     arguments=_tree, options=DVTSOptions, check=_check_dvts))
register(ProgramSpec("best_of_n", "programs.best_of_n:best_of_n", prm="optional", budget="samples",
                     summary="N whole samples, the best by PRM score (or the majority without a PRM)",
                     arguments=_sampling_arguments))
register(ProgramSpec("self_consistency", "programs.best_of_n:best_of_n", prm="none", budget="samples",
                     summary="N whole samples, the majority answer",
                     arguments=_sampling_arguments))
register(ProgramSpec("mcts", "programs.mcts:mcts", prm="required", budget="rollouts",
                     summary="Monte Carlo tree search over steps, PRM-scored, with early exits",
                     arguments=_mcts_arguments, options=MCTSConfig, check=_check_mcts))
register(ProgramSpec("particle_filtering", "programs.particle_filtering:particle_filtering", prm="required",
                     budget="beams",
                     summary="particle filtering: N particles weighted by PRM scores, resampled every step",
                     arguments=_particle_filtering_arguments, options=ParticleFilteringOptions,
                     check=_check_particle_filtering))
register(ProgramSpec("deepconf", "programs.deepconf:deepconf", prm="none", budget="samples",
                     summary="DeepConf: N samples voted by their token confidence, low-confidence ones "
                             "filtered (offline) or stopped early (online)",
                     arguments=_deepconf_arguments, options=DeepConfOptions, check=_check_deepconf))

# each program's own settings with their defaults (kept for old imports: the options hold them)
BEAM_SEARCH_SETTINGS = dict(program("beam_search").settings)
PARTICLE_FILTERING_SETTINGS = dict(program("particle_filtering").settings)
DEEPCONF_SETTINGS = dict(program("deepconf").settings)
MCTS_SETTINGS = dict(program("mcts").settings)

__all__ = ["BEAM_SEARCH_SETTINGS", "BUDGETS", "DEEPCONF_SETTINGS", "MCTS_SETTINGS", "PARTICLE_FILTERING_SETTINGS",
           "PRM_USES", "ProgramSpec", "find", "names", "own_settings", "program", "register", "setting_fields"]
