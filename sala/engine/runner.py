"""One engine step through the model: the scheduled tokens as one row, a step context, one forward.

`prepare` turns a Schedule into the model's inputs and a StepContext (sala/context.py): slot
mapping, page tables and context lengths of the decode rows, state slots, prompt spans. The
model's own mixers read it; this file never restates the layers.

With Medusa (`tree`), the decodes of a speculative step are tree verifies: the request's draft
tree (root = its last token, nodes = its drafts picked by the tree's candidate indices) takes T
rows at positions num_computed + depth, in a TreeStep context (sala/context.py); all T rows'
logits come back. The other steps run as without Medusa.

Decode-only steps take a fast path: on CPU the step is compiled with inductor (`compile=True`,
dynamic batch size and page count); on CUDA it is replayed from CUDA graphs captured at
bucketed batch sizes over persistent input buffers (padding rows write the scratch page and
state slot). Tree-verify steps with no prompt chunk are compiled the same way on CPU (dynamic
request count and committed length; the tree's shape is fixed per engine), so a verify step
competes with a compiled decode step, not an eager one. For a batch of greedy requests without
logprobs, what follows the forward (acceptance, commit, bonus token, next drafts) is a second
compiled graph (CompiledGreedySpeculation), read back once. Steps that carry prompt chunks run
eagerly through the same forward.

Batch invariance (engine.md, Determinism) is a mode, `batch_invariant=True`: a request's logits
must not depend on what else shares its step, nor on where its prompt was cut into chunks.
Three things would make them depend on it on CPU: MKL computes a matmul's rows in blocks of 4
and, in small matmuls, the rows left over after the last full block through a kernel whose
sums round differently, so the mode pads every step to a multiple of 8 rows; the chunked
lightning form sums in blocks counted from the start of each call, so the scheduler cuts
prompts only at multiples of that block (lightning.CHUNK_SIZE) and the mode runs each
request's prompt chunk as its own call, never as one padded batch (whose final states come
from a different formula); and compiled kernels are generated per shape, so the mode never
compiles. Attention over pages padded to the batch's widest needs nothing: masked keys add
exact zeros (tests/test_engine.py checks all of it bitwise).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from sala import sparse
from sala.context import Span, StepContext, TreeStep
from sala.engine.cache import CachePool
from sala.engine.request import Request
from sala.engine.scheduler import Schedule
from sala.engine.speculation import greedy_batch

log = logging.getLogger(__name__)
INVARIANT_ROWS = 8


def decode_inputs(ctx: StepContext, ids: torch.Tensor) -> list[torch.Tensor]:
    """A decode step's tensor inputs, in the order the fast paths take them."""
    return [ids, ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.context_lens, ctx.state_slots]


def padding_values(cache: CachePool) -> list[int]:
    """What a padding decode row holds, input by input: it reads and writes only the scratch
    page and state slot, so rows added to round a batch up change nothing."""
    return [0, 0, cache.scratch_row, cache.scratch_page, 1, cache.scratch_slot]


@dataclass
class StepRows:
    """Which rows of a step's logits mean what."""

    sampled: list[Request]  # a request per sampled row (the first len(sampled) logits rows)
    prompt_targets: list[tuple[Request, int]]  # (request, next prompt token) per prompt-logprob row (the rest)
    verified: list[Request] = field(default_factory=list)  # tree verify: R requests, R * T logits rows before the rest
    tree_tokens: torch.Tensor | None = None  # [R, T] the tokens verified
    context: StepContext | None = None  # a tree verify's context, for commit_tree
    hidden: torch.Tensor | None = None  # Medusa: the heads' input (hidden / logit divisor) of every logits row
    # A greedy batch's verify, accepted, committed and drafted inside the compiled step
    # (CompiledGreedySpeculation's emitted and drafts); the step then has no tree logits rows.
    speculated: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelRunner:
    def __init__(self, model, cache: CachePool, batch_invariant: bool = False, compile: bool = True, max_decode_batch: int = 32,
                 tree=None, medusa=None):
        self.model, self.cache, self.batch_invariant = model, cache, batch_invariant
        self.device = cache.device
        self.tree = tree  # a MedusaTree on the device: decodes are tree verifies
        self.medusa = medusa  # the MedusaHeads drafting the trees
        self.compile_seconds: float | None = None
        self.fast_decode = self.fast_tree = self.fast_greedy = None
        if compile and not batch_invariant:
            self.fast_decode = CudaGraphDecode(self, max_decode_batch) if self.device.type == "cuda" else CompiledDecode(self)
            if tree is not None and self.device.type == "cpu":
                self.fast_tree = CompiledTreeVerify(self)
                self.fast_greedy = CompiledGreedySpeculation(self) if medusa is not None else None

    # ---------------------------------------------------------------- inputs
    def prepare(self, sched: Schedule) -> tuple[torch.Tensor, StepContext, list[int], StepRows]:
        cache, dev = self.cache, self.device
        if self.tree is not None and sched.decodes and sched.speculative:
            return self._prepare_tree(sched)
        dec = sched.decodes
        ids = [r.last_token for r in dec]
        pos = [r.num_computed for r in dec]
        slots = [cache.row(r, r.num_computed) for r in dec]
        ctx = StepContext(cache, None, None, num_decode=len(dec), batch_invariant=self.batch_invariant)
        if dec:
            width = max(len(r.pages) for r in dec)
            ctx.block_tables = torch.tensor([r.pages + [cache.scratch_page] * (width - len(r.pages)) for r in dec], device=dev)
            ctx.context_lens = torch.tensor([p + 1 for p in pos], device=dev)
            ctx.state_slots = torch.tensor([r.state_slot for r in dec], device=dev)
            if cache.compressed:
                ctx.decode_prompt_lens = [len(r.prompt_ids) for r in dec]
        sample_rows, rows = list(range(len(dec))), StepRows(list(dec), [])
        slot_parts = [torch.tensor(slots, dtype=torch.long, device=dev)]
        return self._add_prefills(sched, ids, pos, slot_parts, ctx, sample_rows, rows, len(dec))

    def _prepare_tree(self, sched: Schedule):
        cache, dev, tree = self.cache, self.device, self.tree
        dec, t = sched.decodes, self.tree.num_nodes
        roots = torch.tensor([r.last_token for r in dec], device=dev)
        candidates = torch.cat([roots[:, None], torch.stack([r.drafts for r in dec]).flatten(1)], 1)
        tokens = candidates[:, tree.candidate_indices]  # [R, T]
        computed = torch.tensor([r.num_computed for r in dec], device=dev)
        # Rows of every committed position and of the deepest path after them (the commit's destinations).
        width = max(r.num_computed for r in dec) + tree.retrieve_indices.shape[1]
        pages = -(-width // cache.page_size)
        tables = torch.tensor([r.pages[:pages] + [cache.scratch_page] * (pages - len(r.pages[:pages])) for r in dec],
                              device=dev)
        pos = torch.arange(width, device=dev)
        kv_rows = tables[:, pos // cache.page_size] * cache.page_size + pos % cache.page_size
        ctx = StepContext(cache, None, None, batch_invariant=self.batch_invariant)
        ctx.tree = TreeStep(len(dec), tree.depths, tree.ancestor_mask, kv_rows, computed,
                            torch.tensor([r.state_slot for r in dec], device=dev), parents=tree.parents, levels=tree.levels)
        rows = StepRows([], [], list(dec), tokens, ctx)
        positions = computed[:, None] + tree.depths
        if not sched.prefills:  # a pure verify step: its inputs as tensors, no round trip through lists
            ctx.positions = positions.flatten()
            ctx.slot_mapping = torch.full((len(dec) * t,), cache.scratch_row, dtype=torch.long, device=dev)
            return tokens.flatten(), ctx, list(range(len(dec) * t)), rows
        ids, pos = tokens.flatten().tolist(), positions.flatten().tolist()
        slot_parts = [torch.full((len(ids),), cache.scratch_row, dtype=torch.long, device=dev)]
        ids, ctx, logit_rows, rows = self._add_prefills(sched, ids, pos, slot_parts, ctx, [], rows, len(ids))
        return ids, ctx, list(range(len(dec) * t)) + logit_rows, rows

    def _add_prefills(self, sched, ids, pos, slot_parts, ctx, sample_rows, rows, row):
        cache, dev = self.cache, self.device
        prompt_rows = []
        for r, start, end in sched.prefills:
            ids += r.token_slice(start, end)
            pos += range(start, end)
            slot_parts.append(cache.rows(r, start, end))
            kv_rows = cache.rows(r, 0, end) if start or cache.compressed else None
            ctx.prefills.append(Span(row, end - start, start, r.state_slot, kv_rows, len(r.prompt_ids)))
            self._prompt_logprob_rows(r, start, end, row, prompt_rows, rows.prompt_targets)
            row += end - start
            if end == r.num_tokens:
                sample_rows.append(row - 1)
                rows.sampled.append(r)
        if len(ctx.prefills) > 1 and not self.batch_invariant:
            ctx.prefill_state_slots = torch.tensor([s.state_slot for s in ctx.prefills], device=dev)
            ctx.prefill_lengths = torch.tensor([s.length for s in ctx.prefills], device=dev)
        pad = -row % INVARIANT_ROWS if self.batch_invariant else 0
        ids += [0] * pad
        pos += [0] * pad
        slot_parts.append(torch.full((pad,), cache.scratch_row, dtype=torch.long, device=dev))
        ctx.positions = torch.tensor(pos, device=dev)
        ctx.slot_mapping = torch.cat(slot_parts)
        return torch.tensor(ids, device=dev), ctx, sample_rows + prompt_rows, rows

    @staticmethod
    def _prompt_logprob_rows(r: Request, start: int, end: int, row: int, prompt_rows: list, targets: list) -> None:
        """Rows of this chunk whose logits score the next prompt token (position p scores token p + 1),
        each position once even when a preempted request recomputes its prompt."""
        if r.prompt_logprobs_next is None:
            return
        last = min(end, len(r.prompt_ids) - 1)
        for p in range(max(start, r.prompt_logprobs_next), last):
            prompt_rows.append(row + p - start)
            targets.append((r, r.prompt_ids[p + 1]))
        r.prompt_logprobs_next = max(r.prompt_logprobs_next, last)

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def run(self, sched: Schedule) -> tuple[StepRows, torch.Tensor]:
        """Advance the cache by the scheduled tokens (a tree verify: by nothing yet, see
        commit_tree); returns which rows mean what and the fp32 logits of the verified tree
        rows, then the sampled rows, then the prompt-logprob rows."""
        ids, ctx, logit_rows, rows = self.prepare(sched)
        if self.fast_decode is not None and not ctx.prefills and ctx.tree is None and not self._sparse_decodes(sched):
            logits = self.fast_decode(ids, ctx)
            if logits is not None:
                return rows, logits
        if self.tree is None:
            return rows, self.forward(ids, ctx, logit_rows)
        if self.fast_tree is not None and ctx.tree is not None and not ctx.prefills:
            out = self.fast_tree(ids, ctx)
            if out is not None:
                if self.fast_greedy is not None and greedy_batch(rows.verified):
                    left = torch.tensor([r.params.max_tokens - len(r.output_ids) for r in rows.verified], device=self.device)
                    rows.speculated = self.fast_greedy(*out, ids, ctx, left)
                    if rows.speculated is not None:
                        return rows, torch.empty(0, self.model.config.vocab_size, device=self.device)
                rows.hidden, logits = out
                return rows, logits
        rows.hidden = self.heads_input(ids, ctx, logit_rows)
        return rows, self.model.lm_head(rows.hidden).float()  # = model.logits of the undivided hidden

    def heads_input(self, ids: torch.Tensor, ctx: StepContext, logit_rows: list[int]) -> torch.Tensor:
        """The final hidden of the logits rows divided by the muP logit divisor: what lm_head and the Medusa heads read."""
        hidden = self.model.model(ids[None], context=ctx)[0]
        return hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)] / self.model.config.logit_divisor

    def _sparse_decodes(self, sched: Schedule) -> bool:
        """Whether a decode row attends sparsely (InfLLM-v2): such steps run eagerly."""
        dense_len = self.model.config.sparse_config["dense_len"]
        return self.cache.compressed and any(sparse.call_length(r.num_computed, len(r.prompt_ids)) >= dense_len
                                             for r in sched.decodes)

    def forward(self, ids: torch.Tensor, ctx: StepContext, logit_rows: list[int] | None = None) -> torch.Tensor:
        hidden = self.model.model(ids[None], context=ctx)[0]
        if logit_rows is not None:
            n = len(logit_rows)
            pad = -n % INVARIANT_ROWS if self.batch_invariant else 0
            hidden = hidden[torch.tensor(logit_rows + [0] * pad, dtype=torch.long, device=self.device)]  # may be empty
            return self.model.logits(hidden)[:n]
        return self.model.logits(hidden)


class CompiledStep:
    """A step function through torch.compile (inductor), dynamic shapes, C++ launcher
    (cpp_wrapper: measured ~20% off a batch-8 step). After the first call compiled, guards are
    not evaluated (skip_guard_eval_unsafe: over a hundred parameter and pool tensors, ~0.5 ms a
    step): subclasses pad inputs so that one graph serves every step. If compiling fails (no C++
    compiler, an unsupported op) the engine says so once and stays eager."""

    # Inductor specialises size-1 dimensions (more graphs) and lays a size-1 batch out with
    # stride 0, which sends every GEMM to a slow non-BLAS path: batches and page tables are
    # padded to at least two (the extra rows read and write only scratch).
    MIN_ROWS = MIN_WIDTH = 2
    what = "the decode step"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.fn = torch.compile(self._step, dynamic=True, options={"cpp_wrapper": True})
        self.failed = False
        self.compiled = False

    def _step(self, *inputs):
        raise NotImplementedError

    def _run(self, inputs: list[torch.Tensor]):
        if self.failed:
            return None
        for t in inputs:  # else a width equal to some static size (kv heads: 2) is specialised on
            if t.shape[0] > 1:
                torch._dynamo.mark_dynamic(t, 0)
        if self.compiled:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self.fn(*inputs)
            except RuntimeError:  # a graph that has to be recompiled: raised before anything ran
                pass
        t0 = time.perf_counter()
        try:
            out = self.fn(*inputs)
        except Exception as e:  # compiling happens before the step writes anything, so eager can redo it
            self.failed = True
            log.warning("compiling %s failed, running eager: %s", self.what,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        if not self.compiled:
            self.compiled = True
            seconds = time.perf_counter() - t0
            self.runner.compile_seconds = (self.runner.compile_seconds or 0.0) + seconds
            log.info("compiled %s in %.1f s", self.what, seconds)
        return out


class CompiledDecode(CompiledStep):
    """The decode-only step: batch size and page-table width dynamic, one graph for every step."""

    def _step(self, ids, positions, slot_mapping, block_tables, context_lens, state_slots):
        ctx = StepContext(self.runner.cache, positions, slot_mapping, num_decode=ids.shape[0], block_tables=block_tables,
                          context_lens=context_lens, state_slots=state_slots)
        return self.runner.forward(ids, ctx)

    def __call__(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        c = self.runner.cache
        inputs = decode_inputs(ctx, ids)
        tables = inputs[3]
        if tables.shape[1] < self.MIN_WIDTH:
            inputs[3] = torch.cat([tables, tables.new_full((tables.shape[0], self.MIN_WIDTH - tables.shape[1]), c.scratch_page)], 1)
        extra = self.MIN_ROWS - ids.shape[0]
        if extra > 0:
            inputs = [torch.cat([t, t.new_full((extra, *t.shape[1:]), v)]) for t, v in zip(inputs, padding_values(c))]
        torch._dynamo.mark_dynamic(inputs[3], 1)
        logits = self._run(inputs)
        return None if logits is None else logits[: ids.shape[0]]


class CompiledTreeVerify(CompiledStep):
    """A tree-verify step with no prompt chunk: request count and committed width dynamic, the
    tree (depths, ancestor mask) fixed, so one graph serves every verify step. Returns the
    heads' input and the fp32 logits of every tree row; the tree's K/V that commit_tree needs
    come back as outputs and are put in the eager context's `tree.saved`."""

    what = "the tree-verify step"

    def __init__(self, runner: ModelRunner):
        super().__init__(runner)
        self.levels = runner.tree.levels  # computed once: the tree is fixed
    # A single request's tree is still T rows to every GEMM, so it is not padded to two (which
    # would double a compute-bound step): it gets its own graph, with every shape but the
    # committed width static.
    MIN_ROWS = 1

    def _forward(self, ids, positions, kv_rows, kv_lens, state_slots):
        runner, tree = self.runner, self.runner.tree
        ctx = StepContext(runner.cache, positions.flatten(), torch.full_like(positions.flatten(), runner.cache.scratch_row))
        ctx.tree = TreeStep(ids.shape[0], tree.depths, tree.ancestor_mask, kv_rows, kv_lens, state_slots,
                            parents=tree.parents, levels=self.levels)
        hidden = runner.model.model(ids.flatten()[None], context=ctx)[0] / runner.model.config.logit_divisor
        return hidden, runner.model.lm_head(hidden).float(), ctx

    def _step(self, ids, positions, kv_rows, kv_lens, state_slots):
        hidden, logits, ctx = self._forward(ids, positions, kv_rows, kv_lens, state_slots)
        return hidden, logits, [ctx.tree.saved[i] for i in sorted(ctx.tree.saved)]

    def _inputs(self, ids: torch.Tensor, ctx: StepContext) -> list[torch.Tensor]:
        c, tree = self.runner.cache, ctx.tree
        r, t = tree.num_requests, tree.num_nodes
        kv_rows = tree.kv_rows
        if kv_rows.shape[1] < self.MIN_WIDTH:
            kv_rows = torch.cat([kv_rows, kv_rows.new_full((r, self.MIN_WIDTH - kv_rows.shape[1]), c.scratch_row)], 1)
        torch._dynamo.mark_dynamic(kv_rows, 1)
        return [ids.view(r, t), ctx.positions.view(r, t), kv_rows, tree.kv_lens, tree.state_slots]

    def __call__(self, ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        tree = ctx.tree
        out = self._run(self._inputs(ids, ctx))
        if out is None:
            return None
        hidden, logits, saved = out
        for layer, kept in enumerate(saved):  # every layer saves what its commit needs, in layer order
            tree.saved[layer] = tuple(x[: tree.num_requests] for x in kept)
        return hidden, logits


class CompiledGreedySpeculation(CompiledStep):
    """What follows a greedy batch's tree-verify forward, as one graph: greedy acceptance (the
    longest path whose every token is its parent's argmax), the commit (the accepted path's K/V
    into the pages, lightning states advanced along it), the bonus token (the argmax at the
    last accepted node) and the heads' drafts for the next tree. Eagerly these were ~20 small
    ops around the compiled forward, costing more than the forward itself on a small model.
    It is a graph of its own: folded into the forward's graph, the pool writes after the
    forward's pool reads made inductor copy whole pools (measured: 2.5x the step).

    Returns (emitted [R, 2 + P]: accepted length n, the path's tokens root first, the bonus token;
    drafts [R, heads, topk], left on the device for the next step's tree)."""

    what = "the greedy Medusa acceptance and commit"
    MIN_ROWS = 1

    def _step(self, hidden, logits, ids, kv_rows, kv_lens, state_slots, max_nodes, *saved):
        from sala.medusa.accept import accept_greedy  # sala.medusa imports the engine package

        runner, tree = self.runner, self.runner.tree
        r, t = ids.shape
        hidden, logits = hidden.view(r, t, -1), logits.view(r, t, -1)
        ctx = StepContext(runner.cache, None, None)
        ctx.tree = TreeStep(r, tree.depths, tree.ancestor_mask, kv_rows, kv_lens, state_slots, parents=tree.parents)
        it = iter(saved)
        for layer in runner.model.model.layers:  # (k, v) per layer, or (node states,) for a BF16-state lightning layer
            n = 1 if layer.is_lightning and runner.cache.states[layer.layer_idx].dtype != torch.float32 else 2
            ctx.tree.saved[layer.layer_idx] = tuple(next(it) for _ in range(n))
        acc = accept_greedy(tree, ids, logits, max_nodes)
        dest = ctx.tree.path_rows(acc.lengths, tree.retrieve_indices.shape[1], runner.cache.scratch_row)
        runner.model.model.commit_tree(ctx, acc.paths, acc.lengths, dest)
        rows, last = torch.arange(r, device=ids.device), acc.last_nodes()
        bonus = logits[rows, last].argmax(-1)
        drafts = runner.medusa.draft_tokens(hidden[rows, last], runner.model.lm_head)
        return torch.cat([acc.lengths[:, None], ids.gather(1, acc.paths.clamp(min=0)), bonus[:, None]], 1), drafts

    def __call__(self, hidden, logits, ids: torch.Tensor, ctx: StepContext, max_nodes: torch.Tensor):
        tree = ctx.tree
        saved = [x for i in sorted(tree.saved) for x in tree.saved[i]]
        inputs = [hidden, logits, ids.view(tree.num_requests, -1), tree.kv_rows, tree.kv_lens, tree.state_slots, max_nodes]
        torch._dynamo.mark_dynamic(tree.kv_rows, 1)
        return self._run(inputs + saved)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes decode graphs are captured at: a step of n requests runs the smallest >= n."""
    return [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256) if s < max_batch] + [max_batch]


class CudaGraphDecode:
    """Decode steps replayed from CUDA graphs captured at bucketed batch sizes (as nano-vllm
    does). Inputs live in persistent buffers; a step of n requests runs the smallest captured
    size >= n, its extra rows pointed at the scratch page and state slot. Page tables are as
    wide as the longest request the pool can hold, so one graph serves every context length."""

    def __init__(self, runner: ModelRunner, max_batch: int):
        self.runner = runner
        cache = runner.cache
        self.sizes = graph_batch_sizes(max_batch)
        width = cache.pages_for(cache.plan.max_model_len)
        shapes = [(max_batch,)] * 3 + [(max_batch, width)] + [(max_batch,)] * 2
        # Persistent inputs, in decode_inputs' order, every row a padding row until a step fills it.
        self.buffers = [torch.full(shape, v, dtype=torch.long, device=cache.device)
                        for shape, v in zip(shapes, padding_values(cache))]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _context(self, n: int) -> StepContext:
        _, positions, slot_mapping, block_tables, context_lens, state_slots = (b[:n] for b in self.buffers)
        return StepContext(self.runner.cache, positions, slot_mapping, num_decode=n, block_tables=block_tables,
                           context_lens=context_lens, state_slots=state_slots)

    def capture(self) -> None:
        t0 = time.perf_counter()
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            ids = self.buffers[0][:n]
            self.runner.forward(ids, self._context(n))  # warm-up: Triton compiles, constants reach the GPU
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                out = self.runner.forward(ids, self._context(n))
            self.pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        self.runner.compile_seconds = time.perf_counter() - t0
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes, self.runner.compile_seconds)

    def __call__(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if not self.graphs:
            self.capture()
        n = ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        for buf, t, pad in zip(self.buffers, decode_inputs(ctx, ids), padding_values(self.runner.cache)):
            buf[:size].fill_(pad)
            buf[tuple(slice(0, d) for d in t.shape)] = t  # page tables: as wide as this step's
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
