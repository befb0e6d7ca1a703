"""``sgl-tts bench``: start each side's servers (``sgl-tts serve``), run the searches, write the
records (resumable JSONL), the report (Markdown + JSON) and the plot. See :mod:`sgl_tts.bench.goodput`
for what is measured.

``--device cuda`` (the default) runs both sides on one GPU, the sgl-tts side with the memory planner's
split. ``--device cpu`` runs real SGLang servers on this machine's CPU (:mod:`sgl_tts.launch.cpu_serving`):
small random-weight Qwen2 models (:data:`CPU_MODELS`), a shorter trace of the same log-normal shape
(:data:`CPU_TRACE`); the stock sides get ``--stock-split`` of ``--kv-memory``, the sgl-tts side the
planner's split on both models' measured CPU profiles (:mod:`sgl_tts.launch.cpu_profile`) or
``--sgl-tts-split``. The stock sides are scheduling plugin-free, observed by the same observer as the
sgl-tts side: the plugin loaded observe-only (:data:`STOCK_ENV`), so the report's recomputed prompt
tokens and scheduler time per round come from one piece of code on every side
(:mod:`sgl_tts.bench.server_counters`)."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from sgl_tts.bench import server_counters
from sgl_tts.plugin.scheduling.observer import SERVER_ENV as OBSERVER_ENV
from sgl_tts.bench.arrivals import DEFAULT_LATENCY_BOUND
from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput import measure_limit, run_side
from sgl_tts.bench.goodput_load import block_rates, finished_blocks, run_load_side
from sgl_tts.bench.goodput_report import (format_report, plot_report, plot_title, provenance_lines, summarize,
                                          write_report_files)
from sgl_tts.bench.goodput_settings import DEFAULT_N, DEFAULT_SERVER_ARGS, BenchSettings
from sgl_tts.bench.goodput_store import RecordWriter
from sgl_tts.bench.sides import (ALL_SIDES, LOAD_SIDES, SERVER_POLICIES, SIDE_OPTIONS, SIDES, STOCK_POLICIES, is_stock, side_curve,
                                 side_slowdown)

MODEL_CACHE = Path.home() / ".cache" / "sgl-tts" / "bench-models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
# the stock sides: sgl-tts loaded observe-only (sgl_tts.plugin.scheduling.observer): no scheduling hook, no flag, only
# the observer every side is measured by (SGLang's allow-list names no other plugin)
STOCK_ENV = dict(OBSERVER_ENV)
DEVICES = ("cuda", "cpu")
DEFAULT_STOCK_SPLIT = 0.5   # --stock-split: the stock sides' generator share of the budget

# --device cpu: models a 2-core CPU serves at a few thousand tokens/s (the shipped tiny generator's
# shape, with a word-tokenizer vocabulary, random weights; configs/tiny-cpu-*.json) ...
CPU_MODELS = {"generator": "tiny-cpu-generator", "prm": "tiny-cpu-prm"}
# ... and the GPU trace's heavy-tailed log-normal shape (sigma 1.0, the same end rule) scaled down about
# 5x: median 32 tokens (mean ~53, p99 ~330), capped at 512; problems of 64 words (the GPU's 300, scaled)
CPU_TRACE = {"median_tokens": 32.0, "sigma": 1.0, "max_tokens": 512}
CPU_PROMPT_TOKENS = 64
CPU_N = (8, 32, 64)
CPU_PROBLEMS = 1
LOAD_PROBLEMS = 8   # --arrivals: problems per (algorithm, n) and rate, arriving as a Poisson process
# --pressure (issue 32; docs/benchmarks/LOG.md "CPU under memory pressure"): the CPU workload under which the
# scheduler plugin must win. Every beam shares a 512-token prompt (a few-shot prefix worth keeping), and
# each n gets a KV budget (both pools of a side) whose stock generator pool the search's live generator
# KV overflows 1.5-2.5x. Live peaks, measured on stock fcfs with 1 GiB (nothing evicted; SGLang's #token
# at every decode step, 2026-11-29): DVTS 3,208 / 7,355 / 11,700 and beam search 4,318 / 7,547 / 17,875
# tokens at n = 64 / 128 / 256. The stock pools: n = 128 at 16 MiB (split 0.5) 4,096 tokens (1.80x /
# 1.84x); n = 256 at 28 MiB 7,168 (1.63x / 2.49x); n = 64 at 11.125 MiB 2,107 (1.52x / 2.05x), where the
# stock split is 0.37 so that the PRM's pool still holds one whole 2,048-token context (7 MiB of its
# 3,584-byte tokens; 2,050 tokens); the planner's split there is the PRM's floor too (2,112 / 2,048).
CPU_PRESSURE_PROMPT_TOKENS = 512
CPU_PRESSURE_BUDGETS = {64: "11.125MiB", 128: "16MiB", 256: "28MiB"}
CPU_PRESSURE_STOCK_SPLITS = {64: 0.37}   # the stock sides' generator share where 0.5 does not fit the PRM
CPU_PRESSURE_SIDES = ("stock", "stock-lpm", "stock-dfs-weight", "sgl-tts", "sgl-tts+locality", "sgl-tts+locality+overlap",
                      "sgl-tts+locality+overlap-by-family")


def apply_pressure(args) -> None:
    """``--pressure``: the measured pressure budget of the given n, the shared prompt and
    :data:`CPU_PRESSURE_SIDES` unless ``--sides`` is given (in place). A setting that contradicts it
    raises :class:`ValueError` naming it."""
    if not getattr(args, "pressure", False):
        return
    measured = ", ".join(f"n = {n}: {b}" for n, b in CPU_PRESSURE_BUDGETS.items())
    if args.device != "cpu":
        raise ValueError("--pressure is a --device cpu workload")
    if not args.n:
        raise ValueError(f"--pressure needs --n (its budgets are measured for {measured})")
    ns = ", ".join(map(str, args.n))
    unknown = [n for n in args.n if n not in CPU_PRESSURE_BUDGETS]
    if unknown:
        raise ValueError(f"--pressure: no budget measured for n = {', '.join(map(str, unknown))} ({measured}); "
                         "give --kv-memory and --prompt-tokens without --pressure")
    budgets = {(CPU_PRESSURE_BUDGETS[n], CPU_PRESSURE_STOCK_SPLITS.get(n, DEFAULT_STOCK_SPLIT)) for n in args.n}
    if len(budgets) > 1:
        raise ValueError(f"--pressure: n = {ns} run at different budgets ({measured}); "
                         "run one budget at a time")
    budget, split = budgets.pop()
    for flag, given, wanted in (("--kv-memory", args.kv_memory, budget),
                                ("--prompt-tokens", args.prompt_tokens, CPU_PRESSURE_PROMPT_TOKENS),
                                ("--stock-split", args.stock_split, split)):
        if given is not None and given != wanted:
            raise ValueError(f"--pressure sets {flag} {wanted} at n = {ns}; "
                             f"leave {flag} out (got {given})")
    args.kv_memory, args.prompt_tokens, args.stock_split = budget, CPU_PRESSURE_PROMPT_TOKENS, split
    args.sides = args.sides or list(CPU_PRESSURE_SIDES)


def apply_device_defaults(args) -> None:
    """Fill what the user left out with ``args.device``'s defaults (in place); ``--pressure`` first
    (:func:`apply_pressure`)."""
    from sgl_tts.launch.cpu_serving import DEFAULT_KV_MEMORY

    apply_pressure(args)
    cpu = args.device == "cpu"
    if args.stock_split is None:
        args.stock_split = DEFAULT_STOCK_SPLIT
    if args.kv_memory is None:
        args.kv_memory = DEFAULT_KV_MEMORY
    load = bool(getattr(args, "arrivals", None))
    if args.sides is None:
        args.sides = list(LOAD_SIDES if load else SIDES)
    if cpu:
        args.generator = args.generator or CPU_MODELS["generator"]
        args.prm = args.prm or CPU_MODELS["prm"]
    if args.n is None:
        args.n = list(CPU_N if cpu else DEFAULT_N)
    if args.problems is None:
        args.problems = LOAD_PROBLEMS if load else CPU_PROBLEMS if cpu else 2
    if args.prompt_tokens is None:
        args.prompt_tokens = CPU_PROMPT_TOKENS if cpu else 300
    if args.server_args is None:
        args.server_args = "" if cpu else DEFAULT_SERVER_ARGS


def model_folder(arg: str, models_dir: Path) -> Path:
    """A servable folder: ``arg`` itself if it holds a tokenizer, else a random-weight folder written
    for its config (once; rewritten if the config changed)."""
    from sgl_tts.bench.dummy_models import find_config, tokenizer_dir, write_dummy_model

    path = Path(arg)
    if path.is_dir() and any((tokenizer_dir(path) / f).exists() for f in TOKENIZER_FILES):
        return path
    src = find_config(arg)
    out = models_dir / _label(str(src))
    done = out / "config.json"
    if not (done.exists() and done.read_text() == src.read_text() and (out / "tokenizer" / "tokenizer.json").exists()):
        write_dummy_model(src, out)
    return out


def _label(arg: str) -> str:
    """A model's short name: a folder's or config's name (``config.json``: its folder's)."""
    path = Path(arg)
    if path.name == "config.json":
        path = path.parent
    return path.name[:-5] if path.name.endswith(".json") else path.name


def settings_from_args(args, context_default: int | None, planned_batch: int,
                       banned_token_ids: Sequence[int] = ()) -> BenchSettings:
    given = {k: v for k, v in {"median_tokens": args.trace_median, "sigma": args.trace_sigma,
                               "max_tokens": args.trace_max_tokens,
                               "end_probability": args.trace_end_probability,
                               "max_depth": args.trace_max_depth}.items() if v is not None}
    trace = {**(CPU_TRACE if getattr(args, "device", "cuda") == "cpu" else {}), **given}
    return BenchSettings(tuple(args.algorithms), tuple(args.n), args.problems, args.beam_width, args.seed,
                         args.prompt_tokens, args.temperature, trace,
                         args.context_tokens or context_default, planned_batch, args.limit_tokens,
                         tuple(banned_token_ids), arrivals=tuple(getattr(args, "arrivals", None) or ()),
                         latency_bound=getattr(args, "latency_bound", None) or DEFAULT_LATENCY_BOUND,
                         unloaded_problems=getattr(args, "unloaded_problems", None))


PROVENANCE = ("machine", "date", "command")


def run_record(header: dict) -> dict:
    """The ``run`` record a run that measures writes first: its whole header (machine, date, command,
    budget, plan, pools, trace), so a report rebuilt elsewhere (``--report-only``) or by a later
    checkout describes the run that measured, not the invocation rebuilding it."""
    return {"kind": "run", **header}


def measured_header(header: dict, records: Sequence[dict]) -> dict:
    """The header of the runs the records came from: the first run's, with every run's machine and
    date (each distinct value once, in order, joined by "; ") and ``commands`` (every run's;
    ``command`` is the first); ``differ`` names the other keys on which later runs disagree with the
    first (their figures are then not of one setting); ``rebuilt`` names this invocation when it is
    none of the runs (a report rebuilt on another machine or day). Records without ``run`` records
    (written before 2026-11-27) keep ``header``: this invocation's description."""
    runs = [{k: v for k, v in r.items() if k != "kind"} for r in records if r.get("kind") == "run"]
    if not runs:
        return header
    out = dict(runs[0])
    for key in ("machine", "date"):
        out[key] = "; ".join(dict.fromkeys(str(r[key]) for r in runs))
    out["commands"] = list(dict.fromkeys(r["command"] for r in runs))
    out["command"] = out["commands"][0]
    differ = sorted({k for r in runs[1:] for k in r.keys() | runs[0].keys()
                     if k not in PROVENANCE and r.get(k) != runs[0].get(k)})
    if differ:
        out["differ"] = differ
    if all({k: r[k] for k in PROVENANCE} != {k: header[k] for k in PROVENANCE} for r in runs):
        out["rebuilt"] = {k: header[k] for k in PROVENANCE}
    return out


def summary_json(records: list[dict], settings: BenchSettings, header: dict, output: Path | None = None,
                 extra: Sequence = ()) -> dict:
    """What ``.summary.json`` holds (and ``--json`` prints): the header, the settings and the rows
    (the load mode: the cells, with ``extra``'s: :func:`sgl_tts.bench.load_report.load_json`)."""
    if settings.load:
        from sgl_tts.bench.load_report import load_json

        return load_json(records, settings, header, extra, output.name if output else "")
    rows = summarize(records, settings)
    return {"header": header, "settings": settings.to_json(),
            "server_counters": server_counters.per_side(records),
            "rows": [{"algorithm": r.algorithm, "n": r.n, "limit_goodput": r.limit_goodput,
                      "limit_batch": r.limit_batch, "kept_beams_match": r.match, "mismatched": r.mismatched,
                      "sides": {k: vars(v) for k, v in r.sides.items()}} for r in rows]}


def report(records: list[dict], settings: BenchSettings, output: Path, header: dict, extra: Sequence = ()) -> str:
    """Write ``.md``, ``.summary.json`` and ``.png`` beside ``output``; return the Markdown (the load
    mode: with the cells of ``extra``, :class:`sgl_tts.bench.load_report.LoadSource` s)."""
    if settings.load:
        from sgl_tts.bench.load_report import write_load_report

        return write_load_report(records, settings, output, header, extra)
    rows = summarize(records, settings)
    table = format_report(rows)
    lines = [f"# sgl-tts bench: {header['generator']} + {header['prm']}", "", *provenance_lines(header)]
    lines += [f"- settings: `{json.dumps(settings.to_json())}`", "", table, ""]
    counters = server_counters.format_counters(server_counters.per_side(records), ALL_SIDES)
    if counters:
        lines += ["Each side's generator over the side's searches (its `/metrics`): SGLang's own counters "
                  "(evicted, retracted), then the sgl-tts observer's, the same code on every side (stock "
                  "sides: the plugin observe-only): prompt tokens recomputed that an earlier request had "
                  "computed (block-granular: whole 16-token blocks), prompt tokens prefilled, and the "
                  "scheduler's own time per round forming a batch (`-`: not observed).",
                  "", counters, ""]
    return write_report_files(output, "\n".join(lines), summary_json(records, settings, header),
                              (lambda path: plot_report(rows, path, plot_title(header))) if rows else None)


@dataclasses.dataclass
class BenchSetup:
    """What the flags and the model folders give one ``sgl-tts bench`` run: the models, the settings,
    each side's server flags and environment, and the memory plan (CUDA)."""

    gen_dir: Path
    prm_dir: Path
    names: dict[str, str]
    tokenizers: dict[str, Path]
    settings: BenchSettings
    shape: dict
    side_flags: dict
    envs: dict
    budget: str
    vocab: int
    plan: object | None = None
    splits: dict | None = None   # --device cpu: each side's generator share and whether it was planned


def prepare(args) -> BenchSetup:
    """Resolve the models, the trace and each side's flags (FileNotFoundError / ValueError on bad input)."""
    from sgl_tts.bench.dummy_models import WORD_SPECIALS, tokenizer_dir
    from sgl_tts.launch.memory import GiB, context_tokens, plan_from_args, static_split_flags

    models_dir = Path(args.models_dir).expanduser()
    gen_dir, prm_dir = model_folder(args.generator, models_dir), model_folder(args.prm, models_dir)
    names = {"generator": _label(args.generator), "prm": _label(args.prm)}
    args.generator, args.prm = str(gen_dir), str(prm_dir)
    gen_cfg = json.loads((gen_dir / "config.json").read_text())
    toks = {"generator": tokenizer_dir(gen_dir), "prm": tokenizer_dir(prm_dir)}
    # a path (and the PRM's input for it) must fit both models' context
    contexts = [c for c in (context_tokens(gen_dir), context_tokens(prm_dir)) if c]
    context = min(contexts) if contexts else None
    draft = settings_from_args(args, context, 1)
    shape = draft.step_trace().describe(samples=4000)
    vocab = int(gen_cfg["vocab_size"]) - len(WORD_SPECIALS)
    if args.device == "cpu":
        return _prepare_cpu(args, gen_dir, prm_dir, names, toks, shape, draft, context, vocab)
    plan_args = planner_args(args, shape, draft)
    plan = plan_from_args(plan_args)
    longest = plan_args.longest_request or 0
    stock = static_split_flags(plan.gen, plan.prm, plan.budget, plan.reserve, args.stock_split, args.first,
                               min_pool_tokens={"generator": longest, "prm": longest})
    return BenchSetup(gen_dir, prm_dir, names, toks,
                      settings_from_args(args, context, plan.flags["generator"].max_running_requests or 1),
                      shape, {"stock": stock, "sgl-tts": plan.flags}, {"stock": STOCK_ENV, "sgl-tts": None},
                      f"{plan.budget / GiB:.1f} GiB", vocab, plan)


def pooled_step_ids(model_dir: Path) -> tuple[int, ...]:
    """The id a step-pooled PRM's class pools at when served without its tokenizer (the benchmark's
    word tokenizer sits apart), if ``model_dir``'s config is one: the generator must never sample it
    (a sampled one would be read as a step's end), as it never samples the step-tag PRM's tag."""
    from sgl_tts.protocol import STEP_POOLED_DEFAULT_IDS

    archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or ()
    return tuple(STEP_POOLED_DEFAULT_IDS[a] for a in archs if a in STEP_POOLED_DEFAULT_IDS)


def planner_args(args, shape: dict, draft: BenchSettings):
    """A copy of ``args`` with the planner's workload filled in from the trace where not given: a
    request in the middle of a solution (``--beams`` the largest n, step the trace's mean, the prompt
    plus half a mean path cached, the PRM reading prompt + path + step), the problem's prompt shared
    by all and the path by a beam's ``--beam-width`` children."""
    plan_args = copy.copy(args)
    plan_args.beams = args.beams or max(args.n)
    plan_args.step_tokens = args.step_tokens or round(shape["mean_tokens"])
    path = round(shape["mean_steps"] * shape["mean_tokens"] / 2)
    plan_args.prompt_tokens = args.prompt_tokens + path
    plan_args.verify_tokens = args.verify_tokens or args.prompt_tokens + path + plan_args.step_tokens
    # every request of a search shares the problem's prompt, and a beam's children its path so far
    plan_args.shared_tokens = args.prompt_tokens if args.shared_tokens is None else args.shared_tokens
    plan_args.siblings = args.siblings or args.beam_width
    # the longest request the benchmark sends: a path is cut before the context (see the trace)
    plan_args.longest_request = args.longest_request or draft.context_tokens
    return plan_args


def server_extra(args, folders: dict[str, Path], tokenizers: dict[str, Path]) -> dict[str, list[str]]:
    """Each model's further ``launch_server`` flags: ``--server-args``, ``--load-format`` and, for a
    folder whose tokenizer sits apart (the word tokenizer), ``--tokenizer-path``."""
    extra = shlex.split(args.server_args) + (["--load-format", args.load_format] if args.load_format else [])
    return {name: extra + (["--tokenizer-path", str(tokenizers[name])] if tokenizers[name] != folder else [])
            for name, folder in folders.items()}


def _prepare_cpu(args, gen_dir: Path, prm_dir: Path, names: dict, toks: dict, shape: dict, draft: BenchSettings,
                 context: int | None, vocab: int) -> BenchSetup:
    """``--device cpu``: the stock sides get --stock-split of --kv-memory; the sgl-tts side the memory
    planner's split on both models' measured CPU profiles, or --sgl-tts-split when given. SGLang's own
    batch limits on both; the limit's batch is n itself."""
    from sgl_tts.bench.dummy_models import WORD_SPECIALS
    from sgl_tts.launch.cpu_serving import CPU_ENV, cpu_pair_flags
    from sgl_tts.launch.memory import parse_bytes

    plan = None
    share = args.sgl_tts_split
    if share is None and all(is_stock(side) for side in args.sides):
        share = args.stock_split   # no sgl-tts side: nothing to plan (and no profile to measure)
    if share is None and pooled_step_ids(prm_dir):
        raise ValueError(f"{names['prm']} is a step-pooled PRM, which the CPU planner cannot profile yet (its "
                         f"profile decodes): give --sgl-tts-split (e.g. 0.5)")
    if share is None:
        from sgl_tts.launch.cpu_profile import cpu_plan_from_args

        plan_args = planner_args(args, shape, draft)
        # the bench's sgl-tts servers run SGLang's torch_native attention (the plugin's default)
        plan = cpu_plan_from_args(plan_args, extra=server_extra(args, {"generator": gen_dir, "prm": prm_dir}, toks),
                                  attention="native")
        share = plan.generator_share
    flags = {"stock": cpu_pair_flags(gen_dir, prm_dir, args.kv_memory, args.stock_split),
             "sgl-tts": plan.flags if plan is not None else cpu_pair_flags(gen_dir, prm_dir, args.kv_memory, share)}
    splits = {"stock": {"generator_share": args.stock_split, "planned": False},
              "sgl-tts": {"generator_share": round(share, 4), "planned": plan is not None}}
    if plan is not None:
        splits["sgl-tts"].update(rooms={"generator": plan.plan.gen_room, "prm": plan.plan.prm_room},
                                 batches={"generator": plan.plan.gen_batch, "prm": plan.plan.prm_batch},
                                 predicted_seconds=round(plan.plan.total_seconds, 4))
    # a word tokenizer's last ids (<unk>, the PRM's labels and step tag) are never sampled: with
    # a small vocabulary a random model would write them into many steps (an <unk> vanishes
    # from the decoded text, a step tag makes a path unscorable), and the sides would differ
    vocab_size = vocab + len(WORD_SPECIALS)
    banned = (*range(vocab_size - len(WORD_SPECIALS), vocab_size), *pooled_step_ids(prm_dir)) \
        if toks["generator"] != gen_dir else ()
    budget = parse_bytes(args.kv_memory)
    return BenchSetup(gen_dir, prm_dir, names, toks, settings_from_args(args, context, max(args.n), banned),
                      shape, flags, {"stock": {**CPU_ENV, **STOCK_ENV}, "sgl-tts": dict(CPU_ENV)},
                      f"{budget / 2 ** 20:.1f} MiB of KV on the CPU; generator share: stock {args.stock_split}, "
                      f"sgl-tts {share:.3f} ({'planned on measured CPU profiles' if plan else 'given'})",
                      vocab, plan, splits)


def side_specs(args, setup: BenchSetup, output: Path) -> dict[str, list]:
    """Each side's servers: stock SGLang scheduling (under the side's scheduling policy; the plugin
    observe-only), or the sgl-tts servers (plugin on). Every generator serves SGLang's counters and the
    observer's (``--enable-metrics``)."""
    from sgl_tts.plugin.settings import TTSSettings
    from sgl_tts.launch.serve import build_specs

    extra_by = server_extra(args, {"generator": setup.gen_dir, "prm": setup.prm_dir}, setup.tokenizers)
    ports = {"generator": args.generator_port, "prm": args.prm_port}
    specs = {}
    for side in args.sides:
        servers = "stock" if is_stock(side) else "sgl-tts"   # every sgl-tts side runs on the sgl-tts servers
        policy = STOCK_POLICIES.get(side)
        # the load mode reads both servers' waiting queues from their /metrics
        metered = ("generator", "prm") if setup.settings.load else ("generator",)
        flags = {name: extra_by[name] + (["--schedule-policy", policy] if policy else [])
                 + ([server_counters.METRICS_FLAG] if name in metered else []) for name in extra_by}
        server_policy = SERVER_POLICIES.get(side)
        plugin = TTSSettings(**(server_policy or {"policy": "prefix-aware"}),
                             metrics_file=str(output.with_name(output.stem + ".plugin-metrics.jsonl"))
                             ) if servers == "sgl-tts" else None
        specs[side] = build_specs(str(setup.gen_dir), str(setup.prm_dir), setup.side_flags[servers], host=args.host,
                                  ports=ports, first=args.first, plugin=plugin, extra=flags,
                                  env=setup.envs[servers],
                                  prm_plugin=TTSSettings(**server_policy) if server_policy else None)
    return specs


def bench_header(args, argv: Sequence[str], setup: BenchSetup) -> dict:
    """The report's provenance: models, machine, date, command, budget, workload, pools, trace."""
    from sgl_tts.machine import describe

    trace = setup.settings.step_trace()
    return {"generator": setup.names["generator"], "prm": setup.names["prm"], "machine": describe(),
            "date": datetime.date.today().isoformat(), "command": shlex.join(["sgl-tts", "bench", *argv]),
            "device": args.device, "budget": setup.budget,
            "workload": dataclasses.asdict(setup.plan.work) if setup.plan is not None else None,
            "pools": {side: {name: setup.side_flags[side][name].max_total_tokens for name in ("generator", "prm")}
                      for side in SIDES},
            "splits": setup.splits,
            "trace": {**dataclasses.asdict(trace), **{k: round(v, 3) for k, v in setup.shape.items()}}}


def server_groups(sides: Sequence[str], specs: dict[str, list]) -> list[list[str]]:
    """The sides in groups that run on one start of the same servers, in the order of each group's first
    side: sides whose servers are the same commands (e.g. ``sgl-tts``, ``sgl-tts+overlap`` and
    ``sgl-tts+auto+overlap``: only the program's settings differ). A server start costs about a minute
    on a GPU (docs/gpu-bringup-log.md), a lease has fifteen. The locality policy's sides always start
    their own: their eviction state lives on the radix tree, whose survival of a flush is not proven."""
    groups: list[list[str]] = []
    for side in dict.fromkeys(sides):
        shared = side not in SERVER_POLICIES and next(
            (g for g in groups if g[0] not in SERVER_POLICIES and specs[g[0]] == specs[side]), None)
        if shared:
            shared.append(side)
        else:
            groups.append([side])
    return groups


def flush_caches(urls: dict[str, str], timeout: float = 120.0) -> None:
    """Empty both servers' radix caches (SGLang's ``/flush_cache``, which waits up to ``timeout`` for the
    server to be idle), so that a side run on servers an earlier side used starts as cold as on fresh
    ones; the plugin's observer forgets what it saw computed (:func:`sgl_tts.plugin.scheduling.observer.after_flush`).
    Raises BenchError when a server refuses."""
    from sgl_tts.launch.server_api import CacheNotFlushed, flush_cache

    for name, url in urls.items():
        try:
            flush_cache(url, timeout)
        except CacheNotFlushed as exc:
            raise BenchError(f"the {name} server did not flush its cache between two sides: {exc.reason}") from exc


class SideRunner:
    """Runs the sides group by group (:func:`server_groups`) on one records file: a group's servers
    start, each of its sides runs what it has not finished (and, on an sgl-tts side, the decode limit)
    after the radix caches were flushed if an earlier side used them, its servers stop; ``left`` counts
    what ``--stop-after`` left undone; ``side`` is the side running (or last run)."""

    def __init__(self, args, setup: BenchSetup, specs: dict[str, list], writer: RecordWriter):
        self.args, self.setup, self.specs, self.writer = args, setup, specs, writer
        self.deadline = time.monotonic() + args.stop_after if args.stop_after is not None else None
        self.left = 0
        self.side = ""

    def _todo(self, side: str) -> tuple[set, set, int]:
        """Every side's finished searches, the decode limits measured, and how many searches and
        measurements ``side`` has left."""
        settings, writer = self.setup.settings, self.writer
        if settings.load:   # the load mode's unit is a block: (side, algorithm, n, rate)
            done = finished_blocks(writer.records)
            need = {(side, a, n, r) for a in settings.algorithms for n in settings.n for r in block_rates(settings)}
            return done, set(), len(need - done)
        done = {(r["side"], r["algorithm"], r["n"], r["problem"]) for r in writer.records if r.get("kind") == "search"}
        limits = {r["batch"] for r in writer.records if r.get("kind") == "limit"}
        need = {(side, a, n, p) for a in settings.algorithms for n in settings.n for p in range(settings.problems)}
        need_limit = not is_stock(side) and bool({min(n, settings.planned_batch) for n in settings.n} - limits)
        return done, limits, len(need - done) + int(need_limit)

    def run_group(self, sides: Sequence[str]) -> None:
        """Raises ServerFailed / BenchError / OSError (connection errors) when a side fails."""
        from sgl_tts.launch.serve import run_servers

        todo = [side for side in sides if self._todo(side)[2]]
        if not todo:
            return
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.left += sum(self._todo(side)[2] for side in todo)
            return
        stop = threading.Event()

        def work(servers):
            try:
                urls = {s.spec.name: s.spec.health_url.rsplit("/", 1)[0] for s in servers}
                for k, side in enumerate(todo):
                    self.side = side
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        self.left += self._todo(side)[2]
                        continue
                    if k:
                        flush_caches(urls)
                        self.writer({"kind": "servers", "side": side, "started_for": todo[0], "flushed": True})
                    self._run_side(side, urls)
            except Exception as exc:
                time.sleep(0.5)   # a server that crashed has exited by now: name it, with its last lines
                dead = next((s for s in servers if not s.alive()), None)
                if dead is not None:
                    raise dead.failure(f"exited with code {dead.proc.returncode} during the searches") from exc
                raise
            finally:
                stop.set()

        self.side = todo[0]
        run_servers(self.specs[todo[0]], health_timeout=self.args.health_timeout, on_ready=work, stop_event=stop,
                    out=sys.stderr if self.args.json else None)   # with --json stdout carries only the JSON

    def _run_side(self, side: str, urls: dict[str, str]) -> None:
        settings, writer, toks = self.setup.settings, self.writer, self.setup.tokenizers
        done, limits, _ = self._todo(side)
        if settings.load:
            self.left += run_load_side(side, urls, settings, prm_tokenizer=str(toks["prm"]),
                                       generator_tokenizer=str(toks["generator"]), vocab=self.setup.vocab, done=done,
                                       write=writer, flush=lambda: flush_caches(urls),
                                       progress=not self.args.no_progress, deadline=self.deadline)
            return
        if SIDE_OPTIONS[side].get("speculative") == "auto":
            # its decode curve and the PRM's slowdown (cached; run_side reads them back) are
            # measured before the side's counters start: their prompts are not the side's work
            side_curve(side, urls["generator"], settings, settings.step_trace())
            side_slowdown(side, urls["generator"], urls["prm"])
        before = server_counters.server_counters(urls["generator"])
        unfinished = run_side(side, urls["generator"], urls["prm"], settings,
                              prm_tokenizer=str(toks["prm"]), generator_tokenizer=str(toks["generator"]),
                              vocab=self.setup.vocab, done=done, write=writer,
                              progress=not self.args.no_progress, deadline=self.deadline)
        self.left += unfinished
        # after a side's searches only (the decode limit below is not its work)
        writer({"kind": "counters", "side": side,
                **server_counters.delta(before, server_counters.server_counters(urls["generator"]))})
        if not is_stock(side) and not unfinished:
            measure_limit(urls["generator"], settings, vocab=self.setup.vocab, write=writer, done=limits)


__all__ = ["CPU_MODELS", "CPU_TRACE", "DEVICES", "BenchSetup", "SideRunner", "apply_device_defaults", "bench_header",
           "flush_caches", "server_groups",
           "measured_header", "run_record", "model_folder",
           "planner_args", "prepare", "report", "server_extra", "settings_from_args", "side_specs", "summary_json"]
