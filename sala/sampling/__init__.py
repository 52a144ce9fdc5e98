"""Choosing tokens: the per-request parameters, the logits controls and the batched sampler.

Below both the engine and Medusa's acceptance, which each read a step's logits through it."""
from sala.sampling.params import MAX_TOP_LOGPROBS, InvalidParam, SamplingParams, Sequence, StructuredOutputs
from sala.sampling.sampler import TokenLogprob, filtered_probs, inverse_cdf, sample, token_logprobs, uniforms

__all__ = ["MAX_TOP_LOGPROBS", "InvalidParam", "SamplingParams", "Sequence", "StructuredOutputs", "TokenLogprob", "filtered_probs",
           "inverse_cdf", "sample", "token_logprobs", "uniforms"]
