"""The mixed-precision cache (sala/kv): formats against numpy references of the same formats,
attention over quantized pages against attention over their dequantized values, bf16 states,
plan validation, and the engine with a plan against the model's own cached forward over the
same quantized cache."""
import copy
import json
import shutil

import numpy as np
import pytest
import torch

from sala.checkpoint import load_model
from sala.checkpoint_files import write_manifest
from sala.config import SALAConfig
from sala.engine import Engine, EngineConfig, SamplingParams
from sala.engine.cache import CachePool
from sala.engine.context import StepContext
from sala.engine.memory import plan_memory
from sala.eval.compare import window_sequences
from sala.kv import KVPages, KVPlan, KVPlanError, apply_to_model, decode_attention, load_plan, make_codec
from sala.kv.measure import calibrate_amax, measure_plan, reference_baseline
from sala.tiny import heldout_texts, token_stream

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to FP8 E4M3 (3 mantissa bits, min exponent -6, max 448), ties to even, saturating."""
    a = np.abs(x).astype(np.float64)
    e = np.clip(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6, 8)
    step = 2.0 ** (e - 3)
    return (np.sign(x) * np.minimum(np.round(a / step) * step, 448.0)).astype(np.float32)


def np_e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 magnitude code (ties to the even code), saturating at 6; bit 3 = x < 0."""
    dist = np.abs(np.abs(x)[..., None].astype(np.float64) - E2M1)
    best = dist.min(-1, keepdims=True)
    ties = dist == best
    code = np.where(ties[..., ::2].any(-1), np.argmax(ties[..., ::2], -1) * 2, np.argmax(ties, -1))
    return code.astype(np.uint8) | ((x < 0).astype(np.uint8) << 3)


def np_fp8_fake(x: np.ndarray, head_scale: np.ndarray | None) -> np.ndarray:
    x = x.astype(np.float32)
    if head_scale is None:
        s = np.abs(x).max(-1) / np.float32(448)
        s = np.where(s > 0, s, np.float32(1))[..., None]
    else:
        s = head_scale.astype(np.float32)[:, None]
    return (np_e4m3(np.clip(x / s, -448, 448)) * s).astype(np.float32)


def np_nvfp4(x: np.ndarray, g: np.float32, four_over_six: bool):
    """(codes [..., D], dequantized [..., D]) with global scale g (encode direction)."""
    grp = x.astype(np.float32).reshape(*x.shape[:-1], -1, 16)
    unrounded = (np.abs(grp).max(-1) / np.float32(6)) * g

    def candidate(scale_hp):
        s = np_e4m3(np.minimum(scale_hp, 448))
        s = np.where(s == 0, np.float32(0.125), s)
        step = (s / g)[..., None].astype(np.float32)
        codes = np_e2m1_codes(grp / step)
        values = (np.where(codes & 8, -1, 1) * E2M1[codes & 7]).astype(np.float32) * step
        return codes, values, ((values.astype(np.float64) - grp) ** 2).sum(-1)

    codes, values, err = candidate(unrounded)
    if four_over_six:
        c4, v4, e4 = candidate(np.float32(1.5) * unrounded)
        m4 = e4 < err
        codes, values = np.where(m4[..., None], c4, codes), np.where(m4[..., None], v4, values)
    return codes.reshape(x.shape), values.reshape(x.shape)


def kv_rows(n=64, h=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * torch.rand(n, h, 1, generator=g) * 4
    x[0, 0] = 0  # an all-zero row: a zero scale must not divide by zero
    x[1, 1, :16] = 1e-4  # a group whose FP8 scale is subnormal
    return x


@pytest.mark.parametrize("calibrated", [False, True])
def test_fp8_round_trip_matches_numpy(calibrated):
    x = kv_rows()
    amax = x.abs().amax((0, 2)) if calibrated else None
    codec = make_codec("fp8", amax)
    data, scale = codec.encode(x)
    assert data.dtype == torch.float8_e4m3fn and (scale is None) == calibrated
    got = codec.decode(data, scale, torch.float32).numpy()
    want = np_fp8_fake(x.numpy(), None if amax is None else (amax / 448).numpy())
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - x.numpy()).max() <= x.abs().max().item() / 16  # 3 mantissa bits


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_4over6"])
def test_nvfp4_round_trip_matches_numpy(name):
    x = kv_rows(seed=1)
    amax = x.abs().amax((0, 2))
    codec = make_codec(name, amax)
    packed, scale = codec.encode(x)
    assert packed.shape == (64, 2, 16) and packed.dtype == torch.uint8 and scale.shape == (64, 2, 2)
    codes_np, want = np_nvfp4(x.numpy(), codec.global_scale.numpy()[0], name == "nvfp4_4over6")
    p = packed.numpy()
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(x.shape)  # low nibble = even element
    got = codec.decode(packed, scale, torch.float32).numpy()
    groups_differ = (got != want).reshape(-1, 16).any(-1).mean()
    # FourOverSix compares two sums of 16 squares; summed in another order a near-tie may go
    # the other way. Plain NVFP4 has no such choice and must agree exactly.
    assert groups_differ <= (0.01 if name == "nvfp4_4over6" else 0.0), groups_differ
    if name == "nvfp4":
        np.testing.assert_array_equal(codes & 7, codes_np & 7)
    rel = np.linalg.norm(got - x.numpy()) / np.linalg.norm(x.numpy())
    print(f"{name}: relative error {rel:.4f}")
    assert rel < 0.12


def test_four_over_six_beats_plain_nvfp4_on_gaussian_rows():
    x = torch.randn(512, 2, 128, generator=torch.Generator().manual_seed(2))
    err = {n: (make_codec(n, x.abs().amax((0, 2))).fake(x) - x).square().mean().item() for n in ("nvfp4", "nvfp4_4over6")}
    print(err)
    assert err["nvfp4_4over6"] < err["nvfp4"]


def naive_decode_attention(q, k_pages, v_pages, block_tables, context_lens, scale):
    """Per sequence: gather its first context_len keys through its page table, full softmax."""
    out = []
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        rows = [(int(block_tables[b, t // page_size]), t % page_size) for t in range(n)]
        k = torch.stack([k_pages[p, r] for p, r in rows]).double()  # [n, Hkv, D]
        v = torch.stack([v_pages[p, r] for p, r in rows]).double()
        rep = q.shape[1] // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("k_fmt, v_fmt", [("fp8", "fp8"), ("nvfp4", "nvfp4_4over6"), ("fp8", "nvfp4"), ("bf16", "fp8")])
def test_decode_attention_over_quantized_pages_equals_attention_over_their_dequantized_values(k_fmt, v_fmt):
    pages, page_size, hkv, hq, d = 9, 4, 2, 4, 32
    g = torch.Generator().manual_seed(3)
    k = KVPages(make_codec(k_fmt), pages, page_size, hkv, d, "cpu")
    v = KVPages(make_codec(v_fmt, [3.0, 2.0]), pages, page_size, hkv, d, "cpu")
    rows = torch.randperm(pages * page_size, generator=g)
    k.write(rows, torch.randn(len(rows), hkv, d, generator=g) * 2)
    v.write(rows, torch.randn(len(rows), hkv, d, generator=g))
    tables = torch.tensor([[3, 1, 7], [0, 8, 2], [5, 4, 6]])
    lens = torch.tensor([11, 1, 8])
    q = torch.randn(3, hq, d, generator=g)
    got = decode_attention(q, k, v, tables, lens, d**-0.5)
    want = naive_decode_attention(q, k.dequantized(torch.float32), v.dequantized(torch.float32), tables, lens, d**-0.5)
    err = (got.double() - want).abs().max().item()
    print(f"{k_fmt}/{v_fmt}: max error {err:.2e}")
    assert err < 1e-5
    # And the pages really are quantized: rows read back differ from what a dense cache holds.
    assert k.read(rows[:4], torch.float32).shape == (4, hkv, d)


def tiny_config():
    from tests.model.test_model import tiny_random_config

    return tiny_random_config()


def test_bf16_state_step_equals_the_fp32_step_rounded():
    from sala.model import LightningAttention, rope_inv_freq, rope_tables

    torch.manual_seed(4)
    config = tiny_config()
    attn = LightningAttention(config, 1).eval()
    x = torch.randn(1, 3, config.hidden_size)
    results = {}
    for state in ("fp32", "bf16"):
        plan = KVPlan.uniform(config, "bf16", state)
        mem = plan_memory(config, 1 << 20, max_seqs=3, max_model_len=32, page_size=16, kv_plan=plan)
        pool = CachePool(EngineConfig(page_size=16, prefix_cache=False, device=torch.device("cpu"), model=config,
                                      kv_plan=plan, memory=mem))
        start = torch.randn(3, *pool.states[1].shape[1:], generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        pool.states[1][:3] = start  # a bf16-representable state in both pools
        ctx = StepContext(pool, torch.tensor([7, 9, 3]), torch.zeros(3, dtype=torch.long),
                          state_slots=torch.tensor([2, 0, 1]))
        rope = rope_tables(ctx.positions[None], rope_inv_freq(config.head_dim, config.rope_theta))
        with torch.no_grad():
            out = attn(x, rope, None, None, ctx)
        results[state] = out, pool.states[1][:3].clone()
    assert results["bf16"][1].dtype == torch.bfloat16
    torch.testing.assert_close(results["bf16"][1], results["fp32"][1].to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(results["bf16"][0], results["fp32"][0], rtol=0, atol=0)  # same state read, same output
    assert not torch.equal(results["fp32"][1], results["bf16"][1].float())  # the rounding is real


def test_plan_bytes_for_the_9b_config():
    from sala.config import MINICPM_SALA_9B

    config = SALAConfig(**MINICPM_SALA_9B)
    amax = {i: {"k": [1.0] * 2, "v": [1.0] * 2} for i in config.sparse_layers}  # calibrated: per-head scales
    per = {f: sum(KVPlan.uniform(config, f, amax=amax).kv_bytes_per_token(config).values()) for f in ("bf16", "fp8", "nvfp4")}
    assert per == {"bf16": 8192, "fp8": 4096, "nvfp4": 2304}  # NVFP4: 0.5625 bytes an element
    assert sum(KVPlan.uniform(config, "fp8", "bf16").state_bytes_per_seq(config).values()) == 24 * 2**20
    dyn = KVPlan.uniform(config, "fp8").kv_bytes_per_token(config)  # uncalibrated: a scale per token and head
    assert set(dyn.values()) == {2 * (2 * 128 + 2 * 4)}


@pytest.fixture(scope="module")
def tiny(tiny_sala_dir):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    return load_model(tiny_sala_dir), AutoTokenizer.from_pretrained(tiny_sala_dir)


def plan_dict(config, over=None):
    over = over or {}
    plan = KVPlan.uniform(config, "fp8").to_json()
    for entry in plan["layers"]:
        entry.update(over.get(entry["layer"], {}))
    return plan


def test_bad_plans_fail_at_load_with_the_problem_named(tiny, tmp_path):
    model, tok = tiny
    config = model.config
    lightning, sparse = config.lightning_layers[0], config.sparse_layers[0]
    cases = {
        "is a lightning layer in this model, but the plan says sparse": plan_dict(config, {lightning: {"kind": "sparse", "kv": "fp8"}}),
        "unknown kv format 'int4'": plan_dict(config, {sparse: {"kv": "int4"}}),
        "unknown state dtype 'fp16'": plan_dict(config, {lightning: {"state": "fp16"}}),
        "layer 8 is out of range: the model has 8 layers": {"layers": plan_dict(config)["layers"] + [{"layer": 8, "kind": "sparse", "kv": "fp8"}]},
        "no entry for layer\\(s\\) \\[3\\]": {"layers": [e for e in plan_dict(config)["layers"] if e["layer"] != 3]},
        "made for another model: num_key_value_heads is 8": {**plan_dict(config), "model": {"num_key_value_heads": 8}},
        "k_amax must list 2 finite": plan_dict(config, {sparse: {"k_amax": [1.0], "v_amax": [1.0, 2.0]}}),
    }
    for message, plan in cases.items():
        with pytest.raises(KVPlanError, match=message) as e:
            Engine(copy.deepcopy(model), tok, compile=False, kv_plan=plan)
        assert "\n" not in str(e.value)
    (tmp_path / "kv_plan.json").write_text("{not json")
    with pytest.raises(KVPlanError, match="not valid JSON"):
        load_plan(tmp_path, config)
    with pytest.raises(KVPlanError, match="no such file"):
        load_plan(tmp_path / "missing.json", config)


def test_from_pretrained_picks_up_the_checkpoints_plan(tiny, tiny_sala_dir, tmp_path):
    model, _ = tiny
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_sala_dir, ckpt)
    plan = KVPlan.uniform(model.config, "nvfp4", "bf16").with_units({model.config.sparse_layers[0]: "fp8"})
    plan.save(ckpt)
    write_manifest(ckpt)  # the plan is part of the checkpoint: its manifest lists it
    assert json.loads((ckpt / "kv_plan.json").read_text())["layers"][0] == {"layer": 0, "kind": "sparse", "kv": "fp8"}
    engine = Engine.from_pretrained(ckpt, compile=False)
    assert engine.config.kv_plan.kv == plan.kv and engine.config.kv_plan.state == plan.state
    assert engine.cache.k[0].data.dtype == torch.float8_e4m3fn and engine.cache.k[4].data.dtype == torch.uint8
    assert engine.cache.states[1].dtype == torch.bfloat16
    other = Engine.from_pretrained(ckpt, compile=False, kv_plan=KVPlan.uniform(model.config, "fp8").to_json())
    assert set(other.config.kv_plan.kv.values()) == {"fp8"}
    (ckpt / "kv_plan.json").write_text(json.dumps(plan_dict(model.config, {1: {"kind": "sparse", "kv": "fp8"}})))
    write_manifest(ckpt)
    with pytest.raises(KVPlanError, match="layer 1 is a lightning layer"):
        Engine.from_pretrained(ckpt, compile=False)


def engine_prompts(tiny_sala_dir, tok, n=6):
    stream = tok("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    return [stream[:1] + stream[1 + 97 * i : 9 + 97 * i + (13 * i) % 48] for i in range(n)]


def greedy(n=10):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def test_all_bf16_fp32_plan_is_the_engine_without_a_plan(tiny, tiny_sala_dir):
    model, tok = tiny
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ps = engine_prompts(tiny_sala_dir, tok)
    plain = Engine(copy.deepcopy(bf16), tok, compile=False).generate(ps, greedy())
    planned = Engine(copy.deepcopy(bf16), tok, compile=False, kv_plan=KVPlan.uniform(model.config, "bf16", "fp32")).generate(ps, greedy())
    for a, b in zip(plain, planned):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]  # bitwise


def cached_greedy(model, ids, n, plan):
    """The model's own forward with its SALACache, the cache stored as `plan` says."""
    apply_to_model(model, plan)
    try:
        cache = model.new_cache()
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
        out, lps = [], []
        for _ in range(n):
            lp = torch.log_softmax(logits.float(), -1)
            out.append(int(lp.argmax()))
            lps.append(lp[out[-1]].item())
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
        return out, lps
    finally:
        apply_to_model(model, None)


@pytest.fixture(scope="module")
def calibrated(tiny, tiny_sala_dir):
    model, tok = tiny
    windows = window_sequences(token_stream(tok, heldout_texts(tiny_sala_dir)), 128, 24)
    return calibrate_amax(model, windows[:8]), windows[8:]


@torch.no_grad()
def test_greedy_with_a_mixed_plan_equals_the_cached_forward_over_the_same_quantized_cache(tiny, tiny_sala_dir, calibrated):
    model, tok = tiny
    amax, _ = calibrated
    config = model.config
    plan = KVPlan.uniform(config, "nvfp4", "bf16", amax).with_units({0: "fp8", 7: "nvfp4_4over6"}, {2: "fp32"})
    ps = engine_prompts(tiny_sala_dir, tok)
    done = Engine(copy.deepcopy(model), tok, compile=False, kv_plan=plan).generate(ps, greedy())
    # The reference with the engine's fused projections: quantization is a step function, and
    # GEMMs that round differently would move a few K/V values across a rounding boundary.
    model = copy.deepcopy(model)
    model.model.fuse_projections()
    worst = 0.0
    for c, p in zip(done, ps):
        tokens, lps = cached_greedy(model, p, 10, plan)
        assert c.token_ids == tokens
        worst = max(worst, max(abs(a.logprob - b) for a, b in zip(c.logprobs, lps)))
        assert c.text and all(0 <= t < config.vocab_size for t in c.token_ids)
    print(f"max |engine - cached forward| logprob {worst:.2e}")
    # Measured: 2e-6 with quantized K/V and fp32 states; 3.8e-4 once states are bf16, where fp32
    # noise of ~1e-6 (the batched one-step form) sometimes rounds a state element to the
    # neighbouring bf16 value (2^-8 apart). Tokens stay equal.
    assert worst < 2e-3


def test_mixed_plan_kl_lies_between_all_fp8_and_all_nvfp4(tiny, calibrated):
    model, _ = tiny
    amax, windows = calibrated
    config = model.config
    ref = reference_baseline(model, windows, 64)
    first, *rest = config.sparse_layers
    plans = {"fp8": KVPlan.uniform(config, "fp8", "fp32", amax), "nvfp4": KVPlan.uniform(config, "nvfp4", "fp32", amax),
             "mixed": KVPlan.uniform(config, "nvfp4", "bf16", amax).with_units({first: "fp8"})}
    kl = {k: measure_plan(model, windows, p, ref, 64)["kl_mean"] for k, p in plans.items()}
    print(kl)
    assert kl["fp8"] < kl["mixed"] < kl["nvfp4"]
    assert measure_plan(model, windows, KVPlan.uniform(config, "bf16", "fp32"), ref, 64)["kl_mean"] < kl["fp8"]


def test_greedy_plan_keeps_the_budget_against_a_brute_force_search():
    """An additive-with-interaction damage model where the combined KL differs from the sum of
    single-unit KLs: the greedy plan meets the budget, re-measures (a unit that fits alone but
    not on top of the others stays), and fp8_layers keeps exactly the most sensitive layers FP8."""
    from itertools import combinations

    from sala.kv.search import greedy_plan, units

    config = tiny_config()
    base = KVPlan.uniform(config, "fp8")
    us = units(config)
    cost = {u: 0.01 * (n + 1) for n, u in enumerate(reversed(us))}

    def kl(plan):
        down = [("kv", i) for i, f in plan.kv.items() if f == "nvfp4"] + [("state", i) for i, s in plan.state.items()
                                                                         if s == "bf16"]
        return sum(cost[u] for u in down) * (1 + 0.5 * max(0, len(down) - 1))  # effects compound

    calls = []

    def measure(plan):
        calls.append(plan)
        return {"kl_mean": kl(plan), "top1_agreement": 1.0, "ppl": 1.0}

    sensitivity = {u: kl(KVPlan.uniform(config, "fp8").with_units(**({"kv": {u[1]: "nvfp4"}} if u[0] == "kv" else
                                                                       {"state": {u[1]: "bf16"}}))) for u in us}
    budget = 0.08
    plan, metrics = greedy_plan(base, {"kl_mean": 0.0}, sensitivity, measure, max_kl=budget)
    assert metrics["kl_mean"] == kl(plan) <= budget and plan.metrics == metrics and len(calls) == len(us)
    assert plan.budget == {"max_kl": budget, "fp8_layers": None} and len(plan.table) == len(us)
    downgraded = len([f for f in plan.kv.values() if f == "nvfp4"]) + len([s for s in plan.state.values() if s == "bf16"])
    # No plan that meets the budget downgrades more units (greedy in order of sensitivity is optimal here).
    best = max(k for k in range(len(us) + 1) for c in combinations(us, k)
               if sum(cost[u] for u in c) * (1 + 0.5 * max(0, k - 1)) <= budget)
    assert downgraded == best >= 2
    plan, _ = greedy_plan(base, {"kl_mean": 0.0}, sensitivity, measure, fp8_layers=1)
    most = max(config.sparse_layers, key=lambda i: sensitivity[("kv", i)])
    assert plan.kv == {i: "fp8" if i == most else "nvfp4" for i in config.sparse_layers}
    assert set(plan.state.values()) == {"fp32"}
    with pytest.raises(ValueError, match="needs a budget"):
        greedy_plan(base, {}, sensitivity, measure)
