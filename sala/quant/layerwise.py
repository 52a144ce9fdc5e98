"""Quantizing a whole SALA model, one decoder layer at a time.

The pieces the single-process CLI (`python -m sala.quant`) and the Ray pipeline
(pipelines/quantize.py) share, so both produce the same checkpoint from the same inputs:

- `LAYER_GROUPS`: which Linears of a layer are quantized, which share one input (and so one
  Hessian) and which form a fused group that must share one global scale (q/k/v; gate/up),
  because vLLM and SGLang fuse them into one GEMM with a single global scale.
- `collect_hessians`: forward hooks accumulate X^T X per input site.
- `quantize_layer`: GPTQ or RTN for every Linear of one layer, given that layer's weights and
  Hessians; `quantize_module` does one Linear under its fused group's amax (`group_amax`), so
  the pipeline's workers can quantize the members of a group apart.
- `apply_quantized`: put the quantized weights back into the model (packed NVFP4Linear, or
  dequantized into the existing Linear), e.g. to propagate calibration inputs in
  sequential mode.
- `quantize_sequential`: the layer-by-layer driver in one process, given a function that
  quantizes one layer; `quantize_model` runs it with per-module statistics (the CLI, the
  benchmarks). The Ray pipeline does the same walk on its worker pool (pipelines/layer_pool.py).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from sala.quant.gptq import GPTQStats, HessianAccumulator, gptq_quantize, relative_output_error, relative_weight_error
from sala.quant.nvfp4 import NVFP4Tensor, quantize_rtn

# site -> modules reading that input; tuples inside are fused groups sharing a global scale.
LAYER_GROUPS = {
    "sparse": {
        "attn_in": [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_gate",)],
        "attn_out": [("self_attn.o_proj",)],
        "mlp_in": [("mlp.gate_proj", "mlp.up_proj")],
        "mlp_out": [("mlp.down_proj",)],
    },
    "lightning": {
        "attn_in": [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.z_proj",)],
        "attn_out": [("self_attn.o_proj",)],
        "mlp_in": [("mlp.gate_proj", "mlp.up_proj")],
        "mlp_out": [("mlp.down_proj",)],
    },
}


def layer_groups(layer: nn.Module) -> dict[str, list[tuple[str, ...]]]:
    """LAYER_GROUPS of this layer, without the modules its config switched off."""
    groups = LAYER_GROUPS["lightning" if layer.is_lightning else "sparse"]
    present = dict(layer.named_modules())
    return {site: [g for g in gs if all(m in present for m in g)] for site, gs in groups.items()}


def layer_modules(layer: nn.Module) -> list[str]:
    return [m for gs in layer_groups(layer).values() for g in gs for m in g]


def quantized_module_names(model) -> list[str]:
    """Full names of every Linear the checkpoint stores as NVFP4 (lm_head and embeddings stay BF16)."""
    return [f"model.layers.{i}.{m}" for i, layer in enumerate(model.model.layers) for m in layer_modules(layer)]


def collect_hessians(layers: dict[int, nn.Module], sites: tuple[str, ...] | None = None
                     ) -> tuple[dict[tuple[int, str], HessianAccumulator], list]:
    """Install hooks that accumulate each site's input second moment (of `sites` only, when
    given) while the caller runs forwards. Returns the accumulators keyed by (layer index, site)
    and the hook handles."""
    accs: dict[tuple[int, str], HessianAccumulator] = {}
    handles = []
    for idx, layer in layers.items():
        named = dict(layer.named_modules())
        for site, groups in layer_groups(layer).items():
            if sites is not None and site not in sites:
                continue
            first = named[groups[0][0]]
            acc = HessianAccumulator(first.in_features, device=first.weight.device)
            accs[(idx, site)] = acc
            handles.append(first.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add(args[0].detach())))
    return accs, handles


def layer_hessians(layer: nn.Module, idx: int, inputs, run, sites: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The Hessians of a layer's input sites (`sites`, default all) from a forward of each batch of
    `inputs` (calibration shards), run(layer, batch): each batch's X^T X summed in batch order, so
    the bytes depend on how the calibration set is cut into batches, never on who computes them."""
    totals: dict[str, HessianAccumulator] = {}
    for batch in inputs:
        accs, handles = collect_hessians({idx: layer}, sites)
        try:
            with torch.no_grad():
                run(layer, batch)
        finally:
            for hd in handles:
                hd.remove()
        for (_, site), part in accs.items():
            totals[site] = (totals.get(site) or HessianAccumulator(part.in_features, device=part.xtx.device)).merge(part)
    return {site: acc.hessian(f"model.layers.{idx} {site}") for site, acc in totals.items()}


def layer_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(layer.named_modules())
    return {m: named[m].weight.detach().float().cpu() for m in layer_modules(layer)}


def quantize_layer(
    weights: dict[str, torch.Tensor],
    hessians: dict[str, torch.Tensor] | None,
    groups: dict[str, list[tuple[str, ...]]],
    *,
    method: str = "gptq",
    scale_rule: str = "4over6",
    act_order: bool = False,
    damp: float = 0.01,
    layer_name: str = "layer",
) -> dict[str, tuple[NVFP4Tensor, GPTQStats | None]]:
    """Quantize every Linear of one layer. Fused groups share the global scale, computed from
    the original weights before any GPTQ update."""
    out: dict[str, tuple[NVFP4Tensor, GPTQStats | None]] = {}
    for site, site_groups in groups.items():
        for group in site_groups:
            amax = group_amax(weights, group)
            for m in group:
                out[m] = quantize_module(weights[m], (hessians or {}).get(site), amax, method=method, scale_rule=scale_rule,
                                         act_order=act_order, damp=damp, name=f"{layer_name}.{m}")
    return out


def group_amax(weights: dict[str, torch.Tensor], group: tuple[str, ...]) -> torch.Tensor:
    """max |w| over a fused group: the amax its shared global scale is built on."""
    return max(weights[m].abs().max() for m in group)


def quantize_module(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    amax: torch.Tensor,
    *,
    method: str = "gptq",
    scale_rule: str = "4over6",
    act_order: bool = False,
    damp: float = 0.01,
    name: str = "linear",
) -> tuple[NVFP4Tensor, GPTQStats | None]:
    """One Linear, GPTQ or RTN, under its fused group's amax: members of a group can be quantized
    apart (in different processes) and still share their global scale."""
    if method == "rtn":
        return quantize_rtn(weight, scale_rule, global_amax=amax), None
    if method != "gptq":
        raise ValueError(f"method must be 'gptq' or 'rtn', got {method!r}")
    return gptq_quantize(weight, hessian, scale_rule=scale_rule, global_amax=amax, damp=damp, act_order=act_order, name=name)


def apply_quantized(layer: nn.Module, results: dict[str, NVFP4Tensor], packed: bool = False) -> None:
    """Replace a layer's Linears by their quantized versions: NVFP4Linear modules (packed) or
    the dequantized weights in the existing Linears, in the layer's dtype."""
    from sala.quant.linear import NVFP4Linear

    for name, q in results.items():
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        old = getattr(parent, child)
        if packed:
            setattr(parent, child, NVFP4Linear.from_quantized(q, old.bias).to(old.weight.device))
        else:
            old.weight.data = q.dequantize(old.weight.dtype).to(old.weight.device)


def quantize_sequential(model, seqs: torch.Tensor, quantize_fn, finished: dict[int, dict] | None = None, on_layer=None) -> dict[int, dict]:
    """Layer by layer: each layer's Hessians come from inputs that already went through the
    quantized layers before it, so GPTQ corrects the error those layers introduced.

    quantize_fn(layer_idx, weights, hessians, groups) returns {module: (NVFP4Tensor, stats)}.
    Layers already in
    `finished` are not quantized again, only applied. on_layer(idx, results) runs after each
    newly quantized layer (progress, checkpointing of partial results).
    """
    results = dict(finished or {})
    seqs = seqs.to(model.model.embed_tokens.weight.device)
    h = model.model.embed_tokens(seqs) * model.config.scale_emb
    rope = model.model.rope(torch.arange(seqs.shape[1], device=seqs.device).expand(seqs.shape[0], -1))
    for i, layer in enumerate(model.model.layers):
        if i not in results:
            hessians = {site: hs.cpu() for site, hs in
                        layer_hessians(layer, i, [h], lambda layer, x: layer(x, rope, None, None, x.shape[1])).items()}
            results[i] = quantize_fn(i, layer_weights(layer), hessians, layer_groups(layer))
            if on_layer is not None:
                on_layer(i, results[i])
        apply_quantized(layer, {m: q for m, (q, _) in results[i].items()})
        with torch.no_grad():
            h = layer(h, rope, None, None, seqs.shape[1])
    return results


@dataclass
class ModuleStats:
    """One quantized Linear, for either method: RTN has no GPTQStats, and the same errors
    make the two comparable."""

    layer: int
    module: str
    m4_share: float
    weight_error: float  # ||dW||^2 / ||W||^2
    output_error: float  # ||X dW^T||^2 / ||X W^T||^2 on the calibration inputs
    seconds: float  # per module; a fused group's time is split evenly


def quantize_model(model, seqs: torch.Tensor, method: str = "gptq", scale_rule: str = "4over6", *,
                   act_order: bool = False, damp: float = 0.01) -> tuple[dict, list[ModuleStats]]:
    """Quantize `model` layer by layer in this process, in place (its Linears end up holding
    the dequantized weights), with a progress bar on stderr. Returns {full module name:
    NVFP4Tensor} and one ModuleStats per module."""
    from tqdm import tqdm

    rows: list[ModuleStats] = []
    bar = tqdm(total=len(model.model.layers), desc="quantizing layers", unit="layer", file=sys.stderr)

    def quantize_fn(idx, weights, hessians, groups):
        results = {}
        for site, site_groups in groups.items():
            for group in site_groups:
                # One call per fused group, so the time is that group's own.
                t0 = time.perf_counter()
                done = quantize_layer(weights, hessians, {site: [group]}, method=method, scale_rule=scale_rule,
                                      act_order=act_order, damp=damp, layer_name=f"model.layers.{idx}")
                seconds = (time.perf_counter() - t0) / len(group)
                for m, (q, _) in done.items():
                    deq = q.dequantize()
                    rows.append(ModuleStats(idx, m, q.m4_share, relative_weight_error(weights[m], deq),
                                            relative_output_error(weights[m], deq, hessians[site]), seconds))
                results |= done
        bar.update(1)
        return results

    results = quantize_sequential(model, seqs, quantize_fn)
    bar.close()
    quantized = {f"model.layers.{i}.{m}": q for i, res in results.items() for m, (q, _) in res.items()}
    return quantized, rows
