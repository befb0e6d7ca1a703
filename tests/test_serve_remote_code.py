"""Code sent over the network runs in no server sgl-tts starts unless the user asks (issue 62): SGLang's
custom logit processors (``--enable-custom-logit-processor``: a request's processor is dill-serialized
code the server loads) are off in ``sgl-tts serve`` (GPU, ``--device cpu``, ``--replicas``) unless
``--enable-deepconf-stop`` or ``--server-args`` asks for them, ``serve`` says so when it starts, and on a
non-loopback ``--host`` they are refused before anything starts unless ``--allow-remote-code-execution``
names the risk; :func:`sgl_tts.launch.serve.launch_command`, which builds every SGLang command line
sgl-tts runs, refuses them there too."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from sgl_tts.launch.live_servers import LiveServer, LiveServers, free_port
from sgl_tts.models import shipped_model

FLAG = "--enable-custom-logit-processor"
CONFIGS = Path(__file__).parent / "data" / "configs"
GPU = ["serve", "--generator", str(CONFIGS / "qwen2.5-1.5b.json"), "--prm", str(CONFIGS / "qwen2.5-7b.json"),
       "--gpu", "H100"]
CPU = ["serve", "--device", "cpu", "--generator-share", "0.5"]


def refusal(asked_by: str, host: str) -> str:
    return (f"sgl-tts serve: error: {asked_by} turns on SGLang's custom logit processors (a request's processor is "
            f"code the server runs), and --host {host} is not a loopback address: anyone who reaches the server "
            f"could run code on this machine. Serve on 127.0.0.1 (the default), or pass "
            f"--allow-remote-code-execution to accept that risk\n")


def dry_run(capsys, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``sgl-tts serve --dry-run``: the comment lines, and each server's command by name."""
    from sgl_tts.cli import main

    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    notes = [x for x in out if x.startswith("#")]
    names = [x.split(":")[0].lstrip("# ") for x in notes if ": healthy at " in x]
    return notes, dict(zip(names, [x for x in out if not x.startswith("#")], strict=True))


@pytest.mark.parametrize("base", [GPU, CPU], ids=["cuda", "cpu"])
def test_no_server_gets_custom_logit_processors_unless_asked_and_then_the_generator_only(capsys, base):
    notes, cmds = dry_run(capsys, base)
    assert set(cmds) == {"generator", "prm"} and not any(FLAG in c for c in cmds.values())
    assert not any("custom logit processors" in x for x in notes)
    notes, cmds = dry_run(capsys, [*base, "--enable-deepconf-stop"])
    assert FLAG in cmds["generator"].split() and FLAG not in cmds["prm"]
    assert notes[0] == ("# sgl-tts serve: custom logit processors are ON for generator (http://127.0.0.1:30000), "
                        "asked for by --enable-deepconf-stop (online DeepConf's stop inside generation): a request "
                        "may carry code that the server runs, so only trusted clients may reach it")


def test_replicas_get_them_only_when_asked_and_the_notice_names_each():
    from sgl_tts.cli.serve import build_parser, pair_flags, serve_specs
    from sgl_tts.launch.serve import remote_code_notice

    def specs(*argv):
        args = build_parser().parse_args([*CPU[1:], "--replicas", "2", *argv])
        return {s.name: s.command for s in serve_specs(args, *pair_flags(args))}

    plain = specs()
    assert sorted(plain) == ["generator-0", "generator-1", "prm", "router"]
    assert not any(FLAG in c for c in plain.values())
    asked = specs("--enable-deepconf-stop", "--generator-port", "31000")
    assert [n for n, c in asked.items() if FLAG in c] == ["generator-0", "generator-1"]
    args = build_parser().parse_args([*CPU[1:], "--replicas", "2", "--enable-deepconf-stop"])
    assert remote_code_notice(serve_specs(args, *pair_flags(args)), "why") == (
        "sgl-tts serve: custom logit processors are ON for generator-0 (http://127.0.0.1:30100), generator-1 "
        "(http://127.0.0.1:30101), why: a request may carry code that the server runs, so only trusted clients "
        "may reach it")


@pytest.mark.parametrize("argv, asked_by", [
    (["--enable-deepconf-stop"], "--enable-deepconf-stop"),
    (["--server-args", "--enable-custom-logit-processor --log-level info"], "--server-args"),
    (["--replicas", "2", "--enable-deepconf-stop"], "--enable-deepconf-stop"),
])
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "gpu-box.example"])
def test_a_non_loopback_host_with_them_is_refused_before_anything_starts(capsys, argv, asked_by, host):
    from sgl_tts.cli import main

    # --device cpu without --generator-share: the planner would start servers to measure profiles
    for base in (GPU, ["serve", "--device", "cpu"]):
        assert main([*base, "--host", host, *argv, "--dry-run"]) == 1
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", refusal(asked_by, host))


def test_the_risk_named_allows_them_on_any_host_and_a_remote_host_alone_gets_none(capsys):
    notes, cmds = dry_run(capsys, [*GPU, "--host", "0.0.0.0", "--enable-deepconf-stop", "--allow-remote-code-execution"])
    assert FLAG in cmds["generator"] and FLAG not in cmds["prm"]
    assert notes[0].startswith("# sgl-tts serve: custom logit processors are ON for generator (http://0.0.0.0:30000), ")
    notes, cmds = dry_run(capsys, [*GPU, "--host", "0.0.0.0"])
    assert not any(FLAG in c for c in cmds.values()) and not any("custom logit" in x for x in notes)
    # the flag alone turns nothing on
    notes, cmds = dry_run(capsys, [*GPU, "--host", "0.0.0.0", "--allow-remote-code-execution"])
    assert not any(FLAG in c for c in cmds.values())
    for host in ("localhost", "127.0.0.2", "::1"):
        _, cmds = dry_run(capsys, [*GPU, "--host", host, "--enable-deepconf-stop"])
        assert FLAG in cmds["generator"]


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("128.0.0.1", False),
    ("::ffff:10.0.0.5", False), ("example.com", False), ("localhost.example.com", False),
])
def test_which_hosts_are_loopback(host, loopback):
    from sgl_tts.launch.serve import is_loopback

    assert is_loopback(host) is loopback


def test_every_sglang_command_line_refuses_them_on_a_remote_host(tmp_path):
    """The one builder of SGLang's command line (serve, the live-server fleet, smoke, the benchmarks):
    a caller that passes the flag itself, e.g. through the bench's --server-args, is refused too."""
    from sgl_tts.launch.serve import launch_command

    with pytest.raises(ValueError, match=r"^--enable-custom-logit-processor turns on SGLang's custom logit "
                                         r"processors .* --host 0\.0\.0\.0 is not a loopback address"):
        launch_command("m", host="0.0.0.0", port=1, extra=(FLAG,))
    with pytest.raises(ValueError, match="--host 10.1.2.3 is not a loopback address"):
        launch_command("m", host="10.1.2.3", port=1, flags=["--a", FLAG])
    assert launch_command("m", host="0.0.0.0", port=1, extra=(FLAG,), allow_remote_code=True,
                          python="py")[-1] == FLAG
    assert launch_command("m", host="127.0.0.1", port=1, extra=(FLAG,), python="py")[-1] == FLAG
    assert launch_command("m", host="0.0.0.0", port=1, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "m", "--host", "0.0.0.0", "--port", "1"]
    # the test bed's servers (tests/conftest.py's ``generator`` has them, on the loopback)
    gen = LiveServer(str(shipped_model("generator")), policy="prefix-aware", extra=(FLAG,))
    assert LiveServers({"g": gen}, tmp_path).command("g").command[-1] == FLAG
    with pytest.raises(ValueError, match="is not a loopback address"):
        LiveServers({"g": gen}, tmp_path, host="0.0.0.0").command("g")


class _Answers(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_serve_says_they_are_on_and_why_before_it_starts_a_server(capsys):
    """The notice comes before the servers start: here the generator's port already answers, so
    ``serve`` stops before starting any (the notice is still the first line it says)."""
    from sgl_tts.cli import main

    taken = http.server.HTTPServer(("127.0.0.1", free_port()), _Answers)
    threading.Thread(target=taken.serve_forever, daemon=True).start()
    port = taken.server_address[1]
    try:
        for asked, on in ((["--enable-deepconf-stop"], "generator (http://127.0.0.1:{gen}), asked for by "
                           "--enable-deepconf-stop (online DeepConf's stop inside generation)"),
                          # --server-args go to both servers
                          ([f"--server-args={FLAG}"], "generator (http://127.0.0.1:{gen}), prm "
                           "(http://127.0.0.1:{prm}), asked for in --server-args"),
                          ([], None)):
            prm = free_port()
            assert main([*CPU, "--generator-port", str(port), "--prm-port", str(prm), *asked]) == 1
            out = capsys.readouterr()
            assert out.out == ("" if on is None else
                               f"sgl-tts serve: custom logit processors are ON for {on.format(gen=port, prm=prm)}: "
                               f"a request may carry code that the server runs, so only trusted clients may "
                               f"reach it\n")
            assert f"something already answers at http://127.0.0.1:{port}/health" in out.err
    finally:
        taken.shutdown()
        taken.server_close()
