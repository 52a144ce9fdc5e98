"""The quantize pipeline's workers: a pool of Ray actors that read the checkpoint one decoder
layer at a time, so no process ever holds the model.

Each actor holds the calibration set's hidden states entering the layer it is at (fp32, in host
memory, moved to its device one shard at a time) and nothing of the model but the layer it is
working on. A call quantizes one Linear (GPTQ or RTN): the actor reads that Linear's weights
(and its fused group's, for their shared amax) from the checkpoint's shards; for GPTQ it first
brings its hidden states to the call's layer, through the quantized layers before it
(sequential mode: the call carries references to the results of the layers it has yet to go
through) or the original ones (parallel mode), then sums the Hessian of the Linear's input site
over the shards, in shard order, from a forward of the layer, and keeps it for the layer's other
Linears of that site. So a Hessian
never travels, and every actor computes it in the same order from the same shards: the bytes of
the checkpoint depend on the number of shards, never on the number of actors or which actor
did what. Actors only move forward through the layers; each call goes to a free actor that is
not past its layer, the lowest such layer first and within it the costliest call. The driver puts
a finished layer's results in Ray's object store when an actor's call first needs them (read back
from the layer store on disk) and drops its reference once every actor is past that layer, so the
object store holds the layers the actors are going through, not every layer done.

Nothing is lost with an actor or its node (a spot node preempted, a process killed): the driver
owns every call, not Ray's retries. A call that fails with its actor gone, or with its result
lost with its node, goes back to the queue, and Ray is asked for a replacement actor, which
takes work once it has started (on a node that has room then: one added mid-run, say) and
catches up from the embeddings. Ray restarts nothing itself: a restarted actor could sit
waiting for a CPU that died with its node while its calls wait with it.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import torch

# What a layer's results are stored as, here and in the resume ledger (pipelines/quantize.py LayerStore).
RESULTS_FORMAT = "sala-layer-results/2"


def _torch_threads() -> None:
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))


def results_to_bytes(results: dict) -> tuple[bytes, dict]:
    """{module: (NVFP4Tensor, stats)} as safetensors bytes (they carry FP8 scales, which pickled
    torch storages cannot; codes packed two a byte, as the checkpoint holds them) and a JSON-able
    stats dict: what workers return and the layer store keeps."""
    from safetensors.torch import save

    tensors, stats = {}, {}
    for m, (q, st) in results.items():
        tensors |= {f"{m}.packed": q.packed(), f"{m}.scale": q.scale, f"{m}.global_scale": q.global_scale,
                    f"{m}.m4_mask": q.m4_mask.to(torch.uint8)}
        stats[m] = asdict(st) if st is not None else {}
    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}), stats


def results_from_bytes(blob: bytes, stats: dict) -> dict:
    from safetensors.torch import load

    from sala.quant.gptq import GPTQStats
    from sala.quant.nvfp4 import NVFP4Tensor, unpack_fp4

    t = load(blob)
    return {m: (NVFP4Tensor(unpack_fp4(t[f"{m}.packed"]), t[f"{m}.scale"], t[f"{m}.global_scale"], t[f"{m}.m4_mask"].bool()),
                GPTQStats(**st) if st else None) for m, st in stats.items()}


@dataclass(frozen=True)
class Job:
    """One Linear to quantize: `module` of layer `layer`, a member of fused `group`, whose input
    is `site` (the Hessian it needs); `cost` orders the calls."""

    layer: int
    group: tuple[str, ...]
    module: str
    site: str
    cost: int


class LayerWorker:
    """Ray actor: the calibration shards' hidden states entering layer `self.layer`, and that
    layer's Hessians by site once computed."""

    def __init__(self, model_dir: str, shards: list, need):
        from sala.checkpoint import CheckpointReader

        _torch_threads()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.need = need
        # The driver verified the checkpoint's manifest; a worker reads only the tensors it needs.
        self.reader = CheckpointReader(model_dir, verify=False)
        self.shard_refs = shards
        self.h: list[torch.Tensor] | None = None  # per shard, entering self.layer; made on the first GPTQ call
        self.layer = 0
        self.hessians: dict[str, torch.Tensor] = {}

    def whoami(self) -> tuple[int, str]:
        """(process id, Ray node id): the actor's first call, once it has checked that its device
        can hold its work (MemoryShortfall otherwise: a clear refusal, not an out-of-memory error an hour in)."""
        import ray

        from sala.quant.memory import check_device

        check_device(self.need, self.device)
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def quantize(self, job: Job, opts: dict, applied: dict | None) -> tuple[bytes, dict]:
        """GPTQ/RTN of one Linear, from the checkpoint's weights. `applied[j]`: layer j's results,
        for each layer j the hidden states go through on the way to the call's layer in sequential
        mode (None: the original layers)."""
        from sala.quant.layerwise import group_amax, quantize_module

        hessian = self._hessian(job, applied) if opts["method"] == "gptq" else None
        prefix = f"model.layers.{job.layer}"
        weights = {m: self.reader.tensor(f"{prefix}.{m}.weight", torch.float32).to(self.device) for m in job.group}
        result = quantize_module(weights[job.module], hessian, group_amax(weights, job.group), name=f"{prefix}.{job.module}",
                                 **opts)
        return results_to_bytes({job.module: result})

    def _hessian(self, job: Job, applied: dict | None) -> torch.Tensor:
        self._advance(job.layer, applied)
        if job.site not in self.hessians:
            self.hessians |= self._layer_hessians(job.layer, job.site)
        return self.hessians[job.site]

    def _advance(self, idx: int, applied: dict | None) -> None:
        """Bring the hidden states to layer `idx`'s inputs: the embeddings first, then each layer
        before it, read from the checkpoint (in sequential mode with its quantized weights)."""
        import ray

        from sala.quant.layerwise import apply_quantized

        if self.layer > idx:
            raise RuntimeError(f"worker is past layer {idx} (at {self.layer}); calls arrived out of order")
        if self.h is None:
            scale = self.reader.config.scale_emb
            self.h = [self.reader.embeddings(ids, torch.float32) * scale for ids in ray.get(self.shard_refs)]
        while self.layer < idx:
            layer = self.reader.layer(self.layer, torch.float32, self.device)
            if applied is not None:
                results = results_from_bytes(*ray.get(applied[self.layer]))
                apply_quantized(layer, {m: q for m, (q, _) in results.items()})
            self.h = [self._run(layer, h) for h in self.h]
            self.layer += 1
            self.hessians = {}

    def _layer_hessians(self, idx: int, site: str) -> dict[str, torch.Tensor]:
        """Layer `idx`'s Hessian of input `site`, and of every other site whose Hessian is no larger
        (one forward gives them all, and the layer's other Linears will ask for them), summed over
        the shards in shard order."""
        from sala.quant.layerwise import layer_groups, layer_hessians

        layer = self.reader.layer(idx, torch.float32, self.device)
        named = dict(layer.named_modules())
        width = {s: named[groups[0][0]].in_features for s, groups in layer_groups(layer).items()}
        sites = tuple(s for s in width if s == site or (s not in self.hessians and width[s] <= width[site]))
        return layer_hessians(layer, idx, self.h, self._run, sites)

    @torch.no_grad()
    def _run(self, layer, h: torch.Tensor) -> torch.Tensor:
        """One shard through `layer`, on the device; the result back in host memory."""
        x = h.to(self.device)
        positions = torch.arange(x.shape[1], device=self.device).expand(x.shape[0], -1)
        return layer(x, self.reader.skeleton.model.rope(positions), None, None, x.shape[1]).to(h.device)


def _lost(error: BaseException) -> bool:
    """Whether a call failed because its actor or its node went away (work to redo elsewhere), not
    because the work itself raised (a bug or bad input, which another actor would repeat)."""
    import ray

    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError,
                              ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError))


class LayerPool:
    """The driver's side: LayerWorker actors over `shards` calibration shards, spread over the
    cluster's nodes, kept at `workers` by replacing each that dies. `finished(j)`: layer j's results
    (blob, stats) once it is done, which GPTQ calls of later layers go through (sequential mode);
    None: they go through the original layers (parallel mode, and RTN)."""

    def __init__(self, model_dir, seqs: torch.Tensor, shards: int, workers: int, gpus: float, need, finished=None):
        import ray

        from pipelines.capacity import ray_memory

        chunks = [c for c in torch.tensor_split(seqs, min(shards, len(seqs))) if len(c)]
        self.need = need
        # Ray places no more workers on a node than its memory resource holds.
        self.actor = ray.remote(LayerWorker).options(num_cpus=1, num_gpus=1 if gpus else 0,
                                                     memory=ray_memory(need.worker(bool(gpus))), max_restarts=0,
                                                     max_task_retries=0, scheduling_strategy="SPREAD")
        self.model_dir = str(model_dir)
        self.shards = len(chunks)
        # Shards go by reference, held here for the pool's life: each actor fetches them from the
        # driver's object store when it first needs hidden states.
        self.shard_refs = [ray.put(c) for c in chunks]
        self.live: list = []  # started actors, in start order
        self.starting: dict = {}  # ObjectRef of an actor's whoami() -> the actor
        self.at: dict = {}  # actor -> the layer its hidden states enter once its calls so far are done
        self.pid: dict = {}  # actor -> its process id
        self.node: dict = {}  # actor -> its node id
        self.calls_by_node: Counter = Counter()  # calls answered, by node id
        self.lost = 0  # actors lost so far
        self.finished = finished
        self.applied: dict = {}  # layer -> ObjectRef of its results, while an actor is yet to go through it
        for _ in range(workers):
            self._start()
        while self.starting:  # the first pool starts whole
            self._wait_started(list(self.starting))
        self.pids = [self.pid[a] for a in self.live]
        self.nodes = len(set(self.node.values()))

    # -- actors
    def _start(self) -> None:
        a = self.actor.remote(self.model_dir, self.shard_refs, self.need)
        self.at[a] = 0
        self.starting[a.whoami.remote()] = a

    def _wait_started(self, refs: list) -> list:
        """Those of `refs` (whoami calls of starting actors, all ready) join the pool; returns those that did."""
        import ray

        from sala.footprint import MemoryShortfall

        joined = []
        for ref in refs:
            a = self.starting.pop(ref)
            try:
                self.pid[a], self.node[a] = ray.get(ref)
            except Exception as e:
                if isinstance(getattr(e, "cause", None), MemoryShortfall):
                    raise e.cause from None
                if not _lost(e):
                    raise RuntimeError(f"a quantize worker failed to start: {e}") from e
                self._start()  # it died starting (its node went away): ask again
                continue
            self.live.append(a)
            joined.append(a)
            if self.lost:
                print(f"workers    a replacement worker (pid {self.pid[a]}) joined; {len(self.live)} live", file=sys.stderr,
                      flush=True)
        return joined

    def _drop(self, a, error: BaseException) -> None:
        """Actor `a` is gone: a replacement is asked for."""
        import ray

        self.live.remove(a)
        self.lost += 1
        ray.kill(a, no_restart=True)
        self._start()
        print(f"workers    worker pid {self.pid.get(a)} lost ({type(error).__name__}); its call goes back to the queue, "
              f"a replacement is on its way ({len(self.live)} live)", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the actors, every call answered: by ray.kill, as they hold nothing unsaved. An
        actor left to exit on its own spends about 2 s of a core in the interpreter's teardown
        (sala/process_exit.py), taken from the driver's gate where they share a node."""
        import ray

        for a in [*self.live, *self.starting.values()]:
            ray.kill(a, no_restart=True)
        self.live, self.starting = [], {}

    # -- calls
    def run(self, jobs: list[Job], opts: dict, on_done) -> None:
        """Run `jobs`, each on a free actor, the lowest layer first and within it the costliest;
        on_done(job, (blob, stats)) as each finishes. GPTQ calls go to actors not past their
        layer (an actor moves forward only); RTN reads no inputs, so any actor takes any call. A
        call whose actor is lost goes back to the queue."""
        import ray

        # Layer by layer, within a layer the costliest first: layers complete in order, each going
        # to disk as it does, so the driver holds the results of the layers in flight only,
        # whatever the model's depth (costliest first across all layers held part of every layer).
        queue = sorted(jobs, key=lambda j: (j.layer, -j.cost))
        free, running = list(self.live), {}
        ordered = opts["method"] == "gptq"
        while queue or running:
            for a in list(free):
                eligible = [j for j in queue if not ordered or j.layer >= self.at[a]]
                if not eligible:
                    continue
                job = eligible[0]
                queue.remove(job)
                free.remove(a)
                applied = None
                if ordered:
                    applied = self._applied(a, job.layer)
                    self.at[a] = job.layer
                    self._release()
                running[a.quantize.remote(job, opts, applied)] = (job, a)
            if not running and not self.starting:
                raise RuntimeError(f"no worker can take the calls of layer(s) {sorted({j.layer for j in queue})}")
            done, _ = ray.wait([*running, *self.starting], num_returns=1)
            if done[0] in self.starting:
                free += self._wait_started(done)
                continue
            job, a = running.pop(done[0])
            try:
                out = self._get(done[0], f"model.layers.{job.layer}.{job.module}")
            except _Lost as e:
                self._drop(a, e.cause)  # `a` was running, so not among the free
                queue.insert(0, job)
                continue
            free.append(a)
            self.calls_by_node[self.node[a]] += 1
            on_done(job, out)

    def _applied(self, a, layer: int) -> dict | None:
        """References to the results of the layers actor `a` goes through on its way to `layer`
        (None: the original layers), each put in the object store when first needed."""
        import ray

        if self.finished is None:
            return None
        for j in range(self.at[a], layer):
            if j not in self.applied:
                if (results := self.finished(j)) is None:
                    raise RuntimeError(f"layer {j}'s results are not in the layer store (removed or changed during the run)")
                self.applied[j] = ray.put(results)
        return {j: self.applied[j] for j in range(self.at[a], layer)}

    def _release(self) -> None:
        """Drop the references to layers every live or starting actor is past (a call in flight
        keeps those it carries until it ends); a replacement actor's first call puts them again."""
        floor = min(self.at[a] for a in (*self.live, *self.starting.values()))
        for j in [j for j in self.applied if j < floor]:
            del self.applied[j]

    @staticmethod
    def _get(ref, what: str):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"quantizing {what} failed: {e.cause!r}") from e
        except Exception as e:
            if _lost(e):
                raise _Lost(e) from e
            raise


class _Lost(Exception):
    """A call's actor or node went away (`cause`): its work is to be done again elsewhere."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause
