"""Launching SGLang: the layer beside the server, under the applications.

- :mod:`sgl_tts.launch.serve`: the one builder of SGLang's command line (``launch_command``),
  process supervision (``ManagedServer``, ``run_servers``), replicas behind SGLang's router, and
  ``sgl-tts serve``;
- :mod:`sgl_tts.launch.cpu_serving`: what a real SGLang server needs on the CPU (flags, environment);
- :mod:`sgl_tts.launch.memory`: the memory planner for a co-located generator and PRM (``sgl-tts plan``);
- :mod:`sgl_tts.launch.live_servers`: named CPU servers started on first use (the test bed's fleet);
- :mod:`sgl_tts.launch.server_api`: what is asked of a running server beside generating: its info
  (``server_info``) and a radix-cache flush (``flush_cache``), one function each.

These import the plugin's settings type (to render its flags) and the shipped models' paths, never
the client backends, the programs or the experiments.
"""
