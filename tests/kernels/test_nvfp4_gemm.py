"""W4A16 NVFP4 matmul: the Triton kernel (interpreted on CPU) and the tiled CPU path against the
torch reference, the reference against compressed-tensors and float64, and the quantized Linear
around them."""
import importlib.util
import subprocess
import sys

import pytest
import torch
from compressed_tensors.compressors import unpack_fp4_from_uint8

import kernels.nvfp4_gemm as gemm
from kernels.nvfp4_gemm import (
    CPU_TILE_WEIGHTS,
    dequantize_rows,
    nvfp4_dequantize_reference,
    nvfp4_linear,
    nvfp4_matmul_reference,
    nvfp4_matmul_tiled,
    nvfp4_matmul_triton,
    schedule,
)
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


def test_dispatch_on_cpu_keeps_leading_dims():
    # A weight of one tile: the reference's own fp32 linear on the same weights, bit for bit.
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


def test_linear_holds_only_its_packed_tensors_after_cpu_calls():
    # Two tiles' worth of weights (the tiled op) and a fused layer's [N] global scale.
    a, b, *_ = fused_pair(CPU_TILE_WEIGHTS // 512, CPU_TILE_WEIGHTS // 512, 512)
    layer = NVFP4Linear.concat([NVFP4Linear.from_quantized(a), NVFP4Linear.from_quantized(b)])
    n, k = layer.out_features, layer.in_features
    assert n * k == 2 * CPU_TILE_WEIGHTS and layer.weight_global_scale.shape == (n,)
    x = torch.randn(3, k).bfloat16()
    ref = nvfp4_matmul_reference(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    torch.testing.assert_close(layer(x), ref, rtol=2.0**-7, atol=1e-3)  # a bf16 ulp
    tensors = {id(t): t for t in [*layer.buffers(), *layer.parameters(), *vars(layer).values()] if isinstance(t, torch.Tensor)}
    assert sum(t.nbytes for t in tensors.values()) == n * k // 2 + n * k // 16 + 4 * n  # codes, FP8 scales, fp32 globals


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


# ---- the CPU path: W dequantized a tile of rows at a time -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("globals_", ["one", "per_row"])
def test_cpu_tiles_equal_the_reference(dtype, with_bias, globals_):
    """80 x 144 and 75 x 64 weights cut into tiles of 7 rows (N not a multiple: a 3- or 5-row tail),
    1 row, and one tile, at M = 1 and 5. Each tile's weights are the reference's rows bit for bit
    and its output is the reference's fp32 linear on those rows bit for bit. Against the reference
    itself, one GEMM over all of N whose BLAS kernel may sum K in another order (one-row tiles go
    to a matrix-vector kernel), it is within fp32 rounding, and so it is against the exact float64
    product. Measured: one tile is the reference bit for bit; 7- and 1-row tiles differ by up to
    1.5e-5 on outputs of magnitude ~50 (a few fp32 ulps), bf16 outputs by one bf16 ulp or none."""
    for n, k in [(80, 144), (75, 64)]:
        if globals_ == "one":
            q, packed, scale, g = quantized_weight(n, k, seed=n + k)
            w64 = q.dequantize().double()
        else:
            a, b, packed, scale, g = fused_pair(n - 23, 23, k)  # the parts meet inside a 7-row tile
            w64 = torch.cat([a.dequantize(), b.dequantize()]).double()
        bias = torch.randn(n).to(dtype) if with_bias else None
        w_ref = nvfp4_dequantize_reference(packed, scale, g)
        for m in (1, 5):
            x = torch.randn(m, k).to(dtype)
            ref = nvfp4_matmul_reference(x, packed, scale, g, bias)
            exact64, _ = exact_product(x, packed, scale, g, bias)
            bound = fp32_rounding_bound(x, w64) + (bias.double().abs() * 2.0**-24 if with_bias else 0)
            slack = ref.double().abs() * 2.0**-7 if dtype == torch.bfloat16 else 0.0  # a bf16 ulp: the final rounding
            for rows in (7, 1, n):
                y = nvfp4_matmul_tiled(x, packed, scale, g, bias, rows * k)
                assert y.dtype == dtype and y.shape == (m, n)
                for lo in range(0, n, rows):
                    hi = min(lo + rows, n)
                    g_rows = g[lo:hi] if g.numel() > 1 else g
                    assert torch.equal(dequantize_rows(packed[lo:hi], scale[lo:hi], g_rows), w_ref[lo:hi])
                    b = bias[lo:hi].float() if with_bias else None
                    assert torch.equal(y[:, lo:hi], torch.nn.functional.linear(x.float(), w_ref[lo:hi], b).to(dtype))
                diff = (y.double() - ref.double()).abs()
                print(f"{dtype} N={n} K={k} M={m} {rows}-row tiles: max |tiled - reference| {diff.max():.2e}")
                assert (diff <= 2 * bound + slack).all()
                assert ((y.double() - exact64).abs() <= bound + slack).all()


def test_cpu_path_dequantizes_one_tile_at_a_time(monkeypatch):
    """nvfp4_linear on a weight of 2.5 tiles: three tiles of whole rows, none over CPU_TILE_WEIGHTS,
    every row once; a weight of one tile is dequantized whole, once."""
    k = 512
    rows = CPU_TILE_WEIGHTS // k
    q, packed, scale, g = quantized_weight(rows * 5 // 2, k, seed=21)
    seen = []
    real = gemm.dequantize_rows

    def recording(packed, scale, global_scale):
        seen.append(packed.shape[0] * 2 * packed.shape[1])
        return real(packed, scale, global_scale)

    monkeypatch.setattr(gemm, "dequantize_rows", recording)
    x = torch.randn(2, k)
    y = nvfp4_linear(x, packed, scale, g)
    assert seen == [CPU_TILE_WEIGHTS, CPU_TILE_WEIGHTS, CPU_TILE_WEIGHTS // 2]
    assert ((y - nvfp4_matmul_reference(x, packed, scale, g)).abs() <= fp32_rounding_bound(x, q.dequantize())).all()
    seen.clear()
    nvfp4_linear(x, packed[:rows], scale[:rows], g)
    assert seen == [CPU_TILE_WEIGHTS]


def test_cpu_tiled_op_compiles_as_one_opaque_op():
    """Under torch.compile a weight of several tiles is one call of the custom op (its loop is not
    unrolled into the graph) and a weight of one tile is inlined; both compile with inductor as the
    engine compiles its decode step (C++ wrapper, dynamic batch) and give the eager results bit for
    bit. The op's fake implementation passes torch's checks."""
    k = 256
    _, big_p, big_s, big_g = quantized_weight(CPU_TILE_WEIGHTS // k * 3, k, seed=22)
    _, small_p, small_s, small_g = quantized_weight(48, k, seed=23)

    def f(x):
        return nvfp4_linear(x, big_p, big_s, big_g), nvfp4_linear(x, small_p, small_s, small_g)

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    x = torch.randn(3, k).bfloat16()
    torch._dynamo.reset()
    torch.compile(f, backend=recording_backend, fullgraph=True)(x)
    torch._dynamo.reset()
    (graph,) = graphs
    targets = [str(node.target) for node in graph.nodes if node.op in ("call_function", "call_method")]
    assert targets.count("sala.nvfp4_matmul_tiled.default") == 1
    assert targets.count("index_select") == 2  # the one-tile weight's two gathers, inlined
    compiled = torch.compile(f, dynamic=None, options={"cpp_wrapper": True})
    for m in (2, 5):
        x = torch.randn(m, k).bfloat16()
        torch._dynamo.mark_dynamic(x, 0)
        for got, want in zip(compiled(x), f(x)):
            assert torch.equal(got, want)
    args = (torch.randn(3, k).bfloat16(), big_p, big_s, big_g, torch.randn(big_p.shape[0]).bfloat16(), k * 100)
    checks = torch.library.opcheck(nvfp4_matmul_tiled, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    assert set(checks.values()) == {"SUCCESS"}


def test_cpu_tiled_op_rejects_mismatched_shapes():
    _, packed, scale, g = quantized_weight(32, 64, seed=24)
    with pytest.raises(ValueError, match="do not match packed weight"):
        nvfp4_matmul_tiled(torch.randn(2, 48), packed, scale, g, None)
    with pytest.raises(ValueError, match="expected \\[1\\] or \\[32\\]"):
        nvfp4_matmul_tiled(torch.randn(2, 64), packed, scale, torch.ones(31), None)
