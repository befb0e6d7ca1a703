"""Group abort: one ``/abort_request`` with a search group's rid prefix aborts all of its requests.

SGLang 0.5.15's ``Scheduler.abort_request`` already matches by prefix: one ``AbortReq(rid=p)`` pops
every waiting request whose rid starts with ``p`` (answering each with its own ``AbortReq(rid)`` to
the tokenizer manager), marks every running one ``to_finish = FINISH_ABORT()`` (it finishes at its
next step and is answered with ``finish_reason`` abort through the normal output path, KV freed),
and does the same for the chunked-prefill request, the grammar queue and the disaggregation queues.
What stops a prefix from getting there is the tokenizer manager: its ``abort_request`` drops an
abort whose rid is not itself a live request (``rid not in self.rid_to_state``).

The plugin's hook on ``TokenizerManager.abort_request`` therefore sends an abort of a ``tts/<group>/``
prefix to the scheduler as it is, **once**, when at least one request of the group is live there:
the scheduler scans each of its queues once for the whole group, and every request of the group
still gets its own answer from the scheduler, which also removes its tokenizer-side state. (The
first version sent one ``AbortReq`` per live request, each scanning every queue: O(group x queue)
string matches in one scheduler iteration; ``SGLANG_TTS_GROUP_ABORT=per-request`` in the server's
environment brings that path back, for benchmarks: ``benchmarks/group_abort.py``.)

With several tokenizer workers (``--tokenizer-worker-num``) each holds only its own requests' states;
the prefix is sent to the scheduler whatever this worker holds (as SGLang sends any rid there), so
the group's requests of every worker are aborted and each answer goes to its own worker. A request
whose state exists but which is still being tokenized when the abort arrives is not aborted (it
reaches the scheduler after the abort and runs to its end), as with SGLang's own abort of one rid.

Other aborts (a plain rid, ``abort_all``) are SGLang's own.
"""

from __future__ import annotations

import os

from sgl_tts.protocol import GROUP_PREFIX, group_prefix, is_group_prefix  # the rid scheme's home

MODE_ENV = "SGLANG_TTS_GROUP_ABORT"   # "per-request": the old path (benchmarks); anything else: one AbortReq


def abort_request(original, self, rid: str = "", abort_all: bool = False, *args, **kwargs):
    """AROUND hook on ``TokenizerManager.abort_request``: a ``tts/<group>/`` prefix (or a deeper one
    ending in ``/``) reaches the scheduler as one ``AbortReq``; anything else is SGLang's own abort."""
    if abort_all or not is_group_prefix(rid):
        return original(self, rid, abort_all, *args, **kwargs)
    # the tokenizer manager's event loop is the only writer of rid_to_state; list() copies the keys
    # in one step anyway
    live = [r for r in list(self.rid_to_state) if r.startswith(rid)]
    dispatch = getattr(self, "_dispatch_to_scheduler", None)
    if os.environ.get(MODE_ENV) == "per-request" or dispatch is None:
        for one in live:
            original(self, one, False, *args, **kwargs)
        return None
    if not live and getattr(self.server_args, "tokenizer_worker_num", 1) == 1:
        return None   # nothing of the group is live: dropped, as SGLang drops an unknown rid
    from sglang.srt.managers.io_struct import AbortReq

    dispatch(AbortReq(rid=rid))
    if getattr(self, "enable_metrics", False):   # SGLang counts one abort per aborted request
        for _ in live:
            self.metrics_collector.observe_one_aborted_request(self.metrics_collector.labels)
    return None


__all__ = ["GROUP_PREFIX", "MODE_ENV", "abort_request", "group_prefix", "is_group_prefix"]
