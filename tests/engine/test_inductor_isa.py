"""What inductor's instruction-set checks found, kept across processes (sala/inductor_isa.py), in
one interpreter whose record is kept in a directory of its own (inductor's cache stays where it
is, with the check libraries built already): between phases inductor's in-process memory of the
checks is cleared, as a new process starts without it (the control phases show it was)."""
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

CHILD = """
import json, sys
from torch._inductor import config, cpu_vec_isa
from sala import inductor_isa

inductor_isa.cache_dir = lambda: sys.argv[1]
checked = []  # the sets whose base check ran (their extensions' checks always run)
check = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda isa, code: (code != isa._avx_code or not checked.append(str(isa))) and check(isa, code)

def start_afresh():
    config.cpp.vec_isa_ok = None
    checked.clear()
    cached = [f for c in (cpu_vec_isa.VecISA, *cpu_vec_isa.VecISA.__subclasses__(), cpu_vec_isa.VecAVX512VNNI, cpu_vec_isa.VecAMX)
              for f in vars(c).values() if hasattr(f, "cache_clear")]
    for f in [cpu_vec_isa.valid_vec_isa_list, *cached]:
        f.cache_clear()

def phase(record_text=None):
    start_afresh()
    record = inductor_isa.record_path()
    if record_text is not None:
        record.write_text(record_text)
    inductor_isa.use_known()
    picked = str(cpu_vec_isa.pick_vec_isa())  # what a step's C++ is compiled and looked up for
    inductor_isa.remember()
    return {"picked": picked, "checked": list(checked), "told": config.cpp.vec_isa_ok,
            "record": record.read_text() if record.is_file() else None}

out = {"first": phase(), "second": phase()}
out["a set failed"] = phase(json.dumps({"passed": ["avx2"]}))
out["torn"] = phase("{")
out["after torn"] = phase()
print(json.dumps(out))
"""


def test_the_instruction_set_checks_run_once_a_machine_and_then_pick_what_they_picked(tmp_path):
    """Inductor's base check of each vector instruction set (a library built and loaded in a
    child process) runs once on a machine; after that the same set is picked without it. A
    record saying a set failed, or a torn one, leaves the checks on; a torn one is written again."""
    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which("g++"):
        pytest.skip("inductor checks instruction sets only on x86, with a C++ compiler")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.splitlines()[-1])
    first = runs["first"]
    assert first["checked"] and first["told"] is None
    assert json.loads(first["record"])["passed"][0] == first["picked"]
    assert runs["second"]["checked"] == [] and runs["second"]["told"] is True
    for control in ("a set failed", "torn"):  # checks that run again: the phases start afresh
        assert runs[control]["checked"] and runs[control]["told"] is None
    assert "ignoring" in r.stderr and runs["torn"]["record"] == first["record"]
    assert runs["after torn"]["checked"] == [] and runs["after torn"]["told"] is True
    assert {run["picked"] for run in runs.values()} == {first["picked"]}
