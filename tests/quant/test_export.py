"""NVFP4 checkpoint export and load: a small random SALA model quantized layer by layer (RTN
with plain NVFP4, GPTQ with FourOverSix), written, read back, and read by compressed-tensors'
own decompressor, which serves as the independent reference for the format."""
import copy
import json
import shutil

import pytest
import torch
from compressed_tensors.compressors import NVFP4PackedCompressor, unpack_fp4_from_uint8
from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.utils import generate_gparam
from safetensors.torch import load_file

from sala.checkpoint import CheckpointError, load_model, write_manifest
from sala.quant.export import export_checkpoint
from sala.quant.layerwise import apply_quantized, quantize_model
from sala.quant.linear import NVFP4Linear
from tests.model.test_model import random_model

# Every in-feature (hidden 64, intermediate 96, heads x head_dim 64) is a multiple of 16;
# vocab 101 is not, which only lm_head sees, and lm_head stays BF16.
CONFIG = dict(hidden_size=64, intermediate_size=96, head_dim=16, vocab_size=101)
VARIANTS = {"rtn-6": ("rtn", "6"), "gptq-4over6": ("gptq", "4over6")}
FUSED = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]


def quantize(model, method, scale_rule, seed=0):
    """{full module name: NVFP4Tensor} through the CLI's layer-by-layer path."""
    seqs = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(seed))
    quantized, _ = quantize_model(model, seqs, method, scale_rule)
    return quantized


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    """(reference model, quantized tensors, checkpoint dir, scale rule)."""
    method, scale_rule = VARIANTS[request.param]
    reference = random_model(**CONFIG)
    quantized = quantize(copy.deepcopy(reference), method, scale_rule)
    path = export_checkpoint(reference, quantized, tmp_path_factory.mktemp(request.param) / "ckpt",
                             scale_rule=scale_rule, method=method)
    return reference, quantized, path, scale_rule


def saved_tensors(path):
    return load_file(str(path / "model.safetensors"))


def parsed_config(path) -> QuantizationConfig:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})


# ---- round trip -----------------------------------------------------------------------------


def test_reload_dequantized_equals_in_memory_bit_for_bit(exported):
    reference, quantized, path, _ = exported
    model = load_model(path, dtype=torch.float32, packed=False)
    state = model.state_dict()
    for name, q in quantized.items():
        assert torch.equal(state[f"{name}.weight"], q.dequantize(torch.float32)), name
    # Everything not quantized (embeddings, lm_head, norms) is the reference in BF16.
    for key, value in reference.state_dict().items():
        if key.removesuffix(".weight") not in quantized:
            assert torch.equal(state[key], value.bfloat16().float()), key


def test_reload_packed_holds_the_quantized_tensors(exported):
    _, quantized, path, _ = exported
    model = load_model(path, dtype=torch.float32)  # the generic loader dispatches on quantization_config
    modules = dict(model.named_modules())
    assert sorted(n for n, m in modules.items() if isinstance(m, NVFP4Linear)) == sorted(quantized)
    assert type(modules["lm_head"]) is torch.nn.Linear
    for name, q in quantized.items():
        m = modules[name]
        assert torch.equal(m.weight_packed, q.packed())
        assert m.weight_scale.dtype == torch.float8_e4m3fn
        assert torch.equal(m.weight_scale.view(torch.uint8), q.scale.view(torch.uint8))
        assert m.weight_global_scale.dtype == torch.float32
        assert torch.equal(m.weight_global_scale, q.global_scale)


def test_packed_logits_equal_dequantized_logits(exported):
    _, _, path, _ = exported
    packed = load_model(path, dtype=torch.float32, packed=True)
    dense = load_model(path, dtype=torch.float32, packed=False)
    ids = torch.randint(0, packed.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = packed(ids, use_cache=False).logits
        b = dense(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_linears_with_bias_round_trip(tmp_path):
    # attention_bias puts a BF16 bias beside q/k/v's packed weights; every path keeps it.
    reference = random_model(**CONFIG, attention_bias=True)
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.q_proj.bias.normal_()
    quantized = quantize(copy.deepcopy(reference), "rtn", "4over6")
    path = export_checkpoint(reference, quantized, tmp_path / "ckpt", scale_rule="4over6", method="rtn")
    packed = load_model(path, dtype=torch.float32, packed=True)
    dense = load_model(path, dtype=torch.float32, packed=False)
    bias = packed.model.layers[0].self_attn.q_proj.bias
    assert torch.equal(bias, reference.model.layers[0].self_attn.q_proj.bias.bfloat16().float())
    # In memory too: apply_quantized's packed modules keep the bias.
    in_memory = {use_packed: copy.deepcopy(reference) for use_packed in (True, False)}
    for use_packed, model in in_memory.items():
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."
            apply_quantized(layer, {k.removeprefix(prefix): q for k, q in quantized.items() if k.startswith(prefix)},
                            packed=use_packed)
    ids = torch.randint(0, 101, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for a, b in ((packed, dense), (in_memory[True], in_memory[False])):
            torch.testing.assert_close(a(ids, use_cache=False).logits, b(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)


# ---- compressed-tensors reads what we wrote -------------------------------------------------


def test_compressed_tensors_decompressor_agrees(exported):
    _, quantized, path, _ = exported
    tensors = saved_tensors(path)
    scheme = parsed_config(path).config_groups["group_0"]
    for name, q in quantized.items():
        packed, scale, gscale = (tensors[f"{name}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert packed.dtype == torch.uint8 and packed.shape == (q.codes.shape[0], q.codes.shape[1] // 2)
        assert scale.dtype == torch.float8_e4m3fn and scale.shape == (q.codes.shape[0], q.codes.shape[1] // 16)
        assert gscale.dtype == torch.float32 and gscale.shape == (1,)
        # The compressor decodes to BF16: our fp32 dequantization rounded once to BF16.
        out = NVFP4PackedCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gscale}, scheme)
        assert torch.equal(out["weight"], q.dequantize(torch.bfloat16)), name
        # In fp32 through its unpacker and dequantize: identical bits.
        values = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
        w32 = ct_dequantize(values, scale.float(), args=scheme.weights, global_scale=gscale, dtype=torch.float32)
        assert torch.equal(w32, q.dequantize(torch.float32)), name


def test_compressed_tensors_checkpoint_dequantizer_agrees(exported, tmp_path):
    # Whole checkpoint through compressed-tensors' converter: it finds the quantized modules
    # from our config (targets, ignore) and leaves every other tensor as written.
    _, quantized, path, _ = exported
    out = tmp_path / "dequantized"
    convert_checkpoint(path, out, CompressedTensorsDequantizer(path, dtype=torch.bfloat16), max_workers=1, device="cpu")
    theirs = load_file(str(out / "model.safetensors"))
    ours = load_model(path, dtype=torch.bfloat16, packed=False).state_dict()
    assert sorted(theirs) == sorted(ours)
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key


def test_quantization_config_has_the_compressed_tensors_fields(exported):
    _, _, path, _ = exported
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"]
    assert qc["kv_cache_scheme"] is None
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["format"] == "nvfp4-pack-quantized"
    assert group["input_activations"] is None and group["output_activations"] is None
    assert group["weights"] == {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                "scale_dtype": "torch.float8_e4m3fn", "symmetric": True, "dynamic": False}
    parsed = parsed_config(path)
    assert parsed.config_groups["group_0"].weights.num_bits == 4
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_act_order_is_declared_static(tmp_path):
    reference = random_model(**CONFIG)
    quantized = quantize(copy.deepcopy(reference), "rtn", "6")
    path = export_checkpoint(reference, quantized, tmp_path / "ckpt", scale_rule="6", method="gptq", act_order=True)
    weights = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] == "static"
    assert parsed_config(path).config_groups["group_0"].weights.actorder == "static"
    load_model(path)  # static act-order stores no g_idx: loads like any other


# ---- fused groups ---------------------------------------------------------------------------


def test_fused_groups_share_one_global_scale(exported):
    reference, quantized, path, scale_rule = exported
    tensors = saved_tensors(path)
    fp8_max = {"6": 448.0, "4over6": 256.0}[scale_rule]
    for i, layer in enumerate(reference.model.layers):
        named = dict(layer.named_modules())
        for group in FUSED:
            scales = [tensors[f"model.layers.{i}.{m}.weight_global_scale"] for m in group]
            assert all(torch.equal(s, scales[0]) for s in scales), (i, group)
            amax = max(named[m].weight.abs().max() for m in group)
            if scale_rule == "6":  # compressed-tensors' own global scale for that group
                assert torch.equal(scales[0], generate_gparam(-amax.reshape(1), amax.reshape(1)))
            else:
                assert scales[0].item() == pytest.approx(fp8_max * 6 / amax.item(), rel=1e-6)
        # Unfused modules keep their own.
        own = named["mlp.down_proj"].weight.abs().max().item()
        assert tensors[f"model.layers.{i}.mlp.down_proj.weight_global_scale"].item() == pytest.approx(fp8_max * 6 / own, rel=1e-6)


# ---- other formats are refused --------------------------------------------------------------


def _edited_copy(path, tmp_path, edit):
    """A copy of the checkpoint whose config.json went through `edit`, with a fresh manifest,
    so only the edit (not a checksum) can make loading fail."""
    dst = tmp_path / "edited"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "manifest.json").unlink()
    write_manifest(dst)
    return dst


W4A4_INPUTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "dynamic": "local", "symmetric": True, "scale_dtype": "torch.float8_e4m3fn"}


def _w4a4(qc):
    qc["config_groups"]["group_0"]["input_activations"] = W4A4_INPUTS


def _gptq(qc):
    qc.clear()
    qc.update({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True})


def _int4_pack_quantized(qc):
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    qc["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "type": "int", "strategy": "group",
                                                 "group_size": 128, "symmetric": True, "dynamic": False}


def _kv_cache(qc):
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _frozen(qc):
    qc["quantization_status"] = "frozen"


def _down_proj_ignored(qc):
    qc["ignore"].append("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("edit, message", [
    (_w4a4, "quantizes activations \\(W4A4\\)"),
    (_gptq, "quant_method 'gptq' is not supported"),
    (_int4_pack_quantized, "quantization format 'pack-quantized' is not supported"),
    (_kv_cache, "KV-cache quantization"),
    (_frozen, "quantization_status 'frozen'"),
    (_down_proj_ignored, "model.layers.0.mlp.down_proj has weight_packed but is not a target"),
])  # fmt: skip
def test_other_quantization_formats_are_refused(exported, tmp_path, edit, message):
    _, _, path, _ = exported
    edited = _edited_copy(path, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(edited)


# ---- atomic write ---------------------------------------------------------------------------


class FailingTokenizer:
    """Fails after the weights are written, as a full disk or a crash would."""

    def save_pretrained(self, directory):
        (directory / "tokenizer.json").write_text("{")
        raise OSError("disk full")


def test_failed_export_leaves_nothing_at_the_target(exported, tmp_path):
    reference, quantized, _, scale_rule = exported
    target = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(reference, quantized, target, FailingTokenizer(), scale_rule=scale_rule, method="rtn")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary sibling


def test_failed_overwrite_keeps_the_old_checkpoint(exported, tmp_path):
    reference, quantized, path, scale_rule = exported
    target = tmp_path / "out"
    shutil.copytree(path, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(reference, quantized, target, FailingTokenizer(), scale_rule=scale_rule, method="rtn",
                          overwrite=True)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bad_export_arguments_write_nothing(exported, tmp_path):
    reference, quantized, path, scale_rule = exported
    target = tmp_path / "out"
    first = next(iter(quantized))
    with pytest.raises(ValueError, match="lm_head: quantized shape"):
        export_checkpoint(reference, {"lm_head": quantized[first]}, target, scale_rule=scale_rule, method="rtn")
    with pytest.raises(ValueError, match="model.norm: not a Linear"):
        export_checkpoint(reference, {"model.norm": quantized[first]}, target, scale_rule=scale_rule, method="rtn")
    with pytest.raises(FileExistsError):
        export_checkpoint(reference, quantized, path, scale_rule=scale_rule, method="rtn")
    assert not target.exists()


# ---- KV-cache scheme ------------------------------------------------------------------------


def test_kv_plan_exports_as_a_compressed_tensors_kv_cache_scheme(exported, tmp_path):
    from safetensors.torch import save_file

    from sala.checkpoint import verify_manifest
    from sala.kv import KVPlan, load_plan
    from sala.kv.measure import calibrate_amax

    reference, quantized, _, scale_rule = exported
    config = reference.config
    amax = calibrate_amax(reference, torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)))
    first, *rest = config.sparse_layers
    plan = KVPlan.uniform(config, "fp8", "fp32", amax).with_units(kv={i: "nvfp4" for i in rest},
                                                                  state={config.lightning_layers[0]: "bf16"})
    path = export_checkpoint(reference, quantized, tmp_path / "ckpt", scale_rule=scale_rule, method="rtn", kv_plan=plan)
    tensors = saved_tensors(path)
    # Every sparse layer, NVFP4 ones too (a plain loader runs them at FP8): one scale for all its
    # kv heads, where SGLang's MiniCPM-SALA loader looks for it.
    for i in config.sparse_layers:
        for side, name in (("k", "k_scale"), ("v", "v_scale")):
            got = tensors.pop(f"model.layers.{i}.self_attn.attn.{name}")
            assert got.dtype == torch.float32 and got.shape == (1,)
            assert torch.equal(got, torch.tensor([max(amax[i][side])], dtype=torch.float32) / 448)
    assert not [k for k in tensors if k.endswith(("k_scale", "v_scale"))]
    kv = parsed_config(path).kv_cache_scheme  # compressed-tensors' own schema parses it
    assert (kv.num_bits, kv.type, kv.strategy, kv.symmetric, kv.dynamic, kv.scale_dtype) == (
        8, "float", "tensor", True, False, torch.float32)
    assert verify_manifest(path)
    # The per-head amax the engine's codecs scale by travel in the plan beside.
    assert load_plan(path, config).to_json()["layers"] == plan.to_json()["layers"]
    load_model(path)  # our loader accepts the scheme and checks the scales against the plan
    # A scale that does not match the plan beside it is named.
    tensors = saved_tensors(path)
    tensors[f"model.layers.{first}.self_attn.attn.v_scale"] *= 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(path)
    with pytest.raises(CheckpointError, match=f"model.layers.{first}.self_attn.attn.v_scale is missing, unexpected or differs"):
        load_model(path)


def test_checkpoints_with_per_head_kv_scales_still_load(exported, tmp_path):
    # What export_checkpoint wrote before the scheme became per tensor: strategy attn_head and
    # fp32 [Hkv, 1, 1] scales at self_attn.k_scale. Rewritten here from a current export.
    from safetensors.torch import save_file

    from sala.kv import KVPlan
    from sala.kv.measure import calibrate_amax

    reference, quantized, _, scale_rule = exported
    config = reference.config
    amax = calibrate_amax(reference, torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)))
    path = export_checkpoint(reference, quantized, tmp_path / "ckpt", scale_rule=scale_rule, method="rtn",
                             kv_plan=KVPlan.uniform(config, "fp8", "fp32", amax))
    tensors = {k: v for k, v in saved_tensors(path).items() if not k.endswith(("k_scale", "v_scale"))}
    for i in config.sparse_layers:
        for side in "kv":
            tensors[f"model.layers.{i}.self_attn.{side}_scale"] = torch.tensor(amax[i][side]).reshape(-1, 1, 1) / 448
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    (path / "config.json").write_text(json.dumps(config_json))
    write_manifest(path)
    load_model(path)
    tensors[f"model.layers.{config.sparse_layers[0]}.self_attn.k_scale"] *= 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(path)
    with pytest.raises(CheckpointError, match="self_attn.k_scale is missing, unexpected or differs"):
        load_model(path)
