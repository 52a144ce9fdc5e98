"""Medusa in the engine on tiny-sala: greedy decoding with tree verify equals greedy decoding
without it token for token (the lossless property; also under a mixed cache plan, and with the
verify step compiled), and verify never writes the pools.

BF16 logits come out of a BF16 lm_head, so two tokens can have exactly the same logit; argmax
then takes the lower id, and a verify step whose hidden state differs from the decode step's in
the last bit may break the tie the other way. Such a prompt is allowed to diverge only at a
position where the plain decode had an exact tie (measured: 1 of 50 prompts at 16 tokens);
every other prompt must match token for token, and in fp32 compute (NVFP4 on CPU) all must."""
import copy

import pytest
import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.kv.plan import KVPlan
from sala.medusa.heads import load_heads
from sala.tiny import heldout_texts
from tests.engine.test_engine import nvfp4_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_PROMPTS, N_NEW = 50, 16


@pytest.fixture(scope="module")
def base(tiny_sala_dir):
    return load_model(tiny_sala_dir)


@pytest.fixture(scope="module")
def heads(medusa_checkpoint, base):
    return load_heads(medusa_checkpoint, base.config)


@pytest.fixture(scope="module")
def prompts(tiny_sala_dir, base):
    """50 held-out windows, 8 to 40 tokens, each after a BOS (none seen in the heads' training)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    stream = tok("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    return [stream[:1] + stream[7 + 131 * i : 15 + 131 * i + (5 * i) % 32] for i in range(N_PROMPTS)]


def mixed_plan(config) -> KVPlan:
    """Sparse layers in FP8, NVFP4 and BF16 K/V; two lightning layers keeping BF16 states."""
    first, second, *_ = config.sparse_layers
    return KVPlan.uniform(config).with_units({first: "fp8", second: "nvfp4"},
                                             {i: "bf16" for i in config.lightning_layers[::2]})


# The whole cross: both weight types, both batch sizes, with and without a mixed cache plan.
@pytest.mark.parametrize("plan", [None, "mixed"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_greedy_with_medusa_equals_greedy_without(base, heads, prompts, tiny_sala_dir, weights, batch, plan):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    model = copy.deepcopy(base).to(torch.bfloat16) if weights == "bf16" else nvfp4_model(base)
    kv_plan = mixed_plan(base.config) if plan else None
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    plain = Engine(copy.deepcopy(model), tok, max_seqs=batch, compile=False, kv_plan=kv_plan).generate(
        prompts, SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=2))
    engine = Engine(copy.deepcopy(model), tok, max_seqs=batch, compile=False, kv_plan=kv_plan, medusa=copy.deepcopy(heads))
    spec = engine.generate(prompts, params)
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    ties = 0
    for a, b in zip(plain, spec):
        if a.token_ids != b.token_ids:
            j = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            (_, first), (_, second) = a.logprobs[j].top
            assert weights == "bf16" and first == second, f"diverged at token {j} without a tie: {a.logprobs[j].top}"
            ties += 1
    stats = engine.decoding.totals
    print(f"{weights} batch {batch} plan {plan}: {same}/{len(prompts)} identical ({ties} diverge at an exact BF16 tie), "
          f"accept length {stats.accept_length:.2f} over {stats.verify_steps} verify steps")
    assert ties <= 2
    assert all(len(c.token_ids) == N_NEW for c in spec)
    assert stats.accept_length > 1.3  # drafts really were accepted, so the commit path was exercised
    assert sum(c.spec.verify_steps for c in spec) == stats.verify_steps


def test_verify_writes_no_pool_and_commit_writes_only_the_accepted_path(base, heads, prompts, tiny_sala_dir):
    from transformers import AutoTokenizer

    engine = Engine(copy.deepcopy(base), AutoTokenizer.from_pretrained(tiny_sala_dir), max_seqs=2, compile=False,
                    medusa=copy.deepcopy(heads))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts[:2]]
    engine.step()  # both prompts prefilled, drafts made
    cache = engine.cache
    def tensors(d):  # K/V pages are KVPages (their codes in .data), states plain tensors
        return {i: getattr(t, "data", t) for i, t in d.items()}

    before = {n: {i: t.clone() for i, t in tensors(d).items()} for n, d in (("k", cache.k), ("v", cache.v),
                                                                            ("states", cache.states))}
    sched = engine.scheduler.schedule()
    assert sched.decodes == reqs and not sched.prefills
    assert sched.decoding is engine.decoding.verify
    out = engine.runner.run(sched)
    assert out.decoded.shape[0] == 2 * engine.decoding.tree.num_nodes
    for name, d in (("k", cache.k), ("v", cache.v), ("states", cache.states)):
        for i, t in tensors(d).items():  # the last page / slot is scratch: padding and tree rows may write there
            assert torch.equal(t[:-1], before[name][i][:-1]), f"verify wrote {name}[{i}]"
    computed = [r.num_computed for r in reqs]
    engine.postprocess(sched, out)
    written = {int(cache.row(r, p)) for r, c in zip(reqs, computed) for p in range(c, r.num_computed)}
    assert len(written) == sum(r.num_computed - c for r, c in zip(reqs, computed))
    for i, t in tensors(cache.k).items():
        changed = [row for row in (t != before["k"][i]).flatten(2).any(-1).flatten().nonzero()[:, 0].tolist()
                   if row < cache.scratch_row]
        assert set(changed) <= written and changed, f"layer {i}: K/V rows {changed} written, expected {sorted(written)}"
    for i, t in cache.states.items():
        changed = (t != before["states"][i])[:-1].flatten(1).any(-1).nonzero()[:, 0].tolist()
        assert changed == sorted(r.state_slot for r in reqs)


def test_usage_reports_spec_counters_as_sglang():
    from sala.engine.request import RequestOutput, SpecStats
    from serve.protocol import Choice, usage

    c = Choice(0)
    c.add(RequestOutput("r", [1, 2, 3], "", [], [], False, None, 5, 3, spec=SpecStats(2, 126, 1, [1, 0, 0, 0])))
    u = usage([c], 5)
    assert u["spec_verify_ct"] == 2 and u["spec_accept_token_num"] == 1 and u["spec_draft_token_num"] == 126
    assert u["spec_accept_length"] == 1.5 and u["completion_tokens"] == 3
    assert "spec_verify_ct" not in usage([Choice(0)], 5)  # no Medusa, no counters


def test_sampling_with_typical_acceptance_is_seeded_and_mixes_with_greedy(base, heads, prompts, tiny_sala_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    runs = [Engine(copy.deepcopy(base), tok, max_seqs=2, compile=False, medusa=copy.deepcopy(heads)).generate(prompts[:2], params)
            for _ in range(2)]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]  # the seed fixes the draws
    assert all(len(c.token_ids) == 12 for c in runs[0])
    plain = Engine(copy.deepcopy(base), tok, compile=False).generate(prompts[1:2], params[1])
    assert runs[0][1].token_ids == plain[0].token_ids  # the greedy request beside a sampled one stays lossless


def test_compiled_verify_step_equals_eager_greedy(base, heads, prompts, tiny_sala_dir):
    """On CPU a greedy batch's whole speculative step runs compiled (medusa_decoding.CompiledGreedyAccept:
    verify, acceptance, commit and drafting in one graph for a single request's tree, one for
    several); its output is plain greedy's, at one and two requests a step, and the graphs really ran."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    plain = Engine(copy.deepcopy(base), tok, max_seqs=2, compile=False).generate(prompts[:6], params)
    engine = Engine(copy.deepcopy(base), tok, max_seqs=2, medusa=copy.deepcopy(heads), medusa_max_batch="auto")
    engine.warmup()
    fast = engine.decoding.verify.fast_greedy
    assert fast.compiled and not fast.failed, "the compiled speculative step did not run"
    assert engine.decoding.plain.fast_decode.compiled, "warmup did not compile the plain decode step 'auto' may choose"
    timed = engine.decoding.policy.step_ms  # batch -> (plain, greedy verify, sampled verify) ms, measured by warmup
    print(engine.decoding.describe())
    assert set(timed) == {1, 2} and all(len(ms) == 3 and all(0 < t < 1e3 for t in ms) for ms in timed.values())
    assert engine.decoding.totals.verify_steps == 0 and engine.counts.generated_tokens == 0  # warmup's steps are not traffic
    engine.decoding.policy.max_batch = None  # always verify, to check both verify graphs
    calls = []
    fast.fn = (lambda fn: lambda *a: calls.append(a[2].shape[0]) or fn(*a))(fast.fn)  # a[2]: the tree tokens [R, T]
    single = engine.generate(prompts[:1], params)
    pair = engine.generate(prompts[1:6], params)
    assert [c.token_ids for c in single + pair] == [c.token_ids for c in plain]
    assert {1, 2} <= set(calls) and engine.decoding.totals.accept_length > 1.3
    # Verifying only single requests: two decoders take the compiled plain step (their drafts go stale), still lossless.
    engine.decoding.policy.max_batch, calls[:] = 1, []
    decoded = []
    plain_step = engine.decoding.plain.fast_decode
    plain_step.fn = (lambda fn: lambda *a: decoded.append(a[0].shape[0]) or fn(*a))(plain_step.fn)
    assert [c.token_ids for c in engine.generate(prompts[1:6], params)] == [c.token_ids for c in plain[1:]]
    assert decoded and set(calls) == {1}


def test_plain_steps_above_medusa_max_batch_stay_lossless(base, heads, prompts, tiny_sala_dir):
    """medusa_max_batch=1: a step with more than one decoding request decodes plainly, a step with
    one verifies its tree; the requests keep their old drafts through plain steps, and greedy
    output is plain greedy's token for token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 8, 12, 24)]
    plain = Engine(copy.deepcopy(base), tok, max_seqs=4, compile=False).generate(prompts[:4], params)
    engine = Engine(copy.deepcopy(base), tok, max_seqs=4, compile=False, medusa=copy.deepcopy(heads), medusa_max_batch=1)
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(s := schedule()) or s
    out = engine.generate(prompts[:4], params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    verifies = [s.decoding is engine.decoding.verify for s in steps]
    kinds = {(len(s.decodes), v) for s, v in zip(steps, verifies) if s.decodes}
    assert {(1, True), (2, False), (4, False)} <= kinds and all(spec == (n == 1) for n, spec in kinds), kinds
    assert engine.decoding.totals.verify_steps == sum(len(s.decodes) for s, v in zip(steps, verifies) if v)
    assert out[3].spec.verify_steps > 0 and out[0].spec.verify_steps == 0
    # What a replica's /metrics reports of it.
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import EngineSeries

    registry = CollectorRegistry()
    registry.register(EngineSeries(engine.info(), engine.stats()))
    value = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    totals = engine.decoding.totals
    assert value["sala_spec_max_batch"] == 1 and value["sala_spec_verify_steps_total"] == totals.verify_steps
    assert value["sala_spec_accepted_tokens_total"] == totals.accepted_tokens


def test_auto_speculation_verifies_where_accepted_tokens_pay_for_the_step():
    """medusa_max_batch='auto' against the rule worked by hand: verify at n requests when
    accept_length x plain(n) >= verify(n), times linear between the batch sizes timed."""
    from sala.engine.config import parse_max_batch
    from sala.engine.medusa_decoding import SpeculationPolicy, running_accept_length
    from sala.engine.request import SpecStats

    stats = SpecStats()
    policy = SpeculationPolicy("auto")
    def length():  # the engine's: the measured mean once enough verify steps ran, the heads' prior before
        return running_accept_length(stats, 1.8)

    assert policy(64, length())  # not timed yet: verify
    policy.step_ms = {1: (2.0, 3.0, 4.0), 4: (3.0, 9.0, 12.0), 16: (6.0, 40.0, 50.0)}
    # n = 2: plain 2 + 1/3, verify 3 + 2 = 5; 1.8 x 2.33 = 4.2 < 5. Sampled, n = 1: 3.6 < 4.
    assert [policy(n, length()) for n in (1, 2, 4, 16, 64)] == [True, False, False, False, False]
    assert not policy(1, length(), greedy=False)
    stats.verify_steps, stats.accepted_tokens = 31, 62
    assert length() == 1.8  # 31 steps: still the prior
    stats.verify_steps, stats.accepted_tokens = 32, 64  # measured accept length 3.0 replaces the prior
    # n = 2: 3 x 2.33 = 7 >= 5; n = 4: 9 >= 9; n = 5: plain 3.25, verify 11.6 > 9.75.
    assert [policy(n, length()) for n in (2, 4, 5)] == [True, True, False] and policy.largest_batch(16, length()) == 4
    # Sampled: n = 2: verify 4 + 8/3 = 6.67 <= 7; n = 3: plain 2.67, verify 9.33 > 8.
    assert policy(2, length(), greedy=False) and not policy(3, length(), greedy=False)
    assert policy.largest_batch(16, length(), greedy=False) == 2
    assert SpeculationPolicy(2)(2, None) and not SpeculationPolicy(2)(3, None) and SpeculationPolicy(None)(10**6, None)
    assert parse_max_batch("8") == 8 and parse_max_batch("auto") == "auto"
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="medusa_max_batch"):
            parse_max_batch(bad)


def test_served_medusa_checkpoint_drift_scored_by_the_logprob_evaluation(medusa_checkpoint):
    """pipelines/train_medusa.py's last step: greedy Medusa never leaves the plain greedy path of
    the evaluation-mode baseline; sampling (typical acceptance, and plain) does, and is measured."""
    from pipelines.evaluate import score_medusa

    s = score_medusa(medusa_checkpoint, num_prompts=8, max_new_tokens=16)
    print(s)
    assert s["medusa_greedy_drift_identical_share"] == 1 and s["medusa_greedy_untied_departures"] == 0
    assert s["medusa_greedy_drift_flip_rate"] == 0 and s["medusa_greedy_drift_kl_mean"] < 1e-6
    assert s["medusa_typical_drift_identical_share"] < 1 and s["plain_sampled_drift_identical_share"] < 1
