"""The OpenAI chat-completions request that ``sgl-tts serve-search`` accepts, read into a search.

A request names a TTS program as its ``model`` and may carry the search's settings as extra body
fields (the ``openai`` client's ``extra_body``)::

    client.chat.completions.create(
        model="beam_search",                      # or "beam_search:16x4": budget 16, width 4
        messages=[{"role": "user", "content": "Compute ((12+7)*3)-5."}],
        seed=0, temperature=0.8, n=1,
        extra_body={"budget": 16, "beam_width": 4})

Everything here is pure (no I/O): :func:`parse_request` turns a JSON body into a
:class:`SearchRequest` (a checked :class:`~sgl_tts.experiment.RunConfig` plus the response's shape)
or raises :class:`APIError`, which carries the HTTP status and OpenAI's error object.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from sgl_tts import registry
from sgl_tts.experiment import RunConfig, RunError
from sgl_tts.search import STEP_DELIMITER
from sgl_tts.search.options import (DEFAULT_AGGREGATION, DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, DEFAULT_MAX_TOKENS,
                                    DEFAULT_STEP_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_WIDTH)

# Extra body fields: the search's settings (RunConfig's names; ``budget`` is RunConfig.n, the beams,
# samples or rollouts, so that it cannot be confused with OpenAI's ``n``, the number of choices).
SEARCH_FIELDS: dict[str, str] = {
    "budget": "n", "beam_width": "beam_width", "max_depth": "max_depth", "step_tokens": "step_tokens",
    "aggregation": "aggregation", "speculative": "speculative",
    "overlap_verification": "overlap_verification", "overlap_by_family": "overlap_by_family",
    **{k: k for k in registry.setting_fields()}}   # every program's own settings (its options')
# OpenAI fields read (the others of the API are refused by name rather than silently ignored)
OPENAI_FIELDS = ("model", "messages", "n", "temperature", "seed", "stream", "stream_options", "max_tokens",
                 "max_completion_tokens", "user", "metadata")
# programs a request may name, with what a model-name suffix "name:B" or "name:BxW" sets
MODEL_RE = re.compile(r"^(?P<program>[a-z_]+)(?::(?P<budget>\d+)(?:x(?P<width>\d+))?)?$")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (``sgl-tts serve-search`` flags).

    Attributes:
        max_budget: most beams, samples or rollouts per search.
        max_depth: most steps per tree search.
        max_step_tokens: most tokens per step (and per best-of-N sample).
        max_choices: most choices (OpenAI ``n``) per response.
    """

    max_budget: int = 64
    max_depth: int = 40
    max_step_tokens: int = 512
    max_choices: int = 16


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The settings a request gets for what it leaves out (``RunConfig``'s names)."""

    n: int = DEFAULT_BUDGET
    beam_width: int = DEFAULT_WIDTH
    max_depth: int = DEFAULT_MAX_DEPTH
    step_tokens: tuple[int, ...] = (DEFAULT_STEP_TOKENS,)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    aggregation: str = DEFAULT_AGGREGATION
    seed: int = 0
    delimiter: str = STEP_DELIMITER


class APIError(Exception):
    """A request the server refuses: the HTTP status and the body of OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class SearchRequest:
    """One chat-completions request, read and checked.

    Attributes:
        model: the ``model`` as the client sent it (echoed in the response).
        config: the search's settings (program, budget, width, temperature, seed, ...), validated.
        question: the text the program answers (see :func:`question_of`).
        choices: how many choices the response holds at most (OpenAI ``n``).
        stream: answer as server-sent events (progress, then the answer).
        include_usage: a streamed response ends with a ``usage`` chunk (``stream_options``).
    """

    model: str
    config: RunConfig
    question: str
    choices: int = 1
    stream: bool = False
    include_usage: bool = False


def _bad(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> APIError:
    return APIError(status, message, param=param, code=code)


def _int(body: Mapping[str, Any], name: str, low: int = 1, high: int | None = None,
         where: str | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {value!r}", name)
    if value < low:
        raise _bad(f"'{name}' must be at least {low}, got {value}", name)
    if high is not None and value > high:
        raise _bad(f"'{name}' = {value} is over this server's limit of {high}{where or ''}", name,
                   code="limit_exceeded")
    return value


def question_of(messages: Any) -> str:
    """The question a program answers: the conversation's message contents in order, joined by a
    blank line (one user message: its content alone). Roles are not rendered: the programs send
    ``question + delimiter`` as their prompt, as ``sgl-tts run`` does with a dataset's question."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}] has role {role!r}; use system, developer, user or assistant "
                       f"(tool messages are not supported)", "messages")
        if isinstance(content, list):    # content parts: only text
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}] has a content part that is not text; only text is supported",
                               "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}] has no text content", "messages")
        parts.append(content)
    if messages[-1].get("role") != "user":
        raise _bad("the last message must be the user's question", "messages")
    question = "\n\n".join(p for p in parts if p)
    if not question.strip():
        raise _bad("the messages hold no text to answer", "messages")
    return question


def parse_request(body: Any, limits: Limits = Limits(), defaults: Defaults = Defaults()) -> SearchRequest:
    """A chat-completions body read into a :class:`SearchRequest`, or :class:`APIError` naming the
    first thing wrong (404 for an unknown program, as OpenAI answers an unknown model)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in OPENAI_FIELDS and k not in SEARCH_FIELDS)
    if unknown:
        raise _bad(f"unsupported field {unknown[0]!r}; this server reads {', '.join(OPENAI_FIELDS)} and the "
                   f"search settings {', '.join(SEARCH_FIELDS)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required: a program name, e.g. beam_search or beam_search:16x4", "model")
    m = MODEL_RE.match(model)
    if m is None or m["program"] not in registry.names():
        raise _bad(f"unknown model {model!r}; the models are the programs {', '.join(registry.names())}, optionally "
                   f"with ':BUDGET' or ':BUDGETxWIDTH' (e.g. beam_search:16x4)", "model", 404, "model_not_found")
    question = question_of(body.get("messages"))

    settings: dict[str, Any] = dict(program=m["program"], n=defaults.n, beam_width=defaults.beam_width,
                                    max_depth=defaults.max_depth, step_tokens=list(defaults.step_tokens),
                                    max_tokens=defaults.max_tokens, temperature=defaults.temperature,
                                    aggregation=defaults.aggregation, seed=defaults.seed,
                                    delimiter=defaults.delimiter, progress=False)
    for suffix, field, name in ((m["budget"], "n", "budget"), (m["width"], "beam_width", "beam_width")):
        if suffix is not None:
            if body.get(name) is not None and body[name] != int(suffix):
                raise _bad(f"model {model!r} sets {name} {int(suffix)} but the body sets {body[name]!r}", name)
            settings[field] = int(suffix)
    for name, field in SEARCH_FIELDS.items():
        if body.get(name) is not None:
            settings[field] = body[name]
    # check the budget against this server's limits before the program's own checks
    budget = _int({"budget": settings["n"]}, "budget", 1, limits.max_budget, " (--max-budget)")
    _int({"beam_width": settings["beam_width"]}, "beam_width", 1, limits.max_budget, " (--max-budget)")
    _int({"max_depth": settings["max_depth"]}, "max_depth", 1, limits.max_depth, " (--max-depth)")
    settings["step_tokens"] = _step_tokens(settings["step_tokens"], limits)

    max_tokens = _int(body, "max_completion_tokens", 1, limits.max_step_tokens, " (--max-step-tokens)")
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1, limits.max_step_tokens,
                                                               " (--max-step-tokens)")
    if max_tokens is not None:
        if registry.program(settings["program"]).budget != "samples":
            raise _bad(f"'max_tokens' limits a best-of-N sample; {settings['program']} generates step by step: "
                       f"set 'step_tokens' and 'max_depth' instead", "max_tokens")
        settings["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise _bad(f"'temperature' must be a number from 0 to 2, got {temperature!r}", "temperature")
        settings["temperature"] = float(temperature)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _bad(f"'seed' must be an integer, got {seed!r}", "seed")
        settings["seed"] = seed
    choices = _int(body, "n", 1, min(limits.max_choices, budget), " (the search's budget or --max-choices)") or 1
    stream, include_usage = _streaming(body)
    try:
        cfg = RunConfig(**settings)
        cfg.validate()
    except TypeError as exc:
        raise _bad(f"bad search settings: {exc}") from exc
    except RunError as exc:
        raise _bad(str(exc)) from exc
    return SearchRequest(model=model, config=cfg, question=question, choices=choices, stream=stream,
                         include_usage=include_usage)


def _step_tokens(value: Any, limits: Limits) -> list[int]:
    """'step_tokens' as a list of positive ints within this server's limit (one int is a list of one)."""
    steps = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(steps, list) or not steps or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                                       for x in steps):
        raise _bad(f"'step_tokens' must be a positive integer or a list of them, got {value!r}", "step_tokens")
    if max(steps) > limits.max_step_tokens:
        raise _bad(f"'step_tokens' = {max(steps)} is over this server's limit of {limits.max_step_tokens} "
                   f"(--max-step-tokens)", "step_tokens", code="limit_exceeded")
    return steps


def _streaming(body: Mapping) -> tuple[bool, bool]:
    """'stream' and 'stream_options' read: whether to stream, and whether to end with a usage chunk."""
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise _bad("'stream_options' may only hold include_usage", "stream_options")
    if options and not stream:
        raise _bad("'stream_options' needs stream: true", "stream_options")
    return stream, bool(options.get("include_usage", False))


__all__ = ["APIError", "Defaults", "Limits", "OPENAI_FIELDS", "SEARCH_FIELDS", "SearchRequest", "parse_request",
           "question_of"]
