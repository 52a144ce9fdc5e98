"""The serving engine: continuous batching over a paged K/V pool and a lightning state pool.

What servers and jobs use is exported here; the modules behind it may move."""
from sala.engine.async_engine import AsyncEngine, RequestStream
from sala.engine.cache import CachePool
from sala.engine.config import EngineConfig, SpeculationSettingError, parse_max_batch, parse_nodes
from sala.engine.engine import Engine
from sala.engine.memory import CacheFull
from sala.engine.request import Completion, RequestOutput, SpecStats
from sala.engine.scheduler import QueueFull
from sala.engine.stats import EngineInfo, EngineStats
from sala.sampling import MAX_TOP_LOGPROBS, InvalidParam, SamplingParams, StructuredOutputs, TokenLogprob

__all__ = ["AsyncEngine", "CacheFull", "CachePool", "Completion", "Engine", "EngineConfig", "EngineInfo", "EngineStats", "InvalidParam",
           "MAX_TOP_LOGPROBS", "QueueFull", "RequestOutput", "RequestStream", "SamplingParams", "SpecStats",
           "SpeculationSettingError", "StructuredOutputs", "TokenLogprob", "parse_max_batch", "parse_nodes"]
