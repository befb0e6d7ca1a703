"""What importing a layer loads: the scheduler plugin (loaded in every SGLang scheduler process) and the
wire protocol stay apart from the client (issue 31), and the package's names still load on use."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import sgl_tts
from sgl_tts.protocol import (GROUP_PREFIX, SearchTag, check_group, group_prefix, is_group_prefix, is_tagged_rid,
                              rid_depth, rid_group, rid_prefix)

# what the plugin must never pull in: the client's backends and CPU engine, SGLang's frontend
# interpreter, the programs and experiments, and the heavy libraries behind them
CLIENT_SIDE = ("sgl_tts.backends", "sgl_tts.search.pipeline", "sgl_tts.search", "sgl_tts.experiment", "sgl_tts.search.runner",
               "sgl_tts.prm", "sgl_tts.mcts", "programs", "sglang.lang", "transformers", "torch")


def _loaded_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_plugin_loads_none_of_the_client():
    # the PRM model classes (sgl_tts.plugin.models.*) are model code: SGLang's model registry imports
    # them where it loads models, torch already in place; the next test holds them to the rest
    loaded = _loaded_after("import importlib, pkgutil, sgl_tts.plugin as p\n"
                           "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
                           "    if not m.name.startswith('sgl_tts.plugin.models.'): importlib.import_module(m.name)")
    # it did load the plugin, both parts, and its model registration imported no model class
    assert {"sgl_tts.plugin.scheduling.policy", "sgl_tts.plugin.attention.sparse_attention",
            "sgl_tts.plugin.model_registry", "sgl_tts.plugin.models"} <= set(loaded)
    assert "sgl_tts.protocol" in loaded
    assert not [m for m in loaded if m.startswith("sgl_tts.plugin.models.")]
    client = [m for m in loaded if any(m == c or m.startswith(c + ".") for c in CLIENT_SIDE)]
    assert client == []


def test_the_plugins_model_classes_load_torch_and_sglang_and_nothing_of_the_client():
    loaded = _loaded_after("import importlib, pkgutil, sgl_tts.plugin.models as p\n"
                           "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'): importlib.import_module(m.name)")
    assert {"sgl_tts.plugin.models.qwen2_prm", "sgl_tts.plugin.models.step_pooling", "torch"} <= set(loaded)
    client = [m for m in loaded if any(m == c or m.startswith(c + ".") for c in CLIENT_SIDE if c != "torch")]
    assert client == []


def test_the_protocol_imports_nothing_of_sgl_tts_or_sglang():
    loaded = _loaded_after("import sgl_tts.protocol")
    assert [m for m in loaded if m.startswith("sgl_tts")] == ["sgl_tts", "sgl_tts.frontend", "sgl_tts.lazy",
                                                              "sgl_tts.protocol"]
    assert not [m for m in loaded if m.split(".")[0] in ("sglang", "torch", "numpy", "transformers")]


def test_the_record_store_and_the_server_api_import_nothing_of_sgl_tts_nor_sglang():
    """``sgl_tts.records`` (run, bench and load resume from it) and ``sgl_tts.launch.server_api`` (the
    flush and the server-info reader) sit under everything that uses them: the standard library only."""
    loaded = _loaded_after("import sgl_tts.records, sgl_tts.launch.server_api")
    assert [m for m in loaded if m.startswith("sgl_tts")] == ["sgl_tts", "sgl_tts.frontend", "sgl_tts.launch",
                                                              "sgl_tts.launch.server_api", "sgl_tts.lazy",
                                                              "sgl_tts.records"]
    assert not [m for m in loaded if m.split(".")[0] in ("sglang", "torch", "numpy", "transformers")]


def test_the_package_names_load_on_first_use():
    from sgl_tts.backends import LocalBackend, connect, gen

    assert (sgl_tts.connect, sgl_tts.gen, sgl_tts.LocalBackend) == (connect, gen, LocalBackend)
    assert set(sgl_tts.__all__) <= set(dir(sgl_tts))
    assert all(getattr(sgl_tts, name) is not None for name in sgl_tts.__all__)
    with pytest.raises(AttributeError, match="module 'sgl_tts' has no attribute 'Backend'"):
        sgl_tts.Backend  # noqa: B018
    import sgl_tts.backends as backends

    assert set(backends._LAZY) <= set(dir(backends)) and backends.Completion.__module__ == "sgl_tts.backends.semantics"
    with pytest.raises(AttributeError, match="module 'sgl_tts.backends' has no attribute 'Engine'"):
        backends.Engine  # noqa: B018


def test_launching_loads_none_of_the_client_nor_the_applications():
    loaded = _loaded_after("import sgl_tts.launch.serve, sgl_tts.launch.cpu_serving, sgl_tts.launch.memory, "
                           "sgl_tts.launch.live_servers, sgl_tts.launch.decode_curve, "
                           "sgl_tts.launch.verifier_slowdown")
    assert {"sgl_tts.launch.live_servers", "sgl_tts.launch.verifier_slowdown", "sgl_tts.server_costs"} <= set(loaded)
    above = [m for m in loaded if any(m == c or m.startswith(c + ".") for c in
                                      (*CLIENT_SIDE, "sgl_tts.serving", "sgl_tts.bench", "sgl_tts.quality"))]
    assert above == []


def test_the_rid_scheme():
    # the scheme, written out: tts/<group>/<depth>/<place>/..., a tag after #tag=
    assert GROUP_PREFIX == "tts/"
    assert group_prefix("g1") == "tts/g1/"
    assert rid_prefix("g1", 3) == "tts/g1/3/"
    assert rid_prefix("g1", 3, "spec2") == "tts/g1/3/spec2/"
    assert rid_prefix("g1", 0, 7, "a") == "tts/g1/0/7/a/"
    assert all(is_group_prefix(p) for p in (group_prefix("g"), rid_prefix("g", 1), rid_prefix("g", 1, 2)))
    tag = SearchTag("g1", depth=2, parent=1, beam=5)
    assert tag.rid() == "tts/g1/2/5" and tag.rid("r3") == "tts/g1/2/5/r3"
    rid = tag.request_id()
    assert rid.startswith(rid_prefix("g1", 2, 5)) and not is_group_prefix(rid) and is_tagged_rid(rid)
    assert SearchTag.from_rid(rid) == tag
    assert not is_tagged_rid("abc") and not is_tagged_rid(None) and not is_tagged_rid(7)
    assert (rid_depth(rid), rid_depth(rid_prefix("g1", 12, "spec0")), rid_depth(group_prefix("g1"))) == (2, 12, None)
    assert rid_depth("tts/g1/x/0") is None and rid_depth("other/g1/3/") is None and rid_depth(None) is None
    for bad in ("", "a/b", None):
        with pytest.raises(ValueError, match="a search group must be a non-empty id without '/', got"):
            check_group(bad)
        with pytest.raises(ValueError, match="a search group must be a non-empty id without '/'"):
            rid_prefix(bad, 0)
    with pytest.raises(ValueError, match="a search group must be a non-empty id without '/', got 'x/y'"):
        SearchTag("x/y")


def test_a_rids_group_is_read_by_the_protocol_wherever_it_is_read():
    rid = SearchTag("g1", depth=2, parent=1, beam=5).request_id()
    assert [rid_group(r) for r in (rid, group_prefix("g1"), rid_prefix("g1", 3, "spec0"))] == ["g1"] * 3
    assert [rid_group(r) for r in ("tts/", "tts//3/", "tts/g1", "other/g1/3/", "abc", "", None, 7)] == [None] * 8
    assert SearchTag.from_rid("tts/g1#tag=0,-1,0,normal") is None   # no group: no tag
    # the client's abort ledger: an abort covers the requests of its own group made before it, none other
    from sgl_tts.backends.request import AbortLedger, RequestFields, _clock

    ledger = AbortLedger()
    made = next(_clock)   # when the requests were made: before the aborts, on the ledger's clock
    before = [RequestFields(rid=SearchTag(g).request_id(), issued=made) for g in ("g1", "g2")]
    ledger.record(group_prefix("g1"))
    ledger.record("tts/")   # names no group: nothing recorded
    assert [ledger.covers(f) for f in before] == [True, False]
    assert not ledger.covers(RequestFields(rid=None, issued=made))
    # the scale-out benchmark's prompt tokens by group, from the plugin's prefill records
    from sgl_tts.bench.scaleout import prefill_by_group

    records = [{"event": "prefill", "requests": [{"rid": SearchTag("a").request_id(), "cached": 3, "computed": 5},
                                                 {"rid": rid_prefix("a", 1, 0) + "x", "cached": 1, "computed": 1},
                                                 {"rid": "untagged", "cached": 9, "computed": 9}]},
               {"event": "decode", "requests": [{"rid": SearchTag("b").request_id(), "cached": 9, "computed": 9}]}]
    assert prefill_by_group(records) == {"a": (4, 6)}


# ------------------------------------------------------------------ one builder of the command line

def _parse_plugin_flags(argv):
    """The plugin's own flag group, as a server parses it, back into its settings."""
    import argparse

    from sgl_tts.plugin.settings import TTSSettings, add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    a = ap.parse_args(argv)
    return TTSSettings(a.tts_policy, a.tts_dedup_tokens, a.tts_metrics_file, a.tts_seeded_sampling, a.tts_max_wait,
                       a.tts_cpu_attention)


@pytest.mark.parametrize("settings", [
    dict(),
    dict(policy="prefix-aware"),
    dict(policy="prefix-aware", dedup_tokens=7, metrics_file="/tmp/m.jsonl", seeded_sampling=True, max_wait=None),
    dict(policy="off", metrics_file="/tmp/m", max_wait=2.5),
    dict(cpu_attention="ragged"),
])
def test_the_plugin_settings_render_their_own_flags(settings, monkeypatch):
    from sgl_tts.plugin.settings import TTSSettings

    for var in ("SGLANG_TTS_POLICY", "SGLANG_TTS_DEDUP_TOKENS", "SGLANG_TTS_METRICS_FILE", "SGLANG_TTS_SEEDED_SAMPLING",
                "SGLANG_TTS_MAX_WAIT", "SGLANG_TTS_CPU_ATTENTION"):   # the parser's defaults come from these
        monkeypatch.delenv(var, raising=False)
    s = TTSSettings(**settings)
    assert _parse_plugin_flags(s.args()) == s
    assert TTSSettings().args() == []   # all off: no --tts-* flag, so a stock server accepts the line too
    assert TTSSettings("prefix-aware", metrics_file="m", seeded_sampling=True).args() == [
        "--tts-policy", "prefix-aware", "--tts-seeded-sampling", "--tts-metrics-file", "m"]


def test_every_server_command_comes_from_one_builder(tmp_path):
    from sgl_tts.launch.live_servers import NO_PLUGIN, LiveServer, LiveServers, ephemeral_port_floor
    from sgl_tts.models import shipped_model
    from sgl_tts.plugin.settings import TTSSettings
    from sgl_tts.launch.serve import launch_command
    from sgl_tts.smoke import server_command

    gen = str(shipped_model("generator"))
    cmd = launch_command(gen, host="h", port=7, flags=["--a", "1"], plugin=TTSSettings("prefix-aware"),
                         extra=["--b"], python="py")
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", gen, "--host", "h", "--port", "7", "--a", "1",
                   "--tts-policy", "prefix-aware", "--b"]
    smoke = server_command(gen, 9, "m", 0.2, "--x y", python="py", max_batch=4)
    assert smoke == launch_command(gen, host="127.0.0.1", port=9, python="py",
                                   flags=["--mem-fraction-static", "0.2", "--cuda-graph-max-bs-decode", "4"],
                                   plugin=TTSSettings("prefix-aware", metrics_file="m"), extra=["--x", "y"])
    servers = LiveServers({"a": LiveServer(gen, policy="prefix-aware", metrics=True, seeded_sampling=True, extra=("--z",)),
                           "b": LiveServer(gen, policy=NO_PLUGIN)}, tmp_path)
    a, b = servers.command("a"), servers.command("b")
    assert a.command[:3] == [servers.python, "-m", "sglang.launch_server"]
    assert a.command[-6:] == ["--tts-policy", "prefix-aware", "--tts-seeded-sampling", "--tts-metrics-file",
                              str(servers.metrics_prefix("a")), "--z"]
    assert not any(x.startswith("--tts-") for x in b.command) and b.env["SGLANG_PLUGINS"] == "none"
    # each server its own torch.distributed port below the ephemeral range (two may start at once), and
    # no 5 s of crash diagnostics when the fleet stops it
    ports = [c.command[c.command.index("--nccl-port") + 1] for c in (a, b)]
    assert ports[0] != ports[1] and all(int(p) < ephemeral_port_floor() for p in ports)
    assert a.env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == b.env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    with pytest.raises(ValueError, match="seeded sampling comes from the sgl-tts plugin: give a policy"):
        LiveServer(gen, policy=NO_PLUGIN, seeded_sampling=True)
    ragged = LiveServers({"c": LiveServer(gen, policy="off", cpu_attention="ragged")}, tmp_path).command("c")
    assert ragged.command[-2:] == ["--tts-cpu-attention", "ragged"] and "SGLANG_PLUGINS" not in ragged.env
    with pytest.raises(ValueError, match=r"the ragged CPU attention comes from the sgl-tts plugin: give a policy \('off' will do\)"):
        LiveServer(gen, policy=NO_PLUGIN, cpu_attention="ragged")


def test_an_engine_process_loads_no_sglang():
    """The CPU engine's child process (sgl_tts.backends.engine_process) needs torch and transformers,
    not SGLang's frontend, which takes seconds to import in every child."""
    loaded = _loaded_after("import sgl_tts.backends.engine_process")
    assert "sgl_tts.backends.engine" in loaded and "torch" in loaded
    assert not [m for m in loaded if m.split(".")[0] == "sglang" or m in ("sgl_tts.backends.local",
                                                                            "sgl_tts.backends.endpoint")]


# ------------------------------------------------------------------------------- the command line
COMMAND_MODULES = ("demo", "info", "scheduler_stats", "train_tiny", "run", "plan", "serve", "bench", "load",
                   "serve_search", "scale_out", "bench_frontend", "wheelhouse", "smoke", "quality", "workload")


def test_the_cli_package_loads_no_torch_sglang_nor_command():
    loaded = _loaded_after("import sgl_tts.cli\nsgl_tts.cli.build_parser()")
    assert "sgl_tts.cli" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "sglang", "transformers")]
    # each command's module is imported when that command runs, not before
    assert [m for m in loaded if m.startswith("sgl_tts.cli.")] == []


def test_the_parser_lists_exactly_the_table_and_each_command_has_its_module():
    import argparse
    import importlib

    import sgl_tts.cli as cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(cli.COMMANDS)
    assert [c.help for c in sub._choices_actions] == [c.help for c in cli.COMMANDS.values()]
    assert sorted(c.module for c in cli.COMMANDS.values()) == sorted(f"sgl_tts.cli.{m}" for m in COMMAND_MODULES)
    for name, command in cli.COMMANDS.items():
        module = importlib.import_module(command.module)
        parser = module.build_parser()
        assert isinstance(parser, argparse.ArgumentParser) and parser.prog == f"sgl-tts {name}"
        assert callable(module.main)


def test_no_library_module_parses_arguments():
    """The split's point: argparse and a ``main`` live in sgl_tts/cli/ only. The exceptions: the plugin
    adds its flags to SGLang's own server parser (``python -m sglang.launch_server``: SGLang's command
    line, not ours); the group-abort benchmark's command line is a script
    (``benchmarks/group_abort.py``), its measurements the library's; the CPU engine's child process starts at ``engine_process.main`` and the zygote
    that forks them at ``engine_zygote.main`` (no flags: a socket's file descriptor, and they must load
    no more than the engine)."""
    root = Path(sgl_tts.__file__).parent
    allowed = {"plugin/settings.py": {"argparse"}, "backends/engine_process.py": {"main"}, "backends/engine_zygote.py": {"main"}}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("cli/"):
            continue
        tree = ast.parse(path.read_text())
        imports = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        imports |= {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
        if "argparse" in imports and "argparse" not in allowed.get(rel, ()):
            offenders.append(f"{rel} imports argparse")
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body) \
                and "main" not in allowed.get(rel, ()):
            offenders.append(f"{rel} defines main")
    assert offenders == []


def test_the_library_reaches_the_programs_only_through_the_registry():
    """``programs/`` sits above ``sgl_tts``: the library names a program by the registry's
    ``"module:attribute"`` string and never imports ``programs`` itself (no package-level cycle)."""
    from sgl_tts import registry

    root = Path(sgl_tts.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(root)}:{node.lineno} imports {n}" for n in names
                          if n == "programs" or n.startswith("programs.")]
    assert offenders == []
    assert {registry.program(n).function.split(":")[0] for n in registry.names()} == {
        "programs.beam_search", "programs.dvts", "programs.best_of_n", "programs.mcts", "programs.particle_filtering",
        "programs.deepconf"}


# ------------------------------------------------------------------------------- the import graph
ROOT = Path(sgl_tts.__file__).parent

#: the circles left in sgl_tts's import graph, each with the reason it may stay (a strongly connected
#: component: the modules that reach one another through their imports)
ALLOWED_CYCLES = {
    frozenset({"sgl_tts.backends.engine_process", "sgl_tts.backends.engine_zygote"}):
        "fork child: the zygote (started by engine_process) imports engine_process once, before it forks "
        "the engines, so that every forked child has it loaded",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements in ``body`` and under it (functions, classes, ``if``/``try``/``with``
    blocks), except those under ``if TYPE_CHECKING:``, which never run."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from _imports(node.orelse)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child])
                elif isinstance(getattr(child, "body", None), list):   # an except clause, a match case
                    yield from _imports(child.body)


def import_graph() -> dict[str, set[str]]:
    """Each module of sgl_tts -> the sgl_tts modules it imports, read from its source (ast). An
    import inside a function counts as well as one at the top: both load the module when they run.
    ``from package import name`` is an arrow to the submodule when ``name`` is one, else to the
    package. Names a package loads on first use (``sgl_tts.lazy``) and the registry's
    ``"module:attribute"`` strings are not imports."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        arrows = set()
        for target in targets:
            while target and target not in modules:   # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                arrows.add(target)
        graph[name] = arrows
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, arrows = work[-1]
            nxt = next((t for t in arrows if t not in index or t in stack), None)
            if nxt is not None:
                if nxt in index:
                    low[node] = min(low[node], index[nxt])
                else:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_nothing_outside_the_cli_imports_the_cli():
    """The command line is the application on top: the library never reaches up into it (a ``__main__``
    stub that ran a command's ``main`` did, in ``quality.py`` and ``tiny/training.py``)."""
    def in_cli(module: str) -> bool:
        return module == "sgl_tts.cli" or module.startswith("sgl_tts.cli.")

    graph = import_graph()
    up = [f"{m} imports {t}" for m, targets in sorted(graph.items()) if not in_cli(m) for t in sorted(targets)
          if in_cli(t)]
    assert up == []
    assert "sgl_tts.launch.serve" in graph["sgl_tts.cli.serve"]   # the graph does see the imports in functions


def test_the_import_graph_has_no_circles_but_the_allowed_ones():
    found = cycles(import_graph())
    assert {tuple(sorted(c)) for c in found - set(ALLOWED_CYCLES)} == set(), "new circles in sgl_tts's imports"
    assert {tuple(sorted(c)) for c in set(ALLOWED_CYCLES) - found} == set(), "allowed circles that are gone: drop them"


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}, "f": {"a"}}
    assert cycles(graph) == {frozenset("abc"), frozenset({"e", "e2"})}
    assert cycles({"a": {"b"}, "b": set()}) == set()
