"""The prefix cache (sala/engine/prefix.py) on its own, inside a cache pool: which pages enter
the trie and when, where a later request resumes (the deepest snapshot its tokens match, at
least one token left to compute), that it resumes with the snapshot's states and the shared
pages, that a held page is never evicted while unheld ones go leaves first, and the evaluation
mode's rule (resume only at multiples of the lightning chunk). Steps are "run" by advancing the
requests and writing known values into their state slots, as a forward would."""
from sala import lightning
from tests.engine.parts import build, request, with_pages

PAGE, INTERVAL = 16, 64


def prefix_parts(**settings):
    return with_pages(12, max_seqs=3, max_model_len=160, prefix_cache=True, prefix_snapshot_interval=INTERVAL,
                      prefix_snapshot_bytes=1 << 20, **settings)


def run_prompt(pool, r, mark: float) -> None:
    """r's prompt computed in chunks ending at each snapshot interval and at its end, its state
    slot holding `mark` + the position after each chunk (what a snapshot there must copy)."""
    hit = pool.match(r)
    pool.admit(r, hit)
    while r.num_computed < len(r.prompt_ids):
        end = min((r.num_computed // INTERVAL + 1) * INTERVAL, len(r.prompt_ids))
        assert pool.grow(r, end)
        r.num_computed = end
        for s in pool.states.values():
            s[r.state_slot].fill_(mark + end)
        pool.after_step([r])


def test_full_pages_enter_the_trie_and_a_match_resumes_at_the_deepest_snapshot():
    p = prefix_parts()
    pool, prefix = p.cache, p.cache.prefix
    first = request(100)  # snapshots at 64 (the interval) and at 100 (its prompt's end: a tail of 4 tokens)
    run_prompt(pool, first, mark=1000)
    assert prefix.num_snapshots == 2 and prefix.resumable_len(list(range(1, 101))) == 100
    same_start = request(90)  # tokens 1..90: matches the pages up to 80 but the snapshot only at 64
    hit = pool.match(same_start)
    assert hit.length == INTERVAL and [n.page for n in hit.nodes] == first.pages[:4] and hit.tail is None
    pool.admit(same_start, hit)
    assert same_start.pages == first.pages[:4] and same_start.num_computed == INTERVAL
    assert all(s[same_start.state_slot].eq(1000 + INTERVAL).all() for s in pool.states.values())
    whole = request(101)  # the first prompt and one token more: resumes from the tail at 100
    hit = pool.match(whole)
    assert hit.length == 100 and hit.tail is not None and len(hit.nodes) == 6
    pool.admit(whole, hit)
    assert whole.pages[:6] == first.pages[:6] and whole.pages[6] != first.pages[6]  # the tail's page is its own copy
    assert all(s[whole.state_slot].eq(1000 + 100).all() for s in pool.states.values())
    exact = request(100)  # the same prompt: its last token must be computed, so the snapshot at 64
    assert pool.match(exact).length == INTERVAL
    other = request(100, first=500)
    assert pool.match(other) is None


def test_held_pages_are_never_evicted_and_unheld_ones_go_leaves_first():
    p = prefix_parts()
    pool, prefix = p.cache, p.cache.prefix
    held = request(64)
    run_prompt(pool, held, mark=0)
    done = request(128, first=300)
    run_prompt(pool, done, mark=0)
    done_pages = list(done.pages)
    pool.free(done)
    assert prefix.num_evictable == 8 and pool.num_free_pages == 12 - 4 and not pool.free_pages
    assert prefix.evict(1) == [done_pages[-1]]  # the deepest page first: its successors go before a page
    assert prefix.evict(7) == done_pages[-2::-1] and prefix.num_evictable == 0  # never the running request's four
    assert prefix.match(request(65)).length == INTERVAL  # and still match


def test_evaluation_mode_resumes_only_at_multiples_of_the_lightning_chunk():
    assert INTERVAL % lightning.CHUNK_SIZE == 0
    p = prefix_parts(batch_invariant=True)
    pool = p.cache
    first = request(100)
    run_prompt(pool, first, mark=0)
    assert pool.match(request(101)).length == INTERVAL  # the prompt-end tail at 100 is not a chunk multiple
    assert build(prefix_cache=True, prefix_snapshot_interval=INTERVAL).cache.prefix.batch_invariant is False
