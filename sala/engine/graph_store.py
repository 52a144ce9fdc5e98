"""Compiled steps kept on disk across starts (CPU), beside torch's own compile caches.

Compiling a step traces the model with dynamo on every start, even where inductor's caches
hold the code: on tiny-sala the decode step takes 5.3 s to compile from warm caches and 1.4 s
to load once traced. So each graph a `CompiledStep` (sala/engine/graphs.py) compiles, in
torch.compile's ahead-of-time form (the traced bytecode, its guards and inductor's code), is
saved here, and the next process that compiles the same step for the same engine loads it: a
second start, a restarted replica, every batch actor after the first. Compiling ahead of time
does not read AOTAutograd's cache, so a step with nothing saved compiles as from cold (15-16 s
for tiny-sala's decode step), once per key. A file's path is its key:

- its directory: the step, the engine settings a step compiles in (the pools' shapes, the cache
  plan, typical acceptance's constants), the model's config, the structure of the modules the
  step runs (each submodule's class, each parameter's and buffer's dtype and shape: a model
  quantized in memory has its config unchanged, and the guards of the other's graph fail on it),
  the device, torch's thread count (inductor's C++ is compiled for it), the versions of Python,
  torch and transformers, and a digest of the sources of sala and kernels (a graph runs the code
  that was traced);
- its name: the sizes that were symbols and the static parts of the step's arguments.

A loaded graph runs only if its guards pass on the arguments at hand (checked once, as
torch.compile checks a graph before its first run); else, or if the file cannot be read, the
step is compiled again and the file replaced, with a log line, never an error. The files live
in inductor's cache directory (TORCHINDUCTOR_CACHE_DIR; by default under /tmp), whose compiled
C++ they load: clearing one clears the other.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import platform
from pathlib import Path

import torch
import transformers
from torch.utils import _pytree as pytree

import kernels
import sala
from sala.engine.step_costs import device_kind

log = logging.getLogger(__name__)


@functools.cache
def sources_digest() -> str:
    """A digest of every Python source of sala and kernels, the code a compiled step traces."""
    digest = hashlib.sha256()
    for package in (sala, kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{package.__name__}/{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def static_parts(value) -> object:
    """What of an argument's pytree is compiled in, as plain data: tensors by dtype and shape (the
    guards check those), numbers, strings and lists by value, other objects by type."""
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {tuple(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [static_parts(v) for v in value]
    return type(value).__qualname__


def spec_parts(spec: pytree.TreeSpec) -> list:
    """A pytree's structure with its static parts (`static_parts` of each node's context)."""
    return [spec.type.__qualname__ if spec.type else None, static_parts(spec.context),
            [spec_parts(child) for child in spec.children()]]


def structure(module: torch.nn.Module) -> list:
    """What a graph's guards check of a module tree, as plain data: each submodule's class and
    each of its parameters' and buffers' dtype and shape."""
    return [[name, type(m).__qualname__, [[n, str(t.dtype), list(t.shape)] for n, t in
             itertools.chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))]]
            for name, m in module.named_modules()]


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def reason(e: Exception) -> str:
    """An exception as a log line says it: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__


class GraphStore:
    """The saved graphs of one step of one engine, whose step runs `modules`."""

    def __init__(self, step: str, config, modules: tuple[torch.nn.Module, ...]):
        model = {k: v for k, v in config.model.to_dict().items() if k != "_name_or_path"}
        self.modules = modules
        self.key = {"step": step, "model": model, "device": device_kind(config.device),
                    "pools": repr(config.memory), "kv_plan": repr(config.kv_plan),
                    "typical": [config.typical_threshold, config.typical_alpha],
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "sources": sources_digest()}

    def path(self, symbols: tuple, spec: pytree.TreeSpec) -> Path:
        """The file of a graph compiled with these sizes symbolic for arguments of this structure."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # imports dynamo: only where a graph is at stake

        key = digest(self.key | {"threads": torch.get_num_threads(), "modules": [structure(m) for m in self.modules]})
        return Path(cache_dir()) / "sala_graphs" / key / f"{digest([list(symbols), spec_parts(spec)])}.bin"

    def load(self, path: Path, step, leaves: list):
        """The graph saved at `path` if its guards pass on (step, *leaves); None if there is none,
        or one that cannot be read or does not fit (said in a log line)."""
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                graph = torch.compiler.load_compiled_function(f, external_data={"step": step})
            if not graph.guard_check(step, *leaves):
                failed = graph._artifacts.guard_manager.check_verbose(graph.prepare_f_locals(step, *leaves))
                raise ValueError(f"its guards fail on this engine's step: {failed.verbose_code_parts[0]}")
        except Exception as e:  # a file of another torch, a torn or foreign file: compiling again is the cure
            log.warning("ignoring the compiled graph in %s (%s); compiling again", path, reason(e))
            return None
        return graph

    def save(self, path: Path, graph, step) -> None:
        """Write it (atomically: a temporary file renamed); a failure is logged."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path), external_data={"step": step})
        except Exception as e:
            log.warning("could not save the compiled graph to %s: %s", path, reason(e))
