"""sala: MiniCPM-SALA in plain PyTorch, with quantization, KV compression and serving around it.

Importing the package registers the model with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(dir)` works without `trust_remote_code`. Without torch
installed only the numpy parts load (sala.eval.logprob: scoring logprobs from any server).
"""
import importlib.util

if importlib.util.find_spec("torch") is not None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from sala.config import SALAConfig
    from sala.model import SALACache, SALAForCausalLM

    AutoConfig.register(SALAConfig.model_type, SALAConfig, exist_ok=True)
    AutoModelForCausalLM.register(SALAConfig, SALAForCausalLM, exist_ok=True)
    AutoTokenizer.register(SALAConfig, fast_tokenizer_class=PreTrainedTokenizerFast, exist_ok=True)

    __all__ = ["SALAConfig", "SALAForCausalLM", "SALACache"]
