"""The asynchronous sparse choice in a process of its own (``--tts-sparse-worker process``, the default):
seed 003's cache rank beside the scheduler's inference rank.

Why a process: a worker *thread* shares the scheduler's interpreter lock. The forward pass is hundreds
of small torch calls per step, each releasing and retaking the lock, and the worker's own calls do the
same, so each waits on the other at every call: on the CPU server (2 cores, tiny generator, 1 row of
2k) a job that takes 2 ms alone took 10 ms in the server and the step grew by 6-9 ms. A process has
its own interpreter; the two share only memory.

What is shared and what is sent:

- The key pools of the sparse layers are moved into shared memory once (:func:`share_key_pools`, in
  place: SGLang's tensors keep their identity; the pool's pointer tables are rebuilt) and handed to
  the process when it starts; it reads the keys the scheduler writes, no copy per step.
- So is the server's ``req_to_token`` (:class:`CacheRank` moves it in place): the process reads the
  rows' contexts' pool slots there, so a job carries none.
- Each job goes over a pipe as numpy arrays: the layers, the rows' slots and epochs, lengths, their
  recent queries (:class:`~sgl_tts.plugin.attention.sparse_async.QueryHistory` columns) and how many are real,
  plus the rotary table when it changed. Each answer comes back the same way
  (:func:`~sgl_tts.plugin.attention.sparse_async.choose`'s, :func:`answer_of` on the scheduler's side): the
  chosen tokens as flat pool rows (layer-major) and each row's count, positions and predicted
  queries under measure, the seconds the choice took, and how many waiting jobs it superseded.
- Two one-way pipes. In the process a thread takes every job as it arrives, so the scheduler's send
  never waits on a choice in progress, and the scheduler hands no job while two steps' worth are unanswered
  (:attr:`CacheRank.MAX_OUTSTANDING_STEPS`): the pipe never fills. (One duplex pipe, each side writing
  while the other wrote, deadlocked a server at 16k context.) The scheduler reads answers without
  waiting (:meth:`CacheRank.answers`: ``poll`` with no timeout at a sparse layer's decode); a job
  newer than one still waiting supersedes it in the process. A closed pipe ends the process (the
  scheduler exited, however it exited).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)


def share_key_pools(kv_pool: Any, layers: list[int]) -> dict[int, "torch.Tensor"]:  # noqa: F821
    """Move the key buffers of ``layers`` of SGLang's KV pool into shared memory (in place) and return
    each layer's key tensor as the attention backend reads it (``get_key_buffer``).

    The pool's attributes are SGLang 0.5.15's ``MHATokenToKVPool``'s, by name
    (:data:`~sgl_tts.plugin.internals.INTERNALS`): a pool that lacks one is refused before anything
    moves (:class:`~sgl_tts.plugin.internals.MissingInternals`), never moved with its pointer tables
    left on the freed buffers."""
    import torch

    from sgl_tts.plugin import internals

    internals.check_object(kv_pool, internals.SPARSE_PROCESS)
    moved = False
    for layer in layers:
        buf = kv_pool.k_buffer[layer - kv_pool.start_layer]
        if not buf.is_shared():
            buf.share_memory_()
            moved = True
    if moved:   # SGLang's pointer tables (copy kernels) follow the move
        kv_pool.k_data_ptrs = torch.tensor([x.data_ptr() for x in kv_pool.k_buffer], dtype=torch.uint64,
                                           device=kv_pool.k_data_ptrs.device)
        kv_pool.data_ptrs = torch.cat([kv_pool.k_data_ptrs, kv_pool.v_data_ptrs], dim=0)
    return {layer: kv_pool.get_key_buffer(layer) for layer in layers}


#: bytes a pipe of the cache rank holds (Linux's limit for an unprivileged process, 1 MiB by default): a
#: job (a step's recent queries, 70 KB on the tiny generator) or an answer is written in one go instead of
#: in the default 64 KiB pieces, each waiting for the other side to read the last (measured in process:
#: 0.5 ms of a 12 ms step went to one job's write)
PIPE_BYTES = 1 << 20


def widen_pipe(fd: int, size: int = PIPE_BYTES) -> int:
    """Grow pipe ``fd``'s buffer to ``size`` bytes, or as near as the system allows; returns its size
    (unchanged where the system has no such setting)."""
    import fcntl

    setsz, getsz = getattr(fcntl, "F_SETPIPE_SZ", 1031), getattr(fcntl, "F_GETPIPE_SZ", 1032)
    try:
        return fcntl.fcntl(fd, setsz, size)
    except OSError:
        try:
            with open("/proc/sys/fs/pipe-max-size") as f:
                return fcntl.fcntl(fd, setsz, min(size, int(f.read())))
        except (OSError, ValueError):
            return fcntl.fcntl(fd, getsz) if hasattr(fcntl, "F_GETPIPE_SZ") else 0


def _array(t: "torch.Tensor") -> "numpy.ndarray":  # noqa: F821
    import torch

    return (t if t.dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool)
            else t.float()).numpy()


class CacheRank:
    """The worker process and the scheduler's end of its pipe.

    ``k_caches``: each sparse layer's key tensor, in shared memory (:func:`share_key_pools`, or any
    CPU tensor after ``share_memory_()``); ``req_to_token``: the server's request table (moved into
    shared memory in place if it is not there); ``settings``: the
    :class:`~sgl_tts.plugin.settings.SparseSettings`. The constructor returns once the process is
    ready (:attr:`ready_seconds`), or raises ``RuntimeError`` (the process stopped) when it did not
    start within ``ready_timeout`` seconds or exited first."""

    #: steps' worth of jobs handed but not answered beyond which a step hands none (the process is
    #: behind, and newer jobs would supersede the older ones anyway): the pipe never fills, so a send
    #: never waits. A step hands one job (its first step a job per sparse layer).
    MAX_OUTSTANDING_STEPS = 2

    def __init__(self, settings: Any, k_caches: dict[int, "torch.Tensor"], req_to_token: "torch.Tensor",  # noqa: F821
                 ready_timeout: float = 120.0):
        import torch.multiprocessing  # noqa: F401 - registers the shared-tensor pickling the start uses

        if not req_to_token.is_shared():
            req_to_token.share_memory_()

        ctx = multiprocessing.get_context("spawn")   # the scheduler has threads: never fork it
        jobs_out, self.jobs = ctx.Pipe(duplex=False)          # (reader, writer): scheduler -> process
        self.answers_in, answers_out = ctx.Pipe(duplex=False)  # process -> scheduler
        for end in (self.jobs, answers_out):
            widen_pipe(end.fileno())
        self.process = ctx.Process(target=serve, args=(jobs_out, answers_out, settings.to_json(), k_caches, req_to_token),
                                   daemon=True, name="sgl-tts-cache-rank")
        self.process.start()
        jobs_out.close()
        answers_out.close()
        self._rotary_sent: Optional[tuple] = None
        self.given = self.finished = 0
        self._most = self.MAX_OUTSTANDING_STEPS * max(1, len(k_caches))
        try:
            self.ready_seconds = self._await_ready(ready_timeout)
        except RuntimeError:
            self.close()
            raise

    def _await_ready(self, timeout: float) -> float:
        """Wait for the process to say it is ready (its imports done, the shared tensors mapped); the
        seconds that took. Until then its jobs would only pile up: a server whose first requests come
        within the process's start-up (seconds on a loaded machine) would serve them without a single
        selection."""
        t0 = time.monotonic()
        if not self.answers_in.poll(timeout):
            raise RuntimeError(f"the sparse cache rank process did not start within {timeout:.0f} s")
        try:
            self.answers_in.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the sparse cache rank process exited while starting (code "
                               f"{self.process.exitcode})") from None
        return time.monotonic() - t0

    @property
    def owes(self) -> bool:
        """Answers are still owed (some may have arrived)."""
        return self.finished < self.given

    @property
    def behind(self) -> bool:
        """The process has :attr:`MAX_OUTSTANDING_STEPS` steps' worth of jobs unanswered (a job per
        sparse layer: the first step's count)."""
        return self.given - self.finished >= self._most

    def submit(self, job: Any) -> None:
        """Hand one job to the process: a :class:`~sgl_tts.plugin.attention.sparse_async.Job` (its key pools go by
        layer id; its request table is the one the process was started with)."""
        msg: dict[str, Any] = {"layers": list(job.layers), "slots": list(job.slots), "epochs": list(job.epochs),
                               "lengths": _array(job.lengths), "ring": _array(job.ring),
                               "available": _array(job.available), "scale": job.scale, "rotary": None}
        rotary = job.rotary
        if rotary is not None:
            key = (rotary.cos_sin.data_ptr(), tuple(rotary.cos_sin.shape), rotary.rotary_dim, rotary.neox)
            if key != self._rotary_sent:
                msg["rotary"] = (_array(rotary.cos_sin), rotary.rotary_dim, rotary.neox)
                self._rotary_sent = key
            msg["rotated"] = True
        self.jobs.send(msg)
        self.given += 1

    def answers(self, wait: bool = False) -> Iterator[dict]:
        """The answers that have arrived (none waited for), or with ``wait`` every answer still owed."""
        while self.finished < self.given and (wait or self.answers_in.poll()):
            try:
                answer = self.answers_in.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"the sparse cache rank process exited (code {self.process.exitcode})") from None
            self.finished += 1 + answer["superseded"]
            yield answer

    def close(self) -> None:
        try:
            self.jobs.close()
            self.answers_in.close()
        finally:
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()


def serve(jobs, answers, settings_json: str, k_caches: dict, req_to_token) -> None:
    """The process: a thread takes every job as it arrives (so the scheduler's send never waits on a
    choice in progress); the main thread answers the newest job of each set of layers waiting."""
    import threading

    import torch

    from sgl_tts.plugin.attention import sparse_decoding as sd
    from sgl_tts.plugin.settings import SparseSettings

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    s = SparseSettings.from_json(settings_json)
    try:
        answers.send({"ready": True})        # CacheRank waits for this before the server goes on
    except (EOFError, OSError):
        return
    inbox: list = []
    arrived = threading.Condition()
    closed = []

    def receive() -> None:
        while True:
            try:
                msg = jobs.recv()
            except (EOFError, OSError):   # the scheduler is gone (its end closed)
                msg = None
            with arrived:
                if msg is None:
                    closed.append(True)
                else:
                    inbox.append(msg)
                arrived.notify()
            if msg is None:
                return

    threading.Thread(target=receive, name="sgl-tts-cache-rank-inbox", daemon=True).start()
    rotary = None
    mirror = sd.KeyMirror()
    while True:
        with arrived:
            arrived.wait_for(lambda: inbox or closed)
            if closed and not inbox:
                return
            batch = inbox[:]
            inbox.clear()
        newest: dict[tuple, dict] = {}
        superseded: dict[tuple, int] = {}
        for msg in batch:
            if msg["rotary"] is not None:
                table, dim, neox = msg["rotary"]
                rotary = sd.Rotary(torch.from_numpy(table), dim, neox)
            key = tuple(msg["layers"])
            if key in newest:
                superseded[key] = superseded.get(key, 0) + 1
            newest[key] = msg
        for key, msg in newest.items():
            try:
                answers.send(_answer(msg, superseded.get(key, 0), s, k_caches, req_to_token, rotary, mirror))
            except (EOFError, OSError):
                return


def _answer(msg: dict, superseded: int, s: Any, k_caches: dict, req_to_token: Any, rotary: Any,
            mirror: Any = None) -> dict:
    """One job's answer: :func:`~sgl_tts.plugin.attention.sparse_async.choose` on its arrays (the keys from
    ``mirror``, a :class:`~sgl_tts.plugin.attention.sparse_decoding.KeyMirror`, if given), as numpy arrays, or the
    error that stopped it (its rows then stay dense)."""
    import torch

    from sgl_tts.plugin.attention.sparse_async import choose

    t0 = time.perf_counter()
    answer = {"layers": msg["layers"], "slots": msg["slots"], "epochs": msg["epochs"], "lengths": msg["lengths"],
              "superseded": superseded, "error": None}
    try:
        got = choose(s, msg["layers"], msg["slots"], msg["epochs"], torch.from_numpy(msg["lengths"]),
                     torch.from_numpy(msg["ring"]), torch.from_numpy(msg["available"]), msg["scale"],
                     [k_caches[layer] for layer in msg["layers"]], req_to_token,
                     rotary if msg.get("rotated") else None, mirror)
        answer.update(rows=got.rows.numpy(), counts=got.counts,
                      positions=None if got.positions is None else got.positions.to(torch.int32).numpy(),
                      mask=None if got.mask is None else got.mask.numpy(),
                      query=None if got.query is None else got.query.numpy())
    except Exception as exc:  # noqa: BLE001 - a failed choice leaves rows dense, never the server down
        answer["error"] = f"{type(exc).__name__}: {exc}"
    answer["seconds"] = time.perf_counter() - t0
    return answer


def answer_of(a: dict) -> Any:
    """The scheduler's side of :func:`_answer`: an :class:`~sgl_tts.plugin.attention.sparse_async.Answer`."""
    import torch

    from sgl_tts.plugin.attention.sparse_async import Answer

    def tensor(x):
        return None if x is None else torch.from_numpy(x)

    positions = tensor(a["positions"])
    return Answer(a["layers"], a["slots"], a["epochs"], [int(n) for n in a["lengths"]], tensor(a["rows"]),
                  a["counts"], None if positions is None else positions.long(), tensor(a["mask"]),
                  tensor(a["query"]), a["seconds"])


__all__ = ["CacheRank", "PIPE_BYTES", "answer_of", "serve", "share_key_pools", "widen_pipe"]
