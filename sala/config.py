"""SALAConfig: the keys of MiniCPM-SALA's config.json, with the checks the forward pass relies on.

The real 9B config.json loads unchanged. Inconsistent configs fail at construction with a
message naming the offending key, because a wrong head count or layer list otherwise shows up
much later as a shape error deep inside a layer.
"""
from __future__ import annotations

import math

from transformers import PretrainedConfig

from sala import sparse

# The model class the released config names; SGLang, vLLM and the official remote code pick
# their implementation by it, so every config we write carries it.
ARCHITECTURE = "MiniCPMSALAForCausalLM"
SPARSE = "minicpm4"
LIGHTNING = "lightning-attn"
_MIXER_ALIASES = {SPARSE: SPARSE, "lightning-attn": LIGHTNING, "lightning": LIGHTNING, "lightning_attn": LIGHTNING}

DEFAULT_SPARSE_CONFIG = {
    "block_size": 64,
    "dense_len": 8192,
    "init_blocks": 1,
    "kernel_size": 32,
    "kernel_stride": 16,
    "topk": 64,
    "use_nope": False,
    "window_size": 2048,
}


# The released 9B checkpoint's config.json (openbmb/MiniCPM-SALA; docs/design/architecture.md),
# verbatim: the shapes the kernels are built and checked for.
MINICPM_SALA_9B = {
    "architectures": [ARCHITECTURE],
    "auto_map": {
        "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
        "AutoModel": "modeling_minicpm_sala.MiniCPMSALAModel",
        "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM",
    },
    "model_type": "minicpm_sala",
    "vocab_size": 73448, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 524288, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "attn_use_rope": False, "attn_use_output_gate": True,
    "lightning_use_rope": True, "qk_norm": True, "use_output_gate": True, "use_output_norm": True,
    "lightning_nh": 32, "lightning_nkv": 32, "lightning_head_dim": 128, "lightning_scale": "1/sqrt(d)",
    "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 256, "mup_denominator": 32,
    "sparse_config": {"block_size": 64, "dense_len": 8192, "init_blocks": 1, "kernel_size": 32,
                      "kernel_stride": 16, "topk": 64, "use_nope": False, "window_size": 2048},
    "mixer_types": [SPARSE if i in (0, 9, 16, 17, 22, 29, 30, 31) else "lightning-attn" for i in range(32)],
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [2, 73440], "pad_token_id": 2,
    "initializer_range": 0.1, "pretraining_tp": 1, "shift_labels": True, "use_cache": True,
    "dtype": "bfloat16", "transformers_version": "4.57.1",
}  # fmt: skip


class ConfigError(ValueError):
    """A config.json whose keys contradict each other."""


class SALAConfig(PretrainedConfig):
    model_type = "minicpm_sala"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 73448,
        hidden_size: int = 4096,
        intermediate_size: int = 16384,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 2,
        head_dim: int = 128,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 524288,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        attn_use_rope: bool = False,
        attn_use_output_gate: bool = True,
        lightning_use_rope: bool = True,
        qk_norm: bool = True,
        use_output_gate: bool = True,
        use_output_norm: bool = True,
        lightning_nh: int | None = None,
        lightning_nkv: int | None = None,
        lightning_head_dim: int | None = None,
        lightning_scale: str = "1/sqrt(d)",
        scale_emb: float = 12.0,
        scale_depth: float = 1.4,
        dim_model_base: int = 256,
        mup_denominator: int = 32,
        sparse_config: dict | None = None,
        mixer_types: list[str] | None = None,
        initializer_range: float = 0.1,
        pretraining_tp: int = 1,
        shift_labels: bool = True,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        bos_token_id: int = 1,
        eos_token_id: int | list[int] = (2, 73440),
        pad_token_id: int = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.attn_use_rope = attn_use_rope
        self.attn_use_output_gate = attn_use_output_gate
        self.lightning_use_rope = lightning_use_rope
        self.qk_norm = qk_norm
        self.use_output_gate = use_output_gate
        self.use_output_norm = use_output_norm
        self.lightning_nh = num_attention_heads if lightning_nh is None else lightning_nh
        self.lightning_nkv = self.lightning_nh if lightning_nkv is None else lightning_nkv
        self.lightning_head_dim = head_dim if lightning_head_dim is None else lightning_head_dim
        self.lightning_scale = lightning_scale
        self.scale_emb = scale_emb
        self.scale_depth = scale_depth
        self.dim_model_base = dim_model_base
        self.mup_denominator = mup_denominator
        self.sparse_config = {**DEFAULT_SPARSE_CONFIG, **(sparse_config or {})}
        if mixer_types is None:
            mixer_types = [SPARSE] + [LIGHTNING] * (num_hidden_layers - 1)
        self.mixer_types = list(mixer_types)
        self.initializer_range = initializer_range
        self.pretraining_tp = pretraining_tp
        self.shift_labels = shift_labels
        self.use_cache = use_cache
        if isinstance(eos_token_id, tuple):
            eos_token_id = list(eos_token_id)
        if not kwargs.get("architectures"):  # configs we wrote before it was written load as well
            kwargs["architectures"] = [ARCHITECTURE]
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.mixer_types) != n:
            raise ConfigError(f"mixer_types has {len(self.mixer_types)} entries but num_hidden_layers is {n}")
        unknown = sorted({m for m in self.mixer_types if m not in _MIXER_ALIASES})
        if unknown:
            raise ConfigError(f"mixer_types: unknown mixer {unknown}; expected one of {sorted(_MIXER_ALIASES)}")
        if n and _MIXER_ALIASES[self.mixer_types[0]] != SPARSE:
            raise ConfigError(f"mixer_types[0] must be '{SPARSE}': the cache counts seen tokens on layer 0")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError(
                f"num_attention_heads x head_dim = {self.num_attention_heads} x {self.head_dim} "
                f"!= hidden_size {self.hidden_size} (the minicpm4 layer needs them equal)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        # The reference code reads num_attention_heads/head_dim for lightning layers, SGLang and
        # vLLM read the lightning_* keys; a checkpoint where they differ is ambiguous.
        if self.lightning_nh != self.num_attention_heads:
            raise ConfigError(f"lightning_nh={self.lightning_nh} != num_attention_heads={self.num_attention_heads}")
        if self.lightning_head_dim != self.head_dim:
            raise ConfigError(f"lightning_head_dim={self.lightning_head_dim} != head_dim={self.head_dim}")
        if self.lightning_nh % self.lightning_nkv:
            raise ConfigError(f"lightning_nkv={self.lightning_nkv} does not divide lightning_nh={self.lightning_nh}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        # transformers folds rope_scaling/rope_theta into rope_parameters; only plain RoPE is valid.
        rope = getattr(self, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_scaling: only plain RoPE (null) is supported, got {rope}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if problem := sparse.validate(self.sparse_config):
            raise ConfigError(problem)
        if self.sparse_config.get("use_nope") and self.attn_use_rope:
            raise ConfigError("sparse_config.use_nope=true with attn_use_rope=true is not supported: the compressed "
                              "keys are made from the cached (rotated) keys")

    # Derived quantities the forward pass uses; kept here so every module agrees on them.
    @property
    def layer_kinds(self) -> list[str]:
        return [_MIXER_ALIASES[m] for m in self.mixer_types]

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == SPARSE]

    @property
    def lightning_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == LIGHTNING]

    @property
    def residual_scale(self) -> float:
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    @property
    def logit_divisor(self) -> float:
        return self.hidden_size / self.dim_model_base

    @property
    def lightning_q_scale(self) -> float:
        d = self.lightning_head_dim
        if self.lightning_scale == "1/sqrt(d)":
            return d**-0.5
        if self.lightning_scale == "1/d":
            return 1.0 / d
        return 1.0


def default_generation_config(config: SALAConfig):
    """The generation config a model derives from its config, which transformers' models start
    from when a checkpoint has no generation_config.json."""
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)
