"""``sgl-tts serve-search``: test-time scaling behind an OpenAI-compatible HTTP endpoint
(:func:`sgl_tts.serving.server.serve_search`)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

# the counts that must be at least 1
COUNTS = ("max_concurrent", "max_budget", "max_depth", "max_step_tokens", "max_choices", "default_budget",
          "default_beam_width", "default_max_depth", "default_step_tokens")


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.serving import server
    from sgl_tts.experiment.config import PRM_KINDS
    from sgl_tts.serving.api import Defaults, Limits

    p = argparse.ArgumentParser(prog="sgl-tts serve-search", description=server.__doc__.split("\n\n")[0])
    lim, d = Limits(), Defaults()
    p.add_argument("--generator-url", default=None,
                   help="the generator SGLang server, or the router in front of several (default: start "
                        "the tiny generator with the sgl-tts plugin on the CPU)")
    p.add_argument("--prm-url", default=None, help="the PRM SGLang server (default: start the tiny PRM when "
                   "the generator is started too); 'none': serve self_consistency only")
    p.add_argument("--prm-kind", default="auto", choices=list(PRM_KINDS),
                   help="how to read the PRM (default: from its architecture)")
    p.add_argument("--prm-tokenizer", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30010)
    p.add_argument("--max-concurrent", type=int, default=8, help="searches running at once; later ones wait")
    p.add_argument("--max-budget", type=int, default=lim.max_budget, help="most beams/samples/rollouts per search")
    p.add_argument("--max-depth", type=int, default=lim.max_depth, help="most steps per tree search")
    p.add_argument("--max-step-tokens", type=int, default=lim.max_step_tokens, help="most tokens per step or sample")
    p.add_argument("--max-choices", type=int, default=lim.max_choices, help="most choices (OpenAI n) per response")
    p.add_argument("--default-budget", type=int, default=d.n)
    p.add_argument("--default-beam-width", type=int, default=d.beam_width)
    p.add_argument("--default-max-depth", type=int, default=d.max_depth)
    p.add_argument("--default-step-tokens", type=int, default=d.step_tokens[0])
    p.add_argument("--default-aggregation", default=d.aggregation)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.serving.api import Defaults, Limits
    from sgl_tts.serving.server import serve_search

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in COUNTS:
        if getattr(args, name) < 1:
            print(f"sgl-tts serve-search: error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    limits = Limits(args.max_budget, args.max_depth, args.max_step_tokens, args.max_choices)
    defaults = Defaults(n=args.default_budget, beam_width=args.default_beam_width, max_depth=args.default_max_depth,
                        step_tokens=(args.default_step_tokens,), aggregation=args.default_aggregation)
    try:
        serve_search(args.generator_url, args.prm_url, host=args.host, port=args.port,
                     max_concurrent=args.max_concurrent, prm_kind=args.prm_kind, prm_tokenizer=args.prm_tokenizer,
                     limits=limits, defaults=defaults, log_level=args.log_level)
    except ConnectionError as exc:
        print(f"sgl-tts serve-search: error: {exc}", file=sys.stderr)
        return 1
    return 0
