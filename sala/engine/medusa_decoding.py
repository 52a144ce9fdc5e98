"""Medusa decoding: the strategy (sala/engine/decoding.py) of an engine given Medusa heads.

A verify step puts each decoding request's draft tree in place of its decode row: root = its
last token, nodes = the heads' top-k candidates the tree's paths pick (sala/medusa/tree.py),
T rows at positions num_computed + depth. `TreeVerify.inputs` builds that step's context (a
TreeStep: sparse layers attend over the committed K/V plus each node's ancestors, lightning
layers run the tree from the slot's state; neither writes the pools). After the forward,
`TreeVerify.emit` keeps the longest acceptable path of each tree (the acceptance math,
sala/medusa/accept.py: greedy is lossless, sampling uses typical acceptance), commits it
(`commit`: its K/V into the pages and the lightning states advanced along it,
sala/engine/paged.py commit_tree), takes the bonus token at its last node and the heads'
drafts there for the next tree, and counts.

On CPU a verify step with no prompt chunk runs compiled (`CompiledTreeVerify`: request count
and committed width dynamic, the tree fixed), and for a batch of greedy requests without
logprobs the acceptance, commit, bonus token and drafts are a second graph
(`CompiledGreedyAccept`), read back once. Steps with prompt chunks run eagerly.

When to verify (`SpeculationPolicy`). A verify step costs more than a decode step (T rows a
request instead of one) and pays for it in accepted tokens. Where a step is overhead-bound
(small batches, a GPU) that is a gain; where the rows already fill the machine (large batches,
a CPU) it is a loss. So, as vLLM's `disable_by_batch_size`, a step whose decoding requests
number more than `max_batch` decodes plainly. `max_batch` (the engine's medusa_max_batch):

- None: always verify;
- an integer N: verify while at most N requests decode;
- "auto": `warmup` times a plain decode step and a verify step at batch sizes 1, 2, 4, ... up
  to the engine's max_seqs, and a step of n requests verifies when
  accept_length x plain(n) >= verify(n) (step times interpolated between the sizes timed). A
  verify step is timed twice: for greedy requests, whose acceptance and commit run compiled on
  CPU, and for sampled ones (typical acceptance, eager); a step with any sampled or logprobs
  request is judged by the second. accept_length is the engine's running mean once
  MIN_VERIFY_STEPS verify steps have been measured, before that the tree's expected accept
  length from the heads' measured per-rank accuracy (tree.expected_accept_length, an
  underestimate), and with neither, verify. Until warmup has timed the steps, it always verifies.

A plain step of a Medusa engine drafts only for the prompts it ends (their first tree); the
requests it decodes keep their drafts, so the first verify after plain steps usually accepts
less, never anything wrong. Greedy output does not depend on the policy (both kinds of step
are lossless); a sampled request's tokens do (typical acceptance and plain sampling draw
differently), as with vLLM's setting.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sala.engine import paged
from sala.engine.config import EngineConfig
from sala.engine.context import StepContext, TreeStep
from sala.engine.decoding import Emitted, PlainDecoding, StepOutput
from sala.engine.graphs import CompiledStep, rows_dynamic
from sala.engine.request import Request, SpecStats
from sala.engine.stats import SpeculationStats
from sala.medusa import accept as medusa_accept
from sala.medusa.accept import Settled
from sala.medusa.tree import expected_accept_length
from sala.sampling import InvalidParam, SamplingParams, sample, token_logprobs

log = logging.getLogger(__name__)
MIN_VERIFY_STEPS = 32


def greedy_batch(reqs: list[Request]) -> bool:
    """Greedy requests without logprobs only: their verify needs nothing but argmaxes (on CPU the
    compiled greedy tail; a batch with any other request accepts eagerly)."""
    return all(r.params.greedy and r.params.logprobs is None for r in reqs)


class MedusaDecoding:
    """Medusa heads serving an engine: each step's choice between a verify step and a plain one,
    the drafts, and the counters."""

    def __init__(self, config: EngineConfig, heads, runner):
        model, cache = runner.model, runner.cache
        param = next(model.parameters())
        self.heads = heads.to(device=cache.device, dtype=param.dtype if param.is_floating_point() else torch.float32)
        self.tree = heads.tree.to(cache.device)
        for t in (self.tree.depths, self.tree.ancestor_mask, self.tree.parents):
            torch._dynamo.mark_static(t)  # a compiled verify step specialises on the tree's shape
        self.config, self.model, self.cache = config, model, cache
        self.totals = SpecStats()  # over all requests
        accuracy = heads.config.rank_accuracy
        self.prior_accept_length = expected_accept_length(torch.tensor(accuracy), self.tree) if accuracy else None
        self.policy = SpeculationPolicy(config.medusa_max_batch)
        self.plain = PlainDecoding(config, runner)
        self.plain_step = PlainStep(self)
        self.verify = TreeVerify(self)

    def for_step(self, decoding: list[Request]):
        """A verify step for these decoding requests, or a plain one (the policy's choice)."""
        verifies = decoding and self.policy(len(decoding), self.accept_length, greedy_batch(decoding))
        return self.verify if verifies else self.plain_step

    def compiled_steps(self) -> list:
        return self.plain.compiled_steps() + [s for s in (self.verify.fast_verify, self.verify.fast_greedy) if s]

    def admit(self, req: Request) -> None:
        """Refuse what tree acceptance cannot honour: it judges drafts by the raw logits."""
        p = req.params
        if p.adjusts_logits or p.min_p:
            name = next(f for f, off in (("logit_bias", {}), ("min_tokens", 0), ("repetition_penalty", 1),
                                         ("presence_penalty", 0), ("frequency_penalty", 0), ("min_p", 0))
                        if getattr(p, f) != off)
            raise InvalidParam(name, f"{name} is not supported with Medusa decoding; serve without Medusa to use it")
        req.spec = SpecStats()

    @property
    def accept_length(self) -> float | None:
        return running_accept_length(self.totals, self.prior_accept_length)

    @torch.inference_mode()
    def draft(self, reqs: list[Request], hidden: torch.Tensor | None) -> None:
        """Each request's next tree candidates [K, topk] from the heads' input at its row."""
        if reqs:
            for r, d in zip(reqs, self.heads.draft_tokens(hidden, self.model.lm_head)):
                r.drafts = d

    def commit(self, ctx: StepContext, acc: medusa_accept.Accepted) -> None:
        """The accepted paths' K/V into the pages, the lightning states advanced along them."""
        dest = ctx.tree.path_rows(acc.lengths, self.tree.retrieve_indices.shape[1], self.cache.scratch_row)
        paged.commit_tree(self.model.model, ctx, acc.paths, acc.lengths, dest)

    def settle(self, acc: medusa_accept.Accepted, ctx: StepContext, tokens: torch.Tensor, hidden: torch.Tensor,
               bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After acceptance, in tensor ops alone (the compiled greedy graph runs it too): the
        commit, then the fields of a Settled (a plain tuple: what a compiled graph returns)."""
        self.commit(ctx, acc)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        drafts = self.heads.draft_tokens(hidden[rows, acc.last_nodes()], self.model.lm_head)
        return torch.cat([acc.lengths[:, None], tokens.gather(1, acc.paths.clamp(min=0)), bonus[:, None]], 1), drafts

    # ---------------------------------------------------------------- reporting
    def stats(self) -> SpeculationStats:
        t = self.totals
        return SpeculationStats(verify_steps=t.verify_steps, draft_tokens=t.draft_tokens, accepted_tokens=t.accepted_tokens,
                                max_batch=self.largest_batch())

    def largest_batch(self, greedy: bool = True) -> int:
        """The largest batch size up to max_seqs that verifies now (0: none)."""
        return self.policy.largest_batch(self.config.max_seqs, self.accept_length, greedy)

    def describe(self) -> str:
        policy = self.policy
        if policy.max_batch is None:
            return "Medusa verifies at every batch size"
        if policy.max_batch != "auto":
            return f"Medusa verifies while at most {policy.max_batch} requests decode"
        if not policy.step_ms:
            return "Medusa verifies at every batch size until warmup times the steps (medusa_max_batch='auto')"
        times = ", ".join(f"{n}: {p:.1f} / {g:.1f} / {v:.1f} ms" for n, (p, g, v) in sorted(policy.step_ms.items()))
        accept = "unknown" if self.accept_length is None else f"{self.accept_length:.2f}"
        return (f"Medusa verifies greedy batches up to {self.largest_batch()} requests, sampled ones up to "
                f"{self.largest_batch(greedy=False)} (medusa_max_batch='auto': accept length {accept}; plain "
                f"/ greedy verify / sampled verify step at batch {times})")

    # ---------------------------------------------------------------- warmup
    def warmup(self, engine, prompt: list[int], params: SamplingParams) -> None:
        """Compile the steps the engine serving these heads may take, and with
        medusa_max_batch='auto' time them: through the engine's public API, which Engine.warmup
        keeps out of its counts."""
        if self.plain.fast_decode is not None:
            # Verify steps of one request and of several are two graphs (see CompiledTreeVerify), and
            # so are the greedy tails after them; sampled and logprobs batches accept eagerly.
            for n in (1, 2) if self.verify.fast_verify is not None and self.config.max_seqs > 1 else (1,):
                engine.generate([prompt] * n, params)
            if self.policy.max_batch is not None:  # plain decode steps too
                with self.policy.forcing(False):
                    engine.generate([prompt], params)
        if self.policy.max_batch == "auto":
            self.policy.step_ms = self._time_steps(engine, prompt)
            log.info(self.describe())

    def _time_steps(self, engine, prompt: list[int], steps: int = 5) -> dict[int, tuple[float, float, float]]:
        """Median ms of a pure plain decode step, a greedy verify step and a sampled verify step
        at batch sizes 1, 2, 4, ... max_seqs (what medusa_max_batch='auto' decides by)."""
        max_seqs = self.config.max_seqs
        sizes = sorted({min(2**i, max_seqs) for i in range(max_seqs.bit_length() + 1)})
        # Each request must outlive the timed steps: a verify step may take max_depth + 1 tokens.
        max_tokens = min(2 * steps * (self.tree.max_depth + 1) + 8, self.cache.max_tokens - 1)
        table = {}
        for n in sizes:
            times = []
            for temperature, kinds in ((0, (False, True)), (1, (True,))):
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True)
                reqs = [engine.add_request(prompt, params) for _ in range(n)]
                for verify in kinds:
                    ms = []
                    with self.policy.forcing(verify):
                        while len(ms) < steps and engine.has_work():
                            before = engine.stats()
                            pure = before.waiting == 0 and not any(r.prefilling for r in reqs if not r.finish_reason)
                            t0 = time.perf_counter()
                            engine.step()
                            elapsed = time.perf_counter() - t0
                            if pure and engine.stats().running == n:
                                ms.append(1e3 * elapsed)
                    times.append(sorted(ms)[len(ms) // 2] if ms else math.inf)
                for r in reqs:
                    engine.cancel(r)
                while engine.has_work():
                    engine.step()
            table[n] = tuple(times)
        return table


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
    """A verify step: each decoding request's draft tree in its rows, the accepted path kept."""

    drafts = True

    def __init__(self, medusa: MedusaDecoding):
        self.medusa, self.tree, self.cache = medusa, medusa.tree, medusa.cache
        self.lookahead, self.rows = self.tree.max_depth, self.tree.num_nodes
        self.levels = self.tree.levels  # computed once: the tree is fixed
        on_cpu = medusa.config.compiled and self.cache.device.type == "cpu"
        self.fast_verify = CompiledTreeVerify(medusa.model) if on_cpu else None
        self.fast_greedy = CompiledGreedyAccept(medusa) if on_cpu else None

    def inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, StepContext]:
        """Each request's draft tree (R * T tokens) and the step context that verifies them."""
        cache, dev, tree = self.cache, self.cache.device, self.tree
        roots = torch.tensor([r.last_token for r in reqs], device=dev)
        candidates = torch.cat([roots[:, None], torch.stack([r.drafts for r in reqs]).flatten(1)], 1)
        tokens = candidates[:, tree.candidate_indices]
        computed = torch.tensor([r.num_computed for r in reqs], device=dev)
        # Rows of every committed position and of the deepest path after them (the commit's destinations).
        width = max(r.num_computed for r in reqs) + tree.retrieve_indices.shape[1]
        pages = cache.pages_for(width)
        tables = torch.tensor([r.pages[:pages] + [cache.scratch_page] * (pages - len(r.pages[:pages])) for r in reqs],
                              device=dev)
        pos = torch.arange(width, device=dev)
        kv_rows = tables[:, pos // cache.page_size] * cache.page_size + pos % cache.page_size
        positions = (computed[:, None] + tree.depths).flatten()
        state_slots = torch.tensor([r.state_slot for r in reqs], device=dev)
        step = TreeStep(depths=tree.depths, ancestor_mask=tree.ancestor_mask, kv_rows=kv_rows, kv_lens=computed,
                        state_slots=state_slots, parents=tree.parents, levels=self.levels)
        return tokens.flatten(), StepContext(cache=cache, positions=positions,
                                             slot_mapping=torch.full_like(positions, cache.scratch_row), tree=step)

    def run_compiled(self, ids: torch.Tensor, ctx: StepContext, reqs: list[Request]) -> StepOutput | None:
        """Through the compiled graphs (CPU); None where there are none (or compiling failed)."""
        tokens = ids.view(len(reqs), -1)
        out = self.fast_verify(tokens, ctx) if self.fast_verify is not None else None
        if out is None:
            return None
        hidden, logits, ctx.tree.saved = out
        step = StepOutput(ids, ctx, decoded=logits, decoded_hidden=hidden)
        if self.fast_greedy is not None and greedy_batch(reqs):
            r, t = tokens.shape
            decided = self.fast_greedy(tokens, logits.view(r, t, -1), hidden.view(r, t, -1), ctx, self._room(reqs))
            step.decided = None if decided is None else Settled(*decided)  # None: compiling failed, accept eagerly
        return step

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
        logits = out.decoded.view(len(reqs), tree.num_nodes, -1)
        if out.decided is not None:  # greedy without logprobs: no path to score
            (emitted, drafts), paths = out.decided, None
        else:
            acc = medusa_accept.accept(tree, tokens, logits, [r.params for r in reqs], self._room(reqs),
                                       medusa.config.typical_threshold, medusa.config.typical_alpha)
            bonus = torch.tensor(sample(logits[torch.arange(len(reqs)), acc.last_nodes()], reqs, eos_ids),
                                 device=tokens.device)
            emitted, drafts = medusa.settle(acc, out.context, tokens, out.decoded_hidden.view(len(reqs), tree.num_nodes, -1),
                                            bonus)
            paths = acc.paths.tolist()
        gained = []
        for i, (r, row) in enumerate(zip(reqs, emitted.tolist())):  # the step's one read-back
            n = row[0]
            r.num_computed += n
            r.drafts = drafts[i]
            accepted = row[2 : 1 + n] + [row[-1]]  # the accepted drafts (the root was emitted last step), the bonus
            for stats in (r.spec, medusa.totals):
                stats.record(n, tree.num_nodes - 1, tree.max_depth)
            scored = [None] * n
            if r.params.logprobs is not None:  # token j is scored by the logits of the node before it (eager path only)
                scored = token_logprobs(logits[i, paths[i][:n]], accepted, [r.params.logprobs] * n)
            gained.append(Emitted(r, accepted, scored))
        return gained


def running_accept_length(totals: SpecStats, prior: float | None) -> float | None:
    """What a verify step is expected to yield: the measured mean once MIN_VERIFY_STEPS verify
    steps are in `totals`, before that the prior (None: unknown)."""
    return totals.accept_length if totals.verify_steps >= MIN_VERIFY_STEPS else prior


@dataclass
class SpeculationPolicy:
    """Whether a step verifies, from medusa_max_batch and (for "auto") the step times warmup measured."""

    max_batch: int | str | None
    # auto: batch -> (plain, greedy verify, sampled verify) ms
    step_ms: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    force: bool | None = None  # set while warmup times one kind of step

    def __call__(self, n: int, accept_length: float | None, greedy: bool = True) -> bool:
        """Whether a step with n decoding requests verifies their trees (greedy: all of them are
        greedy without logprobs)."""
        if self.force is not None:
            return self.force
        if self.max_batch is None:
            return True
        if self.max_batch != "auto":
            return n <= self.max_batch
        if not self.step_ms or accept_length is None:
            return True
        plain, verify_greedy, verify_sampled = self.step_times(n)
        return accept_length * plain >= (verify_greedy if greedy else verify_sampled)

    def largest_batch(self, max_seqs: int, accept_length: float | None, greedy: bool = True) -> int:
        """The largest batch size up to max_seqs that verifies (0: none)."""
        return max((n for n in range(1, max_seqs + 1) if self(n, accept_length, greedy)), default=0)

    @contextmanager
    def forcing(self, verify: bool):
        """Every step verifies (True) or decodes plainly (False) inside the block: warmup's compiling and timing."""
        self.force = verify
        try:
            yield
        finally:
            self.force = None

    def step_times(self, n: int) -> tuple[float, ...]:
        """(plain, greedy verify, sampled verify) ms of a step of n requests: linear between the
        sizes timed, the nearest one's outside them."""
        sizes = sorted(self.step_ms)
        i = bisect.bisect_left(sizes, n)
        if i == 0 or i == len(sizes):
            return self.step_ms[sizes[min(i, len(sizes) - 1)]]
        lo, hi = sizes[i - 1], sizes[i]
        w = (n - lo) / (hi - lo)
        return tuple((1 - w) * a + w * b for a, b in zip(self.step_ms[lo], self.step_ms[hi]))


class CompiledTreeVerify(CompiledStep):
    """A verify step with no prompt chunk: request count and committed width dynamic, the tree
    fixed, so one graph serves every verify step. Returns the heads' input and the fp32 logits
    of every tree row, and what the commit needs (the context's tree.saved) as outputs."""

    what = "the tree-verify step"
    # A single request's tree is still T rows to every GEMM, so it is not padded to two (which
    # would double a compute-bound step): it gets its own graph, with every shape but the
    # committed width static.
    MIN_ROWS = 1

    def __init__(self, model):
        super().__init__()
        self.model = model

    def step(self, tokens: torch.Tensor, ctx: StepContext):
        hidden = self.model.model(tokens.flatten()[None], step=ctx)[0] / self.model.config.logit_divisor
        return hidden, self.model.lm_head(hidden).float(), ctx.tree.saved

    def __call__(self, tokens: torch.Tensor, ctx: StepContext):
        tree = ctx.tree
        if tree.kv_rows.shape[1] < self.MIN_WIDTH:  # padding columns: the scratch row, past every request's length
            extra = tree.kv_rows.new_full((tree.num_requests, self.MIN_WIDTH - tree.kv_rows.shape[1]), ctx.cache.scratch_row)
            tree.kv_rows = torch.cat([tree.kv_rows, extra], 1)
        # (The context's positions and slot mapping are R * T long: derived sizes, not marked.)
        return self.run(tokens, ctx, dynamic=rows_dynamic(tokens, tree.kv_rows, tree.kv_lens, tree.state_slots)
                        + [(tree.kv_rows, 1)])


class CompiledGreedyAccept(CompiledStep):
    """What follows a greedy batch's tree-verify forward, as one graph: greedy acceptance (the
    longest path whose every token is its parent's argmax), then `MedusaDecoding.settle` with
    the argmax at the last accepted node as the bonus token. Eagerly these are ~20 small ops
    around the compiled forward, costing more than the forward itself on a small model. It is a
    graph of its own: folded into the forward's graph, the pool writes after the forward's pool
    reads made inductor copy whole pools (measured: 2.5x the step). Returns StepOutput.decided."""

    what = "the greedy Medusa acceptance and commit"
    MIN_ROWS = 1

    def __init__(self, medusa: MedusaDecoding):
        super().__init__()
        self.medusa = medusa

    def step(self, hidden, logits, tokens, ctx: StepContext, room):
        acc = medusa_accept.accept_greedy(self.medusa.tree, tokens, logits, room)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return self.medusa.settle(acc, ctx, tokens, hidden, logits[rows, acc.last_nodes()].argmax(-1))

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, ctx: StepContext,
                 room: torch.Tensor):
        tree = ctx.tree
        saved = [x for kept in tree.saved.values() for x in kept]
        dynamic = rows_dynamic(hidden, logits, tokens, tree.kv_rows, tree.kv_lens, tree.state_slots, room, *saved)
        return self.run(hidden, logits, tokens, ctx, room, dynamic=dynamic + [(tree.kv_rows, 1)])
