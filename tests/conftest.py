"""Shared fixtures: a tiny Qwen2 model built on the fly, a LocalBackend on it, and ``live``: real
SGLang servers on this CPU (``sgl_tts.launch.live_servers``), each started the first time a test asks for
it and kept until the run ends."""

from __future__ import annotations

import collections
import faulthandler
import os
import sys
from pathlib import Path

import pytest
import torch
from _pytest.faulthandler import get_stderr_fileno

from sgl_tts.models import build_tiny_model


pytest_plugins = ["pytester"]   # tests/test_live_order.py runs pytest on made-up suites

SERVER_TEST_TIMEOUT = 900   # s; under pyproject's faulthandler_timeout (1200), the backstop behind it
EXIT_TIMEOUT = 120          # s the process may take to exit once the run has ended
_EXIT_FD = pytest.StashKey[int]()
_LIVE = pytest.StashKey[object]()   # the session's LiveServers, for the run's summary


def _pytest_owns_the_process() -> bool:
    """Whether this process is the pytest command (not ``pytest.main()`` inside a notebook, say)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (spec is not None and spec.name in ("pytest", "pytest.__main__")) or \
        Path(sys.argv[0]).name in ("pytest", "py.test")


def pytest_configure(config):
    if _pytest_owns_the_process():
        config.stash[_EXIT_FD] = os.dup(get_stderr_fileno())   # the real stderr, as pytest's faulthandler takes it


def pytest_unconfigure(config):
    # Threads the run left behind (a request stuck on a server) would keep the interpreter from
    # exiting, with every test passed: print their stacks and exit failed instead of hanging CI.
    if _EXIT_FD in config.stash:
        faulthandler.dump_traceback_later(EXIT_TIMEOUT, exit=True, file=config.stash[_EXIT_FD])


FAILURES_AT_ONCE = "SGLANG_TTS_FAILURES_AT_ONCE"


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """With SGLANG_TTS_FAILURES_AT_ONCE=1 (the GPU lease's tests phase, tools/gpu/short-lease.sh), a
    failure's traceback is printed the moment it fails: pytest prints them only at the end, and a run
    that the lease's cap cuts short would say which tests failed but never why (2026-11-27)."""
    if report.failed and os.environ.get(FAILURES_AT_ONCE):
        sys.stdout.write(f"\n---- {report.nodeid} failed ({report.when}) ----\n{report.longreprtext}\n"
                         f"---- end of {report.nodeid} ----\n")
        sys.stdout.flush()


def pytest_terminal_summary(terminalreporter, config):
    """How often the session's live servers started, and the time spent waiting for them: what the
    order of tests/live_order.py is for (each server should start once)."""
    servers = config.stash.get(_LIVE, None)
    if servers is None or not servers.starts:
        return
    counts = collections.Counter(name for name, _ in servers.starts)
    waited = sum(seconds for _, seconds in servers.starts)
    terminalreporter.write_line(
        f"live servers: {len(servers.starts)} starts, {waited:.0f} s of start-up (starts at once each counted) "
        f"({', '.join(f'{name} {k}' for name, k in counts.items())})")


def pytest_collection_modifyitems(config, items):
    # imported here: a suite that imports this module's hooks as ``tests.conftest`` (tests/test_project.py)
    # has no tests/ on its path
    from live_order import order_by_live_servers

    order_by_live_servers(items)   # tests/live_order.py: session servers start once, not after every stop
    # a live-server test may start servers (~20-60 s each) and run searches on 2 busy cores (the
    # slowest takes about 3.5 minutes on a quiet machine)
    for item in items:
        if "server" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SERVER_TEST_TIMEOUT))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def backend(tiny_model_path):
    from sgl_tts import LocalBackend

    be = LocalBackend(tiny_model_path, seed=0)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def local_prm():
    """The shipped step-tag PRM on an in-process LocalBackend (the live tests' verifier: the same
    scores whichever server generated the steps), one per module."""
    from sgl_tts.backends import LocalBackend
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    prm_backend = LocalBackend(str(shipped_model("prm")))
    yield StepTagPRM(prm_backend)
    prm_backend.shutdown()


@pytest.fixture(scope="session")
def hf_model(backend):
    """The backend's own transformers model, for direct reference forwards."""
    return backend.model


# The live servers every `server` test shares; each starts on first use, so a run that needs only some
# starts only those. float32: the server computes what LocalBackend computes (greedy text and logprobs
# comparable to 1e-3; the checkpoints are bf16).
LIVE_KV_BYTES = 64 << 20     # per server: 16k tokens of the generator in float32, plenty for the tests


@pytest.fixture(scope="session")
def live(request, tmp_path_factory, tiny_model_path):
    """``LiveServers`` with: ``generator`` (plugin, --tts-policy prefix-aware, metrics, seeded
    sampling), ``generator_off`` (plugin loaded, --tts-policy off, metrics, seeded sampling), ``generator_stock`` (no plugin:
    SGLANG_PLUGINS=none), ``generator_4slots`` (plugin, prefix-aware, --max-running-requests 4),
    ``prm`` (the step-tag PRM), ``generator_ragged`` and ``prm_ragged`` (plugin, --tts-policy off,
    --tts-cpu-attention ragged), ``generator_sparse`` (plugin, --tts-sparse-attention async) and ``reward_head`` (``write_reward_head`` of
    ``tiny_model_path``, served at /classify: SGLang cannot serve the shipped PRM's classifier form
    right on the CPU, see sgl_tts.launch.cpu_serving), ``qwen2.5-math-prm`` and ``skywork-prm`` (tiny checkpoints
    of those PRMs' real formats, served by the plugin's step-pooled classes, ``--enable-metrics``) and
    ``math-shepherd`` and ``rlhflow`` (tiny checkpoints of those causal-LM PRMs' formats, stock SGLang,
    ``--enable-metrics``).
    A server that cannot start fails the test with its log."""
    from sgl_tts.launch.live_servers import NO_PLUGIN, LiveServer, LiveServers
    from sgl_tts.launch.serve import DEEPCONF_STOP_FLAGS
    from sgl_tts.models import shipped_model
    from sgl_tts.models.prm_checkpoints import write_tiny_prm
    from sgl_tts.models.reward_head import write_reward_head

    work = tmp_path_factory.mktemp("live")
    gen, prm = str(shipped_model("generator")), str(shipped_model("prm"))
    head = str(write_reward_head(tiny_model_path, work / "reward-head"))
    specs = {
        "generator": LiveServer(gen, policy="prefix-aware", metrics=True, kv_bytes=LIVE_KV_BYTES,
                                seeded_sampling=True, extra=DEEPCONF_STOP_FLAGS),  # online DeepConf's stop (loopback)
        "generator_off": LiveServer(gen, policy="off", metrics=True, kv_bytes=LIVE_KV_BYTES,
                                    seeded_sampling=True),
        "generator_stock": LiveServer(gen, policy=NO_PLUGIN, kv_bytes=LIVE_KV_BYTES),
        # four request slots: the two-phase (speculative) preemption needs a server that can be full
        "generator_4slots": LiveServer(gen, policy="prefix-aware", kv_bytes=LIVE_KV_BYTES,
                                       extra=("--max-running-requests", "4")),
        "prm": LiveServer(prm, kv_bytes=LIVE_KV_BYTES),
        # the plugin's ragged CPU attention (tests/test_live_cpu_attention.py; stopped after it)
        "generator_ragged": LiveServer(gen, policy="off", kv_bytes=LIVE_KV_BYTES, cpu_attention="ragged"),
        "prm_ragged": LiveServer(prm, policy="off", kv_bytes=LIVE_KV_BYTES, cpu_attention="ragged"),
        # sparse decode attention (seed 003; tests/test_live_sparse_attention.py; stopped after it): rows
        # from 24 tokens on attend to half their context, chosen asynchronously
        "generator_sparse": LiveServer(gen, policy="off", metrics=True, kv_bytes=LIVE_KV_BYTES,
                                       extra=("--tts-sparse-attention", "async", "--tts-sparse-budget", "0.5",
                                              "--tts-sparse-dense-below", "24", "--tts-sparse-measure",
                                              "--tts-sparse-stand-down", "off")),
        "reward_head": LiveServer(head, kv_bytes=LIVE_KV_BYTES, extra=("--is-embedding",)),
        # the PRM architectures SGLang does not serve, in their real formats (tiny, random weights),
        # served by the plugin's step-pooled classes (tests/test_live_prm_models.py; stopped after it)
        **{fmt: LiveServer(str(write_tiny_prm(fmt, work / fmt)), policy="off", kv_bytes=LIVE_KV_BYTES,
                           extra=("--enable-metrics",)) for fmt in ("qwen2.5-math-prm", "skywork-prm")},
        # Math-Shepherd's format (a Mistral causal LM, its tokenizer's ки tag) and RLHFlow's (a Llama
        # causal LM in Llama 3's chat format): stock SGLang serves them
        **{fmt: LiveServer(str(write_tiny_prm(fmt, work / fmt)), kv_bytes=LIVE_KV_BYTES, extra=("--enable-metrics",))
           for fmt in ("math-shepherd", "rlhflow")},
    }
    servers = LiveServers(specs, work / "servers")
    request.config.stash[_LIVE] = servers
    yield servers
    servers.stop_all()


@pytest.fixture
def live_stopped(live):
    """The session's live servers stopped (each starts again on its next use), for a test that starts
    servers of its own: a CPU server takes about 2 GB, and six session servers plus a test's own
    outgrew the 24 GiB machine (a CI run was killed for memory)."""
    live.stop(*live.running())
