"""The serving engine: continuous batching over a paged K/V pool and a lightning state pool."""
from sala.engine.cache import CacheFull, CachePool
from sala.engine.engine import AsyncEngine, Engine, RequestStream
from sala.engine.params import MAX_TOP_LOGPROBS, InvalidParam, SamplingParams
from sala.engine.request import Completion, RequestOutput, TokenLogprob
from sala.engine.scheduler import QueueFull

__all__ = ["AsyncEngine", "CacheFull", "CachePool", "Completion", "Engine", "InvalidParam", "MAX_TOP_LOGPROBS",
           "QueueFull", "RequestOutput", "RequestStream", "SamplingParams", "TokenLogprob"]
