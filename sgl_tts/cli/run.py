"""``sgl-tts run``: a TTS program over a JSONL dataset (:func:`sgl_tts.experiment.run`), resumable, then
the summary; :func:`add_config_arguments` makes one flag per :class:`~sgl_tts.experiment.RunConfig`
field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from sgl_tts.experiment.config import RunConfig, RunError, config_from_options, field_kind

logger = logging.getLogger(__name__)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` plus one ``--flag`` per :class:`RunConfig` field (only given flags override)."""
    parser.add_argument("--config", default=None, help="YAML file of settings (flags override it)")
    docs = field_docs()
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = field_kind(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{docs.get(f.name, '')} (default: {default!r})".strip()
        if kind == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=argparse.SUPPRESS,
                                metavar=f.name.upper(), help=help_text.replace("%", "%%"))


def field_docs() -> dict[str, str]:
    """Each setting's line from its home's ``Attributes`` section: :class:`RunConfig`'s docstring for
    the shared settings, the program's options dataclass's for a program's own."""
    from sgl_tts import registry

    docs = _attribute_docs(RunConfig)
    for name, (spec, _) in registry.setting_fields().items():
        docs[name] = _attribute_docs(spec.options).get(name, "")
    return docs


def _attribute_docs(cls: type) -> dict[str, str]:
    """Each field's entry in a dataclass docstring's ``Attributes`` section (continuation lines
    joined; a blank line ends an entry)."""
    names = {f.name for f in dataclasses.fields(cls)}
    docs, current = {}, None
    for line in (cls.__doc__ or "").splitlines():
        s = line.strip()
        head = s.split(":", 1)
        if len(head) == 2 and head[0] in names:
            current = head[0]
            docs[current] = head[1].strip()
        elif not s:
            current = None
        elif current:
            docs[current] += " " + s
    return docs


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The config from ``--config`` and the flags given on the command line."""
    return config_from_options(args.config, vars(args))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sgl-tts run", description="Run a TTS program over a JSONL dataset (resumable), then "
        "summarise accuracy, pass@N, accuracy vs N, goodput and latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts run``."""
    from sgl_tts import registry
    from sgl_tts.experiment import driver
    from sgl_tts.experiment.summary import plot_summary
    from sgl_tts.frontend import end_stream_executors

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        import transformers
        import warnings

        # a failed request is reported once, by the error line below; SGLang's interpreter would also
        # print a traceback per fork worker it stopped
        warnings.filterwarnings("ignore", message="Error in stream_executor")

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    t0 = time.perf_counter()
    try:
        cfg = config_from_args(args)
        summary, records = driver.run(cfg)
    except (RunError, OSError, ValueError) as exc:   # OSError: ConnectionError, FileNotFoundError, ...
        logger.debug("sgl-tts run failed", exc_info=True)
        # one line, always: a multi-line message (a server's reply, say) is joined
        message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"sgl-tts run: error: {message or type(exc).__name__}", file=sys.stderr)
        # a search that failed mid-way left fork workers waiting (non-daemon threads): without this
        # the process can outlive its error (seen once in CI after a generator was killed)
        end_stream_executors()
        return 1
    from sgl_tts.machine import describe

    plot = None
    if cfg.plot:
        title = f"{cfg.program}, N={cfg.n}" + (f", M={cfg.beam_width}" if registry.program(cfg.program).budget == "beams" else "")
        plot = str(plot_summary(summary, records, cfg.plot, title))
    info = {"config": dataclasses.asdict(cfg), "summary": summary.to_json(), "output": cfg.output,
            "plot": plot, "seconds": round(time.perf_counter() - t0, 2), "machine": describe(),
            "date": time.strftime("%Y-%m-%d")}
    summary_path = Path(cfg.output).with_suffix(".summary.json")
    summary_path.write_text(json.dumps(info, indent=1) + "\n")
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"sgl-tts run: {cfg.program} N={cfg.n} on {cfg.problems or 'the embedded test split'}"
          f" -> {cfg.output}")
    print(summary.table())
    if plot:
        print(f"plot: {plot}")
    print(f"summary: {summary_path}; {info['seconds']:.1f} s on {info['machine']}")
    return 0
