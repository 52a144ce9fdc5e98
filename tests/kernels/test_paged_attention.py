"""Paged decode attention: the torch reference and the Triton kernel (interpreted on CPU) against
a naive float64 loop over exactly each sequence's keys."""
import math
import subprocess
import sys

import pytest
import torch

from kernels.paged_attention import (
    SPLIT_LEN,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from tests.conftest import assert_gpu_bench_refuses_cpu

PAGE = 16
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 2, 4 * PAGE + 6]  # 1 token .. 5 pages


def naive(q, k_cache, v_cache, block_tables, context_lens, scale):
    """float64, one (sequence, query head) at a time, over its keys 0..len-1 looked up token by
    token through the block table."""
    b, hq, d = q.shape
    group = hq // k_cache.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(context_lens[i])
        pages = [int(block_tables[i, t // PAGE]) for t in range(n)]
        for h in range(hq):
            k = torch.stack([k_cache[p, t % PAGE, h // group] for t, p in enumerate(pages)]).double()
            v = torch.stack([v_cache[p, t % PAGE, h // group] for t, p in enumerate(pages)]).double()
            w = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v
    return out


def paged_problem(hq, hkv, d, dtype, lengths=LENGTHS, width=12, seed=0, index_dtype=torch.int32):
    """A pool with more pages than the sequences use, each sequence's pages drawn from a
    shuffled permutation (non-contiguous, out of order); block table entries past a sequence's
    last page are 0, and the table (width pages) is wider than the longest context."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / PAGE) for n in lengths]
    num_pages = sum(need) + 7
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.zeros(len(lengths), width, dtype=index_dtype)
    used = 0
    for i, p in enumerate(need):
        tables[i, :p] = perm[used : used + p].to(index_dtype)
        used += p
    k_cache = torch.randn(num_pages, PAGE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, hkv, d, generator=g).to(dtype)
    # q as the engine passes it: a transposed view of [Hq, B, D], not contiguous.
    q = torch.randn(hq, len(lengths), d, generator=g).to(dtype).transpose(0, 1)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=index_dtype)


# Thresholds from measured max |error| vs float64, in units of max |v| (about 4.5 here), about
# 3x above the largest measured over the cases below. fp32: reference 5.6e-8, kernel 8.8e-8.
# bf16: the reference's only error is rounding its fp32 result to bf16 (half an ulp), measured
# 9.5e-4; the kernel also rounds the softmax weights to bf16 for the P.V dot, and the
# interpreter truncates instead of rounding (a full ulp), measured 2.1e-3.
TOLERANCE = {torch.float32: (3e-7, 3e-7), torch.bfloat16: (3e-3, 6e-3)}  # (reference, kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2), (8, 2)])  # Hq / Hkv = 1, 2, 4
def test_reference_and_kernel_match_the_naive_loop(dtype, d, hq, hkv):
    q, k_cache, v_cache, tables, lens = paged_problem(hq, hkv, d, dtype, seed=d + hq)
    scale = d**-0.5
    exact = naive(q, k_cache, v_cache, tables, lens, scale)
    vmax = v_cache.abs().max().double()
    ref = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    # split_len 32 cuts the longer sequences into 2-3 splits and leaves others' later splits
    # empty; the default (256) is one split here, written without the merge kernel.
    one = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale)
    split = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale, split_len=32)
    tol_ref, tol_kernel = TOLERANCE[dtype]
    errs = {name: ((o.double() - exact).abs().max() / vmax).item() for name, o in
            [("reference", ref), ("kernel", one), ("kernel split 32", split)]}
    print(f"\n{dtype} D={d} Hq/Hkv={hq}/{hkv}: max |err| / max |v|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    for o in (ref, one, split):
        assert o.shape == (len(LENGTHS), hq, d) and o.dtype == dtype
    assert errs["reference"] <= tol_ref
    assert errs["kernel"] <= tol_kernel and errs["kernel split 32"] <= tol_kernel


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_long_context_in_a_much_wider_table_across_default_splits(index_dtype):
    # 300 tokens (19 pages) split at the default 256, next to a 1-token sequence, in a table
    # of 64 pages (1024 tokens, 4 splits of which the last 2-3 are empty).
    q, k_cache, v_cache, tables, lens = paged_problem(
        8, 2, 32, torch.float32, lengths=[300, 1], width=64, seed=5, index_dtype=index_dtype
    )
    exact = naive(q, k_cache, v_cache, tables, lens, 0.2)
    for o in (paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.2),
              paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.2)):
        err = (o.double() - exact).abs().max().item()
        print(f"\n300 + 1 tokens in a 1024-token table: max |err| {err:.2e}")
        assert err <= TOLERANCE[torch.float32][1] * v_cache.abs().max()


def test_kernel_result_does_not_depend_on_the_batch():
    # A sequence's split boundaries are fixed token counts, so alone in a narrow table or beside
    # others in a wide one, its output is the same bit for bit (docs/design/batch-invariance.md).
    q, k_cache, v_cache, tables, lens = paged_problem(8, 2, 32, torch.bfloat16, seed=3)
    together = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.2, split_len=32)
    for i in (0, 2, 4, 5):  # 1 and 16 tokens: one split alone, merged from several together
        pages = math.ceil(int(lens[i]) / PAGE)
        alone = paged_decode_attention_triton(q[i : i + 1], k_cache, v_cache, tables[i : i + 1, :pages],
                                              lens[i : i + 1], 0.2, split_len=32)
        assert torch.equal(alone, together[i : i + 1])


def test_reference_compiles_without_graph_breaks():
    q, k_cache, v_cache, tables, lens = paged_problem(4, 2, 32, torch.bfloat16, seed=4)
    compiled = torch.compile(paged_decode_attention_reference, fullgraph=True, dynamic=False)
    eager = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.25)
    out = compiled(q, k_cache, v_cache, tables, lens, 0.25)
    diff = (out.float() - eager.float()).abs().max().item()
    print(f"\ncompiled vs eager reference: max diff {diff:.2e}")
    # inductor may fuse the fp32 softmax differently: at most one bf16 rounding step apart.
    assert diff <= 2**-8 * eager.float().abs().max().item()


def test_dispatch_on_cpu_is_the_reference():
    q, k_cache, v_cache, tables, lens = paged_problem(4, 2, 32, torch.bfloat16, seed=6)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3),
                       paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.3))


def test_mismatched_shapes_are_rejected():
    q, k_cache, v_cache, tables, lens = paged_problem(4, 2, 32, torch.float32)
    for fn in (paged_decode_attention_reference, paged_decode_attention_triton):
        with pytest.raises(ValueError, match="multiple of Hkv"):
            fn(q[:, :3], k_cache, v_cache, tables, lens, 1.0)
        with pytest.raises(ValueError, match="must be \\[B, max_pages\\] and \\[B\\]"):
            fn(q, k_cache, v_cache, tables[:2], lens, 1.0)
        with pytest.raises(ValueError, match="caches are"):
            fn(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 1.0)


def test_reference_and_dispatch_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels.paged_attention import paged_decode_attention\n"
        "k = torch.zeros(2, 4, 1, 8); v = torch.arange(8.0).view(2, 4, 1, 1).expand(2, 4, 1, 8)\n"
        "o = paged_decode_attention(torch.ones(1, 2, 8), k, v, torch.tensor([[1, 0]]), torch.tensor([3]), 1.0)\n"
        "assert torch.allclose(o, torch.full((1, 2, 8), 5.0)), o\n"  # equal scores: mean of 4, 5, 6
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_exits_with_one_line_without_a_gpu():
    assert_gpu_bench_refuses_cpu("paged_attention_gpu.py")


@pytest.mark.gpu
@pytest.mark.parametrize("context", [1, 1000, 5000])
def test_kernel_on_gpu_and_under_a_cuda_graph(context):
    # The 9B model's sparse-layer shapes, page size 64, bf16, several splits.
    b, hq, hkv, d, page = 4, 32, 2, 128, 64
    width = math.ceil(5000 / page)
    pool = b * width + 3
    k_cache = torch.randn(pool, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pool, device="cuda")[: b * width].view(b, width).int()
    lens = torch.tensor([context, max(1, context // 2), 1, context], device="cuda", dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, d**-0.5)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
    # p rounded to bf16 for the P.V dot plus the output's bf16 rounding (half an ulp each here).
    assert (out.float() - ref.float()).abs().max() <= 2**-7 * v_cache.abs().max().float()
    graph_out = torch.empty_like(out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out.copy_(paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out)
    assert SPLIT_LEN < 5000  # the 5000-token case runs the merge kernel
