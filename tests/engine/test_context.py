"""The step context (sala/engine/context.py) on its own: padding rows read and write only the
scratch page and state slot (so a padded step computes the same logits for its real rows and
leaves every other row and slot of the pools as the unpadded step does), the persistent
context's row views and copies, the sizes derived from it, the tree's commit rows against a
naive loop, and its round trip as a pytree (what a compiled step takes)."""
import copy

import torch
from torch.utils import _pytree as pytree

from sala.engine.context import Span, StepContext, TreeStep, decode_padding, padding_values
from tests.engine.parts import build, prefill, request


def decoding_parts(n: int = 3):
    """Parts with n requests past their prompts (of different lengths), ready to decode."""
    p = build(max_seqs=4)
    reqs = [request(5 + 7 * i, first=1 + 11 * i) for i in range(n)]
    prefill(p, reqs)
    return p, reqs


def pools(cache) -> dict:
    return copy.deepcopy({"k": {i: t.data for i, t in cache.k.items()}, "v": {i: t.data for i, t in cache.v.items()},
                          "states": cache.states})


def test_padding_rows_change_nothing_but_scratch():
    p, reqs = decoding_parts()
    ids, ctx = p.decoding.inputs(reqs)
    before = pools(p.cache)
    with torch.inference_mode():
        logits = p.runner.forward(ids, copy.copy(ctx))[1]
        plain = pools(p.cache)
        for name, tensors in before.items():  # back to before the step
            for i, t in tensors.items():
                (p.cache.states[i] if name == "states" else getattr(p.cache, name)[i].data).copy_(t)
        padded = ctx.padded(rows=6, width=ctx.block_tables.shape[1] + 2)
        padded_logits = p.runner.forward(torch.cat([ids, ids.new_zeros(3)]), padded)[1]
    assert padded.block_tables.shape == (6, ctx.block_tables.shape[1] + 2)
    assert padded.state_slots[3:].eq(p.cache.scratch_slot).all() and padded.slot_mapping[3:].eq(p.cache.scratch_row).all()
    torch.testing.assert_close(padded_logits[:3], logits, rtol=1e-5, atol=1e-5)
    after = pools(p.cache)
    scratch = {"k": p.cache.scratch_page, "v": p.cache.scratch_page, "states": p.cache.scratch_slot}
    for name in after:
        for i in after[name]:
            keep = torch.arange(after[name][i].shape[0]) != scratch[name]
            torch.testing.assert_close(after[name][i][keep], plain[name][i][keep], rtol=1e-5, atol=1e-5)


def test_persistent_context_rows_and_copies():
    p, reqs = decoding_parts()
    _, ctx = p.decoding.inputs(reqs)
    big = decode_padding(p.cache, rows=8, width=5)
    ctx.copy_into(big.rows(4))
    assert torch.equal(big.positions[:3], ctx.positions) and torch.equal(big.state_slots[:3], ctx.state_slots)
    w = ctx.block_tables.shape[1]
    assert torch.equal(big.block_tables[:3, :w], ctx.block_tables) and big.block_tables[:3, w:].eq(p.cache.scratch_page).all()
    values = padding_values(p.cache)
    for name, value in values.items():  # rows past the copy keep what padding holds
        assert getattr(big, name)[3:].eq(value).all(), name
    view = big.rows(2)
    view.positions.fill_(77)  # a view: the persistent context a captured graph reads changes with it
    assert big.positions[:2].eq(77).all() and big.num_decode == 8 and view.num_decode == 2


def test_derived_sizes_and_tree_commit_rows():
    p, _ = decoding_parts(1)
    kv_rows = torch.arange(24).view(2, 12) + 100
    tree = TreeStep(depths=torch.tensor([0, 1, 1, 2]), ancestor_mask=torch.eye(4, dtype=torch.bool), kv_rows=kv_rows,
                    kv_lens=torch.tensor([3, 7]), state_slots=torch.tensor([0, 1]))
    assert (tree.num_requests, tree.num_nodes, tree.num_rows) == (2, 4, 8)
    rows = tree.path_rows(torch.tensor([2, 3]), width=4, scratch_row=-5)
    naive = [[int(kv_rows[r, lens + j]) if j < kept else -5 for j in range(4)]
             for r, (lens, kept) in enumerate([(3, 2), (7, 3)])]
    assert rows.tolist() == naive
    ctx = StepContext(cache=p.cache, positions=torch.zeros(5, dtype=torch.long), slot_mapping=torch.zeros(5, dtype=torch.long),
                      prefills=[Span(start=0, length=3, past=0, state_slot=2), Span(start=3, length=2, past=4, state_slot=0)])
    assert ctx.num_decode == 0 and ctx.prefill_state_slots.tolist() == [2, 0] and ctx.prefill_lengths.tolist() == [3, 2]


def test_a_context_is_a_pytree_of_its_tensors():
    p, reqs = decoding_parts()
    _, ctx = p.decoding.inputs(reqs)
    leaves, spec = pytree.tree_flatten(ctx)
    assert len([t for t in leaves if isinstance(t, torch.Tensor)]) == 5 and all(t is None or isinstance(t, torch.Tensor)
                                                                               for t in leaves)  # no tree
    back = pytree.tree_unflatten(leaves, spec)
    assert back.cache is ctx.cache and back.batch_invariant == ctx.batch_invariant
    for name in padding_values(p.cache):
        assert getattr(back, name) is getattr(ctx, name)
