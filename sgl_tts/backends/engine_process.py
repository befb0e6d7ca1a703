"""A :class:`~sgl_tts.backends.engine.BatchEngine` in a process of its own.

In the caller's process the engine thread shares one interpreter lock with every thread of the
caller: with many searches in flight (hundreds of fork threads) each torch call of the engine waits
to get the lock back, and the same decode step took 62 ms instead of 46 ms (2-core CPU, 128
concurrent MCTS searches). :class:`EngineProcess` runs the model and its engine in a child process
(a fresh interpreter running :func:`main` that never runs the caller's
main module) and keeps :class:`~sgl_tts.backends.engine.BatchEngine`'s interface: ``submit`` returns a
future that a reader thread resolves when the child's result arrives. Requests are checked here, before
they are sent, so a bad one fails at once with the same message as in the caller's process.

Nothing polls: the child's main thread blocks on the pipe, its engine blocks on its queue, and the
caller's reader thread blocks on the pipe too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Sequence

from sgl_tts.backends import engine_zygote
from sgl_tts.backends.engine import EngineStats
from sgl_tts.backends.semantics import LogprobSpec, SamplingSpec, UnsupportedFeatureError, check_request

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
READY_TIMEOUT_S = 600.0
CHILD_COMMAND = "import sys; from sgl_tts.backends.engine_process import main; main(sys.argv[1:])"


def check_supported_architecture(config) -> None:
    """Refuse models whose attention the engine's masks would get wrong (sliding windows, hybrid or
    state-space layers): the engine builds full causal masks over a per-layer KV cache."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(cfg, "layer_types", None)
    problem = None
    if layer_types and any(t != "full_attention" for t in layer_types):
        problem = f"layer types {sorted(set(layer_types))}"
    elif getattr(cfg, "use_sliding_window", False):
        problem = "sliding-window attention (use_sliding_window=True)"
    elif getattr(cfg, "model_type", "") in ("mistral", "mixtral"):
        window = getattr(cfg, "sliding_window", None)
        if window is not None and window < getattr(cfg, "max_position_embeddings", 0):
            problem = f"sliding-window attention (sliding_window={window})"
    if problem:
        raise UnsupportedFeatureError(
            f"LocalBackend supports full-attention decoder models only; this model has {problem}. "
            f"Serve it with SGLang and use sgl_tts.connect(url)")


def load_model(path: str | os.PathLike, dtype: str, trust_remote_code: bool = False):
    """The causal LM at ``path`` on the CPU, in eval mode, with the engine's attention."""
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_tts.backends.kv import use_engine_attention

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtypes[dtype], trust_remote_code=trust_remote_code)
    check_supported_architecture(model.config)
    model.to("cpu").eval()
    use_engine_attention(model)
    return model


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build its engine (all picklable)."""

    model_path: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    max_running: int = 256
    prefix_cache_bytes: int = 256 << 20
    gather_window_s: float = 0.004
    seed: int | None = None
    threads: int | None = 1


# Messages, caller -> child: ("submit", key, ids, sampling, logprobs, rid, score_positions, priority,
# logit_processor),
# ("flush",), ("stats", key), ("close",). Child -> caller: ("ready", info), ("failed", error text),
# ("done", key, Completion), ("error", key, exception), ("stats", key, EngineStats).


def _child_main(conn, spec: EngineSpec) -> None:
    """The engine process: load the model, then serve the pipe until it closes."""
    import torch

    from sgl_tts.backends.engine import BatchEngine

    torch.set_grad_enabled(False)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.model_path, trust_remote_code=spec.trust_remote_code)
        model = load_model(spec.model_path, spec.dtype, spec.trust_remote_code)
        engine = BatchEngine(model, tokenizer, max_running=spec.max_running,
                             prefix_cache_bytes=spec.prefix_cache_bytes, seed=spec.seed,
                             gather_window_s=spec.gather_window_s, threads=spec.threads)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which raises it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):  # the caller is gone; the loop below ends too
                pass

    def finished(key: int, fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        if exc is None:
            send(("done", key, fut.result()))
        else:
            send(("error", key, _portable(exc)))

    send(("ready", {"vocab_size": engine.vocab_size, "max_positions": engine.max_positions}))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "submit":
                _, key, ids, sampling, logprobs, rid, score_positions, priority, processor = msg
                try:
                    fut = engine.submit(ids, sampling, logprobs, rid=rid, score_positions=score_positions,
                                        priority=priority, logit_processor=processor)
                except Exception as exc:  # noqa: BLE001 - the caller's future fails with it
                    send(("error", key, _portable(exc)))
                    continue
                fut.add_done_callback(lambda f, key=key: finished(key, f))
            elif kind == "flush":
                engine.flush_prefix_cache()
            elif kind == "stats":
                send(("stats", msg[1], dataclasses.replace(engine.stats)))
            elif kind == "close":
                break
    finally:
        engine.close()
        with lock:
            conn.close()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineProcess:
    """:class:`~sgl_tts.backends.engine.BatchEngine`'s interface, served by a child process.

    The constructor starts the child and returns at once, so that several engines load together;
    the first call that needs the child (:meth:`submit`, :attr:`stats`, :meth:`wait_ready`) waits
    until it has loaded the model and raises its load error, if any. If the child dies, every request
    in flight fails with an error naming its exit code, and so does every later one.
    """

    def __init__(self, spec: EngineSpec):
        if spec.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        self.spec = spec
        self.max_running = spec.max_running
        self.threads = spec.threads
        ours, theirs = socket.socketpair()
        self._process: subprocess.Popen | engine_zygote.ForkedChild
        try:   # forked by the zygote, which has the imports already (engine_zygote's docstring)
            self._process = engine_zygote.start().spawn(theirs.fileno())
        except (OSError, RuntimeError) as exc:
            logger.warning("starting the engine process afresh: the engine zygote failed (%s)", exc)
            self._process = subprocess.Popen(
                [sys.executable, "-c", CHILD_COMMAND, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=engine_zygote.child_environment())
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(spec)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ready_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._keys = itertools.count()
        self._closed = False
        self._failure: str | None = None
        self._info: dict[str, Any] | None = None
        self._reader: threading.Thread | None = None

    def wait_ready(self) -> None:
        """Block until the child has loaded the model; raise RuntimeError with its load error."""
        if self._info is not None:
            return
        with self._ready_lock:
            if self._info is not None:
                return
            if self._failure is not None:
                raise RuntimeError(self._failure)
            path = self.spec.model_path
            if not self._conn.poll(READY_TIMEOUT_S):  # one bounded wait for the child's first message
                self._process.kill()
                self._process.wait()
                self._failure = f"the engine process for {path} did not start within {READY_TIMEOUT_S:.0f} s"
            else:
                try:
                    first = self._conn.recv()
                except (EOFError, OSError):
                    first = ("failed", None)
                if first[0] == "failed":
                    code = self._process.wait()
                    self._failure = (f"the engine process could not load {path}: {first[1]}" if first[1]
                                     else f"the engine process for {path} exited while loading (exit code {code})")
                else:
                    self._reader = threading.Thread(target=self._read, name="sgl-tts-engine-reader",
                                                    daemon=True)
                    self._reader.start()
                    self._info = first[1]
                    return
        raise RuntimeError(self._failure)

    @property
    def vocab_size(self) -> int:
        self.wait_ready()
        return self._info["vocab_size"]

    @property
    def max_positions(self) -> int | None:
        self.wait_ready()
        return self._info["max_positions"]

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    # ----------------------------------------------------------------------------------- public
    def submit(self, input_ids: Sequence[int], sampling: SamplingSpec,
               logprobs: LogprobSpec | None = None, *, rid: str | None = None,
               score_positions: tuple[Sequence[int], Sequence[int]] | None = None,
               priority: int = 0, logit_processor: tuple[str, dict | None] | None = None) -> concurrent.futures.Future:
        """As :meth:`BatchEngine.submit <sgl_tts.backends.engine.BatchEngine.submit>`."""
        self.wait_ready()
        ids, lp, sp = check_request(input_ids, sampling, logprobs, score_positions,
                                    vocab_size=self._info["vocab_size"],
                                    max_positions=self._info["max_positions"])
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_unusable()
            key = next(self._keys)
            self._pending[key] = fut
        self._send(("submit", key, ids, sampling, lp, rid, sp, int(priority), logit_processor))
        return fut

    def generate(self, input_ids: Sequence[int], sampling: SamplingSpec,
                 logprobs: LogprobSpec | None = None, **kw) -> Any:
        """Blocking :meth:`submit`."""
        return self.submit(input_ids, sampling, logprobs, **kw).result()

    def flush_prefix_cache(self) -> None:
        """Drop every cached prefix (takes effect before the engine's next step)."""
        self.wait_ready()
        self._send(("flush",))

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the child engine's counters (one round trip)."""
        self.wait_ready()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_unusable()
            key = next(self._keys)
            self._pending[key] = fut
        self._send(("stats", key))
        return fut.result()

    @property
    def native_thread_id(self) -> None:
        """None: the model runs in another process (its CPU is process :attr:`pid`'s)."""
        return None

    def close(self) -> None:
        """Stop the child; every request not finished yet fails with "the engine was closed"."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._send(("close",))
        except RuntimeError:
            pass
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()
        if self._reader is not None:
            self._reader.join(5)
        self._fail_pending("the engine was closed")

    # ---------------------------------------------------------------------------------- helpers
    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            key = msg[1] if msg[0] in ("submit", "stats") else None
            error = RuntimeError(self._failure or f"the engine process is gone ({exc})")
            with self._lock:
                fut = self._pending.pop(key, None) if key is not None else None
            if fut is not None:
                fut.set_exception(error)
            elif msg[0] != "close":
                raise error from None

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = self._pending.pop(msg[1], None)
            if fut is None:
                continue
            if msg[0] == "error":
                fut.set_exception(msg[2])
            else:
                fut.set_result(msg[2])
        if not self._closed:
            try:
                code = self._process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            with self._lock:
                self._failure = (f"the engine process for {self.spec.model_path} exited "
                                 f"(exit code {code})")
            logger.error("%s", self._failure)
            self._fail_pending(self._failure)

    def _fail_pending(self, text: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(text))


def main(argv: Sequence[str] | None = None) -> None:
    """The child's entry point (:data:`CHILD_COMMAND`, argument FD: a connected socket whose first
    message is the :class:`EngineSpec`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        raise SystemExit("usage: main([FD]) (started by sgl_tts's EngineProcess, not by hand)")
    # Ctrl-C in a terminal reaches the whole process group: the caller handles it and closes the
    # socket (or dies, which closes it too); the child ends on that, without a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(args[0]))
    try:
        spec = conn.recv()
    except EOFError:
        return
    _child_main(conn, spec)


__all__ = ["EngineProcess", "EngineSpec", "check_supported_architecture", "load_model"]
