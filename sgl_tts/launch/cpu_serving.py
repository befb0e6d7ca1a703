"""SGLang servers on the CPU: the flags and environment a real ``sglang.launch_server`` needs there.

SGLang 0.5.15 serves on a CPU with ``--device cpu`` when ``SGLANG_USE_CPU_ENGINE=1`` is set (without
it the scheduler dies importing vLLM's rotary kernel). What else the CPU needs, and why:

- ``--max-total-tokens``: without it the KV pool takes 75% of free RAM and a second server does not
  fit. :func:`cpu_pair_flags` derives each server's pool from a stated KV memory budget.
- ``--grammar-backend none``: with the default xgrammar, a regex request kills the scheduler
  (``Unsupported device: cpu``); with none it gets a clean error and the server stays up.
- ``--sleep-on-idle``: an idle scheduler otherwise busy-polls a whole core.
- ``OMP_NUM_THREADS`` (:data:`CPU_ENV`): half the cores per server (at least 1), unless the caller set
  it. Each scheduler's torch otherwise takes every core, and a generator and a PRM busy at once (what
  several searches in flight make them) oversubscribe the cores with spinning OpenMP workers: 8 beam
  searches at once on the 2-core CPU ran at 0.25-0.41 searches/s against 0.72 for one at a time; with
  one thread per server 0.99-1.12 (docs/benchmarks/LOG.md, "Many searches at once").
- ``--model-impl transformers`` for a Qwen2 model whose ``head_dim`` is not ``hidden_size /
  num_attention_heads`` (the tiny PRM: hidden 288 = 256 + 32 side dimensions, 4 heads of 64).
  On the CPU, ``adjust_config_with_unaligned_cpu_tp`` (``sglang/srt/configs/update_config.py``)
  always sets ``original_num_attention_heads`` on the config, and SGLang's own Qwen2 layer
  (``sglang/srt/models/qwen2.py``) then takes ``head_dim = hidden_size // original_num_attention_heads``
  (72), ignoring the config's 64: weights still load, the first request fails with a shape
  mismatch. SGLang's transformers implementation reads ``head_dim`` from the config. The choice is
  made here, per model, from its ``config.json``, because this is the one place that builds a CPU
  server's command line: both benchmark sides, ``serve``, ``smoke`` and the tests get it alike, and
  a model whose shapes agree keeps SGLang's native implementation. (A patch of SGLang's Qwen2 layer
  in the plugin would reach only servers that load the plugin, not stock ones.) A *classifier* with
  such shapes (``write_reward_head`` of the tiny PRM) is refused: SGLang 0.5.15's transformers
  implementation serves ``*ForSequenceClassification`` as an embedding model (``/classify`` returns
  the normalised last hidden state, not the score head's logits), so neither implementation gives
  right scores; :func:`cpu_server_flags` says so instead of letting a server answer wrongly.
- ``SGLANG_DISABLED_MODEL_ARCHS`` (:func:`model_registry_env`): SGLang's model registry imports every
  one of its ~200 model modules in each scheduler process (3 s of a 23 s start of the tiny generator
  on the 2-core CPU); the servers started here skip the modules whose entry classes serve none of
  their models' architectures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from sgl_tts.launch.memory import ModelShape, Plan, StageCosts, Workload

def _threads_per_server() -> str:
    """OpenMP threads for each CPU server: the caller's ``OMP_NUM_THREADS``, else half this process's
    cores (a generator and a PRM share the machine), at least 1."""
    from sgl_tts.machine import usable_cores

    return os.environ.get("OMP_NUM_THREADS") or str(max(1, usable_cores() // 2))


CPU_ENV: dict[str, str] = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": _threads_per_server()}
#: SGLang 0.5.15 answers SIGTERM with crash diagnostics (a py-spy dump, a CUDA core dump) that first
#: sleep 5 s "to let GPU activity settle" (``TokenizerManager.dump_requests_before_crash``, on by
#: default). The servers sgl-tts stops as a matter of course (the live-server fleet: the test bed,
#: profiles, serve-search's own) skip them: 5 s of every stop, for nothing on a CPU.
QUICK_STOP_ENV: dict[str, str] = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
DEFAULT_KV_MEMORY = "1GiB"
_NATIVE_QWEN2 = ("qwen2",)   # model types served by sglang/srt/models/qwen2.py's decoder layer


def _config(model: str | os.PathLike) -> dict:
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}; pass a model folder")
    return json.loads(path.read_text())


def needs_transformers_impl(config: Mapping) -> bool:
    """Whether SGLang's native implementation would get this model's head size wrong on the CPU
    (see the module docstring): a Qwen2 config whose ``head_dim`` x heads differs from its hidden size."""
    cfg = {**config.get("text_config", {}), **config}
    head_dim, heads, hidden = cfg.get("head_dim"), cfg.get("num_attention_heads"), cfg.get("hidden_size")
    return (cfg.get("model_type") in _NATIVE_QWEN2 and bool(head_dim and heads and hidden)
            and int(head_dim) * int(heads) != int(hidden))


_ENTRY_CLASS = re.compile(r"^EntryClass\s*=\s*(\[[\w\s,]*\]|\w+)\s*$", re.MULTILINE)
#: kept whatever the models: SGLang serves an architecture it has no class of (and every model under
#: ``--model-impl transformers``) through its transformers implementation
_ALWAYS_KEPT = ("transformers",)


@functools.lru_cache(maxsize=None)
def _model_modules() -> dict[str, frozenset[str] | None]:
    """SGLang's model modules (``sglang/srt/models/*.py``) by name, each with the classes its
    ``EntryClass`` names, read from the source without importing it; None where it is not a plain
    name or list of names (such a module is never skipped)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")   # the top package's place only: importing it takes seconds
    found: dict[str, frozenset[str] | None] = {}
    for path in sorted((Path(spec.origin).parent / "srt" / "models").glob("*.py")):
        if path.name == "__init__.py":
            continue
        match = _ENTRY_CLASS.search(path.read_text(errors="replace"))
        found[path.stem] = frozenset(re.findall(r"\w+", match.group(1))) if match else None
    return found


def model_registry_env(*models: str | os.PathLike) -> dict[str, str]:
    """``SGLANG_DISABLED_MODEL_ARCHS`` for a server process that serves ``models`` (folders): every
    SGLang model module whose entry classes serve none of their ``architectures``, added to what the
    environment already disables. Empty when an architecture is served by no module that can be
    read (this package's PRM classes: SGLang's registry then needs nothing it would skip, but this
    stays on the safe side) or SGLang's models cannot be found."""
    archs = set()
    for model in models:
        archs.update(_config(model).get("architectures") or ())
    try:
        modules = _model_modules()
    except (ImportError, AttributeError, TypeError, OSError):
        return {}
    serving = {name for name, classes in modules.items() if classes is None or classes & archs}
    if not archs or not all(any(a in (modules[n] or ()) for n in serving) for a in archs):
        return {}
    already = [x.strip() for x in os.environ.get("SGLANG_DISABLED_MODEL_ARCHS", "").split(",") if x.strip()]
    skipped = sorted(set(modules) - serving - set(_ALWAYS_KEPT) | set(already))
    return {"SGLANG_DISABLED_MODEL_ARCHS": ",".join(skipped)}


@dataclasses.dataclass(frozen=True)
class CPUServerFlags:
    """SGLang flags of one server on the CPU (the environment is :data:`CPU_ENV`)."""

    max_total_tokens: int
    model_impl: str | None = None   # "transformers" where the native layer would mis-size heads
    dtype: str | None = None        # None: the checkpoint's (``--dtype`` otherwise)

    def args(self) -> list[str]:
        out = ["--device", "cpu", "--max-total-tokens", str(self.max_total_tokens),
               "--grammar-backend", "none", "--sleep-on-idle"]
        if self.model_impl:
            out += ["--model-impl", self.model_impl]
        if self.dtype:
            out += ["--dtype", self.dtype]
        return out


def cpu_server_flags(model: str | os.PathLike, kv_bytes: int, *, dtype: str | None = None) -> CPUServerFlags:
    """Flags for ``model`` with a KV pool of ``kv_bytes`` (at least one full-context request);
    ``dtype`` (e.g. ``float32``, what :class:`sgl_tts.LocalBackend` computes in) overrides the
    checkpoint's, and sizes the KV cache too."""
    from sgl_tts.launch.memory import ModelShape, context_tokens

    shape = ModelShape.from_config(model, kv_dtype=dtype)
    tokens = int(kv_bytes // shape.kv_bytes_per_token)
    longest = context_tokens(model)
    if tokens < max(1, longest):
        raise ValueError(f"a KV budget of {kv_bytes / 2 ** 20:.1f} MiB holds {tokens} tokens of {shape.name} "
                         f"({shape.kv_bytes_per_token} bytes each), less than its context length ({longest}); "
                         f"give more memory")
    config = _config(model)
    impl = "transformers" if needs_transformers_impl(config) else None
    arch = (config.get("architectures") or [""])[0]
    if impl and arch.endswith(("ForSequenceClassification", "ForRewardModel")):
        raise ValueError(f"{model}: SGLang 0.5.15 cannot serve this classifier right on the CPU: its Qwen2 layer "
                         f"takes head_dim = hidden_size / heads there (not the config's {config.get('head_dim')}), "
                         f"and its transformers implementation returns the last hidden state instead of the "
                         f"head's scores; use a model whose hidden_size equals heads x head_dim, or a GPU")
    return CPUServerFlags(tokens, impl, dtype)


def cpu_pair_flags(generator: str | os.PathLike, prm: str | os.PathLike, kv_memory: str | int = DEFAULT_KV_MEMORY,
                   generator_share: float = 0.5, dtype: str | None = None) -> dict[str, CPUServerFlags]:
    """Both servers' CPU flags: ``kv_memory`` (bytes, or a size such as ``1GiB``) is the KV memory
    the two pools may take together, ``generator_share`` of it the generator's."""
    from sgl_tts.launch.memory import parse_bytes

    if not 0 < generator_share < 1:
        raise ValueError(f"the generator's share must be in (0, 1), got {generator_share}")
    budget = parse_bytes(kv_memory) if isinstance(kv_memory, str) else int(kv_memory)
    return {"generator": cpu_server_flags(generator, int(budget * generator_share), dtype=dtype),
            "prm": cpu_server_flags(prm, int(budget * (1 - generator_share)), dtype=dtype)}


@dataclasses.dataclass(frozen=True)
class CpuPairPlan:
    """The memory planner's split of a CPU KV budget (:func:`plan_cpu_pair`).

    Attributes:
        budget: the KV bytes of both pools together (weights live in host RAM beside it).
        plan: :func:`sgl_tts.launch.memory.solve`'s plan on the measured costs (rooms, batches, times).
        generator_share: the generator's share of ``budget`` once the PRM has its planned pool (raised
            to one longest request, the bytes taken from the generator) and the generator the rest.
        flags: both servers' flags for those pools (:func:`cpu_server_flags`).
    """

    budget: int
    gen: "ModelShape"
    prm: "ModelShape"
    work: "Workload"
    plan: "Plan"
    generator_share: float
    flags: dict[str, CPUServerFlags]


def plan_cpu_pair(generator: str | os.PathLike, prm: str | os.PathLike, kv_memory: str | int, work: "Workload",
                  costs: "StageCosts", *, dtype: str | None = None) -> CpuPairPlan:
    """Split ``kv_memory`` between the two CPU servers by the seed's search
    (:func:`sgl_tts.launch.memory.solve`) on ``costs`` (a :class:`~sgl_tts.launch.memory.StageCosts`,
    normally both models' measured :class:`~sgl_tts.launch.cpu_profile.CpuProfile`) for ``work``.
    The PRM's pool is the plan's (at least one request as long as its context: SGLang refuses a
    longer request than its pool) and the generator takes the rest of the budget, the plan's pool and
    what the boundary left (less than one of its requests)."""
    from sgl_tts.launch.memory import ModelShape, context_tokens, parse_bytes, solve

    budget = parse_bytes(kv_memory) if isinstance(kv_memory, str) else int(kv_memory)
    gen_shape = ModelShape.from_config(generator, kv_dtype=dtype)
    prm_shape = ModelShape.from_config(prm, kv_dtype=dtype)
    plan = solve(gen_shape, prm_shape, costs, work, budget)
    floors = {"generator": max(1, context_tokens(generator)) * gen_shape.kv_bytes_per_token,
              "prm": max(1, context_tokens(prm)) * prm_shape.kv_bytes_per_token}
    prm_bytes = max(plan.prm_kv_bytes, floors["prm"])
    if budget - prm_bytes < floors["generator"]:
        prm_bytes = budget - floors["generator"]
        if prm_bytes < floors["prm"]:
            raise ValueError(f"a KV budget of {budget / 2 ** 20:.1f} MiB cannot hold one context-long request "
                             f"of each model ({floors['generator'] / 2 ** 20:.1f} + {floors['prm'] / 2 ** 20:.1f} MiB)")
    flags = {"generator": cpu_server_flags(generator, budget - prm_bytes, dtype=dtype),
             "prm": cpu_server_flags(prm, prm_bytes, dtype=dtype)}
    return CpuPairPlan(budget, gen_shape, prm_shape, work, plan, (budget - prm_bytes) / budget, flags)


__all__ = ["CPU_ENV", "CPUServerFlags", "CpuPairPlan", "DEFAULT_KV_MEMORY", "cpu_pair_flags", "cpu_server_flags",
           "model_registry_env", "needs_transformers_impl", "plan_cpu_pair"]
