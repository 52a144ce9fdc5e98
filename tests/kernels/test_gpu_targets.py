"""The kernels on every NVIDIA target, without a GPU: FP8 decoded where a target has no FP8 type,
a GPU the engine cannot use named at start-up, and every kernel built for sm_80, sm_89, sm_90a,
sm_100a and sm_120 by sala/compile_check.py (Triton's compiler and the wheel's ptxas, for real)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels import target
from kernels.kv_quant import fp8_write_triton, nvfp4_write_triton
from kernels.nvfp4_gemm import nvfp4_matmul_triton
from kernels.paged_attention import PagedKV, paged_decode_attention_pages_triton
from kernels.target import TARGETS, UnsupportedGPU, require_supported, standing_in
from tests.conftest import ROOT

triton = pytest.importorskip("triton")
tl = triton.language


def compiler_env() -> dict:
    """This process's environment without the interpreter: the compile check builds for real."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env | {"PYTHONPATH": str(ROOT)}


if triton is not None:
    from kernels.nvfp4_gemm import e4m3_to_float

    @triton.jit
    def _decode_every_code(x_ptr, y_ptr, NATIVE: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(y_ptr + i, e4m3_to_float(tl.load(x_ptr + i), NATIVE))


@pytest.mark.parametrize("native", [True, False], ids=["fp8-type", "integer-ops"])
def test_fp8_decode_is_torchs_on_all_256_codes(native):
    """Both ways of reading an FP8 E4M3 byte (the conversion instruction of sm_89+, the integer
    operations of sm_80) give torch's float8_e4m3fn value of every code: signed zeros,
    subnormals, 448 and the two NaNs included."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = torch.empty(256)
    _decode_every_code[(1,)](codes, got, NATIVE=native)
    nan = torch.isnan(want)
    assert nan.sum() == 2
    if not native:  # the interpreter's own FP8 conversion reads the NaN codes as 480; a GPU's gives NaN
        assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bit for bit, -0.0 too


def fp8_problem():
    """Three sequences over a pool of 6 pages of 8 tokens (interpreted kernels run a program at
    a time: the pool stays small)."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 8, 32, generator=gen).bfloat16()
    k, v = (torch.randn(6 * 8, 2, 32, generator=gen) for _ in range(2))
    tables = torch.randperm(6, generator=gen).view(3, 2)
    return q, k, v, tables, torch.tensor([12, 5, 16])


def quantized_pages(x: torch.Tensor):
    """x [rows, H, D] written into FP8 (per-token scales) and NVFP4 pages by the Triton writes."""
    rows = torch.arange(x.shape[0])
    fp8 = torch.zeros(6, 8, 2, 32, dtype=torch.uint8)
    fp8_scale = torch.zeros(6, 8, 2)
    fp8_write_triton(x, rows, fp8, row_scale=fp8_scale)
    fp4 = torch.zeros(6, 8, 2, 16, dtype=torch.uint8)
    fp4_scale = torch.zeros(6, 8, 2, 2, dtype=torch.uint8)
    nvfp4_write_triton(x, rows, fp4, fp4_scale, torch.tensor([3.0]), four_over_six=True)
    return PagedKV(fp8, "fp8", fp8_scale), PagedKV(fp4, "nvfp4", fp4_scale, torch.tensor([3.0]))


def fp8_users() -> dict[str, torch.Tensor]:
    """Every kernel that reads FP8 bytes: the W4A16 GEMM's scales, the NVFP4 K/V write's group
    scales (FourOverSix compares both candidates' decoded values), decode attention over FP8 and
    NVFP4 pages."""
    from sala.quant.nvfp4 import quantize_rtn

    torch.manual_seed(0)
    w = quantize_rtn(torch.randn(80, 144) * 0.1, "4over6")
    x = torch.randn(3, 144)
    q, k, v, tables, lens = fp8_problem()
    (k8, k4), (v8, v4) = quantized_pages(k), quantized_pages(v)
    return {
        "w4a16": nvfp4_matmul_triton(x, w.packed(), w.scale, w.global_scale, split_k=1),
        "nvfp4 pages": torch.cat([k4.data.flatten(), k4.row_scale.flatten()]),
        "fp8 attention": paged_decode_attention_pages_triton(q, k8, v8, tables, lens, 0.2),
        "nvfp4 attention": paged_decode_attention_pages_triton(q, k4, v4, tables, lens, 0.2),
    }


def test_sm_80_kernels_compute_what_the_fp8_type_computes():
    """Standing in for an A100 (no FP8 type) the kernels take the integer decode, and every
    result is bit for bit the one of the FP8-type path."""
    native = fp8_users()
    assert target.native_fp8(torch.device("cpu"))
    with standing_in(TARGETS["sm_80"]):
        assert not target.native_fp8(torch.device("cpu"))
        integer = fp8_users()
    for name, out in native.items():
        assert torch.equal(integer[name], out), name


def test_a_gpu_older_than_sm_80_is_named_at_start_up(monkeypatch, tiny_sala_dir):
    """A V100 (7.0) gets one line naming the device, its capability and what the engine needs,
    from the engine's loader before any weight is read."""
    from sala.engine import Engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    target._cuda_arch.cache_clear()
    try:
        with pytest.raises(UnsupportedGPU) as e:
            Engine.from_pretrained(tiny_sala_dir, device="cuda")
        message = str(e.value)
        assert "\n" not in message and "Tesla V100" in message and "7.0" in message and "8.0" in message
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
        target._cuda_arch.cache_clear()
        require_supported(torch.device("cuda:0"))  # an A100 passes
    finally:
        target._cuda_arch.cache_clear()


def test_occupancy_follows_the_cuda_occupancy_rules():
    h200 = TARGETS["sm_90a"]
    assert h200.resident_blocks(registers=128, shared=0, num_warps=4) == 4  # 16 warps of 4096 registers
    assert h200.resident_blocks(registers=255, shared=0, num_warps=4) == 2  # 255 rounds to 256 a thread
    assert h200.resident_blocks(registers=32, shared=0, num_warps=4) == 16  # the 64-warp limit
    assert h200.resident_blocks(registers=32, shared=100 << 10, num_warps=4) == 2  # 228 KiB of shared memory
    assert TARGETS["sm_120"].resident_blocks(registers=32, shared=0, num_warps=4) == 12  # 48 warps


def test_the_check_reports_a_kernel_that_does_not_build_for_one_target(tmp_path):
    """What the compile check stands on: a kernel using the fp8e4nv type is recorded through
    its launch and fails to build for sm_80 only, with the compiler's reason."""
    (tmp_path / "fp8_probe.py").write_text(textwrap.dedent('''
        import triton, triton.language as tl

        @triton.jit
        def _fp8_kernel(x_ptr, y_ptr):
            i = tl.arange(0, 16)
            tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv, bitcast=True).to(tl.float32))
    '''))
    (tmp_path / "build_probe.py").write_text(textwrap.dedent('''
        import json, torch
        from kernels import aot
        from kernels.target import TARGETS
        from fp8_probe import _fp8_kernel

        if __name__ == "__main__":
            recorders = []
            for name in ("sm_80", "sm_90a"):
                with aot.capture(TARGETS[name]) as r:
                    _fp8_kernel[(1,)](torch.zeros(16, dtype=torch.uint8), torch.empty(16))
                recorders.append(r)
            print(json.dumps({b.launch.target: [b.error, b.registers] for b in aot.build(recorders)}))
    '''))
    env = compiler_env() | {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    out = subprocess.run([sys.executable, str(tmp_path / "build_probe.py")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])
    assert "fp8e4nv not supported" in built["sm_80"][0]
    assert built["sm_90a"][0] is None and built["sm_90a"][1] > 0


@pytest.mark.slow
def test_every_kernel_builds_for_every_target_without_spilling():
    """`python -m sala.compile_check`: every specialisation the engine launches, for both
    models and all five targets, compiles, spills nothing and fits its shared memory."""
    out = subprocess.run([sys.executable, "-m", "sala.compile_check"], cwd=ROOT, env=compiler_env(),
                         capture_output=True, text=True, timeout=900)
    print(out.stdout[-6000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and report["problems"] == [], out.stderr[-4000:]
    assert report["targets"] == list(TARGETS)
    built = {(r["kernel"], r["target"]) for r in report["kernels"] if r["failed"] == 0 and r["specialisations"]}
    from sala.compile_check import _short, launched_kernels

    assert {(_short(k), t) for k in launched_kernels() for t in TARGETS} <= built
