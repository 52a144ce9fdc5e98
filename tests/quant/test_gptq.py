"""GPTQ on NVFP4 groups: the Hessian, exact reduction to RTN, a naive float64 reference, and
the error it saves over RTN on correlated inputs."""
import pytest
import torch

from sala.quant.gptq import HessianAccumulator, gptq_quantize, relative_output_error, relative_weight_error
from sala.quant.nvfp4 import quantize_column, quantize_rtn


def correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated features and unequal scales, as in real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    scales = torch.logspace(-1, 0.5, k)[torch.randperm(k, generator=g)]
    return (torch.randn(tokens, k, generator=g) @ mix + 0.2 * torch.randn(tokens, k, generator=g)) * scales


def naive_gptq(w, h, scale, gscale, damp=0.01):
    """Textbook column-by-column GPTQ in float64: quantize column i, spread its error with the
    inverse Hessian of the remaining columns, then eliminate i from that inverse."""
    w = w.double().clone()
    h = h.double() + damp * h.diagonal().mean().double() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for i in range(w.shape[1]):
        c, q = quantize_column(w[:, i].float(), scale[:, i // 16].float(), gscale)
        codes[:, i] = c
        err = (w[:, i] - q.double()) / hinv[i, i]
        w[:, i + 1 :] -= torch.outer(err, hinv[i, i + 1 :])
        hinv = hinv - torch.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
    return codes


# ---- Hessian --------------------------------------------------------------------------------


def test_hessian_accumulates_merges_and_counts_tokens():
    x = torch.randn(3, 10, 32)
    whole = HessianAccumulator(32)
    whole.add(x)
    shard_a, shard_b = HessianAccumulator(32), HessianAccumulator(32)
    shard_a.add(x[:2])
    shard_b.add(x[2:].reshape(-1, 32)[:7])
    shard_b.add(x[2:].reshape(-1, 32)[7:])
    merged = shard_a.merge(shard_b)
    flat = x.reshape(-1, 32).double()
    expected = 2.0 / 30 * flat.T @ flat
    assert whole.tokens == merged.tokens == 30
    torch.testing.assert_close(whole.hessian().double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.hessian(), whole.hessian(), rtol=1e-6, atol=1e-6)


def test_empty_or_mismatched_calibration_is_an_error():
    with pytest.raises(ValueError, match="q_proj: empty calibration"):
        HessianAccumulator(16).hessian("q_proj")
    with pytest.raises(ValueError, match=r"expected inputs \[\.\.\., 16\]"):
        HessianAccumulator(16).add(torch.randn(4, 8))
    with pytest.raises(ValueError, match="cannot merge"):
        HessianAccumulator(16).merge(HessianAccumulator(32))
    with pytest.raises(ValueError, match="no signal"):
        gptq_quantize(torch.randn(8, 16), torch.zeros(16, 16))
    acc = HessianAccumulator(16)
    acc.add(torch.full((2, 16), float("nan")))
    with pytest.raises(ValueError, match="NaN or Inf"):
        acc.hessian()


# ---- reduction to RTN -----------------------------------------------------------------------


@pytest.mark.parametrize("scale_rule", ["6", "4over6"])
def test_identity_hessian_is_rtn_bit_for_bit(scale_rule):
    # With H = c * I the inverse Cholesky factor is diagonal: no error reaches another column,
    # so every column is rounded exactly as RTN rounds it (several lazy blocks, a short tail).
    torch.manual_seed(0)
    w = torch.randn(48, 208)
    rtn = quantize_rtn(w, scale_rule)
    q, stats = gptq_quantize(w, 3.0 * torch.eye(208), scale_rule=scale_rule, block_size=64)
    assert torch.equal(q.codes, rtn.codes)
    assert torch.equal(q.scale.view(torch.uint8), rtn.scale.view(torch.uint8))
    assert torch.equal(q.global_scale, rtn.global_scale)
    assert torch.equal(q.m4_mask, rtn.m4_mask)
    assert stats.output_error == pytest.approx(relative_weight_error(w, rtn.dequantize()), rel=1e-5)


def test_diagonal_hessian_with_act_order_is_rtn_bit_for_bit():
    # A diagonal H still propagates nothing, but act-order permutes the columns: the codes must
    # come back to their own columns, each rounded with its original group's scale.
    torch.manual_seed(1)
    w = torch.randn(32, 96)
    h = torch.diag(torch.rand(96) + 0.1)
    for rule in ["6", "4over6"]:
        q, _ = gptq_quantize(w, h, scale_rule=rule, act_order=True, block_size=32)
        assert torch.equal(q.codes, quantize_rtn(w, rule).codes)


def test_fused_global_amax_is_used_as_given():
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    q, _ = gptq_quantize(w, torch.eye(64), global_amax=10.0)
    assert q.global_scale.item() == pytest.approx(268.8, rel=1e-6)
    assert torch.equal(q.codes, quantize_rtn(w, global_amax=10.0).codes)


# ---- GPTQ proper ----------------------------------------------------------------------------


def test_matches_a_naive_float64_reference():
    torch.manual_seed(3)
    k = 96
    w = torch.randn(24, k)
    x = correlated_inputs(2048, k, seed=3)
    h = 2.0 / x.shape[0] * x.T @ x
    q, _ = gptq_quantize(w, h, block_size=32)
    rtn = quantize_rtn(w)
    ref = naive_gptq(w, h, rtn.scale, rtn.global_scale)
    agree = (q.codes == ref).float().mean().item()
    # float32 blocked vs float64 unblocked: a value within rounding noise of a decision
    # boundary may go either way and then steer the rest of its row.
    print(f"\ncodes agreeing with the naive float64 GPTQ: {agree:.4f}")
    assert agree > 0.98


@pytest.mark.parametrize("scale_rule", ["6", "4over6"])
@pytest.mark.parametrize("act_order", [False, True])
def test_beats_rtn_on_correlated_inputs(scale_rule, act_order):
    torch.manual_seed(4)
    n, k = 64, 256
    w = torch.randn(n, k) * 0.05
    x = correlated_inputs(4096, k, seed=4)
    acc = HessianAccumulator(k)
    acc.add(x)
    h = acc.hessian()
    rtn = quantize_rtn(w, scale_rule)
    q, stats = gptq_quantize(w, h, scale_rule=scale_rule, act_order=act_order)

    def output_error(w_hat):  # measured on the inputs themselves, not through H
        return ((x @ (w_hat - w).T).square().sum() / (x @ w.T).square().sum()).item()

    rtn_err, gptq_err = output_error(rtn.dequantize()), output_error(q.dequantize())
    print(f"\n{scale_rule} act_order={act_order}: output error RTN {rtn_err:.5f} GPTQ {gptq_err:.5f}")
    assert stats.output_error == pytest.approx(gptq_err, rel=1e-3)
    assert relative_output_error(w, rtn.dequantize(), h) == pytest.approx(rtn_err, rel=1e-3)
    assert gptq_err < 0.8 * rtn_err
    # GPTQ trades weight error for output error; the frame is RTN's.
    assert stats.weight_error > relative_weight_error(w, rtn.dequantize())
    assert torch.equal(q.m4_mask, rtn.m4_mask) and stats.m4_share == rtn.m4_share
    assert stats.damp == 0.01 and stats.seconds > 0


def test_dead_columns_are_rounded_as_rtn():
    torch.manual_seed(5)
    k = 64
    w = torch.randn(16, k)
    x = correlated_inputs(512, k, seed=5)
    dead = torch.tensor([3, 17, 40])
    x[:, dead] = 0
    q, stats = gptq_quantize(w, 2.0 / 512 * x.T @ x)
    assert torch.equal(q.codes[:, dead], quantize_rtn(w).codes[:, dead])
    assert stats.output_error < relative_output_error(w, quantize_rtn(w).dequantize(), x.T @ x)


def test_not_positive_definite_hessian():
    torch.manual_seed(6)
    k = 32
    basis, _ = torch.linalg.qr(torch.randn(k, k, dtype=torch.float64))
    eig = torch.ones(k, dtype=torch.float64)
    # One eigenvalue of -0.5: 1% and 10% of the mean diagonal (~0.95) do not lift it above
    # zero, 100% does.
    eig[0] = -0.5
    h = (basis * eig) @ basis.T
    w = torch.randn(8, k)
    q, stats = gptq_quantize(w, h.float(), name="layers.3.mlp.up_proj")
    assert stats.damp == pytest.approx(1.0)
    assert q.codes.shape == (8, k)
    eig[0] = -40.0  # beyond even 10x the mean diagonal
    h = (basis * eig) @ basis.T
    h += (0.5 - h.diagonal().mean()) * torch.eye(k, dtype=torch.float64)  # keep the mean positive
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj: Hessian is not positive definite"):
        gptq_quantize(w, h.float(), name="layers.3.mlp.up_proj")
    with pytest.raises(ValueError, match="NaN or Inf"):
        gptq_quantize(w, torch.full((k, k), float("nan")))
    with pytest.raises(ValueError, match="does not match in-features"):
        gptq_quantize(w, torch.eye(16))


@pytest.mark.parametrize("damp", [0.01, 1.0])
def test_in_place_dampening_is_the_formula_bit_for_bit(damp):
    """The inverse factor is the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, as the
    formula computes it with an identity matrix (the reference here), though H's diagonal is
    dampened in place; H comes back unchanged."""
    from sala.quant.gptq import _inverse_hessian_cholesky

    x = correlated_inputs(512, 96)
    h = x.T @ x * (2.0 / 512)
    before = h.clone()
    u, used = _inverse_hessian_cholesky(h, damp, "layer")
    eye = torch.eye(h.shape[0])
    chol = torch.linalg.cholesky(before + damp * before.diagonal().mean() * eye)
    expected = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    assert used == damp and torch.equal(u, expected) and torch.equal(h, before)
