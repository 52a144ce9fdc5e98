"""The decoding strategies (sala/engine/decoding.py, sala/engine/medusa_decoding.py) on their
own: the decode rows plain decoding builds, against a naive reading of the requests' pages; what
each strategy's step emits and how far it advances each request; Medusa's choice of step and
what it refuses; and a verify step's acceptance and commit given logits that make a known path
acceptable: the path's tokens and the bonus token come out, only the path's K/V rows and the
requests' state slots are written, and the counts per depth are the path's."""
import pytest
import torch

from sala.engine.decoding import PlainDecoding, StepOutput
from sala.sampling import InvalidParam
from tests.engine.parts import build, prefill, request, timed


def test_plain_decode_rows_are_each_requests_next_position():
    p = build(max_seqs=4)
    reqs = [request(5), request(20, first=40), request(33, first=60)]
    prefill(p, reqs)
    ids, ctx = p.decoding.inputs(reqs)
    assert ids.tolist() == [r.output_ids[-1] for r in reqs]
    assert ctx.positions.tolist() == [r.num_computed for r in reqs] == [5, 20, 33]
    assert ctx.slot_mapping.tolist() == [r.pages[n // 16] * 16 + n % 16 for r, n in zip(reqs, (5, 20, 33))]
    assert ctx.context_lens.tolist() == [6, 21, 34] and ctx.state_slots.tolist() == [r.state_slot for r in reqs]
    width = max(len(r.pages) for r in reqs)
    assert ctx.block_tables.tolist() == [r.pages + [p.cache.scratch_page] * (width - len(r.pages)) for r in reqs]
    assert p.decoding.for_step(reqs) is p.decoding and p.decoding.run_compiled(ids, ctx, reqs) is None  # compile=False


def test_plain_emit_advances_each_request_and_samples_only_new_positions():
    p = build(max_seqs=4)
    fresh, recomputing = request(6, logprobs=2), request(6, first=20)
    prefill(p, [fresh, recomputing])
    recomputing.output_ids += [9, 9]  # it generated two more before a preemption: decoding recomputes them
    logits = torch.zeros(2, p.model.config.vocab_size)
    logits[:, 42] = 3.0
    gained = p.decoding.emit([fresh, recomputing], StepOutput(torch.zeros(2), None, decoded=logits), set())
    assert [g.request for g in gained] == [fresh] and gained[0].tokens == [42]
    assert gained[0].logprobs[0].token_id == 42 and len(gained[0].logprobs[0].top) == 2
    assert (fresh.num_computed, recomputing.num_computed) == (7, 7) and recomputing.num_computed < recomputing.num_tokens


def test_compiled_plain_decoding_has_one_graph():
    assert len(build(compile=True).decoding.compiled_steps()) == 1 and not build().decoding.compiled_steps()
    assert not build(compile=True, batch_invariant=True).decoding.compiled_steps()  # the evaluation mode never compiles


def test_medusa_chooses_its_step_by_the_policy_and_refuses_what_it_cannot_honour():
    p = build(medusa=True, medusa_max_batch=1, max_seqs=4)
    medusa = p.decoding
    assert list(medusa.verifies) == [6]  # heads with no measured acceptance: their own tree is the one candidate
    tree = medusa.verifies[6].tree
    one, two = [request(4)], [request(4), request(4)]
    assert medusa.for_step(one) is medusa.plain_step  # untimed: plain decoding, its own steps timed first
    timed(medusa, {0: 2.0, 6: 2.5})  # 1 token / 2.0 ms against 2 expected / 2.5 ms
    verify = medusa.for_step(one)
    assert verify is medusa.verifies[6] and (verify.lookahead, verify.rows) == (tree.max_depth, tree.num_nodes) == (3, 7)
    assert medusa.for_step(two) is medusa.plain_step and medusa.for_step([]) is medusa.plain_step
    assert (medusa.plain_step.lookahead, medusa.plain_step.rows) == (0, 1) and isinstance(medusa.plain, PlainDecoding)
    with pytest.raises(InvalidParam, match="logit_bias is not supported with Medusa"):
        medusa.admit(request(4, logit_bias={3: 1.0}))
    r = request(4)
    medusa.admit(r)
    assert r.spec is not None and r.spec.verify_steps == 0


def test_auto_verifies_only_the_batches_a_compiled_graph_accepts():
    """Where verify steps compile (CPU), "auto" verifies greedy batches and batches sampled by
    temperature alone; a batch with a top-p, top-k or logprobs request decodes plainly (its
    acceptance would run eagerly, costlier than the forward), whatever the times say. A fixed tree
    verifies them all, and so does "auto" where nothing compiles (every kind of step is then eager)."""
    medusa = build(medusa=True, compile=True, max_seqs=4).decoding
    timed(medusa, {0: 2.0, 6: 2.5})
    whole = medusa.verifies[6]
    assert medusa.for_step([request(4)]) is whole and medusa.for_step([request(4), request(4, temperature=0.7)]) is whole
    for odd in ({"top_p": 0.9}, {"top_k": 5}, {"logprobs": 1}):
        assert medusa.for_step([request(4), request(4, temperature=0.7, **odd)]) is medusa.plain_step, odd
    assert medusa.for_step([request(4, logprobs=1)]) is medusa.plain_step
    fixed = build(medusa=True, compile=True, max_seqs=4, medusa_nodes=6).decoding
    assert fixed.for_step([request(4, temperature=0.7, top_p=0.9)]) is fixed.verifies[6]
    eager = build(medusa=True, max_seqs=4).decoding
    timed(eager, {0: 2.0, 6: 2.5})
    assert eager.for_step([request(4, temperature=0.7, top_p=0.9)]) is eager.verifies[6]


def test_where_verify_steps_compile_a_step_with_prompt_chunks_decodes_plainly():
    """A step that prompt chunks join runs eagerly; where verify steps compile (CPU), an eager
    verify with its acceptance costs several times a compiled one, so such a step decodes plainly,
    with "auto" or a fixed tree, and starts a run of plain steps in the choice (the verify step after
    it is not measured: its drafts are a token old). Where nothing compiles it verifies as any other."""
    from sala.engine.tree_choice import SETTLE

    medusa = build(medusa=True, compile=True, max_seqs=4).decoding
    timed(medusa, {0: 2.0, 6: 2.5})
    whole = medusa.verifies[6]
    for _ in range(SETTLE + 1):
        assert medusa.for_step([request(4)]) is whole
    assert medusa.choice.run == SETTLE
    assert medusa.for_step([request(4)], prompts=True) is medusa.plain_step and medusa.choice.current[2] == 0
    assert medusa.for_step([request(4)]) is whole and medusa.choice.run == 0
    fixed = build(medusa=True, compile=True, max_seqs=4, medusa_nodes=6).decoding
    assert fixed.for_step([request(4)], prompts=True) is fixed.plain_step and fixed.for_step([request(4)]) is fixed.verifies[6]
    eager = build(medusa=True, max_seqs=4).decoding
    timed(eager, {0: 2.0, 6: 2.5})
    assert eager.for_step([request(4)], prompts=True) is eager.verifies[6]


def test_a_verify_after_plain_steps_takes_each_depth_from_the_head_drafting_its_token():
    """Drafts are made for the tokens after a request's last one (head k: the k + 1st); a plain
    step decodes one of them without drafting, so after p plain steps depth d of the tree takes
    head d - 1 + p's top-k (the last head's where that is past the last), and after a verify
    step the heads' new drafts as they are."""
    p = build(medusa=True, max_seqs=4)
    medusa = p.decoding
    timed(medusa, {0: 2.0, 6: 2.5})
    verify = medusa.verifies[6]
    reqs = [request(10), request(21, first=50)]
    for r in reqs:
        medusa.admit(r)
    prefill(p, reqs)
    drafted = [r.drafts.clone() for r in reqs]
    heads = drafted[0].shape[0]

    def tree_tokens(behind: int) -> list[list[int]]:
        """Each request's tree tokens, naively: the root, then each head's top-k `behind` heads on."""
        out = []
        for r, d in zip(reqs, drafted):
            candidates = [r.output_ids[-1]] + [t for k in range(heads) for t in d[min(k + behind, heads - 1)].tolist()]
            out.append([candidates[i] for i in verify.tree.candidate_indices.tolist()])
        return out

    assert verify.inputs(reqs)[0].view(2, -1).tolist() == tree_tokens(0)
    for behind in (1, 2, 3, 4):
        with medusa.choice.forcing(0):  # decoded plainly, as a probe is
            batch = p.scheduler.schedule()
        assert batch.decoding is medusa.plain_step and batch.decodes == reqs
        for g in batch.decoding.emit(reqs, p.runner.run(batch), set()):
            g.request.output_ids += g.tokens
        assert verify.inputs(reqs)[0].view(2, -1).tolist() == tree_tokens(behind), behind
    batch = p.scheduler.schedule()
    assert batch.decoding is verify
    for g in verify.emit(reqs, p.runner.run(batch), set()):
        g.request.output_ids += g.tokens
    drafted = [r.drafts.clone() for r in reqs]
    assert verify.inputs(reqs)[0].view(2, -1).tolist() == tree_tokens(0)


def test_verify_emits_the_acceptable_path_then_the_bonus_and_commits_only_it():
    p = build(medusa=True, max_seqs=4)
    medusa, cache = p.decoding, p.cache
    timed(medusa, {0: 2.0, 6: 2.5})
    verify = medusa.verifies[6]
    tree = verify.tree
    reqs = [request(10), request(21, first=50)]
    for r in reqs:
        medusa.admit(r)
    prefill(p, reqs)
    assert all(r.drafts is not None for r in reqs)
    batch = p.scheduler.schedule()
    assert batch.decoding is verify and batch.decodes == reqs and not batch.prefills
    out = p.runner.run(batch)
    t, vocab = tree.num_nodes, p.model.config.vocab_size
    tokens = out.ids.view(2, t)
    # Request 0 keeps the deepest path (root, then one node a depth); request 1 nothing past its root.
    path = max((row[row >= 0] for row in tree.retrieve_indices), key=len).tolist()
    logits = torch.zeros(2, t, vocab)
    bonus = [min(set(range(vocab)) - set(tokens[i].tolist())) for i in range(2)]  # no node's token: no child is acceptable
    for i in range(2):
        logits[i, :, bonus[i]] = 1.0
    for node in path[1:]:
        logits[0, tree.parents[node], tokens[0, node]] = 5.0
    out.decoded = logits.view(2 * t, vocab)
    before = {i: pages.data.clone() for i, pages in cache.k.items()}
    states = {i: s.clone() for i, s in cache.states.items()}
    computed = [r.num_computed for r in reqs]
    gained = verify.emit(reqs, out, set())
    assert gained[0].tokens == tokens[0, path[1:]].tolist() + [bonus[0]] and gained[1].tokens == [bonus[1]]
    assert [r.num_computed - c for r, c in zip(reqs, computed)] == [len(path), 1]
    written = {cache.row(r, q) for r, c in zip(reqs, computed) for q in range(c, r.num_computed)}
    for i, k in cache.k.items():
        changed = {row for row in (k.data != before[i]).flatten(0, 1).flatten(1).any(-1).nonzero()[:, 0].tolist()
                   if row < cache.scratch_row}
        assert changed <= written and changed, (changed, written)
    for i, s in cache.states.items():
        assert (s != states[i])[:-1].flatten(1).any(-1).nonzero()[:, 0].tolist() == sorted(r.state_slot for r in reqs)
    assert reqs[0].spec.accepted_per_depth == [1] * (len(path) - 1) and reqs[1].spec.accepted_tokens == 0
    assert medusa.totals.verify_steps == 2 and medusa.totals.accepted_tokens == len(path) - 1
    assert medusa.totals.draft_tokens == 2 * (t - 1)
