"""What a PRM reads: the prompt, then every step followed by the step tag, and where the tags sit
in its tokens. Both scorers (:mod:`sgl_tts.prm.scorers`) and the tiny PRM's training read this one
format."""

from __future__ import annotations

from typing import Callable, Sequence

STEP_TAG = "\n\n"


def default_prompt(question: str) -> str:
    """The project's prompt format: the question, then a blank line."""
    return question + "\n\n"


def prm_input(question: str, steps: Sequence[str], *, tag: str = STEP_TAG,
              prompt: Callable[[str], str] = default_prompt) -> str:
    """The text a step-tag PRM reads: the prompt, then every step followed by ``tag``."""
    return prompt(question) + "".join(s + tag for s in steps)


def tag_positions(tokenizer, question: str, steps: Sequence[str], *, tag: str = STEP_TAG,
                  prompt: Callable[[str], str] = default_prompt) -> tuple[list[int], list[int]]:
    """Token ids of the PRM input (prompt, then every step followed by ``tag``) and the positions of
    the tag tokens, one per step. The tag must be a single token and must not occur inside a step."""
    for st in steps:
        if tag in st or st != st.strip("\n"):
            raise ValueError(f"a step must not contain the step tag or start/end with a newline: {st!r}")
    head = prompt(question)
    ids = tokenizer.encode(prm_input(question, steps, tag=tag, prompt=prompt))
    tag_ids = tokenizer.encode(tag)
    if len(tag_ids) != 1:
        raise ValueError(f"the step tag {tag!r} must be a single token for this tokenizer, got {tag_ids}")
    start = len(tokenizer.encode(head))
    pos = [i for i in range(start, len(ids)) if ids[i] == tag_ids[0]]
    if len(pos) != len(steps):
        raise ValueError(f"expected {len(steps)} step tags, found {len(pos)}")
    return ids, pos


def tag_work(tokenizer, question: str, work: list[tuple[list[str], int]], *, tag: str,
             prompt: Callable[[str], str]) -> tuple[list[list[float]], list[tuple[int, list[int], list[int]]]]:
    """Token ids and the tag positions still to score for each ``(steps, start)`` of a scorer's
    work: ``(out, [(work index, ids, positions from start)])``. A trajectory that cannot be tagged
    (a step holding the tag) gets 0.0 for every step in ``out`` rather than failing the batch."""
    out: list[list[float]] = [[] for _ in work]
    tagged = []
    for w, (steps, start) in enumerate(work):
        try:
            ids, pos = tag_positions(tokenizer, question, steps, tag=tag, prompt=prompt)
        except ValueError:
            out[w] = [0.0] * (len(steps) - start)
            continue
        tagged.append((w, ids, pos[start:]))
    return out, tagged


__all__ = ["STEP_TAG", "default_prompt", "prm_input", "tag_positions", "tag_work"]
