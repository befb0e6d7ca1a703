"""The program registry: what it holds, how a program is added, and that every record's arguments are
its function's parameters."""

from __future__ import annotations

import inspect

import pytest

from sgl_tts import registry
from sgl_tts.experiment import RunConfig, RunError, program_function
from sgl_tts.registry import ProgramSpec


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry that a test may add to."""
    monkeypatch.setattr(registry, "_PROGRAMS", dict(registry._PROGRAMS))


def test_the_registered_programs():
    assert registry.names() == ("beam_search", "dvts", "best_of_n", "self_consistency", "mcts", "particle_filtering",
                                "deepconf")
    assert {n: (registry.program(n).prm, registry.program(n).budget) for n in registry.names()} == {
        "beam_search": ("required", "beams"), "dvts": ("required", "beams"), "best_of_n": ("optional", "samples"),
        "self_consistency": ("none", "samples"), "mcts": ("required", "rollouts"),
        "particle_filtering": ("required", "beams"), "deepconf": ("none", "samples")}
    assert registry.own_settings() == {"semantics": ("beam_search", "sgl-tts"), "filter_duplicates": ("beam_search", False),
                                       "sort_completed": ("beam_search", False), "accept_threshold": ("beam_search", None),
                                       **{k: ("mcts", v) for k, v in registry.MCTS_SETTINGS.items()},
                                       "resampling": ("particle_filtering", "multinomial"),
                                       "weight_temperature": ("particle_filtering", 1.0),
                                       "particle_pick": ("particle_filtering", "best"),
                                       "deepconf_mode": ("deepconf", "online"), "keep_fraction": ("deepconf", 0.9),
                                       "confidence_window": ("deepconf", 16), "confidence_top_k": ("deepconf", 20),
                                       "confidence_measure": ("deepconf", "lowest_group"),
                                       "warmup_samples": ("deepconf", 4), "consensus": ("deepconf", 0.95),
                                       "chunk_tokens": ("deepconf", 0)}
    with pytest.raises(KeyError, match="unknown program 'bfs'; choose one of beam_search, dvts"):
        registry.program("bfs")


@pytest.mark.parametrize("name", registry.names())
def test_every_argument_is_a_parameter_of_the_program(name):
    cfg = RunConfig(program=name, **({"prm": "none"} if name == "self_consistency" else {}))
    cfg.validate()
    args = cfg.program_arguments("What is 2+3?", prm=object())
    fn = program_function(name)
    params = inspect.signature(fn.func).parameters
    assert set(args) <= set(params) - {"s"}
    missing = [p for p, v in params.items() if p != "s" and v.default is inspect.Parameter.empty and p not in args]
    assert missing == []


def test_adding_a_program_is_one_registration(scratch_registry):
    seen = []

    def check(cfg, bad):
        if cfg.n % 2:
            bad(f"toy needs an even n, got {cfg.n}", "n")
        seen.append(cfg.n)

    registry.register(ProgramSpec("toy", "programs.best_of_n:best_of_n", prm="optional", budget="samples",
                                  summary="a test program", check=check,
                                  arguments=lambda cfg, q, prm: dict(question=q, num_samples=cfg.n, prm=prm)))
    assert registry.names()[-1] == "toy"
    RunConfig(program="toy", n=4).validate()
    assert seen == [4]
    with pytest.raises(RunError, match="toy needs an even n, got 3"):
        RunConfig(program="toy", n=3).validate()
    with pytest.raises(RunError, match="parallel: settings of program mcts"):
        RunConfig(program="toy", n=4, parallel=2).validate()
    assert RunConfig(program="toy", n=4).program_arguments("q", "P") == {"question": "q", "num_samples": 4, "prm": "P"}
    from programs.best_of_n import best_of_n
    assert program_function("toy") is best_of_n
    # another program's record is unchanged by the addition
    assert RunConfig(program="beam_search").run_key() == RunConfig(program="beam_search").run_key()


def test_bad_records_are_refused(scratch_registry):
    ok = dict(function="m:f", prm="none", budget="samples", summary="", arguments=lambda c, q, p: {})
    with pytest.raises(ValueError, match="program 'mcts' is registered already"):
        registry.register(ProgramSpec("mcts", **ok))
    with pytest.raises(ValueError, match="program 'x': settings c_puct belong to another program"):
        registry.register(ProgramSpec("x", **{**ok, "settings": {"c_puct": 2.0}}))
    with pytest.raises(ValueError, match="program y: prm must be one of required, optional, none, got 'maybe'"):
        ProgramSpec("y", **{**ok, "prm": "maybe"})
    with pytest.raises(ValueError, match="program y: budget must be one of beams, samples, rollouts, got 'steps'"):
        ProgramSpec("y", **{**ok, "budget": "steps"})
    with pytest.raises(ValueError, match="program y: function must be 'module:attribute', got 'm.f'"):
        ProgramSpec("y", **{**ok, "function": "m.f"})


def test_run_keys_did_not_move():
    # recorded before the registry (runs written then must still resume): the default run, an MCTS
    # run with its own settings, and a run at another program
    assert RunConfig().run_key() == RUN_KEYS["default"]
    assert RunConfig(program="mcts", parallel=4, negative_exit=True, aggregation="min").run_key() == RUN_KEYS["mcts"]
    assert RunConfig(program="best_of_n", n=8).run_key() == RUN_KEYS["best_of_n"]


RUN_KEYS = {"default": "38285ef2a532", "mcts": "4c828d99a93c", "best_of_n": "a29e92e27173"}   # at 82df6c1


def test_beam_search_s_positive_early_exit_is_its_own_setting():
    """``accept_threshold`` (what `sgl-tts load`'s beam-search side runs): beam search's only, checked,
    passed through, and out of the run key at its default (runs written before it still resume)."""
    cfg = RunConfig(program="beam_search", accept_threshold=0.75)
    cfg.validate()
    assert cfg.program_arguments("q", "P")["accept_threshold"] == 0.75
    assert "accept_threshold" not in RunConfig(program="beam_search").program_arguments("q", "P")
    assert cfg.run_key() != RunConfig(program="beam_search").run_key() == RUN_KEYS["default"]
    for bad, message in ((dict(program="mcts", accept_threshold=0.5), "accept_threshold: settings of program beam_search"),
                         (dict(accept_threshold=1.5), r"accept_threshold must lie in \[0, 1\] \(a PRM score\), got 1.5"),
                         (dict(accept_threshold=0.5, semantics="search-and-learn"),
                          "accept_threshold \\(positive early exit\\) belongs to the default semantics")):
        with pytest.raises(RunError, match=message):
            RunConfig(**bad).validate()


@pytest.mark.parametrize("program, arguments, settings", [
    ("beam_search", dict(branching="random"), dict(branching="random")),
    ("beam_search", dict(lookahead=-1), dict(lookahead=-1)),
    ("beam_search", dict(semantics="sal"), dict(semantics="sal")),
    ("beam_search", dict(semantics="search-and-learn", lookahead=2), dict(semantics="search-and-learn", lookahead=2)),
    ("beam_search", dict(sort_completed=True), dict(sort_completed=True)),
    ("beam_search", dict(accept_threshold=1.5), dict(accept_threshold=1.5)),
    ("beam_search", dict(semantics="search-and-learn", accept_threshold=0.5),
     dict(semantics="search-and-learn", accept_threshold=0.5)),
    ("beam_search", dict(semantics="search-and-learn", overlap_verification=True),
     dict(semantics="search-and-learn", overlap_verification=True)),
    ("beam_search", dict(step_tokens=[64, 0]), dict(step_tokens=[64, 0])),
    ("dvts", dict(num_beams=2, beam_width=4), dict(n=2, beam_width=4)),
])
def test_a_run_is_refused_with_the_words_the_program_would_use(program, arguments, settings):
    """One home for the tree searches' checks (sgl_tts.search.options): `sgl-tts run` refuses bad
    settings before any server is opened, with the program's own message, naming the run's settings."""
    from sgl_tts.testing import ScriptedBackend, ScriptedPRM

    with pytest.raises(ValueError) as by_program:
        program_function(program).run(question="1+1?", prm=ScriptedPRM(lambda step: 0.5),
                                      backend=ScriptedBackend(lambda prefix, draw: "2\n\n"), **arguments)
    with pytest.raises(RunError) as by_run:
        RunConfig(program=program, **settings).validate()
    assert str(by_run.value) == str(by_program.value)
    assert set(by_run.value.settings) & set(settings), by_run.value.settings   # it names what was set


def test_each_programs_options_are_the_one_home_of_its_settings():
    """A program's own settings are its options dataclass's ``run_setting`` fields: ``RunConfig`` has a
    field of each name and default, ``sgl-tts run`` a flag with its documentation, and the program a
    parameter of that name whose default is read from the options (nothing written twice)."""
    import dataclasses

    from sgl_tts.cli.run import build_parser, field_docs
    from sgl_tts.search.options import run_settings

    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    flags = {a.dest for a in build_parser()._actions}
    docs = field_docs()
    declared = set()
    for name in registry.names():
        spec = registry.program(name)
        if spec.options is None:
            continue
        params = inspect.signature(program_function(name).func).parameters
        for setting, f in run_settings(spec.options).items():
            declared.add(setting)
            assert defaults[setting] == f.default and setting in flags and docs[setting], setting
            assert params[setting].default == f.default, (name, setting)
        args = RunConfig(program=name).program_arguments("q", "P")
        assert {k for k in args if k in run_settings(spec.options)} <= set(params)
    assert declared == {k for k, _ in registry.setting_fields().items()}
    # the settings every program shares keep their names and defaults; the programs' are the options'
    assert set(defaults) - declared == {
        "problems", "output", "limit", "program", "n", "beam_width", "max_depth", "step_tokens", "max_tokens",
        "temperature", "aggregation", "speculative", "overlap_verification", "overlap_by_family", "speculation_curve",
        "verifier_shares_device", "verifier_slowdown", "seed", "delimiter", "answer_pattern", "generator", "runtime",
        "cpu_engine", "cpu_replicas", "prm", "prm_kind", "prm_tokenizer", "prm_good", "prm_bad", "prm_tag",
        "in_flight", "plot", "progress"}
    assert declared == {"branching", "lookahead", *registry.own_settings()}
