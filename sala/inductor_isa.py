"""What inductor's vector instruction-set checks found on this machine, kept for the next process.

Before it compiles or loads C++ on CPU, inductor picks the widest vector instruction set the CPU
reports that works, and checks each by building a small library with its flags and loading it
in a child process: six processes on an AVX-512 machine, 1.2 s of every process that compiles or
loads a step (sala/engine/graphs.py), more than 2 s of a restarted replica under load. The base
check of each set depends only on the CPU, the C++ compiler and torch, so its result is kept in
inductor's cache directory, beside the saved graphs. Where it passed every set the CPU reports,
the next process tells inductor so (`cpp.vec_isa_ok`, what TORCHINDUCTOR_VEC_ISA_OK sets), which
then skips those checks and picks the same set; the checks of a set's extensions (AVX-512's
BF16 and VNNI, AMX's) still run, as they decide the compiler flags.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
from pathlib import Path

import torch
from torch._inductor import config, cpp_builder, cpu_vec_isa
from torch._inductor.runtime.cache_dir_utils import cache_dir

from sala.atomic import write_atomically

log = logging.getLogger(__name__)


def reported() -> list[str]:
    """The sets inductor would check here (its order, widest first) by what the CPU reports: the
    list its checks leave unchanged when every one passes."""
    flags = cpu_vec_isa.x86_isa_checker()
    return [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def record_path() -> Path | None:
    """The file of this machine's result, keyed by the CPU's reported sets, the C++ compiler and
    torch; None where inductor does not check: off x86, or told what to use."""
    if platform.machine() not in ("x86_64", "AMD64") or config.cpp.vec_isa_ok is not None:
        return None
    try:
        compiler = shutil.which(cpp_builder.get_cpp_compiler())
    except Exception:  # no C++ compiler: nothing to keep, and compiling says so itself
        return None
    stat = os.stat(compiler) if compiler else None
    key = {"reported": reported(), "torch": torch.__version__, "compiler": compiler,
           "compiler_file": [stat.st_size, stat.st_mtime_ns] if stat else None}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir()) / "sala_graphs" / f"vec_isa-{digest}.json"


def use_known() -> None:
    """Before compiling or loading C++: where this machine's checks passed every set the CPU
    reports, tell inductor so."""
    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:  # checked already in this process
        return
    record = record_path()
    if record is None or not record.is_file():
        return
    try:
        passed = json.loads(record.read_text())["passed"]
    except Exception as e:  # a torn or foreign file: inductor checks, and the file is written again
        log.warning("ignoring %s (%s: %s); inductor checks the instruction sets again", record, type(e).__name__, e)
        record.unlink(missing_ok=True)
        return
    if passed == reported():
        config.cpp.vec_isa_ok = True


def remember() -> None:
    """After compiling or loading C++: keep what inductor's checks found, if it ran them."""
    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return
    record = record_path()
    if record is None or record.is_file():
        return
    passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(record, lambda f: f.write(json.dumps({"passed": passed})), mode="w")
    except OSError as e:
        log.warning("could not keep inductor's instruction-set checks in %s: %s", record, e)
