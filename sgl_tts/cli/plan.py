"""``sgl-tts plan``: the KV split and both servers' SGLang flags for a generator + PRM pair
(:func:`sgl_tts.launch.memory.plan_from_args`); :func:`add_plan_arguments` holds the planning flags
``sgl-tts serve`` and ``sgl-tts bench`` share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

DESCRIPTION = "``sgl-tts plan``: the KV split and both servers' SGLang flags for a generator + PRM pair."


def add_plan_arguments(ap: argparse.ArgumentParser, *, models_required: bool = True) -> None:
    """The planning flags ``sgl-tts plan`` and ``sgl-tts serve`` share (``serve --device cpu`` has
    default models, so it asks for them itself)."""
    from sgl_tts.launch.memory import HARDWARE

    ap.add_argument("--generator", required=models_required, help="generator model folder or config.json")
    ap.add_argument("--prm", required=models_required, help="PRM model folder or config.json")
    ap.add_argument("--gpu", default="H100", choices=sorted(HARDWARE), help="GPU profile")
    ap.add_argument("--gpu-memory", default=None,
                    help="memory both servers may use, e.g. 24GiB or 0.4*24GiB (default: the GPU's)")
    ap.add_argument("--beams", type=int, default=64, help="requests per search iteration (N)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--step-tokens", type=int, default=256, help="tokens generated per step")
    ap.add_argument("--verify-tokens", type=int, default=800, help="PRM input tokens per request")
    ap.add_argument("--longest-request", type=int, default=None,
                    help="tokens of the longest request a server must hold (SGLang refuses a request "
                         "longer than its KV pool; default: each model's context length)")
    ap.add_argument("--reserve", default=None, help="runtime reserve (default 8%% of the budget, >= 1GiB)")
    ap.add_argument("--first", choices=["generator", "prm"], default="generator",
                    help="which server starts first (its fraction is of the whole budget)")
    ap.add_argument("--measure", action="store_true",
                    help="measure peak bf16 TFLOP/s and GB/s on this machine's GPU instead of the profile's")
    ap.add_argument("--ceilings", nargs=2, type=float, metavar=("TFLOPS", "GBS"),
                    help="use these peak TFLOP/s and GB/s instead of the profile's")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sgl-tts plan", description=DESCRIPTION)
    add_plan_arguments(ap)
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts plan``: the plan as one JSON object or as a table and both servers' flags."""
    from sgl_tts.launch.memory import GiB, plan_from_args

    args = build_parser().parse_args(argv)
    try:
        p = plan_from_args(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts plan: error: {exc}", file=sys.stderr)
        return 1
    hw, budget, reserve, gen, prm, work = p.hw, p.budget, p.reserve, p.gen, p.prm, p.work
    shared, off, flags = p.shared, p.offload, p.flags
    result = {"gpu": dataclasses.asdict(hw), "budget_bytes": budget, "reserve_bytes": reserve,
              "workload": dataclasses.asdict(work),
              "generator": dataclasses.asdict(gen), "prm": dataclasses.asdict(prm),
              "plan": {**dataclasses.asdict(shared), "total_seconds": shared.total_seconds},
              "offload": None if off is None else {**dataclasses.asdict(off), "total_seconds": off.total_seconds},
              "choice": p.choice,
              "flags": {k: v.args() for k, v in flags.items()}}
    if args.json:
        print(json.dumps(result))
        return 0
    g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    print(f"{gen.name} (generator) + {prm.name} (PRM) on {hw.name}, budget {g(budget)} "
          f"(reserve {g(reserve)}); {work.requests} requests, prompt {work.prompt_tokens}, step "
          f"{work.step_tokens}, verify {work.verify_tokens} tokens")
    print("| | generator | PRM |")
    print("| --- | ---: | ---: |")
    print(f"| weights | {g(gen.weight_bytes)} | {g(prm.weight_bytes)} |")
    print(f"| KV per token | {gen.kv_bytes_per_token / 1024:.1f} KiB | {prm.kv_bytes_per_token / 1024:.1f} KiB |")
    print(f"| KV pool | {g(shared.gen_kv_bytes)} ({shared.gen_room} requests) | "
          f"{g(shared.prm_kv_bytes)} ({shared.prm_room} requests) |")
    print(f"| batch | {shared.gen_batch} | {shared.prm_batch} |")
    total = shared.total_seconds
    print(f"| predicted time per iteration | {shared.gen_seconds * 1e3:.1f} ms ({100 * shared.gen_seconds / total:.0f}%) "
          f"| {shared.prm_seconds * 1e3:.1f} ms ({100 * shared.prm_seconds / total:.0f}%) |")
    if off is not None:
        print(f"offload alternative: {off.total_seconds * 1e3:.1f} ms per iteration (transfers "
              f"{off.offload_seconds * 1e3:.1f} ms) vs shared {total * 1e3:.1f} ms -> {result['choice']}")
    for name in (args.first, "prm" if args.first == "generator" else "generator"):
        print(f"{name} flags: {' '.join(flags[name].args())}")
    return 0
