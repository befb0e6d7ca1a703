"""The plugin's attention part: the CPU attention backends that take the place of SGLang's
``torch_native`` one (``--tts-cpu-attention ragged``, ``--tts-sparse-attention``).

``backend_choice`` (the hook that chooses the backend, above both), ``cpu_attention`` (the ragged
backend), ``sparse_attention`` (the sparse backend on the ragged one: ``SparseDecoder``) with its
parts: ``sparse_decoding`` (seed 003's math), ``sparse_async`` (the asynchronous side's jobs and
answers), ``sparse_worker`` (the cache rank as a process), ``sparse_counters`` and ``sparse_payoff``.
torch and SGLang are imported on first use, so the plugin package loads neither in the launcher.
"""
