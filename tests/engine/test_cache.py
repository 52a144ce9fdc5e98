"""The cache pool (sala/engine/cache.py) on its own: the pools the memory plan and the cache
plan ask for, pages and state slots handed out and taken back all or nothing, and cached prefix
pages counted as free and taken back when a request needs them."""
import torch

from sala.engine.request import Request
from sala.kv import KVPlan
from tests.engine.parts import build, request, with_pages


def test_pools_follow_the_memory_and_cache_plans():
    model_config = build().model.config
    first, second = model_config.sparse_layers[:2]
    kv_plan = KVPlan.uniform(model_config, "fp32").with_units({first: "bf16"})
    p = build(kv_plan=kv_plan, max_seqs=4)
    pool, plan, c = p.cache, p.config.memory, model_config
    assert pool.k[first].data.dtype == torch.bfloat16 and pool.k[second].data.dtype == torch.float32
    assert pool.k[first].data.shape == (plan.num_pages + 1, 16, c.num_key_value_heads, c.head_dim)  # + the scratch page
    assert pool.states[c.lightning_layers[0]].shape[0] == plan.max_seqs + 1  # + the scratch slot
    assert pool.scratch_row == plan.num_pages * 16 and pool.scratch_slot == plan.max_seqs
    assert pool.pages_for(16) == 1 and pool.pages_for(17) == 2


def test_pages_and_slots_all_or_nothing():
    p = with_pages(6, max_seqs=2, max_model_len=96)
    pool = p.cache
    r = request(20)
    assert pool.can_admit(20)
    pool.admit(r)
    assert pool.grow(r, 20) and len(r.pages) == 2
    assert pool.rows(r, 14, 18).tolist() == [pool.row(r, q) for q in range(14, 18)]
    assert pool.rows(r, 15, 17).tolist() == [r.pages[0] * 16 + 15, r.pages[1] * 16]
    assert not pool.grow(r, 16 * 7) and len(r.pages) == 2  # 7 pages: more than there are, nothing taken
    assert pool.grow(r, 16 * 6) and pool.num_free_pages == 0 and not pool.can_admit(1)
    other = request(4)
    pool.admit(other)
    assert not pool.free_state_slots and not pool.can_admit(0)  # no state slot left
    for s in pool.states.values():  # a slot is handed out zeroed: a prompt starts from the empty state
        s[other.state_slot].fill_(3)
    filled = other.state_slot
    pool.free(r)
    pool.free(other)  # freed last, its slot (filled above) is the next one handed out
    assert sorted(pool.free_pages) == list(range(6)) and len(pool.free_state_slots) == 2 and r.pages == []
    again = request(4)
    pool.admit(again)
    assert again.state_slot == filled
    assert all(s[again.state_slot].eq(0).all() for s in pool.states.values())


def test_cached_pages_count_as_free_and_are_taken_back_when_needed():
    p = with_pages(6, max_seqs=2, max_model_len=96, prefix_cache=True, prefix_snapshot_interval=64)
    pool = p.cache
    done = request(48)  # three full pages once computed
    pool.admit(done)
    pool.grow(done, 48)
    done.num_computed = 48
    pool.after_step([done])
    pool.free(done)
    assert len(pool.free_pages) == 3 and pool.num_free_pages == 6 and pool.prefix.num_evictable == 3
    big = request(90, first=200)  # other tokens: needs all six pages, the cached three among them
    pool.admit(big)
    assert pool.grow(big, 90) and len(big.pages) == 6 and pool.prefix.num_evictable == 0
    assert pool.prefix.num_evicted_pages == 3
    pool.free(big)
    assert pool.flush_prefix() == 0 and len(pool.free_pages) == 6


def test_copy_page_copies_codes_and_scales():
    model_config = build().model.config
    p = build(kv_plan=KVPlan.uniform(model_config, "nvfp4"))
    pages = p.cache.k[model_config.sparse_layers[0]]
    assert pages.scale is not None
    pages.data[3] = torch.randint(0, 100, pages.data[3].shape).to(pages.data.dtype)
    pages.scale[3] = torch.rand(pages.scale[3].shape).to(pages.scale.dtype)
    p.cache.copy_page(3, 5)
    assert torch.equal(pages.data[5], pages.data[3]) and torch.equal(pages.scale[5], pages.scale[3])


def test_a_request_is_itself_in_the_pool():
    a, b = Request([1, 2], None, None, None), Request([1, 2], None, None, None)
    assert a != b and [a].count(b) == 0  # equal fields, two requests
