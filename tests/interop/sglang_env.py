"""A separate Python environment holding SGLang's real code, for tests/interop/test_sglang.py.

SGLang 0.5.23 pins torch 2.14.1 (a CUDA build), transformers 5.19 and compressed-tensors 0.18,
against our transformers < 5.6 and compressed-tensors 0.20: it cannot share our environment.
This one holds the sglang wheel without its dependencies (its CUDA kernels cannot install
without a GPU toolchain) plus the plain packages that its config parsing, quantization
configs, model classes and weight loader import, at sglang's own pins where it pins them,
and torch and triton at this interpreter's versions (the CPU build; a constraint keeps any
install from swapping it for sglang's CUDA one).

Built once per (sglang version, requirement list, torch, triton, Python) under
$SALA_HOME/envs, in a temporary directory that takes its place only when complete.

    python tests/interop/sglang_env.py      # build it (or find it built) and print its interpreter
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sala.checkpoint_files import atomic_directory  # noqa: E402
from sala.home import sala_home  # noqa: E402

SGLANG = "0.5.23"
# What sglang's loading path imports; the pins are those of sglang's own metadata.
REQUIREMENTS = [
    "transformers==5.19.0", "compressed-tensors==0.18.0", "tokenizers==0.23.2", "sentencepiece==0.2.1",
    "apache-tvm-ffi==0.1.11", "numpy", "safetensors", "orjson", "pybase64", "requests", "pillow", "msgspec",
    "pyzmq", "IPython", "aiohttp", "gguf",
    # sglang's other dependencies bring these: fastapi brings starlette, datasets dill
    "starlette", "dill",
]


class EnvUnavailable(RuntimeError):
    """The environment cannot be built here (no package registry, say): one line says why."""


def _pins() -> list[str]:
    """torch and triton as this interpreter has them: SGLang's loader runs on the same CPU build."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in ("torch", "triton")]


def env_dir() -> Path:
    key = json.dumps([SGLANG, REQUIREMENTS, _pins(), sys.version_info[:2]])
    return sala_home() / "envs" / f"sglang-{SGLANG}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def ensure_env() -> Path:
    """The environment's interpreter, built first if needed; EnvUnavailable if it cannot be."""
    target = env_dir()
    python = target / "bin" / "python"
    if python.exists():  # only a complete build is ever put there
        return python
    with atomic_directory(target, flush=lambda _: os.sync()) as tmp:  # one sync, not 50,000 fsyncs
        _run([sys.executable, "-m", "venv", str(tmp)], "python -m venv")
        constraints = tmp / "constraints.txt"  # no install may swap torch for another build
        constraints.write_text("".join(f"{pin}\n" for pin in _pins()))
        # --no-compile: sglang is 10,000 files; Python compiles the few hundred the loader imports.
        pip = [tmp / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check",
               "-c", constraints]
        _run([*pip, *_pins(), *REQUIREMENTS], "pip install torch and sglang's plain dependencies")
        _run([*pip, "--no-deps", f"sglang=={SGLANG}"], f"pip install --no-deps sglang=={SGLANG}")
    return python


def _run(cmd: list, what: str) -> None:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode:
        errors = [line for line in r.stderr.splitlines() if line.startswith("ERROR")] or r.stderr.splitlines() or ["?"]
        raise EnvUnavailable(f"SGLang {SGLANG} environment cannot be built: {what} failed: {errors[-1]}")


if __name__ == "__main__":
    try:
        print(ensure_env())
    except EnvUnavailable as e:
        sys.exit(str(e))
