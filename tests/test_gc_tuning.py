"""sala.gc_tuning: a process that imports `serve` (a replica) has the collector's youngest
threshold raised before torch is imported; collect_less never lowers a threshold or turns
collection on."""
import gc
import subprocess
import sys

from sala.gc_tuning import YOUNGEST, collect_less
from tests.conftest import ROOT

# The threshold at the moment something first imports torch, and after the import.
PROBE = """
import gc, sys
seen = []
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(gc.get_threshold()[0])
sys.meta_path.insert(0, Probe())
import ray  # a Ray worker has it imported before it loads the deployment's module
import serve.server
print(seen[0], gc.get_threshold()[0])
"""


def test_a_replica_raises_the_threshold_before_torch_is_imported():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(YOUNGEST), str(YOUNGEST)]


def test_collect_less_only_raises():
    saved = gc.get_threshold()
    try:
        for before, after in (((700, 10, 10), (YOUNGEST, 10, 10)), ((YOUNGEST * 2, 5, 7), (YOUNGEST * 2, 5, 7)),
                              ((0, 10, 10), (0, 10, 10)), ((100, 3, 4), (YOUNGEST, 3, 4))):
            gc.set_threshold(*before)
            collect_less()
            assert gc.get_threshold() == after, before
    finally:
        gc.set_threshold(*saved)
