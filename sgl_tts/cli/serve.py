"""``sgl-tts serve``: the generator and the PRM as two supervised SGLang servers, on one GPU (planned)
or on the CPU.

The command line is planned here: :func:`pair_flags` (the servers' flags from the memory plan, the
CPU's split or the planner's measured CPU profiles) and :func:`serve_specs` (the servers to start,
replicas and router included) read the parsed flags; the launch layer does the rest with its library
functions (:func:`sgl_tts.launch.serve.build_specs`, :func:`~sgl_tts.launch.serve.launch_command`,
:func:`~sgl_tts.launch.serve.run_servers`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Sequence

from sgl_tts.cli.plan import add_plan_arguments

if TYPE_CHECKING:
    from sgl_tts.launch.serve import ServerSpec


def _step_pooled(prm: str) -> bool:
    """Whether ``prm`` is a PRM only the plugin's step-pooled classes serve (it cannot decode)."""
    from sgl_tts.prm.detect import detect_prm

    try:
        return detect_prm(prm).kind == "step_pooled"
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """``sgl-tts serve``'s flags: the memory plan's (GPU) and the CPU, replica and router ones."""
    from sgl_tts.launch import serve
    from sgl_tts.launch.cpu_serving import DEFAULT_KV_MEMORY
    from sgl_tts.plugin.settings import CPU_ATTENTION, POLICIES

    ap = argparse.ArgumentParser(prog="sgl-tts serve", description=serve.__doc__.splitlines()[0])
    add_plan_arguments(ap, models_required=False)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: the planned split on one GPU. cpu: both servers on this machine's CPU "
                         "(SGLANG_USE_CPU_ENGINE=1; default models: the shipped tiny generator and PRM; "
                         "--kv-memory split by the planner on measured CPU profiles or --generator-share; "
                         "--gpu, --gpu-memory and the other GPU flags are ignored)")
    ap.add_argument("--kv-memory", default=DEFAULT_KV_MEMORY,
                    help=f"with --device cpu: RAM the two KV pools may take together "
                         f"(default {DEFAULT_KV_MEMORY}; each server also needs ~3 GB for itself)")
    ap.add_argument("--generator-share", type=float, default=None,
                    help="with --device cpu: the generator's share of --kv-memory (default: the memory "
                         "planner's split for --beams/--prompt-tokens/--step-tokens/--verify-tokens on both "
                         "models' CPU profiles, measured on live servers the first time and cached)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="with --device cpu: compute and KV dtype (default: the checkpoint's; float32 "
                         "computes exactly what sgl_tts.LocalBackend computes)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="the servers' address (default 127.0.0.1: this machine only)")
    ap.add_argument("--enable-deepconf-stop", action="store_true",
                    help="turn on SGLang's custom logit processors on the generator "
                         "(--enable-custom-logit-processor) for online DeepConf's stop inside generation "
                         "(chunk_tokens 0). A request may then carry code the generator runs: on a "
                         "non-loopback --host this needs --allow-remote-code-execution (default: off; "
                         "online DeepConf with chunk_tokens > 0 needs nothing)")
    ap.add_argument("--allow-remote-code-execution", action="store_true",
                    help="allow custom logit processors (--enable-deepconf-stop) on a non-loopback --host: "
                         "anyone who reaches the generator's port can then run code on this machine")
    ap.add_argument("--generator-port", type=int, default=30000)
    ap.add_argument("--prm-port", type=int, default=30001)
    ap.add_argument("--tts-policy", default="prefix-aware", choices=list(POLICIES))
    ap.add_argument("--tts-metrics-file", default=None)
    ap.add_argument("--cpu-attention", default="ragged", choices=list(CPU_ATTENTION),
                    help="with --device cpu: both servers' attention (the plugin's --tts-cpu-attention). "
                         "ragged (default): decode rows batched by length, extends over their new tokens "
                         "only; native: SGLang's torch_native (one call per sequence, every extend over "
                         "its whole context). Equal to float rounding; ragged is several times faster")
    ap.add_argument("--replicas", type=int, default=1,
                    help="generator replicas behind SGLang's router (sglang-router), which listens on "
                         "--generator-port: clients keep one URL. cpu: the generator's KV share is split "
                         "between them; cuda: replica i runs on GPU i with the planned flags (default 1: "
                         "no router)")
    ap.add_argument("--router-policy", default="cache_aware", choices=list(serve.ROUTER_POLICIES),
                    help="how the router picks a replica (cache_aware: the one whose prefix tree matches "
                         "the request best, unless the load is unbalanced)")
    ap.add_argument("--router-args", default="",
                    help="more flags for sglang_router.launch_router, one quoted string (e.g. "
                         "\"--cache-threshold 0.5 --balance-abs-threshold 32\")")
    ap.add_argument("--replica-ports", default=None,
                    help="comma-separated ports of the replicas (default: --generator-port + 100, + 101, ...)")
    ap.add_argument("--server-args", default="",
                    help="more SGLang flags for both servers, one quoted string, after the planned ones "
                         "(e.g. \"--attention-backend triton --sampling-backend pytorch\" where SGLang's "
                         "default kernels are not installed, as on the wheelhouse's GPU machines)")
    ap.add_argument("--health-timeout", type=float, default=600.0)
    ap.add_argument("--dry-run", action="store_true", help="print the two commands and exit")
    return ap


def pair_flags(args: argparse.Namespace) -> tuple[dict, dict[str, str] | None]:
    """The generator's and the PRM's server flags and their environment: on the CPU the shipped tiny
    models by default, --kv-memory split by --generator-share, or when it is not given by the memory
    planner on both models' measured CPU profiles (the generator's share split again between its
    replicas); on CUDA the memory plan's split. ValueError / FileNotFoundError for bad
    input; ValueError first of all for custom logit processors on a non-loopback ``--host`` without
    ``--allow-remote-code-execution`` (:func:`~sgl_tts.launch.serve.check_remote_code`), before the
    planner may start a server to measure a profile."""
    from sgl_tts.launch.cpu_serving import CPU_ENV, cpu_pair_flags, cpu_server_flags
    from sgl_tts.launch.memory import parse_bytes, plan_from_args
    from sgl_tts.launch.serve import DEEPCONF_STOP_FLAGS, check_remote_code, say

    check_remote_code(args.host, [*(DEEPCONF_STOP_FLAGS if args.enable_deepconf_stop else ()), *server_args(args)],
                      allow_remote_code=args.allow_remote_code_execution,
                      asked_by="--enable-deepconf-stop" if args.enable_deepconf_stop else "--server-args")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.device != "cpu":
        if not (args.generator and args.prm):
            raise ValueError("--generator and --prm are required with --device cuda")
        return plan_from_args(args).flags, None
    from sgl_tts.models import shipped_model

    args.generator = args.generator or str(shipped_model("generator") or "")
    args.prm = args.prm or str(shipped_model("prm") or "")
    if not (args.generator and args.prm):
        raise ValueError("this install ships no tiny models: pass --generator and --prm")
    share = args.generator_share
    if share is None and _step_pooled(args.prm):
        raise ValueError(f"{args.prm} is a step-pooled PRM, which the CPU planner cannot profile yet (its "
                         f"profile decodes): give --generator-share (e.g. 0.5)")
    if share is None:   # the planner's split, on both models' measured CPU profiles
        from sgl_tts.launch.cpu_profile import cpu_plan_from_args

        plan = cpu_plan_from_args(args, attention=args.cpu_attention)
        share, flags = plan.generator_share, dict(plan.flags)
        say(f"sgl-tts serve: planned generator share {share:.3f} of {args.kv_memory} "
            f"(rooms: generator {plan.plan.gen_room}, PRM {plan.plan.prm_room} requests)")
    else:
        flags = cpu_pair_flags(args.generator, args.prm, args.kv_memory, share, args.dtype)
    if args.replicas > 1:
        share = parse_bytes(args.kv_memory) * share / args.replicas
        flags["generator"] = cpu_server_flags(args.generator, int(share), dtype=args.dtype)
    return flags, dict(CPU_ENV)


def server_args(args: argparse.Namespace) -> list[str]:
    """``--server-args`` as a list of flags (ValueError naming it for an unclosed quote)."""
    import shlex

    try:
        return shlex.split(args.server_args)
    except ValueError as exc:   # an unclosed quote
        raise ValueError(f"--server-args: {exc}") from None


def serve_specs(args: argparse.Namespace, flags: dict, env: dict[str, str] | None) -> list[ServerSpec]:
    """The servers to start, in start-up order: the pair, or K generator replicas, the PRM and the
    router on the generator's port. Custom logit processors only with ``--enable-deepconf-stop`` (or
    asked for in ``--server-args``), and on a non-loopback ``--host`` only with
    ``--allow-remote-code-execution`` (ValueError otherwise)."""
    import shlex

    from sgl_tts.launch.serve import build_specs, replicate
    from sgl_tts.plugin.settings import TTSSettings

    # on the CPU the pytorch sampler runs: with seeded sampling the programs' seeds take effect
    attention = args.cpu_attention if args.device == "cpu" else "native"
    plugin = TTSSettings(args.tts_policy, metrics_file=args.tts_metrics_file, seeded_sampling=args.device == "cpu",
                         cpu_attention=attention)
    prm_plugin = TTSSettings(cpu_attention=attention) if attention != "native" else None
    more = server_args(args)
    specs = build_specs(args.generator, args.prm, flags, host=args.host,
                        ports={"generator": args.generator_port, "prm": args.prm_port},
                        first=args.first, plugin=plugin, env=env, prm_plugin=prm_plugin,
                        extra={"generator": more, "prm": more}, deepconf_stop=args.enable_deepconf_stop,
                        allow_remote_code=args.allow_remote_code_execution)
    if args.replicas == 1:
        return specs
    ports = ([int(p) for p in args.replica_ports.split(",")] if args.replica_ports
             else [args.generator_port + 100 + i for i in range(args.replicas)])
    return replicate(specs, args.replicas, host=args.host, router_port=args.generator_port,
                     replica_ports=ports, router_policy=args.router_policy,
                     router_args=shlex.split(args.router_args),
                     gpu_ids=list(range(args.replicas)) if args.device == "cuda" else None)


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts serve``."""
    from sgl_tts.launch.serve import (ServerFailed, print_commands, remote_code_notice, run_servers, say,
                                      sigterm_stops_servers, wait_router_workers)

    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        flags, env = pair_flags(args)
        specs = serve_specs(args, flags, env)
    except (FileNotFoundError, ValueError) as exc:
        if args.device == "cuda" and not (args.generator and args.prm):
            ap.error(str(exc))
        print(f"sgl-tts serve: error: {exc}", file=sys.stderr)
        return 1
    notice = remote_code_notice(specs, "asked for by --enable-deepconf-stop (online DeepConf's stop inside "
                                "generation)" if args.enable_deepconf_stop else "asked for in --server-args")
    if args.dry_run:
        if notice:
            print("# " + notice)
        print_commands(specs)
        return 0
    if notice:
        say(notice)

    def ready(servers):
        urls = {s.spec.name: s.spec.health_url.rsplit("/", 1)[0] for s in servers}
        if "router" in urls:
            wait_router_workers(urls["router"], args.replicas)
            reps = ", ".join(u for n, u in urls.items() if n.startswith("generator-"))
            say(f"sgl-tts serve: generator {urls['router']} (SGLang router, {args.router_policy}, "
                f"{args.replicas} replicas: {reps}), PRM {urls['prm']} (Ctrl-C stops all)")
        else:
            say(f"sgl-tts serve: generator {urls['generator']}, PRM {urls['prm']} (Ctrl-C stops both)")

    try:
        with sigterm_stops_servers():
            run_servers(specs, health_timeout=args.health_timeout, on_ready=ready)
    except ServerFailed as exc:
        print(f"sgl-tts serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sgl-tts serve: stopped", file=sys.stderr)
        return 130
    return 0
