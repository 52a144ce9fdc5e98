"""What the quantize job says it needs (sala/quant/memory.py), against the 9B's shapes worked out
by hand, flat in the number of layers, and the refusal it makes before loading anything."""
import dataclasses
import subprocess
import sys

import pytest

from sala.config import MINICPM_SALA_9B, SALAConfig
from sala.footprint import GIB, RUNTIME_BYTES
from sala.quant.memory import gptq_bound, quantize_memory
from tests.conftest import ROOT

H, F, V = 4096, 16384, 73448


def config(layers: int) -> SALAConfig:
    return SALAConfig(**{**MINICPM_SALA_9B, "num_hidden_layers": layers, "mixer_types": MINICPM_SALA_9B["mixer_types"][:layers]})


def need(layers: int, method: str = "gptq", sequences: int = 164):
    return quantize_memory(config(layers), sequences, 128, 4, method, 2 << 30, 8 * 96 + 2 * 128)


def test_the_9b_by_hand():
    n = need(32)
    lightning = 5 * H * H + 3 * H * F + 3 * H + 2 * 128  # q, k, v, z, o, the MLP and five norms: the largest layer
    assert n.layer == 4 * lightning
    assert n.hessians == 4 * (3 * H * H + F * F)  # attn_in, attn_out, mlp_in, and mlp_out's 16384 wide
    assert n.gptq == 4 * (3 * F * F + 8 * H * F)  # down_proj, by gptq_bound (measured against GPTQ below)
    assert n.hidden_states == 164 * 128 * H * 4
    assert n.activations == 41 * 128 * 3 * F * 4  # 164 sequences in 4 shards, through the MLP's widest
    assert n.worker_device == max(n.layer + 2 * n.hessians + n.activations, n.hessians + n.gptq, n.rtn)
    assert 6 * GIB < n.worker_device < 7 * GIB
    rtn = need(32, "rtn")
    assert rtn.worker_device == rtn.rtn == 6 * 4 * H * F and rtn.hidden_states == 0
    # A CPU worker's host holds its work; a GPU worker's, its hidden states and runtime.
    assert n.worker(False).total == n.worker_device + n.hidden_states + RUNTIME_BYTES
    assert n.worker(True).total == n.hidden_states + RUNTIME_BYTES


GPTQ_PEAK = """
import sys, torch
from bench.memwatch import restart_high_water_mark, status_bytes
from sala.quant.gptq import gptq_quantize
n, k = map(int, sys.argv[1:])
g = torch.Generator().manual_seed(0)
x = torch.randn(4 * k, k, generator=g)
hessian, weight = x.T @ x / len(x), torch.randn(n, k, generator=g) * 0.02
del x
before = restart_high_water_mark()
gptq_quantize(weight, hessian, scale_rule="4over6")
print(status_bytes("VmHWM") - before)
"""


@pytest.mark.parametrize("n, k", [(8192, 2048), (512, 4096)])
def test_gptq_stays_within_the_bound_the_job_says(n, k):
    """GPTQ of an [n, k] weight (wide, and a k x k factor much larger than the weight) peaks, by the
    high-water mark of a fresh process (as a quantize worker starts) over its resident memory before
    the call, below gptq_bound's fp32 values beside the Hessian (2 k^2 + 3 n k is below this peak at
    n = 4k). Fresh, because in a process that freed large tensors before, the C allocator serves
    the call from memory it kept resident, and the growth measured would depend on what ran before."""
    out = subprocess.run([sys.executable, "-c", GPTQ_PEAK, str(n), str(k)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.split()[-1])
    assert 0.4 * gptq_bound(n, k) * 4 < peak < gptq_bound(n, k) * 4, (peak / (k * k * 4), gptq_bound(n, k) / (k * k))


def test_nothing_grows_with_the_number_of_layers():
    """A worker's figures are one layer's; the driver's, one output shard's (2 GiB once the output is larger) or the gate's."""
    workers = [dataclasses.replace(need(n, m), driver_work=0) for n in (2, 4, 32) for m in ("gptq", "rtn")]
    assert workers[0::2] == [workers[0]] * 3 and workers[1::2] == [workers[1]] * 3
    assert need(8) == need(32) and need(2).driver_work <= need(32).driver_work == 2 << 30


def test_the_job_refuses_before_it_loads_anything(pipeline_env, tmp_path):
    """Sixty-four workers of the 9B's widths on this machine: one line, exit 2, the --workers that
    fit (pipelines/capacity.py checks the hosts)."""
    from sala.realwidth import ensure_realwidth
    from tests.conftest import run_pipeline

    r = run_pipeline(pipeline_env, "--model", str(ensure_realwidth(1)), "--output", str(tmp_path / "out"), "--workers", "64",
                     "--num-samples", "2", "--seq-len", "64", check=False)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]  # Ray says it started, before
    assert line.startswith("error: 64 quantize workers at once need ") and "; pass --workers " in line, line
    assert "workers    " not in r.stdout and not (tmp_path / "out").exists()
