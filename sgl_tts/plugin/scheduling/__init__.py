"""The plugin's scheduling part: what the scheduler runs and in which order, and what it reports.

``ordering`` (the trie walk), ``policy`` (prefix-aware order, deferral, classes), ``residency`` (the
``locality`` policy: what the radix cache keeps), ``preemption`` (speculative requests stopped and
retracted first), ``reclass`` (class changes), ``abort`` (group abort), ``seeding`` (seeded
sampling), and what observes it: ``observer`` (the observation hooks every mode registers) and
``metrics`` (JSONL and Prometheus). The hooks are registered by :mod:`sgl_tts.plugin`; nothing here
imports torch or SGLang on import.
"""
