"""Prefix reuse (sala/engine/prefix.py) against the same engine with it turned off.

The reference is `Engine(..., prefix_cache=False)` on the same weights: every request computes
its whole prompt itself. With reuse, requests that share a prefix must decode the same greedy
tokens with the same logprobs (to rounding; bit for bit in the evaluation mode), whether the
shared part ends on a snapshot position or between two, under memory pressure that evicts
cached pages and snapshots, and across preemption; and when everything has finished no page
is held by anyone.
"""
import copy

import pytest

from sala.engine import Engine, SamplingParams
from sala.tiny import heldout_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE, INTERVAL = 16, 128
# Measured: reuse vs none differ by at most ~1e-6 in fp32 (the resumed chunk is a different
# shape of matmul); the engine tests' tolerance for differently batched steps.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_sala_dir):
    from transformers import AutoTokenizer

    from sala.checkpoint import load_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_sala_dir)
    stream = tokenizer("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    return load_model(tiny_sala_dir), tokenizer, stream


def engine(setup, **kw):
    model, tokenizer, _ = setup
    kw = {"compile": False, "page_size": PAGE, "prefix_snapshot_interval": INTERVAL, "max_model_len": 1024} | kw
    if not kw.get("prefix_cache", True):
        kw.pop("prefix_snapshot_interval")
    return Engine(copy.deepcopy(model), tokenizer, **kw)


def questions(stream, n, start=2000):
    return [stream[start + 40 * i : start + 40 * i + 9 + 3 * i] for i in range(n)]


PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


def run_one_by_one(eng, prompts, params=PARAMS):
    return [eng.generate([p], params)[0] for p in prompts]


def assert_same(got, want, bitwise=False):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        if bitwise:
            assert [(e.token_id, e.logprob, e.top) for e in g.logprobs] == [(e.token_id, e.logprob, e.top) for e in w.logprobs]
        else:
            assert max(abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, w.logprobs)) < LOGPROB_TOL


def generate_checking_pages(eng, prompts, params):
    """Engine.generate, checking after every step that no page a running request holds is free,
    and that two requests share a page only through a trie node both hold."""
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_work():
        eng.step()
        free, owners = set(eng.cache.free_pages), {}
        for r in eng.scheduler.running:
            assert not free & set(r.pages)
            assert [n.page for n in r.prefix_chain] == r.pages[: len(r.prefix_chain)]
            for i, page in enumerate(r.pages):
                owners.setdefault(page, []).append(i < len(r.prefix_chain))
        assert all(len(o) == 1 or all(o) for o in owners.values())
        assert all(n.refs == sum(n in r.prefix_chain for r in eng.scheduler.running)
                   for r in eng.scheduler.running for n in r.prefix_chain)
    return [r.completion() for r in reqs]


def assert_nothing_held(eng):
    """Every trie node is held by no request, and free + cached pages are the whole pool."""
    p, nodes, stack = eng.cache.prefix, [], [eng.cache.prefix.root]
    while stack:
        n = stack.pop()
        nodes += [n] if n is not p.root else []
        stack += list(n.children.values()) + list(n.tails.values())
    assert all(n.refs == 0 for n in nodes)
    assert p.num_evictable == len(nodes)
    assert len(eng.cache.free_pages) + len(nodes) == eng.cache.plan.num_pages
    assert len(set(eng.cache.free_pages) | {n.page for n in nodes}) == eng.cache.plan.num_pages  # no page twice
    assert len(eng.cache.free_state_slots) == eng.cache.plan.max_seqs


@pytest.mark.parametrize("doc_len", [2 * INTERVAL, 2 * INTERVAL + 37], ids=["on-a-snapshot", "between-snapshots"])
def test_shared_prefix_outputs_equal_no_reuse(setup, doc_len):
    """Questions over one document, one after another: each resumes from the deepest snapshot
    inside the document (at it, or the one below), and decodes what it decodes without reuse."""
    stream = setup[2]
    prompts = [stream[:doc_len] + q for q in questions(stream, 4)]
    want = run_one_by_one(engine(setup, prefix_cache=False), prompts)
    eng = engine(setup)
    got = run_one_by_one(eng, prompts)
    assert [c.num_cached_tokens for c in got] == [0] + [2 * INTERVAL] * 3
    assert_same(got, want)
    assert eng.cache.prefix.num_hit_tokens == 3 * 2 * INTERVAL and eng.cache.prefix.num_queried_tokens == sum(map(len, prompts))
    assert_nothing_held(eng)


def test_a_conversation_resumes_from_the_end_of_its_last_prompt(setup):
    """A second turn whose prompt extends the first (off any page or interval boundary) resumes
    at the first prompt's end through its tail snapshot; an identical repeat resumes below it."""
    stream = setup[2]
    first = stream[:150]
    second = first + stream[3000:3040]
    prompts = [first, second, first]
    want = run_one_by_one(engine(setup, prefix_cache=False), prompts)
    eng = engine(setup)
    got = run_one_by_one(eng, prompts)
    assert [c.num_cached_tokens for c in got] == [0, 150, INTERVAL]
    assert_same(got, want)
    assert_nothing_held(eng)


def test_evaluation_mode_reuse_is_bitwise(setup):
    """batch_invariant=True: logprobs with reuse are the same bits as from a cold cache, one by
    one and all at once. (The reference is a cold prefix-caching engine, not prefix_cache=False:
    both cut prompts at the snapshot positions, and the evaluation mode is not bitwise
    invariant to where a long prompt is cut; measured, cutting a 302-token prompt at 256 or
    not changes top logprobs in the 7th digit.)"""
    stream = setup[2]
    prompts = [stream[: 2 * INTERVAL + 37] + q for q in questions(stream, 4)]
    want = [engine(setup, batch_invariant=True).generate([p], PARAMS)[0] for p in prompts]
    eng = engine(setup, batch_invariant=True)
    got = run_one_by_one(eng, prompts)
    assert [c.num_cached_tokens for c in got] == [0] + [2 * INTERVAL] * 3
    assert_same(got, want, bitwise=True)
    got = eng.generate(prompts, PARAMS)  # all resume from the snapshots above, batched together
    assert all(c.num_cached_tokens == 2 * INTERVAL for c in got)
    assert_same(got, want, bitwise=True)
    assert_nothing_held(eng)


def test_eviction_under_pressure_never_changes_an_output(setup):
    """Two snapshots' budget and a pool a few requests fill: cached pages and snapshots are
    evicted again and again, and the outputs stay those of no reuse."""
    stream = setup[2]
    docs = [stream[1000 * d : 1000 * d + INTERVAL + 20] for d in range(3)]
    prompts = [docs[d] + q for d, q in zip([0, 0, 1, 1, 2, 2, 0, 1, 0], questions(stream, 9))]
    want = run_one_by_one(engine(setup, prefix_cache=False), prompts)
    eng = engine(setup, max_seqs=2, max_model_len=256, memory_bytes=40 * PAGE * 1536 + 2 * 81920,
                 prefix_snapshot_bytes=2 * 81920)
    assert eng.cache.plan.num_pages == 40 and eng.cache.prefix.max_snapshots == 2
    got = [generate_checking_pages(eng, [p], PARAMS)[0] for p in prompts]
    print(f"evicted {eng.cache.prefix.num_evicted_pages} pages, {eng.cache.prefix.num_evicted_snapshots} snapshots; "
          f"cached tokens {[c.num_cached_tokens for c in got]}")
    assert eng.cache.prefix.num_evicted_pages > 0 and eng.cache.prefix.num_evicted_snapshots > 0
    assert any(c.num_cached_tokens for c in got)
    assert_same(got, want)
    assert_nothing_held(eng)


def test_eviction_never_takes_a_page_a_running_request_holds(setup):
    """A held page with a stale place in the eviction order: document D's last page became an
    unheld leaf when D's first request finished; B, D again, resumes from D's snapshot at 64 and
    takes that page back (its own copy of the same tokens is dropped), and while B decodes it
    stays a leaf (B never fills its next page). A later unheld leaf (document E) is what may go
    when C needs pages while B runs: the pool must evict E's pages, never D's, and B and C must
    decode what they decode without reuse."""
    stream = setup[2]
    doc, other, c_prompt = stream[: 6 * PAGE], stream[1000 : 1000 + 3 * PAGE], stream[3000:3240]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    want = run_one_by_one(engine(setup, prefix_cache=False), [doc, c_prompt], params)
    eng = engine(setup, max_seqs=2, max_model_len=256, memory_bytes=24 * PAGE * 1536 + 2 * 81920,
                 prefix_snapshot_bytes=8 * 81920, prefix_snapshot_interval=64)
    assert eng.cache.plan.num_pages == 24
    one = SamplingParams(max_tokens=1, temperature=0)
    eng.generate([doc], one)  # D's 6 pages cached, its last one an unheld leaf in the eviction order
    eng.generate([other], one)  # E's 3 pages cached after it
    b = eng.add_request(doc, params)
    while not b.output_ids:
        eng.step()
    last = b.prefix_chain[-1]
    assert b.num_cached_tokens == 64 and len(b.prefix_chain) == 6 and last.refs == 1 and last.is_leaf
    assert any(n is last for _, _, n in eng.cache.prefix.evictable), "D's last page should still have its old place"
    c = eng.add_request(c_prompt, params)
    while eng.has_work():
        eng.step()
        free = set(eng.cache.free_pages)
        for r in eng.scheduler.running:
            assert all(n.parent is not None and n.page not in free for n in r.prefix_chain), "a held page was evicted"
            assert not free & set(r.pages)
    assert eng.cache.prefix.num_evicted_pages > 0, "C should have needed E's cached pages"
    assert_same([b.completion(), c.completion()], want)
    assert_nothing_held(eng)


def test_preemption_with_shared_pages(setup):
    """Eight requests over one document in a pool too small for all: they share the document's
    pages, are preempted and resume (from snapshots) and still decode what they decode alone."""
    stream = setup[2]
    doc = stream[: INTERVAL + 40]
    prompts = [doc + q for q in questions(stream, 8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    want = run_one_by_one(engine(setup, prefix_cache=False), prompts, params)
    eng = engine(setup, max_seqs=8, max_model_len=256, memory_bytes=30 * PAGE * 1536 + 8 * 81920,
                 prefix_snapshot_bytes=32 * 81920)
    eng.generate(prompts[:1], params)  # the document is cached: the others share its pages
    got = generate_checking_pages(eng, prompts, params)
    print(f"preemptions {eng.num_preemptions}, cached tokens {[c.num_cached_tokens for c in got]}")
    assert eng.num_preemptions > 0
    assert all(c.num_cached_tokens >= INTERVAL for c in got)
    assert_same(got, want)
    assert_nothing_held(eng)


def test_prompt_logprobs_bound_the_reuse(setup):
    """A request asking for prompt logprobs from position p resumes no later than p, and gets
    every prompt logprob it asked for, equal to those without reuse."""
    stream = setup[2]
    prompt = stream[: 2 * INTERVAL + 20]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs_start=INTERVAL + 10)
    want = engine(setup, prefix_cache=False).generate([prompt], params)[0]
    eng = engine(setup)
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    got = eng.generate([prompt], params)[0]
    assert got.num_cached_tokens == INTERVAL
    assert [e.token_id for e in got.prompt_logprobs] == [e.token_id for e in want.prompt_logprobs] == prompt[INTERVAL + 10 :]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got.prompt_logprobs, want.prompt_logprobs)) < LOGPROB_TOL


def test_bad_snapshot_interval_is_refused(setup):
    with pytest.raises(ValueError, match="prefix_snapshot_interval=100 must be a positive multiple of 64"):
        engine(setup, prefix_snapshot_interval=100)
