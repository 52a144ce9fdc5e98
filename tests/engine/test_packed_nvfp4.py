"""The engine keeps NVFP4 weights packed on CPU: no fp32 copy of a weight after its steps, eager or
compiled, and the peak memory of loading a checkpoint at the 9B model's widths and decoding from
it within 1.25x the checkpoint's bytes plus the engine's cache budget. A dense BF16 checkpoint
loads in BF16."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from sala.checkpoint import CheckpointReader, load_model, save_checkpoint, weight_files
from sala.engine import Engine, SamplingParams
from sala.quant.export import export_checkpoint
from sala.quant.layerwise import group_amax, layer_groups
from sala.quant.linear import NVFP4Linear
from sala.quant.nvfp4 import quantize_rtn
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def write_rtn(dense, target, scale_rule: str = "6"):
    """`dense` RTN-quantized to an NVFP4 checkpoint in `target`, a layer at a time from its shards,
    each fused group under its shared amax, as the quantize pipeline's workers do."""
    reader = CheckpointReader(dense)

    def layer_results(i):
        prefix, results = f"model.layers.{i}", {}
        for groups in layer_groups(reader.skeleton.get_submodule(prefix)).values():
            for group in groups:
                weights = {m: reader.tensor(f"{prefix}.{m}.weight", torch.float32) for m in group}
                amax = group_amax(weights, group)
                results |= {f"{prefix}.{m}": quantize_rtn(weights[m], scale_rule, global_amax=amax) for m in group}
        return results

    return export_checkpoint(reader, layer_results, target, AutoTokenizer.from_pretrained(dense), scale_rule=scale_rule,
                             method="rtn")


def module_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor the model's modules hold (parameters, buffers, tensor attributes and tensors in
    dict attributes), by where it was found first."""
    found, names = {}, {}
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            for sub, t in (value.items() if isinstance(value, dict) else [("", value)]):
                if isinstance(t, torch.Tensor) and id(t) not in found:
                    found[id(t)], names[id(t)] = t, f"{prefix}.{sub or key}"
    return {names[i]: t for i, t in found.items()}


@pytest.fixture(scope="module")
def tiny_nvfp4_dir(tiny_sala_dir, tmp_path_factory):
    return write_rtn(tiny_sala_dir, tmp_path_factory.mktemp("nvfp4") / "tiny-rtn")


@pytest.mark.parametrize("compile", [False, True])
def test_nvfp4_linears_hold_only_packed_tensors_after_engine_steps(tiny_nvfp4_dir, compile):
    engine = Engine.from_pretrained(tiny_nvfp4_dir, device="cpu", compile=compile, max_seqs=4)
    engine.generate([[1, 5, 6, 7]], GREEDY)
    assert (engine.compile_seconds is not None) == compile
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(linears) == 4 * model.config.num_hidden_layers  # fused q/k/v/gate and gate/up, o, down
    for m in linears:
        n, k = m.out_features, m.in_features
        held = module_tensors(m)
        assert {name.split(".")[-1]: t.dtype for name, t in held.items()} == {
            "weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_global_scale": torch.float32}
        assert sum(t.nbytes for t in held.values()) == n * k // 2 + n * k // 16 + 4 * m.weight_global_scale.numel()
    # No fp32 weight anywhere: the only fp32 tensors are global scales; the rest is as stored (BF16).
    tensors = module_tensors(model)
    assert {name for name, t in tensors.items() if t.dtype == torch.float32 and t.numel() > 64} <= {
        name for name in tensors if name.endswith("weight_global_scale")}
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16


def test_a_bf16_checkpoint_loads_in_bf16(tiny_sala_dir, tokenizer, tmp_path):
    bf16 = save_checkpoint(load_model(tiny_sala_dir, dtype=torch.bfloat16), tmp_path / "bf16", tokenizer)
    engine = Engine.from_pretrained(bf16, device="cpu", compile=False, max_seqs=4)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert len(engine.generate([[1, 5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens


# Loads and decodes in a fresh process on one torch thread, reporting the growth of its peak RSS
# (the kernel's high-water mark, reset first: exact, not sampled) over its RSS after imports; RSS
# counts the checkpoint's pages the weights are mapped from as well as what is allocated.
CHILD = """
import json, sys
import torch
from bench.memwatch import restart_high_water_mark, status_bytes
from sala.engine import Engine, SamplingParams

torch.set_num_threads(1)
before = restart_high_water_mark()
engine = Engine.from_pretrained(sys.argv[1], device="cpu", compile=sys.argv[2] == "compiled", max_model_len=4096, max_seqs=4)
(out,) = engine.generate(["The for statement"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"growth": status_bytes("VmHWM") - before, "budget": engine.config.memory.budget_bytes,
                  "tokens": len(out.token_ids), "compiled": engine.compile_seconds is not None}))
"""


@pytest.fixture(scope="module")
def realwidth_nvfp4(tmp_path_factory):
    """The 1-layer MiniCPM-SALA at the 9B's widths (sala/realwidth.py, 1.7 GB in BF16), RTN-quantized
    (plain NVFP4, the quickest rule; the format is the same): 1.35 GB, 1.2 GB of it the BF16
    embeddings and lm_head."""
    from sala.realwidth import ensure_realwidth

    return write_rtn(ensure_realwidth(1, progress=False), tmp_path_factory.mktemp("realwidth") / "nvfp4-1L")


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_realwidth_nvfp4_peak_memory(realwidth_nvfp4, mode):
    """Loading and decoding 8 tokens grows the process's peak memory by at most 1.25 x the
    checkpoint's bytes plus the cache budget. An fp32 copy of the quantized weights (254M of them,
    1 GB) would exceed it."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(realwidth_nvfp4), mode], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    checkpoint = sum(f.stat().st_size for f in weight_files(realwidth_nvfp4))
    print(f"\n{mode}: checkpoint {checkpoint / 2**30:.3f} GiB, cache budget {got['budget'] / 2**20:.0f} MiB, "
          f"peak growth {got['growth'] / 2**30:.3f} GiB ({got['growth'] / checkpoint:.2f} x the checkpoint)")
    assert got["tokens"] == 8 and got["compiled"] == (mode == "compiled")
    assert got["growth"] <= 1.25 * checkpoint + got["budget"]


@pytest.mark.parametrize("packed", [True, False])
def test_footprint_counts_the_fused_projections(tiny_nvfp4_dir, tiny_sala_dir, packed):
    """sala.footprint's estimate of what fusing copies, on the meta model, against the tensors a
    real engine's fused q/k/v/gate and gate/up hold (NVFP4: packed buffers; dense: parameters);
    the NVFP4 estimate keeps one global scale per row where the values are unknown."""
    from sala.footprint import CheckpointFootprint

    path = tiny_nvfp4_dir if packed else tiny_sala_dir
    engine = Engine.from_pretrained(path, device="cpu", compile=False, max_seqs=4)
    fused = {name: t for name, t in module_tensors(engine.model).items()
             if any(part in name.split(".") for part in ("qkvg_proj", "gate_up_proj"))}
    assert fused
    held = sum(t.nbytes for t in fused.values())
    # Where the parts shared a global scale the engine kept one: the estimate counts one per row.
    one_scale = [name.rsplit(".", 1)[0] for name, t in fused.items() if name.endswith("weight_global_scale") and t.numel() == 1]
    unknown = sum(4 * (fused[f"{m}.weight_packed"].shape[0] - 1) for m in one_scale)
    assert CheckpointFootprint(path).fused_bytes() == held + unknown
