"""W4A16 NVFP4 matmul: the Triton kernel (interpreted on CPU) against the torch reference, the
reference against compressed-tensors and float64, and the quantized Linear around them."""
import subprocess
import sys

import pytest
import torch
from compressed_tensors.compressors import unpack_fp4_from_uint8

from kernels.nvfp4_gemm import nvfp4_dequantize_reference, nvfp4_linear, nvfp4_matmul_reference, nvfp4_matmul_triton
from sala.quant.linear import NVFP4Linear
from sala.quant.nvfp4 import quantize_rtn

HAND_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def quantized_weight(n: int, k: int, seed: int, scale_rule: str = "6"):
    torch.manual_seed(seed)
    q = quantize_rtn(torch.randn(n, k) * 0.1, scale_rule)
    return q, q.packed(), q.scale, q.global_scale


def fp32_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Forward error bound of an fp32 dot product of length K: K * 2^-24 * (|x| @ |w|^T), plus
    the fp32 rounding of each reference weight (one more 2^-24)."""
    k = x.shape[-1]
    return (k + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)


def test_kernel_decodes_every_code():
    # Row r of W holds code r at every column; with x = I the output is W^T itself, one
    # E2M1 value per row, times scale 2 / global 4.
    codes = torch.arange(16, dtype=torch.uint8)[:, None].expand(16, 32)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.full((16, 2), 2.0).to(torch.float8_e4m3fn)
    y = nvfp4_matmul_triton(torch.eye(32)[:16], packed, scale, torch.tensor([4.0]))
    assert y[0].tolist() == [v / 2 for v in HAND_TABLE]


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("n, k", [(64, 128), (80, 144)])  # block multiples, and not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(m, n, k, dtype):
    q, packed, scale, g = quantized_weight(n, k, seed=m + n)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    exact = nvfp4_matmul_reference(x.float(), packed, scale, g, bias.float())
    bound = fp32_rounding_bound(x, q.dequantize()).float()
    y = nvfp4_matmul_triton(x, packed, scale, g, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.float32:
        err = (y - exact).abs()
        print(f"\nfp32 M={m} N={n} K={k}: max |kernel - reference| {err.max():.2e}")
        assert (err <= bound + 1e-30).all()
    else:
        # The only extra step is the final rounding of the fp32 result to bf16. The GPU rounds
        # to nearest (half an ulp); the interpreter truncates (triton runtime/interpreter.py,
        # _convert_float), so allow one ulp, which is at most 2^-7 of the value.
        assert ((y.float() - exact).abs() <= exact.abs() * 2.0**-7 + bound).all()
        assert torch.equal(nvfp4_matmul_reference(x, packed, scale, g, bias), exact.to(dtype))


def test_kernel_strided_activations_and_no_bias():
    q, packed, scale, g = quantized_weight(48, 64, seed=9)
    x = torch.randn(64, 5).T  # non-contiguous [5, 64]
    y = nvfp4_matmul_triton(x, packed, scale, g)
    exact = nvfp4_matmul_reference(x, packed, scale, g)
    assert ((y - exact).abs() <= fp32_rounding_bound(x, q.dequantize())).all()


def test_kernel_rejects_mismatched_shapes():
    _, packed, scale, g = quantized_weight(32, 64, seed=7)
    with pytest.raises(ValueError, match="do not match packed weight"):
        nvfp4_matmul_triton(torch.randn(2, 48), packed, scale, g)


def test_reference_dequantizes_like_compressed_tensors_and_multiplies_exactly():
    q, packed, scale, g = quantized_weight(32, 96, seed=1, scale_rule="4over6")
    w = nvfp4_dequantize_reference(packed, scale, g)
    ct = unpack_fp4_from_uint8(packed, 32, 96, dtype=torch.float32) * (scale.float() / g).repeat_interleave(16, -1)
    assert torch.equal(w, ct)
    assert torch.equal(w, q.dequantize())
    x = torch.randn(5, 96)
    torch.testing.assert_close(
        nvfp4_matmul_reference(x, packed, scale, g).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5
    )


def test_dispatch_on_cpu_is_the_reference_and_keeps_leading_dims():
    _, packed, scale, g = quantized_weight(40, 64, seed=2)
    x = torch.randn(2, 3, 64).bfloat16()
    bias = torch.randn(40).bfloat16()
    y = nvfp4_linear(x, packed, scale, g, bias)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 40), nvfp4_matmul_reference(x.reshape(6, 64), packed, scale, g, bias))


def test_reference_and_dispatch_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels.nvfp4_gemm import nvfp4_linear\n"
        "packed = torch.full((4, 8), 0x72, dtype=torch.uint8)\n"  # codes 2 (1.0), 7 (6.0)
        "scale = torch.ones(4, 1).to(torch.float8_e4m3fn)\n"
        "y = nvfp4_linear(torch.ones(1, 16), packed, scale, torch.tensor([2.0]))\n"
        "assert y.tolist() == [[28.0] * 4], y\n"  # 8 * (1 + 6) / 2
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the quantized Linear -------------------------------------------------------------------


def test_linear_buffers_are_the_compressed_tensors_tensors():
    q, packed, scale, g = quantized_weight(24, 32, seed=3)
    layer = NVFP4Linear.from_quantized(q, bias=torch.randn(24))
    state = layer.state_dict()
    assert {name: (t.dtype, tuple(t.shape)) for name, t in state.items()} == {
        "weight_packed": (torch.uint8, (24, 16)),
        "weight_scale": (torch.float8_e4m3fn, (24, 2)),
        "weight_global_scale": (torch.float32, (1,)),
        "bias": (torch.float32, (24,)),
    }
    assert torch.equal(state["weight_packed"], packed)
    fresh = NVFP4Linear(32, 24, bias=True)
    fresh.load_state_dict(state)
    x = torch.randn(3, 32)
    assert torch.equal(fresh(x), nvfp4_matmul_reference(x, packed, scale, g, state["bias"]))
    with pytest.raises(ValueError, match="not a multiple of the NVFP4 group size"):
        NVFP4Linear(40, 8)


def test_linear_cache_gives_identical_outputs_and_follows_new_weights():
    q, packed, scale, g = quantized_weight(24, 32, seed=4)
    plain = NVFP4Linear.from_quantized(q)
    cached = NVFP4Linear.from_quantized(q, cache_dequantized=True)
    x = torch.randn(5, 32).bfloat16()
    assert torch.equal(cached(x), plain(x))
    other = NVFP4Linear.from_quantized(quantized_weight(24, 32, seed=5)[0])
    cached.load_state_dict(other.state_dict())
    assert torch.equal(cached(x), other(x))


def test_linear_dtype_cast_keeps_quantized_tensors():
    q, *_ = quantized_weight(16, 32, seed=6)
    layer = NVFP4Linear.from_quantized(q, bias=torch.randn(16)).to(torch.bfloat16)
    assert layer.weight_global_scale.dtype == torch.float32
    assert torch.equal(layer.weight_global_scale, q.global_scale)
    assert layer.weight_scale.dtype == torch.float8_e4m3fn
    assert layer.bias.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 128])
def test_kernel_on_gpu(m):
    q, packed, scale, g = quantized_weight(4096, 4096, seed=m)
    x = torch.randn(m, 4096, dtype=torch.bfloat16)
    exact = nvfp4_matmul_reference(x.float(), packed, scale, g)
    y = nvfp4_linear(x.cuda(), packed.cuda(), scale.cuda(), g.cuda()).cpu()
    bound = fp32_rounding_bound(x, q.dequantize()).float()
    assert ((y.float() - exact).abs() <= exact.abs() * 2.0**-8 + bound).all()  # half a bf16 ulp
