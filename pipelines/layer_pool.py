"""The quantize pipeline's workers: a pool of Ray actors, each holding the model and the hidden
states of some calibration shards, so Ray start-up and model loading are paid once per worker.

The calibration set is cut into a fixed number of shards, whatever the number of workers. An
actor runs its shards through the model one layer at a time and returns each shard's X^T X
sums, which the driver adds in shard order: the Hessians, and so the checkpoint, are the same
bytes with one worker or eight. The same actors run GPTQ, one Linear per call (members of a
fused group share the group's amax, so they can be quantized apart), reading the weights from
their own copy of the model; the longest calls are handed out first to whichever actor is free.

Nothing is lost with an actor or its node (a spot node preempted, a process killed): the driver
owns every piece of work, not Ray's retries. An actor's death (its call fails with the actor
gone, or with its result lost with its node) hands its calibration shards to a live actor, puts
its call back in the queue and asks Ray for a replacement actor, which takes work once it has
started (on a node that has room then: one added mid-run, say). Ray restarts nothing itself: a
restarted actor could sit waiting for a CPU that died with its node while its calls wait with it.
Any actor can take any shard at any layer: every call names the layer whose inputs it needs and
carries references to the quantized results of the layers before it, which the actor replays
first, and a shard it has not held yet starts at the embeddings and runs through the quantized
layers it holds, the same operations its first owner ran, so the bytes do not change either.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import asdict

import torch


def _torch_threads() -> None:
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))


def results_to_bytes(results: dict) -> tuple[bytes, dict]:
    """{module: (NVFP4Tensor, stats)} as safetensors bytes (they carry FP8 scales, which pickled
    torch storages cannot) and a JSON-able stats dict: what workers return and the layer store keeps."""
    from safetensors.torch import save

    tensors, stats = {}, {}
    for m, (q, st) in results.items():
        tensors |= {f"{m}.codes": q.codes, f"{m}.scale": q.scale, f"{m}.global_scale": q.global_scale,
                    f"{m}.m4_mask": q.m4_mask.to(torch.uint8)}
        stats[m] = asdict(st) if st is not None else {}
    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}), stats


def results_from_bytes(blob: bytes, stats: dict) -> dict:
    from safetensors.torch import load

    from sala.quant.gptq import GPTQStats
    from sala.quant.nvfp4 import NVFP4Tensor

    t = load(blob)
    return {m: (NVFP4Tensor(t[f"{m}.codes"], t[f"{m}.scale"], t[f"{m}.global_scale"], t[f"{m}.m4_mask"].bool()),
                GPTQStats(**st) if st else None) for m, st in stats.items()}


class LayerWorker:
    """Ray actor: the model, and for each calibration shard it holds the hidden states entering `self.layer`."""

    def __init__(self, model_dir: str):
        from sala.checkpoint import load_model

        _torch_threads()
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load_model(model_dir, dtype=torch.float32, device=self.device)
        self.layer = 0
        self.h, self.rope = {}, {}

    def whoami(self) -> tuple[int, str]:
        """(process id, Ray node id)."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def _run_layer(self, idx: int, shard: int) -> torch.Tensor:
        h = self.h[shard]
        with torch.no_grad():
            return self.model.model.layers[idx](h, self.rope[shard], None, None, h.shape[1])

    def _hold(self, shards: dict) -> None:
        """Take on the shards (index -> ObjectRef of token ids) not held yet: their embeddings, run
        through the layers before `self.layer` (already quantized here)."""
        import ray

        new = {s: r for s, r in shards.items() if s not in self.h}
        m = self.model.model
        for s, ids in zip(new, ray.get(list(new.values()))):
            ids = ids.to(self.device)
            with torch.no_grad():
                self.h[s] = m.embed_tokens(ids) * self.model.config.scale_emb
                self.rope[s] = m.rope(torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1))
            for j in range(self.layer):
                self.h[s] = self._run_layer(j, s)

    def _catch_up(self, idx: int, applied: list) -> None:
        """Put the quantized layers before `idx` in place and run the shards through them."""
        import ray

        from sala.quant.layerwise import apply_quantized

        if self.layer > idx:
            raise RuntimeError(f"worker is past layer {idx} (at {self.layer}); calls arrived out of order")
        while self.layer < idx:
            results = results_from_bytes(*ray.get(applied[self.layer]))
            apply_quantized(self.model.model.layers[self.layer], {m: q for m, (q, _) in results.items()})
            for s in self.h:
                self.h[s] = self._run_layer(self.layer, s)
            self.layer += 1

    def layer_hessians(self, idx: int, applied: list, shards: dict) -> dict[int, dict[str, tuple[torch.Tensor, int]]]:
        """Sequential mode: per shard in `shards`, (X^T X, tokens) of each input site of layer `idx`,
        on inputs that went through the quantized layers before it (`applied[j]`: layer j's results)."""
        from sala.quant.layerwise import collect_hessians

        self._catch_up(idx, applied)
        self._hold(shards)
        out = {}
        for s in shards:
            accs, handles = collect_hessians({idx: self.model.model.layers[idx]})
            try:
                self._run_layer(idx, s)
            finally:
                for hd in handles:
                    hd.remove()
            out[s] = {site: (acc.xtx.cpu(), acc.tokens) for (_, site), acc in accs.items()}
        return out

    def model_hessians(self, shards: dict) -> dict[int, dict[tuple[int, str], tuple[torch.Tensor, int]]]:
        """Parallel mode: per shard, (X^T X, tokens) of every layer's sites, all from the unquantized model."""
        from sala.quant.layerwise import collect_hessians

        self._hold(shards)
        layers = self.model.model.layers
        out = {}
        for s in shards:
            accs, handles = collect_hessians(dict(enumerate(layers)))
            h = self.h[s]
            try:
                with torch.no_grad():
                    for layer in layers:
                        h = layer(h, self.rope[s], None, None, h.shape[1])
            finally:
                for hd in handles:
                    hd.remove()
            out[s] = {key: (acc.xtx.cpu(), acc.tokens) for key, acc in accs.items()}
        return out

    def quantize(self, idx: int, group: tuple[str, ...], module: str, hessian: torch.Tensor | None,
                 opts: dict) -> tuple[bytes, dict]:
        """GPTQ/RTN of one Linear of layer `idx` (a member of fused `group`), from the original weights."""
        from sala.quant.layerwise import group_amax, layer_weights, quantize_module

        if self.layer > idx:
            raise RuntimeError(f"worker is past layer {idx}: its weights are already quantized")
        weights = {m: w.to(self.device) for m, w in layer_weights(self.model.model.layers[idx]).items() if m in group}
        if hessian is not None:
            hessian = hessian.to(self.device)
        result = quantize_module(weights[module], hessian, group_amax(weights, group), name=f"model.layers.{idx}.{module}",
                                 **opts)
        return results_to_bytes({module: result})


def _lost(error: BaseException) -> bool:
    """Whether a call failed because its actor or its node went away (work to redo elsewhere), not
    because the work itself raised (a bug or bad input, which another actor would repeat)."""
    import ray

    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError,
                              ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError))


class LayerPool:
    """The driver's side: LayerWorker actors over `shards` calibration shards, spread over the
    cluster's nodes, kept at `workers` by replacing each that dies."""

    def __init__(self, model_dir, seqs: torch.Tensor, shards: int, workers: int, gpus: float):
        import ray

        chunks = [c for c in torch.tensor_split(seqs, min(shards, len(seqs))) if len(c)]
        self.actor = ray.remote(LayerWorker).options(num_cpus=1, num_gpus=1 if gpus else 0, max_restarts=0,
                                                     max_task_retries=0, scheduling_strategy="SPREAD")
        self.model_dir = str(model_dir)
        self.shards = len(chunks)
        # Shards go by reference, held here for the pool's life: whichever actor takes a shard
        # fetches it from the driver's object store.
        self.shard_refs = [ray.put(c) for c in chunks]
        self.live: list = []  # started actors, in start order
        self.starting: dict = {}  # ObjectRef of an actor's whoami() -> the actor
        self.owner: dict[int, object] = {}  # shard -> the live actor holding it
        self.pid: dict = {}  # actor -> its process id
        self.node: dict = {}  # actor -> its node id
        self.calls_by_node: Counter = Counter()  # calls answered, by node id
        self.lost = 0  # actors lost so far
        for _ in range(min(workers, len(chunks))):
            self._start()
        while self.starting:  # the first pool starts whole: its shards are dealt out below
            self._wait_started(list(self.starting))
        self.pids = [self.pid[a] for a in self.live]
        self.nodes = len(set(self.node.values()))
        for s in range(self.shards):
            self.owner[s] = self.live[s % len(self.live)]

    # -- actors
    def _start(self) -> None:
        a = self.actor.remote(self.model_dir)
        self.starting[a.whoami.remote()] = a

    def _wait_started(self, refs: list) -> list:
        """Those of `refs` (whoami calls of starting actors, all ready) join the pool; returns those that did."""
        import ray

        joined = []
        for ref in refs:
            a = self.starting.pop(ref)
            try:
                self.pid[a], self.node[a] = ray.get(ref)
            except Exception as e:
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
        """Actor `a` is gone: its shards go to the live actors holding fewest, and a replacement is asked for."""
        import ray

        if a not in self.live:
            return
        self.live.remove(a)
        self.lost += 1
        ray.kill(a, no_restart=True)
        self._start()
        print(f"workers    worker pid {self.pid.get(a)} lost ({type(error).__name__}); its work goes to the "
              f"{len(self.live)} live worker(s), a replacement is on its way", file=sys.stderr, flush=True)
        if not self.live:  # no live actor to hand the shards to: the first that starts takes them
            self._wait_started(ray.wait(list(self.starting), num_returns=1)[0])
        for s in sorted(s for s, o in self.owner.items() if o is a):
            load = {b: sum(o is b for o in self.owner.values()) for b in self.live}
            self.owner[s] = min(self.live, key=lambda b: load[b])

    # -- Hessians
    def submit_layer_hessians(self, idx: int, applied: list) -> dict:
        """Start the actors holding shards on layer `idx`'s Hessians (after the layers in `applied`);
        returns the calls, each with its actor and the shards it answers for."""
        return {a.layer_hessians.remote(idx, applied, shards): (a, shards) for a, shards in self._by_actor().items()}

    def _by_actor(self) -> dict:
        out: dict = {}
        for s in range(self.shards):
            out.setdefault(self.owner[s], {})[s] = self.shard_refs[s]
        return out

    def layer_hessians(self, idx: int, applied: list, calls: dict) -> dict[str, torch.Tensor]:
        """The Hessians of layer `idx` from the calls submit_layer_hessians started."""
        return self._reduce(self._per_shard(calls, lambda a, shards: a.layer_hessians.remote(idx, applied, shards),
                                            f"model.layers.{idx}"))

    def model_hessians(self) -> dict[int, dict[str, torch.Tensor]]:
        calls = {a.model_hessians.remote(shards): (a, shards) for a, shards in self._by_actor().items()}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for (layer, site), h in self._reduce(self._per_shard(calls, lambda a, shards: a.model_hessians.remote(shards),
                                                             "the Hessian pass")).items():
            out.setdefault(layer, {})[site] = h
        return out

    def _per_shard(self, calls: dict, call, what: str) -> list[dict]:
        """Every shard's answer: a call lost with its actor is made again by the shards' new owners."""
        import ray

        parts = []
        while calls:
            done, _ = ray.wait(list(calls), num_returns=1)
            a, shards = calls.pop(done[0])
            try:
                parts.append(self._get(done[0], what))
                self.calls_by_node[self.node[a]] += 1
            except _Lost as e:
                self._drop(a, e.cause)
                for b, mine in self._by_actor().items():
                    if again := {s: r for s, r in mine.items() if s in shards}:
                        calls[call(b, again)] = (b, again)
        return parts

    def _reduce(self, parts: list[dict]) -> dict:
        """Per-shard (X^T X, tokens) -> Hessians, summed in shard order (worker count does not matter)."""
        from sala.quant.gptq import HessianAccumulator

        by_shard = {s: sums for p in parts for s, sums in p.items()}
        accs: dict = {}
        for s in sorted(by_shard):
            for key, (xtx, tokens) in by_shard[s].items():
                part = HessianAccumulator(xtx.shape[0])
                part.xtx, part.tokens = xtx, tokens
                accs.setdefault(key, HessianAccumulator(xtx.shape[0])).merge(part)
        return {key: acc.hessian(f"{key}") for key, acc in accs.items()}

    # -- GPTQ
    def quantize(self, jobs: list[tuple], opts: dict, on_done) -> None:
        """Run jobs (layer, group, module, hessian, in_features, out_features), the costliest first,
        each on whichever actor is free; on_done(layer, module, (blob, stats)) as each finishes.
        A job whose actor is lost goes back to the front of the queue; a replacement actor that
        has started joins the free ones."""
        import ray

        # GPTQ costs about K^2 (N + K) for an [N, K] weight: longest processing time first.
        queue = sorted(jobs, key=lambda j: -j[4] * j[4] * (j[4] + j[5]))
        free, running = list(self.live), {}
        while queue or running:
            while queue and free:
                job, a = queue.pop(0), free.pop(0)
                running[a.quantize.remote(job[0], job[1], job[2], job[3], opts)] = (job, a)
            done, _ = ray.wait([*running, *self.starting], num_returns=1)
            if done[0] in self.starting:
                free += self._wait_started(done)
                continue
            job, a = running.pop(done[0])
            try:
                out = self._get(done[0], f"model.layers.{job[0]}.{job[2]}")
            except _Lost as e:
                self._drop(a, e.cause)  # `a` was running, so not among the free
                queue.insert(0, job)
                continue
            free.append(a)
            self.calls_by_node[self.node[a]] += 1
            on_done(job[0], job[2], out)

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
