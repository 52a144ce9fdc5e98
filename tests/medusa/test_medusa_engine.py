"""Medusa in the engine on tiny-sala: greedy decoding with tree verify equals greedy decoding
without it token for token (the lossless property; also under a mixed cache plan, and with the
verify step compiled), and verify never writes the pools.

BF16 logits come out of a BF16 lm_head, so two tokens can have exactly the same logit (argmax
then takes the lower id) or logits one BF16 step apart, and a verify step whose hidden state
differs from the decode step's in the last bit (its GEMMs have more rows, which CPU kernels sum
in other blocks) may break the tie the other way or round either logit to its neighbour. Such a
prompt is allowed to diverge only at a position where the plain decode's top two logits were
within one BF16 step of each other (measured: 1 of 50 prompts at 16 tokens at an exact tie; on
another build of tiny-sala, logits 2^-5 apart); every other prompt must match token for token,
and in fp32 compute (NVFP4 on CPU) all must."""
import copy

import pytest
import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.engine.medusa_decoding import EAGER, step_kind
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
    ties = diverged_at_ties(plain, spec, weights == "bf16")
    stats = engine.decoding.totals
    print(f"{weights} batch {batch} plan {plan}: {same}/{len(prompts)} identical ({ties} diverge at a BF16 tie), "
          f"accept length {stats.accept_length:.2f} over {stats.verify_steps} verify steps")
    assert ties <= 2
    assert all(len(c.token_ids) == N_NEW for c in spec)
    assert stats.accept_length > 1.3  # drafts really were accepted, so the commit path was exercised
    assert sum(c.spec.verify_steps for c in spec) == stats.verify_steps


BF16_STEP = 2**-5  # between neighbouring BF16 values in [4, 8), where most of tiny-sala's top logits lie (4-12)


def diverged_at_ties(plain, spec, ties_allowed: bool) -> int:
    """How many greedy outputs diverge from plain greedy's (which carries top-2 logprobs); each
    only where the plain decode's top two were within one BF16 step of each other, and only
    where that may happen (BF16 logits)."""
    ties = 0
    for a, b in zip(plain, spec):
        if a.token_ids != b.token_ids:
            j = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            (_, first), (_, second) = a.logprobs[j].top
            tie = first - second <= BF16_STEP * (1 + 1e-6)
            assert ties_allowed and tie, f"diverged at token {j} without a tie: {a.logprobs[j].top}"
            ties += 1
    return ties


def test_compiled_greedy_verify_under_a_mixed_plan_equals_greedy_without(base, heads, prompts, tiny_sala_dir):
    """BF16 weights, FP8 / NVFP4 / BF16 K/V and BF16 lightning states, verify steps compiled
    (one request a step and several): greedy output is plain greedy's (but at a BF16 tie)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    model, kv_plan = copy.deepcopy(base).to(torch.bfloat16), mixed_plan(base.config)
    plain = Engine(copy.deepcopy(model), tok, max_seqs=2, compile=False, kv_plan=kv_plan).generate(
        prompts[:7], SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=2))
    engine = Engine(model, tok, max_seqs=2, kv_plan=kv_plan, medusa=copy.deepcopy(heads), medusa_nodes=8)
    engine.warmup()
    verify = engine.decoding.verifies[8].fast_verify
    assert verify.compiled and not verify.failed
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    spec = engine.generate(prompts[:1], params) + engine.generate(prompts[1:7], params)
    assert diverged_at_ties(plain, spec, True) <= 1 and engine.decoding.totals.accept_length > 1.3


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
    assert sched.decoding is engine.decoding.verifies[63]  # not timed: the whole tree
    out = engine.runner.run(sched)
    assert out.decoded.shape[0] == 2 * 64
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


def test_compiled_verify_step_equals_eager_greedy_for_every_tree(base, heads, prompts, tiny_sala_dir):
    """On CPU a greedy batch's whole speculative step runs compiled (CompiledGreedyVerify: the
    forward, acceptance, commit and drafting), the same graphs for every candidate tree (the
    tree's size is a dynamic dimension) and for one request a step or several; the
    output is plain greedy's for each tree, and the graphs really ran. So does a batch with
    sampled requests (CompiledSampledVerify). Warmup timed each kind of
    step at batch 1 and 2 without counting it as traffic."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    plain = Engine(copy.deepcopy(base), tok, max_seqs=2, compile=False).generate(prompts[:6], params)
    engine = Engine(copy.deepcopy(base), tok, max_seqs=2, medusa=copy.deepcopy(heads))
    medusa = engine.decoding
    assert sorted(medusa.verifies) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 63]
    engine.warmup()
    fast = medusa.verifies[1].fast_greedy
    assert all(v.fast_greedy is fast for v in medusa.verifies.values()), "one graph for every tree"
    assert fast.compiled and not fast.failed, "the compiled speculative step did not run"
    assert medusa.plain.fast_decode.compiled, "warmup did not compile the plain decode step 'auto' may choose"
    print(medusa.describe())
    timed = medusa.choice.step_ms  # batch -> {(greedy, nodes): ms}, measured by warmup
    assert set(timed) <= {1, 2} and 1 in timed and {(True, 0), (True, 1), (False, 0), (False, 1)} <= set(timed[1])
    assert all(0 < ms < 1e3 for row in timed.values() for ms in row.values())
    for greedy in (True, False):  # a larger tree is never timed cheaper than a smaller one
        verify = [ms for (g, nodes), ms in sorted(timed[1].items()) if g == greedy and nodes > 0]
        assert verify == sorted(verify) and len(verify) > 1
    assert medusa.totals.verify_steps == 0 and engine.counts.generated_tokens == 0  # warmup's steps are not traffic
    assert not medusa.choice.accepted.entries
    # What a replica's /metrics says of the choice.
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import EngineSeries

    registry = CollectorRegistry()
    registry.register(EngineSeries(engine.info(), engine.stats()))
    samples = {(s.name, s.labels.get("batch"), s.labels.get("sampling")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    trees = engine.stats().speculation.trees
    assert {t.batch for t in trees} == set(timed)
    for t in trees:
        key = (str(t.batch), "greedy" if t.greedy else "sampled")
        assert samples[("sala_spec_tree_nodes", *key)] == t.nodes == medusa.choice.best(t.batch, t.greedy)[0]
        assert samples[("sala_spec_expected_speedup", *key)] == pytest.approx(t.speedup)
        assert samples[("sala_spec_warmup_speedup", *key)] == pytest.approx(t.warmup_speedup)
        assert t.speedup == pytest.approx(t.warmup_speedup)  # no decode step has run yet: nothing corrects it
    calls = []
    fast.fn = (lambda fn: lambda *a: calls.append(a[0].shape[0]) or fn(*a))(fast.fn)  # a[0]: parents [T]
    for nodes in (1, 4, 63):
        with medusa.choice.forcing(nodes):
            out = engine.generate(prompts[:1], params) + engine.generate(prompts[1:6], params)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain], f"the {nodes}-node tree"
    assert set(calls) == {2, 5, 64} and medusa.totals.accept_length > 1.3
    # Batches with sampled requests whose only control is their temperature run the sampled graph
    # (what it computes: test_medusa_accept.py, against the naive paths and the sampler): seeded, a
    # run is repeated draw for draw, and a greedy request among them stays plain greedy's. A batch
    # with a top-p request accepts eagerly.
    graph = medusa.verifies[1].fast_sampled
    assert all(v.fast_sampled is graph for v in medusa.verifies.values()) and graph.compiled and not graph.failed
    graph.fn = (lambda fn: lambda *a: calls.append(a[0].shape[0]) or fn(*a))(graph.fn)
    sampled = [SamplingParams(max_tokens=N_NEW, temperature=t, top_p=p, seed=i, ignore_eos=True)
               for i, (t, p) in enumerate([(0.8, 1), (1.0, 1), (0, 1), (0.7, 1), (0.9, 0.8), (0.6, 1)])]
    for nodes in (1, 4, 63):
        calls.clear()
        with medusa.choice.forcing(nodes):
            runs = [[c.token_ids for c in engine.generate(prompts[:1], sampled[:1]) + engine.generate(prompts[:6], sampled)]
                    for _ in range(2)]
        assert runs[0] == runs[1] and runs[0][3] == plain[2].token_ids, f"the {nodes}-node tree"
        assert set(calls) == {nodes + 1}, "the sampled graph did not run"
    # A temperature given as an int runs the same graph (another would compile mid-run: 4 s).
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with medusa.choice.forcing(4):
        engine.generate(prompts[:2], [SamplingParams(max_tokens=N_NEW, temperature=1, seed=i, ignore_eos=True) for i in (0, 1)])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # With the choice left to itself, every decode step with no prompt work is timed against
    # warmup's time for its kind, but a verify right after a plain step (warmup times verify steps
    # after verify steps); nothing else is (the forced steps above were not).
    assert not medusa.choice.plain_times.entries and not medusa.choice.verify_times.entries
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(s := schedule()) or s
    out = engine.generate(prompts[:6], params)
    del engine.scheduler.schedule
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    decodes = [(s.decoding.rows - 1, not s.prefills) for s in steps if s.decodes]  # (tree, no prompt work)
    expected = [n for i, (n, pure) in enumerate(decodes) if pure and not (n and i and not decodes[i - 1][0])]
    timed = sorted([(step, 0) for step, _, _ in medusa.choice.plain_times.entries]
                   + [(step, keys[0][1]) for step, keys, _ in medusa.choice.verify_times.entries])
    assert [nodes for _, nodes in timed] == expected and len(expected) > N_NEW


def test_plain_steps_above_medusa_max_batch_stay_lossless(base, heads, prompts, tiny_sala_dir):
    """medusa_max_batch=1: a step with more than one decoding request decodes plainly, a step with
    one verifies its tree; the requests keep their drafts through plain steps, and greedy
    output is plain greedy's token for token."""
    from transformers import AutoTokenizer

    from sala.engine.medusa_decoding import TreeVerify

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 8, 12, 24)]
    plain = Engine(copy.deepcopy(base), tok, max_seqs=4, compile=False).generate(prompts[:4], params)
    engine = Engine(copy.deepcopy(base), tok, max_seqs=4, compile=False, medusa=copy.deepcopy(heads), medusa_max_batch=1)
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(s := schedule()) or s
    out = engine.generate(prompts[:4], params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    verifies = [isinstance(s.decoding, TreeVerify) for s in steps]
    kinds = {(len(s.decodes), v) for s, v in zip(steps, verifies) if s.decodes}
    assert {(1, True), (2, False), (4, False)} <= kinds and all(spec == (n == 1) for n, spec in kinds), kinds
    assert engine.decoding.totals.verify_steps == sum(len(s.decodes) for s, v in zip(steps, verifies) if v)
    assert out[3].spec.verify_steps > 0 and out[0].spec.verify_steps == 0


def step(choice, nodes: int) -> None:
    """The choice's history as if the decode step in flight verified the `nodes` candidate (0:
    decoded plainly) after the last one: what its observe and timed calls are about."""
    choice.previous, choice.current = choice.current, nodes


def test_tree_choice_pays_by_measured_costs_and_backs_off_when_drafts_stop_paying():
    """TreeChoice against the rule worked by hand: at n requests the candidate with the largest
    accept_length x plain(n) / verify(n, tree) if that is at least MIN_SPEEDUP, else plain; the
    accept length its prior scaled by what the window's verify steps accepted against their
    priors; a candidate short of MIN_SPEEDUP but not of MIN_EXPLORED verified now and then while
    the window has too few verify steps; observations age out after WINDOW_STEPS decode steps,
    and then it verifies again."""
    from sala.engine.tree_choice import (
        EXPLORE_EVERY,
        EXPLORE_STEPS,
        MIN_OBSERVED,
        MIN_TIMED,
        WINDOW_STEPS,
        TreeChoice,
        candidate_sizes,
    )

    choice = TreeChoice(prior={1: 1.5, 4: 2.0, 16: 2.4}, max_batch=None, fixed=False)
    assert choice(64) == 16  # not timed yet: the whole tree
    choice.step_ms = {1: {(True, 0): 2.0, (True, 1): 2.5, (True, 4): 3.0, (True, 16): 5.0, (False, 0): 2.0, (False, 1): 4.0},
                      4: {(True, 0): 3.0, (True, 1): 4.0, (True, 4): 6.0, (True, 16): 12.0, (False, 0): 3.0}}
    # n = 1: 1.5 x 2 / 2.5 = 1.2, 2.0 x 2 / 3 = 1.33, 2.4 x 2 / 5 = 0.96 -> 4 nodes. n = 4: 1.125, 1.0, 0.6:
    # below MIN_SPEEDUP (1.15) -> plain. n = 2 (a third of the way): plain 2.33, one node 3.0: 1.17; four 4.0:
    # 1.17 (a tie keeps the smaller). Sampled, n = 1: 1.5 x 2 / 4 = 0.75; beyond it no verify time: plain.
    # n = 64: past the batch sizes timed, plain.
    assert [choice.best(n, True)[0] for n in (1, 2, 4, 64)] == [4, 1, 0, 0] and choice.best(1, False)[0] == 0
    assert choice.best(1, True) == (4, pytest.approx(4 / 3)) and choice(1) == 4
    # Below MIN_SPEEDUP but at least MIN_EXPLORED (n = 4: one node, 1.125x), while the window holds too few
    # verify steps, EXPLORE_STEPS in a row out of every EXPLORE_EVERY verify the top candidate anyway; sampled
    # at n = 1 (0.75x): never.
    first = choice.steps + 1
    looks = {first + i: choice(4) for i in range(2 * EXPLORE_EVERY)}
    assert looks == {step: 1 if step % EXPLORE_EVERY < EXPLORE_STEPS else 0 for step in looks}
    assert not any(choice(1, greedy=False) for _ in range(2 * EXPLORE_EVERY))
    # Past the largest batch size timed (warmup stopped there: nothing paid), plain steps and no looks.
    assert not any(choice(5) for _ in range(2 * EXPLORE_EVERY)) and choice.step_times(5) == {}
    # A text the heads do not know: greedy verifies of four nodes accept a quarter of what their prior says
    # (and take as long as warmup timed them: the window holds verify steps enough, no more looks).
    step(choice, 4)
    step(choice, 4)  # verify steps after verify steps
    observed_at = choice.steps
    for _ in range(MIN_OBSERVED):
        choice.observe(4, True, requests=1, accepted=0 if _ % 4 else 1)
    for _ in range(MIN_TIMED):
        choice.timed(4, True, 1, 3.0)
    # A verify right after a plain step (its drafts made a token earlier, and it is not what warmup timed) is
    # neither counted nor timed.
    assert choice(1) == 0
    step(choice, 1)
    choice.observe(1, True, requests=1, accepted=0)
    choice.timed(1, True, 1, 30.0)
    assert choice.accepted[True][0] == MIN_OBSERVED and choice.verify_times[True, 1][0] == 0
    assert choice.accept_length(4, True) == pytest.approx(1.25) and choice.accept_length(16, True) == pytest.approx(1.35)
    # n = 1: 1.125 x 2 / 2.5 = 0.9, 1.25 x 2 / 3 = 0.83: plain.
    assert choice(1) == 0 and choice(4) == 0 and choice.accept_length(4, False) == 2.0  # sampled steps: their own window
    while choice.steps < observed_at + WINDOW_STEPS - 1:
        assert choice(1) == 0
    assert choice(1) == 4  # the observations aged out: it tries again
    assert candidate_sizes("auto", 63, True) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 63]
    assert candidate_sizes("auto", 63, False) == [63] and candidate_sizes(8, 63, True) == [8] and candidate_sizes(0, 63, True) == []
    with pytest.raises(ValueError, match="medusa_nodes=64 but the heads' tree has 63 nodes"):
        candidate_sizes(64, 63, True)
    fixed = TreeChoice(prior={8: 2.0}, max_batch=2, fixed=True)
    assert [fixed(n) for n in (1, 2, 3)] == [8, 8, 0]


def decode_one(choice, ms: dict[int, float], steps: int) -> list[int]:
    """The trees `steps` decode steps of one request take under the choice, each step taking
    ms[nodes] and, verifying, accepting what the tree's prior says."""
    taken = []
    for _ in range(steps):
        nodes = choice(1)
        choice.timed(nodes, True, 1, ms[nodes])
        if nodes:
            choice.observe(nodes, True, requests=1, accepted=choice.prior[nodes] - 1)
        taken.append(nodes)
    return taken


def test_tree_choice_verifies_every_close_candidate_the_window_has_not_measured():
    """Warmup ranked three close trees 2 > 3 > 4 nodes, and the 4-node one is in truth the best:
    the 3-node tree is verified until measured, then the 4-node one (both within RIVAL_WITHIN of
    the chosen one), which then takes the steps. Measuring only the runner-up, the 4-node tree
    would never be verified."""
    from sala.engine.tree_choice import MIN_TIMED, PROBE, RIVAL_WITHIN, TreeChoice

    choice = TreeChoice(prior={2: 1.6, 3: 1.8, 4: 2.0, 16: 2.4}, max_batch=None, fixed=False)
    choice.step_ms = {1: {(True, 0): 1.0, (True, PROBE): 1.0, (True, 2): 1.25, (True, 3): 1.42, (True, 4): 1.6,
                          (True, 16): 4.0}}
    # By warmup: 1.28x, 1.27x, 1.25x (all within RIVAL_WITHIN of 1.28x), 0.6x. In truth the 4-node
    # tree takes 1.45 ms: 1.38x.
    assert choice.top(1, True) == (2, pytest.approx(1.28)) and 2.0 / 1.6 >= RIVAL_WITHIN * 1.28
    taken = decode_one(choice, {0: 1.0, 2: 1.25, 3: 1.42, 4: 1.45}, 480)
    first = {nodes: taken.index(nodes) for nodes in (3, 4)}
    assert first[3] < first[4] and taken.count(3) >= MIN_TIMED and 16 not in taken
    assert set(taken[len(taken) // 2:]) <= {0, 4}


def test_tree_choice_verifies_the_runner_up_until_its_own_steps_correct_its_time():
    """Warmup timed the 4-node tree dearer than it is: expected at 0.95x the 2-node tree it is
    the runner-up, verified EXPLORE_STEPS steps in a row out of every EXPLORE_EVERY until the
    window has measured it (MIN_TIMED of its steps timed); its own steps correct its time, and it
    is chosen though only 1.04x the 2-node tree (LARGER_BY is for trees the window has not
    measured). Where warmup timed it right, it is not, and it stops being verified once measured."""
    from sala.engine.tree_choice import EXPLORE_EVERY, EXPLORE_STEPS, LARGER_BY, MIN_TIMED, PROBE, RIVAL_WITHIN, TreeChoice

    def run(four_ms: float, steps: int = 480) -> tuple[list[int], TreeChoice]:
        choice = TreeChoice(prior={2: 1.6, 4: 2.0, 16: 2.4}, max_batch=None, fixed=False)
        choice.step_ms = {1: {(True, 0): 1.0, (True, PROBE): 1.0, (True, 2): 1.25, (True, 4): 1.65, (True, 16): 4.0}}
        # 2 nodes: 1.6 / 1.25 = 1.28x; 4 nodes: 2.0 / 1.65 = 1.21x, within RIVAL_WITHIN of it; 16: 0.6x.
        assert choice.top(1, True) == (2, pytest.approx(1.28)) and 2.0 / 1.65 >= RIVAL_WITHIN * 1.28
        return decode_one(choice, {0: 1.0, 2: 1.25, 4: four_ms}, steps), choice

    cheaper, choice = run(1.5)  # in truth 2.0 / 1.5 = 1.33x, 1.04x the 2-node tree's 1.28x
    assert 2.0 / 1.5 < LARGER_BY * 1.28
    first = cheaper[:EXPLORE_EVERY]
    assert first[:EXPLORE_STEPS].count(4) >= EXPLORE_STEPS - 1 and set(first[EXPLORE_STEPS:]) <= {0, 2}
    switched = next(i for i in range(len(cheaper)) if set(cheaper[i:]) <= {0, 4})
    looked = cheaper[:switched].count(4)
    assert MIN_TIMED <= looked <= 2 * MIN_TIMED and switched < len(cheaper) // 2
    # The 16-node tree, never verified, is not taken as cheaper for what the 4-node tree's steps said.
    assert choice.time_scale(4, True) == pytest.approx(1.65 / 1.5) and choice.time_scale(16, True) == 1.0
    as_timed, _ = run(1.65)
    assert set(as_timed[len(as_timed) // 2:]) <= {0, 2}  # its own steps say warmup was right
    assert MIN_TIMED <= as_timed.count(4) <= 2 * MIN_TIMED


def test_tree_choice_scales_every_candidates_acceptance_by_the_windows_not_by_its_own_steps():
    """Texts differ more than trees do: the 2-node tree verified on easy text (all of its prior's
    drafts and more), then the 4-node one on hard text (half of its prior's). Each candidate's
    accept length is its prior scaled by what every verify step in the window accepted against
    its tree's prior (worked by hand below), so the 4-node tree, the better one by the priors and
    warmup's times, stays chosen; judged by its own steps it would look worse than the 2-node tree."""
    from sala.engine.tree_choice import MIN_OBSERVED, MIN_TIMED, PROBE, TreeChoice

    choice = TreeChoice(prior={2: 1.6, 4: 2.0}, max_batch=None, fixed=False, steps=10, previous=2, current=2)
    choice.step_ms = {1: {(True, 0): 1.0, (True, PROBE): 1.0, (True, 2): 1.2, (True, 4): 1.4}}
    for nodes, accepted in ((2, 0.9), (4, 0.5)):  # drafts a step, against priors of 0.6 and 1.0
        step(choice, nodes)  # verify steps after verify steps: each counted and timed
        for _ in range(MIN_OBSERVED):
            step(choice, nodes)
            choice.steps += 1
            choice.observe(nodes, True, requests=1, accepted=accepted)
            choice.timed(nodes, True, 1, choice.step_ms[1][True, nodes])
        step(choice, 0)
        for _ in range(MIN_TIMED):
            choice.timed(0, True, 1, 1.0)
    scale = (0.9 + 0.5) / (0.6 + 1.0)
    assert choice.accept_length(2, True) == pytest.approx(1 + scale * 0.6)
    assert choice.accept_length(4, True) == pytest.approx(1 + scale * 1.0)
    # 2 nodes: (1 + 0.875 x 0.6) / 1.2 = 1.27x; 4 nodes: 1.875 / 1.4 = 1.34x. By their own steps
    # they would be 1.9 / 1.2 = 1.58x and 1.5 / 1.4 = 1.07x.
    assert choice.best(1, True) == (4, pytest.approx(1.875 / 1.4))


def test_tree_choice_corrects_warmups_step_times_by_the_steps_it_takes():
    """The machine's speed drifts over a run, and not alike for every kind of step. The choice
    scales verify against plain by exp(mean log(took / warmup's time)) of each kind over the
    window, a candidate without MIN_TIMED steps of its own taken as all verify steps, a plain
    step right after a verify compared with warmup's probe time; and while it verifies it takes a
    plain step every PROBE_EVERY decode steps (PROBE_SOON while fewer than MIN_TIMED plain steps
    are in the window) to know what one takes now."""
    import math

    from sala.engine.tree_choice import MAX_LOG_DRIFT, MIN_TIMED, PROBE, PROBE_EVERY, PROBE_SOON, VERIFY, WINDOW_STEPS, TreeChoice

    choice = TreeChoice(prior={1: 1.5, 4: 2.0}, max_batch=None, fixed=False)
    choice.step_ms = {1: {(True, 0): 2.0, (True, PROBE): 2.6, (True, 1): 2.5, (True, 4): 3.0, (False, 0): 2.0},
                      2: {(True, 0): 3.0, (True, PROBE): 3.6, (True, 1): 4.0, (True, 4): 5.0}}
    # By warmup alone, n = 1: 1.5 x 2 / 2.5 = 1.2, 2 x 2 / 3 = 1.33 -> 4 nodes; with no plain step timed
    # yet, every PROBE_SOON-th step is plain.
    picks = [choice(1) for _ in range(3 * PROBE_SOON)]
    assert picks == ([4] * (PROBE_SOON - 1) + [0]) * 3 and choice.time_scale(4, True) == 1.0
    step(choice, 4)
    choice.timed(4, True, 1, 3.3)  # too few steps of either kind: warmup's times stand
    assert choice.best(1, True) == (4, pytest.approx(4 / 3))
    # Plain steps take 0.75 of warmup's time at their batch size (1.5 ms at n = 1, 1.875 at n = 1.5 -> 2.5 ms;
    # right after a verify step 0.75 of the probe's, 1.95 ms), the 4-node verify 1.1 of it: 4 nodes scale by
    # 0.75 / 1.1 -> 0.91x; the 1-node tree, with no steps of its own, by the same (every verify step's
    # drift): 1.2 x 0.682 = 0.82x. Both below MIN_SPEEDUP: plain.
    step(choice, 0)
    choice.timed(0, True, 1, 0.75 * 2.6)
    assert choice.plain_times[True] == [1, pytest.approx(math.log(0.75))]
    step(choice, 0)
    for _ in range(MIN_TIMED):
        choice.timed(0, True, 1, 1.5)
        choice.timed(0, True, 2, 2.25)
    step(choice, 4)
    step(choice, 4)
    for _ in range(MIN_TIMED):
        choice.timed(4, True, 2, 5.5)
    ratio = 0.75 / 1.1
    assert choice.time_scale(4, True) == pytest.approx(ratio) and choice.time_scale(1, True) == pytest.approx(ratio)
    assert choice.speedup(choice.step_times(1), 4, True) == pytest.approx(4 / 3 * ratio)
    assert choice.speedup(choice.step_times(1), 4, True, live=False) == pytest.approx(4 / 3)
    assert choice(1) == 0 and choice(2) == 0
    assert choice.table()[0].warmup_speedup == 1.0 and choice.table()[0].speedup == 1.0  # plain
    # The 1-node tree's own steps are as warmup said (0.75 against plain's 0.75): 1.2x, chosen.
    step(choice, 1)
    step(choice, 1)
    for _ in range(MIN_TIMED):
        choice.timed(1, True, 1, 1.875)
    assert choice.time_scale(1, True) == pytest.approx(1.0) and choice.best(1, True) == (1, pytest.approx(1.2))
    row = choice.table()[0]
    assert (row.batch, row.nodes, row.speedup, row.warmup_speedup) == (1, 1, pytest.approx(1.2), pytest.approx(1.2))
    # A pause counts as at most e times warmup's step time; sampled steps keep a drift of their own.
    step(choice, 0)
    step(choice, 0)
    choice.timed(0, False, 1, 1e6)
    assert choice.plain_times[False] == [1, MAX_LOG_DRIFT] and choice.time_scale(1, False) == 1.0
    # Probes: verifying, at least one decode step in PROBE_EVERY is plain.
    picks = [choice(1) for _ in range(3 * PROBE_EVERY)]
    assert picks.count(0) == 3 and set(picks) == {0, 1} and picks[PROBE_EVERY - 1] == 0, picks  # the last plain step: two before the first pick
    # Timings age out with the window: warmup's times stand again.
    while choice.steps < WINDOW_STEPS + 100:
        choice(1)
    assert not choice.plain_times.entries and not choice.verify_times.entries
    assert all(n == 0 for window in (choice.plain_times, choice.verify_times) for n, _ in window.sums.values())
    assert (True, VERIFY) in choice.verify_times.sums
    assert choice.time_scale(4, True) == 1.0 and choice(1) == 4
    # Warmup's own steps (forced) are not counted.
    with choice.forcing(4):
        choice.timed(4, True, 1, 3.0)
    assert not choice.plain_times.entries and not choice.verify_times.entries
    assert math.isclose(choice.plain_times[True][1], 0.0, abs_tol=1e-9)


def test_tree_choice_weighs_the_candidates_again_whenever_what_it_weighs_them_by_changes():
    """The choice is made every decode step from what it remembers of the last weighing at that
    batch size: acceptance entering the window, a new set of warmup times, or plain steps' times
    becoming many enough to compare verify steps' by must each change it as the rule says."""
    from sala.engine.tree_choice import MIN_OBSERVED, MIN_TIMED, TreeChoice

    def weighed() -> TreeChoice:
        # n = 1: 1.5 x 2 / 2.5 = 1.2, 2 x 2 / 3 = 1.33 -> 4 nodes
        choice = TreeChoice(prior={1: 1.5, 4: 2.0}, max_batch=None, fixed=False, steps=10, previous=4, current=4)
        choice.step_ms = {1: {(True, 0): 2.0, (True, 1): 2.5, (True, 4): 3.0}}
        assert choice.best(1, True) == (4, pytest.approx(4 / 3))
        return choice

    # A larger candidate must be expected at LARGER_BY times the best smaller one: four nodes at 3.3 ms,
    # 2 x 2 / 3.3 = 1.21x, are within 5% of one node's 1.2x.
    choice = weighed()
    choice.step_ms = {1: {(True, 0): 2.0, (True, 1): 2.5, (True, 4): 3.3}}
    assert choice.best(1, True) == (1, pytest.approx(1.2))
    # Verify steps that accept nothing: accept lengths 1 -> 0.8x and 0.67x, plain.
    choice = weighed()
    for _ in range(MIN_OBSERVED):
        choice.steps += 1
        choice.observe(4, True, requests=1, accepted=0)
    assert choice.best(1, True) == (0, 1.0)
    # New warmup times: a one-node verify at 1 ms -> 1.5 x 2 / 1 = 3x.
    choice = weighed()
    choice.step_ms = {1: {(True, 0): 2.0, (True, 1): 1.0, (True, 4): 3.0}}
    assert choice.best(1, True) == (1, pytest.approx(3.0))
    # Verify steps took twice warmup's time; it counts only once plain steps are timed beside them
    # (as warmup said): then 1.33 / 2 and 1.2 / 2, plain.
    choice = weighed()
    for _ in range(MIN_TIMED):
        choice.timed(4, True, 1, 6.0)
    assert choice.best(1, True) == (4, pytest.approx(4 / 3))
    step(choice, 0)
    step(choice, 0)
    for _ in range(MIN_TIMED):
        choice.timed(0, True, 1, 2.0)
    assert choice.best(1, True) == (0, 1.0) and choice.time_scale(4, True) == pytest.approx(0.5)


def test_warmup_times_no_tree_cheaper_than_a_smaller_one():
    """Warmup's verify times are raised to every smaller tree's (the times noise gave a 16-node
    tree below a 6-node one's on the 2-core VM, in order of size)."""
    from sala.engine.medusa_decoding import at_least_smaller_trees

    measured = {16: 2.85, 1: 1.47, 4: 1.63, 6: 3.0, 8: 2.79, 12: 2.76, 24: 3.34}
    assert at_least_smaller_trees(measured) == {1: 1.47, 4: 1.63, 6: 3.0, 8: 3.0, 12: 3.0, 16: 3.0, 24: 3.34}


def test_medusa_settings_parse_and_name_what_is_wrong():
    from sala.engine.config import parse_max_batch, parse_nodes

    assert parse_max_batch("8") == 8 and parse_max_batch(None) is None
    assert parse_nodes("auto") == "auto" and parse_nodes("12") == 12 and parse_nodes(0) == 0
    with pytest.raises(ValueError, match="medusa_max_batch='auto': Medusa now chooses from measured step costs"):
        parse_max_batch("auto")
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="medusa_max_batch"):
            parse_max_batch(bad)
        with pytest.raises(ValueError, match="medusa_nodes"):
            parse_nodes(bad)


def test_served_medusa_checkpoint_drift_scored_by_the_logprob_evaluation(medusa_checkpoint):
    """pipelines/train_medusa.py's last step: greedy Medusa never leaves the plain greedy path of
    the evaluation-mode baseline; sampling (typical acceptance, and plain) does, and is measured."""
    from pipelines.evaluate import score_medusa

    s = score_medusa(medusa_checkpoint, num_prompts=8, max_new_tokens=16)
    print(s)
    assert s["medusa_greedy_drift_identical_share"] == 1 and s["medusa_greedy_untied_departures"] == 0
    assert s["medusa_greedy_drift_flip_rate"] == 0 and s["medusa_greedy_drift_kl_mean"] < 1e-6
    assert s["medusa_typical_drift_identical_share"] < 1 and s["plain_sampled_drift_identical_share"] < 1


def test_prefix_cache_keys_each_page_by_its_own_tokens_after_verify_steps(base, heads, prompts, tiny_sala_dir):
    """A verify step computes several tokens at once, and the prefix cache takes in the pages it
    filled before those tokens are appended (so that a request finishing can give its pages
    back): a page is entered under its page_size tokens, once they are all known, never under a
    shorter key (which no lookup matches, and eviction failed on)."""
    from transformers import AutoTokenizer

    engine = Engine(copy.deepcopy(base), AutoTokenizer.from_pretrained(tiny_sala_dir), max_seqs=2, compile=False,
                    medusa=copy.deepcopy(heads))
    out = engine.generate(prompts[:8], SamplingParams(max_tokens=96, temperature=0, ignore_eos=True))
    assert engine.decoding.totals.accept_length > 1.3
    ps, pages = engine.cache.page_size, 0
    stack = [engine.cache.prefix.root]
    while stack:
        node = stack.pop()
        assert all(len(k) == ps for k in node.children) and all(len(k) < ps for k in node.tails)
        pages += len(node.children)
        stack += list(node.children.values()) + list(node.tails.values())
    assert pages >= sum((len(p) + len(c.token_ids) - 1) // ps for p, c in zip(prompts[:8], out)) - 8  # pages were entered


@pytest.mark.parametrize("batch", [1, 8])
def test_constrained_greedy_with_medusa_equals_constrained_greedy_without(base, heads, prompts, tiny_sala_dir, batch):
    """Every constraint kind through verify steps: a drafted token the grammar forbids is never
    kept, and what is kept is what constrained decoding without Medusa chooses, token for token
    (also with requests preempted and recomputed, at batch 8)."""
    from transformers import AutoTokenizer

    from tests.engine.test_structured import CONSTRAINTS

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = [SamplingParams(max_tokens=48, temperature=0, structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)])
              for i in range(8)]
    plain = Engine(copy.deepcopy(base), tok, max_seqs=batch, compile=False).generate(prompts[:8], params)
    small = dict(page_size=16, max_model_len=128, memory_bytes=6 * 16 * 1536 + 8 * 81920) if batch == 8 else {}
    accept = {}
    for grammar in (True, False):
        engine = Engine(copy.deepcopy(base), tok, max_seqs=batch, compile=False, medusa=copy.deepcopy(heads), medusa_nodes=16,
                        **small)
        spec = engine.generate(prompts[:8], params if grammar else SamplingParams(max_tokens=48, temperature=0))
        accept[grammar] = engine.decoding.totals.accept_length
        if grammar:
            # The compiled greedy verify graph accepts by raw argmaxes: constrained requests never take it.
            req = engine.add_request(prompts[0], params[0])
            assert req.grammar is not None and step_kind([req], engine.decoding.vocab) == EAGER
            engine.cancel(req)
            engine.step()
            assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
            assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
            assert engine.decoding.totals.accepted_tokens > 0
            assert engine.num_preemptions > 0 or not small
    print(f"batch {batch}: accept length {accept[True]:.2f} with a grammar, {accept[False]:.2f} without")
