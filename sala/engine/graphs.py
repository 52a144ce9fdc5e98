"""The decode step's fast paths: compiled with inductor on CPU, replayed from CUDA graphs on CUDA.

A decode-only step (every row one request's next token) is the one every engine repeats most,
so its host overhead is cut: on CPU `CompiledDecode` runs it through torch.compile (one graph
with dynamic batch size and page-table width); on CUDA `CudaGraphDecode` replays graphs
captured at bucketed batch sizes over a persistent step context (as nano-vllm does). Medusa's
verify steps have compiled graphs of their own (sala/engine/medusa_decoding.py) on `CompiledStep`.

A compiled step takes its arguments (tensors and step contexts) as one pytree: flattened to
tensors on the way in, rebuilt inside the graph (sala/engine/context.py registers the contexts).
"""
from __future__ import annotations

import logging
import time

import torch
from torch.fx.experimental import _config as fx_config
from torch.utils import _pytree as pytree

from sala.engine.context import StepContext, decode_padding
from sala.engine.graph_store import GraphStore, reason

log = logging.getLogger(__name__)
# What torch._dynamo.mark_dynamic sets on a tensor.
DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides", "_specialize_on",
             "_has_dynamo_dim_marking")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes decode graphs are captured at: a step of n requests runs the smallest >= n."""
    return [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256) if s < max_batch] + [max_batch]


class CompiledStep:
    """A step function through torch.compile (inductor), C++ launcher (cpp_wrapper: measured
    ~20% off a batch-8 step). Only the sizes the caller marks dynamic are symbols: the pools'
    shapes, model constants and float attributes (norm epsilons, scales) are compiled in. With
    dynamic=True each of those was a symbol, passed into the graph and boxed on every call (~120
    in the greedy Medusa graph), and the kernels generic: measured 1.6 -> 1.2 ms a batch-1
    decode step, 3.1 -> 2.3 ms a one-node verify step. A compiled-in size that does change fails
    the graph's input size checks (a RuntimeError before anything ran: `run` compiles another).
    Guards are checked once, when a graph is compiled or loaded, never at a step (over a hundred
    parameter and pool tensors, ~0.5 ms a step): callers pad inputs so that one graph serves
    every step, and a step runs the graph compiled for the same sizes marked dynamic (a single
    request's verify step, say, has its own). If compiling fails (no C++ compiler, an
    unsupported op, a graph break, more graphs than dynamo's recompile limit) the engine says
    so once and stays eager.

    Graphs are compiled ahead of time (`aot_compile`: traced, compiled and guarded without
    running), kept by this step alone, and saved for the next process that compiles the same step
    for the same engine (sala/engine/graph_store.py)."""

    # Inductor specialises size-1 dimensions (more graphs) and lays a size-1 batch out with
    # stride 0, which sends every GEMM to a slow non-BLAS path: batches and page tables are
    # padded to at least two (the extra rows read and write only scratch).
    MIN_ROWS = MIN_WIDTH = 2
    what = "the decode step"

    def __init__(self, config, *modules: torch.nn.Module):
        """`modules`: those the step runs (their structure is part of its saved graphs' key)."""
        self.store = GraphStore(type(self).__qualname__, config, modules)
        self.graphs: dict[tuple, list] = {}  # by the dims marked dynamic: its graphs, the last one run first
        self.spec: pytree.TreeSpec | None = None
        self.failed = False
        self.seconds: float | None = None  # compiling (or loading) took, once compiled

    @property
    def compiled(self) -> bool:
        return self.seconds is not None

    def _unflattened(self, *leaves):
        return self.step(*pytree.tree_unflatten(leaves, self.spec))

    def step(self, *args):
        """The computation, on the arguments `run` was given."""
        raise NotImplementedError

    def run(self, *args, dynamic: list[tuple[torch.Tensor, int]]):
        """step(*args) compiled; None when compiling failed (the caller then runs it eagerly).
        `dynamic`: the (tensor, dim) sizes that change from step to step."""
        if self.failed:
            return None
        leaves, self.spec = pytree.tree_flatten(args)
        symbols = tuple(dim for _, dim in dynamic)
        graphs = self.graphs.setdefault(symbols, [])
        for i, graph in enumerate(graphs):
            try:
                out = self.launch(graph, leaves)
            except RuntimeError:  # a compiled-in size that changed: raised before anything ran
                continue
            graphs.insert(0, graphs.pop(i))
            return out
        made = sum(map(len, self.graphs.values()))  # graphs compiled or loaded
        if made >= torch._dynamo.config.recompile_limit:
            return self._fail(f"more than {made} graphs (torch._dynamo.config.recompile_limit)")
        # Inductor's modules are imported by the first graph loaded or compiled: they import dynamo
        # (1.1 s of CPU), which a process whose engines never compile does not need.
        from torch._inductor import cpp_builder

        from sala import inductor_isa

        t0 = time.perf_counter()
        path = self.store.path(symbols, self.spec)
        inductor_isa.use_known()
        graph = self.store.load(path, self, leaves)  # its guards are checked on tensors not marked, as at a step
        try:
            if graph is None:
                # Inductor looks for its C++ compiler only after tracing and generating the code (11 s of
                # tiny-sala's first decode step): a machine without one is told at once (the search is cached).
                cpp_builder.get_cpp_compiler()
                graph = self._compile(leaves, dynamic)
                self.store.save(path, graph, self)
                how = "compiled"
            else:
                how = "loaded the saved graph of"
            graph.disable_guard_check()
            out = self.launch(graph, leaves)
        except Exception as e:  # compiling happens before the step writes anything, so eager can redo it
            return self._fail(reason(e))
        inductor_isa.remember()
        elapsed = time.perf_counter() - t0
        log.info("%s %s in %.1f s%s", how, self.what, elapsed, " (one more graph)" if made else "")
        graphs.insert(0, graph)
        self.seconds = (self.seconds or 0.0) + elapsed
        return out

    def launch(self, graph, leaves: list):
        """One graph run on a step's flattened arguments: a step's only call into compiled code."""
        return graph(self, *leaves)

    def _compile(self, leaves: list, dynamic: list[tuple[torch.Tensor, int]]):
        """A graph of step(*leaves) with the `dynamic` sizes symbols, compiled without running."""
        for t, dim in dynamic:  # what compiling reads: else a width equal to some static size (kv heads: 2) is specialised on
            torch._dynamo.mark_dynamic(t, dim)
        try:
            # No "duck" sizes: two dynamic sizes equal when compiling (a tree's nodes and its paths,
            # say) must stay two symbols, as guards are not checked later. No automatic dynamic
            # sizes either: dynamo would make a size symbolic because it saw another one before
            # (another engine's pool, compiled earlier in the process), and the graph would serve
            # engines whose sizes it was not compiled for.
            with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                # Made here, not with the step: making it imports AOTAutograd's partitioner and networkx
                # (0.3 s of CPU), which an engine that loads its saved graphs never needs.
                fn = torch.compile(CompiledStep._unflattened, fullgraph=True, dynamic=None, options={"cpp_wrapper": True})
                return fn.aot_compile(((self, *leaves), {}))
        finally:
            # The marks go with the compiling: a tensor that lives on (a tree's buffers) would
            # otherwise carry them into a saved graph's guard check, which refuses marked tensors.
            for t, _ in dynamic:
                for mark in DIM_MARKS:
                    if hasattr(t, mark):
                        delattr(t, mark)

    def __getstate__(self) -> dict:
        """What a graph's guards keep of the step (they pickle the objects they read): never its
        graphs, whose guard managers do not pickle."""
        return {k: v for k, v in self.__dict__.items() if k not in ("graphs", "store")}

    def _fail(self, why: str) -> None:
        self.failed = True
        log.warning("compiling %s failed, running eager: %s", self.what, why)


def rows_dynamic(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Dimension 0 of each tensor that has more than one row."""
    return [(t, 0) for t in tensors if t.shape[0] > 1]


class CompiledDecode(CompiledStep):
    """The decode-only step: batch size and page-table width dynamic, one graph for every step."""

    def __init__(self, config, runner):
        super().__init__(config, runner.model)
        self.runner = runner

    def step(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.runner.forward(ids, ctx)[1]

    def __call__(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        n, width = ids.shape[0], ctx.block_tables.shape[1]
        if n < self.MIN_ROWS:
            ids = torch.cat([ids, ids.new_zeros(self.MIN_ROWS - n)])
        if n < self.MIN_ROWS or width < self.MIN_WIDTH:
            ctx = ctx.padded(self.MIN_ROWS, self.MIN_WIDTH)
        tensors = (ids, ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.context_lens, ctx.state_slots)
        logits = self.run(ids, ctx, dynamic=rows_dynamic(*tensors) + [(ctx.block_tables, 1)])
        return None if logits is None else logits[:n]


class CudaGraphDecode:
    """Decode steps replayed from CUDA graphs captured at bucketed batch sizes (as nano-vllm
    does). The inputs live in a persistent step context; a step of n requests runs the smallest
    captured size >= n, its extra rows padding (the scratch page and state slot). Page tables
    are as wide as the longest request the pool can hold, so one graph serves every context
    length."""

    def __init__(self, runner, max_batch: int):
        self.runner = runner
        cache = runner.cache
        self.sizes = graph_batch_sizes(max_batch)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=cache.device)
        self.context = decode_padding(cache, max_batch, cache.pages_for(cache.plan.max_model_len))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.seconds: float | None = None  # capturing took, once captured

    def capture(self) -> None:
        t0 = time.perf_counter()
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            ids, ctx = self.ids[:n], self.context.rows(n)
            self.runner.forward(ids, ctx)  # warm-up: Triton compiles, constants reach the GPU
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                out = self.runner.forward(ids, ctx)[1]
            self.pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - t0
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes, self.seconds)

    def __call__(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if not self.graphs:
            self.capture()
        n = ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.ids[:size].zero_()
        self.ids[:n] = ids
        ctx.copy_into(self.context.rows(size))
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
