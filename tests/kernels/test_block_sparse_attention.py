"""The block-sparse attention kernel (kernels/block_sparse_attention.py), Triton under the
interpreter and its torch reference, against sala/sparse.py's mask-based attention."""
import pytest
import torch

from kernels.block_sparse_attention import block_sparse_attention_reference, block_sparse_attention_triton, triton
from sala import sparse


def selection(length, t_q, hkv, block_size, k_sel, seed):
    """Random causal selections that always hold the query's own block, -1 padded, plus the mask."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(length - t_q, length)
    nb = -(-length // block_size)
    idx = torch.full((hkv, t_q, k_sel), -1, dtype=torch.long)
    mask = torch.zeros(hkv, t_q, nb, dtype=torch.bool)
    for h in range(hkv):
        for i, p in enumerate(pos.tolist()):
            own = p // block_size
            extra = torch.randperm(own, generator=g)[: k_sel - 1] if own else torch.empty(0, dtype=torch.long)
            chosen = torch.cat([extra, torch.tensor([own])]).sort().values
            idx[h, i, : len(chosen)] = chosen
            mask[h, i, chosen] = True
    return pos, idx, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sparse_kernel_and_reference_match_the_masked_attention(dtype):
    length, t_q, hq, hkv, d, bs = 100, 40, 4, 2, 16, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t_q, hq, d, generator=g).to(dtype)
    k = torch.randn(length, hkv, d, generator=g).to(dtype)
    v = torch.randn(length, hkv, d, generator=g).to(dtype)
    pos, idx, mask = selection(length, t_q, hkv, bs, 3, 1)
    want = sparse.block_sparse_attention(q.transpose(0, 1), k, v, pos, mask, bs, d**-0.5).transpose(0, 1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(block_sparse_attention_reference(q, k, v, pos, idx, bs, d**-0.5).float(), want, **tol)
    if triton is not None:
        torch.testing.assert_close(block_sparse_attention_triton(q, k, v, pos, idx, bs, d**-0.5).float(), want, **tol)


@pytest.mark.gpu
def test_block_sparse_kernel_on_cuda_at_the_9b_shapes():
    """32 query heads on 2 kv heads, D = 128, 64-token blocks, 96 selected of 160, bf16."""
    length, t_q, hq, hkv, d, bs = 10240, 64, 32, 2, 128, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()
               for shape in ((t_q, hq, d), (length, hkv, d), (length, hkv, d)))
    pos, idx, _ = selection(length, t_q, hkv, bs, 96, 1)
    pos, idx = pos.cuda(), idx.cuda()
    torch.testing.assert_close(block_sparse_attention_triton(q, k, v, pos, idx, bs, d**-0.5).float(),
                               block_sparse_attention_reference(q, k, v, pos, idx, bs, d**-0.5).float(),
                               atol=2e-2, rtol=2e-2)


def test_stage1_kernel_and_reference_match_sala_selection_scores():
    """The Triton stage-1 kernel (interpreter) equals its torch reference, which sala/sparse.py's
    selection runs on CPU (tests/model/test_sparse.py checks it against the naive spec reference)."""
    from kernels.stage1_scores import stage1_scores_reference, stage1_scores_triton

    s = sparse.SparseSettings(block_size=16, dense_len=0, init_blocks=1, kernel_size=8, kernel_stride=4, topk=3, window_size=32)
    length, hq, hkv, d = 150, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(length, hq, d, generator=g), torch.randn(length, hkv, d, generator=g)
    k1, k2 = sparse.CompressedKeys(s).extend(k)
    pos = torch.arange(length)
    (size1, st1), (size2, st2) = s.levels
    vis1 = sparse.visible_windows(pos, k1.shape[0], size1, st1, length)
    vis2 = sparse.visible_windows(pos, k2.shape[0], size2, st2, length)
    want = stage1_scores_reference(q, k1, k2, vis1, vis2, d**-0.5)
    assert want[:, 100:].sum() > 0
    if triton is not None:
        torch.testing.assert_close(stage1_scores_triton(q, k1, k2, vis1, vis2, d**-0.5), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_stage1_kernel_on_cuda_at_the_9b_shapes():
    from kernels.stage1_scores import stage1_scores_reference, stage1_scores_triton

    t_q, hq, hkv, d, n1, n2 = 64, 32, 2, 128, 1023, 255
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t_q, hq, d, generator=g).to(torch.bfloat16).cuda() * 0.1
    k1, k2 = torch.randn(n1, hkv, d, generator=g).cuda(), torch.randn(n2, hkv, d, generator=g).cuda()
    vis1 = torch.arange(n1 - t_q, n1).cuda()
    vis2 = vis1 // 4
    torch.testing.assert_close(stage1_scores_triton(q, k1, k2, vis1, vis2, d**-0.5),
                               stage1_scores_reference(q, k1, k2, vis1, vis2, d**-0.5), atol=1e-3, rtol=1e-3)
