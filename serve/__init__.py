"""The HTTP server: Ray Serve deployments of the engine, OpenAI- and SGLang-compatible APIs.

A replica imports this package before torch: the collector's threshold is raised first
(sala/gc_tuning.py), which takes about a fifth off a restarting replica's imports.
"""
from sala.gc_tuning import collect_less

collect_less()
