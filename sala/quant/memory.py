"""What quantizing a checkpoint needs in memory, from its config and the run's settings alone:
what pipelines/quantize.py prints before it loads anything, and what its workers check against
their device before they start.

A worker holds no more of the model than one decoder layer (sala/checkpoint.py reads it from the
shards), so nothing here grows with the number of layers:
- the calibration set's hidden states entering the layer it is at (fp32, host memory; on a GPU
  one shard at a time on the device);
- while it sums a layer's Hessians: the layer in fp32, one shard's activations, and every
  Hessian of the layer twice (the running sums and one shard's part);
- while it runs GPTQ on the widest Linear: the layer's Hessians, two more K x K matrices (the
  Cholesky factor and its inverse), and a few copies of the weight in fp32;
- RTN: a few fp32 copies of the largest weight.
The driver holds one shard of the output while writing it and, for the gate, one layer in fp32
beside its BF16 copy, every gate sequence's hidden states, and a chunk of lm_head and logits.
Figures are upper estimates of tensors; each Python process adds its runtime (RUNTIME_BYTES).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sala.quant.layerwise import layer_groups

FP32 = 4
RUNTIME_BYTES = 600 << 20  # an interpreter with torch and Ray imported, before any tensor
GIB = 1 << 30


def size(n: int) -> str:
    """A byte count as people read it."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


@dataclass(frozen=True, kw_only=True)
class QuantizeMemory:
    layer: int  # the largest decoder layer in fp32
    hessians: int  # all of its Hessians
    activations: int  # one calibration shard through one layer
    hidden_states: int  # every calibration shard's hidden states (host)
    gptq: int  # GPTQ of the widest Linear, besides the Hessians
    rtn: int  # RTN of the largest Linear
    driver: int  # the driver's largest stage (writing a shard, or the gate)

    @property
    def worker_device(self) -> int:
        """What a worker's device holds at its peak (a CPU worker's device is host memory)."""
        summing = self.layer + 2 * self.hessians + self.activations
        return max(summing, self.hessians + self.gptq, self.rtn)

    def worker_host(self, on_gpu: bool) -> int:
        return RUNTIME_BYTES + self.hidden_states + (0 if on_gpu else self.worker_device)

    @property
    def driver_host(self) -> int:
        return RUNTIME_BYTES + self.driver

    def describe(self, workers: int, on_gpu: bool) -> str:
        if self.layer:
            work = (f"a layer in fp32 {size(self.layer)}, its Hessians {size(self.hessians)} (twice while summed), a calibration "
                    f"shard's activations {size(self.activations)}; GPTQ of the widest Linear {size(self.gptq)} beside the Hessians")
        else:
            work = f"RTN of the largest Linear {size(self.rtn)}"
        hidden = f"calibration hidden states {size(self.hidden_states)}; " if self.hidden_states else ""
        if on_gpu:
            worker = (f"{size(self.worker_device)} of GPU memory ({work}) and {size(self.worker_host(True))} of host memory "
                      f"({hidden}its runtime)")
        else:
            worker = f"{size(self.worker_host(False))} of host memory ({work}; {hidden}its runtime)"
        return (f"memory     a worker needs {worker}; the driver {size(self.driver_host)}; {workers} worker(s) and the driver "
                f"on one host: {size(self.node_host(workers, on_gpu))}")

    def node_host(self, workers: int, on_gpu: bool) -> int:
        """Host memory of the driver and `workers` workers on one node."""
        return self.driver_host + workers * self.worker_host(on_gpu)


def quantize_memory(config, sequences: int, seq_len: int, shards: int, method: str, max_shard_bytes: int,
                    gate_tokens: int) -> QuantizeMemory:
    """The estimate for quantizing a model of `config` on `sequences` x `seq_len` calibration tokens
    cut into `shards`, writing shards of at most `max_shard_bytes`, with a gate over `gate_tokens`
    tokens (prompts and held-out windows)."""
    from sala.model import SALAForCausalLM

    with torch.device("meta"):
        model = SALAForCausalLM(config)
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers) * FP32
    hessians = gptq = rtn = 0
    for layer_module in model.model.layers:
        named = dict(layer_module.named_modules())
        sites = {site: named[groups[0][0]].in_features for site, groups in layer_groups(layer_module).items()}
        hessians = max(hessians, sum(k * k for k in sites.values()) * FP32)
        for groups in layer_groups(layer_module).values():
            for m in (m for g in groups for m in g):
                n, k = named[m].out_features, named[m].in_features
                # the factor and its inverse, the weight, its working copy and the dequantized result
                gptq = max(gptq, (2 * k * k + 3 * n * k) * FP32)
                rtn = max(rtn, 6 * n * k * FP32)  # the weight, its groups' scaled copies and codes
    quantized = {f"model.layers.{i}.{m}" for i, layer_module in enumerate(model.model.layers)
                 for groups in layer_groups(layer_module).values() for g in groups for m in g}
    output = sum(p.numel() * (9 / 16 if name.rsplit(".", 1)[0] in quantized else 2) for name, p in model.named_parameters())
    rows = -(-sequences // max(1, min(shards, sequences)))
    widest = max(config.intermediate_size * 3, config.hidden_size * 8)  # gate/up/act of the MLP, or the attention's q/k/v/gate/o
    activations = rows * seq_len * widest * FP32
    hidden_states = sequences * seq_len * config.hidden_size * FP32
    gate = layer + layer // 2 + gate_tokens * config.hidden_size * FP32 * 2 + 64 * config.vocab_size * FP32 * 3 \
        + 8192 * config.hidden_size * FP32
    driver = max(min(max_shard_bytes, int(output)), gate)
    if method == "rtn":  # reads no inputs: no layer, no Hessians, no hidden states
        return QuantizeMemory(layer=0, hessians=0, activations=0, hidden_states=0, gptq=0, rtn=rtn, driver=driver)
    return QuantizeMemory(layer=layer, hessians=hessians, activations=activations, hidden_states=hidden_states, gptq=gptq,
                          rtn=rtn, driver=driver)


class WontFit(RuntimeError):
    """A run that cannot fit the memory it would have: the message names what would fit."""


def available_host_bytes() -> int:
    """This machine's MemAvailable (what can be allocated without swapping), from /proc/meminfo."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def check_host(need: QuantizeMemory, workers: int, on_gpu: bool, available: int) -> None:
    """WontFit, naming the --workers that would fit (or what shrinks a worker), when the driver and
    `workers` workers need more host memory than `available`."""
    if need.node_host(workers, on_gpu) <= available:
        return
    fits = max((w for w in range(1, workers) if need.node_host(w, on_gpu) <= available), default=0)
    have = f"{workers} worker(s) and the driver need {size(need.node_host(workers, on_gpu))} of host memory, {size(available)} is available"
    if fits:
        raise WontFit(f"{have}: pass --workers {fits}")
    raise WontFit(f"{have}: even one worker does not fit; raise --shards or lower --num-samples / --seq-len (a worker's "
                  f"calibration activations and hidden states), or run on a machine with more memory")


def check_device(need: QuantizeMemory, device: torch.device) -> None:
    """WontFit when a worker's GPU has less free memory than it needs (a CPU worker's host is checked by the driver)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if free < need.worker_device:
        raise WontFit(f"a quantize worker needs {size(need.worker_device)} of GPU memory and its GPU has {size(free)} free; raise "
                      f"--shards or lower --seq-len (a calibration shard's activations are {size(need.activations)})")
