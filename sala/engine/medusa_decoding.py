"""Medusa decoding: the strategy (sala/engine/decoding.py) of an engine given Medusa heads.

A verify step puts each decoding request's draft tree in place of its decode row: root = its
last token, nodes = the heads' top-k candidates the tree's paths pick (sala/medusa/tree.py),
T rows at positions num_computed + depth. `TreeVerify.inputs` builds that step's context (a
TreeStep: sparse layers attend over the committed K/V plus each node's ancestors, lightning
layers run the tree from the slot's state; neither writes the pools). After the forward,
`TreeVerify.emit` keeps the longest acceptable path of each tree (the acceptance math,
sala/medusa/accept.py: greedy is lossless, sampling uses typical acceptance), commits it
(`settle`: its K/V into the pages and the lightning states advanced along it,
sala/engine/paged.py commit_tree), takes the bonus token at its last node and the heads'
drafts there for the next tree, and counts.

On CPU a verify step with no prompt chunk runs compiled (request count, committed width and tree
size dynamic): for a batch of greedy requests without logprobs the whole step, forward,
acceptance, commit, bonus token and drafts, is one graph (`CompiledGreedyVerify`), read back
once; so is it for a batch with sampled requests whose only sampling control is their
temperature (`CompiledSampledVerify`); for any other batch the forward is (`CompiledTreeVerify`)
and acceptance runs eagerly.
Steps with prompt chunks run eagerly. Where a lightning layer keeps BF16 states its
verify scans the tree depth by depth (sala/lightning_tree.py), a loop the graph unrolls: then
each tree has a forward graph of its own, and greedy batches accept eagerly too.

Which tree a step verifies, if any, is `TreeChoice`'s (sala/engine/tree_choice.py): by default
the timed candidate with the most expected tokens per second, by running estimates of each
candidate's step time and of the heads' acceptance, kept from the steps the engine takes and
across starts on disk (sala/engine/step_costs.py); medusa_max_batch caps the batch
sizes that may verify. A plain step of a Medusa engine drafts only for the prompts it ends
(their first tree); the requests it decodes keep their drafts, which a verify after plain steps
reads a head further out for each token decoded since (`tree_drafts`): on tiny-sala's heads at
batch 1 with the 4-node tree it keeps 1.87 tokens where a verify after a verify keeps 2.09 (and
1.08 with the drafts unshifted). Greedy output
does not depend on the choice (every step is lossless); a sampled request's tokens do (typical
acceptance and plain sampling draw differently), as with vLLM's disable_by_batch_size.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from sala import structured
from sala.engine import paged
from sala.engine.config import EngineConfig
from sala.engine.context import StepContext, TreeStep
from sala.engine.decoding import Emitted, PlainDecoding, StepOutput
from sala.engine.graphs import CompiledStep, rows_dynamic
from sala.engine.request import Request, SpecStats
from sala.engine.stats import SpeculationStats
from sala.engine.step_costs import StepCosts, cost_key
from sala.engine.tree_choice import TreeChoice, candidate_sizes
from sala.medusa import accept as medusa_accept
from sala.medusa.accept import Settled, TreeIndices, tempered_probs
from sala.medusa.tree import MedusaTree, build_tree, by_acceptance, expected_accept_length
from sala.sampling import InvalidParam, SamplingParams, inverse_cdf, sample, token_logprobs, uniforms

log = logging.getLogger(__name__)
WARMUP_TOKENS, WARMUP_RUNS = 64, 16  # a warmup request's prompt and output tokens; the most runs a class and kind takes

# What a verify step accepts by (`step_kind`).
GREEDY = "greedy"  # greedy requests without logprobs or a grammar: argmaxes alone
TEMPERED = "tempered"  # ... and sampled ones whose only control is their temperature: typical acceptance
EAGER = "eager"  # any other batch: acceptance with every control, eagerly


def step_kind(reqs: list[Request], vocab: int) -> str:
    """GREEDY, TEMPERED or EAGER for a batch of these requests: on CPU the first two verify in
    one compiled graph each (CompiledGreedyVerify, CompiledSampledVerify)."""
    if any(r.params.logprobs is not None or r.grammar is not None for r in reqs):
        return EAGER
    if all(r.params.greedy for r in reqs):
        return GREEDY
    return TEMPERED if all(r.params.greedy or (r.params.top_p >= 1 and not 0 < r.params.top_k < vocab)
                           for r in reqs) else EAGER


class MedusaDecoding:
    """Medusa heads serving an engine: each step's choice of tree (or none), the drafts, the counters."""

    def __init__(self, config: EngineConfig, heads, runner):
        model, cache = runner.model, runner.cache
        param = next(model.parameters())
        self.heads = heads.to(device=cache.device, dtype=param.dtype if param.is_floating_point() else torch.float32)
        self.config, self.model, self.cache = config, model, cache
        self.totals = SpecStats()  # over all requests
        acceptance = heads.config.acceptance
        order = by_acceptance(heads.config.tree, acceptance)
        sizes = candidate_sizes(config.medusa_nodes, len(order), bool(acceptance))
        compiled = config.compiled and cache.device.type == "cpu"
        # One pair of graphs serves every tree unless a layer scans trees depth by depth (BF16 states):
        # then each tree has a forward graph of its own and greedy batches accept eagerly, as inductor
        # miscompiled the greedy verify graph's commit of BF16 node states (states off by ~25 after one
        # step; the same graph through aot_eager is exact).
        shared = compiled and all(s.dtype == torch.float32 for s in cache.states.values())
        graphs = (CompiledTreeVerify(config, model), CompiledGreedyVerify(self), CompiledSampledVerify(self)) if shared else None
        self.verifies = {}
        for n in sizes:
            tree = build_tree(order[:n], heads.config.topk, heads.config.num_heads).to(cache.device)
            own = (CompiledTreeVerify(config, model), None, None) if compiled and not shared else None
            self.verifies[n] = TreeVerify(self, tree, graphs or own, levels=not shared)
        fixed = None if config.medusa_nodes == "auto" else config.medusa_nodes
        self.costs = StepCosts(cost_key(config, heads.config, param.dtype)) if fixed is None else None
        times, kept = self.costs.load() if self.costs else ([], [])
        self.choice = TreeChoice(prior={n: expected_accept_length(acceptance, order[:n]) if acceptance else None
                                        for n in sizes},
                                 max_batch=config.medusa_max_batch, fixed=fixed, step_ms=times, acceptance=kept)
        self.plain = PlainDecoding(config, runner)
        self.plain_step = PlainStep(self)
        # Where verify steps run compiled, "auto" verifies only the batches a graph accepts (greedy, or
        # sampled by temperature alone): eager acceptance costs more than the forward (at batch 1, 4
        # nodes: 3.8 ms against 3.4), and a grammar walks every node of the tree.
        self.compiled_only = shared and config.medusa_nodes == "auto"
        # There a step with prompt chunks, which runs eagerly, decodes plainly (below, for_step).
        self.compiled = compiled
        self.vocab = model.config.vocab_size
        # The step in flight's kind (step_kind): for_step, the run, emit and took are one step's, in that order.
        self.kind = GREEDY

    def for_step(self, decoding: list[Request], prompts: bool = False):
        """The chosen tree's verify step for these decoding requests, or a plain one. Where verify
        steps run compiled, a step that prompt chunks may join decodes plainly: it runs eagerly,
        and there a verify with its acceptance costs a good part of what it gains (measured at
        batch 4, the 4-node tree, one prompt of 33 tokens: 10.1-10.4 ms against 7.7-8.3 for the
        plain step, where a compiled verify takes 2.5; the 4-node tree fixed ran 1.5-2.5% faster
        so, greedy and sampled, over three rounds)."""
        if not decoding:
            return self.plain_step
        self.kind = step_kind(decoding, self.vocab)
        eager = prompts and self.compiled or self.compiled_only and self.kind == EAGER
        nodes = self.choice(len(decoding), self.kind, verifiable=not eager)
        return self.verifies[nodes] if nodes else self.plain_step

    def took(self, batch, seconds: float) -> None:
        """A decode step with no prompt work took `seconds`: it times its candidate (TreeChoice.timed),
        and the disk cache is written whenever that makes a candidate timed."""
        if batch.decodes and not batch.prefills and self.choice.timed(1e3 * seconds) and self.costs:
            self.costs.save(self.choice.step_ms(), self.choice.kept())

    def compiled_steps(self) -> list:
        graphs = {id(g): g for v in self.verifies.values() for g in (v.fast_verify, v.fast_greedy, v.fast_sampled)
                  if g is not None}
        return self.plain.compiled_steps() + list(graphs.values())

    def admit(self, req: Request) -> None:
        """Refuse what tree acceptance cannot honour: it judges drafts by the raw logits."""
        p = req.params
        if p.adjusts_logits or p.min_p:
            name = next(f for f, off in (("logit_bias", {}), ("min_tokens", 0), ("repetition_penalty", 1),
                                         ("presence_penalty", 0), ("frequency_penalty", 0), ("min_p", 0))
                        if getattr(p, f) != off)
            raise InvalidParam(name, f"{name} is not supported with Medusa decoding; serve without Medusa to use it")
        req.spec = SpecStats()

    def draft(self, reqs: list[Request], hidden: torch.Tensor | None) -> None:
        """Each request's next tree candidates [K, topk] from the heads' input at its row."""
        if reqs:  # most steps end no prompt: not even the inference-mode switch then
            with torch.inference_mode():
                for r, d in zip(reqs, self.heads.draft_tokens(hidden, self.model.lm_head)):
                    r.drafts, r.drafts_for = d, r.num_tokens + 1  # past the token the prompt's end draws

    def settle(self, tree: MedusaTree | TreeIndices, acc: medusa_accept.Accepted, ctx: StepContext,
               tokens: torch.Tensor, hidden: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After acceptance, in tensor ops alone (the compiled greedy graph runs it too): the
        accepted paths' K/V into the pages and the lightning states advanced along them, then the
        fields of a Settled (a plain tuple: what a compiled graph returns)."""
        dest = ctx.tree.path_rows(acc.lengths, tree.retrieve_indices.shape[1], self.cache.scratch_row)
        paged.commit_tree(self.model.model, ctx, acc.paths, acc.lengths, dest)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        drafts = self.heads.draft_tokens(hidden[rows, acc.last_nodes()], self.model.lm_head)
        return torch.cat([acc.lengths[:, None], tokens.gather(1, acc.paths.clamp(min=0)), bonus[:, None]], 1), drafts

    # ---------------------------------------------------------------- reporting
    def stats(self) -> SpeculationStats:
        t = self.totals
        return SpeculationStats(verify_steps=t.verify_steps, draft_tokens=t.draft_tokens, accepted_tokens=t.accepted_tokens,
                                trees=self.choice.table())

    def describe(self) -> str:
        """The choice in a line: what each batch size class verifies now, and why."""
        choice = self.choice
        if not choice.prior:
            return "Medusa never verifies (medusa_nodes=0)"
        cap = "" if choice.max_batch is None else f" while at most {choice.max_batch} requests decode"
        if choice.fixed is not None:
            return f"Medusa verifies the {choice.fixed}-node tree{cap}"
        rows = choice.table()
        if not rows:
            return f"Medusa decodes plainly until its steps are timed{cap}"
        return f"Medusa trees chosen from measured step costs{cap}: " + "; ".join(
            f"{t.kind} batches of {t.batch}+: " + (f"{t.nodes} nodes ({t.accept_length:.2f} tokens a step, {t.speedup:.2f}x)"
                                                    if t.nodes else "plain") for t in rows)

    # ---------------------------------------------------------------- warmup
    def warmup(self, engine, prompt: list[int], params: SamplingParams) -> None:
        """Compile the steps the engine serving these heads may take, and with medusa_nodes='auto'
        time them up front as traffic would (TreeChoice), through the engine's public API, which
        Engine.warmup keeps out of its counts: batches of 1, 2, 4, ... up to max_seqs (and
        medusa_max_batch) requests, greedy and sampled, until a batch size where no tree pays (a
        verify's cost grows with the batch faster than a plain step's). What the disk cache held
        takes no step."""
        sampled = replace(params, temperature=1.0, seed=0)
        if self.plain.fast_decode is not None:
            with self.choice.forcing(0):
                engine.generate([prompt], params)
            # Verify steps of one request and of several are two graphs (see CompiledTreeVerify), for greedy
            # batches and sampled ones (the whole step), and for batches asking for logprobs (the forward),
            # which "auto" never verifies there. Shared graphs compile on the largest tree, so that every
            # size is a new value of a dynamic one.
            graphs = {id(v.fast_verify): n for n, v in sorted(self.verifies.items()) if v.fast_verify is not None}
            kinds = (params, sampled) + (() if self.compiled_only else (replace(sampled, logprobs=0),))
            for n in graphs.values():
                with self.choice.forcing(n):
                    for batch in (1, 2) if self.config.max_seqs > 1 else (1,):
                        for p in kinds:
                            engine.generate([prompt] * batch, p)
        choice = self.choice
        if choice.fixed is not None or not choice.prior:
            return
        # What the warmup prompt's drafts keep says nothing of traffic's: the walk weighs the trees by
        # the acceptance as it was (the heads' validation figures, or what the disk cache kept). Its
        # requests are as long as traffic's (the cost of a verify grows with the context).
        acceptance = choice.kept()
        long_prompt = (prompt * WARMUP_TOKENS)[:WARMUP_TOKENS]
        cap = min(self.config.max_seqs, self.config.max_seqs if choice.max_batch is None else choice.max_batch)
        for n in (1 << i for i in range(cap.bit_length())):
            pays = False
            for p in (replace(params, max_tokens=WARMUP_TOKENS), replace(sampled, max_tokens=WARMUP_TOKENS)):
                kind = GREEDY if p.greedy else TEMPERED
                for _ in range(WARMUP_RUNS):
                    if choice.untimed(kind, n) is None:
                        break
                    engine.generate([long_prompt] * n, p)
                    choice.acceptance = {}
                    choice.learned(acceptance)
                pays |= any(t.nodes for t in choice.table() if (t.kind, t.batch) == (kind, n))
            if not pays:
                break
        log.info(self.describe())


class PlainStep:
    """A Medusa engine's plain step: plain decoding, and drafts for the prompts it ends."""

    lookahead, rows, drafts = 0, 1, True

    def __init__(self, medusa: MedusaDecoding):
        self.medusa, self.plain = medusa, medusa.plain
        self.inputs, self.run_compiled = self.plain.inputs, self.plain.run_compiled

    def emit(self, reqs: list[Request], out: StepOutput, eos_ids: set[int]) -> list[Emitted]:
        self.medusa.draft(out.sampled, out.hidden)
        return self.plain.emit(reqs, out, eos_ids)


class TreeVerify:
    """A verify step of one tree: each decoding request's draft tree in its rows, the accepted path kept."""

    drafts = True

    def __init__(self, medusa: MedusaDecoding, tree: MedusaTree, graphs, levels: bool):
        self.medusa, self.tree, self.cache = medusa, tree, medusa.cache
        self.lookahead, self.rows = tree.max_depth, tree.num_nodes
        self.levels = tree.levels if levels else None  # what a BF16-state layer's scan unrolls; computed once
        retrieve = tree.retrieve_indices
        # A compiled graph sizes every tree dimension dynamically, and a dimension of 1 would be
        # specialised on: a chain's single path is given twice (the first longest row wins anyway).
        self.indices = TreeIndices(tree.parents, retrieve if retrieve.shape[0] > 1 else retrieve.repeat(2, 1))
        self.links = structured.tree_links(tree.parents.tolist())  # what a grammar walks the tree by
        self.fast_verify, self.fast_greedy, self.fast_sampled = graphs or (None, None, None)
        self.page_offsets = torch.arange(self.cache.page_size, device=self.cache.device)

    def inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, StepContext]:
        """Each request's draft tree (R * T tokens) and the step context that verifies them."""
        cache, dev, tree = self.cache, self.cache.device, self.tree
        # Rows of every committed position and of the deepest path after them (the commit's destinations).
        width = max(r.num_computed for r in reqs) + tree.retrieve_indices.shape[1]
        pages = cache.pages_for(width)
        # A verify step's host work is a share of its cost on a small model: one tensor for the
        # per-request numbers, one for the page tables, each row contiguous.
        roots, computed, state_slots = torch.tensor([[r.last_token for r in reqs], [r.num_computed for r in reqs],
                                                     [r.state_slot for r in reqs]], device=dev)
        tables = torch.tensor([r.pages[:pages] + [cache.scratch_page] * (pages - len(r.pages[:pages])) for r in reqs],
                              device=dev)
        kv_rows = (tables[:, :, None] * cache.page_size + self.page_offsets).flatten(1)[:, :width].contiguous()
        tokens = torch.cat([roots[:, None], tree_drafts(reqs).flatten(1)], 1)[:, tree.candidate_indices]
        positions = (computed[:, None] + tree.depths).flatten()
        step = TreeStep(depths=tree.depths, ancestor_mask=tree.ancestor_mask, kv_rows=kv_rows, kv_lens=computed,
                        state_slots=state_slots, parents=tree.parents, levels=self.levels)
        return tokens.flatten(), StepContext(cache=cache, positions=positions,
                                             slot_mapping=torch.full_like(positions, cache.scratch_row), tree=step)

    def run_compiled(self, ids: torch.Tensor, ctx: StepContext, reqs: list[Request]) -> StepOutput | None:
        """Through the compiled graphs (CPU); None where there are none (or compiling failed)."""
        tokens = ids.view(len(reqs), -1)
        decided, kind = None, self.medusa.kind
        if kind == GREEDY and self.fast_greedy is not None:
            decided = self.fast_greedy(self.indices, tokens, ctx, self._room(reqs))
        elif kind == TEMPERED and self.fast_sampled is not None:
            dev = tokens.device
            # float32 whatever the request gave (an int temperature would be another graph to compile)
            temperature = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev)
            sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
            u = torch.zeros(len(reqs), dtype=torch.float64)
            u[sampled] = uniforms([reqs[i] for i in sampled])
            decided = self.fast_sampled(self.indices, tokens, ctx, self._room(reqs), temperature, u.to(dev))
        if decided is not None:  # None: compiling failed (or no such graph), accept eagerly
            return StepOutput(ids, ctx, decided=Settled(*decided))
        out = self.fast_verify(tokens, ctx) if self.fast_verify is not None else None
        if out is None:
            return None
        hidden, logits, ctx.tree.saved = out
        return StepOutput(ids, ctx, decoded=logits, decoded_hidden=hidden)

    def _within_grammars(self, reqs: list[Request], tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, T, V] with each node's row masked by what the request's grammar allows after
        the node's path (a copy; `logits` itself when no request has a grammar). Acceptance and the
        bonus token read these: a drafted token the grammar forbids is never kept, and greedy
        acceptance keeps exactly what constrained greedy decoding would choose."""
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not constrained:
            return logits
        t = self.tree.num_nodes
        mask = structured.bitmask(len(reqs) * t, logits.shape[-1])
        cpu_tokens = tokens.cpu()
        for i in constrained:
            structured.tree_masks(reqs[i].grammar, self.links, cpu_tokens[i], mask, i * t)
        rows = [i * t + j for i in constrained for j in range(t)]
        return structured.apply(logits.flatten(0, 1), mask, rows).view_as(logits)

    def _room(self, reqs: list[Request]) -> torch.Tensor:
        """[R] tokens each request may still generate: the most nodes its accepted path may keep."""
        return torch.tensor([r.params.max_tokens - len(r.output_ids) for r in reqs], device=self.cache.device)

    @torch.inference_mode()
    def emit(self, reqs: list[Request], out: StepOutput, eos_ids: set[int]) -> list[Emitted]:
        """Each request's accepted drafts, then its bonus token (with logprobs when asked for),
        its accepted path committed and its next tree drafted."""
        medusa, tree = self.medusa, self.tree
        medusa.draft(out.sampled, out.hidden)
        tokens = out.ids.view(len(reqs), tree.num_nodes)
        if out.decided is not None:  # greedy without logprobs: no path to score
            (emitted, drafts), paths = out.decided, None
        else:
            logits = out.decoded.view(len(reqs), tree.num_nodes, -1)
            allowed = self._within_grammars(reqs, tokens, logits)
            acc = medusa_accept.accept(tree, tokens, allowed, [r.params for r in reqs], self._room(reqs),
                                       medusa.config.typical_threshold, medusa.config.typical_alpha)
            bonus = torch.tensor(sample(allowed[torch.arange(len(reqs)), acc.last_nodes()], reqs, eos_ids),
                                 device=tokens.device)
            emitted, drafts = medusa.settle(tree, acc, out.context, tokens,
                                            out.decoded_hidden.view(len(reqs), tree.num_nodes, -1), bonus)
            paths = acc.paths.tolist()
        gained = []
        for i, (r, row) in enumerate(zip(reqs, emitted.tolist())):  # the step's one read-back
            n = row[0]
            r.num_computed += n
            r.drafts, r.drafts_for = drafts[i], r.num_tokens + n  # past the accepted drafts and the bonus
            accepted = row[2 : 1 + n] + [row[-1]]  # the accepted drafts (the root was emitted last step), the bonus
            for stats in (r.spec, medusa.totals):
                stats.record(n, tree.num_nodes - 1, tree.max_depth)
            scored = [None] * n
            if r.params.logprobs is not None:  # token j is scored by the logits of the node before it (eager path only)
                scored = token_logprobs(logits[i, paths[i][:n]], accepted, [r.params.logprobs] * n)
            gained.append(Emitted(r, accepted, scored))
        medusa.choice.observe(len(reqs), sum(len(g.tokens) - 1 for g in gained))
        return gained


class CompiledTreeVerify(CompiledStep):
    """A verify step with no prompt chunk: request count, committed width and tree size dynamic
    (the tree's buffers are inputs), so one graph serves every verify step. Returns the heads'
    input and the fp32 logits of every tree row, and what the commit needs (the context's
    tree.saved) as outputs: a batch with a sampled or logprobs request accepts eagerly."""

    what = "the tree-verify step"
    # A single request's tree is still T rows to every GEMM, so it is not padded to two (which
    # would double a compute-bound step): it gets its own graph, with every shape but the
    # committed width static.
    MIN_ROWS = 1

    def __init__(self, config: EngineConfig, model, *modules: torch.nn.Module):
        super().__init__(config, model, *modules)
        self.model = model

    def step(self, tokens: torch.Tensor, ctx: StepContext):
        return *self.forward(tokens, ctx), ctx.tree.saved

    def __call__(self, tokens: torch.Tensor, ctx: StepContext):
        return self.run(tokens, ctx, dynamic=self.dynamic(tokens, ctx))

    def forward(self, tokens: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' input and fp32 logits of the tree rows (tokens [R, T])."""
        hidden = self.model.model(tokens.flatten()[None], step=ctx)[0] / self.model.config.logit_divisor
        return hidden, self.model.lm_head(hidden).float()

    def dynamic(self, tokens: torch.Tensor, ctx: StepContext) -> list[tuple[torch.Tensor, int]]:
        """The sizes of the forward's inputs that change from step to step, once the committed
        width is padded to MIN_WIDTH (scratch-row columns, past every request's length)."""
        tree = ctx.tree
        if tree.kv_rows.shape[1] < self.MIN_WIDTH:
            extra = tree.kv_rows.new_full((tree.num_requests, self.MIN_WIDTH - tree.kv_rows.shape[1]), ctx.cache.scratch_row)
            tree.kv_rows = torch.cat([tree.kv_rows, extra], 1)
        return (rows_dynamic(tokens, tree.kv_rows, tree.kv_lens, tree.state_slots)
                + [(tree.kv_rows, 1), (tokens, 1), (ctx.positions, 0), (ctx.slot_mapping, 0), *tree_dynamic(tree)])


class CompiledGreedyVerify(CompiledTreeVerify):
    """A greedy batch's whole verify step as one graph: the forward, greedy acceptance (the
    longest path whose every token is its parent's argmax), then `MedusaDecoding.settle` with
    the argmax at the last accepted node as the bonus token; it returns StepOutput.decided.
    Eagerly the steps after the forward are ~20 small ops, costing more than the forward itself
    on a small model; as a second graph they cost a second call's overhead and took every
    layer's tree K/V as inputs (measured: 2.4 -> 1.6 ms a batch-1 step of a 4-node tree). The
    commit is the graph's only pool write (sparse_step leaves tree rows out of the pool), which
    inductor does in place: after a first write, it copied every pool whole (9x the step)."""

    what = "the greedy tree-verify step"

    def __init__(self, medusa: MedusaDecoding):
        super().__init__(medusa.config, medusa.model, medusa.heads)  # the graph drafts with the heads too
        self.medusa = medusa

    def step(self, indices: TreeIndices, tokens: torch.Tensor, ctx: StepContext, room: torch.Tensor):
        r, t = tokens.shape
        hidden, logits = (x.view(r, t, -1) for x in self.forward(tokens, ctx))
        acc = medusa_accept.accept_greedy(indices, tokens, logits, room)
        rows = torch.arange(r, device=tokens.device)
        return self.medusa.settle(indices, acc, ctx, tokens, hidden, logits[rows, acc.last_nodes()].argmax(-1))

    def __call__(self, indices: TreeIndices, tokens: torch.Tensor, ctx: StepContext, room: torch.Tensor):
        # Paths and their length in the retrieve indices.
        sizes = [(indices.parents, 0), (indices.retrieve_indices, 0), (indices.retrieve_indices, 1)]
        return self.run(indices, tokens, ctx, room, dynamic=self.dynamic(tokens, ctx) + rows_dynamic(room) + sizes)


class CompiledSampledVerify(CompiledGreedyVerify):
    """`CompiledGreedyVerify` for a batch with sampled requests whose only sampling control is
    their temperature (`step_kind` TEMPERED): typical acceptance at each request's temperature, the
    bonus token drawn at the last accepted node by the uniform the request's generator gave
    before the step (as `sample` would draw it after), greedy rows as in the greedy graph.
    Eagerly the acceptance, draw and commit after the forward cost more than the forward
    (measured at batch 1, 4 nodes: 3.8 ms against 3.4). top-k and top-p stay eager: each sorts
    every node's distribution (0.75 ms for 5 x 2048 on CPU)."""

    what = "the sampled tree-verify step"

    def step(self, indices: TreeIndices, tokens: torch.Tensor, ctx: StepContext, room: torch.Tensor,
             temperature: torch.Tensor, u: torch.Tensor):
        r, t = tokens.shape
        hidden, logits = (x.view(r, t, -1) for x in self.forward(tokens, ctx))
        config = self.medusa.config
        acc = medusa_accept.accept_tempered(indices, tokens, logits, temperature, room, config.typical_threshold,
                                            config.typical_alpha)
        last = logits[torch.arange(r, device=tokens.device), acc.last_nodes()]
        bonus = torch.where(temperature == 0, last.argmax(-1), inverse_cdf(tempered_probs(last, temperature), u))
        return self.medusa.settle(indices, acc, ctx, tokens, hidden, bonus)

    def __call__(self, indices: TreeIndices, tokens: torch.Tensor, ctx: StepContext, room: torch.Tensor,
                 temperature: torch.Tensor, u: torch.Tensor):
        sizes = [(indices.parents, 0), (indices.retrieve_indices, 0), (indices.retrieve_indices, 1)]
        return self.run(indices, tokens, ctx, room, temperature, u,
                        dynamic=self.dynamic(tokens, ctx) + rows_dynamic(room, temperature, u) + sizes)


def tree_drafts(reqs: list[Request]) -> torch.Tensor:
    """[R, K, topk]: for depth d + 1 of each request's tree (the d + 1st token after its last),
    the top-k of the head that drafted that token. Head k drafts token drafts_for + k; a plain
    step decodes a token without drafting, so after p of them (p = num_tokens - drafts_for) depth
    d + 1 takes head d + p's, and past the last head the last head's (drafted for another
    position: that only costs acceptance). Unshifted, each depth would be judged against the
    token after the one its head drafted."""
    drafts = torch.stack([r.drafts for r in reqs])
    behind = [r.num_tokens - r.drafts_for for r in reqs]
    if not any(behind):
        return drafts
    heads = drafts.shape[1]
    shift = torch.tensor([[min(k + p, heads - 1) for k in range(heads)] for p in behind], device=drafts.device)
    return drafts.gather(1, shift[:, :, None].expand_as(drafts))


def tree_dynamic(tree: TreeStep) -> list[tuple[torch.Tensor, int]]:
    """The tree's node count in its buffers: dynamic, so that one graph verifies trees of every size."""
    return [(tree.depths, 0), (tree.ancestor_mask, 0), (tree.ancestor_mask, 1), (tree.parents, 0)]
