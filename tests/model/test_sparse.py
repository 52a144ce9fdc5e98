"""InfLLM-v2 (sala/sparse.py) against a naive reference written from the spec, and the model's
sparse path: exact below dense_len, decode after a long prefill equal to the full forward."""
import math

import pytest
import torch

from sala import sparse
from sala.config import ConfigError, SALAConfig
from sala.hf import MiniCPMSALAForCausalLM
from sala.sparse import SparseSettings
from tests.model.test_model import random_model

SMALL = SparseSettings(block_size=16, dense_len=0, init_blocks=1, kernel_size=8, kernel_stride=4, topk=3, window_size=32)


# ---------------------------------------------------------------- naive reference (float64, loops)
def ref_windows(keys, size, stride):
    """keys [L, D] -> [n, D] means of complete windows from 0."""
    n = max((keys.shape[0] - size) // stride + 1, 0)
    return torch.stack([keys[j * stride : j * stride + size].mean(0) for j in range(n)]) if n else keys[:0]


def tdiv(a, b):
    return int(a / b)  # C division truncates towards zero


def ref_visible(t, n, stride, tq, decode):
    """The kernel's count, as the spec writes it: j < clamp((t+1)//s - 1 + n - tdiv(Tq - s + 1, s), 0, n)."""
    if decode:
        return n
    return min(max((t + 1) // stride - 1 + n - tdiv(tq - stride + 1, stride), 0), n)


def ref_selection(q, k, s: SparseSettings, decode=False):
    """Selected blocks per (kv head, query): a dict (h, t) -> set of block indices. q [Hq, T, D]
    (queries at positions L - T ..), k [L, Hkv, D]. Prefill rows: one-shot prefill of L tokens."""
    hq, t_q, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    (s1, st1), (s2, st2) = s.levels
    out = {}
    for h in range(hkv):
        k1, k2 = ref_windows(k[:, h], s1, st1), ref_windows(k[:, h], s2, st2)
        for i in range(t_q):
            t = length - t_q + i
            v1 = ref_visible(t, k1.shape[0], st1, length, decode)
            v2 = ref_visible(t, k2.shape[0], st2, length, decode)
            score = torch.zeros(v1, dtype=torch.float64)
            for head in range(h * g, (h + 1) * g):
                logits2 = [(q[head, i] @ k2[j]) / math.sqrt(d) for j in range(v2)]
                lse = torch.logsumexp(torch.tensor(logits2, dtype=torch.float64), 0) if v2 else -math.inf
                for j in range(v1):
                    score[j] += math.exp((q[head, i] @ k1[j]) / math.sqrt(d) - lse)
            nb = -(-length // s.block_size)
            own = t // s.block_size
            per = s.block_size // st1
            block_score = []
            for b in range(nb):
                ws = [score[j] for j in range(per * b - 1, per * b + per) if 0 <= j < v1]
                sc = max(ws) if ws else -math.inf
                if b < s.init_blocks or own - s.local_blocks <= b <= own:
                    sc = math.inf
                block_score.append(sc)
            k_sel = min(s.num_selected, nb)
            ranked = sorted(range(nb), key=lambda b: (-block_score[b], b))  # ties: lower index first
            out[h, i] = {b for b in ranked[:k_sel] if b <= own}
    return out


def ref_attention(q, k, v, sel, block_size):
    """Full score matrix, everything outside the selected blocks (or after the query) masked."""
    hq, t_q, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    o = torch.zeros(hq, t_q, d, dtype=torch.float64)
    for head in range(hq):
        h = head // (hq // hkv)
        scores = (q[head] @ k[:, h].T) / math.sqrt(d)  # [T, L]
        for i in range(t_q):
            t = length - t_q + i
            keep = torch.tensor([j <= t and j // block_size in sel[h, i] for j in range(length)])
            o[head, i] = torch.softmax(scores[i].masked_fill(~keep, -math.inf), 0) @ v[:, h]
    return o


def random_qkv(length, t_q, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, t_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(length, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(length, hkv, d, generator=g, dtype=torch.float64)
    return q, k, v


def ours(q, k, v, s, decode=False):
    length, t_q = k.shape[0], q.shape[1]
    k1, k2 = sparse.CompressedKeys(s).extend(k.float())
    qf, kf, vf = q.float(), k.float(), v.float()
    pos = torch.arange(length - t_q, length)
    mask = sparse.select_blocks(qf, k1, k2, pos, 0 if decode else length, s, q.shape[-1] ** -0.5)
    o = sparse.infllm_v2_attention(qf, kf, vf, k1, k2, length - t_q, 0 if decode else length, s, q.shape[-1] ** -0.5)
    return mask, o


@pytest.mark.parametrize("length", [300, 303, 319])  # 303 % 4 == 3 and 319 % 16 == 15: the kernel's one-fewer windows
def test_sparse_prefill_equals_naive_reference(length):
    q, k, v = random_qkv(length, length)
    mask, o = ours(q, k, v, SMALL)
    sel = ref_selection(q, k, SMALL)
    got = {(h, i): set(mask[h, i].nonzero().flatten().tolist()) for h in range(2) for i in range(length)}
    assert got == sel
    torch.testing.assert_close(o.double(), ref_attention(q, k, v, sel, SMALL.block_size), atol=2e-5, rtol=1e-4)


def test_sparse_decode_equals_naive_reference():
    q, k, v = random_qkv(301, 1, seed=1)
    mask, o = ours(q, k, v, SMALL, decode=True)
    sel = ref_selection(q, k, SMALL, decode=True)
    assert {(h, 0): set(mask[h, 0].nonzero().flatten().tolist()) for h in range(2)} == sel
    torch.testing.assert_close(o.double(), ref_attention(q, k, v, sel, SMALL.block_size), atol=2e-5, rtol=1e-4)


def test_selection_keeps_init_and_local_blocks_is_causal_and_sized():
    length = 400
    q, k, _ = random_qkv(length, length, seed=2)
    mask, _ = ours(q, k, k, SMALL)
    for i in range(length):
        own = i // SMALL.block_size
        chosen = set(mask[0, i].nonzero().flatten().tolist()) | set(mask[1, i].nonzero().flatten().tolist())
        assert max(chosen) == own  # causal, and the query's own block is in
        assert {0} | set(range(max(own - SMALL.local_blocks, 0), own + 1)) <= set(mask[0, i].nonzero().flatten().tolist())
        assert int(mask[0, i].sum()) == min(SMALL.num_selected, own + 1)
    # the selection differs between the kv heads (it is shared only within a GQA group)
    assert not torch.equal(mask[0], mask[1])


def test_kth_block_ties_go_to_the_lower_index():
    """Equal keys make every block score the same: the non-forced picks are the lowest blocks."""
    length = 200
    q = torch.randn(4, 1, 8)
    k = torch.ones(length, 2, 8)
    mask, _ = ours(q, k, k, SMALL, decode=True)
    own = (length - 1) // SMALL.block_size
    forced = {0} | set(range(own - SMALL.local_blocks, own + 1))
    free = sorted(set(range(own)) - forced)[: SMALL.num_selected - len(forced)]
    assert set(mask[0, 0].nonzero().flatten().tolist()) == forced | set(free)


# ---------------------------------------------------------------- the model's sparse path
MODEL_SPARSE = {"block_size": 64, "dense_len": 256, "init_blocks": 1, "kernel_size": 32, "kernel_stride": 16,
                "topk": 4, "window_size": 64}


def sparse_model(**sc):
    return random_model(seed=3, max_position_embeddings=2048, sparse_config={**MODEL_SPARSE, **sc})


def test_below_dense_len_the_sparse_model_is_exactly_dense():
    m = sparse_model()
    dense = sparse_model(dense_len=1 << 20)
    ids = torch.randint(0, 101, (1, 255), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, dense(ids).logits)
        long = torch.randint(0, 101, (1, 600), generator=torch.Generator().manual_seed(1))
        # and past it the output is no longer dense (late queries attend to 5 of up to 10 blocks)
        assert (m(long).logits[0, 400:] - dense(long).logits[0, 400:]).abs().max() > 1e-3


def test_decode_after_long_prefill_equals_full_forward():
    m = sparse_model()
    ids = torch.randint(0, 101, (1, 520), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(ids).logits
        out = m(ids[:, :300], use_cache=True)  # sparse from here; decode then makes the windows of blocks 4-8
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(300, 519):
            out = m(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[:, -1])
    # decode rows see every window; prefill rows of 520 and 300 tokens have no one-fewer quirk
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 299:519], atol=1e-4, rtol=1e-4)


def test_generate_through_transformers_takes_the_sparse_path():
    m = sparse_model()
    ids = torch.randint(0, 101, (1, 400), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        gen = MiniCPMSALAForCausalLM.sharing(m).generate(ids, max_new_tokens=4, do_sample=False)
        loop = ids
        for _ in range(4):
            loop = torch.cat([loop, m(loop).logits[:, -1:].argmax(-1)], 1)
    assert gen[0, 400:].tolist() == loop[0, 400:].tolist()


def test_left_padded_batch_equals_each_sequence_alone():
    m = sparse_model()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(3, 101, (1, 450), generator=g), torch.randint(3, 101, (1, 300), generator=g)
    batch = torch.cat([a, torch.cat([torch.full((1, 150), 2), b], 1)])
    mask = torch.cat([torch.ones(1, 450), torch.cat([torch.zeros(1, 150), torch.ones(1, 300)], 1)]).long()
    with torch.no_grad():
        got = m(batch, attention_mask=mask).logits
        torch.testing.assert_close(got[0], m(a).logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1, 150:], m(b).logits[0], atol=1e-4, rtol=1e-4)


def test_prompt_past_max_position_embeddings_is_refused():
    m = sparse_model()
    with pytest.raises(ValueError, match="max_position_embeddings=2048"):
        m(torch.zeros(1, 2049, dtype=torch.long))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"window_size": 100}, "window_size=100 is not a multiple of block_size=64"),
        ({"topk": 0}, "topk=0 must be at least 1"),
        ({"kernel_stride": 64}, "kernel_stride=64 is larger than kernel_size=32"),
        ({"kernel_stride": 12}, "multiples of kernel_stride=12"),
        ({"block_size": "64"}, "must be integers"),
    ],
)
def test_inconsistent_sparse_config_is_refused(change, needle):
    with pytest.raises(ConfigError, match=needle):
        SALAConfig(sparse_config={**MODEL_SPARSE, **change})
