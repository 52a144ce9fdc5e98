"""Lightning attention: every form against the naive recurrence and an independent parallel form."""
import pytest
import torch

from sala import lightning


def rand_qkv(b=2, h=4, t=70, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, t, dk, generator=g) for _ in range(2))
    v = torch.randn(b, h, t, dv, generator=g)
    s0 = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, s0


def parallel_reference(q, k, v, g, scale, s0):
    """O = scale * [((Q K^T) * D) V + diag(lambda^(t+1)) Q S0], D[t,s] = lambda^(t-s) for s <= t.

    Written from the closed form in the spec, independent of the recurrence and the chunking.
    """
    t = q.shape[2]
    idx = torch.arange(t, dtype=torch.float64)
    lam = torch.exp(g.double())
    dist = idx[:, None] - idx[None, :]
    d = torch.where(dist >= 0, lam.view(-1, 1, 1) ** dist.clamp(min=0), torch.zeros(()))
    qd, kd, vd = q.double(), k.double(), v.double()
    o = ((qd @ kd.transpose(-1, -2)) * d) @ vd
    o += (lam.view(-1, 1) ** (idx + 1)).view(1, -1, t, 1) * (qd @ s0.double())
    s = (lam.view(-1, 1) ** (t - 1 - idx)).view(1, -1, t, 1)
    final = (lam ** t).view(1, -1, 1, 1) * s0.double() + (kd * s).transpose(-1, -2) @ vd
    return (scale * o).float(), final.float()


@pytest.mark.parametrize("chunk", [16, 24, 64, 128])
def test_chunked_matches_recurrence_and_parallel(chunk):
    q, k, v, s0 = rand_qkv()
    g = lightning.log_decay(4)
    scale = 8**-0.5
    o_ref, s_ref = lightning.recurrent(q, k, v, g, scale, s0)
    o_par, s_par = parallel_reference(q, k, v, g, scale, s0)
    o, s = lightning.chunked(q, k, v, g, scale, s0, chunk_size=chunk)
    err = (o - o_ref).abs().max().item()
    print(f"chunk={chunk}: max |chunked - recurrent| = {err:.2e}, state {(s - s_ref).abs().max().item():.2e}")
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_ref, o_par, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_ref, s_par, rtol=1e-4, atol=1e-4)


def test_step_matches_recurrence_and_state_carries_across_calls():
    q, k, v, s0 = rand_qkv(t=20)
    g = lightning.log_decay(4)
    o_ref, s_ref = lightning.recurrent(q, k, v, g, 0.3, s0)
    # prefill 13 tokens chunked, then decode the rest one step at a time from the returned state
    o1, s = lightning.chunked(q[:, :, :13], k[:, :, :13], v[:, :, :13], g, 0.3, s0, chunk_size=8)
    outs = [o1]
    for t in range(13, 20):
        o_t, s = lightning.step(q[:, :, t], k[:, :, t], v[:, :, t], g, 0.3, s)
        outs.append(o_t[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


def test_zero_length_chunk_keeps_state():
    q, k, v, s0 = rand_qkv(t=0)
    o, s = lightning.chunked(q, k, v, lightning.log_decay(4), 1.0, s0)
    assert o.shape == (2, 4, 0, 6)
    assert torch.equal(s, s0)


@pytest.mark.parametrize(
    "n,expected",
    [
        (4, [0.25, 0.0625, 0.015625, 0.00390625]),
        (6, [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]),
        (8, [0.5 ** (i + 1) for i in range(8)]),
        (32, [2 ** (-(h + 1) / 4) for h in range(32)]),
    ],
)
def test_decay_slopes_match_spec(n, expected):
    torch.testing.assert_close(lightning.decay_slopes(n), torch.tensor(expected), rtol=1e-6, atol=0)


def test_slopes_32_heads_spot_values():
    s = lightning.decay_slopes(32)
    assert abs(s[0].item() - 0.840896) < 1e-6
    assert abs(s[1].item() - 0.707107) < 1e-6
    assert abs(s[3].item() - 0.5) < 1e-7
    assert abs(s[31].item() - 0.0039063) < 1e-6


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_batch_of_different_lengths_matches_each_alone(chunk):
    """Right-padded sequences of different lengths in one call (the engine's batched prefill):
    outputs and each sequence's final state (`lengths`) equal the recurrence run on it alone."""
    q, k, v, s0 = rand_qkv(b=3, t=70)
    lengths = [70, 33, 16]
    for i, n in enumerate(lengths):  # what the engine feeds past a sequence's end: zeros
        q[i, :, n:], k[i, :, n:], v[i, :, n:] = 0, 0, 0
    g = lightning.log_decay(4)
    o, s = lightning.chunked(q, k, v, g, 0.3, s0, chunk_size=chunk, lengths=torch.tensor(lengths))
    for i, n in enumerate(lengths):
        o_ref, s_ref = lightning.recurrent(q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n], g, 0.3, s0[i : i + 1])
        torch.testing.assert_close(o[i : i + 1, :, :n], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[i : i + 1], s_ref, rtol=1e-5, atol=1e-5)
