"""What quantizing a checkpoint needs in memory, from its config and the run's settings alone:
what pipelines/quantize.py prints and checks (pipelines/capacity.py) before it loads anything,
and what a GPU worker checks against its device before it starts.

A worker holds no more of the model than one decoder layer (sala/checkpoint.py reads it from the
shards), so nothing here grows with the number of layers:
- the calibration set's hidden states entering the layer it is at (fp32, host memory; on a GPU
  one shard at a time on the device);
- while it sums a layer's Hessians: the layer in fp32, one shard's activations, and every
  Hessian of the layer twice (the running sums and one shard's part);
- while it runs GPTQ on the widest Linear [N, K]: the layer's Hessians and, beside them, at most
  3 K^2 + 8 N K fp32 values (gptq_bound): the Cholesky factor of H and its inverse while they
  are made, then the weight's working copy and FourOverSix's candidates, the dequantized result
  and the statistics' products;
- RTN: a few fp32 copies of the largest weight.
The driver holds one shard of the output while writing it and, for the gate, one layer in fp32
beside its BF16 copy, every gate sequence's hidden states, and a chunk of lm_head and logits.
Figures are upper estimates of tensors; each process adds its runtime (sala.footprint.RUNTIME_BYTES).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sala.footprint import RUNTIME_BYTES, MemoryShortfall, Need, gib
from sala.quant.layerwise import layer_groups

FP32 = 4


def gptq_bound(n: int, k: int) -> int:
    """fp32 values sala.quant.gptq.gptq_quantize holds at its peak beside the Hessian of an [n, k]
    weight, 3 k^2 + 8 n k: above its peak measured on CPU (the process's high-water mark, allocator
    included) at k = 1024 and 2048 with n = 4k (30.6 and 28.8 k^2), k = n = 4096 (7.5 k^2),
    k = 4096, n = 16384 (17.8 k^2), k = 8192, n = 1024 (2.4 k^2) and the 9B's down_proj,
    k = 16384, n = 4096 (2.3 k^2, where the bound says 5)."""
    return 3 * k * k + 8 * n * k


@dataclass(frozen=True, kw_only=True)
class QuantizeMemory:
    layer: int  # the largest decoder layer in fp32
    hessians: int  # all of its Hessians
    activations: int  # one calibration shard through one layer
    hidden_states: int  # every calibration shard's hidden states (host)
    gptq: int  # GPTQ of the widest Linear, besides the Hessians
    rtn: int  # RTN of the largest Linear
    driver_work: int  # the driver's largest stage (writing a shard, or the gate)

    @property
    def worker_device(self) -> int:
        """What a worker's device holds at its peak (a CPU worker's device is host memory)."""
        if not self.layer:  # RTN reads no inputs: no layer, no Hessians
            return self.rtn
        return max(self.layer + 2 * self.hessians + self.activations, self.hessians + self.gptq)

    def worker(self, on_gpu: bool) -> Need:
        """A worker's host memory: on a GPU its hidden states and runtime, on a CPU its work too."""
        work = {} if on_gpu else {"its peak (Hessians summed, or GPTQ)" if self.layer else "RTN": self.worker_device}
        hidden = {"calibration hidden states": self.hidden_states} if self.hidden_states else {}
        return Need("quantize worker", 0, work | hidden | {"runtime": RUNTIME_BYTES})

    def driver(self) -> Need:
        return Need("quantize driver", 0, {"writing a shard, or the gate": self.driver_work, "runtime": RUNTIME_BYTES})

    def describe(self, on_gpu: bool) -> str:
        if self.layer:
            work = (f"a layer in fp32 {gib(self.layer)}, its Hessians {gib(self.hessians)} twice while summed, a calibration "
                    f"shard's activations {gib(self.activations)}; then GPTQ of the widest Linear, {gib(self.gptq)} beside the "
                    "Hessians")
        else:
            work = f"RTN of the largest Linear {gib(self.rtn)}"
        hidden = f"calibration hidden states {gib(self.hidden_states)}, " if self.hidden_states else ""
        worker = self.worker(on_gpu).total
        if on_gpu:
            worker_text = f"{gib(self.worker_device)} of GPU memory ({work}) and {gib(worker)} of host memory ({hidden}runtime)"
        else:
            worker_text = f"{gib(worker)} of host memory (at its peak {gib(self.worker_device)}: {work}; {hidden}runtime)"
        return (f"memory     a worker needs {worker_text}; the driver {gib(self.driver().total)} (writing a shard of the "
                f"output, or the gate: {gib(self.driver_work)}; runtime)")


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
    quantized = set()
    for i, layer_module in enumerate(model.model.layers):
        named = dict(layer_module.named_modules())
        groups = layer_groups(layer_module)
        hessians = max(hessians, sum(named[g[0][0]].in_features ** 2 for g in groups.values()) * FP32)
        for m in (m for gs in groups.values() for g in gs for m in g):
            quantized.add(f"model.layers.{i}.{m}")
            n, k = named[m].out_features, named[m].in_features
            gptq = max(gptq, gptq_bound(n, k) * FP32)
            rtn = max(rtn, 6 * n * k * FP32)  # the weight, its groups' scaled copies and codes
    output = sum(p.numel() * (9 / 16 if name.rsplit(".", 1)[0] in quantized else 2) for name, p in model.named_parameters())
    rows = -(-sequences // max(1, min(shards, sequences)))
    widest = max(config.intermediate_size * 3, config.hidden_size * 8)  # gate/up/act of the MLP, or the attention's q/k/v/gate/o
    gate = layer + layer // 2 + gate_tokens * config.hidden_size * FP32 * 2 + 64 * config.vocab_size * FP32 * 3 \
        + 8192 * config.hidden_size * FP32
    driver_work = max(min(max_shard_bytes, int(output)), gate)
    if method == "rtn":  # reads no inputs: no layer, no Hessians, no hidden states
        return QuantizeMemory(layer=0, hessians=0, activations=0, hidden_states=0, gptq=0, rtn=rtn, driver_work=driver_work)
    return QuantizeMemory(layer=layer, hessians=hessians, activations=rows * seq_len * widest * FP32,
                          hidden_states=sequences * seq_len * config.hidden_size * FP32, gptq=gptq, rtn=rtn,
                          driver_work=driver_work)


def check_device(need: QuantizeMemory, device: torch.device) -> None:
    """MemoryShortfall when a worker's GPU has less free memory than it needs (hosts are checked
    before the workers start, pipelines/capacity.py)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if free < need.worker_device:
        raise MemoryShortfall(f"a quantize worker needs {gib(need.worker_device)} of GPU memory and its GPU has {gib(free)} "
                              f"free; raise --shards or lower --seq-len (a calibration shard's activations are "
                              f"{gib(need.activations)})")
