"""Every Triton kernel, built for every NVIDIA target at the launches the engine makes, no GPU needed.

    python -m sala.compile_check [--targets sm_80 sm_90a ...] [--workers N] [--all-rows]

For each target of kernels.target.TARGETS (sm_80, sm_89, sm_90a, sm_100a, sm_120) the code
paths the engine runs on a GPU are called with CPU tensors while kernels/aot.py stands in for
the target: the sala functions dispatch to their Triton wrappers as on CUDA, and every launch
is specialised as on that GPU (capability, SM count, FP8 support) and recorded instead of run.
The recorded launches are compiled with the triton wheel's ptxas, in parallel and cached by
Triton, and each cubin's resources are read back with its cuobjdump.

Two models, each in the dtypes the engine serves it in: the released 9B config and tiny-sala.
The sizes are the engine's own: decode batches at the sizes CUDA graphs are captured at
(graphs.graph_batch_sizes up to MAX_SEQS["cuda"]), prompt chunks up to the step's token budget
(MAX_BATCH_TOKENS["cuda"]), page tables one page wide and as wide as a graph's, pools small and
past 2^31 elements, every K/V format a plan can name, fp32 and bf16 lightning states, Medusa
trees of every tile size up to Medusa's default tree, and InfLLM-v2's sparse path where the
model reaches sparse_config.dense_len.

Prints the worst case of each kernel on each target (registers, spilled bytes, shared memory,
resident warps per SM; --all-rows: every specialisation and what launched it), the bytes the
memory-bound decode kernels keep in flight per SM against the bandwidth x latency each target
needs, and a JSON line. Exits 1 on a compile failure, a spill, shared memory over the target's
limit, or a kernel of kernels/ that no launch reached. CUDA graphs and torch.compile on CUDA
are not checked here (they need a device): bench/gpu_check.sh runs them.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from collections import defaultdict

import torch
import triton

import kernels
from kernels import aot
from kernels.lightning_decode import lightning_decode
from kernels.target import TARGETS
from sala import lightning, lightning_tree, sparse
from sala.config import MINICPM_SALA_9B, SALAConfig
from sala.engine.config import MAX_BATCH_TOKENS, MAX_SEQS, PAGE_SIZE
from sala.engine.graphs import graph_batch_sizes
from sala.kv.formats import DENSE_DTYPES, make_codec
from sala.kv.pages import KVPages, decode_attention
from sala.medusa.tree import MC_SIM_7B_63, build_tree
from sala.model import DecoderLayer
from sala.process_exit import exit_now
from sala.quant.layerwise import layer_groups
from sala.quant.linear import NVFP4Linear
from sala.tiny import RECIPE

OFF64_ELEMENTS = 2**31  # a pool this large takes 64-bit offsets in the paged decode kernel
TREE_PATHS = (5, 31, 63)  # trees of 6, 32 and 64 nodes: every tile size up to Medusa's default tree


class Model:
    """One checked config: its first sparse and first lightning layer as the engine serves a
    quantized checkpoint, and how it runs: (dtype, whether its Linears are packed NVFP4)."""

    def __init__(self, name: str, config: SALAConfig, runs: tuple[tuple[torch.dtype, bool], ...]):
        self.name, self.config, self.runs = name, config, runs
        self.sparse_layer = quantized_layer(config, config.sparse_layers[0])
        self.lightning_layer = quantized_layer(config, config.lightning_layers[0]) if config.lightning_layers else None


def models() -> list[Model]:
    """Each checkpoint in the dtype it loads in: the 9B in bf16 (NVFP4 or not: the BF16 run is
    the NVFP4 one without the W4A16 launches); tiny-sala in fp32 as built, and in bf16 once
    quantized (sala.checkpoint.load_model's default for an NVFP4 checkpoint)."""
    tiny = SALAConfig(vocab_size=RECIPE["vocab_size"], **RECIPE["config"])
    return [Model("9B", SALAConfig(**MINICPM_SALA_9B), ((torch.bfloat16, True),)),
            Model("tiny-sala", tiny, ((torch.float32, False), (torch.bfloat16, True)))]


def quantized_layer(config: SALAConfig, index: int) -> DecoderLayer:
    """Decoder layer `index` with every Linear of LAYER_GROUPS packed NVFP4 (storage allocated,
    values irrelevant), the members of a fused group under one global scale and different groups
    under different ones, as a quantized checkpoint loads; then fused as Engine fuses it."""
    with torch.device("meta"):
        layer = DecoderLayer(config, index)
    for number, group in enumerate((g for gs in layer_groups(layer).values() for g in gs), start=1):
        for name in group:
            old = layer.get_submodule(name)
            new = NVFP4Linear(old.in_features, old.out_features, old.bias is not None)
            new.weight_global_scale.fill_(number)
            parent, _, child = name.rpartition(".")
            layer.get_submodule(parent).register_module(child, new)
    layer.self_attn.fuse()
    layer.mlp.fuse()
    return layer


def pool(codec, num_pages: int, n_kv: int, d: int) -> KVPages:
    """A K or V pool in the engine's layout, its storage left untouched: a pool past 2^31
    elements would take gigabytes to zero, and only its layout reaches the kernels."""
    pages = KVPages(codec, 1, PAGE_SIZE, n_kv, d, "cpu")
    pages.data = torch.empty(num_pages, *pages.data.shape[1:], dtype=pages.data.dtype)
    if pages.scale is not None:
        pages.scale = torch.empty(num_pages, *pages.scale.shape[1:], dtype=pages.scale.dtype)
    return pages


class Launches:
    """Calls the engine's GPU code paths for one model and dtype, naming each for the recorder."""

    def __init__(self, model: Model, dtype: torch.dtype, quantized: bool, recorder: aot.Recorder):
        self.model, self.config, self.dtype, self.quantized, self.recorder = model, model.config, dtype, quantized, recorder
        self.decode_rows = graph_batch_sizes(MAX_SEQS["cuda"])
        self.prompt_rows = (1, 100, MAX_BATCH_TOKENS["cuda"])  # one token, a ragged chunk, a full step

    def doing(self, what: str) -> None:
        self.recorder.label = f"{self.model.name} {str(self.dtype).removeprefix('torch.')} {what}"

    def heads(self, layer: DecoderLayer, n: int):
        """q, k, v [1, H, n, D] of n tokens laid out as QKVOProjections.heads leaves them: views
        of the fused projection's output."""
        attn = layer.self_attn
        fused = torch.empty(1, n, sum(attn.split_sizes), dtype=self.dtype)
        return [x.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2) for x in fused.split(attn.split_sizes, -1)[:3]]

    def run(self) -> None:
        if self.quantized:
            self.linears()
        self.sparse_attention()
        if self.model.lightning_layer is not None:
            self.lightning()

    def linears(self) -> None:
        for layer in filter(None, (self.model.sparse_layer, self.model.lightning_layer)):
            for name, linear in layer.named_modules():
                if isinstance(linear, NVFP4Linear):
                    for m in (*self.decode_rows, *self.prompt_rows):
                        self.doing(f"W4A16 {name} M={m}")
                        linear(torch.empty(m, linear.in_features, dtype=self.dtype))

    def kv_formats(self) -> list[tuple[str, list[float] | None]]:
        """Every K/V format a plan can give a layer served in this dtype; FP8 and NVFP4 with and
        without calibration (calibrated FP8 scales per head, uncalibrated per token)."""
        amax = [1.0] * self.config.num_key_value_heads
        return ([(n, None) for n, dt in DENSE_DTYPES.items() if dt == self.dtype]
                + [(f, a) for f in ("fp8", "nvfp4", "nvfp4_4over6") for a in (None, amax)])

    def sparse_attention(self) -> None:
        from kernels.prefill_attention import prefill_attention

        c, attn = self.config, self.model.sparse_layer.self_attn
        n_kv, d, scale = attn.n_kv, attn.head_dim, attn.head_dim**-0.5
        graph_width = -(-c.max_position_embeddings // PAGE_SIZE)
        q, k, _ = self.heads(self.model.sparse_layer, 2)
        q_dec, k_rows = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [n, H, D] as attend_step passes them
        for fmt, amax in self.kv_formats():
            name = fmt + (" calibrated" if amax else "")
            for pages in (graph_width + 1, OFF64_ELEMENTS // (PAGE_SIZE * n_kv * d) + 1):
                kp, vp = pool(make_codec(fmt, amax), pages, n_kv, d), pool(make_codec(fmt, amax), pages, n_kv, d)
                self.doing(f"K/V write {name}")
                kp.write(torch.arange(2), k_rows)
                for width in (1, graph_width):  # an eager step's table, and a graph's as wide as the longest request
                    self.doing(f"decode attention {name}, {pages} pages, tables {width} wide")
                    decode_attention(q_dec, kp, vp, torch.zeros(2, width, dtype=torch.long), torch.ones(2, dtype=torch.long),
                                     scale)
        for t in self.prompt_rows:
            q, k, v = self.heads(self.model.sparse_layer, t)
            self.doing(f"prefill attention, {t} new tokens")
            prefill_attention(q[0], k[0], v[0])
            cached = torch.empty(n_kv, PAGE_SIZE + t, d, dtype=self.dtype)  # read back from the pages
            self.doing(f"prefill attention, {t} tokens after {PAGE_SIZE}")
            prefill_attention(q[0], cached, cached)
        s = sparse.SparseSettings.of(c)
        if c.max_position_embeddings <= s.dense_len:
            return
        for t in (MAX_BATCH_TOKENS["cuda"], 1):  # a prompt chunk and a decode row past dense_len
            q, _, _ = self.heads(self.model.sparse_layer, t)
            keys = torch.empty(s.dense_len + t, n_kv, d, dtype=self.dtype)
            k1, k2 = (torch.empty(sparse.num_windows(s.dense_len + t, size, stride), n_kv, d, dtype=self.dtype)
                      for size, stride in s.levels)
            self.doing(f"InfLLM-v2, {t} tokens after {s.dense_len}")
            sparse.infllm_v2_attention(q[0], keys, keys, k1, k2, s.dense_len, s.dense_len + (t if t > 1 else 0), s, scale)

    def lightning(self) -> None:
        attn = self.model.lightning_layer.self_attn
        g = attn.consts.get("log_decay", torch.device("cpu"))
        h, d = attn.n_heads, attn.head_dim
        for t in self.prompt_rows:
            q, k, v = (x.float() for x in self.heads(self.model.lightning_layer, t))
            self.doing(f"lightning prefill, {t} tokens")
            lightning.chunked(q, k, v, g, attn.scale, torch.empty(1, h, d, d))
            padded = [torch.empty(2, h, t, d) for _ in range(3)]  # several prompt chunks as one padded batch
            self.doing(f"lightning prefill, 2 chunks of up to {t} tokens")
            lightning.chunked(*padded, g, attn.scale, torch.empty(2, h, d, d), lengths=torch.tensor([t, max(1, t // 2)]))
        for state_dtype in (torch.float32, torch.bfloat16):  # a plan keeps a layer's states in either
            states = torch.empty(MAX_SEQS["cuda"] + 1, h, d, d, dtype=state_dtype)
            q = torch.empty(2, h, d)
            self.doing(f"lightning decode, {str(state_dtype).removeprefix('torch.')} states")
            lightning_decode(q, q, q, g, attn.scale, states, torch.arange(2))
        for paths in TREE_PATHS:
            tree = build_tree(MC_SIM_7B_63[:paths])
            nodes = torch.empty(2, h, tree.num_nodes, d)
            self.doing(f"Medusa tree verify, {tree.num_nodes} nodes")
            lightning_tree.tree_parallel(nodes, nodes, nodes, g, attn.scale, torch.empty(2, h, d, d), tree.depths,
                                         tree.ancestor_mask)


def launched_kernels() -> list[str]:
    """Every kernel of kernels/ (the JIT functions named *_kernel; the others are device functions they call)."""
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        found += [f"{module.__name__}:{n}" for n, f in vars(module).items()
                  if isinstance(f, triton.runtime.JITFunction) and n.endswith("_kernel") and f.__module__ == module.__name__]
    return sorted(found)


# HBM bytes one program's loads request per loop iteration, by kernel: what it keeps in flight
# before its first use (Triton issues a loop body's loads together), from the launch's tile
# sizes and pointer types.
def _w4a16_bytes(c: dict, signature: dict) -> int:
    return c["BLOCK_N"] * c["BLOCK_K"] // 2 + c["BLOCK_N"] * c["BLOCK_K"] // 16  # codes and FP8 scales


def _paged_bytes(c: dict, signature: dict) -> int:
    dense = 4 if signature["q_ptr"] == "*fp32" else 2
    per_element = {0: dense, 1: 1, 2: 1, 3: 0.5 + 1 / 16}  # dense, FP8 (+ a per-row scale), NVFP4 (+ group scales)
    rows = c["BLOCK_N"]
    return int(sum(rows * c["HEAD_DIM"] * per_element[c[f]] + (4 * rows if c[f] == 2 else 0) for f in ("K_FMT", "V_FMT")))


def _state_bytes(c: dict, signature: dict) -> int:
    return c["BLOCK_K"] * c["BLOCK_V"] * (4 if signature["s_ptr"] == "*fp32" else 2)


IN_FLIGHT = {  # kernel: (name, bytes a program requests an iteration, whether a launch is a decode one)
    "kernels.nvfp4_gemm:_nvfp4_matmul_kernel": ("W4A16, M <= 16", _w4a16_bytes, lambda c: c["PARTIAL"]),
    "kernels.paged_attention:_paged_decode_kernel": ("paged decode", _paged_bytes, lambda c: True),
    "kernels.lightning_decode:_lightning_decode_kernel": ("lightning decode", _state_bytes, lambda c: True),
}


def in_flight_rows(builds: list[aot.Build]) -> list[dict]:
    """Per memory-bound decode kernel and target, over the 9B model's decode launches: the
    fewest bytes in flight per SM (resident programs x bytes each requests an iteration), and
    the target's bandwidth x latency / SMs."""
    worst: dict[tuple[str, str], dict] = {}
    for b in builds:
        if b.launch.kernel not in IN_FLIGHT or b.error or not b.uses[0].startswith("9B"):
            continue
        name, tile_bytes, applies = IN_FLIGHT[b.launch.kernel]
        c = b.launch.constants
        if not applies(c):
            continue
        per_program = tile_bytes(c, b.launch.signature)
        if "K_FMT" in c:  # one row per K/V format
            name = f"{name}, {('dense', 'FP8', 'FP8', 'NVFP4')[c['K_FMT']]} K/V"
        programs = b.target.resident_blocks(b.registers, b.shared, b.num_warps)
        row = {"kernel": name, "target": b.launch.target, "programs_per_sm": programs, "bytes_per_program": per_program,
               "in_flight": programs * per_program, "needed": round(b.target.bytes_in_flight_needed())}
        key = (name, b.launch.target)
        if key not in worst or row["in_flight"] < worst[key]["in_flight"]:
            worst[key] = row
    return list(worst.values())


def _short(kernel: str) -> str:
    return kernel.split(":")[1].strip("_").removesuffix("_kernel")


def summary_rows(builds: list[aot.Build]) -> list[dict]:
    """The worst specialisation of each kernel on each target."""
    by = defaultdict(list)
    for b in builds:
        by[(b.launch.kernel, b.launch.target)].append(b)
    rows = []
    for (kernel, target), bs in by.items():
        ok = [b for b in bs if not b.error]
        rows.append({
            "kernel": _short(kernel), "target": target, "specialisations": len(bs), "failed": len(bs) - len(ok),
            "max_registers": max((b.registers for b in ok), default=0),
            "local_ops": sum(b.local_ops for b in ok),
            "max_shared": max((b.shared for b in ok), default=0),
            "min_resident_warps": min((b.resident_warps for b in ok), default=0),
        })
    return sorted(rows, key=lambda r: (r["kernel"], list(TARGETS).index(r["target"])))


def print_table(rows: list[dict], columns: list[tuple[str, str, int]]) -> None:
    print("  ".join(f"{title:>{w}}" if w > 0 else f"{title:<{-w}}" for title, _, w in columns))
    for r in rows:
        print("  ".join(f"{r[key]!s:>{w}}" if w > 0 else f"{r[key]!s:<{-w}}" for _, key, w in columns))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: one per core)")
    p.add_argument("--all-rows", action="store_true", help="one row per specialisation, with what launched it")
    p.add_argument("--kernels", nargs="+", help="build only kernels whose name contains one of these (while tuning one)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    checked = models()
    recorders = []
    for name in args.targets:
        with aot.capture(TARGETS[name]) as recorder:
            for model in checked:
                for dtype, quantized in model.runs:
                    Launches(model, dtype, quantized, recorder).run()
        recorders.append(recorder)
    captured = time.perf_counter() - t0
    if args.kernels:
        for r in recorders:
            r.launches = {k: v for k, v in r.launches.items() if any(s in k.kernel for s in args.kernels)}
    builds = aot.build(recorders, args.workers)
    seconds = time.perf_counter() - t0
    if args.all_rows:
        rows = [{"kernel": _short(b.launch.kernel), "target": b.launch.target, "regs": b.registers,
                 "spill": b.local_ops, "shared": b.shared, "warps": b.num_warps, "resident": b.resident_warps,
                 "use": b.uses[0] + (f" (+{len(b.uses) - 1})" if len(b.uses) > 1 else "")}
                for b in builds if not b.error]
        print_table(rows, [("kernel", "kernel", -18), ("target", "target", -7), ("regs", "regs", 4), ("spill ld/st", "spill", 11),
                           ("smem B", "shared", 7), ("warps", "warps", 5), ("warps/SM", "resident", 8),
                           ("launched for", "use", -60)])
        print()
    summary = summary_rows(builds)
    print(f"Triton kernels built for {len(args.targets)} targets: {len(builds)} specialisations; worst case of each "
          "kernel on each target (CUDA graphs and torch.compile need a GPU: bench/gpu_check.sh)")
    print_table(summary, [("kernel", "kernel", -18), ("target", "target", -7), ("specs", "specialisations", 5),
                          ("failed", "failed", 6), ("max regs", "max_registers", 8), ("spill ld/st", "local_ops", 11),
                          ("max smem B", "max_shared", 10), ("min warps/SM", "min_resident_warps", 12)])
    flight = in_flight_rows(builds)
    print("\nDecode kernels, bytes in flight per SM (resident programs x HBM bytes each requests per loop iteration) "
          "against bandwidth x latency / SMs")
    print_table(flight, [("kernel", "kernel", -24), ("target", "target", -7), ("programs/SM", "programs_per_sm", 11),
                         ("B/program", "bytes_per_program", 9), ("in flight B", "in_flight", 11), ("needed B", "needed", 8)])
    problems = [f"{b.launch.kernel} on {b.launch.target} ({b.uses[0]}): {p}" for b in builds for p in b.problems()]
    reached = {(b.launch.kernel, b.launch.target) for b in builds}
    problems += [f"{k} on {t}: no launch reached it (add its launch to sala/compile_check.py)"
                 for k in launched_kernels() for t in args.targets
                 if (k, t) not in reached and (not args.kernels or any(s in k for s in args.kernels))]
    for line in problems:
        print(f"FAIL {line}", file=sys.stderr)
    print(f"\n{len(problems)} problems; captured in {captured:.1f} s, built in {seconds - captured:.1f} s")
    print(json.dumps({"bench": "compile_check", "targets": args.targets, "specialisations": len(builds),
                      "problems": problems, "seconds": round(seconds, 1), "kernels": summary, "in_flight": flight}))
    return 1 if problems else 0


if __name__ == "__main__":
    exit_now(main())
