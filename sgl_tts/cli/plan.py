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
    ap.add_argument("--searches-in-flight", type=int, default=1, metavar="Q",
                    help="searches served at once (a service): both pools are planned for Q x N requests, "
                         "each search's question held once; planned for one search, a busy service's "
                         "generator gets too little (docs/MEMORY_PLANNER.md, under load)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--step-tokens", type=int, default=256, help="tokens generated per step")
    ap.add_argument("--verify-tokens", type=int, default=800, help="PRM input tokens per request")
    ap.add_argument("--shared-tokens", type=int, default=None,
                    help="tokens at the head of every request's context that all share, held once per pool "
                         "by the radix cache (the question; default 0, or the problem's prompt in sgl-tts bench)")
    ap.add_argument("--siblings", type=int, default=None,
                    help="requests that share the rest of their context (a beam's children: the beam width; "
                         "default 1, or the beam width in sgl-tts bench)")
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
    ap.add_argument("--remeasure", action="store_true",
                    help="with --device cpu: measure both models' CPU profiles again on live servers instead "
                         "of reading them from the cache")
    ap.add_argument("--profile-dir", default=None,
                    help="with --device cpu: where measured CPU profiles are cached (default "
                         "~/.cache/sgl-tts/profiles)")


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.launch.cpu_serving import DEFAULT_KV_MEMORY
    from sgl_tts.plugin.settings import CPU_ATTENTION

    ap = argparse.ArgumentParser(prog="sgl-tts plan", description=DESCRIPTION)
    add_plan_arguments(ap, models_required=False)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: the roofline on a GPU profile. cpu: both models' costs measured on live CPU "
                         "SGLang servers (cached; default models: the shipped tiny generator and PRM), "
                         "--kv-memory split (the GPU flags are ignored)")
    ap.add_argument("--kv-memory", default=DEFAULT_KV_MEMORY,
                    help=f"with --device cpu: RAM the two KV pools take together (default {DEFAULT_KV_MEMORY})")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="with --device cpu: compute and KV dtype (default: the checkpoint's)")
    ap.add_argument("--cpu-attention", default="ragged", choices=list(CPU_ATTENTION),
                    help="with --device cpu: the servers' attention, as sgl-tts serve --device cpu runs them "
                         "(default ragged; the profile is measured with it)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar while a profile is measured")
    ap.add_argument("--json", action="store_true")
    return ap


def _cpu_main(args) -> int:
    """``sgl-tts plan --device cpu``: the planned split of --kv-memory on measured profiles."""
    from sgl_tts.launch.cpu_profile import cpu_plan_from_args
    from sgl_tts.models import shipped_model

    args.generator = args.generator or str(shipped_model("generator") or "")
    args.prm = args.prm or str(shipped_model("prm") or "")
    if not (args.generator and args.prm):
        print("sgl-tts plan: error: this install ships no tiny models: pass --generator and --prm", file=sys.stderr)
        return 1
    try:
        p = cpu_plan_from_args(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts plan: error: {exc}", file=sys.stderr)
        return 1
    plan, work = p.plan, p.work
    result = {"device": "cpu", "budget_bytes": p.budget, "workload": dataclasses.asdict(work),
              "generator": dataclasses.asdict(p.gen), "prm": dataclasses.asdict(p.prm),
              "plan": {**dataclasses.asdict(plan), "total_seconds": plan.total_seconds},
              "generator_share": p.generator_share,
              "flags": {k: v.args() for k, v in p.flags.items()}}
    if args.json:
        print(json.dumps(result))
        return 0
    mib = lambda b: f"{b / 2 ** 20:.2f} MiB"  # noqa: E731
    print(f"{p.gen.name} (generator) + {p.prm.name} (PRM) on the CPU, KV budget {mib(p.budget)}; {work.requests} "
          f"requests, prompt {work.prompt_tokens}, step {work.step_tokens}, verify {work.verify_tokens} tokens"
          f"{_sharing(work)} (costs measured on live servers, {args.cpu_attention} attention)")
    print("| | generator | PRM |")
    print("| --- | ---: | ---: |")
    print(f"| KV per token | {p.gen.kv_bytes_per_token} B | {p.prm.kv_bytes_per_token} B |")
    print(f"| planned room | {plan.gen_room} requests | {plan.prm_room} requests |")
    print(f"| batch | {plan.gen_batch} | {plan.prm_batch} |")
    print(f"| KV pool (tokens) | {p.flags['generator'].max_total_tokens} | {p.flags['prm'].max_total_tokens} |")
    print(f"| predicted time per iteration | {plan.gen_seconds * 1e3:.1f} ms | {plan.prm_seconds * 1e3:.1f} ms |")
    print(f"generator share of the KV budget: {p.generator_share:.3f}")
    for name in ("generator", "prm"):
        print(f"{name} flags: {' '.join(p.flags[name].args())}")
    return 0


def _sharing(work) -> str:
    """What the workload's requests share, for the header line ('' when nothing)."""
    head = f"{work.shared_tokens} shared by each search's requests" if work.searches > 1 else f"{work.shared_tokens} shared by all"
    parts = ([f"{work.searches} searches in flight"] if work.searches > 1 else []) + \
        ([head] if work.shared_tokens else []) + \
        ([f"the rest of a context by {work.siblings} siblings"] if work.siblings > 1 else [])
    return f" ({', '.join(parts)})" if parts else ""


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts plan``: the plan as one JSON object or as a table and both servers' flags."""
    from sgl_tts.launch.memory import GiB, plan_from_args

    ap = build_parser()
    args = ap.parse_args(argv)
    if args.device == "cpu":
        return _cpu_main(args)
    if not (args.generator and args.prm):
        ap.error("--generator and --prm are required with --device cuda")
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
          f"{work.step_tokens}, verify {work.verify_tokens} tokens{_sharing(work)}")
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
