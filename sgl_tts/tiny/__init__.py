"""The project's own small world: the arithmetic task and the training of its tiny models.

- :mod:`sgl_tts.tiny.task`: seeded problems by level, the fixed test split, the step format, the
  checker, JSONL export;
- :mod:`sgl_tts.tiny.training`: ``sgl-tts train-tiny`` (tokenizer, generator, slip fine-tuning, PRM).

The shipped model folders and the code that builds them stay in :mod:`sgl_tts.models` (their paths
are the package's data).
"""
