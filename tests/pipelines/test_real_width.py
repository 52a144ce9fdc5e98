"""The main job at the 9B's widths, on CPU: a random-weight one-layer MiniCPM-SALA checkpoint
(sala/realwidth.py: hidden 4096, FFN 16384, vocabulary 73,448, 1.7 GB in BF16) quantized RTN by
`python pipelines/quantize.py` with its export and gate. The run's peak memory, every process of
it together, must stay within what it says it needs before it starts (sala/quant/memory.py): a
stage that loads more than it should fails here, not in a user's run. The engine's bound at this
width is tests/engine/test_packed_nvfp4.py's; serving, the deeper models and GPTQ (8 minutes a
layer on 2 cores) are bench/scale.py's."""
import json
import re
import sys

import pytest

from bench.memwatch import GIB, run_measured
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
RAY_PROCESSES = 1 << 30  # a local Ray's own processes (GCS, raylet, dashboard agent, log monitor) besides the driver and workers


@pytest.fixture(scope="module")
def real_width():
    from sala.realwidth import ensure_realwidth

    return ensure_realwidth(1)


@pytest.fixture(scope="module")
def quantized(real_width, pipeline_env, tmp_path_factory):
    """(checkpoint, output, peak) of the main job, RTN, one worker."""
    out = tmp_path_factory.mktemp("rw") / "rtn"
    cmd = [sys.executable, str(ROOT / "pipelines" / "quantize.py"), "--model", str(real_width), "--output", str(out),
           "--method", "rtn", "--num-samples", "2", "--seq-len", "64", "--gate-prompts", "2", "--eval-sequences", "1",
           "--no-register", "--workers", "1"]
    result, peak = run_measured(cmd, env=pipeline_env, cwd=ROOT, timeout=900, interval=0.2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, result.stdout, peak


def test_quantize_stays_within_what_it_says_it_needs(quantized, real_width):
    from sala.checkpoint import CheckpointReader

    out, stdout, peak = quantized
    said = re.search(r"^memory +a worker needs ([\d.]+) GiB of host memory .*; the driver ([\d.]+) GiB", stdout, re.M)
    assert said, stdout[:3000]
    need = (float(said[1]) + float(said[2])) * GIB  # one worker, then the driver's export and gate, never both at their peaks
    print(peak.summary(), f"said {need / GIB:.2f} GiB")
    assert peak.peak_tree_bytes <= need + RAY_PROCESSES, (peak.summary(), said[0])
    # Less than the unquantized model twice in fp32, as the gate once held it (reference and candidate).
    model_bytes = sum(f.stat().st_size for f in real_width.glob("*.safetensors"))
    assert peak.peak_tree_bytes < 4 * model_bytes
    reader = CheckpointReader(out)  # what was written: NVFP4 packed, the manifest verified
    assert reader.quantized is not None and len(reader.quantized.names) == 8  # q, k, v, o_gate, o; gate, up, down
    summary = json.loads([line for line in stdout.splitlines() if line.startswith('{"pipeline"')][-1])
    assert summary["method"] == "rtn" and summary["kl_mean"] >= 0 and "cosine_mean" in summary

