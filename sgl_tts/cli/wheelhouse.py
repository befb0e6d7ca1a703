"""``sgl-tts wheelhouse build``: the wheels that carry SGLang to a GPU machine without network
(:func:`sgl_tts.wheelhouse.build`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts import wheelhouse

    ap = argparse.ArgumentParser(prog="sgl-tts wheelhouse", description=wheelhouse.__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="download, slim and pack the wheels (here)")
    b.add_argument("--out", default=".wheelhouse", help="output folder (ignore it in git; default .wheelhouse)")
    b.add_argument("--part-mib", type=float, default=None,
                   help="MiB per part (default: what a 64 MiB device call leaves beside this working tree "
                        "and the JIT cache carried with the last part)")
    b.add_argument("--add", nargs="*", default=[], help="more distributions to carry (at this environment's version)")
    b.add_argument("--list", action="store_true", help="only print what would travel")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.wheelhouse import (JIT_CACHE, ROOT, build, fitting_part_mib, imported_distributions,
                                    present_on_machine, wanted)

    args = build_parser().parse_args(argv)
    if args.list:
        for name, version in wanted(imported_distributions(), present_on_machine(), args.add).items():
            print(f"{name}=={version}")
        return 0
    out = Path(args.out)
    part_mib = args.part_mib
    if part_mib is None:
        try:
            part_mib = fitting_part_mib()
        except ValueError as exc:
            print(f"sgl-tts wheelhouse: error: {exc}", file=sys.stderr)
            return 1
        print(f"parts of {part_mib:.0f} MiB: what a device call leaves beside this working tree")
    manifest = build(out, part_mib, args.add)
    print(f"{len(manifest['wheels'])} wheels, {manifest['bytes'] / 2**20:.1f} MiB in {manifest['parts']} parts "
          f"under {out}/ (sizes in {out}/sizes.txt)")
    print("device calls, back to back (the machine stays warm 30 s after each):")
    for k in range(manifest["parts"]):
        last = k == manifest["parts"] - 1
        cmd = f"bash tools/gpu/bringup.sh receive {out}/part-{k:02d}"
        carry = f"\"{out}/part-{k:02d}\""
        if last:
            cmd += " && bash tools/gpu/short-lease.sh 585 smoke tests"
            carry += f", \"{JIT_CACHE.parent}\"" if (ROOT / JIT_CACHE.parent).exists() else ""
        print(f"  carry=[{carry}]  command: {cmd}")
    return 0
