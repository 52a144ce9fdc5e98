"""The prefill kernels (kernels/prefill_attention.py, kernels/lightning_prefill.py), Triton under
the interpreter and their torch references, against naive references written here: an explicit
masked softmax for attention, sala/lightning.py's token-by-token recurrence for lightning."""
import pytest
import torch

from kernels.lightning_prefill import lightning_prefill_reference, lightning_prefill_triton
from kernels.prefill_attention import prefill_attention_reference, prefill_attention_triton, triton
from sala import lightning
from tests.conftest import assert_gpu_bench_refuses_cpu

needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed")


def naive_attention(q, k, v, scale):
    """Every score, the causal mask written out (query i at position L - T + i), softmax, in fp64."""
    hq, t, _ = q.shape
    hkv, length, _ = k.shape
    kk, vv = (x.double().repeat_interleave(hq // hkv, 0) for x in (k, v))
    scores = q.double() @ kk.transpose(1, 2) * scale
    visible = torch.arange(length)[None] <= torch.arange(length - t, length)[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vv).float()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past,blocks", [(0, (64, 64)), (60, (16, 16))])
def test_prefill_attention_kernel_and_reference_match_the_naive_softmax(dtype, past, blocks):
    """A fresh prompt (one tile) and a chunk after 60 cached keys in 16-row tiles (several query
    tiles, each stopping at its own last key), 4 query heads on 2 kv heads, D = 24 (padded to 32)."""
    t, hq, hkv, d = 40, 4, 2, 24
    g = torch.Generator().manual_seed(past)
    q = torch.randn(hq, t, d, generator=g).to(dtype)
    k, v = (torch.randn(hkv, past + t, d, generator=g).to(dtype) for _ in range(2))
    want = naive_attention(q, k, v, d**-0.5)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(prefill_attention_reference(q, k, v).float(), want, **tol)
    torch.testing.assert_close(prefill_attention_triton(q, k, v, None, *blocks).float(), want, **tol)


def test_prefill_attention_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="L >= T"):
        prefill_attention_reference(torch.zeros(4, 8, 16), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        prefill_attention_reference(torch.zeros(3, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16))


def recurrence_per_sequence(q, k, v, g, scale, s0, lengths):
    """sala.lightning.recurrent over each sequence's own tokens: outputs there (zeros past) and its final state."""
    o, finals = torch.zeros_like(v), []
    for b, n in enumerate(lengths):
        o_b, s_b = lightning.recurrent(q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n], g, scale,
                                       None if s0 is None else s0[b : b + 1])
        o[b, :, :n] = o_b[0]
        finals.append(s_b[0])
    return o, torch.stack(finals)


@needs_triton
@pytest.mark.parametrize("with_state,lengths,block_v", [(True, None, 64), (False, None, 16), (True, [150, 70], 16)])
def test_lightning_prefill_kernel_and_reference_match_the_recurrence(with_state, lengths, block_v):
    """150 tokens (two whole 64-token chunks and a partial one), Dk = 16, Dv = 24 (one or two
    column blocks), from a given state or zeros, and a right-padded batch whose second sequence
    ends mid-chunk (its final state taken there, its outputs past there zero)."""
    b, h, t, dk, dv = 2, 2, 150, 16, 24
    gen = torch.Generator().manual_seed(block_v)
    q, k = (torch.randn(b, h, t, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, h, t, dv, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen) if with_state else None
    g, scale = lightning.log_decay(h), dk**-0.5
    want_o, want_s = recurrence_per_sequence(q, k, v, g, scale, s0, lengths or [t] * b)
    n = None if lengths is None else torch.tensor(lengths)
    for o, s in (lightning_prefill_reference(q, k, v, g, scale, s0, n),
                 lightning_prefill_triton(q, k, v, g, scale, s0, n, block_v=block_v)):
        torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


@needs_triton
def test_lightning_prefill_kernel_reads_strided_slices():
    """The engine passes a span's slice of a step's rows ([1, H, N, D] cut along N): not contiguous."""
    h, n, d = 2, 200, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for _ in range(3))
    part = slice(30, 130)
    g, scale = lightning.log_decay(h), d**-0.5
    want_o, want_s = lightning.recurrent(q[:, :, part], k[:, :, part], v[:, :, part], g, scale)
    o, s = lightning_prefill_triton(q[:, :, part], k[:, :, part], v[:, :, part], g, scale)
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_prefill_kernels_on_cuda_at_the_9b_shapes():
    """Dense: 32 query heads on 2 kv heads, D = 128, a 2048-token chunk after 2048 cached keys, bf16,
    against SDPA. Lightning: 32 heads, D = 128, 4096 tokens from a state, fp32, against the torch form."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(32, 2048, 128, generator=gen).to(torch.bfloat16).cuda()
    k, v = (torch.randn(2, 4096, 128, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    torch.testing.assert_close(prefill_attention_triton(q, k, v).float(), prefill_attention_reference(q, k, v).float(),
                               atol=2e-2, rtol=2e-2)
    q, k, v = (torch.randn(1, 32, 4096, 128, generator=gen).cuda() * 0.1 for _ in range(3))
    s0 = torch.randn(1, 32, 128, 128, generator=gen).cuda()
    g = lightning.log_decay(32).cuda()
    o, s = lightning_prefill_triton(q, k, v, g, 128**-0.5, s0)
    want_o, want_s = lightning_prefill_reference(q, k, v, g, 128**-0.5, s0)
    torch.testing.assert_close(o, want_o, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(s, want_s, atol=1e-3, rtol=1e-3)


def test_gpu_bench_refuses_a_machine_without_cuda():
    assert_gpu_bench_refuses_cpu("prefill_kernels_gpu.py")
