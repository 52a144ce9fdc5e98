"""Medusa in the engine, in one place: `Speculation`, the object an engine with heads holds.

A verify step puts each decoding request's draft tree in place of its decode row: root = its
last token, nodes = the heads' top-k candidates the tree's paths pick (sala/medusa/tree.py),
T rows at positions num_computed + depth. `tree_context` builds that step's context (a
TreeStep: sparse layers attend over the committed K/V plus each node's ancestors, lightning
layers run the tree from the slot's state; neither writes the pools). After the forward,
`accept` keeps the longest acceptable path of each tree (sala/medusa/accept.py: greedy is
lossless, sampling uses typical acceptance), commits its K/V and lightning state
(sala/engine/paged.py commit_tree), samples the bonus token at its last node, drafts the next
tree from the heads at that node, and counts. The engine without heads holds none of this.

On CPU a verify step with no prompt chunk runs compiled (`CompiledTreeVerify`: request count
and committed width dynamic, the tree fixed), and for a batch of greedy requests without
logprobs what follows the forward (acceptance, commit, bonus token, drafts) is a second graph
(`CompiledGreedySpeculation`), read back once. Steps with prompt chunks run eagerly.

When to verify (`SpeculationPolicy`). A verify step costs more than a decode step (T rows a
request instead of one) and pays for it in accepted tokens. Where a step is overhead-bound
(small batches, a GPU) that is a gain; where the rows already fill the machine (large batches,
a CPU) it is a loss. So, as vLLM's `disable_by_batch_size`, a step whose decoding requests
number more than `max_batch` decodes plainly. `max_batch`:

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

Greedy output does not depend on it (both kinds of step are lossless); a sampled request's
tokens do (typical acceptance and plain sampling draw differently), as with vLLM's setting.
Requests keep their last drafts through plain steps: the first verify after them usually
accepts less, never anything wrong.
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
from sala.engine.cache import CachePool
from sala.engine.context import StepContext, TreeStep
from sala.engine.graphs import CompiledStep, rows_dynamic
from sala.engine.request import Request, SpecStats
from sala.engine.stats import SpeculationStats
from sala.medusa import accept as medusa_accept
from sala.medusa.tree import expected_accept_length
from sala.sampling import InvalidParam, SamplingParams, TokenLogprob, sample, token_logprobs

log = logging.getLogger(__name__)
MIN_VERIFY_STEPS = 32


def greedy_batch(reqs: list[Request]) -> bool:
    """Greedy requests without logprobs only: their verify needs nothing but argmaxes (on CPU the
    compiled greedy tail; a batch with any other request accepts eagerly)."""
    return all(r.params.greedy and r.params.logprobs is None for r in reqs)


class SpeculationSettingError(ValueError):
    """medusa_max_batch is neither an integer >= 0, "auto" nor None."""


def parse_max_batch(value) -> int | str | None:
    """medusa_max_batch as given (an integer >= 0, "auto" or None), or SpeculationSettingError naming it."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):  # from a command line or YAML
        try:
            value = int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpeculationSettingError(f"medusa_max_batch={value!r}: give an integer >= 0 (0 never verifies), 'auto' (timed at "
                                      "warmup) or None (always verify)")
    return value


@dataclass
class Verified:
    """A verify step's draft trees, read back: one per request."""

    requests: list[Request]
    tokens: torch.Tensor  # [R, T] the nodes' tokens
    context: StepContext  # its tree holds what the commit writes (tree.saved)
    logits: torch.Tensor  # [R, T, V] fp32
    hidden: torch.Tensor  # [R, T, hidden] the heads' input
    # Decided by the compiled greedy step (accepted, committed, drafted): (emitted [R, 2 + P]:
    # accepted length n, the path's tokens root first, the bonus token; drafts [R, heads, topk])
    decided: tuple[torch.Tensor, torch.Tensor] | None = None


class Speculation:
    """Medusa heads serving an engine: its verify steps, drafts, acceptance, policy and counters."""

    def __init__(self, heads, model, cache: CachePool, max_batch: int | str | None = None,
                 typical_threshold: float | None = None, typical_alpha: float | None = None, compile: bool = True):
        param = next(model.parameters())
        self.heads = heads.to(device=cache.device, dtype=param.dtype if param.is_floating_point() else torch.float32)
        self.tree = heads.tree.to(cache.device)
        self.levels = self.tree.levels  # computed once: the tree is fixed
        for t in (self.tree.depths, self.tree.ancestor_mask, self.tree.parents):
            torch._dynamo.mark_static(t)  # a compiled verify step specialises on the tree's shape
        self.model, self.cache = model, cache
        self.typical = (medusa_accept.TYPICAL_THRESHOLD if typical_threshold is None else typical_threshold,
                        medusa_accept.TYPICAL_ALPHA if typical_alpha is None else typical_alpha)
        self.totals = SpecStats()  # over all requests
        accuracy = heads.config.rank_accuracy
        self.prior_accept_length = expected_accept_length(torch.tensor(accuracy), self.tree) if accuracy else None
        self.policy = SpeculationPolicy(parse_max_batch(max_batch))
        on_cpu = compile and cache.device.type == "cpu"
        self.fast_verify = CompiledTreeVerify(model) if on_cpu else None
        self.fast_greedy = CompiledGreedySpeculation(self) if on_cpu else None

    @property
    def compiled_steps(self) -> list[CompiledStep]:
        return [s for s in (self.fast_verify, self.fast_greedy) if s is not None]

    # ---------------------------------------------------------------- requests and scheduling
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

    def verifies(self, decoding: list[Request]) -> bool:
        """Whether a step of these decoding requests verifies their trees."""
        return self.policy(len(decoding), self.accept_length, greedy_batch(decoding))

    def row_cost(self) -> tuple[int, int]:
        """A verifying request's (positions reserved past its next token, rows of the step)."""
        return self.tree.max_depth, self.tree.num_nodes

    # ---------------------------------------------------------------- the verify step
    def tree_context(self, reqs: list[Request]) -> tuple[torch.Tensor, StepContext]:
        """Each request's draft tree ([R, T] tokens) and the step context that verifies them."""
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
        return tokens, StepContext(cache, positions, torch.full_like(positions, cache.scratch_row),
                                   tree=TreeStep(tree.depths, tree.ancestor_mask, kv_rows, computed, state_slots,
                                                 parents=tree.parents, levels=self.levels))

    def run_compiled(self, tokens: torch.Tensor, ctx: StepContext, reqs: list[Request]) -> Verified | None:
        """A verify step with no prompt chunk through the compiled graphs (CPU); None where
        there are none (or compiling failed), for the eager forward to run it."""
        out = self.fast_verify(tokens, ctx) if self.fast_verify is not None else None
        if out is None:
            return None
        r, t = tokens.shape
        hidden, logits, ctx.tree.saved = out
        verified = Verified(reqs, tokens, ctx, logits.view(r, t, -1), hidden.view(r, t, -1))
        if self.fast_greedy is not None and greedy_batch(reqs):
            verified.decided = self.fast_greedy(verified, self._room(reqs))
        return verified

    def _room(self, reqs: list[Request]) -> torch.Tensor:
        """[R] tokens each request may still generate: the most nodes its accepted path may keep."""
        return torch.tensor([r.params.max_tokens - len(r.output_ids) for r in reqs], device=self.cache.device)

    def commit(self, ctx: StepContext, acc: medusa_accept.Accepted) -> None:
        """The accepted paths' K/V into the pages, the lightning states advanced along them."""
        dest = ctx.tree.path_rows(acc.lengths, self.tree.retrieve_indices.shape[1], self.cache.scratch_row)
        paged.commit_tree(self.model.model, ctx, acc.paths, acc.lengths, dest)

    @staticmethod
    def emitted(acc: medusa_accept.Accepted, tokens: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """[R, 2 + P]: each request's accepted length, its path's tokens (root first), its bonus token."""
        return torch.cat([acc.lengths[:, None], tokens.gather(1, acc.paths.clamp(min=0)), bonus[:, None]], 1)

    @torch.inference_mode()
    def accept(self, v: Verified, eos_ids: set[int]) -> list[tuple[Request, list[int], list[TokenLogprob | None]]]:
        """Commit what each tree keeps, draft the next trees, count; per request the tokens it
        emits (the accepted drafts, then the bonus token) and their logprobs when asked for."""
        reqs = v.requests
        if v.decided is not None:  # greedy without logprobs: no path to score
            (emitted, drafts), paths = v.decided, None
        else:
            acc = medusa_accept.accept(self.tree, v.tokens, v.logits, [r.params for r in reqs], self._room(reqs),
                                       *self.typical)
            self.commit(v.context, acc)
            rows, last = torch.arange(len(reqs), device=v.tokens.device), acc.last_nodes()
            bonus = torch.tensor(sample(v.logits[rows, last], reqs, eos_ids), device=v.tokens.device)
            drafts = self.heads.draft_tokens(v.hidden[rows, last], self.model.lm_head)
            emitted, paths = self.emitted(acc, v.tokens, bonus), acc.paths.tolist()
        out = []
        for i, (r, row) in enumerate(zip(reqs, emitted.tolist())):  # the step's one read-back
            n = row[0]
            r.num_computed += n
            r.drafts = drafts[i]
            tokens = row[2 : 1 + n] + [row[-1]]  # the accepted drafts (the root was emitted last step), the bonus
            for stats in (r.spec, self.totals):
                stats.verify_steps += 1
                stats.draft_tokens += self.tree.num_nodes - 1
                stats.accepted_tokens += n - 1
                stats.accepted_per_depth += [0] * (self.tree.max_depth - len(stats.accepted_per_depth))
                for d in range(n - 1):
                    stats.accepted_per_depth[d] += 1
            scored = [None] * n
            if r.params.logprobs is not None:  # token j is scored by the logits of the node before it (eager path only)
                scored = token_logprobs(v.logits[i, paths[i][:n]], tokens, [r.params.logprobs] * n)
            out.append((r, tokens, scored))
        return out

    @torch.inference_mode()
    def draft(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        """Each request's next tree candidates [K, topk] from the heads' input at its row."""
        for r, d in zip(reqs, self.heads.draft_tokens(hidden, self.model.lm_head)):
            r.drafts = d

    # ---------------------------------------------------------------- reporting
    def stats(self, max_seqs: int) -> SpeculationStats:
        t = self.totals
        return SpeculationStats(t.verify_steps, t.draft_tokens, t.accepted_tokens, t.accept_length,
                                self.largest_batch(max_seqs))

    def largest_batch(self, max_seqs: int, greedy: bool = True) -> int:
        """The largest batch size up to max_seqs that verifies now (0: none)."""
        return self.policy.largest_batch(max_seqs, self.accept_length, greedy)

    def describe(self, max_seqs: int) -> str:
        policy = self.policy
        if policy.max_batch is None:
            return "Medusa verifies at every batch size"
        if policy.max_batch != "auto":
            return f"Medusa verifies while at most {policy.max_batch} requests decode"
        if not policy.step_ms:
            return "Medusa verifies at every batch size until warmup times the steps (medusa_max_batch='auto')"
        times = ", ".join(f"{n}: {p:.1f} / {g:.1f} / {v:.1f} ms" for n, (p, g, v) in sorted(policy.step_ms.items()))
        accept = "unknown" if self.accept_length is None else f"{self.accept_length:.2f}"
        return (f"Medusa verifies greedy batches up to {self.largest_batch(max_seqs)} requests, sampled ones up to "
                f"{self.largest_batch(max_seqs, greedy=False)} (medusa_max_batch='auto': accept length {accept}; plain "
                f"/ greedy verify / sampled verify step at batch {times})")

    # ---------------------------------------------------------------- warmup
    def warmup(self, engine, prompt: list[int], params: SamplingParams) -> None:
        """Compile the steps the Engine serving these heads may take, and with
        medusa_max_batch='auto' time them (Engine.warmup, which counts none of it)."""
        if engine.runner.fast_decode is not None:
            # Verify steps of one request and of several are two graphs (see CompiledTreeVerify), and
            # so are the greedy tails after them; sampled and logprobs batches accept eagerly.
            for n in (1, 2) if self.fast_verify is not None and engine.cache.plan.max_seqs > 1 else (1,):
                engine.generate([prompt] * n, params)
            if self.policy.max_batch is not None:  # plain decode steps too
                with self.policy.forcing(False):
                    engine.generate([prompt], params)
        if self.policy.max_batch == "auto":
            self.policy.step_ms = self._time_steps(engine, prompt)
            log.info(self.describe(engine.cache.plan.max_seqs))

    def _time_steps(self, engine, prompt: list[int], steps: int = 5) -> dict[int, tuple[float, float, float]]:
        """Median ms of a pure plain decode step, a greedy verify step and a sampled verify step
        at batch sizes 1, 2, 4, ... max_seqs (what medusa_max_batch='auto' decides by)."""
        max_seqs, scheduler = engine.cache.plan.max_seqs, engine.scheduler
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
                            pure = not scheduler.waiting and all(not r.prefilling for r in scheduler.running)
                            t0 = time.perf_counter()
                            engine.step()
                            if pure and len(scheduler.running) == n:
                                ms.append(1e3 * (time.perf_counter() - t0))
                    times.append(sorted(ms)[len(ms) // 2] if ms else math.inf)
                for r in reqs:
                    engine.cancel(r)
                while engine.has_work():
                    engine.step()
            table[n] = tuple(times)
        return table


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


class CompiledGreedySpeculation(CompiledStep):
    """What follows a greedy batch's tree-verify forward, as one graph: greedy acceptance (the
    longest path whose every token is its parent's argmax), the commit, the bonus token (the
    argmax at the last accepted node) and the heads' drafts for the next tree. Eagerly these
    were ~20 small ops around the compiled forward, costing more than the forward itself on a
    small model. It is a graph of its own: folded into the forward's graph, the pool writes
    after the forward's pool reads made inductor copy whole pools (measured: 2.5x the step).
    Returns Verified.decided."""

    what = "the greedy Medusa acceptance and commit"
    MIN_ROWS = 1

    def __init__(self, speculation: Speculation):
        super().__init__()
        self.speculation = speculation

    def step(self, hidden, logits, tokens, ctx: StepContext, room):
        spec = self.speculation
        acc = medusa_accept.accept_greedy(spec.tree, tokens, logits, room)
        spec.commit(ctx, acc)
        rows, last = torch.arange(tokens.shape[0], device=tokens.device), acc.last_nodes()
        drafts = spec.heads.draft_tokens(hidden[rows, last], spec.model.lm_head)
        return spec.emitted(acc, tokens, logits[rows, last].argmax(-1)), drafts

    def __call__(self, v: Verified, room: torch.Tensor):
        ctx, tree = v.context, v.context.tree
        saved = [x for kept in tree.saved.values() for x in kept]
        dynamic = rows_dynamic(v.hidden, v.logits, v.tokens, tree.kv_rows, tree.kv_lens, tree.state_slots, room, *saved)
        return self.run(v.hidden, v.logits, v.tokens, ctx, room, dynamic=dynamic + [(tree.kv_rows, 1)])
