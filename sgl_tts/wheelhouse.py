"""Carry SGLang to a GPU machine that has torch but no SGLang and no network.

``sgl-tts wheelhouse build`` (here, with pip and a network) finds the distributions an SGLang server
imports when it starts (by importing the server's modules in this environment and mapping them to
their distributions), leaves out what the GPU machine already has (``tools/gpu/present.txt``) and
what the server does not need with the flags in ``tools/gpu/README.md`` (:data:`EXCLUDE`), downloads
the rest as cp312 manylinux wheels at this environment's versions (the lock's), slims
``sglang-kernel`` (its 1.76 GB FA3 ``flash_ops`` library and the Blackwell ``sm100`` build go), builds
the sgl-tts wheel, and packs everything as one tar cut into parts that each fit one device call.
``tools/gpu/bringup.sh`` receives the parts there, checks the tar's hash and installs it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent   # the checkout (a device call carries its working tree)
TOOLS = ROOT / "tools" / "gpu"
# What the server imports at start (SGLang 0.5.15, Qwen2/Llama/Mistral, triton attention, torch sampling),
# and what the benchmark and smoke clients import
SERVER_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.tokenizer_manager",
                  "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen2", "sglang.srt.models.llama",
                  "sglang.srt.models.mistral", "sglang.srt.layers.attention.triton_backend",
                  "sglang.srt.layers.sampler", "sgl_tts.plugin", "sgl_tts.bench.command", "sgl_tts.bench.goodput",
                  "sgl_tts.smoke", "sgl_tts.prm", "programs.beam_search", "programs.dvts", "matplotlib.pyplot")
EXCLUDE = {
    "flashinfer-cubin": "447 MB of prebuilt kernels; triton attention and torch sampling use none",
    "flash-attn-4": "FA4 (Blackwell) kernels; not used with --attention-backend triton",
    "xgrammar": "42.6 MiB; with --grammar-backend none SGLang 0.5.15 imports it only inside try/except "
                "(protocol, function-call detector) or in the xgrammar backend itself",
    "rfc3987-syntax": "jsonschema imports it only inside suppress(ImportError); building its Lark grammar cost "
                      "4.5 s of every SGLang process's start on the H200 (2026-11-26, -X importtime)",
    "sgl-tts": "built from this checkout instead",
}
ALWAYS = ("transformers", "tokenizers")   # the machine has other versions than SGLang pins (its tokenizers 0.23.2 is past transformers 5.12.1's <=0.23.0)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
SLIM = {"sglang-kernel": (r"(^|/)flash_ops[^/]*\.so$", r"(^|/)sm100/")}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def present_on_machine(path: Path = TOOLS / "present.txt") -> set[str]:
    """Distributions the GPU machine's image already has (one name per line, ``#`` comments)."""
    return {normalize(x.split("#")[0].strip()) for x in path.read_text().splitlines() if x.split("#")[0].strip()}


def imported_distributions(modules: Sequence[str] = SERVER_MODULES) -> dict[str, str]:
    """``{distribution: version}`` of everything importing ``modules`` loads, read in a fresh
    interpreter of this environment."""
    probe = ("import importlib, importlib.metadata as md, json, sys, warnings\n"
             "warnings.simplefilter('ignore')\n"
             f"for m in {list(modules)!r}: importlib.import_module(m)\n"
             "pd = md.packages_distributions()\n"
             "tops = {k.split('.')[0] for k in list(sys.modules)}\n"
             "print(json.dumps({d: md.version(d) for t in tops for d in pd.get(t, [])}))\n")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return {normalize(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def wanted(imported: dict[str, str], present: set[str], extra: Iterable[str] = ()) -> dict[str, str]:
    """What must travel: imported and not on the machine, not excluded, plus :data:`ALWAYS` (the
    machine has other versions of those than SGLang pins) and ``extra``."""
    import importlib.metadata as md

    out = {d: v for d, v in imported.items() if d not in present and d not in EXCLUDE}
    for name in (*ALWAYS, *extra):
        out[normalize(name)] = md.version(name)
    return dict(sorted(out.items()))


def slim_wheel(path: Path, drop: Sequence[str]) -> tuple[int, int]:
    """Rewrite a wheel without the members matching ``drop`` (regexes), its RECORD updated.
    Returns (bytes before, bytes after)."""
    before = path.stat().st_size
    pats = [re.compile(p) for p in drop]
    buf = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept = [i for i in src.infolist() if not any(p.search(i.filename) for p in pats)]
        for info in kept:
            if info.filename != record_name:
                dst.writestr(info, src.read(info.filename))
        rows = [r for r in csv.reader(io.StringIO(src.read(record_name).decode()))
                if r and not any(p.search(r[0]) for p in pats)]
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        dst.writestr(record_name, out.getvalue())
    path.write_bytes(buf.getvalue())
    return before, path.stat().st_size


def pack(wheels: Sequence[Path], out: Path, part_bytes: int) -> dict:
    """One tar of ``wheels`` cut into ``out/part-NN/wheels.tar.NN`` pieces of at most ``part_bytes``,
    with ``out/part-NN/manifest.json`` (the parts, the tar's sha256, the wheels) in every part."""
    if part_bytes < 1:
        raise ValueError("part_bytes must be >= 1")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for w in sorted(wheels, key=lambda p: p.name):
            tar.add(w, arcname=w.name)
    data = buf.getvalue()
    chunks = [data[i:i + part_bytes] for i in range(0, len(data), part_bytes)] or [b""]
    manifest = {"parts": len(chunks), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "wheels": sorted(w.name for w in wheels)}
    for k, chunk in enumerate(chunks):
        d = out / f"part-{k:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"wheels.tar.{k:02d}").write_bytes(chunk)
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def select_wheels(folder: Path, dists: dict[str, str]) -> list[Path]:
    """The wheels in ``folder`` of exactly ``dists`` (name and version) and the sgl-tts wheel: the
    download folder is a cache, and what an earlier build wanted must not travel now."""
    out = []
    for w in sorted(folder.glob("*.whl")):
        name, version = w.name.split("-")[:2]
        if normalize(name) == "sgl-tts" or dists.get(normalize(name)) == version:
            out.append(w)
    return out


def download(dists: dict[str, str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    for name, version in dists.items():
        if any(normalize(w.name.split("-")[0]) == name and f"-{version}-" in w.name for w in dest.glob("*.whl")):
            continue
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(dest),
                        f"{name}=={version}"], check=True)


CALL_MIB = 64            # what one device call carries: the working tree, the part, and what else it carries
CALL_MARGIN_MIB = 1.0    # what the device tool counts that git does not list (e.g. a file written meanwhile)
JIT_CACHE = Path(".gpu-cache") / "jit-cache.tgz"   # carried beside the last part (GPU_BRINGUP.md §2b)
JIT_CACHE_MIB = 6.0      # its room when none is here yet (4.5-5.3 MiB in the leases so far)
MIN_PART_MIB = 8.0


def working_tree_bytes(root: Path) -> int:
    """What a device call carries of the checkout at ``root``: its tracked files and the untracked ones
    git does not ignore (``git ls-files --cached --others --exclude-standard``)."""
    names = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def fitting_part_mib(root: Path = ROOT) -> float:
    """The largest part (whole MiB) one device call can carry beside the working tree at ``root`` and
    the JIT cache that travels with the last part (its size if ``root`` has one, else
    :data:`JIT_CACHE_MIB`). The tree grew from 20 MiB to 31 MiB in Nov. 2026 and the fixed 40 MiB parts
    stopped fitting (the device tool refused the first call of the fifth lease)."""
    jit = root / JIT_CACHE
    room = jit.stat().st_size / 2**20 if jit.exists() else JIT_CACHE_MIB
    part = int(CALL_MIB - working_tree_bytes(root) / 2**20 - room - CALL_MARGIN_MIB)
    if part < MIN_PART_MIB:
        raise ValueError(f"the working tree leaves {part} MiB per device call for a part (under "
                         f"{MIN_PART_MIB:.0f}): move large files out of the checkout or give --part-mib")
    return float(part)


def build(out: Path, part_mib: float, extra: Sequence[str] = ()) -> dict:
    """The whole builder: probe, download, slim, build sgl-tts, pack."""
    wheels_dir = out / "wheels"
    dists = wanted(imported_distributions(), present_on_machine(), extra)
    download(dists, wheels_dir)
    for name, drop in SLIM.items():
        for w in wheels_dir.glob(f"{name.replace('-', '_')}-*.whl"):
            before, after = slim_wheel(w, drop)   # in place; a second pass finds nothing to drop
            print(f"slimmed {w.name}: {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB")
    for old in wheels_dir.glob("sgl_tts-*.whl"):
        old.unlink()
    shutil.rmtree(ROOT / "build", ignore_errors=True)   # setuptools would pack stale files from it
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels_dir), str(ROOT)], check=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    wheels = select_wheels(wheels_dir, dists)
    for stale in out.glob("part-*"):
        for f in stale.iterdir():
            f.unlink()
        stale.rmdir()
    manifest = pack(wheels, out, int(part_mib * 2**20))
    (out / "sizes.txt").write_text("".join(f"{w.stat().st_size / 2**20:8.1f} MiB  {w.name}\n"
                                           for w in sorted(wheels, key=lambda p: -p.stat().st_size)))
    return manifest


__all__ = ["EXCLUDE", "JIT_CACHE", "ROOT", "SERVER_MODULES", "build", "fitting_part_mib", "imported_distributions", "pack",
           "present_on_machine", "working_tree_bytes",
           "select_wheels", "slim_wheel", "wanted"]
