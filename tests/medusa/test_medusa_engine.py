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
import json
import logging

import pytest
import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.engine.medusa_decoding import EAGER, GREEDY, TEMPERED, step_kind
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


def whole(heads) -> int:
    """medusa_nodes for the heads' whole tree at every step: every decode step a verify step."""
    return heads.tree.num_nodes - 1


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
    engine = Engine(copy.deepcopy(model), tok, max_seqs=batch, compile=False, kv_plan=kv_plan, medusa=copy.deepcopy(heads),
                    medusa_nodes=whole(heads))
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
    (one request a step and several): greedy output is plain greedy's (but at a BF16 tie). BF16
    states give each tree a forward graph of its own (greedy acceptance eager); it compiles at its
    first step, without warmup() (which would compile the plain step's graphs too)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    model, kv_plan = copy.deepcopy(base).to(torch.bfloat16), mixed_plan(base.config)
    plain = Engine(copy.deepcopy(model), tok, max_seqs=2, compile=False, kv_plan=kv_plan).generate(
        prompts[:7], SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=2))
    engine = Engine(model, tok, max_seqs=2, kv_plan=kv_plan, medusa=copy.deepcopy(heads), medusa_nodes=8)
    verify = engine.decoding.verifies[8].fast_verify
    calls = []
    verify.run = (lambda run: lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))(verify.run)  # a[0]: tokens [R, T]
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    spec = engine.generate(prompts[:1], params) + engine.generate(prompts[1:7], params)
    assert verify.compiled and not verify.failed and set(calls) == {1, 2}, calls
    assert diverged_at_ties(plain, spec, True) <= 1 and engine.decoding.totals.accept_length > 1.3


def test_verify_writes_no_pool_and_commit_writes_only_the_accepted_path(base, heads, prompts, tiny_sala_dir):
    from transformers import AutoTokenizer

    engine = Engine(copy.deepcopy(base), AutoTokenizer.from_pretrained(tiny_sala_dir), max_seqs=2, compile=False,
                    medusa=copy.deepcopy(heads), medusa_nodes=whole(heads))
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
    runs = [Engine(copy.deepcopy(base), tok, max_seqs=2, compile=False, medusa=copy.deepcopy(heads),
                   medusa_nodes=whole(heads)).generate(prompts[:2], params) for _ in range(2)]
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

    from sala.engine.tree_choice import SETTLE

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
    timed = medusa.choice.step_ms()  # [kind, batch size class, nodes, ms], measured by warmup as traffic would be
    assert {(kind, cls, nodes) for kind, cls, nodes, _ in timed} >= {(k, 1, n) for k in (GREEDY, TEMPERED) for n in (0, 1)}
    assert all(0 < ms < 1e3 for *_, ms in timed) and {cls for _, cls, _, _ in timed} <= {1, 2}
    assert medusa.totals.verify_steps == 0 and engine.counts.generated_tokens == 0  # warmup's steps are not traffic
    assert not medusa.choice.acceptance  # nor is what the warmup prompt's drafts kept
    # What a replica's /metrics says of the choice.
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import EngineSeries

    registry = CollectorRegistry()
    registry.register(EngineSeries(engine.info(), engine.stats()))
    samples = {(s.name, s.labels.get("batch"), s.labels.get("sampling")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    trees = engine.stats().speculation.trees
    # One row for each class whose timing warmup finished: which ones did depends on the step times
    # (a class whose trees keep paying is timed further, at traffic's first steps).
    done = {(cls, kind) for kind, cls, _, _ in timed if medusa.choice.untimed(kind, cls) is None}
    assert trees and {(t.batch, t.kind) for t in trees} == done
    for t in trees:
        key = (str(t.batch), t.kind)
        rates = medusa.choice.rates(t.kind, t.batch)
        assert samples[("sala_spec_tree_nodes", *key)] == t.nodes == medusa.choice.best(rates)
        assert samples[("sala_spec_expected_speedup", *key)] == pytest.approx(t.speedup) == rates[t.nodes] / rates[0]
    calls = []
    fast.launch = (lambda launch: lambda graph, leaves: calls.append(leaves[0].shape[0]) or launch(graph, leaves))(
        fast.launch)  # leaves[0]: parents [T]
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
    graph.launch = (lambda launch: lambda g, leaves: calls.append(leaves[0].shape[0]) or launch(g, leaves))(graph.launch)
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
    # With the choice left to itself, a decode step with no prompt work is timed SETTLE steps into
    # a run of its candidate (the forced steps above were not timed); a step that prompt chunks
    # join decodes plainly, and so ends a tree's run.
    counts = {key: est.count for key, est in medusa.choice.ms.items()}
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(s := schedule()) or s
    took = medusa.choice.timed
    timed_steps = []
    medusa.choice.timed = lambda ms: timed_steps.append(medusa.choice._measured()) or took(ms)
    out = engine.generate(prompts[:6], params)
    del engine.scheduler.schedule, medusa.choice.timed
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    decodes = [s for s in steps if s.decodes]
    assert all(s.decoding is medusa.plain_step for s in decodes if s.prefills)
    runs = [(len(s.decodes).bit_length(), s.decoding.rows - 1) for s in decodes]  # size class, nodes
    measured = [i >= SETTLE and runs[i - SETTLE : i] == [runs[i]] * SETTLE for i, s in enumerate(decodes) if not s.prefills]
    assert timed_steps == measured and sum(measured) > 0
    added = sum(est.count for est in medusa.choice.ms.values()) - sum(counts.values())
    assert added == sum(timed_steps)


def test_plain_steps_above_medusa_max_batch_stay_lossless(base, heads, prompts, tiny_sala_dir):
    """medusa_max_batch=1: a step with more than one decoding request decodes plainly, a step with
    one verifies its tree (the 4-node one, fixed); the requests keep their drafts through plain steps, and greedy
    output is plain greedy's token for token."""
    from transformers import AutoTokenizer

    from sala.engine.medusa_decoding import TreeVerify

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 8, 12, 24)]
    plain = Engine(copy.deepcopy(base), tok, max_seqs=4, compile=False).generate(prompts[:4], params)
    engine = Engine(copy.deepcopy(base), tok, max_seqs=4, compile=False, medusa=copy.deepcopy(heads), medusa_max_batch=1,
                    medusa_nodes=4)
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


def run_choice(choice, ms: dict[int, float], steps: int, n: int = 1, kept: float = 1.0) -> list[int]:
    """`steps` decode steps of n greedy requests, each candidate's step taking ms[nodes] and keeping
    `kept` times the drafts its prior expects: the candidate each step took."""
    taken = []
    for _ in range(steps):
        nodes = choice(n, GREEDY)
        choice.timed(ms[nodes])
        if nodes:
            choice.observe(n, n * kept * (choice.prior[nodes] - 1))
        taken.append(nodes)
    return taken


PRIOR = {1: 1.5, 2: 1.8, 4: 2.1, 8: 2.3, 16: 2.5}
MS = {0: 1.0, 1: 1.2, 2: 1.3, 4: 1.5, 8: 2.2, 16: 3.0}  # tokens/ms: 1, 1.25, 1.38, 1.4, 1.05, 0.83


def test_tree_choice_times_plain_then_trees_smallest_first_and_never_verifies_an_untimed_tree():
    """Untimed, a class decodes plainly; then each tree, smallest first, takes TIMED measured steps
    (the SETTLE first after a change are not measured) until one does worse than STOP_BELOW of the best;
    then every step takes the best timed candidate by accept length / ms, but EXPLORE_STEPS in
    every EXPLORE_EVERY, which visit plain decoding and the other timed trees (each in turn) in
    turns. The 16-node tree, past the stop, is never verified."""
    from sala.engine.tree_choice import EXPLORE_EVERY, EXPLORE_STEPS, SETTLE, TIMED, TreeChoice

    choice = TreeChoice(prior=dict(PRIOR), max_batch=None, fixed=None)
    taken = run_choice(choice, MS, 9 * EXPLORE_EVERY)
    walk = [n for n in (0, 1, 2, 4, 8) for _ in range(SETTLE + TIMED)]
    assert taken[: len(walk)] == walk and 16 not in taken
    visits = [(i + 1) // EXPLORE_EVERY if (i + 1) % EXPLORE_EVERY >= EXPLORE_EVERY - EXPLORE_STEPS else None
              for i in range(len(walk), len(taken))]
    assert taken[len(walk):] == [4 if v is None else 0 if v % 2 else [1, 2, 8][v // 2 % 3] for v in visits]
    assert {v // 2 % 3 for v in visits if v is not None and v % 2 == 0} == {0, 1, 2}
    assert sorted(nodes for _, _, nodes, _ in choice.step_ms()) == [0, 1, 2, 4, 8]
    assert [(r.batch, r.kind, r.nodes) for r in choice.table()] == [(1, GREEDY, 4)]
    assert choice.table()[0].speedup == pytest.approx(2.1 / 1.5)
    # Another batch size class is timed on its own (batches of 2 and 3 share one), from plain decoding.
    assert run_choice(choice, MS, 2, n=3) == [0, 0] and choice(2, GREEDY) == 0


def test_tree_choice_follows_the_steps_it_takes():
    """Both running estimates move with the steps: verify steps that keep 0.7 of what the heads'
    acceptance promised shrink every tree's expected accept length, and the choice goes to a
    smaller tree; the chosen tree's steps getting dearer send it to the next best. The first step
    after a change, forced steps (warmup's compiling) and pauses past OUTLIER times the estimate
    do not count."""
    from sala.engine.tree_choice import ACCEPT_WEIGHT, OUTLIER, SETTLE, WEIGHT, TreeChoice

    choice = TreeChoice(prior=dict(PRIOR), max_batch=None, fixed=None,
                        step_ms=[[GREEDY, 1, nodes, ms] for nodes, ms in MS.items()])
    assert choice(1, GREEDY) == 4  # read from the cache: timed, no walk
    taken = run_choice(choice, MS, 120, kept=0.7)
    assert choice.acceptance[GREEDY].mean == pytest.approx(0.7, abs=0.05) and taken[-1] == by_hand(choice, MS) == 2
    dear = MS | {2: 3.0}
    assert run_choice(choice, dear, 200, kept=0.7)[-1] == by_hand(choice, dear) == 4
    assert choice.ms[GREEDY, 1, 2].mean > MS[2]  # one dear step was enough to leave it
    before = choice.ms[GREEDY, 1, 4].mean
    with choice.forcing(4):
        choice(1, GREEDY), choice.timed(100.0), choice(1, GREEDY), choice.timed(100.0)
    assert choice.ms[GREEDY, 1, 4].mean == before
    for _ in range(SETTLE):  # the forced steps count as steps of its run
        assert choice(1, GREEDY) == 4 and choice.run >= SETTLE
        choice.timed(before)
    choice.timed(1e3)  # counted as OUTLIER times the estimate
    assert choice.ms[GREEDY, 1, 4].mean == pytest.approx(before + WEIGHT * (OUTLIER - 1) * before)
    # Every tree's expected accept length is its validation figure scaled by what the verify steps
    # of every tree kept against theirs: a step of a small tree that keeps all it can raises a
    # large tree's expectation as much as its own.
    kept = [[GREEDY, 0.9, 300], [TEMPERED, 1.2, 5]]
    other = TreeChoice(prior=dict(PRIOR), max_batch=None, fixed=None, acceptance=kept)
    assert [other.accept_length(GREEDY, n) for n in (2, 16)] == pytest.approx([1 + 0.9 * (PRIOR[n] - 1) for n in (2, 16)])
    assert other.kept() == kept
    other.current, other.run = (GREEDY, 1, 1), SETTLE  # a measured verify step of the 1-node tree
    other.observe(requests=2, accepted=2)  # both requests kept their draft: twice the figure of 0.5
    scale = 0.9 + ACCEPT_WEIGHT * (2 / (PRIOR[1] - 1) / 2 - 0.9)
    assert other.accept_length(GREEDY, 16) == pytest.approx(1 + scale * (PRIOR[16] - 1))
    # A step keeps anything from no draft to a whole path: the scales move by ACCEPT_WEIGHT of a
    # step, or by 1 / steps while fewer are behind them, read from the disk cache too.
    other.acceptance[TEMPERED].add(0.0)
    assert other.acceptance[TEMPERED].mean == pytest.approx(1.2 * 5 / 6)
    # Plain decoding is taken unless a tree is expected at PLAIN_MARGIN times its tokens/s.
    assert TreeChoice.best({0: 1.0, 4: 1.05}) == 0 and TreeChoice.best({0: 1.0, 4: 1.15}) == 4


def test_tree_choice_measures_every_timed_tree_again():
    """A tree whose time was read too high (from the disk cache, or timed in a slow stretch), and
    that is not the runner-up, is visited in turn with the others: its estimate comes down to what
    its steps take, and the choice goes to it. Visited only as the runner-up, it never would be."""
    from sala.engine.tree_choice import EXPLORE_EVERY, TreeChoice

    cheap = {0: 1.0, 1: 1.2, 2: 1.3, 4: 1.1, 8: 2.2}  # the 4-node tree: 1.91 tokens/ms, the 2-node one 1.38
    cached = cheap | {4: 3.0}  # as read from the cache: 0.7 tokens/ms, below the 1- and 8-node trees
    choice = TreeChoice(prior=dict(PRIOR), max_batch=None, fixed=None,
                        step_ms=[[GREEDY, 1, nodes, ms] for nodes, ms in cached.items()])
    taken = run_choice(choice, cheap, 24 * EXPLORE_EVERY)
    assert taken[0] == 2 and taken[-1] == by_hand(choice, cheap) == 4
    assert choice.ms[GREEDY, 1, 4].mean == pytest.approx(cheap[4], rel=0.1)


def test_tree_choice_starts_from_the_heads_acceptance():
    """Where no acceptance was measured, the heads' validation figure counts as PRIOR_STEPS verify
    steps: the first steps that keep nothing lower it, toward smaller trees, and the choice stays
    with a tree. From those steps alone it would go to plain decoding until a visit."""
    from sala.engine.tree_choice import PRIOR_STEPS, SETTLE, TreeChoice

    choice = TreeChoice(prior=dict(PRIOR), max_batch=None, fixed=None,
                        step_ms=[[GREEDY, 1, nodes, ms] for nodes, ms in MS.items()])
    taken = run_choice(choice, MS, SETTLE + 4, kept=0.0)
    assert taken[0] == 4 and 0 not in taken
    [(kind, scale, steps)] = choice.kept()  # the figure's steps at 1, the measured ones at 0
    assert kind == GREEDY and steps > PRIOR_STEPS and scale == pytest.approx(PRIOR_STEPS / steps)


def by_hand(choice, ms: dict[int, float]) -> int:
    """The candidate with the most tokens per ms by `ms` and the choice's acceptance scale now, a
    tree only at 1.1 times plain decoding's or more."""
    scale = choice.acceptance[GREEDY].mean
    rates = {n: (1 + scale * (PRIOR[n] - 1) if n else 1) / t for n, t in ms.items()}
    best = max(rates, key=rates.get)
    return best if rates[best] >= 1.1 * rates[0] else 0


def fresh_engine(base, heads, tok, **settings):
    return Engine(copy.deepcopy(base), tok, compile=False, medusa=copy.deepcopy(heads), **settings)


def test_an_engine_without_warmup_times_its_steps_keeps_them_on_disk_and_a_second_reads_them(
        base, heads, prompts, tiny_sala_dir, own_step_costs, caplog, monkeypatch):
    """A fresh engine, no warmup(), no costs on disk: its first decode steps are plain, each tree it
    verifies was timed first (or is being timed, smallest first), and its greedy output is plain
    greedy's. The times it measured are on disk, and a second engine with
    the same key starts with them (its first decode step verifies the chosen tree); an unreadable
    file, or one of another key, is ignored with a log line; a changed key measures again, and so
    does code that writes another layout of the file."""
    from transformers import AutoTokenizer

    from sala.engine.medusa_decoding import TreeVerify
    from sala.engine.tree_choice import SETTLE, TIMED

    tok = AutoTokenizer.from_pretrained(tiny_sala_dir)
    engine = fresh_engine(base, heads, tok, max_seqs=1)
    choice = engine.decoding.choice
    # Enough decode steps for the walk to end even where no tree does worse than STOP_BELOW of the best
    # (a machine whose verify steps cost about what a plain step does) and every step keeps a whole path
    # (max_depth + 1 tokens); a request's first token is its prompt step's.
    walk_tokens = len(choice.candidates) * (SETTLE + TIMED) * (heads.tree.max_depth + 1)
    params = SamplingParams(max_tokens=1 - (-walk_tokens // 4), temperature=0, ignore_eos=True)
    plain = Engine(copy.deepcopy(base), tok, max_seqs=1, compile=False).generate(prompts[:4], params)
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append((s := schedule(), choice.untimed(GREEDY, 1))) or s
    out = engine.generate(prompts[:4], params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    decodes = [(s.decoding.rows - 1 if isinstance(s.decoding, TreeVerify) else 0, untimed)
               for s, untimed in steps if s.decodes]
    assert decodes[0] == (0, 0)
    timed = {nodes for kind, cls, nodes, _ in choice.step_ms() if (kind, cls) == (GREEDY, 1)}
    walk = [nodes for nodes, untimed in decodes if untimed is not None]
    assert walk == sorted(walk) and walk[: SETTLE + TIMED] == [0] * (SETTLE + TIMED)  # plain, then trees smallest first
    for nodes, untimed in decodes:  # every tree verified was timed, or was the one being timed
        assert nodes == untimed or nodes in timed
    # The walk ended (it goes on where a larger tree's estimate later comes within STOP_BELOW of the best).
    assert any(untimed is None for _, untimed in decodes) and 0 in timed and len(timed) >= 2
    (path,) = own_step_costs.glob("*.json")
    second = fresh_engine(base, heads, tok, max_seqs=1)
    saved = json.loads(path.read_text())  # as they were when the last candidate became timed
    again = second.decoding.choice
    assert again.step_ms() == saved["step_ms"] and [r[:3] for r in saved["step_ms"]] == [r[:3] for r in choice.step_ms()]
    assert again.kept() == saved["acceptance"] and GREEDY in [r[0] for r in saved["acceptance"]]
    untimed, rates = again.weigh(GREEDY, 1)  # the choice made: the best timed candidate (or a larger tree's timing)
    assert 0 in rates and untimed != 0
    first = untimed if untimed is not None else again.best(rates)
    assert second.decoding.for_step([second.add_request(prompts[0], params)]).rows == first + 1
    assert fresh_engine(base, heads, tok, max_seqs=2).decoding.choice.step_ms() == []  # another key
    for bad in ("{not json", json.dumps({"key": {"other": 1}, "step_ms": [["greedy", 1, 0, 1.0]], "acceptance": []}),
                json.dumps(saved | {"step_ms": [["greedy", 1, 0, -1.0]]}),
                json.dumps(saved | {"acceptance": [["greedy", 1.0]]})):  # a scale without its steps
        path.write_text(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sala.engine.step_costs"):
            assert fresh_engine(base, heads, tok, max_seqs=1).decoding.choice.step_ms() == []
        assert "ignoring the Medusa step costs" in caplog.text and str(path) in caplog.text
    path.write_text(json.dumps(saved))
    assert fresh_engine(base, heads, tok, max_seqs=1).decoding.choice.step_ms() == saved["step_ms"]
    monkeypatch.setattr("sala.engine.step_costs.LAYOUT", 1)  # code of another layout reads another file
    assert fresh_engine(base, heads, tok, max_seqs=1).decoding.choice.step_ms() == []


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
                    medusa=copy.deepcopy(heads), medusa_nodes=whole(heads))
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
