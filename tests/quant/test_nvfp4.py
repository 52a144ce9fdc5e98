"""NVFP4 format, RTN and FourOverSix against hand-computed values, a numpy reference and
compressed-tensors' own quantizer."""
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import pack_fp4_to_uint8, quantize_and_pack_fp4, unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from sala.quant.nvfp4 import (
    CPU_TILE_WEIGHTS,
    decode_e2m1,
    dequantize,
    global_scale,
    pack_fp4,
    quantize_column,
    quantize_rtn,
    round_to_e2m1,
    unpack_fp4,
)

# The E2M1 table written out by hand (spec section 1.1).
HAND_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# ---- numpy reference: nearest grid value by distance, ties to the even code ----------------

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _e4m3_grid() -> np.ndarray:
    """All finite non-negative FP8 E4M3 (fn) values in bit order, built from the bit layout."""
    bits = np.arange(0x7F)  # 0x7F is NaN
    e, m = bits >> 3, bits & 7
    return np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7)).astype(np.float32)


E4M3_GRID = _e4m3_grid()


def ref_round(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value to |x| (saturating), ties to the even index."""
    a = np.minimum(np.abs(x), grid[-1])
    dist = np.abs(a[..., None] - grid)
    best = dist.min(axis=-1, keepdims=True)
    candidates = dist == best
    # Among equally near values prefer an even index (even mantissa bit for both formats).
    even = candidates & (np.arange(len(grid)) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), candidates.argmax(-1))


def ref_fp8(s: np.ndarray) -> np.ndarray:
    v = E4M3_GRID[ref_round(s, E4M3_GRID)]
    return np.where(v == 0, np.float32(0.125), v)


def ref_quantize(w: np.ndarray, fp8_max: float = 448.0, four_over_six: bool = False):
    """Independent NVFP4 quantizer: codes, fp8 scales and M=4 mask, all in float32."""
    w = w.astype(np.float32)
    # compressed-tensors' global is reciprocal(amax) * (S * 6), one rounding more than a division.
    g = (np.float32(1.0) / np.abs(w).max()) * np.float32(fp8_max * 6.0)
    groups = w.reshape(w.shape[0], -1, 16)
    unrounded = (np.abs(groups).max(-1) / np.float32(6.0)) * g

    def candidate(scale):
        step = (scale / g)[..., None]
        idx = ref_round(groups / step, E2M1_GRID)
        codes = (idx | np.where(groups < 0, 8, 0)).astype(np.uint8)
        values = np.where(groups < 0, np.float32(-1), np.float32(1)) * E2M1_GRID[idx] * step
        return codes, values.reshape(w.shape), ((values - groups) ** 2).sum(-1)

    s6 = ref_fp8(unrounded)
    codes, values, err6 = candidate(s6)
    if not four_over_six:
        return codes.reshape(w.shape), s6, np.zeros(s6.shape, bool), values
    s4 = ref_fp8(np.float32(1.5) * unrounded)
    codes4, values4, err4 = candidate(s4)
    m4 = err4 < err6
    codes = np.where(m4[..., None], codes4, codes)
    values = np.where(np.repeat(m4, 16, axis=-1), values4, values)
    return codes.reshape(w.shape), np.where(m4, s4, s6), m4, values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def group_sq_error(w: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    return (w_hat - w).square().unflatten(-1, (-1, 16)).sum(-1)


# ---- the element format ---------------------------------------------------------------------


def test_every_code_decodes_to_the_hand_table():
    values = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == HAND_TABLE
    assert torch.signbit(values).tolist() == [c >= 8 for c in range(16)]


def test_every_representable_value_rounds_to_its_own_code():
    for code, value in enumerate(HAND_TABLE):
        if code == 8:  # -0.0 itself carries no "x < 0"; covered by the negative-zero test
            continue
        assert round_to_e2m1(torch.tensor([value])).item() == code


@pytest.mark.parametrize(
    "x, code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)],
)
def test_tie_points_go_to_the_even_code(x, code):
    below, above = np.nextafter(np.float32(x), np.float32(0)), np.nextafter(np.float32(x), np.float32(9))
    got = round_to_e2m1(torch.tensor([x, -x, float(below), float(above)]))
    expected_neighbors = ref_round(np.array([below, above], np.float32), E2M1_GRID)
    assert got[0].item() == code
    assert got[1].item() == code | 8
    assert got[2:].tolist() == expected_neighbors.tolist()
    # A tie sits between two codes, and the nearest values either side straddle it.
    assert expected_neighbors[0] != expected_neighbors[1]


def test_rounding_matches_the_numpy_reference_on_a_dense_sweep():
    x = torch.arange(-14336, 14337) / 2048  # exact multiples of 2^-11: every tie is on it
    ours = round_to_e2m1(x).numpy()
    ref = ref_round(x.numpy(), E2M1_GRID) | np.where(x.numpy() < 0, 8, 0)
    assert (ours == ref).all()


def test_negative_zero():
    # A small negative rounds to code 0x8 (-0.0), as compressed-tensors emits it; it decodes
    # to a zero. An exact -0.0 input has no "x < 0" and gets 0x0, again like compressed-tensors.
    codes = round_to_e2m1(torch.tensor([-0.1, -0.25, -0.0, 0.1]))
    assert codes.tolist() == [8, 8, 0, 0]
    assert decode_e2m1(codes).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert pack_fp4_to_uint8(torch.tensor([[-0.0, 0.0]])).item() == 0x08


def test_saturation_at_six():
    codes = round_to_e2m1(torch.tensor([5.0001, 6.0, 6.5, 1e6, -1e6]))
    assert codes.tolist() == [7, 7, 7, 7, 15]


# ---- whole-tensor quantization, hand-computed -------------------------------------------------


def test_hand_computed_block_with_every_tie():
    # global_amax 2688 makes the global scale exactly 1; the block max 12 gives the scale
    # fp8(12 / 6) = 2, so an element x lands on x / 2 and each tie is exact in fp32.
    w = torch.tensor([[12.0, 0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, 11.0, -0.4, -3.0, 0.0, 6.0, -12.0, 4.0, 9.0]])
    q = quantize_rtn(w, global_amax=2688.0)
    assert q.global_scale.tolist() == [1.0]
    assert q.scale.float().tolist() == [[2.0]]
    #            12 0.5 1.5 2.5 3.5 5.0 7.0 10 11 -0.4 -3   0  6 -12  4  9
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 7, 8, 11, 0, 5, 15, 4, 6]
    assert q.codes[0].tolist() == expected
    assert q.dequantize()[0].tolist() == [
        12.0, 0.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 12.0, 0.0, -3.0, 0.0, 6.0, -12.0, 4.0, 8.0
    ]  # fmt: skip


def test_scale_rounding_can_push_the_block_max_into_saturation():
    # Block 0 holds the tensor max 2688 (global 1, scale 448, code 6.0 exactly). Block 1 has
    # max 102: 102 / 6 = 17 is an FP8 tie between 16 and 18 and rounds to the even 16, so
    # 102 / 16 = 6.375 > 6 saturates and dequantizes to 96.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16], w[0, 17] = 2688.0, 102.0, -40.0
    q = quantize_rtn(w)
    assert q.global_scale.tolist() == [1.0]
    assert q.scale.float().tolist() == [[448.0, 16.0]]
    # -40 / 16 = -2.5 is itself a tie and stays at -2 (code 0x8 | 4).
    assert q.codes[0, [0, 16, 17]].tolist() == [7, 7, 12]
    assert q.dequantize()[0, [0, 16, 17]].tolist() == [2688.0, 96.0, -32.0]


def test_all_zero_block_and_all_zero_tensor():
    w = torch.randn(2, 32)
    w[1, 16:] = 0
    q = quantize_rtn(w)
    assert q.scale[1, 1].float().item() == 0.125  # compressed-tensors' eps for a zero scale
    assert q.codes[1, 16:].tolist() == [0] * 16
    fos = quantize_rtn(w, "4over6")
    assert fos.scale[1, 1].float().item() == 0.125
    assert not fos.m4_mask[1, 1]  # both candidates are exact: a tie keeps 6
    zero = quantize_rtn(torch.zeros(3, 16))
    assert zero.global_scale.tolist() == [1.0]
    assert (zero.codes == 0).all() and (zero.dequantize() == 0).all()


def test_block_with_one_huge_outlier():
    # amax 1000 -> global 2.688, block scale fp8(1000 / 6 * 2.688 = 448) = 448, step 166.67:
    # the outlier maps to 6.0, every other element of its block (|x| <= 1) to a zero.
    w = torch.full((1, 32), 0.75)
    w[0, 0], w[0, 15] = 1000.0, -1.0
    q = quantize_rtn(w)
    assert q.global_scale.item() == pytest.approx(2.688, rel=1e-7)
    assert q.scale[0, 0].float().item() == 448.0
    assert q.codes[0, :16].tolist() == [7] + [0] * 14 + [8]
    assert q.dequantize()[0, 0].item() == pytest.approx(1000.0, rel=1e-6)
    # The second block, scaled on its own, keeps its 0.75s exactly.
    assert torch.allclose(q.dequantize()[0, 16:], w[0, 16:], rtol=0.07)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_rejected(bad):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_rtn(w)


def test_bad_shapes_and_arguments_rejected():
    with pytest.raises(ValueError, match="not a multiple of the NVFP4 group size 16"):
        quantize_rtn(torch.randn(4, 24))
    with pytest.raises(ValueError, match="2-D"):
        quantize_rtn(torch.randn(16))
    with pytest.raises(ValueError, match="unknown scale rule"):
        quantize_rtn(torch.randn(4, 16), scale_rule="5")
    with pytest.raises(ValueError, match="does not cover"):
        quantize_rtn(torch.ones(4, 16), global_amax=0.5)


def test_fused_group_shares_the_global_scale():
    q, k = torch.randn(32, 64), 3 * torch.randn(16, 64)
    amax = torch.maximum(q.abs().max(), k.abs().max())
    qq, qk = quantize_rtn(q, global_amax=amax), quantize_rtn(k, global_amax=amax)
    assert torch.equal(qq.global_scale, qk.global_scale)
    assert qq.global_scale.item() == pytest.approx(2688.0 / amax.item(), rel=1e-7)
    assert global_scale(amax, "4over6").item() == pytest.approx(1536.0 / amax.item(), rel=1e-7)


# ---- agreement with the references ---------------------------------------------------------


@pytest.mark.parametrize("scale_rule", ["6", "4over6"])
def test_matches_the_numpy_reference(scale_rule):
    """Over more rows than a CPU tile (CPU_TILE_WEIGHTS), the last tile ragged: tiles quantize as
    the whole weight does."""
    torch.manual_seed(1)
    w = torch.randn(1100, 256) * torch.rand(1100, 1) * 0.05
    assert w.numel() > 2 * CPU_TILE_WEIGHTS and w.shape[0] % (CPU_TILE_WEIGHTS // w.shape[1])
    q = quantize_rtn(w, scale_rule)
    fp8_max = {"6": 448.0, "4over6": 256.0}[scale_rule]
    codes, scale, m4, values = ref_quantize(w.numpy(), fp8_max, scale_rule == "4over6")
    assert (q.scale.float().numpy() == scale).all()
    assert (q.m4_mask.numpy() == m4).all()
    assert (q.codes.numpy() == codes).all()
    assert (q.dequantize().numpy() == values).all()


@pytest.mark.parametrize("bf16_grid", [False, True])
def test_identical_to_compressed_tensors(bf16_grid):
    torch.manual_seed(2)
    w = torch.randn(192, 512) * 0.02
    if bf16_grid:  # weights coming from a bf16 checkpoint, upcast: ties are likelier
        w = w.bfloat16().float()
    q = quantize_rtn(w)
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    ct_global = generate_gparam(w.amin(), w.amax())
    groups = w.unflatten(-1, (-1, 16))
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=ct_global)
    assert torch.equal(q.global_scale, ct_global)
    assert torch.equal(_bits(q.scale), _bits(ct_scale.to(torch.float8_e4m3fn)))
    ct_packed = quantize_and_pack_fp4(w, ct_scale, ct_global)
    assert torch.equal(pack_fp4(q.codes), ct_packed)
    ct_values = ct_dequantize(
        unpack_fp4_from_uint8(ct_packed, *w.shape, dtype=torch.float32),
        ct_scale, args=args, global_scale=ct_global,
    )  # fmt: skip
    assert torch.equal(q.dequantize(), ct_values)


def test_group_scale_follows_compressed_tensors_operation_order():
    # fp8(amax_b / 6 * global) and fp8(amax_b * global / 6) differ when the unrounded scale sits
    # within an fp32 ulp of an FP8 midpoint. Find such a group max next to the midpoint 9.5
    # (between 9 and 10) and check we round it as compressed-tensors does.
    amax = torch.tensor([1.2345])
    g = amax.reciprocal() * 2688.0
    start = np.float32(9.5 * 6 / g.item())
    lo = hi = start
    near = [start]
    for _ in range(64):  # the 128 fp32 neighbours of the midpoint's preimage
        lo, hi = np.nextafter(lo, np.float32(0)), np.nextafter(hi, np.float32(1))
        near += [lo, hi]
    a = torch.tensor(np.array(near, dtype=np.float32))
    ours = ((a / 6) * g).to(torch.float8_e4m3fn)
    other = (a * g / 6).to(torch.float8_e4m3fn)
    differs = (ours.float() != other.float()).nonzero().flatten()
    assert len(differs) > 0
    group_max = a[differs[0]].item()
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16] = amax.item(), group_max
    q = quantize_rtn(w)
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    groups = w.unflatten(-1, (-1, 16))
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)
    assert q.scale[0, 1].float().item() == ct_scale[0, 1].item() == ours[differs[0]].float().item()


def test_pack_low_nibble_is_the_even_column():
    assert pack_fp4(torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)).tolist() == [[0x21, 0x8F]]


def test_pack_and_unpack_agree_with_compressed_tensors():
    codes = torch.arange(256, dtype=torch.int64).reshape(8, 32)
    codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).to(torch.uint8)  # every byte
    packed = pack_fp4(codes)
    assert torch.equal(packed.flatten(), torch.arange(256, dtype=torch.uint8))
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(pack_fp4_to_uint8(decode_e2m1(codes)), packed)
    assert torch.equal(unpack_fp4_from_uint8(packed, 8, 64, dtype=torch.float32), decode_e2m1(codes))


def test_quantize_column_equals_the_block_quantizer():
    torch.manual_seed(3)
    w = torch.randn(64, 48)
    q = quantize_rtn(w, "4over6")
    values = q.dequantize()
    for col in range(48):
        codes, deq = quantize_column(w[:, col], q.scale[:, col // 16].float(), q.global_scale)
        assert torch.equal(codes, q.codes[:, col])
        assert torch.equal(deq, values[:, col])


def test_dequantize_in_compressed_tensors_order():
    codes = torch.tensor([[7, 1] * 8], dtype=torch.uint8)
    scale = torch.tensor([[3.0]]).to(torch.float8_e4m3fn)
    g = torch.tensor([7.0])
    step = torch.tensor(3.0) / torch.tensor(7.0)
    assert dequantize(codes, scale, g)[0, :2].tolist() == [(6 * step).item(), (0.5 * step).item()]


# ---- FourOverSix ----------------------------------------------------------------------------


def test_four_over_six_hand_computed_block():
    # amax 1536 gives a 4/6 global of exactly 1. The block [1536, 1152 x 15]: scaled to 6
    # (scale 256) 1152 / 256 = 4.5 rounds to 4 (error 128 each); scaled to 4 (scale 384)
    # every element is exact (1536 / 384 = 4, 1152 / 384 = 3), so the block takes M=4.
    w = torch.tensor([[1536.0] + [1152.0] * 15])
    q = quantize_rtn(w, "4over6")
    assert q.global_scale.tolist() == [1.0]
    assert q.m4_mask.tolist() == [[True]]
    assert q.scale.float().tolist() == [[384.0]]
    assert q.codes[0].tolist() == [6] + [5] * 15
    assert torch.equal(q.dequantize(), w)


def test_four_over_six_tie_keeps_six():
    # A constant block at the tensor max, global 1: scaled to 6 (256) every element is 6.0
    # exactly, scaled to 4 (384) every element is 4.0 exactly. Equal errors keep M=6.
    q = quantize_rtn(torch.full((1, 16), 1536.0), "4over6")
    assert q.m4_mask.tolist() == [[False]]
    assert q.scale.float().tolist() == [[256.0]]
    assert q.codes[0].tolist() == [7] * 16


def test_four_over_six_never_worse_than_six_in_its_own_frame():
    torch.manual_seed(4)
    w = torch.randn(256, 512)
    q = quantize_rtn(w, "4over6")
    # Plain M=6 with the same global scale (built on 256): the per-group alternative 4/6 had.
    *_, six = ref_quantize(w.numpy(), fp8_max=256.0)
    err46, err6 = group_sq_error(w, q.dequantize()), group_sq_error(w, torch.from_numpy(six))
    assert (err46 <= err6).all()
    assert torch.equal(err46 < err6, q.m4_mask)  # ties keep 6
    # Every scale still fits FP8 after the 1.5x expansion: 256 * 1.5 = 384.
    assert q.scale.float().max().item() <= 384.0


def test_four_over_six_share_and_error_on_gaussian_weights():
    torch.manual_seed(5)
    w = torch.randn(512, 1024)
    standard, fos = quantize_rtn(w, "6"), quantize_rtn(w, "4over6")
    err6, err46 = group_sq_error(w, standard.dequantize()), group_sq_error(w, fos.dequantize())
    mse_ratio = (err46.sum() / err6.sum()).item()
    worse = (err46 > err6).float().mean().item()
    print(
        f"\nFourOverSix on N(0,1) 512x1024: M=4 share {fos.m4_share:.3f}, "
        f"MSE vs standard NVFP4 {mse_ratio:.3f}x, blocks worse than standard (448 frame) {worse:.3f}"
    )
    # The spec measured 45.2% and -16.4% on 4096x4096 Gaussian weights.
    assert 0.40 < fos.m4_share < 0.50
    assert 0.80 < mse_ratio < 0.88
