"""SALA as transformers knows it: `MiniCPMSALAForCausalLM` (the architecture config.json names) and
the Auto classes' registration.

The model's modules and forward are sala/model.py's; this class is the same model as a
transformers `PreTrainedModel` with `GenerationMixin`, for `generate()`,
`AutoModelForCausalLM.from_pretrained(dir)` and what else transformers offers. It lives apart
because importing transformers' model, generation and Auto code costs seconds that a process
serving or quantizing SALA does not need. `sala.register()` imports this module.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationMixin,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from sala.config import SALAConfig
from sala.model import SALAForCausalLM, SALAModel, init_module


class MiniCPMSALAForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SALAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True
    _tied_weights_keys: dict = {}

    def __init__(self, config: SALAConfig):
        super().__init__(config)
        self.model = SALAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # The forward and what it calls are the plain model's: one computation for both.
    forward = SALAForCausalLM.forward
    logits = SALAForCausalLM.logits
    new_cache = SALAForCausalLM.new_cache

    @classmethod
    def sharing(cls, model: SALAForCausalLM) -> MiniCPMSALAForCausalLM:
        """The transformers model over `model`'s own modules (shared, not copied) and its
        generation config."""
        with torch.device("meta"):  # nothing is allocated for the modules about to be replaced
            shared = cls(model.config)
        shared.model, shared.lm_head = model.model, model.lm_head
        shared.generation_config = model.generation_config
        return shared.train(model.training)

    def _init_weights(self, module):
        init_module(module, self.config.initializer_range)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Lightning layers keep a recurrent state, not K/V: the model brings its own cache.
        return False

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value


AutoConfig.register(SALAConfig.model_type, SALAConfig, exist_ok=True)
AutoTokenizer.register(SALAConfig, fast_tokenizer_class=PreTrainedTokenizerFast, exist_ok=True)
AutoModelForCausalLM.register(SALAConfig, MiniCPMSALAForCausalLM, exist_ok=True)
