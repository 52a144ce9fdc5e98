"""The NVIDIA GPU the kernels are built for: its compute capability, SM count and limits.

On a GPU these come from the device. Without one, an ahead-of-time compile (kernels/aot.py)
stands in for a target of ``TARGETS``: while it does, ``on_gpu`` sends every dispatch to its
Triton wrapper (which then launches nothing), and the wrappers read the stand-in's capability
and SM count, so each kernel is specialised exactly as it would be on that GPU.

The kernels need sm_80 or newer: Triton's tensor-core dots and async copies start there.
FP8 (E4M3) conversion instructions start at sm_89; below, the kernels decode FP8 bytes with
integer operations instead (``e4m3_to_float`` in kernels/nvfp4_gemm.py).
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    # How fp32 operands of tl.dot are multiplied: as three TF32 tensor-core products (about
    # fp32's accuracy), since "ieee" runs them as scalar FMAs over tiles that overflow the
    # registers into local memory. The interpreter computes every dot in full fp32 either way.
    FP32_DOT = tl.constexpr("tf32x3")
except ImportError:  # CPU installs may lack triton; the torch references still work
    triton = None

# Triton's interpreter (the CPU tests) multiplies bf16 / fp16 tl.dot operands as raw 16-bit
# integers (triton-lang/triton#11584), so under it kernels widen such operands to fp32 first.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

MIN_ARCH = 80
NATIVE_FP8_ARCH = 89
# The interpreter has no SMs; a small fixed count makes the tests' small shapes split 2-3 ways.
INTERPRETER_SM_COUNT = 4


@dataclass(frozen=True)
class Target:
    """One compile target and the limits of a representative GPU of it (CUDA occupancy tables,
    vendor bandwidth). ``latency_ns``: a typical DRAM load latency, for Little's law."""

    name: str  # as ptxas names it
    arch: int  # major * 10 + minor
    gpu: str
    sms: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int  # bytes, all of it usable by resident blocks
    smem_per_block: int  # the most one block may opt in to
    bandwidth: float  # bytes / s
    latency_ns: float
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255

    def bytes_in_flight_needed(self) -> float:
        """Bytes each SM must have requested and not yet received to keep DRAM busy:
        bandwidth x latency (Little's law), shared by the SMs."""
        return self.bandwidth * self.latency_ns * 1e-9 / self.sms

    def resident_blocks(self, registers: int, shared: int, num_warps: int) -> int:
        """Blocks of a kernel one SM holds at once: registers are allocated per warp in units
        of 256, and every block takes 1 KiB of shared memory for the system besides its own."""
        warp_regs = -(-max(registers, 1) * 32 // 256) * 256
        by_regs = self.regs_per_sm // warp_regs // num_warps
        by_smem = self.smem_per_sm // (shared + 1024)
        return min(self.max_warps_per_sm // num_warps, self.max_blocks_per_sm, by_regs, by_smem)


TARGETS = {
    t.name: t
    for t in (
        Target("sm_80", 80, "A100 80GB SXM", 108, 64, 32, 164 << 10, 163 << 10, 2.039e12, 500),
        Target("sm_89", 89, "L40S", 142, 48, 24, 100 << 10, 99 << 10, 0.864e12, 600),
        Target("sm_90a", 90, "H200 SXM", 132, 64, 32, 228 << 10, 227 << 10, 4.8e12, 600),
        Target("sm_100a", 100, "B200", 148, 64, 32, 228 << 10, 227 << 10, 8.0e12, 700),
        Target("sm_120", 120, "RTX PRO 6000 Blackwell", 188, 48, 24, 100 << 10, 99 << 10, 1.792e12, 600),
    )
}

_stand_in: Target | None = None


@contextlib.contextmanager
def standing_in(target: Target):
    """Kernels dispatch and specialise for `target` (kernels/aot.py sets Triton's driver too)."""
    global _stand_in
    previous, _stand_in = _stand_in, target
    try:
        yield target
    finally:
        _stand_in = previous


def on_gpu(x: torch.Tensor) -> bool:
    """Whether work on `x` goes to the Triton kernels: a CUDA tensor, or any while a target is
    stood in for (the torch references run everywhere else)."""
    return triton is not None and (x.is_cuda or _stand_in is not None)


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    # Cached: the device query costs microseconds, as much as a decode GEMV itself.
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def arch(device: torch.device) -> int | None:
    """The compute capability kernels on `device` are built for (90 for sm_90); None under the
    interpreter, which has every type."""
    if _stand_in is not None:
        return _stand_in.arch
    return _cuda_arch(_index(device)) if device.type == "cuda" else None


def native_fp8(device: torch.device) -> bool:
    """Whether the target converts FP8 E4M3 in hardware (sm_89 and newer; the interpreter too)."""
    a = arch(device)
    return a is None or a >= NATIVE_FP8_ARCH


def pick(table: dict[int, object], device: torch.device):
    """A per-target table's entry for `device`: the newest target at or below its capability
    (sm_86 takes sm_80's entry, sm_103 sm_100's). The interpreter stands for the oldest, sm_80:
    every table has an entry for it."""
    a = arch(device) or MIN_ARCH
    return table[max(k for k in table if k <= a)]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the target; INTERPRETER_SM_COUNT on CPU."""
    if _stand_in is not None:
        return _stand_in.sms
    return _cuda_sm_count(_index(device)) if device.type == "cuda" else INTERPRETER_SM_COUNT


class UnsupportedGPU(RuntimeError):
    """A CUDA device the kernels cannot run on."""


def require_supported(device: torch.device) -> None:
    """Raise UnsupportedGPU, in one line, for a CUDA device older than sm_80; nothing elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return
    a = _cuda_arch(_index(device))
    if a < MIN_ARCH:
        name = torch.cuda.get_device_name(device)
        raise UnsupportedGPU(f"{device} is {name}, compute capability {a // 10}.{a % 10}: sala's GPU kernels need "
                             f"compute capability {MIN_ARCH // 10}.{MIN_ARCH % 10} or newer (A100, A10/L4/L40, H100/H200, "
                             "B200, RTX 30xx and later); use device='cpu' on this machine")
