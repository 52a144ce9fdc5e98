"""Ahead-of-time builds of the Triton kernels for NVIDIA GPUs this machine does not have.

``capture(target)``: while it is active, Triton's driver is a stand-in that reports the target
and the kernels dispatch for it (kernels/target.py), so calling the code that launches them
specialises every kernel exactly as a launch on that GPU would: same constants, same integer
and alignment specialisations, same options. The launch compiles and runs nothing: Triton's
``jit_cache_hook`` records the specialisation instead.

``build(launches)`` compiles what was recorded, in parallel processes, with the ``ptxas`` the
triton wheel ships, and reads each cubin's registers, stack, local and shared memory and its
local-memory instructions with the wheel's ``cuobjdump``. Both are cached by the kernel's hash
(of its source, target and options; Triton's cache directory): an unchanged kernel is neither
compiled nor read twice.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from kernels import target as targets

# Triton 3.9's default, stated: unset, every compiling process warns that the default will change.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@dataclass(frozen=True)
class Launch:
    """One specialisation of one kernel for one target, as a launch recorded it."""

    kernel: str  # module:function
    target: str  # a key of kernels.target.TARGETS
    spec: str  # Triton's specialization data (JSON): signature, constants, attributes, options

    @property
    def constants(self) -> dict:
        """The launch's constexpr arguments by name."""
        data = json.loads(self.spec)
        names = list(data["signature"])
        return {names[k[0]]: v for k, v in zip(data["constant_keys"], data["constant_vals"]) if len(k) == 1}

    @property
    def signature(self) -> dict:
        """Every argument's type by name ("*bf16", "i32", "constexpr", ...)."""
        return json.loads(self.spec)["signature"]


@dataclass
class Build:
    launch: Launch
    uses: list[str]  # what launched it (the capturing code's labels)
    error: str | None = None
    registers: int = 0
    stack: int = 0  # bytes of stack frame a thread
    local: int = 0  # bytes of local memory a thread
    local_ops: int = 0  # instructions that load or store local memory: spills, or arrays the registers cannot hold
    shared: int = 0
    num_warps: int = 0
    num_stages: int = 0

    @property
    def target(self) -> targets.Target:
        return targets.TARGETS[self.launch.target]

    @property
    def spilled(self) -> bool:
        # Not the stack size: LLVM can leave an unused few-byte frame that is never touched.
        return self.local_ops > 0

    @property
    def resident_warps(self) -> int:
        if self.error:
            return 0
        return self.target.resident_blocks(self.registers, self.shared, self.num_warps) * self.num_warps

    def problems(self) -> list[str]:
        """Why this build is not fit to ship: a failed compile, a spill, too much shared memory."""
        if self.error:
            return [f"does not compile: {self.error}"]
        out = []
        if self.spilled:
            out.append(f"spills: {self.local_ops} local-memory loads and stores ({self.stack} B of stack a thread)")
        if self.shared > self.target.smem_per_block:
            out.append(f"{self.shared} B of shared memory, over the {self.target.smem_per_block} B a block may have")
        return out


class _StandInDriver:
    """Triton's view of a GPU of `target`: what it compiles for, and nothing to launch on."""

    def __init__(self, target: targets.Target):
        self.target = GPUTarget("cuda", target.arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        # JIT functions cache their binder per device: one per target keeps targets apart.
        return self.target.arch

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _driver(target: targets.Target):
    active = triton.runtime.driver
    previous = active._active  # None (the lazily made default) on a machine without a GPU
    active.set_active(_StandInDriver(target))
    try:
        yield
    finally:
        active._active = previous


class Recorder:
    """The launches seen while capturing; ``label`` names what the caller is launching now."""

    def __init__(self, target: targets.Target):
        self.target = target
        self.label = ""
        self.launches: dict[Launch, list[str]] = {}

    def __call__(self, *, fn, compile, **_) -> bool:
        launch = Launch(f"{fn.module}:{fn.name}", self.target.name, compile["specialization_data"])
        uses = self.launches.setdefault(launch, [])
        if self.label not in uses:
            uses.append(self.label)
        return True  # handled: Triton compiles and launches nothing


@contextlib.contextmanager
def capture(target: targets.Target):
    """Record every kernel launch made inside, specialised for `target`, instead of running it."""
    recorder = Recorder(target)
    knobs = triton.knobs.runtime
    previous_hook = knobs.jit_cache_hook
    with _driver(target), targets.standing_in(target):
        knobs.jit_cache_hook = recorder
        try:
            yield recorder
        finally:
            knobs.jit_cache_hook = previous_hook


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


_LOCAL_OPS = re.compile(r"\b(LDL|STL)\b")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers a thread, stack and local bytes a thread, static shared bytes (cuobjdump's
    --dump-resource-usage of a one-kernel cubin) and the local-memory loads and stores in its
    machine code (cuobjdump -sass)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "-sass"))
    m = _USAGE.search(usage)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage!r}")
    reg, stack, shared, local = map(int, m.groups())
    return {"registers": reg, "stack": stack, "local": local, "static_shared": shared,
            "local_ops": len(_LOCAL_OPS.findall(sass))}


def _cached_usage(kernel) -> dict[str, int]:
    """resource_usage of a compiled kernel, kept beside Triton's cache under the kernel's hash
    (of its source, target and options): an unchanged kernel is neither compiled nor read twice."""
    path = os.path.join(triton.knobs.cache.dir, "resource_usage", f"{kernel.metadata.hash}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        usage = resource_usage(kernel.asm["cubin"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
            json.dump(usage, f)
        os.replace(f.name, path)  # whole or absent, whichever worker gets there first
        return usage


def _build_one(launch: Launch) -> dict:
    """Compile one launch (in a worker process) and read its cubin."""
    module, name = launch.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    with _driver(targets.TARGETS[launch.target]):
        try:
            kernel = fn.preload(launch.spec)
        except Exception as e:  # a compile error of any kind is the finding, not a crash of the check
            return {"error": _one_line(e)}
    usage = dict(_cached_usage(kernel))
    # Triton's shared memory is dynamic (metadata.shared); cuobjdump's SHARED is the static part.
    usage["shared"] = kernel.metadata.shared + usage.pop("static_shared")
    return {**usage, "num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages}


def _one_line(e: BaseException) -> str:
    """The innermost cause, on one line: Triton's CompilationError of a kernel wraps one per
    inlined function, each quoting source; the reason is the innermost's error_message."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(getattr(e, "error_message", None) or e).split())
    return f"{type(e).__name__}: {text[-300:]}"


def build(recorders: list[Recorder], workers: int | None = None) -> list[Build]:
    """Compile every recorded launch, `workers` at a time (default: one per core)."""
    jobs = [(launch, uses) for r in recorders for launch, uses in r.launches.items()]
    results = _run_isolated([launch for launch, _ in jobs], max(1, min(workers or os.cpu_count() or 1, len(jobs))))
    return [Build(launch, uses, **result) for (launch, uses), result in zip(jobs, results)]


def _run_isolated(launches: list[Launch], workers: int) -> list[dict]:
    """_build_one of every launch in worker processes. A compiler that crashes its process
    (ptxas or LLVM aborting) breaks the pool: the launches left are then built one process at
    a time, so the one that crashes is reported as such and the others still build."""
    # Spawned, not forked: the workers need none of this process's state, and forking a process
    # that has started torch's threads can hang the child.
    spawn = multiprocessing.get_context("spawn")
    results: dict[int, dict] = {}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        futures = {pool.submit(_build_one, launch): i for i, launch in enumerate(launches)}
        for future in concurrent.futures.as_completed(futures):
            with contextlib.suppress(concurrent.futures.process.BrokenProcessPool):
                results[futures[future]] = future.result()
    for i, launch in enumerate(launches):
        if i not in results:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as alone:
                try:
                    results[i] = alone.submit(_build_one, launch).result()
                except concurrent.futures.process.BrokenProcessPool:
                    results[i] = {"error": "the compiler crashed its process"}
    return [results[i] for i in range(len(launches))]

