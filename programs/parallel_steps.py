"""Sample one reasoning step on many forks, then pick a continuation: the smallest TTS-shaped program.

It is what the demo runs: ``fork`` to expand, ``gen`` a step per branch (each with its own seed, so a
run is reproducible), ``join`` to gather, and ``select`` to choose among candidate answers by
likelihood.
"""

from __future__ import annotations

import sglang as sgl

import sgl_tts


@sgl.function
def parallel_steps(s, question: str, width: int = 8, step_tokens: int = 32, seed: int = 0,
                   choices: tuple[str, ...] = ("yes", "no")):
    """Fork ``width`` branches after ``question``, sample one step (stop at a blank line) in each,
    then select an answer among ``choices`` after the question."""
    s += question + "\n\n"
    branches = s.fork(width)
    branches += lambda i: sgl_tts.gen("step", max_tokens=step_tokens, stop="\n\n", temperature=0.8,
                                      seed=seed + i, custom_params={"branch": i})
    branches.join()
    s["step_meta"] = [b.get_meta_info("step") for b in branches]
    s += "Answer: " + sgl.select("answer", choices=list(choices))
