"""SGLang 0.5.23's own loader on checkpoints this project wrote: the quantize pipeline's NVFP4
output with a cache plan, tiny-sala (dense), tiny-sala with medusa/, and a random model with
the 9B head layout (16 query heads per KV head, which SGLang's sparse backend requires) in
BF16 and NVFP4. tests/interop/sglang_load.py runs SGLang's config parsing, quantization config, model
class and load_weights in SGLang's own environment (tests/interop/sglang_env.py); here what SGLang holds
is compared with our files read with safetensors: packed weights, block and global scales,
fused rows in order, norms and embeddings, K/V scales, every tensor's shape and dtype."""
import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, write_untrained_medusa
from tests.interop.sglang_env import EnvUnavailable, ensure_env

pytestmark = pytest.mark.slow
# SGLang's fused parameter -> our projections, in the order its rows hold them
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def sglang_python():
    try:
        return ensure_env()
    except EnvUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def nine_b_heads(tmp_path_factory):
    """(BF16, NVFP4) checkpoints of a random model with the 9B head layout: 32 query heads, 2 KV
    heads, 32 lightning heads; written by save_checkpoint and export_checkpoint (RTN, FourOverSix)."""
    from sala.checkpoint import save_checkpoint
    from sala.quant.export import export_checkpoint
    from sala.quant.layerwise import quantize_model
    from tests.model.test_model import random_model

    model = random_model(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=2, head_dim=8, lightning_nkv=32, mixer_types=["minicpm4", "lightning-attn"])
    root = tmp_path_factory.mktemp("nine_b_heads")
    bf16 = save_checkpoint(model, root / "bf16", dtype=torch.bfloat16)
    seqs = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    quantized, _ = quantize_model(copy.deepcopy(model), seqs, "rtn", "4over6")
    return bf16, export_checkpoint(model, quantized, root / "nvfp4", scale_rule="4over6", method="rtn")


@pytest.fixture(scope="module")
def checkpoints(tiny_sala_dir, quantize_run, nine_b_heads, tmp_path_factory):
    # SGLang reads a checkpoint's top-level weights only: medusa/ beside them must not change that,
    # trained or not.
    medusa = write_untrained_medusa(tiny_sala_dir, tmp_path_factory.mktemp("medusa") / "tiny-sala-medusa",
                                    shared_lm_head=False)
    return {"nvfp4 + cache plan (pipeline)": quantize_run[0], "tiny-sala": tiny_sala_dir,
            "tiny-sala + medusa/": medusa, "9B heads, bf16": nine_b_heads[0], "9B heads, nvfp4": nine_b_heads[1]}


@pytest.fixture(scope="module")
def loaded(sglang_python, checkpoints, tmp_path_factory):
    """{checkpoint name: (its directory, SGLang's report, the parameters SGLang holds)}."""
    out = tmp_path_factory.mktemp("sglang")
    r = subprocess.run([str(sglang_python), str(ROOT / "tests" / "interop" / "sglang_load.py"), str(out),
                        *map(str, checkpoints.values())], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})  # local directories only: nothing from a hub
    assert r.returncode == 0, r.stderr[-3000:]
    result = {}
    for i, (name, path) in enumerate(checkpoints.items()):
        report = json.loads((out / str(i) / "report.json").read_text())
        assert "error" not in report, f"{name}: SGLang: {report['error']}\n{report['traceback'][-2000:]}"
        result[name] = (Path(path), report, load_file(str(out / str(i) / "state.safetensors")))
    return result


def our_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's top-level safetensors files, as a server reads them."""
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def our_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_sglang_parses_our_configs_and_builds_its_sala_model(loaded):
    for name, (path, report, _) in loaded.items():
        ours = our_config(path)
        assert ours["architectures"] == report["architectures"] == ["MiniCPMSALAForCausalLM"], name
        assert (report["config_class"], report["model_class"]) == ("MiniCPMHybridConfig", "MiniCPMSALAForCausalLM"), name
        # Every key both configs have means the same to SGLang (a key it missed would take its
        # default, e.g. use_output_gate false: the model would lose its gates). Its transformers
        # adds legacy aliases to rope_parameters: a dict may gain keys, not change them.
        theirs = report["config"]
        skip = {"dtype", "torch_dtype", "transformers_version", "quantization_config"}
        differ = {k: (v, theirs[k]) for k, v in ours.items() if k in theirs and k not in skip and not _same(v, theirs[k])}
        assert not differ, (name, differ)
        # medusa/ is ours alone: SGLang reads the top-level weights only.
        assert report["weight_files"] == ["model.safetensors"], name


def _same(ours, theirs) -> bool:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return all(k in theirs and _same(v, theirs[k]) for k, v in ours.items())
    return ours == theirs


def test_sglang_applies_its_sala_overrides(loaded):
    # What `launch_server` resolves for SALA (docs/sglang.md's launch command relies on it):
    # no radix cache, the sparse backend (flash-attention build on sm_90), one token per page.
    for name, (_, report, _) in loaded.items():
        assert report["server_args"] == {"disable_radix_cache": True, "attention_backend": "minicpm_flashattn",
                                         "page_size": 1, "kv_cache_dtype": "fp8_e4m3"}, name


def test_nvfp4_linears_resolve_to_sglangs_weight_only_fp4_scheme(loaded):
    for name, (path, report, _) in loaded.items():
        quantized = {k.rsplit(".", 1)[0] for k in our_tensors(path) if k.endswith(".weight_packed")}
        fused = set()
        for module in quantized:
            parent, _, child = module.rpartition(".")
            fused.add(next((f"{parent}.{f}" for f, parts in FUSED.items() if child in parts), module))
        if "quantization_config" not in our_config(path):
            assert report["quant_config"] is None and not quantized and report["linear_schemes"] == {}, name
            continue
        assert report["quant_config"] == "CompressedTensorsConfig", name
        assert report["linear_schemes"] == dict.fromkeys(sorted(fused), "CompressedTensorsW4A16Fp4"), name


def test_the_9b_head_layout_is_what_sglangs_sparse_backend_requires(loaded):
    for name in ("9B heads, bf16", "9B heads, nvfp4"):
        config = loaded[name][1]["config"]
        # MiniCPMSparseBackend: "requires 16 query heads per KV head"; lightning: no GQA
        assert config["num_attention_heads"] // config["num_key_value_heads"] == 16
        assert config["lightning_nh"] == config["lightning_nkv"]


def test_sglang_holds_exactly_what_our_files_hold(loaded):
    for name, (path, report, theirs) in loaded.items():
        ours = our_tensors(path)
        dense = "quantization_config" not in our_config(path)
        for key, held in theirs.items():
            if key.endswith(("attn.k_scale", "attn.v_scale")):
                ours.pop(key, None)  # test_kv_scales
                continue
            want = _expected(key, ours)
            assert want is not None, f"{name}: SGLang holds {key}, which our files do not fill"
            if held.dtype != want.dtype:
                # Only a dense checkpoint stored wider than it is served is cast on load.
                assert dense and want.dtype == torch.float32 and str(held.dtype) == f"torch.{report['dtype']}", (
                    f"{name}: {key} is {want.dtype} in our files, SGLang's parameter is {held.dtype}")
                want = want.to(held.dtype)
            if key.endswith(("embed_tokens.weight", "lm_head.weight")):
                held = held[: want.shape[0]]  # SGLang pads the vocabulary to a multiple of 64
            assert held.shape == want.shape, f"{name}: {key}: SGLang {tuple(held.shape)}, ours {tuple(want.shape)}"
            assert torch.equal(held.view(torch.uint8), want.view(torch.uint8)), f"{name}: {key} differs"
            if key.endswith("weight_global_scale"):
                # process_weights_after_loading refuses fused projections with different global scales
                assert held.unique().numel() == 1, f"{name}: {key} {held.tolist()}"
        assert not ours, f"{name}: SGLang holds nothing for {sorted(ours)[:3]}"


def _expected(key: str, ours: dict) -> torch.Tensor | None:
    """What SGLang's parameter `key` must hold, taken (popped) from our tensors: the fused
    projections' rows (and global scales) concatenated in SGLang's order, anything else as is."""
    module, _, leaf = key.rpartition(".")
    parent, _, child = module.rpartition(".")
    if child in FUSED:
        parts = [ours.pop(f"{parent}.{p}.{leaf}", None) for p in FUSED[child]]
        return None if any(p is None for p in parts) else torch.cat(parts)
    return ours.pop(key, None)


def test_kv_scales(loaded):
    from sala.checkpoint import read_config
    from sala.kv import load_plan

    path, report, theirs = loaded["nvfp4 + cache plan (pipeline)"]
    config, ours = read_config(path), our_tensors(path)
    plan = load_plan(path, config)
    assert {"fp8", "nvfp4"} <= set(plan.kv.values())
    assert our_config(path)["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    assert report["kv_cache_quant_algo"] == "FP8"  # --kv-cache-dtype auto picks an FP8 cache for it
    for i in range(config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn.attn"
        # SGLang reads the scheme: every attention layer takes scales from the checkpoint
        assert report["kv_methods"][attn] == "CompressedTensorsKVCacheMethod"
        k, v = report["kv_scales"][attn]  # the floats its attention backends pass to the kernels
        if i in config.sparse_layers:
            for side, got in zip("kv", (k, v)):
                want = ours[f"{attn}.{side}_scale"]
                assert want.dtype == torch.float32 and want.shape == (1,)
                assert got == want.item() == theirs[f"{attn}.{side}_scale"].item()
                # one FP8 scale covers every head the plan calibrated, NVFP4 layers' too
                assert torch.tensor(max(plan.amax[i][side])) / 448 == got, (i, side, plan.kv[i])
        else:  # lightning layers have no K/V cache: no scale, SGLang's default
            assert (k, v) == (1.0, 1.0)
    for name, (_, other, _) in loaded.items():
        if name != "nvfp4 + cache plan (pipeline)":
            assert other["kv_methods"] == {} and other["kv_scales"] == {} and other["kv_cache_quant_algo"] is None, name
