"""Reading a served model without generating, for PRMs: the next-token log-probabilities at chosen
positions of each input (a step-tag PRM, :class:`~sgl_tts.prm.StepTagPRM`) and a classifier /
reward head's output at each input's last token (:class:`~sgl_tts.prm.RewardHeadPRM`), and a step-pooled
PRM's output at every step token (:class:`~sgl_tts.prm.StepPooledPRM`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence


class ServerScoring:
    """PRM reads of the model served at ``base_url``.

    ``post(path, payload) -> answer`` sends each batched request (the owner's, so that a metering
    subclass sees these requests too); ``model_info`` is the server's ``/get_model_info`` answer,
    where the tokenizer's path is read when ``tokenizer_path`` is not given.
    """

    def __init__(self, post: Callable[[str, dict[str, Any]], Any], base_url: str, *,
                 tokenizer_path: str | None = None, model_info: dict[str, Any] | None = None):
        self.post, self.base_url = post, base_url
        self.tokenizer_path, self.model_info = tokenizer_path, model_info or {}
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The served model's Hugging Face tokenizer (``tokenizer_path``, else the path the server
        reports), loaded once; token positions for PRM reads are computed with it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            info = self.model_info
            path = self.tokenizer_path or info.get("tokenizer_path") or info.get("model_path")
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(
                    f"cannot load the tokenizer of the model served at {self.base_url} from {path!r} "
                    f"({exc}); pass SGLangEndpoint(..., tokenizer_path=PATH)") from exc
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the server tokenizes a ``/generate`` prompt."""
        return self.tokenizer.encode(text)

    def next_token_logprobs(self, prompts: Sequence[str | Sequence[int]],
                            positions: Sequence[Sequence[int]],
                            token_ids: Sequence[int]) -> list[list[list[float]]]:
        """log P(next token = t | prompt[: p + 1]) for every prompt, position p and id t, like
        :meth:`LocalBackend.next_token_logprobs`, from one batched ``/generate`` with
        ``max_new_tokens: 0``, ``return_logprob``, ``logprob_start_len`` and ``token_ids_logprob``.

        SGLang 0.5.15 reports input logprobs per input token: entry k of ``input_token_ids_logprobs``
        is the distribution of the token at ``logprob_start_len + k``, read at the position before it
        (entry 0 is None), and the distribution after the last input token is dropped. So the
        distribution after position p is entry ``p + 1 - logprob_start_len``, and one padding token
        is appended to each prompt so that its last position is covered too.
        """
        if len(prompts) != len(positions):
            raise ValueError("prompts and positions must have the same length")
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        batch, starts, wanted = [], [], []
        for prompt, pos in zip(prompts, positions):
            ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            pos = [p + len(ids) if p < 0 else p for p in pos]
            if any(not 0 <= p < len(ids) for p in pos):
                raise ValueError(f"positions {list(pos)} out of range for a prompt of {len(ids)} tokens")
            batch.append(ids + [pad])
            starts.append(min(pos) if pos else len(ids) - 1)
            wanted.append(pos)
        if not batch:
            return []
        ids_list = [int(t) for t in token_ids]
        obj = self.post("/generate", {
            "input_ids": batch, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": [True] * len(batch), "logprob_start_len": starts,
            "token_ids_logprob": [ids_list] * len(batch)})
        results = obj if isinstance(obj, list) else [obj]
        out = []
        for res, start, pos in zip(results, starts, wanted):
            entries = res["meta_info"]["input_token_ids_logprobs"]
            rows = []
            for p in pos:
                got = {int(e[1]): float(e[0]) for e in entries[p + 1 - start]}
                rows.append([got[t] for t in ids_list])
            out.append(rows)
        return out

    def classify(self, inputs: Sequence[str | Sequence[int]]) -> list[list[float]]:
        """The served reward / classifier head's output at the last token of every input, one batched
        ``/classify`` request (SGLang pools the last token and applies no softmax)."""
        if not inputs:
            return []
        if all(isinstance(x, str) for x in inputs):
            payload: dict[str, Any] = {"text": list(inputs)}
        else:
            payload = {"input_ids": [self.encode(x) if isinstance(x, str) else [int(t) for t in x]
                                     for x in inputs]}
        return self._classify(payload, len(inputs), lambda e: [float(v) for v in (e if isinstance(e, list) else [e])],
                              "without an embedding per input", "a reward / classifier-head model")

    def step_rows(self, inputs: Sequence[Sequence[int]]) -> list[list[list[float]]]:
        """A step-pooled PRM's rows (:class:`~sgl_tts.prm.StepPooledPRM`): per input, the head's output
        at each step token the server computed, from one batched ``/classify`` request."""
        if not inputs:
            return []
        return self._classify({"input_ids": [[int(t) for t in x] for x in inputs]}, len(inputs),
                              lambda e: [[float(v) for v in row] for row in e], "no rows of step scores",
                              "a step-pooled PRM (Qwen2ForProcessRewardModel, Qwen2ForPrmModel)")

    def _classify(self, payload: dict[str, Any], count: int, convert: Callable[[Any], Any], missing: str,
                  model: str) -> list:
        """One ``/classify`` request: each answer's embedding through ``convert``, ``count`` of them."""
        res = self.post("/classify", payload)
        answers = res if isinstance(res, list) else [res]
        try:
            out = [convert(a["embedding"]) for a in answers]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{self.base_url}/classify answered {missing} ({exc}); "
                             f"is the server running {model}?") from exc
        if len(out) != count:
            raise ValueError(f"{self.base_url}/classify answered {len(out)} rows for {count} inputs")
        return out


__all__ = ["ServerScoring"]
