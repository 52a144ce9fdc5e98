"""The quantize pipeline's workers: a pool of Ray actors, each holding the model and the hidden
states of some calibration shards, so Ray start-up and model loading are paid once per worker.

The calibration set is cut into a fixed number of shards, whatever the number of workers. An
actor runs its shards through the model one layer at a time and returns each shard's X^T X
sums, which the driver adds in shard order: the Hessians, and so the checkpoint, are the same
bytes with one worker or eight. The same actors run GPTQ, one Linear per call (members of a
fused group share the group's amax, so they can be quantized apart), reading the weights from
their own copy of the model; the longest calls are handed out first to whichever actor is free.

An actor that dies (a node lost, a process killed) is restarted by Ray and its pending calls are
retried. A restarted actor is back at the embeddings: every call names the layer whose inputs it
needs and carries references to the quantized results of the layers before it, which the actor
replays first.
"""
from __future__ import annotations

import os
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
    """Ray actor: the model, and for each of its shards the hidden states entering `self.layer`."""

    def __init__(self, model_dir: str, shards: dict):  # shard index -> ObjectRef of its token ids
        import ray

        from sala.checkpoint import load_model

        _torch_threads()
        shards = dict(zip(shards, ray.get(list(shards.values()))))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load_model(model_dir, dtype=torch.float32, device=self.device)
        m = self.model.model
        self.layer = 0
        self.h, self.rope = {}, {}
        with torch.no_grad():
            for s, ids in sorted(shards.items()):
                ids = ids.to(self.device)
                self.h[s] = m.embed_tokens(ids) * self.model.config.scale_emb
                self.rope[s] = m.rope(torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1))

    def pid(self) -> int:
        return os.getpid()

    def _run_layer(self, idx: int, shard: int) -> torch.Tensor:
        h = self.h[shard]
        with torch.no_grad():
            return self.model.model.layers[idx](h, self.rope[shard], None, None, h.shape[1])

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

    def layer_hessians(self, idx: int, applied: list) -> dict[int, dict[str, tuple[torch.Tensor, int]]]:
        """Sequential mode: per shard and input site of layer `idx`, (X^T X, tokens) on inputs that
        went through the quantized layers before it (`applied[j]`: layer j's results)."""
        from sala.quant.layerwise import collect_hessians

        self._catch_up(idx, applied)
        out = {}
        for s in self.h:
            accs, handles = collect_hessians({idx: self.model.model.layers[idx]})
            try:
                self._run_layer(idx, s)
            finally:
                for hd in handles:
                    hd.remove()
            out[s] = {site: (acc.xtx.cpu(), acc.tokens) for (_, site), acc in accs.items()}
        return out

    def model_hessians(self) -> dict[int, dict[tuple[int, str], tuple[torch.Tensor, int]]]:
        """Parallel mode: per shard, (X^T X, tokens) of every layer's sites, all from the unquantized model."""
        from sala.quant.layerwise import collect_hessians

        layers = self.model.model.layers
        out = {}
        for s in self.h:
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


class LayerPool:
    """The driver's side: `workers` LayerWorker actors over `shards` calibration shards."""

    def __init__(self, model_dir, seqs: torch.Tensor, shards: int, workers: int, gpus: float):
        import ray

        chunks = [c for c in torch.tensor_split(seqs, min(shards, len(seqs))) if len(c)]
        workers = min(workers, len(chunks))
        actor = ray.remote(LayerWorker).options(num_cpus=1, num_gpus=1 if gpus else 0, max_restarts=4,
                                                max_task_retries=4)
        self.shards = len(chunks)
        # Shards go by reference, held here for the pool's life: a restarted actor fetches them again
        # (constructor arguments in the object store may be gone by then, ray-project/ray#53727).
        self.shard_refs = [ray.put(c) for c in chunks]
        self.actors = [actor.remote(str(model_dir), {s: r for s, r in enumerate(self.shard_refs) if s % workers == w})
                       for w in range(workers)]
        self.pids = ray.get([a.pid.remote() for a in self.actors])

    def submit_layer_hessians(self, idx: int, applied: list) -> list:
        """Start every actor on layer `idx`'s Hessians (after the layers in `applied`); returns the calls."""
        return [a.layer_hessians.remote(idx, applied) for a in self.actors]

    def layer_hessians(self, idx: int, calls: list) -> dict[str, torch.Tensor]:
        """The Hessians of layer `idx` from the calls submit_layer_hessians started."""
        return self._reduce(self._gather(calls, f"model.layers.{idx}"))

    def model_hessians(self) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for (layer, site), h in self._reduce(self._gather([a.model_hessians.remote() for a in self.actors],
                                                          "the Hessian pass")).items():
            out.setdefault(layer, {})[site] = h
        return out

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

    def quantize(self, jobs: list[tuple], opts: dict, on_done) -> None:
        """Run jobs (layer, group, module, hessian, in_features, out_features), the costliest first,
        each on whichever actor is free; on_done(layer, module, (blob, stats)) as each finishes."""
        import ray

        # GPTQ costs about K^2 (N + K) for an [N, K] weight: longest processing time first.
        queue = sorted(jobs, key=lambda j: -j[4] * j[4] * (j[4] + j[5]))
        free, running = list(self.actors), {}
        while queue or running:
            while queue and free:
                job, a = queue.pop(0), free.pop(0)
                running[a.quantize.remote(job[0], job[1], job[2], job[3], opts)] = (job, a)
            done, _ = ray.wait(list(running), num_returns=1)
            job, a = running.pop(done[0])
            free.append(a)
            on_done(job[0], job[2], self._gather([done[0]], f"model.layers.{job[0]}.{job[2]}")[0])

    @staticmethod
    def _gather(refs: list, what: str) -> list:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"quantizing {what} failed: {e.cause!r}") from e
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"quantizing {what} failed: its worker died repeatedly ({e})") from e
