"""The engine against the model's plain full-forward greedy loop on tiny-sala.

The reference recomputes the whole sequence with `model(ids, use_cache=False)` for every new
token: no cache, no batching, no chunking, no fused projections, so it shares none of the
engine's machinery. Every engine variant (fast and evaluation mode, eager and compiled,
fp32, BF16 and NVFP4 weights) must decode exactly what it decodes.
"""
import asyncio
import copy

import numpy as np
import pytest
import torch

from sala.checkpoint import load_model
from sala.config import SALAConfig
from sala.engine import AsyncEngine, CacheFull, Engine, InvalidParam, QueueFull, SamplingParams
from sala.engine.memory import cuda_cache_budget, plan_memory
from sala.hf import MiniCPMSALAForCausalLM
from sala.kv import KVPlan
from sala.sampling import filtered_probs
from sala.tiny import heldout_texts
from tests.conftest import assert_gpu_bench_refuses_cpu

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_NEW = 12
# Measured: fast-mode engine logprobs differ from the full forward's by at most ~4e-6 in fp32
# (decode uses the lightning one-step form, the reference the chunked form; fused GEMMs round
# differently); 1e-4 leaves room without hiding a bug.
LOGPROB_TOL = 1e-4


def nvfp4_model(model):
    """tiny-sala with every decoder Linear RTN-quantized to packed NVFP4 (one global scale per
    Linear, so fused q/k/v/gate get per-row global scales)."""
    from sala.quant.layerwise import apply_quantized, layer_modules
    from sala.quant.nvfp4 import quantize_rtn

    model = copy.deepcopy(model)
    for layer in model.model.layers:
        results = {name: quantize_rtn(layer.get_submodule(name).weight.detach(), "4over6") for name in layer_modules(layer)}
        apply_quantized(layer, results, packed=True)
    return model


@pytest.fixture(scope="module")
def models(tiny_sala_dir):
    """Reference models: each engine gets its own copy (it fuses projections in place)."""
    fp32 = load_model(tiny_sala_dir)
    return {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16), "nvfp4": nvfp4_model(fp32)}


@pytest.fixture(scope="module")
def model(models):
    return models["fp32"]


@pytest.fixture(scope="module")
def prompts(tiny_sala_dir, tokenizer):
    """32 windows of held-out text, 9 to 72 tokens, each after a BOS."""
    stream = tokenizer("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    assert len(stream) > 32 * 101 + 72
    return [stream[:1] + stream[1 + 101 * i : 9 + 101 * i + (7 * i) % 64] for i in range(32)]


@torch.no_grad()
def full_forward_greedy(model, ids, n):
    ids, out, logprobs = list(ids), [], []
    for _ in range(n):
        lp = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
        t = int(lp.argmax())
        out.append(t)
        logprobs.append(lp)
        ids.append(t)
    return out, torch.stack(logprobs)


_references = {}


def reference(models, kind, prompts):
    if kind not in _references:
        _references[kind] = [full_forward_greedy(models[kind], p, N_NEW) for p in prompts]
    return _references[kind]


def greedy(**kw):
    return SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, **kw)


def check_against_reference(completions, refs, tol=LOGPROB_TOL):
    """Token for token equal to the reference; with a looser `tol` (BF16) a sequence may leave
    the reference only at a near-tie, where the reference's own logprob of the engine's token is
    within `tol` of its top token's, and is compared up to there."""
    worst, ties = 0.0, 0
    for c, (tokens, lp) in zip(completions, refs):
        same = next((i for i, (a, b) in enumerate(zip(c.token_ids, tokens)) if a != b), len(tokens))
        if same < len(tokens):
            assert tol > LOGPROB_TOL, f"engine left the reference at token {same}: {c.token_ids} != {tokens}"
            gap = (lp[same, tokens[same]] - lp[same, c.token_ids[same]]).item()
            assert gap < tol, f"engine left the reference at token {same}, not a near-tie (gap {gap:.3f})"
            ties += 1
        assert len(c.token_ids) == len(tokens)
        got = torch.tensor([x.logprob for x in c.logprobs[:same]])
        want = lp[torch.arange(same), torch.tensor(tokens[:same], dtype=torch.long)]
        worst = max(worst, (got - want).abs().max().item() if same else 0.0)
    print(f"max |engine logprob - full-forward log_softmax| = {worst:.2e}; {ties} sequences left it at a near-tie")
    assert worst < tol


def run_with_joiners(engine, prompts, params):
    """Requests arrive while others decode."""
    reqs = [engine.add_request(p, params) for p in prompts[: len(prompts) // 4]]
    for _ in range(4):
        engine.step()
    reqs += [engine.add_request(p, params) for p in prompts[len(prompts) // 4 :]]
    while engine.has_work():
        engine.step()
    return [r.completion() for r in reqs]


# Measured worst logprob differences to each model's own full forward: fp32 3e-6; NVFP4
# weights in fp32 activations 3e-6; BF16 weights and activations 3.4e-2 (the engine attends in
# fp32, the model's SDPA in bf16, and fused GEMMs round differently), enough to flip a greedy
# near-tie now and then; compiled, 9.2e-2 (inductor keeps fused elementwise chains in fp32).
TOLERANCE = {"fp32": LOGPROB_TOL, "bf16": 0.15, "nvfp4": LOGPROB_TOL}
VARIANTS = [("fp32", dict(compile=False)), ("fp32", dict(batch_invariant=True)), ("fp32", dict(compile=True)),
            ("bf16", dict(batch_invariant=True)), ("bf16", dict(compile=True)),
            ("nvfp4", dict(batch_invariant=True)), ("nvfp4", dict(compile=True))]


@pytest.mark.parametrize("kind, settings", VARIANTS, ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in s.items())}" for k, s in VARIANTS])
def test_greedy_matches_full_forward(models, tokenizer, prompts, kind, settings):
    """Batches of 1, 3 and 8, then 32 requests joining mid-batch under a 96-token budget that
    splits prompts into chunks: every request decodes what the full forward decodes."""
    refs = reference(models, kind, prompts)
    engine = Engine(copy.deepcopy(models[kind]), tokenizer, max_batch_tokens=96, **settings)
    done = []
    for batch in (1, 3, 8):
        done += engine.generate(prompts[len(done) : len(done) + batch], greedy(logprobs=0))
    check_against_reference(done, refs, TOLERANCE[kind])
    check_against_reference(run_with_joiners(engine, prompts, greedy(logprobs=0)), refs, TOLERANCE[kind])
    assert engine.scheduler.num_preemptions == 0
    if settings.get("compile"):
        assert engine.compile_seconds is not None, "the compiled decode step did not run"
        print(f"{kind}: decode step compiled in {engine.compile_seconds:.1f} s")


def test_fused_engine_model_still_serves_transformers_generate(models, tokenizer, prompts):
    """Fusing projections in place (the engine does) keeps the model's own forward and generate()."""
    model = copy.deepcopy(models["fp32"])
    Engine(model, tokenizer, compile=False)
    assert model.model.layers[0].self_attn.qkvg_proj is not None
    tokens, _ = reference(models, "fp32", prompts)[0]
    ids = torch.tensor([prompts[0]])
    out = MiniCPMSALAForCausalLM.sharing(model).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                                                         do_sample=False, pad_token_id=model.config.pad_token_id)
    assert out[0, ids.shape[1] :].tolist() == tokens


def test_top_logprobs_are_log_softmax_of_full_forward(model, tokenizer, prompts):
    engine = Engine(copy.deepcopy(model), tokenizer, compile=False)
    (c,) = engine.generate(prompts[2:3], greedy(logprobs=256))
    _, lp = full_forward_greedy(model, prompts[2], N_NEW)
    for step, entry in enumerate(c.logprobs):
        ids = [t for t, _ in entry.top]
        values = torch.tensor([v for _, v in entry.top])
        assert len(ids) == 256 and len(set(ids)) == 256
        assert torch.allclose(values, lp[step, ids], atol=LOGPROB_TOL)
        assert torch.allclose(values, lp[step].topk(256).values, atol=LOGPROB_TOL)


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_logprobs_across_prefill_chunks(model, tokenizer, prompts, start):
    ids = prompts[7]  # 58 tokens, prefilled in chunks of at most 16
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0], -1)
    engine = Engine(copy.deepcopy(model), tokenizer, max_batch_tokens=16, max_seqs=4, compile=False)
    (c,) = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=3, prompt_logprobs_start=start))
    first = max(start, 1)
    assert [e.token_id for e in c.prompt_logprobs] == ids[first:]
    for pos, e in zip(range(first, len(ids)), c.prompt_logprobs):
        assert abs(e.logprob - want[pos - 1, ids[pos]].item()) < LOGPROB_TOL
        assert [t for t, _ in e.top] == want[pos - 1].topk(3).indices.tolist()


def logprob_bits(completions):
    return [[(e.token_id, e.logprob, e.top) for e in c.logprobs] + [(e.token_id, e.logprob, e.top) for e in c.prompt_logprobs]
            for c in completions]


def test_evaluation_mode_logprobs_are_bitwise_batch_and_chunk_invariant(model, tokenizer, prompts):
    """batch_invariant=True: a request's logprobs (and prompt logprobs) are the same bits alone,
    among 8, among 32, and with its prompt prefilled in one step or in several chunks. The
    fast mode's difference is printed, not asserted (it depends on the CPU's GEMM kernels)."""
    long_prompts = [sum(prompts[i : i + 4], [])[:150] for i in range(0, 32, 4)]  # 8 prompts of ~150 tokens
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs_start=100)
    for invariant in (True, False):
        def engine(**kw):
            return Engine(copy.deepcopy(model), tokenizer, batch_invariant=invariant, compile=False, **kw)

        alone = [engine().generate([p], params)[0] for p in long_prompts + prompts[:4]]
        runs = {
            "batch 8": engine().generate(long_prompts, params) + engine().generate(prompts[:4], params),
            "batch 32": engine().generate(long_prompts + prompts[:24], params)[:8] + engine().generate(prompts[:32], params)[:4],
            "chunked (80-token budget)": engine(max_batch_tokens=80, max_seqs=8).generate(long_prompts + prompts[:4], params),
        }
        for name, got in runs.items():
            a, b = logprob_bits(alone), logprob_bits(got)
            diff = max(abs(x[1] - y[1]) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
            print(f"batch_invariant={invariant}: {name} vs alone, max logprob difference {diff:.2e}")
            if invariant:
                assert a == b, name


def test_evaluation_mode_is_bitwise_stable_across_chunk_cuts_of_long_prompts(model, tokenizer, tiny_sala_dir):
    """Prompts past SDPA's tile-size switches (192 queries, 512 keys) prefilled whole, in chunks
    of 256 and of 128 tokens, and behind another request's chunk: the same bits. Before attention
    ran in fixed blocks of absolute positions, a 300-token prompt cut at 256 differed from the
    uncut one from position 128 on (~3e-6)."""
    stream = tokenizer("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    long_prompts = [stream[:1] + stream[1 + 700 * i : n + 700 * i] for i, n in enumerate((300, 530, 230))]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs_start=1)

    def run(max_batch_tokens, ps=long_prompts):
        e = Engine(copy.deepcopy(model), tokenizer, batch_invariant=True, compile=False, max_batch_tokens=max_batch_tokens)
        return logprob_bits(e.generate(ps, params))

    whole = run(1024)
    assert run(256) == whole, "chunks of 256"
    assert run(128) == whole, "chunks of 128"
    assert run(1024, [stream[2000:2100]] + long_prompts)[1:] == whole, "after another request's chunk"


def test_seeded_sampling_reproduces_and_does_not_depend_on_the_batch(model, tokenizer, prompts):
    def engine():
        return Engine(copy.deepcopy(model), tokenizer, batch_invariant=True)

    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = engine().generate([prompts[0]], params)[0].token_ids
    assert engine().generate([prompts[0]], params)[0].token_ids == alone
    others = SamplingParams(max_tokens=10, temperature=1.0, seed=1, ignore_eos=True)
    mixed = engine().generate([prompts[1], prompts[0], prompts[2]], [others, params, others])
    assert mixed[1].token_ids == alone
    different_seed = engine().generate([prompts[0]], SamplingParams(
        max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=8, ignore_eos=True))[0].token_ids
    assert different_seed != alone


@pytest.mark.gpu
def test_sampling_on_cuda_matches_cpu_for_a_seed(model, tokenizer, prompts):
    """Logits on the GPU, the same seed: the CPU-drawn uniforms give the same tokens as on CPU
    wherever the two devices' logits agree (greedy tokens are compared as the check of that)."""
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=40, seed=3, ignore_eos=True)
    cpu = Engine(copy.deepcopy(model), tokenizer, compile=False).generate(prompts[:4], params)
    gpu = Engine(copy.deepcopy(model).cuda(), tokenizer).generate(prompts[:4], params)
    assert [c.token_ids for c in gpu] == [c.token_ids for c in cpu]


def test_filtered_probs_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    cases = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6), (1.0, 0, 1e-6)]
    logits = rng.normal(size=(len(cases), 50)).astype(np.float32) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in cases]
    got = filtered_probs(torch.from_numpy(logits), params).numpy()  # all rows in one batched pass
    for row, (temperature, top_k, top_p) in enumerate(cases):
        z = logits[row] / temperature
        if top_k:
            z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep, mass = [], 0.0
        for i in order:  # the smallest set of most likely tokens whose mass reaches top_p
            keep.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        want = np.zeros_like(p)
        want[keep] = p[keep]
        np.testing.assert_allclose(got[row], want, atol=1e-6)


def test_sampled_tokens_follow_the_filtered_distribution(model, tokenizer):
    """The inverse-CDF draw: 4000 seeded draws from one distribution match its probabilities, and
    never pick a token that top-k / top-p removed."""
    from sala.engine.request import Request
    from sala.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    probs = filtered_probs(logits, [params])[0]
    probs = probs / probs.sum()  # top-p leaves the kept mass unnormalised
    reqs = [Request([1], params, None, None, generator=torch.Generator().manual_seed(s)) for s in range(4000)]
    draws = torch.tensor(sample(logits.expand(4000, -1), reqs))
    freq = torch.bincount(draws, minlength=40).float() / 4000
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs).abs().max() < 0.03  # 4000 draws: standard error <= 0.008


def test_a_pool_too_small_for_everyone_preempts_and_still_gives_the_same_outputs(model, tokenizer, prompts):
    """8 pages of 16 tokens for 8 requests of up to 72 + 24 tokens: requests are preempted (and
    recompute their prompt and output) until the rest finish; outputs equal a large pool's."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    big = Engine(copy.deepcopy(model), tokenizer, compile=False).generate(prompts[:8], params)
    small = Engine(copy.deepcopy(model), tokenizer, compile=False, page_size=16, max_seqs=8, max_model_len=128,
                   memory_bytes=8 * 16 * 1536 + 8 * 81920)
    assert small.cache.plan.num_pages == 8
    got = small.generate(prompts[:8], params)
    print(f"preemptions: {small.num_preemptions}")
    assert small.num_preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in big]
    assert all(abs(a.logprob - b.logprob) < LOGPROB_TOL for x, y in zip(got, big) for a, b in zip(x.logprobs, y.logprobs))
    assert small.cache.num_free_pages == 8 and len(small.cache.free_state_slots) == small.cache.plan.max_seqs
    # The evaluation mode: preempted requests give the same bits as the large pool's (their
    # generated tokens are recomputed by decode steps, as they were first computed: a prefill of
    # them, as before, moved logprobs by up to 3e-6).
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    big = Engine(copy.deepcopy(model), tokenizer, batch_invariant=True).generate(prompts[:8], params)
    small = Engine(copy.deepcopy(model), tokenizer, batch_invariant=True, page_size=16, max_seqs=8, max_model_len=128,
                   memory_bytes=8 * 16 * 1536 + 8 * 81920)
    got = small.generate(prompts[:8], params)
    assert small.num_preemptions > 0 and logprob_bits(got) == logprob_bits(big)


def test_a_request_that_does_not_fit_now_does_not_block_smaller_ones(model, tokenizer, prompts):
    engine = Engine(copy.deepcopy(model), tokenizer, compile=False, page_size=16, max_seqs=4, max_model_len=128,
                    memory_bytes=8 * 16 * 1536 + 4 * 81920)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.step()  # prefill: `first` holds 1 of the 8 pages
    long = engine.add_request(sum(prompts[24:28], [])[:120], params)  # needs all 8 pages: waits for `first`
    short = engine.add_request(prompts[1], params)
    while not short.finish_reason:
        engine.step()
    assert long.finish_reason is None and not long.output_ids  # passed over, not failed
    while engine.has_work():
        engine.step()
    assert long.finish_reason == "length" and first.finish_reason == "length"


def test_stop_strings_stop_token_ids_and_max_tokens(models, tokenizer, prompts):
    engine = Engine(copy.deepcopy(models["fp32"]), tokenizer, compile=False)
    tokens, _ = reference(models, "fp32", prompts)[4]
    full_text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert stop.strip(), "pick a prompt whose continuation has visible text"
    (c,) = engine.generate([prompts[4]], greedy(stop=[stop]))
    assert c.finish_reason == "stop"
    assert c.text == full_text[: full_text.index(stop)]

    cut = 5
    (c,) = engine.generate([prompts[4]], greedy(stop_token_ids=[tokens[cut]]))
    first = tokens.index(tokens[cut])
    assert c.finish_reason == "stop" and c.token_ids == tokens[: first + 1]

    (c,) = engine.generate([prompts[4]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert c.finish_reason == "length" and c.token_ids == tokens[:3]


def test_incremental_text_equals_full_decode(tokenizer):
    """Multi-byte characters split across byte-level BPE tokens must come out whole."""
    from sala.engine.detokenizer import IncrementalDetokenizer

    text = "naïve café — ünïcode ✓ 東京 and plain ascii; emoji 🙂 end"
    ids = tokenizer(text)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, ids[:1], stop=[])
    pieces = []
    for t in ids[1:]:
        d.append(t)
        pieces.append(d.delta(finished=False))
    pieces.append(d.delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids[1:], skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_streaming_and_cancellation_free_the_cache(models, tokenizer, prompts):
    engine = Engine(copy.deepcopy(models["fp32"]), tokenizer, compile=False)
    async_engine = AsyncEngine(engine)
    free_pages = engine.cache.num_free_pages

    async def stream_all():
        deltas, tokens = [], []
        async for out in async_engine.submit(prompts[0], greedy()).outputs():
            deltas.append(out.text)
            tokens += out.token_ids
        return "".join(deltas), tokens

    async def stream_two_then_leave():
        agen = async_engine.submit(prompts[1], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)).outputs()
        got = [await agen.__anext__() for _ in range(2)]
        await agen.aclose()
        return got

    try:
        text, tokens = asyncio.run(stream_all())
        assert tokens == reference(models, "fp32", prompts)[0][0]
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(asyncio.run(stream_two_then_leave())) == 2
        for _ in range(100):
            if not engine.has_work():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert not engine.has_work()
        assert engine.cache.num_free_pages == free_pages  # free, or cached for prefix reuse
    finally:
        async_engine.close()


def test_an_abort_counts_once(models, tokenizer, prompts):
    """An abort takes effect at the start of the next step; until then the request is neither
    running nor abortable again (SGLang's abort_all right after an abort by rid names only the rest)."""
    engine = Engine(copy.deepcopy(models["fp32"]), tokenizer, compile=False)
    async_engine = AsyncEngine(engine)

    async def abort_both():
        long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        outputs = {rid: async_engine.submit(p, long, rid).outputs() for rid, p in zip("ab", prompts)}
        for it in outputs.values():
            await it.__anext__()  # both are generating
        assert async_engine.abort("a") and not async_engine.abort("a")
        assert async_engine.running() == ["b"]
        assert async_engine.abort("b") and async_engine.running() == []
        ends = {}
        for rid, it in outputs.items():
            async for out in it:
                ends[rid] = out.finish_reason
        return ends

    try:
        assert asyncio.run(abort_both()) == {"a": "cancelled", "b": "cancelled"}
        assert not async_engine.abort("a")
    finally:
        async_engine.close()


def test_bounded_queue_and_bad_parameters(model, tokenizer, prompts):
    engine = Engine(copy.deepcopy(model), tokenizer, max_waiting=2, compile=False)
    engine.add_request(prompts[0], greedy())
    engine.add_request(prompts[1], greedy())
    with pytest.raises(QueueFull):
        engine.add_request(prompts[2], greedy())
    bad = {
        "max_tokens": SamplingParams(max_tokens=0),
        "temperature": SamplingParams(temperature=-0.1),
        "top_p": SamplingParams(top_p=0.0),
        "logprobs": SamplingParams(logprobs=257),
        "stop_token_ids": SamplingParams(stop_token_ids=[10**6]),
    }
    for field, params in bad.items():
        with pytest.raises(InvalidParam) as e:
            engine.add_request(prompts[0], params)
        assert e.value.param == field
    with pytest.raises(InvalidParam) as e:
        engine.add_request([5] * engine.config.max_model_len, greedy())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParam) as e:
        engine.add_request([], greedy())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParam) as e:
        engine.add_request(prompts[0], SamplingParams(max_tokens=engine.config.max_model_len))
    assert e.value.param == "max_tokens"


def test_start_up_errors_are_one_line(model, tokenizer, tiny_sala_dir):
    with pytest.raises(CacheFull, match=r"cannot hold one request of max_model_len=4096 tokens .* lower max_model_len") as e:
        Engine(copy.deepcopy(model), tokenizer, memory_bytes=1 << 20)
    assert "\n" not in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda but CUDA is not available") as e:
            Engine.from_pretrained(tiny_sala_dir, device="cuda")
        assert "\n" not in str(e.value)


GIB = 1 << 30


@pytest.mark.parametrize("device_gib", [80, 141])
def test_cache_plan_for_the_9b_model(device_gib):
    """The real 9B config on the meta device: BF16 weights, then the cache plan the engine makes
    on an 80 GB and a 141 GB GPU (gpu_memory_utilization 0.9, nothing else on the device)."""
    from sala.config import MINICPM_SALA_9B
    from sala.model import SALAForCausalLM

    config = SALAConfig(**MINICPM_SALA_9B)
    with torch.device("meta"):
        model = SALAForCausalLM(config)
    weights = sum(p.numel() for p in model.parameters()) * 2
    total = device_gib * 10**9
    budget = cuda_cache_budget(config, total=total, free=total - weights, utilization=0.9, max_seqs=256)
    kv = KVPlan.uniform(config, "bf16")
    plan = plan_memory(config, budget, max_seqs=256, max_model_len=config.max_position_embeddings, page_size=64, kv_plan=kv)
    print(f"\n{device_gib} GB: weights {weights / GIB:.1f} GiB; {plan.describe()}")
    assert plan.state_bytes_per_seq == 48 * 2**20 and plan.kv_bytes_per_token == 8 * 1024
    assert plan.max_kv_tokens >= config.max_position_embeddings  # one full-length request fits
    assert plan.max_seqs * plan.state_bytes_per_seq + plan.num_pages * 64 * plan.kv_bytes_per_token <= budget
    assert plan.max_seqs == 256  # 256 states take 12 GiB; the rest is K/V


def test_no_cpp_compiler_means_one_warning_and_eager(tiny_sala_dir, tmp_path):
    """A laptop without a C++ compiler: inductor cannot build the decode step; the engine says
    so in one line and decodes eagerly, with the same tokens."""
    import subprocess
    import sys

    code = f"""
import logging, torch, torch._inductor.config as ic
ic.cpp.cxx = ("/nonexistent/c++",)
torch.set_num_threads(1)
from sala.engine import Engine, SamplingParams
e = Engine.from_pretrained({str(tiny_sala_dir)!r})
p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
a = e.generate(["The for statement"], p)[0].token_ids
assert e.decoding.fast_decode.failed
b = Engine.from_pretrained({str(tiny_sala_dir)!r}, compile=False).generate(["The for statement"], p)[0].token_ids
assert a == b, (a, b)
print("same tokens")
"""
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if "compiling the decode step failed" in line]
    assert len(warnings) == 1 and "same tokens" in run.stdout, run.stderr[-3000:]
    print(warnings[0])


def test_gpu_bench_exits_with_one_line_without_a_gpu():
    assert_gpu_bench_refuses_cpu("engine_gpu.py")


def test_requests_are_compared_by_identity():
    """Two requests with the same fields are still two requests: the scheduler's `in` and
    `remove` over its lists must find this one, not its twin."""
    from dataclasses import replace

    from sala.engine.request import Request

    a = Request([1, 2, 3], SamplingParams(), None, None, request_id="same")
    b = replace(a)
    assert a != b and b not in [a] and len({a, b}) == 2
    running = [a, b]
    running.remove(b)
    assert running[0] is a
