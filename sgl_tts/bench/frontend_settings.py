"""``sgl-tts bench-frontend``'s settings: what to run (backends, programs, K), the programs' budgets,
where the CPU backend's engines run, and the key that says which recorded runs a rerun may reuse."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from typing import Any, Sequence

from sgl_tts.plugin.settings import CPU_ATTENTION

BACKENDS = ("cpu", "server")
PROGRAMS = ("beam_search", "best_of_n", "mcts")
LIMIT_NEW_TOKENS = 64          # tokens of each plain generation of the limit measurement
GEN_KV_BYTES = 1 << 30         # the generator server's KV pool when this command starts it
PRM_KV_BYTES = 512 << 20       # the PRM server's
RECORD_FORMAT = 2              # 2: the limit is taken at the generator's observed running batch
METRICS_FLUSH_WAIT_S = 1.5     # the plugin's records reach disk within a second (its flush timer)


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    out = []
    for part in (x.strip() for x in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{flag}: {part!r} is not a positive integer (give a comma-separated list, e.g. 1,8,32)")
        out.append(int(part))
    return tuple(out)


def _names(text: str, flag: str, choices: Sequence[str]) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in choices]
    if bad or not out:
        raise ValueError(f"{flag}: unknown value {bad[0] if bad else text!r}; choose from {', '.join(choices)}")
    return out


# ------------------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class FrontendSettings:
    """One run's settings.

    Attributes:
        backends, programs, ks: what to run (blocks: every backend x program x K).
        min_searches: searches per block are max(K, this).
        beams, beam_width: beam search's N and M.
        samples: best-of-N's N.
        rollouts, expansion_width, parallel: MCTS's rollout budget, children per expansion and
            rollouts in flight.
        max_depth, step_tokens: most steps of a tree search and a step's token limit.
        max_tokens: a best-of-N sample's token limit.
        temperature: sampling temperature.
        seed: the sampling seed (``sgl-tts run``'s: each sample's seed derives from it).
        cpu_engine: where the ``cpu`` backend's engines run: ``thread`` (in this process),
            ``process`` (a child process each, :class:`~sgl_tts.backends.engine_process.EngineProcess`)
            or ``auto`` (per block, as ``sgl-tts run`` decides: :func:`cpu_engine_for`).
        cpu_replicas: engines per model in processes (``None``: as ``sgl-tts run`` decides).
        server_attention: the attention of the ``server`` backend's servers started here (the
            plugin's ``--tts-cpu-attention``): ``ragged`` (the default, what ``sgl-tts serve
            --device cpu`` runs) or ``native`` (SGLang's ``torch_native``). Servers given by URL run
            what they were started with.
    """

    backends: tuple[str, ...] = BACKENDS
    programs: tuple[str, ...] = PROGRAMS
    ks: tuple[int, ...] = (1, 8, 32, 128)
    min_searches: int = 8
    beams: int = 16
    beam_width: int = 4
    samples: int = 16
    rollouts: int = 16
    expansion_width: int = 4
    parallel: int = 4
    max_depth: int = 40
    step_tokens: int = 64
    max_tokens: int = 256
    temperature: float = 0.8
    seed: int = 0
    cpu_engine: str = "auto"
    cpu_replicas: int | None = None
    server_attention: str = "ragged"

    # --quick: K in {1, 4}, 4 searches, small budgets (a CI check, not a measurement)
    QUICK: typing.ClassVar[dict[str, Any]] = dict(ks=(1, 4), min_searches=4, beams=4, beam_width=2, samples=4,
                                                  rollouts=4, expansion_width=2, parallel=2)
    # what may differ between runs whose records are shared (which blocks to run)
    NOT_IN_KEY: typing.ClassVar[tuple[str, ...]] = ("backends", "programs", "ks")

    def __post_init__(self):
        _names(",".join(self.backends), "--backends", BACKENDS)
        _names(",".join(self.programs), "--programs", PROGRAMS)
        if self.cpu_engine not in ("auto", "thread", "process"):
            raise ValueError(f"--cpu-engine must be auto, thread or process, got {self.cpu_engine!r}")
        if self.cpu_replicas is not None and self.cpu_replicas < 1:
            raise ValueError(f"--cpu-replicas must be at least 1, got {self.cpu_replicas}")
        if self.server_attention not in CPU_ATTENTION:
            raise ValueError(f"--server-attention must be one of {', '.join(CPU_ATTENTION)}, "
                             f"got {self.server_attention!r}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"--ks: every K must be a positive integer, got {self.ks}")
        for name in ("min_searches", "beams", "beam_width", "samples", "rollouts", "expansion_width", "parallel",
                     "max_depth", "step_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")
        from sgl_tts.tiny.task import TEST_SIZE
        if self.searches(max(self.ks)) > TEST_SIZE:
            raise ValueError(f"--ks: {max(self.ks)} searches exceed the {TEST_SIZE} test problems")

    def key(self) -> str:
        """What a record must match to be reused (every setting that changes a block's result)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NOT_IN_KEY}
        fields["record_format"] = RECORD_FORMAT
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def searches(self, k: int) -> int:
        """Searches of a block with K in flight."""
        return max(k, self.min_searches)

    def run_config(self, program: str):
        """``sgl-tts run``'s :class:`~sgl_tts.experiment.RunConfig` for ``program`` at these budgets."""
        from sgl_tts.experiment import RunConfig

        common = dict(program=program, max_depth=self.max_depth, step_tokens=[self.step_tokens],
                      max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed, progress=False)
        if program == "beam_search":
            cfg = RunConfig(n=self.beams, beam_width=self.beam_width, **common)
        elif program == "best_of_n":
            cfg = RunConfig(n=self.samples, **common)
        else:   # MCTS scores trajectories by their weakest step (the program's default)
            cfg = RunConfig(n=self.rollouts, beam_width=self.expansion_width, parallel=self.parallel,
                            aggregation="min", **common)
        cfg.validate()
        return cfg

    def requests_per_search(self, program: str) -> int:
        """Generation requests one search keeps in flight."""
        if program == "beam_search":
            return self.beams
        if program == "best_of_n":
            return self.samples
        return self.parallel * self.expansion_width

    def limit_batch(self, program: str, k: int, max_running: int) -> int:
        """B: the running batch K searches give the generator (at most its max running requests)."""
        return max(1, min(k * self.requests_per_search(program), max_running))


def cpu_engine_for(s: FrontendSettings, program: str, k: int):
    """How the ``cpu`` backend lays its engines out for a block: ``s.cpu_engine``, with ``auto``
    resolved as ``sgl-tts run`` resolves it (:func:`sgl_tts.backends.layout.choose_engine`)."""
    from sgl_tts import registry
    from sgl_tts.backends.layout import choose_engine

    return choose_engine(s.cpu_engine, tree_search=registry.program(program).budget != "samples", in_flight=k,
                         replicas=s.cpu_replicas)


def program_options(s: FrontendSettings, program: str) -> dict[str, Any]:
    """The program's keyword arguments other than the question and the PRM (recorded with a block)."""
    args = s.run_config(program).program_arguments("", None)
    return {k: v for k, v in args.items() if k not in ("question", "prm")}
