"""The Triton K/V kernels (interpreted on CPU) against the torch formats of sala/kv: quantize on
write stores the bits the codecs store; decode attention over FP8 / NVFP4 pages, dequantized
in registers, equals attention over the pages' dequantized values (a naive float64 loop) and
the torch path the engine takes on CPU."""
import pytest
import torch

from kernels.paged_attention import PagedKV, paged_decode_attention_pages_triton
from sala.kv import KVPages, make_codec
from sala.kv.pages import decode_attention_reference
from tests.kv.test_kv import kv_rows, naive_decode_attention

PAGES, PAGE_SIZE, HKV, D = 9, 4, 2, 32


def rows_with_ties(dtype=torch.float32):
    """kv_rows plus rows that land exactly on rounding ties: FP8 (scale 1: 1.0625 lies between
    1.0 and 1.125 and goes to 1.0, 1.1875 to 1.25) and E2M1 (a group of max 6 has step 1 under
    global scale 1: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    x = kv_rows(n=PAGES * PAGE_SIZE, h=HKV, d=D, seed=7)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    x[2, 0, :16] = ties
    x[2, 0, 16:] = torch.tensor([1.0625, 1.1875, -1.0625, -1.1875] * 4)
    x[3, 1] = -1e-30  # tiny negatives: sign bit set on a zero code (0x8)
    return x.to(dtype)


def pages_pair(fmt: str, amax=None) -> tuple[KVPages, KVPages]:
    return tuple(KVPages(make_codec(fmt, amax), PAGES, PAGE_SIZE, HKV, D, "cpu") for _ in range(2))


@pytest.mark.parametrize("fmt, calibrated", [("fp8", False), ("fp8", True), ("nvfp4", False), ("nvfp4", True),
                                             ("nvfp4_4over6", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kernel_stores_the_bits_the_torch_codec_stores(fmt, calibrated, dtype):
    x = rows_with_ties(dtype)
    # Head scale 1 where calibrated FP8 should see the ties (amax 448); NVFP4's global from amax.
    amax = ([448.0, 448.0] if fmt == "fp8" else x.float().abs().amax((0, 2)).tolist()) if calibrated else None
    torch_pages, triton_pages = pages_pair(fmt, amax)
    g = torch.Generator().manual_seed(1)
    rows = torch.randperm(PAGES * PAGE_SIZE, generator=g)[:30]  # 6 rows never written
    # x as the engine passes it: a [N, H, D] view of [H, N, D], not contiguous.
    xs = x[: len(rows)].transpose(0, 1).contiguous().transpose(0, 1)
    torch_pages.write(rows, xs)
    triton_pages.write_triton(rows, xs)
    a, b = torch_pages.data.view(torch.uint8), triton_pages.data.view(torch.uint8)
    if fmt == "nvfp4_4over6":
        # A near-tie between the two candidate scales may go either way (sums in another order).
        differ = (torch_pages.scale.view(torch.uint8) != triton_pages.scale.view(torch.uint8)).float().mean().item()
        print(f"4over6: {differ:.2%} of group scales chosen differently")
        assert differ <= 0.01
        same = (torch_pages.scale.view(torch.uint8) == triton_pages.scale.view(torch.uint8)).all(-1)
        assert torch.equal(a[same], b[same])
        return
    assert torch.equal(a, b)
    if torch_pages.scale is not None:
        assert torch.equal(torch_pages.scale.view(torch.uint8), triton_pages.scale.view(torch.uint8))
    if fmt == "fp8" and calibrated:  # the ties really were exercised
        got = triton_pages.read(rows[2:3], torch.float32)[0, 0, 16:20]
        assert got.tolist() == [1.0, 1.25, -1.0, -1.25]


def decode_problem(k_fmt, v_fmt, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    k = KVPages(make_codec(k_fmt, None if k_fmt == "fp8" else [9.0, 7.0]), PAGES, PAGE_SIZE, HKV, D, "cpu")
    v = KVPages(make_codec(v_fmt, [3.0, 2.0]), PAGES, PAGE_SIZE, HKV, D, "cpu")
    rows = torch.randperm(PAGES * PAGE_SIZE, generator=g)
    k.write(rows, torch.randn(len(rows), HKV, D, generator=g) * 2)
    v.write(rows, torch.randn(len(rows), HKV, D, generator=g))
    tables = torch.tensor([[3, 1, 7, 0], [0, 8, 2, 0], [5, 4, 6, 2]])  # wider than every context
    lens = torch.tensor([11, 1, 15])
    q = torch.randn(4, 3, D, generator=g).to(dtype).transpose(0, 1)  # [B, Hq, D], a view as the engine's
    return q, k, v, tables, lens


# Measured max |error| vs the float64 loop over the dequantized values, in units of max |v|
# (about 3 here), over the cases below: fp32 q 2.1e-7 (the kernel scales scores rather than
# elements: fp32 rounding only); bf16 q 5.0e-3 for the kernel (p rounded to bf16 for the P.V
# dot, the output truncated to bf16 by the interpreter: a full ulp), 2.1e-3 for the torch path
# (which rounds the output to nearest). Bounds about 2x above, as tests/kernels/test_paged_attention.py.
TOLERANCE = {torch.float32: 5e-7, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("k_fmt, v_fmt", [("fp8", "fp8"), ("nvfp4", "nvfp4_4over6"), ("fp8", "nvfp4"),
                                          ("nvfp4", "fp8"), ("bf16", "fp8")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_over_quantized_pages_equals_attention_over_their_dequantized_values(k_fmt, v_fmt, dtype):
    if k_fmt == "bf16" and dtype == torch.float32:
        pytest.skip("bf16 pages with an fp32 q are dequantized by the torch path")
    q, k, v, tables, lens = decode_problem(k_fmt, v_fmt, dtype)
    scale = D**-0.5
    vd = v.dequantized(torch.float32)
    want = naive_decode_attention(q.float(), k.dequantized(torch.float32), vd, tables, lens, scale)
    vmax = vd.abs().max().item()
    ref = decode_attention_reference(q, k, v, tables, lens, scale)  # what the engine runs on CPU
    errs = {}
    for split_len in (256, 4):  # one split; several, merged (scalar V scales carried in the partials)
        got = paged_decode_attention_pages_triton(q, k.kernel_view(), v.kernel_view(), tables, lens, scale,
                                                  split_len=split_len)
        assert got.dtype == dtype and got.shape == q.shape
        errs[split_len] = (got.double() - want).abs().max().item() / vmax
    errs["torch"] = (ref.double() - want).abs().max().item() / vmax
    print(f"{k_fmt}/{v_fmt} {dtype}: max error / max |v| {errs}")
    assert max(errs.values()) < TOLERANCE[dtype]


def test_decode_kernel_reads_the_scales():
    """Scaling a layer's FP8 head scales or NVFP4 global scale changes the kernel's output as
    it changes the dequantized values (a kernel ignoring a scale fails here)."""
    q, k, v, tables, lens = decode_problem("nvfp4", "fp8", torch.float32)
    base = paged_decode_attention_pages_triton(q, k.kernel_view(), v.kernel_view(), tables, lens, 0.2)
    view = v.kernel_view()
    doubled = paged_decode_attention_pages_triton(q, k.kernel_view(), PagedKV(view.data, "fp8", None, view.head_scale * 2),
                                                  tables, lens, 0.2)
    torch.testing.assert_close(doubled, 2 * base, rtol=1e-6, atol=1e-6)
    kv = k.kernel_view()
    halved_global = PagedKV(kv.data, "nvfp4", kv.row_scale, kv.head_scale * 2)  # keys halved: softer softmax
    softer = paged_decode_attention_pages_triton(q, halved_global, v.kernel_view(), tables, lens, 0.4)
    torch.testing.assert_close(softer, base, rtol=1e-5, atol=1e-6)


def test_bad_page_specs_are_rejected():
    q, k, v, tables, lens = decode_problem("fp8", "nvfp4", torch.float32)
    kv, vv = k.kernel_view(), v.kernel_view()
    with pytest.raises(ValueError, match="exactly one of row_scale"):
        paged_decode_attention_pages_triton(q, PagedKV(kv.data, "fp8"), vv, tables, lens, 1.0)
    with pytest.raises(ValueError, match="unknown page format"):
        paged_decode_attention_pages_triton(q, PagedKV(kv.data, "int4"), vv, tables, lens, 1.0)
    with pytest.raises(ValueError, match=r"expected \[pages, page_size, Hkv, 16\]"):
        paged_decode_attention_pages_triton(q, kv, PagedKV(kv.data, "nvfp4", vv.row_scale, vv.head_scale), tables, lens, 1.0)
    with pytest.raises(ValueError, match="exactly one of row_scale"):
        from kernels.kv_quant import fp8_write_triton

        fp8_write_triton(torch.zeros(2, HKV, D), torch.tensor([0, 1]), k.data)


def test_fp8_write_rounds_every_e4m3_interval_like_torch():
    """Every E4M3 value, every midpoint between neighbours (ties) and points just beside them,
    both signs, beyond 448 (saturation) and -0.0, written with head scale 1."""
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.tensor([460.0, 1e6, 2.0**-10, 2.0**-11, 3 * 2.0**-11])])
    vals = torch.cat([vals, -vals, torch.tensor([-0.0])])
    n = -(-vals.numel() // D)
    x = torch.cat([vals, torch.zeros(n * D - vals.numel())]).view(n, 1, D).expand(n, HKV, D)
    torch_pages, triton_pages = (KVPages(make_codec("fp8", [448.0] * HKV), n, 1, HKV, D, "cpu") for _ in range(2))
    rows = torch.arange(n)
    torch_pages.write(rows, x)
    triton_pages.write_triton(rows, x)
    assert torch.equal(torch_pages.data.view(torch.uint8), triton_pages.data.view(torch.uint8))


def test_bench_exits_with_one_line_without_a_gpu():
    from tests.conftest import assert_gpu_bench_refuses_cpu

    assert_gpu_bench_refuses_cpu("kv_attention_gpu.py")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "nvfp4_4over6"])
def test_engine_path_on_gpu_writes_the_torch_bits_and_attends_under_a_cuda_graph(fmt):
    """On CUDA KVPages dispatches to the kernels: the pages written equal the torch codec's on
    CPU, decode attention agrees with the torch path over them, and both replay in a graph."""
    b, hq, hkv, d, page, n_pages = 4, 32, 2, 128, 64, 80
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n_pages * page, hkv, d, generator=g) * 3).to(torch.bfloat16)
    amax = None if fmt == "fp8" else [12.0, 12.0]
    cpu, gpu = KVPages(make_codec(fmt, amax), n_pages, page, hkv, d, "cpu"), KVPages(make_codec(fmt, amax), n_pages, page, hkv, d, "cuda")
    rows = torch.randperm(n_pages * page, generator=g)
    cpu.write(rows, x)
    gpu.write(rows.cuda(), x.cuda())
    same = (cpu.data.view(torch.uint8) == gpu.data.view(torch.uint8).cpu()).float().mean().item()
    assert same == 1.0 or (fmt == "nvfp4_4over6" and same > 0.99), same
    v = KVPages(make_codec("fp8"), n_pages, page, hkv, d, "cuda")
    v.write(rows.cuda(), x.cuda().flip(0))
    tables = torch.randperm(n_pages, device="cuda")[: b * 20].view(b, 20).int()
    lens = torch.tensor([1, 700, 1280, 64], device="cuda", dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    from sala.kv import decode_attention

    out = decode_attention(q, gpu, v, tables, lens, d**-0.5)
    ref = decode_attention_reference(q, gpu, v, tables, lens, d**-0.5)
    assert (out.float() - ref.float()).abs().max() <= 2**-6 * v.dequantized(torch.float32).abs().max()
    graph_out = torch.empty_like(out)
    new_rows = torch.arange(8, device="cuda")
    fresh = torch.randn(8, hkv, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.write(new_rows, fresh)
        graph_out.copy_(decode_attention(q, gpu, v, tables, lens, d**-0.5))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, decode_attention(q, gpu, v, tables, lens, d**-0.5), rtol=0, atol=0)
