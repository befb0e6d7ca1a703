"""The GPU bring-up chain without a GPU: slimming a wheel, packing parts, and tools/gpu/bringup.sh
receiving, checking and installing them (a real pip install of a real small wheel)."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sgl_tts.wheelhouse import EXCLUDE, pack, present_on_machine, select_wheels, slim_wheel, wanted

BRINGUP = Path(__file__).resolve().parent.parent / "tools" / "gpu" / "bringup.sh"


def make_wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (WHEEL, METADATA, RECORD) holding ``files``."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    members = {**files, f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
               f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()}
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    for k in members:
        w.writerow([k, "", ""])
    w.writerow([f"{info}/RECORD", "", ""])
    with zipfile.ZipFile(path, "w") as z:
        for k, v in members.items():
            z.writestr(k, v)
        z.writestr(f"{info}/RECORD", record.getvalue())
    return path


def test_slimming_drops_the_matching_members_and_their_record_rows(tmp_path):
    whl = make_wheel(tmp_path, "sgl_kernel_like", {
        "sgl_kernel/__init__.py": b"", "sgl_kernel/flash_ops.abi3.so": os.urandom(50_000),
        "sgl_kernel/sm100/common_ops.abi3.so": os.urandom(20_000), "sgl_kernel/sm90/common_ops.abi3.so": b"keep"})
    before, after = slim_wheel(whl, (r"(^|/)flash_ops[^/]*\.so$", r"(^|/)sm100/"))
    assert after < before - 60_000
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        record = z.read("sgl_kernel_like-1.0.dist-info/RECORD").decode()
    assert "sgl_kernel/sm90/common_ops.abi3.so" in names and "sgl_kernel/__init__.py" in names
    assert not {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so"} & names
    assert "flash_ops" not in record and "sm100" not in record and "sm90/common_ops" in record


def test_what_travels_leaves_out_the_machine_s_packages_and_the_exclusions():
    present = present_on_machine()
    assert {"torch", "triton", "numpy", "tqdm"} <= present
    got = wanted({"sglang": "0.5.15", "torch": "2.11.0", "flashinfer-cubin": "0.6.12", "orjson": "3.13.0"}, present)
    assert "torch" not in got and "flashinfer-cubin" not in got and "flashinfer-cubin" in EXCLUDE
    assert got["sglang"] == "0.5.15" and got["orjson"] == "3.13.0"
    assert "transformers" in got   # carried at SGLang's pin: the machine has another version


def test_only_the_wanted_versions_travel_from_the_download_cache(tmp_path):
    for name in ("sglang-0.5.15-cp312-cp312-manylinux_2_34_x86_64.whl", "sglang-0.5.14-cp312-cp312-any.whl",
                 "xgrammar-0.2.1-cp312-cp312-manylinux_2_28_x86_64.whl", "pydantic_core-2.50.4-cp312-cp312-x.whl",
                 "sgl_tts-0.1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    got = select_wheels(tmp_path, {"sglang": "0.5.15", "pydantic-core": "2.50.4"})
    assert [w.name for w in got] == ["pydantic_core-2.50.4-cp312-cp312-x.whl",
                                     "sgl_tts-0.1.0-py3-none-any.whl",
                                     "sglang-0.5.15-cp312-cp312-manylinux_2_34_x86_64.whl"]


def _bringup(*args, env):
    return subprocess.run(["bash", str(BRINGUP), *args], capture_output=True, text=True, env={**os.environ, **env})


def test_parts_travel_reassemble_check_and_install(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    wheels = [make_wheel(src, "smoke_pkg_a", {"smoke_pkg_a/__init__.py": b"VALUE = 41\n",
                                              "smoke_pkg_a/blob.bin": os.urandom(30_000)}),
              make_wheel(src, "smoke_pkg_b", {"smoke_pkg_b/__init__.py": b"VALUE = 1\n"})]
    house = tmp_path / "house"
    manifest = pack(wheels, house, part_bytes=12_000)
    assert manifest["parts"] >= 3 and manifest["wheels"] == sorted(w.name for w in wheels)
    assert all((house / f"part-{k:02d}" / "manifest.json").exists() for k in range(manifest["parts"]))
    assert max((house / f"part-{k:02d}" / f"wheels.tar.{k:02d}").stat().st_size
               for k in range(manifest["parts"])) <= 12_000
    env = {"SGLANG_TTS_WHEELHOUSE_STORE": str(tmp_path / "store"), "SGLANG_TTS_SITE": str(tmp_path / "site"),
           "SGLANG_TTS_BRINGUP_IMPORTS": "smoke_pkg_a smoke_pkg_b", "PYTHON": sys.executable}
    out = _bringup("receive", str(house / "part-00"), env=env)
    assert out.returncode == 0 and f"1 of {manifest['parts']} parts" in out.stdout
    early = _bringup("install", env=env)   # a part is missing: say which, install nothing
    assert early.returncode == 3 and "missing: part-01" in early.stderr
    for k in range(1, manifest["parts"]):
        assert _bringup("receive", str(house / f"part-{k:02d}"), env=env).returncode == 0
    done = _bringup("install", env=env)
    assert done.returncode == 0, done.stderr
    assert "import smoke_pkg_a" in done.stdout and "import smoke_pkg_b" in done.stdout
    check = subprocess.run([sys.executable, "-c", "import smoke_pkg_a; print(smoke_pkg_a.VALUE + 1)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert check.stdout.strip() == "42"


def test_a_damaged_part_is_caught_by_the_hash(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    house = tmp_path / "house"
    manifest = pack([make_wheel(src, "smoke_pkg_c", {"smoke_pkg_c/__init__.py": b"", "x.bin": os.urandom(9000)})],
                    house, part_bytes=4000)
    part = house / "part-01" / "wheels.tar.01"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    env = {"SGLANG_TTS_WHEELHOUSE_STORE": str(tmp_path / "store"), "SGLANG_TTS_SITE": str(tmp_path / "site"),
           "PYTHON": sys.executable}
    for k in range(manifest["parts"]):
        _bringup("receive", str(house / f"part-{k:02d}"), env=env)
    bad = _bringup("install", env=env)
    assert bad.returncode != 0 and "is not the manifest's" in bad.stderr and "a part is damaged" in bad.stderr
    assert not (tmp_path / "site").exists()


def test_smoke_dry_run_starts_the_tiny_generator_with_the_plugin(capsys):
    from sgl_tts.models import shipped_model
    from sgl_tts.cli.smoke import main

    assert main(["--dry-run", "--port", "31234"]) == 0
    cmd = capsys.readouterr().out
    assert f"--model-path {shipped_model('generator')}" in cmd and "--port 31234" in cmd
    assert "--tts-policy prefix-aware --tts-metrics-file" in cmd and "--attention-backend triton" in cmd
    assert "--cuda-graph-max-bs-decode 8 " in cmd   # graphs for the search's batch sizes only
    assert main(["--dry-run", "--beams", "12"]) == 0
    assert "--cuda-graph-max-bs-decode 12 " in capsys.readouterr().out
    assert main(["--beams", "1", "--dry-run"]) == 1
    assert capsys.readouterr().err == "sgl-tts smoke: error: need --problems >= 1 and --beams >= 2\n"


@pytest.mark.gpu
def test_smoke_runs_on_a_gpu(capsys):
    from sgl_tts.cli.smoke import main

    assert main(["--problems", "2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")


def _module_runs(name: str) -> bool:
    """Whether ``python -m name`` would run something: a package with a ``__main__`` or a module with a
    ``__name__ == "__main__"`` block (a module without one imports and exits 0, silently)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{name}.__main__") is not None
    return spec.origin is not None and '__name__ == "__main__"' in Path(spec.origin).read_text()


def test_every_module_the_gpu_scripts_run_with_dash_m_runs_something():
    # 2026-11-27, fourth lease: short-lease.sh ran `python3 -m sgl_tts.smoke`, which has no main
    # block: it imported for 12 s and exited 0, and the smoke test was counted as passed unrun
    import re

    calls = []
    for script in sorted(Path("tools/gpu").glob("*.sh")):
        calls += [(script.name, m) for m in re.findall(r"python3? -m ([\w.]+)", script.read_text())]
    assert ("short-lease.sh", "sgl_tts.cli") in calls and ("bench-call.sh", "sgl_tts.cli") in calls
    assert [c for c in calls if not _module_runs(c[1])] == []
    assert not _module_runs("sgl_tts.smoke")   # the check itself tells a library module from a command


def test_the_leases_smoke_command_parses_as_sgl_tts_smoke():
    import re
    import shlex

    from sgl_tts.cli.smoke import build_parser

    line = next(l for l in Path("tools/gpu/short-lease.sh").read_text().splitlines() if " smoke " in l and "-m " in l)
    args = shlex.split(re.sub(r"\$\(\(.*?\)\)", "90", line.split("sgl_tts.cli smoke", 1)[1]))
    got = build_parser().parse_args(args)
    assert (got.problems, got.health_timeout, got.dry_run) == (2, 90.0, False)


def test_parts_are_sized_to_what_a_device_call_leaves_beside_the_working_tree(tmp_path):
    """A device call carries 64 MiB: the working tree (tracked files and untracked ones git does not
    ignore), one part, and with the last part the JIT cache. The fifth lease found the tree at 31 MiB
    and the old fixed 40 MiB parts refused; the default now follows the tree."""
    from sgl_tts.wheelhouse import fitting_part_mib, working_tree_bytes

    mib = 2**20
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / ".gitignore").write_text(".wheelhouse/\n.gpu-cache/\n")
    (tmp_path / "tracked.bin").write_bytes(b"\0" * (20 * mib))
    git("add", ".")
    (tmp_path / "untracked.bin").write_bytes(b"\0" * (10 * mib))   # travels too: git does not ignore it
    (tmp_path / ".wheelhouse").mkdir()
    (tmp_path / ".wheelhouse" / "old.tar").write_bytes(b"\0" * (30 * mib))   # ignored: does not count
    tree = working_tree_bytes(tmp_path)
    assert tree == 30 * mib + len(".wheelhouse/\n.gpu-cache/\n")
    # 64 - 30.0 (tree) - 6 (room for a JIT cache not built yet) - 1 (margin) = 26.99...: whole MiB, down
    assert fitting_part_mib(tmp_path) == 26.0
    (tmp_path / ".gpu-cache").mkdir()
    (tmp_path / ".gpu-cache" / "jit-cache.tgz").write_bytes(b"\0" * (4 * mib))   # the real one's size counts
    assert fitting_part_mib(tmp_path) == 28.0
    (tmp_path / "more.bin").write_bytes(b"\0" * (25 * mib))
    with pytest.raises(ValueError, match=r"the working tree leaves 3 MiB per device call for a part \(under 8\)"):
        fitting_part_mib(tmp_path)
