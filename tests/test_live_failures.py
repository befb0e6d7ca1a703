"""Live servers that die: ``sgl-tts run`` against live servers, its generator SIGKILLed mid-run, then
restarted and the run resumed (0 problems lost, 0 duplicated); the failure is one clear error naming
the server; no result line is corrupt. A program whose server dies mid-search fails naming it."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time

import pytest

from programs.beam_search import beam_search
from sgl_tts.tiny import task
from sgl_tts.backends import LocalBackend, SGLangEndpoint
from sgl_tts.backends.connection import ServerError, ServerUnavailable
from sgl_tts.cli import run as run_command
from sgl_tts.experiment import run
from sgl_tts.models import shipped_model
from sgl_tts.prm import StepTagPRM

pytestmark = pytest.mark.server

LIMIT = 6


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run_command(generator: str, prm: str, output) -> list[str]:
    return [sys.executable, "-m", "sgl_tts.cli", "run", "--program", "beam_search", "--n", "4",
            "--beam-width", "2", "--limit", str(LIMIT), "--in-flight", "2", "--generator", generator,
            "--prm", prm, "--output", str(output), "--no-progress"]


def test_run_survives_a_generator_crash_and_resumes_exactly(live, tmp_path):
    gen_url, prm_url = live.url("generator_stock"), live.url("prm")
    out = tmp_path / "run.jsonl"
    cmd = _run_command(gen_url, prm_url, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while len(_lines(out)) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run wrote fewer than 3 problems in 10 minutes"
        time.sleep(0.2)
    live.kill("generator_stock")                 # SIGKILL, mid-run: requests in flight are cut
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("sgl-tts run: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert gen_url in errors[0] and "did not answer" in errors[0] and "rerun the same command" in errors[0]
    written = _lines(out)                         # every line parses: nothing torn
    assert 3 <= len(written) < LIMIT

    started = len(live.starts)
    assert live.start("generator_stock") == gen_url   # back on the same port
    assert [name for name, _ in live.starts[started:]] == ["generator_stock"] and live.starts[-1][1] > 0
    # the same command line again, its config and driver in this process (the killed run above is the
    # real process)
    printed = io.StringIO()
    run(run_command.config_from_args(run_command.build_parser().parse_args(cmd[4:])), stream=printed)
    assert f"resuming {out}: {len(written)} of {LIMIT} problems already done" in printed.getvalue()
    final = _lines(out)
    ids = [rec["id"] for rec in final]
    assert sorted(ids) == sorted({rec["id"] for rec in final}) and len(ids) == LIMIT   # 0 lost, 0 twice
    assert final[:len(written)] == written        # the first run's lines are kept as they were


class KillAfterFirstScore:
    """A PRM that kills the generator server once the first depth has been generated and scored:
    the search is then certainly mid-way (a timer could fire before it starts or after it ends)."""

    def __init__(self, inner, kill):
        self.inner, self.kill, self.calls = inner, kill, 0

    def score(self, question, steps_batch):
        self.calls += 1
        if self.calls == 1:
            self.kill()
        return self.inner.score(question, steps_batch)


def test_program_fails_naming_the_server_that_died(live):
    url = live.url("generator_stock")
    prm_backend = LocalBackend(str(shipped_model("prm")))
    try:
        endpoint = SGLangEndpoint(url)
        prm = KillAfterFirstScore(StepTagPRM(prm_backend), lambda: live.kill("generator_stock"))
        p = task.test_split()[40]
        # the fork whose request was cut reports it (not SGLang's KeyError for its missing variable):
        # a refused or dropped connection, or an error status from a server going down, both named
        with pytest.raises((ServerUnavailable, ServerError),
                           match=rf"^the SGLang server at {re.escape(url)} (did not answer|answered HTTP)"):
            beam_search.run(question=p.question, prm=prm, num_beams=16, beam_width=4, backend=endpoint)
        assert prm.calls == 1
    finally:
        prm_backend.shutdown()
        # no restart here: the next test that asks for generator_stock starts it (live.url)
