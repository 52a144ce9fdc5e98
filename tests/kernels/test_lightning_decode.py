"""The lightning decode kernel (interpreted on CPU) and its torch reference against the naive
recurrence: one token per request, each request's state updated in place at its own slot."""
import pytest
import torch

from kernels.lightning_decode import lightning_decode_reference, lightning_decode_triton
from sala import lightning


def problem(state_dtype: torch.dtype, h: int = 3, dk: int = 80, dv: int = 40):
    """Three requests at slots 4, 0, 2 of a pool of 6 (the rest must stay untouched); Dk and
    Dv not powers of two, so the kernel's masks are exercised."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(3, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(3, h, dv, generator=gen)
    pool = torch.randn(6, h, dk, dv, generator=gen).to(state_dtype)
    return q, k, v, lightning.log_decay(h), dk**-0.5, pool, torch.tensor([4, 0, 2])


@pytest.mark.parametrize("form", ["reference", "triton"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_updates_each_slot_as_the_recurrence_does(form, state_dtype):
    q, k, v, g, scale, pool, slots = problem(state_dtype)
    before = pool.clone()
    # The naive recurrence, one request at a time, from each slot's stored state in fp32.
    want = [lightning.recurrent(q[i][None, :, None], k[i][None, :, None], v[i][None, :, None], g, scale,
                                before[s].float()[None])
            for i, s in enumerate(slots.tolist())]
    if form == "triton":
        pytest.importorskip("triton")
    run = lightning_decode_reference if form == "reference" else lightning_decode_triton
    o = run(q, k, v, g, scale, pool, slots)
    assert o.dtype == torch.float32 and o.shape == (3, 3, 40)
    for i, s in enumerate(slots.tolist()):
        out, state = want[i]
        torch.testing.assert_close(o[i], out[0, :, 0], atol=1e-5, rtol=1e-5)
        # The new state is stored once, rounded to the pool's dtype: bf16 to nearest (half an ulp,
        # 2^-8 relative), but the interpreter truncates (triton runtime/interpreter.py,
        # _convert_float), so the kernel gets one ulp.
        bf16_ulps = 2**-7 if form == "triton" else 2**-8
        tol = dict(atol=0, rtol=bf16_ulps) if state_dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pool[s].float(), state[0], **tol)
    others = [1, 3, 5]
    assert torch.equal(pool[others], before[others])


def test_reference_is_the_engines_former_decode_bit_for_bit():
    """The CPU engine's decode rows: gather, lightning.step, scatter (what attend_step ran
    before the kernel existed), so moving to the dispatch changed no CPU output."""
    q, k, v, g, scale, pool, slots = problem(torch.float32)
    pool2 = pool.clone()
    o, s = lightning.step(q, k, v, g, scale, pool2.index_select(0, slots).float())
    pool2.index_copy_(0, slots, s)
    assert torch.equal(lightning_decode_reference(q, k, v, g, scale, pool, slots), o)
    assert torch.equal(pool, pool2)


def test_bad_shapes_are_named():
    q, k, v, g, scale, pool, slots = problem(torch.float32)
    with pytest.raises(ValueError, match="states"):
        lightning_decode_reference(q, k, v, g, scale, pool[:, :, :10], slots)
    with pytest.raises(ValueError, match="slots"):
        lightning_decode_reference(q, k, v, g, scale, pool, slots[:2])
