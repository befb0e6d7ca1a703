"""``sgl-tts run``: one TTS program over a JSONL dataset, resumable, with a summary and plots.

One :class:`RunConfig` holds every setting; it loads from YAML (``--config run.yaml``) and any field
is overridden from the command line (``--beam-width 8``), search-and-learn style: defaults < YAML <
flags. Problems are JSONL lines ``{"question": str, "answer": optional, "id": optional}``; without
``--problems`` the embedded tiny task's test split is used. Problems run with ``in_flight`` of them in
flight at once (:func:`sgl_tts.search.runner.run_continuously`), and each finished problem is appended to
the output JSONL as one line the moment it finishes (flushed and synced), so a killed run loses at
most the problems in flight: run the same command again and it skips every problem already written.

The summary is computed from the output file (so a resumed run summarises all its problems):
accuracy of the top-1 majority vote, the PRM-weighted vote and the best PRM score; pass@N (some
trajectory right); accuracy at every N' = 2^k <= N from the same run by subsampling (the first N'
trajectories: for best-of-N exactly what a run with N' samples gives, because sample i's seed depends
on i only; for tree searches an estimate); precise goodput (seed 000 §6.1: mean tokens per
trajectory / mean trajectory completion time); per-problem completion latency; tokens generated vs
kept in the returned trajectories.
"""

from __future__ import annotations

from sgl_tts.experiment.config import (  # noqa: F401
    PROGRAMS,
    MCTS_SETTINGS,
    PRM_KINDS,
    RULES,
    RunError,
    RunConfig,
    SEED_SCHEME,
    program_function,
    load_yaml,
    read_yaml,
    _yaml_error,
    read_input,
    utf8_text,
    field_kind,
    _coerce,
    config_from_options,
)
from sgl_tts.experiment.records import (  # noqa: F401
    ProblemRecord,
    read_problems,
    subsample_sizes,
    answers_at,
    result_record,
    read_results,
    results_store,
)
from sgl_tts.experiment.summary import (  # noqa: F401
    Summary,
    quantile,
    summarize,
    plot_summary,
)
from sgl_tts.experiment.driver import (  # noqa: F401
    open_prm,
    check_prm,
    run,
)

__all__ = [
    "MCTS_SETTINGS",
    "PRM_KINDS",
    "PROGRAMS",
    "ProblemRecord",
    "RULES",
    "RunConfig",
    "RunError",
    "SEED_SCHEME",
    "Summary",
    "answers_at",
    "check_prm",
    "config_from_options",
    "load_yaml",
    "open_prm",
    "plot_summary",
    "program_function",
    "quantile",
    "read_input",
    "read_problems",
    "read_results",
    "read_yaml",
    "result_record",
    "results_store",
    "run",
    "subsample_sizes",
    "summarize",
    "utf8_text",
]
