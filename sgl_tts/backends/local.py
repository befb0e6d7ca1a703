"""``LocalBackend``: SGLang frontend programs on a Hugging Face causal LM, on the CPU, no server.

The interpreter calls ``generate``/``select`` from one thread per fork; every call becomes a request
to one :class:`~sgl_tts.backends.engine.BatchEngine`, which batches whatever runs concurrently into
shared forward passes and reuses the KV of shared prefixes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Sequence

from sglang.global_config import global_config
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.backend.runtime_endpoint import compute_normalized_prompt_logprobs
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path
from sglang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from sglang.lang.ir import SglSamplingParams

from sgl_tts.backends.engine import BatchEngine
from sgl_tts.backends.kv import running_rows
from sgl_tts.backends.semantics import Completion, LogprobSpec, SamplingSpec, UnsupportedFeatureError
from sgl_tts.backends.engine_process import (
    DTYPES,
    EngineProcess,
    EngineSpec,
    check_supported_architecture,
    load_model,
)
from sgl_tts.backends.layout import (  # noqa: F401 - the layout's names, importable from here as before
    DEFAULT_RUNNING_CAP,
    PROCESS_ENGINE_MIN_IN_FLIGHT,
    TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT,
    TREE_SEARCH_RUNNING_CAP,
    EngineIn,
    EngineLayout,
    choose_engine,
)
from sgl_tts.backends.replicas import EngineReplicas
from sgl_tts.backends.request import RequestFields, take_request_fields

logger = logging.getLogger(__name__)


class LocalBackend(BaseBackend):
    """Run SGLang programs on a local transformers model (CPU by default).

    Args:
        model_path: a Hugging Face model folder (``config.json``, weights, tokenizer).
        dtype: ``"float32"`` (default, exact) or ``"bfloat16"`` (faster on recent CPUs).
        device: torch device for the model.
        max_running: most requests decoded together; ``None`` (default): as many as
            ``kv_memory_mb`` of KV holds at the model's longest sequence (at most 2,048 tokens),
            between 16 and ``running_cap`` (:func:`~sgl_tts.backends.kv.running_rows`).
        kv_memory_mb: the KV memory that sizes ``max_running`` when it is not given.
        running_cap: the most ``max_running=None`` allows (default 256; :func:`choose_engine` gives
            tree searches with many in flight 1,024).
        prefix_cache_mb: memory kept for KV of shared prefixes (0 disables reuse across calls).
        seed: seed of the engine's generator for requests without their own seed.
        chat_template: SGLang chat template name; by default chosen from the model path as SGLang does.
        gather_window_ms: how long the engine waits for more requests to arrive together once one
            arrives at an idle engine (a fork's branches arrive within microseconds).
        threads: torch threads of the engine (default 1; ``None`` for torch's default), see
            :class:`~sgl_tts.backends.engine.BatchEngine`.
        engine_in: ``"thread"`` (default) runs the engine on a thread of this process;
            ``"process"`` runs the model and its engine in a child process
            (:class:`~sgl_tts.backends.engine_process.EngineProcess`), so that the searches' threads
            do not share an interpreter lock with it: faster with many searches in flight, a few
            seconds more to start. ``model`` is then ``None`` in this process.
        replicas: engines of this model, each in a process of its own (``engine_in="process"``),
            requests routed by the prompt prefixes each has seen
            (:class:`~sgl_tts.backends.replicas.EngineReplicas`): one core per engine for a small
            model, whose decode step one core runs. ``kv_memory_mb`` and ``prefix_cache_mb`` are
            shared out among them; ``max_running`` is per engine.
    """

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu",
                 max_running: int | None = None, kv_memory_mb: int = 2048,
                 running_cap: int = DEFAULT_RUNNING_CAP, prefix_cache_mb: int = 256,
                 seed: int | None = None,
                 chat_template: str | None = None, gather_window_ms: float = 4.0,
                 threads: int | None = 1, trust_remote_code: bool = False,
                 engine_in: EngineIn = "thread", replicas: int = 1):
        super().__init__()
        from transformers import AutoConfig, AutoTokenizer

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"no model at {path}: expected a Hugging Face model folder with config.json "
                f"(model hubs are not used; pass a local path)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if str(device) != "cpu":
            raise ValueError(f"LocalBackend runs on the CPU (device='cpu'), got device={device!r}; "
                             f"with CUDA use sgl_tts.connect(path) for an in-process SGLang runtime")
        if engine_in not in ("thread", "process"):
            raise ValueError(f"engine_in must be 'thread' or 'process', got {engine_in!r}")
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if replicas > 1 and engine_in != "process":
            raise ValueError(f"replicas={replicas} needs engine_in='process' (engines on threads of one "
                             f"process share its interpreter lock, so a second one adds no core)")
        self.model_path = str(path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if max_running is None:
            max_running = running_rows(config, 2 if dtype in ("bfloat16", "float16") else 4,
                                       (kv_memory_mb << 20) // replicas, cap=running_cap)
        elif max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        spec = EngineSpec(self.model_path, dtype=dtype, trust_remote_code=trust_remote_code,
                          max_running=max_running, prefix_cache_bytes=(prefix_cache_mb << 20) // replicas, seed=seed,
                          gather_window_s=gather_window_ms / 1000.0, threads=threads)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.engine: BatchEngine | EngineProcess | EngineReplicas
        if engine_in == "process":
            check_supported_architecture(config)
            if replicas == 1:
                self.engine = EngineProcess(spec)
            else:  # each its own seed for unseeded requests, so that their draws differ
                self.engine = EngineReplicas([
                    EngineProcess(spec if seed is None else dataclasses.replace(spec, seed=seed + i))
                    for i in range(replicas)])
            self.model = None
        else:
            self.model = load_model(path, dtype, trust_remote_code)
            self.engine = BatchEngine(self.model, self.tokenizer, max_running=max_running,
                                      prefix_cache_bytes=spec.prefix_cache_bytes, seed=seed,
                                      gather_window_s=spec.gather_window_s, threads=threads)
        self.chat_template = (get_chat_template(chat_template) if chat_template
                              else get_chat_template_by_model_path(self.model_path))
        self.is_chat_model = False

    # ------------------------------------------------------------------ BaseBackend interface
    def get_model_name(self) -> str:
        return self.model_path

    def generate(self, s, sampling_params: SglSamplingParams):
        fields = take_request_fields()
        comp = self._complete(s.text_, sampling_params, fields)
        return comp.text, comp.meta_info

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        # The engine finishes a request before returning it: the stream yields one chunk, the
        # whole completion, with the same text and meta_info as ``generate``.
        text, meta = self.generate(s, sampling_params)
        yield text, meta

    def select(self, s, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod | None = None) -> ChoicesDecision:
        """SGLang's ``RuntimeEndpoint.select``, step for step, on the local engine: score each
        ``text + choice`` from two tokens before the end of the prompt, normalise with SGLang's own
        ``compute_normalized_prompt_logprobs``, undo the token-healing overlap the way it does."""
        take_request_fields()
        if temperature > 1e-5:
            raise UnsupportedFeatureError("select with temperature > 0 (SGLang selects greedily)")
        method = choices_method or token_length_normalized
        prompt_len = len(self.encode(s.text_))
        logprob_start_len = max(prompt_len - 2, 0)  # for token healing, as the server client does
        futs = [self.engine.submit(self.encode(s.text_ + c), SamplingSpec(max_new_tokens=0, temperature=0),
                                   LogprobSpec(return_logprob=True, logprob_start_len=logprob_start_len,
                                               return_text_in_logprobs=True))
                for c in choices]
        metas = [f.result().meta_info for f in futs]
        input_token_logprobs = [m["input_token_logprobs"] for m in metas]
        output_token_logprobs = [m["output_token_logprobs"] for m in metas]
        normalized = [compute_normalized_prompt_logprobs(lps) for lps in input_token_logprobs]
        for i, lps in enumerate(input_token_logprobs):
            healed_token_str = lps[0][-1]
            if s.text_.endswith(healed_token_str):  # no healing happened: drop the extra token
                healed = lps[0][0]
                if healed is not None:  # (the first returned entry is None: it never entered the mean)
                    normalized[i] = (normalized[i] * len(lps) - healed) / (len(lps) - 1)
                input_token_logprobs[i] = lps[1:]
        unconditional = None
        if method.requires_unconditional_logprobs:
            # SGLang 0.5.15's client asks with the default logprob_start_len, for which its server
            # returns no input logprobs (and the method then fails); ask from position 0 instead.
            futs = [self.engine.submit([e[1] for e in lps], SamplingSpec(max_new_tokens=0),
                                       LogprobSpec(return_logprob=True, logprob_start_len=0))
                    for lps in input_token_logprobs]
            unconditional = [f.result().meta_info["input_token_logprobs"] for f in futs]
        return method(choices=choices, normalized_prompt_logprobs=normalized,
                      input_token_logprobs=input_token_logprobs,
                      output_token_logprobs=output_token_logprobs,
                      unconditional_token_logprobs=unconditional)

    def cache_prefix(self, prefix_str: str) -> None:
        ids = self.encode(prefix_str)
        if ids:
            self.engine.generate(ids, SamplingSpec(max_new_tokens=0))

    def flush_cache(self) -> None:
        self.engine.flush_prefix_cache()

    def shutdown(self) -> None:
        self.engine.close()

    def wait_ready(self) -> None:
        """Block until the model is loaded (engines in processes load while this process goes on;
        a load failure is raised here)."""
        wait = getattr(self.engine, "wait_ready", None)
        if wait is not None:
            wait()

    def concatenate_and_append(self, src_rids, dst_rid):
        raise UnsupportedFeatureError("concatenate_and_append (KV concatenation of forks)")

    # ------------------------------------------------------------------------ extra API
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as an SGLang server tokenizes a ``/generate`` prompt."""
        return self.tokenizer.encode(text)

    def next_token_logprobs(self, prompts: Sequence[str | Sequence[int]],
                            positions: Sequence[Sequence[int]],
                            token_ids: Sequence[int]) -> list[list[list[float]]]:
        """log P(next token = t | prompt[: p + 1]) for every prompt, position p and id t.

        ``prompts`` are texts or token id lists; ``positions[i]`` index prompt i's tokens (negative
        positions count from the end). All prompts run as one batch. Returns
        ``[prompt][position][token]``. PRM step scores are read this way (e.g. P("+") after a tag).
        """
        if len(prompts) != len(positions):
            raise ValueError("prompts and positions must have the same length")
        futs = []
        for prompt, pos in zip(prompts, positions):
            ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            pos = [p + len(ids) if p < 0 else p for p in pos]
            futs.append(self.engine.submit(ids, SamplingSpec(max_new_tokens=0),
                                           score_positions=(pos, token_ids)))
        return [f.result().meta_info["next_token_logprobs"] for f in futs]

    # ---------------------------------------------------------------------------- helpers
    def _complete(self, text: str, params: SglSamplingParams, fields: RequestFields) -> Completion:
        sampling, logprobs = self._specs(params, fields)
        ids = self.encode(text)
        processor = None if fields.custom_logit_processor is None else \
            (fields.custom_logit_processor, dict(fields.custom_params or {}))
        comp = self.engine.submit(ids, sampling, logprobs, rid=fields.rid, priority=admission_priority(fields),
                                  logit_processor=processor).result()
        if fields.custom_params is not None or fields.priority is not None:
            comp.meta_info["request_fields"] = {"priority": fields.priority,
                                                "custom_params": fields.custom_params}
        return comp

    @staticmethod
    def _specs(p: SglSamplingParams, fields: RequestFields) -> tuple[SamplingSpec, LogprobSpec]:
        unsupported = []
        if p.n not in (None, 1):
            unsupported.append(f"n={p.n} (fork the program instead)")
        if p.regex is not None or p.dtype is not None:
            unsupported.append("regex/dtype constrained decoding")
        if p.json_schema is not None:
            unsupported.append("json_schema constrained decoding")
        if p.stop_regex:
            unsupported.append("stop_regex")
        if p.frequency_penalty or p.presence_penalty:
            unsupported.append("frequency/presence penalties")
        if unsupported:
            raise UnsupportedFeatureError(
                "LocalBackend does not support " + ", ".join(unsupported)
                + "; use an SGLang server backend (sgl_tts.connect(url)) for these")
        stop = p.stop
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        sampling = SamplingSpec(
            max_new_tokens=int(p.max_new_tokens if p.max_new_tokens is not None else 128),
            min_new_tokens=int(p.min_new_tokens or 0),
            temperature=float(p.temperature if p.temperature is not None else 1.0),
            top_p=float(p.top_p if p.top_p is not None else 1.0),
            top_k=int(p.top_k if p.top_k is not None else -1),
            min_p=float(p.min_p or 0.0),
            stop=tuple(x for x in stop if x),
            stop_token_ids=frozenset(int(t) for t in (p.stop_token_ids or ())),
            ignore_eos=bool(p.ignore_eos),
            skip_special_tokens=global_config.skip_special_tokens_in_output,
            spaces_between_special_tokens=global_config.spaces_between_special_tokens_in_out,
            seed=fields.seed,
        )
        token_ids = tuple(fields.token_ids_logprob) if fields.token_ids_logprob is not None else None
        logprobs = LogprobSpec(
            return_logprob=bool(p.return_logprob) or token_ids is not None,
            logprob_start_len=p.logprob_start_len if p.logprob_start_len is not None else -1,
            top_logprobs_num=int(p.top_logprobs_num or 0),
            token_ids_logprob=token_ids,
            return_text_in_logprobs=bool(p.return_text_in_logprobs),
        )
        return sampling, logprobs




def admission_priority(fields: RequestFields) -> int:
    """The engine priority of a request: its own, else below every normal request when it is
    speculative (``tts_class``; two-phase scheduling by admission: speculative work waits for free
    room, seed 000 §4.1.2), else 0."""
    if fields.priority is not None:
        return int(fields.priority)
    return SPECULATIVE_PRIORITY if (fields.custom_params or {}).get("tts_class") == "speculative" else 0


SPECULATIVE_PRIORITY = -1


__all__ = ["DEFAULT_RUNNING_CAP", "EngineLayout", "LocalBackend", "PROCESS_ENGINE_MIN_IN_FLIGHT",
           "TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT",
           "TREE_SEARCH_RUNNING_CAP", "UnsupportedFeatureError", "check_supported_architecture", "choose_engine"]
