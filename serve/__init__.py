"""The HTTP server: Ray Serve deployments of the engine, OpenAI- and SGLang-compatible APIs.

A replica imports this package before torch: the collector's threshold is raised first
(sala/gc_tuning.py says why and what it saves).
"""
from sala.gc_tuning import collect_less

collect_less()
