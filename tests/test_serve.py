"""``sgl-tts serve``'s supervision with real child processes standing in for the two servers: start
order and health, a server that never becomes healthy, one that dies mid-run, one that exits at
start, no orphan (grandchildren included), and the planned commands."""

from __future__ import annotations

import os
import signal
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from sgl_tts.launch.serve import ServerFailed, ServerSpec, _answers, on_cpu, run_servers, start_waves
from sgl_tts.launch.live_servers import ephemeral_port_floor, free_port

STAND_IN = r'''
import http.server, os, subprocess, sys, threading, time
port, mode = int(sys.argv[1]), sys.argv[2]
print("starting", flush=True)
child = subprocess.Popen(["sleep", "1000"])
print(f"grandchild {child.pid}", flush=True)
if mode == "never":
    print("loading weights...", flush=True)
    time.sleep(1000)
if mode == "port-taken":   # as SGLang does: uvicorn cannot bind, the warm-up's retries bury that
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    for k in range(60):
        print(f"  File \"http_server.py\", line {k}, in _execute_server_warmup", flush=True)
    sys.exit(1)
if mode == "slow":   # loads for a second before it answers
    time.sleep(1.0)
if mode == "crash-early":
    print("ValueError: bad flag", flush=True)
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
print("ready", flush=True)
if mode == "die":
    time.sleep(1.5)
    print("CUDA error: out of memory", flush=True)
    os._exit(3)
time.sleep(1000)
'''



@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(STAND_IN)

    def spec(name, mode, *flags):
        port = free_port()
        return ServerSpec(name, [sys.executable, str(script), str(port), mode, *flags],
                          f"http://127.0.0.1:{port}/health")
    return spec


def grandchildren(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"grandchild (\d+)", log)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill 0; it is gone once reaped or marked defunct
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


class Log:
    def __init__(self):
        self.lines = []

    def write(self, text):
        self.lines.append(text)

    def flush(self):
        pass

    def __str__(self):
        return "".join(self.lines)


def test_server_ports_stay_below_the_kernels_ephemeral_range_and_are_never_handed_out_twice():
    """An outgoing connection or SGLang's own port-0 bind (its gloo port) can take an ephemeral port in
    the minute before a server binds the one it was given: a clean-clone CI lost a server so."""
    floor = ephemeral_port_floor()
    ports = [free_port() for _ in range(60)]
    assert len(set(ports)) == 60
    assert all(10000 <= p and p + 10000 < floor for p in ports), (floor, sorted(ports)[-3:])
    low = max(ports) + 1   # a fresh port of three, the first in use, the second's gRPC twin in use
    with socket.socket() as taken, socket.socket() as twin_taken:
        taken.bind(("127.0.0.1", low))
        twin_taken.bind(("127.0.0.1", low + 1 + 10000))
        assert free_port(low=low, high=low + 3) == low + 2
    with pytest.raises(RuntimeError, match=rf"no free port pair on 127.0.0.1 in \[{low + 2}, {low + 3}\)"):
        free_port(low=low + 2, high=low + 3)   # free, but handed out already
    with pytest.raises(ValueError, match=r"no room for ports in \[5, 5\)"):
        free_port(low=5, high=5)


def test_both_start_in_order_healthy_and_stop_without_orphans(stand_in):
    log, stop = Log(), threading.Event()
    seen = {}

    def ready(servers):
        seen["order"] = [s.spec.name for s in servers]
        seen["alive"] = [s.alive() for s in servers]
        seen["procs"] = [s.proc for s in servers]
        stop.set()

    run_servers([stand_in("generator", "ok"), stand_in("prm", "ok")], health_timeout=30, poll=0.1,
                on_ready=ready, stop_event=stop, out=log, grace=5)
    assert seen["order"] == ["generator", "prm"] and seen["alive"] == [True, True]
    assert all(p.poll() is not None for p in seen["procs"])
    text = str(log)
    assert "[generator] ready" in text and "[prm] ready" in text
    assert text.index("[generator] ready") < text.index("[prm] starting")   # the second waits for the first
    assert all(gone(pid) for pid in grandchildren(text))


def test_cpu_servers_start_together_and_gpu_servers_and_routers_one_at_a_time():
    def spec(name, *flags):
        return ServerSpec(name, ["python", "-m", "sglang.launch_server", *flags], "http://x/health")

    cpu = ("--model-path", "m", "--device", "cpu", "--max-total-tokens", "4096")
    gen, prm, rep = spec("generator", *cpu), spec("prm", *cpu), spec("rep1", *cpu)
    router = ServerSpec("router", ["python", "-m", "sglang_router.launch_router", "--worker-urls", "a"], "http://r/health")
    gpu_gen, gpu_prm = spec("generator", "--device", "cuda"), spec("prm", "--mem-fraction-static", "0.3")
    assert start_waves([gen, prm]) == [[gen, prm]]
    assert start_waves([gen, rep, prm, router]) == [[gen, rep, prm], [router]]
    assert start_waves([gpu_gen, gpu_prm]) == [[gpu_gen], [gpu_prm]]
    assert start_waves([gpu_gen, gen, prm]) == [[gpu_gen], [gen, prm]]
    assert start_waves([gen, gpu_gen, prm]) == [[gen], [gpu_gen], [prm]]
    assert not on_cpu(spec("x", "--device")) and not on_cpu(spec("x", "cpu", "--device"))
    assert start_waves([]) == []


def test_cpu_servers_start_at_once_and_all_answer_before_on_ready(stand_in):
    log, stop, seen = Log(), threading.Event(), {}

    def ready(servers):
        seen["order"] = [s.spec.name for s in servers]
        seen["healthy"] = [s.healthy() for s in servers]
        stop.set()

    run_servers([stand_in("generator", "slow", "--device", "cpu"), stand_in("prm", "ok", "--device", "cpu")],
                health_timeout=30, poll=0.1, on_ready=ready, stop_event=stop, out=log, grace=5)
    assert seen == {"order": ["generator", "prm"], "healthy": [True, True]}
    text = str(log)
    assert text.index("[prm] ready") < text.index("[generator] ready")   # the second did not wait
    assert all(gone(pid) for pid in grandchildren(text))


def test_a_cpu_server_that_never_answers_stops_the_one_started_with_it(stand_in):
    log = Log()
    with pytest.raises(ServerFailed, match=r"^the prm server did not answer http://127\.0\.0\.1:\d+/health within 2 s"):
        run_servers([stand_in("generator", "ok", "--device", "cpu"), stand_in("prm", "never", "--device", "cpu")],
                    health_timeout=2, poll=0.1, out=log, grace=2)
    text = str(log)
    assert "[generator] ready" in text and "[prm] loading weights..." in text
    assert len(grandchildren(text)) == 2 and all(gone(pid) for pid in grandchildren(text))


def test_a_sigterm_that_lands_just_after_a_server_started_still_stops_it(stand_in, monkeypatch):
    """The signal comes right after the child was spawned, before run_servers has registered it (the
    wrapper below places it there every time): the server must still be stopped on the way out."""
    from sgl_tts.launch import serve

    spawned = []
    real_init = serve.ManagedServer.__init__

    def init_then_signal(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        spawned.append(self.proc)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(serve.ManagedServer, "__init__", init_then_signal)
    log = Log()
    with pytest.raises(KeyboardInterrupt):
        with serve.sigterm_stops_servers():
            run_servers([stand_in("generator", "ok")], health_timeout=30, poll=0.1, out=log, grace=5)
    assert len(spawned) == 1 and spawned[0].poll() is not None, "the server outlived the command"


def test_a_port_that_already_answers_is_refused_before_anything_starts(stand_in):
    """A server left from a killed run would answer the new one's health checks: the work would go to
    the old server. Nothing is started then."""
    old = stand_in("generator", "ok")
    stop = threading.Event()
    holder = threading.Thread(target=run_servers, args=([old],),
                              kwargs=dict(health_timeout=30, poll=0.1, on_ready=lambda s: None, stop_event=stop,
                                          out=Log(), grace=5))
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while not _answers(old.health_url) and time.monotonic() < deadline:
            time.sleep(0.1)
        again = ServerSpec("generator", ["false"], old.health_url)   # would exit at once if started
        with pytest.raises(ServerFailed, match=f"something already answers at {re.escape(old.health_url)}; "
                                               f"stop it \\(or pick another port\\) before starting the generator"):
            run_servers([again], health_timeout=5, poll=0.1, out=Log())
    finally:
        stop.set()
        holder.join(timeout=30)


def test_a_server_that_never_becomes_healthy_is_named_with_its_last_lines(stand_in):
    log = Log()
    with pytest.raises(ServerFailed, match=r"the generator server did not answer http://127\.0\.0\.1:\d+/health "
                                           r"within 2 s; its last log lines:\n(.|\n)*loading weights\.\.\."):
        run_servers([stand_in("generator", "never"), stand_in("prm", "ok")], health_timeout=2, poll=0.1,
                    out=log, grace=2)
    assert "[prm]" not in str(log)                                        # never started
    assert all(gone(pid) for pid in grandchildren(str(log)))


def test_a_server_dying_mid_run_stops_the_other(stand_in):
    log = Log()
    procs = {}
    with pytest.raises(ServerFailed, match=r"the prm server exited with code 3; its last log lines:\n"
                                           r"(.|\n)*CUDA error: out of memory"):
        run_servers([stand_in("generator", "ok"), stand_in("prm", "die")], health_timeout=30, poll=0.1,
                    on_ready=lambda servers: procs.update({s.spec.name: s.proc for s in servers}),
                    out=log, grace=5)
    assert procs["generator"].poll() is not None                         # the healthy one was stopped
    assert all(gone(pid) for pid in grandchildren(str(log)))


def test_a_server_exiting_at_start(stand_in):
    with pytest.raises(ServerFailed, match=r"exited with code 1 before it was healthy(.|\n)*ValueError: bad flag"):
        run_servers([stand_in("generator", "crash-early")], health_timeout=30, poll=0.1, out=Log(), grace=2)


def test_a_server_that_could_not_bind_its_port_says_so_above_the_warm_up_traceback(stand_in):
    spec = stand_in("generator", "port-taken")
    port = spec.command[-2]
    with pytest.raises(ServerFailed, match=rf"the generator server exited with code 1 before it was healthy; it "
                                           rf"could not bind its port \(ERROR: +\[Errno 98\] error while attempting "
                                           rf"to bind on address \('127.0.0.1', {port}\): address already in use\); "
                                           rf"its last log lines:\n +File .*line 30, in"):
        run_servers([spec], health_timeout=30, poll=0.1, out=Log(), grace=2)


def test_dry_run_prints_the_planned_commands_in_start_up_order(capsys):
    from sgl_tts.cli import main

    configs = Path(__file__).parent / "data" / "configs"
    assert main(["serve", "--generator", str(configs / "qwen2.5-1.5b.json"), "--prm", str(configs / "qwen2.5-7b.json"),
                 "--gpu", "RTX4090", "--gpu-memory", "0.9*24GiB", "--first", "prm", "--dry-run"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    assert len(lines) == 2
    assert "qwen2.5-7b.json" in lines[0] and "--port 30001" in lines[0]            # the PRM first
    assert "qwen2.5-1.5b.json" in lines[1] and "--tts-policy prefix-aware" in lines[1]
    # custom logit processors (code a request sends) only when asked for: tests/test_serve_remote_code.py
    assert not any("--enable-custom-logit-processor" in x for x in lines)
    assert all("-m sglang.launch_server" in x and "--mem-fraction-static" in x for x in lines)
    assert main(["serve", "--generator", str(configs / "llama-3.1-8b.json"),
                 "--prm", str(configs / "llama-3.1-8b.json"), "--gpu", "RTX4090", "--dry-run"]) == 1
    assert "the weights alone do not fit" in capsys.readouterr().err


def test_server_args_go_last_to_both_servers_and_a_bad_quote_is_named(capsys):
    """``--server-args`` reaches both servers after the planned flags (SGLang takes the last of a
    repeated flag), e.g. the kernels a wheelhouse GPU machine has; an unclosed quote is refused."""
    from sgl_tts.cli import main

    configs = Path(__file__).parent / "data" / "configs"
    base = ["serve", "--generator", str(configs / "qwen2.5-1.5b.json"), "--prm", str(configs / "qwen2.5-1.5b.json"),
            "--gpu", "H200", "--gpu-memory", "16GiB", "--dry-run"]
    assert main([*base, "--server-args", "--attention-backend triton --max-running-requests 8"]) == 0
    cmds = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    assert len(cmds) == 2
    for cmd in cmds:
        assert cmd.endswith(" --attention-backend triton --max-running-requests 8")
    assert cmds[0].index("--max-running-requests 64") < cmds[0].index("--max-running-requests 8")  # the planner's, then the user's
    assert main([*base, "--server-args", "--served-model-name 'a b"]) == 1
    assert capsys.readouterr().err == "sgl-tts serve: error: --server-args: No closing quotation\n"


def test_replicas_dry_run_starts_k_generators_then_the_router_on_the_generator_port(capsys):
    from sgl_tts.cli import main

    configs = Path(__file__).parent / "data" / "configs"
    assert main(["serve", "--generator", str(configs / "qwen2.5-1.5b.json"), "--prm", str(configs / "qwen2.5-1.5b.json"),
                 "--gpu", "H100", "--replicas", "3", "--first", "prm", "--tts-metrics-file", "/tmp/m",
                 "--router-args", "--cache-threshold 0.5", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = [x.split(":")[0].lstrip("# ") for x in out if x.startswith("#")]
    assert names == ["prm", "generator-0", "generator-1", "generator-2", "router"]
    cmds = [x for x in out if not x.startswith("#")]
    for i, cmd in enumerate(cmds[1:4]):
        assert f"--port {30100 + i} " in cmd and cmd.endswith(f"--base-gpu-id {i}")
        assert f"--tts-metrics-file /tmp/m.replica{i} " in cmd        # one metrics file per replica
    assert cmds[4].split("-m ")[1] == ("sglang_router.launch_router --worker-urls http://127.0.0.1:30100 "
                                       "http://127.0.0.1:30101 http://127.0.0.1:30102 --policy cache_aware "
                                       "--host 127.0.0.1 --port 30000 --log-level warn --cache-threshold 0.5")
    assert "# router: healthy at http://127.0.0.1:30000/readiness" in out


def test_a_router_binds_the_prometheus_port_it_is_given():
    """Two routers on one host on the default exporter port (29000): the second exits at start-up
    (seen in CI), so LiveServers gives each its own."""
    from sgl_tts.launch.serve import router_spec

    default = router_spec(["http://h:1"], host="h", port=2).command
    assert "--prometheus-port" not in default
    spec = router_spec(["http://h:1"], host="h", port=2, prometheus_port=29123, extra=("--cache-threshold", "0.5"))
    assert spec.command[spec.command.index("--port"):] == ["--port", "2", "--log-level", "warn", "--prometheus-port", "29123",
                                                   "--cache-threshold", "0.5"]


def test_replicas_on_the_cpu_split_the_generators_kv_share(capsys):
    from sgl_tts.cli import main

    def tokens(argv):
        assert main(["serve", "--device", "cpu", "--kv-memory", "1GiB", "--generator-share", "0.5", "--dry-run", *argv]) == 0
        lines = [x for x in capsys.readouterr().out.splitlines() if "launch_server" in x and "generator" in x]
        return [int(x.split("--max-total-tokens ")[1].split()[0]) for x in lines]

    one, two = tokens([]), tokens(["--replicas", "2"])
    assert len(one) == 1 and len(two) == 2 and two[0] == two[1] == one[0] // 2


def test_the_cpu_servers_run_the_ragged_attention_unless_asked_for_native(capsys):
    from sgl_tts.cli import main

    def commands(argv):
        assert main(["serve", "--dry-run", *argv]) == 0
        out = [x for x in capsys.readouterr().out.splitlines() if "launch_server" in x]
        return {("generator" if "/generator " in x else "prm"): x for x in out}

    cpu = commands(["--device", "cpu", "--generator-share", "0.5"])
    assert all(x.endswith("--tts-cpu-attention ragged") for x in cpu.values()), cpu
    native = commands(["--device", "cpu", "--generator-share", "0.5", "--cpu-attention", "native"])
    assert not any("--tts-cpu-attention" in x for x in native.values())
    assert "--tts-" not in native["prm"]   # the PRM has no plugin flag left at all
    with pytest.raises(SystemExit):
        main(["serve", "--device", "cpu", "--cpu-attention", "flash", "--dry-run"])
    assert "--cpu-attention: invalid choice: 'flash'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--replicas", "2", "--replica-ports", "30100"], "need 2 distinct replica ports"),
    (["--replicas", "2", "--replica-ports", "30000,30100"], "apart from the router's 30000"),
])
def test_bad_replica_settings_are_refused(capsys, argv, words):
    from sgl_tts.cli import main

    assert main(["serve", "--device", "cpu", "--generator-share", "0.5", "--dry-run", *argv]) == 1
    assert words in capsys.readouterr().err


class _YieldingOutput:
    """An output whose every write lets other threads run (as a pipe's does when it blocks)."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        time.sleep(0.0002)
        return len(text)

    def flush(self) -> None:
        pass


def test_status_lines_and_streamed_server_logs_never_share_a_line():
    """``sgl-tts serve`` prints its ready line while the servers' logs stream to the same stdout. CI
    (2026-11-26) once read ``[prm] ... "GET /health HTTP/1.1" 200 OKsgl-tts serve: generator ...``:
    print writes a line and its newline in two calls, and another thread's line fell between them.
    Every line is now one write under one lock."""
    from sgl_tts.launch.serve import ManagedServer, say

    out = _YieldingOutput()
    server = ManagedServer(ServerSpec("gen", [sys.executable, "-c", "for i in range(300): print('log', i)"],
                                      "http://127.0.0.1:1/health"), out=out)
    n = 0
    while server._reader.is_alive() or n < 300:
        say(f"status {n}", out)
        n += 1
    server.proc.wait(timeout=60)
    lines = "".join(out.parts).splitlines()
    assert sorted(lines) == sorted([f"[gen] log {i}" for i in range(300)] + [f"status {i}" for i in range(n)])
