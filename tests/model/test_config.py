"""SALAConfig: the real 9B config.json loads unchanged; inconsistent configs name the bad key."""
import json

import pytest
import torch

from sala.checkpoint import read_config
from sala.config import MINICPM_SALA_9B, ConfigError, SALAConfig
from sala.model import SALAForCausalLM

SPARSE = {0, 9, 16, 17, 22, 29, 30, 31}


def spec_shapes() -> dict[str, tuple]:
    """Parameter names and shapes from the spec's state-dict table (section 2)."""
    s = {"model.embed_tokens.weight": (73448, 4096), "model.norm.weight": (4096,), "lm_head.weight": (73448, 4096)}
    for i in range(32):
        p = f"model.layers.{i}."
        s |= {p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,),
              p + "mlp.gate_proj.weight": (16384, 4096), p + "mlp.up_proj.weight": (16384, 4096),
              p + "mlp.down_proj.weight": (4096, 16384)}
        a = p + "self_attn."
        if i in SPARSE:
            s |= {a + "q_proj.weight": (4096, 4096), a + "k_proj.weight": (256, 4096), a + "v_proj.weight": (256, 4096),
                  a + "o_proj.weight": (4096, 4096), a + "o_gate.weight": (4096, 4096)}
        else:
            s |= {a + n + ".weight": (4096, 4096) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "z_proj")}
            s |= {a + "q_norm.weight": (128,), a + "k_norm.weight": (128,), a + "o_norm.weight": (4096,)}
    return s


def test_real_config_builds_meta_model_with_spec_names_and_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MINICPM_SALA_9B))
    cfg = SALAConfig.from_pretrained(tmp_path)
    assert cfg.sparse_layers == sorted(SPARSE)
    assert abs(cfg.residual_scale - 0.24748737341529164) < 1e-15
    assert cfg.logit_divisor == 16
    with torch.device("meta"):
        model = SALAForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == spec_shapes()
    n = sum(p.numel() for p in model.parameters())
    print(f"9B config: {n:,} parameters")
    assert round(n / 1e9, 2) == 9.48


def test_written_config_names_the_released_architecture(tmp_path):
    # SGLang and vLLM pick the model class by `architectures`; configs written before we wrote it
    # load, and gain it when written again.
    older = {k: v for k, v in MINICPM_SALA_9B.items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps(older))
    cfg = read_config(tmp_path)
    cfg.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["MiniCPMSALAForCausalLM"]


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"mixer_types": ["minicpm4"] * 31}, "mixer_types"),
        ({"mixer_types": ["lightning-attn"] + ["minicpm4"] * 31}, "mixer_types[0]"),
        ({"mixer_types": ["minicpm4", "mamba"] + ["minicpm4"] * 30}, "mixer_types"),
        ({"head_dim": 64}, "head_dim"),
        ({"lightning_nh": 16}, "lightning_nh"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ],
)
def test_inconsistent_config_names_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SALAConfig.from_dict({**MINICPM_SALA_9B, **change})
