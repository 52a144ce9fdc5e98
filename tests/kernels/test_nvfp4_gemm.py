"""W4A16 NVFP4 matmul: the Triton kernel (interpreted on CPU) against the torch reference, the
reference against compressed-tensors and float64, and the quantized Linear around them."""
import importlib.util
import subprocess
import sys

import pytest
import torch
from compressed_tensors.compressors import unpack_fp4_from_uint8

from kernels.nvfp4_gemm import nvfp4_dequantize_reference, nvfp4_linear, nvfp4_matmul_reference, nvfp4_matmul_triton, schedule
from kernels.target import TARGETS, standing_in
from sala.quant.linear import NVFP4Linear
from sala.quant.nvfp4 import quantize_rtn
from tests.conftest import ROOT, assert_gpu_bench_refuses_cpu

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


def exact_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, bias=None):
    """x @ W^T + bias in float64 from the codes, independent of the kernel and the reference:
    E2M1 * scale / global, with the per-row global scale when g is [N]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    w = torch.tensor(HAND_TABLE, dtype=torch.float64)[codes]
    w = w * scale.double().repeat_interleave(16, -1) / g.double().reshape(-1, 1)
    y = x.double() @ w.T
    return (y + bias.double() if bias is not None else y), w


def schedule_bound(x: torch.Tensor, w: torch.Tensor, bias, m: int) -> torch.Tensor:
    """Worst-case |kernel - exact| for the schedule the kernel picks at M = m. Each K block is
    two tl.dots of BLOCK_K / 2 columns (even and odd), each added to the accumulator (the
    interpreter runs np.matmul(a, b) + acc). So a product reaches the output through at most
    BLOCK_K / 2 - 1 additions inside its dot, two per K block of its split, SPLITS - 1 in the
    reduce, then the division by the global scale, the bias addition and (fp32 activations)
    its own rounding, each one fp32 rounding (2^-24 relative):
    (BLOCK_K / 2 + 2 * blocks per split + SPLITS + 1) * 2^-24 * (|x| @ |w|^T + |b|).
    At K = 144 that is 32 + 6 + 1 + 1 = 40 roundings tiled and 32 + 2 + 3 + 1 = 38 split three
    ways: split-K shortens the chain, and both stay far inside the K + 2 = 146 of
    fp32_rounding_bound, which the comparisons with the reference keep using unchanged."""
    k = x.shape[-1]
    tiles, splits, per_split = schedule(m, w.shape[0], k, x.device)
    depth = tiles.block_k // 2 + 2 * (per_split // tiles.block_k) + splits + 1
    mag = x.double().abs() @ w.abs().T + (bias.double().abs() if bias is not None else 0)
    return depth * 2.0**-24 * mag


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])  # split-K up to 16 rows, tiled above
@pytest.mark.parametrize("n, k", [(64, 128), (80, 144)])  # block multiples, and not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(m, n, k, dtype):
    q, packed, scale, g = quantized_weight(n, k, seed=m + n)
    _, splits, _ = schedule(m, n, k, torch.device("cpu"))
    assert (splits > 1) == (m <= 16), "these shapes must exercise the path their M selects"
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    exact = nvfp4_matmul_reference(x.float(), packed, scale, g, bias.float())
    bound = fp32_rounding_bound(x, q.dequantize()).float()
    y = nvfp4_matmul_triton(x, packed, scale, g, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.float32:
        err = (y - exact).abs()
        exact64, w64 = exact_product(x, packed, scale, g, bias)
        err64 = (y.double() - exact64).abs()
        print(f"\nfp32 M={m} N={n} K={k} splits={splits}: max |kernel - reference| {err.max():.2e}, "
              f"|kernel - float64| {err64.max():.2e}")
        assert (err <= bound + 1e-30).all()
        assert (err64 <= schedule_bound(x, w64, bias, m)).all()
    else:
        # The only extra step is the final rounding of the fp32 result to bf16. The GPU rounds
        # to nearest (half an ulp); the interpreter truncates (triton runtime/interpreter.py,
        # _convert_float), so allow one ulp, which is at most 2^-7 of the value.
        assert ((y.float() - exact).abs() <= exact.abs() * 2.0**-7 + bound).all()
        assert torch.equal(nvfp4_matmul_reference(x, packed, scale, g, bias), exact.to(dtype))


@pytest.mark.parametrize("split_k", [1, 2, 3, 99])  # 99 is capped at K / BLOCK_K = 3 splits
def test_forced_schedules_agree_with_the_reference(split_k):
    # The benchmark runs the tiled schedule (split_k=1) and the split one side by side at M = 1.
    q, packed, scale, g = quantized_weight(80, 144, seed=11)
    x = torch.randn(1, 144)
    y = nvfp4_matmul_triton(x, packed, scale, g, split_k=split_k)
    exact = nvfp4_matmul_reference(x, packed, scale, g)
    assert ((y - exact).abs() <= fp32_rounding_bound(x, q.dequantize())).all()


def test_split_k_rows_do_not_depend_on_the_batch():
    # Splits depend on N, K and the SM count only, and every M <= 16 pads to the same 16-row
    # tile, so a decode row's result is the same alone or beside 15 others, bit for bit.
    _, packed, scale, g = quantized_weight(80, 144, seed=12)
    x = torch.randn(16, 144).bfloat16()
    together = nvfp4_matmul_triton(x, packed, scale, g)
    assert torch.equal(nvfp4_matmul_triton(x[:1], packed, scale, g), together[:1])
    assert torch.equal(nvfp4_matmul_triton(x[5:8], packed, scale, g), together[5:8])


def load_bench():
    """bench/nvfp4_gemm_gpu.py as a module (bench/ is not a package); importing it runs nothing."""
    path = ROOT / "bench" / "nvfp4_gemm_gpu.py"
    spec = importlib.util.spec_from_file_location("nvfp4_gemm_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_k_schedule_fills_the_gpu_on_the_9b_shapes():
    # The benchmark's shapes, the 9B model's linears: fused q/k/v/gate, fused gate/up, down,
    # o_proj; 132 SMs (H100 SXM / H200), and the schedule's tiles for them.
    shapes = [(k, sum(parts)) for _, k, parts in load_bench().SHAPES]
    assert shapes == [(4096, 8704), (4096, 32768), (16384, 4096), (4096, 4096)]
    cpu = torch.device("cpu")
    with standing_in(TARGETS["sm_90a"]):
        for k, n in shapes:
            tiles, splits, per_split = schedule(1, n, k, cpu)
            programs = splits * -(-n // tiles.block_n)
            assert 3 * 132 <= programs <= 2048, (k, n, splits)
            assert per_split % tiles.block_k == 0 and (splits - 1) * per_split < k <= splits * per_split
            assert schedule(16, n, k, cpu) == (tiles, splits, per_split)
            assert schedule(17, n, k, cpu)[1] == 1


def test_bench_fused_weight_is_what_the_kernel_and_reference_take():
    # The benchmark's fused weights (parts with their own global scales, [N] scale) on CPU.
    packed, scale, g, w_bf16 = load_bench().fused_weight(64, [16, 48], device="cpu")
    assert g.shape == (64,) and g[0] != g[-1]
    assert torch.equal(nvfp4_dequantize_reference(packed, scale, g).bfloat16(), w_bf16)
    x = torch.randn(1, 64).bfloat16()
    ref = nvfp4_matmul_reference(x, packed, scale, g)
    for split_k in (1, None):  # the two schedules the benchmark times at M = 1
        assert (nvfp4_matmul_triton(x, packed, scale, g, split_k=split_k).float() - ref.float()).abs().max() <= (
            2.0**-7 * ref.float().abs().max()
        )


def test_bench_exits_with_one_line_without_a_gpu():
    assert_gpu_bench_refuses_cpu("nvfp4_gemm_gpu.py")


# ---- per-row global scales (fused projections) ----------------------------------------------


def fused_pair(n1: int, n2: int, k: int):
    """Two weights quantized on their own (global scales 30x apart), concatenated along N as a
    fused projection is, with one global scale per output row."""
    torch.manual_seed(n1 + n2)
    a = quantize_rtn(torch.randn(n1, k) * 0.1)
    b = quantize_rtn(torch.randn(n2, k) * 3.0)
    assert not torch.equal(a.global_scale, b.global_scale)
    packed = torch.cat([a.packed(), b.packed()])
    scale = torch.cat([a.scale, b.scale])
    g = torch.cat([a.global_scale.expand(n1), b.global_scale.expand(n2)])
    return a, b, packed, scale, g


def test_reference_per_row_global_scale_is_the_concatenation():
    a, b, packed, scale, g = fused_pair(24, 40, 64)
    w = nvfp4_dequantize_reference(packed, scale, g)
    assert torch.equal(w, torch.cat([a.dequantize(), b.dequantize()]))
    x = torch.randn(5, 64)
    y = nvfp4_matmul_reference(x, packed, scale, g)
    parts = torch.cat([nvfp4_matmul_reference(x, a.packed(), a.scale, a.global_scale),
                       nvfp4_matmul_reference(x, b.packed(), b.scale, b.global_scale)], dim=1)
    diff = (y - parts).abs()
    print(f"\nreference, [N] global scale vs concatenated parts: max diff {diff.max():.2e}")
    assert (diff <= fp32_rounding_bound(x, w)).all()
    # The dispatch (the reference on CPU) takes it too, with leading dims.
    assert torch.equal(nvfp4_linear(x[None], packed, scale, g)[0], y)


@pytest.mark.parametrize("m", [1, 17])  # split-K and tiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_per_row_global_scale_is_the_concatenation(m, dtype):
    # n1 = 48 puts the boundary between the two weights inside a 64-column tile.
    a, b, packed, scale, g = fused_pair(48, 40, 144)
    x = torch.randn(m, 144).to(dtype)
    bias = torch.randn(88).to(dtype)
    y = nvfp4_matmul_triton(x, packed, scale, g, bias)
    parts = torch.cat([nvfp4_matmul_triton(x, a.packed(), a.scale, a.global_scale, bias[:48]),
                       nvfp4_matmul_triton(x, b.packed(), b.scale, b.global_scale, bias[48:])], dim=1)
    exact = nvfp4_matmul_reference(x.float(), packed, scale, g, bias.float())
    bound = fp32_rounding_bound(x, torch.cat([a.dequantize(), b.dequantize()])).float()
    slack = exact.abs() * 2.0**-7 if dtype == torch.bfloat16 else 0.0  # as in test_kernel_equals_reference
    print(f"\n{dtype} M={m}: [N] global scale vs concatenated parts: max diff "
          f"{(y.float() - parts.float()).abs().max():.2e}, vs reference {(y.float() - exact).abs().max():.2e}")
    # Each output column sees the same sums either way: bitwise on a GPU, where one column's sum is
    # the same instructions whatever the tile around it. Under the Triton interpreter tl.dot is
    # numpy's matmul, and OpenBLAS picks its accumulation order by the call's shape (its Haswell
    # kernels: fp32 sums 1e-5 apart), so there the two may differ by fp32 rounding, far below what
    # a wrong global scale for the second weight's columns would make.
    if torch.cuda.is_available() or dtype == torch.bfloat16:
        assert torch.equal(y, parts)
    else:
        assert ((y.float() - parts.float()).abs() <= bound).all()
    assert ((y.float() - exact).abs() <= slack + bound).all()


def test_global_scale_of_another_length_is_rejected():
    _, packed, scale, _ = quantized_weight(32, 64, seed=8)
    for fn in (nvfp4_matmul_triton, nvfp4_matmul_reference):
        with pytest.raises(ValueError, match="expected \\[1\\] or \\[32\\]"):
            fn(torch.randn(2, 64), packed, scale, torch.ones(31))


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
@pytest.mark.parametrize("split_k", [None, 1])  # the schedule M picks (split-K up to 16), and tiled
def test_kernel_on_gpu(m, split_k):
    q, packed, scale, g = quantized_weight(4096, 4096, seed=m)
    x = torch.randn(m, 4096, dtype=torch.bfloat16)
    exact = nvfp4_matmul_reference(x.float(), packed, scale, g)
    y = nvfp4_matmul_triton(x.cuda(), packed.cuda(), scale.cuda(), g.cuda(), split_k=split_k).cpu()
    bound = fp32_rounding_bound(x, q.dequantize()).float()
    assert ((y.float() - exact).abs() <= exact.abs() * 2.0**-8 + bound).all()  # half a bf16 ulp


@pytest.mark.gpu
def test_split_k_on_gpu_with_per_row_global_scale_under_a_cuda_graph():
    a, b, packed, scale, g = (t.cuda() if isinstance(t, torch.Tensor) else t for t in fused_pair(2048, 2048, 4096))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert schedule(1, 4096, 4096, x.device)[1] > 1
    eager = nvfp4_linear(x, packed, scale, g)
    exact = nvfp4_matmul_reference(x.float(), packed, scale, g)
    bound = fp32_rounding_bound(x.cpu(), torch.cat([a.dequantize(), b.dequantize()]).cpu()).float().cuda()
    assert ((eager.float() - exact).abs() <= exact.abs() * 2.0**-8 + bound).all()
    out = torch.empty_like(eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(nvfp4_linear(x, packed, scale, g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # no atomics: the split-K sum is deterministic
