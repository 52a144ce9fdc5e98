"""The engine: requests in, tokens out, one `step` at a time.

`Engine` is synchronous and single-threaded: `add_request`, then call `step()` until
`has_work()` is false (or use `generate` for a list of prompts). Each step schedules a batch,
runs it through the model, samples one token for every request that reached the end of its
prompt, and hands each request a RequestOutput through its callback.

With Medusa heads (`medusa=`, or a checkpoint holding `medusa/`), every decode is a tree
verify: one forward over each request's draft tree, the longest acceptable path kept
(sala/medusa/accept.py: greedy is lossless, sampling uses typical acceptance), its K/V and
lightning state committed, the bonus token sampled from its last node, and the heads' top-k
at that node drafting the next tree.

`AsyncEngine` runs that loop in a background thread for servers: `generate` is an async
iterator of RequestOutputs, and leaving it early (a client that disconnects) cancels the
request, which frees its cache at the start of the next step.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from kernels.target import require_supported
from sala import lightning
from sala.engine.cache import CacheFull, CachePool, full_request_kv_bytes, kv_bytes_per_token, plan_memory, state_bytes_per_seq
from sala.engine.detokenizer import IncrementalDetokenizer
from sala.engine.prefix import PrefixCache
from sala.engine.request import Completion, Request, RequestOutput, SpecStats
from sala.engine.runner import ModelRunner
from sala.engine.scheduler import Scheduler
from sala.engine.speculation import SpeculationPolicy, parse_max_batch
from sala.engine.stats import EngineInfo, EngineStats, LayerBytes, PrefixStats, SpeculationStats
from sala.kv import PLAN_FILE, default_plan, load_plan
from sala.medusa import accept as medusa_accept  # a module: sala.medusa.accept imports the engine's sampling
from sala.medusa.tree import expected_accept_length
from sala.sampling import InvalidParam, SamplingParams, TokenLogprob, sample, token_logprobs

log = logging.getLogger(__name__)
FINISH_REASONS = ("stop", "length", "cancelled")


def stop_token_ids(model, tokenizer) -> set[int]:
    """Tokens that end a request (unless ignore_eos): the eos ids of config.json, generation_config
    and the tokenizer, as vLLM takes them, plus every special token the chat template writes, so a
    chat reply ends at the template's end-of-turn or start-of-turn marker instead of running on
    into the next turn (a ChatML model that forgets <|im_end|> still begins a turn with <|im_start|>)."""
    ids: set[int] = set()
    for eos in (model.config.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                tokenizer.eos_token_id):
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    template = tokenizer.chat_template or ""
    template = "".join(template.values()) if isinstance(template, dict) else template  # named templates
    ids.update(i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if t in template)
    return ids


# Defaults by device type: the CUDA ones are what the GPU kernels are built and checked for
# (sala/compile_check.py).
MAX_SEQS = {"cuda": 256, "cpu": 32}
MAX_BATCH_TOKENS = {"cuda": 2048, "cpu": 512}
PAGE_SIZE = 64  # InfLLM-v2's block


class Engine:
    """`Engine(model, tokenizer)` serves a loaded model (its projections are fused in place);
    `Engine.from_pretrained(path)` loads one. Settings:

    - device: where the model and cache live (from_pretrained: CUDA when available, else CPU).
    - memory_bytes: the K/V + state budget; default on CUDA `gpu_memory_utilization` of the
      device's memory minus what is already in use, on CPU room for `max_seqs` sequences of
      min(max_model_len, 4096) tokens (at most a quarter of the machine's memory).
    - max_seqs (CUDA 256, CPU 32), cut to what the state pool can hold; max_batch_tokens (the
      step's token budget); max_model_len (default the config's); max_waiting (queue bound).
    - batch_invariant: the evaluation mode (bitwise-reproducible logprobs whatever else runs);
      compile: the compiled / CUDA-graph decode step (ignored in the evaluation mode).
    - kv_plan: the cache plan (sala/kv/plan.py; a KVPlan, its JSON dict, or a kv_plan.json path):
      each sparse layer's K/V format and each lightning layer's state dtype. Default: K/V in the
      model's dtype, fp32 states; from_pretrained picks up the checkpoint's kv_plan.json.
    - prefix_cache: reuse the K/V pages and lightning states of shared prefixes
      (sala/engine/prefix.py); outputs are unchanged (bitwise in the evaluation mode).
      prefix_snapshot_interval: tokens between state snapshots (a multiple of the page size and
      of lightning.CHUNK_SIZE); prefix_snapshot_bytes: the snapshots' own budget (default an
      eighth of memory_bytes; on CUDA taken out of the default budget, on CPU on top of it).
    - medusa: MedusaHeads (sala/medusa/heads.py) to decode by tree verify; typical_threshold and
      typical_alpha: typical acceptance for sampled requests (Medusa's posterior_threshold and alpha,
      default 0.09 and 0.3); medusa_max_batch: verify only while at most this many requests decode,
      decoding plainly above it (an integer; "auto": chosen from step times measured by warmup();
      None, the default: always verify; sala/engine/speculation.py).
    """

    def __init__(self, model, tokenizer, *, memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_seqs: int | None = None, max_batch_tokens: int | None = None, max_model_len: int | None = None,
                 max_waiting: int = 256, page_size: int = PAGE_SIZE, batch_invariant: bool = False, compile: bool = True,
                 kv_plan=None, prefix_cache: bool = True, prefix_snapshot_interval: int = 512,
                 prefix_snapshot_bytes: int | None = None, medusa=None,
                 typical_threshold: float | None = None, typical_alpha: float | None = None,
                 medusa_max_batch: int | str | None = None):
        if medusa is not None and batch_invariant:
            raise ValueError("Medusa tree verify has no batch-invariant mode: pass medusa=None (or medusa=False to "
                             "from_pretrained) for the evaluation mode")
        self.model, self.tokenizer = model, tokenizer
        self.config = config = model.config
        param = next(model.parameters())
        self.device = param.device
        require_supported(self.device)
        model.model.fuse_projections()
        if self.device.type == "cpu":
            _dequantize_once(model)
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        cuda = self.device.type == "cuda"
        kind = "cuda" if cuda else "cpu"
        max_seqs = max_seqs or MAX_SEQS[kind]
        unit = math.lcm(page_size, lightning.CHUNK_SIZE)
        if prefix_cache and (prefix_snapshot_interval <= 0 or prefix_snapshot_interval % unit):
            raise ValueError(f"prefix_snapshot_interval={prefix_snapshot_interval} must be a positive multiple of {unit} "
                             f"(the page size {page_size} and the lightning chunk {lightning.CHUNK_SIZE})")
        # Checked against the model before anything is allocated: a bad plan fails at start-up.
        self.kv_plan = default_plan(config, param.dtype) if kv_plan is None else load_plan(kv_plan, config)
        default_budget = memory_bytes is None
        if default_budget:
            memory_bytes = _default_budget(config, self.device, gpu_memory_utilization, max_seqs, self.max_model_len, page_size,
                                           self.kv_plan)
        if prefix_cache and prefix_snapshot_bytes is None:
            prefix_snapshot_bytes = memory_bytes // 8
            if default_budget and cuda:
                memory_bytes -= prefix_snapshot_bytes
        plan = plan_memory(config, memory_bytes, max_seqs, self.max_model_len, page_size, self.kv_plan)
        log.info("%s; %s", plan.describe(), self.kv_plan.describe())
        self.cache = CachePool(config, plan, self.kv_plan, self.device)
        self.prefix = PrefixCache(self.cache, config, prefix_snapshot_interval, prefix_snapshot_bytes, exact=batch_invariant) \
            if prefix_cache else None
        granule = lightning.CHUNK_SIZE if batch_invariant else 1
        if medusa is not None and self.cache.compressed:
            raise ValueError(f"Medusa tree verify does not run InfLLM-v2's sparse path yet: with Medusa, max_model_len "
                             f"({self.max_model_len}) must stay at or below sparse_config.dense_len "
                             f"({config.sparse_config['dense_len']})")
        if medusa is None and medusa_max_batch is not None:
            raise ValueError(f"medusa_max_batch={medusa_max_batch!r} was given but Medusa is off (no heads)")
        max_spec_batch = parse_max_batch(medusa_max_batch)
        self.medusa, self.tree = medusa, None
        decode_tokens = 1
        if medusa is not None:
            self.medusa = medusa.to(device=self.device, dtype=param.dtype if param.is_floating_point() else torch.float32)
            self.tree = medusa.tree.to(self.device)
            self.typical = (medusa_accept.TYPICAL_THRESHOLD if typical_threshold is None else typical_threshold,
                            medusa_accept.TYPICAL_ALPHA if typical_alpha is None else typical_alpha)
            decode_tokens = self.tree.num_nodes
        max_batch_tokens = max_batch_tokens or max(MAX_BATCH_TOKENS[kind], plan.max_seqs + granule,
                                                   min(plan.max_seqs, 16) * decode_tokens + granule)
        self.scheduler = Scheduler(self.cache, max_batch_tokens, plan.max_seqs, max_waiting, granule, self.prefix,
                                   exact_recompute=batch_invariant)
        self.spec = SpecStats() if medusa is not None else None  # totals over all requests
        self.speculation = None
        if self.tree is not None:
            self.scheduler.decode_tokens, self.scheduler.lookahead = decode_tokens, self.tree.max_depth
            accuracy = medusa.config.rank_accuracy
            self.speculation = SpeculationPolicy(
                max_spec_batch, self.spec, expected_accept_length(torch.tensor(accuracy), self.tree) if accuracy else None)
            self.scheduler.speculate = self.speculation
        self.runner = ModelRunner(model, self.cache, batch_invariant, compile, plan.max_seqs, self.tree, self.medusa)
        self.eos_ids = stop_token_ids(model, tokenizer)
        # Running totals for monitoring: tokens generated and finishes by the step thread, prompt tokens on add.
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished: Counter[str] = Counter()  # by finish reason

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                        kv_plan=None, medusa: bool | str | Path | None = None, medusa_tree: list[list[int]] | None = None,
                        **kwargs) -> Engine:
        """A checkpoint directory; its kv_plan.json is used unless `kv_plan` (path or dict) is given.
        medusa: None serves the checkpoint's `medusa/` heads when it has them, False never, True
        requires them, a path loads heads from there; medusa_tree replaces the saved tree."""
        from transformers import AutoTokenizer  # sala/__init__ has registered SALA's tokenizer class

        from sala.checkpoint import CheckpointError, load_model  # BF16, or NVFP4 through the W4A16 path
        from sala.medusa.heads import has_medusa, load_heads

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available (torch {torch.__version__}); use device='cpu'")
        require_supported(device)  # before minutes of loading weights
        if kv_plan is None and (Path(path) / PLAN_FILE).is_file():
            kv_plan = Path(path) / PLAN_FILE
        if kv_plan is not None:  # a bad plan fails before the weights load
            from sala.checkpoint import read_config

            load_plan(kv_plan, read_config(Path(path)))
        if medusa is None and kwargs.get("batch_invariant"):
            medusa = False  # the evaluation mode decodes plainly; only an explicit medusa=True is refused
        heads_path = path if medusa in (None, True) else medusa
        if medusa is True and not has_medusa(path):
            raise CheckpointError(f"{path}: medusa=True but the checkpoint has no medusa/ heads (train them with "
                                  "pipelines/train_medusa.py)")
        model = load_model(path, dtype, device)
        heads = None
        if medusa is not False and (medusa is not None or has_medusa(path)):
            heads = load_heads(heads_path, model.config, device, tree=medusa_tree)
        elif medusa_tree is not None:
            raise ValueError("medusa_tree was given but Medusa is off (medusa=False or no medusa/ heads)")
        return cls(model, AutoTokenizer.from_pretrained(path), kv_plan=kv_plan, medusa=heads, **kwargs)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def info(self) -> EngineInfo:
        """The engine's settings, fixed for its life."""
        plan, kv, config = self.cache.plan, self.kv_plan, self.config
        layers = [LayerBytes(i, "sparse", kv.kv[i], "token", b) for i, b in kv.kv_bytes_per_token(config).items()]
        layers += [LayerBytes(i, "lightning", kv.state[i], "sequence", b) for i, b in kv.state_bytes_per_seq(config).items()]
        return EngineInfo(str(self.device), self.max_model_len, config.vocab_size, plan.max_seqs, plan.num_pages,
                          plan.page_size, self.scheduler.max_batch_tokens, self.scheduler.max_waiting,
                          self.runner.fast_decode is not None, plan.kv_bytes_per_token, plan.state_bytes_per_seq,
                          tuple(layers))

    def stats(self) -> EngineStats:
        """Counters and queues now (on the step thread; AsyncEngine.stats from an event loop)."""
        prefix = spec = None
        if p := self.prefix:
            prefix = PrefixStats(p.num_queried_tokens, p.num_hit_tokens, p.num_evictable, p.num_evicted_pages,
                                 p.num_snapshots * p.snapshot_bytes, p.max_snapshots * p.snapshot_bytes)
        if self.spec is not None:
            spec = SpeculationStats(self.spec.verify_steps, self.spec.draft_tokens, self.spec.accepted_tokens,
                                    self.spec.accept_length, self.speculation.largest_batch(self.cache.plan.max_seqs))
        return EngineStats(self.scheduler.num_waiting, len(self.scheduler.running), len(self.cache.free_pages),
                           self.num_prompt_tokens, self.num_generated_tokens, self.num_preemptions,
                           {r: self.num_finished[r] for r in FINISH_REASONS}, prefix, spec)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix page no request holds (SGLang's /flush_cache); how many went."""
        return self.prefix.flush() if self.prefix else 0

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a request could take from the prefix cache now."""
        return self.prefix.resumable_len(tokens) if self.prefix else 0

    def warmup(self) -> None:
        """Compile (CPU) or capture (CUDA) the decode step now, not on the first request, and with
        medusa_max_batch='auto' time the steps it chooses by; servers and batch jobs call this at
        start-up. The requests it runs are not counted in the engine's totals."""
        prompt = [self.config.bos_token_id or 0]
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        policy = self.speculation
        with self._uncounted():
            if self.runner.fast_decode is not None:
                # Medusa: verify steps of one request and of several are two graphs (see CompiledTreeVerify),
                # and so are the greedy tails after them; sampled and logprobs batches accept eagerly.
                for n in (1, 2) if self.runner.fast_tree is not None and self.cache.plan.max_seqs > 1 else (1,):
                    self.generate([prompt] * n, params)
                if policy is not None and policy.max_batch is not None:  # plain decode steps too
                    with policy.forcing(False):
                        self.generate([prompt], params)
            if policy is not None and policy.max_batch == "auto":
                policy.step_ms = self._time_steps(prompt)
                log.info(policy.describe(self.cache.plan.max_seqs))

    def _time_steps(self, prompt: list[int], steps: int = 5) -> dict[int, tuple[float, float, float]]:
        """Median ms of a pure plain decode step, a greedy verify step and a sampled verify step
        at batch sizes 1, 2, 4, ... max_seqs (what medusa_max_batch='auto' decides by)."""
        policy, max_seqs = self.speculation, self.cache.plan.max_seqs
        sizes = sorted({min(2**i, max_seqs) for i in range(max_seqs.bit_length() + 1)})
        # Each request must outlive the timed steps: a verify step may take max_depth + 1 tokens.
        max_tokens = min(2 * steps * (self.tree.max_depth + 1) + 8, self.cache.max_tokens - 1)
        table = {}
        for n in sizes:
            times = []
            for temperature, kinds in ((0, (False, True)), (1, (True,))):
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True)
                reqs = [self.add_request(prompt, params) for _ in range(n)]
                for verify in kinds:
                    ms = []
                    with policy.forcing(verify):
                        while len(ms) < steps and self.has_work():
                            pure = not self.scheduler.waiting and all(not r.prefilling for r in self.scheduler.running)
                            t0 = time.perf_counter()
                            self.step()
                            if pure and len(self.scheduler.running) == n:
                                ms.append(1e3 * (time.perf_counter() - t0))
                    times.append(sorted(ms)[len(ms) // 2] if ms else math.inf)
                for r in reqs:
                    self.cancel(r)
                while self.has_work():
                    self.step()
            table[n] = tuple(times)
        return table

    @contextmanager
    def _uncounted(self):
        """Leave the engine's running totals as they were (warmup's requests are not traffic)."""
        saved = (self.num_prompt_tokens, self.num_generated_tokens, self.num_finished.copy(),
                 self.spec.copy() if self.spec else None, self.scheduler.num_preemptions)
        try:
            yield
        finally:
            self.num_prompt_tokens, self.num_generated_tokens, self.num_finished, spec, self.scheduler.num_preemptions = saved
            if spec is not None:  # in place: the speculation policy holds this object
                vars(self.spec).update(vars(spec))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode()
            except UnicodeEncodeError as e:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
                raise InvalidParam("prompt", f"prompt is not valid Unicode: {e.reason} at character {e.start}") from None
            return self.tokenizer(prompt)["input_ids"]
        if not all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in prompt):
            raise InvalidParam("prompt", f"token ids must be integers in [0, {self.config.vocab_size})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    on_output: Callable[[RequestOutput], None] = lambda out: None, request_id: str | None = None) -> Request:
        """Queue a request; raises InvalidParam for bad input and QueueFull when the queue is at its limit."""
        params.validate(self.config.vocab_size)
        ids = self.encode(prompt)
        if not ids:
            raise InvalidParam("prompt", "prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidParam("prompt", f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len}")
        if len(ids) + params.max_tokens > min(self.max_model_len, self.cache.max_tokens):
            limit = min(self.max_model_len, self.cache.max_tokens) - len(ids)
            plan = self.cache.plan
            raise InvalidParam("max_tokens", f"max_tokens={params.max_tokens} but the prompt ({len(ids)} tokens) "
                                             f"leaves room for at most {limit}: {len(ids) + params.max_tokens} tokens "
                                             f"need {plan.request_bytes(len(ids) + params.max_tokens) / 2**20:.1f} MiB "
                                             f"(K/V of {len(self.config.sparse_layers)} sparse layers, "
                                             f"{plan.page_bytes / plan.page_size:.0f} B a token, plus a "
                                             f"{plan.state_bytes_per_seq / 2**20:.2f} MiB lightning state) and the "
                                             f"cache holds {plan.max_kv_tokens} tokens "
                                             f"({plan.num_pages * plan.page_bytes / 2**20:.1f} MiB of K/V)")
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens, params.no_stop_trim)
        req = Request(ids, params, detokenizer, on_output)
        if self.medusa is not None:
            if params.adjusts_logits or params.min_p:  # tree acceptance judges drafts by the raw logits
                field = next(f for f, off in (("logit_bias", {}), ("min_tokens", 0), ("repetition_penalty", 1),
                                              ("presence_penalty", 0), ("frequency_penalty", 0), ("min_p", 0))
                             if getattr(params, f) != off)
                raise InvalidParam(field, f"{field} is not supported with Medusa decoding; serve without Medusa to use it")
            req.spec = SpecStats()
        if request_id:
            req.request_id = request_id
        if params.prompt_logprobs_start is not None:
            req.prompt_logprobs_next = max(params.prompt_logprobs_start - 1, 0)
        if not params.greedy:
            # A CPU generator whatever the device: sampling draws its uniforms here (sampling.py),
            # so a seed gives the same tokens on CPU and CUDA.
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            # Any integer seeds: torch takes [-2**63, 2**64) and reads a negative one as its two's complement.
            req.generator = torch.Generator(device="cpu").manual_seed(seed % 2**64)
        self.scheduler.add(req)
        self.num_prompt_tokens += len(ids)
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True  # acted on by the step thread, at the start of the next step

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> None:
        for r in self.scheduler.pop_cancelled():
            self._emit(r, [], None, "cancelled")
        sched = self.scheduler.schedule()
        if not sched.num_tokens:
            return
        step, logits = self.runner.run(sched)
        if not step.verified:
            for r in sched.decodes:
                r.num_computed += 1
        for r, _, end in sched.prefills:
            r.num_computed = end
        if self.prefix:  # before a request can finish and give its pages back (_verify enters verified trees')
            self.prefix.after_step(([] if step.verified else sched.decodes) + [r for r, _, _ in sched.prefills])
        hidden = step.hidden
        if step.verified:
            if step.speculated is not None:  # a pure verify step: no other rows
                self._verify(step, logits, hidden)
            else:
                n_tree = len(step.verified) * self.tree.num_nodes
                self._verify(step, logits[:n_tree], hidden[:n_tree])
                logits, hidden = logits[n_tree:], hidden[n_tree:]
        n = len(step.sampled)
        if self.medusa is not None and n and hidden is not None:  # a compiled plain step: the drafts stay
            drafts = self._draft(hidden[:n])
            for r, d in zip(step.sampled, drafts):
                r.drafts = d
        if step.prompt_targets:
            scored = token_logprobs(logits[n:], [t for _, t in step.prompt_targets],
                                    [r.params.logprobs or 0 for r, _ in step.prompt_targets])
            for (r, _), lp in zip(step.prompt_targets, scored):
                r.prompt_logprobs.append(lp)
        reqs = step.sampled
        if any(r.num_computed < r.num_tokens for r in reqs):  # decodes recomputing generated tokens: nothing new
            keep = [i for i, r in enumerate(reqs) if r.num_computed == r.num_tokens]
            reqs, logits, n = [reqs[i] for i in keep], logits[keep], len(keep)
        tokens = sample(logits[:n], reqs, self.eos_ids)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        scored = token_logprobs(logits[want], [tokens[i] for i in want], [reqs[i].params.logprobs for i in want])
        logprobs = dict(zip(want, scored))
        for i, (r, token) in enumerate(zip(reqs, tokens)):
            self._append(r, token, logprobs.get(i))

    @torch.inference_mode()
    def _draft(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next trees' candidates [N, K, topk] from the heads' input rows [N, hidden]."""
        return self.medusa.draft_tokens(hidden, self.model.lm_head)

    def _verify(self, step, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Accept, commit and emit the verified trees (logits / hidden: their R * T rows; none when
        the compiled step already accepted, committed and drafted: step.speculated)."""
        reqs, t = step.verified, self.tree.num_nodes
        if step.speculated is not None:
            emitted, drafts = step.speculated
        else:
            logits, hidden = logits.view(len(reqs), t, -1), hidden.view(len(reqs), t, -1)
            left = torch.tensor([r.params.max_tokens - len(r.output_ids) for r in reqs], device=self.device)
            acc = medusa_accept.accept(self.tree, step.tree_tokens, logits, [r.params for r in reqs], left, *self.typical)
            tree = step.context.tree
            dest = tree.path_rows(acc.lengths, self.tree.retrieve_indices.shape[1], self.cache.scratch_row)
            self.model.model.commit_tree(step.context, acc.paths, acc.lengths, dest)
            rows = torch.arange(len(reqs), device=self.device)
            last = acc.last_nodes()
            bonus = torch.tensor(sample(logits[rows, last], reqs, self.eos_ids), device=self.device)
            drafts = self._draft(hidden[rows, last])
            emitted = torch.cat([acc.lengths[:, None], step.tree_tokens.gather(1, acc.paths.clamp(min=0)), bonus[:, None]], 1)
            paths = acc.paths.tolist()
        for i, (r, row) in enumerate(zip(reqs, emitted.tolist())):  # the step's one read-back
            n = row[0]
            r.num_computed += n
            r.drafts = drafts[i]
            tokens = row[2 : 1 + n] + [row[-1]]  # the accepted drafts (the root was emitted last step), the bonus
            for stats in (r.spec, self.spec):
                stats.verify_steps += 1
                stats.draft_tokens += t - 1
                stats.accepted_tokens += n - 1
                stats.accepted_per_depth += [0] * (self.tree.max_depth - len(stats.accepted_per_depth))
                for d in range(n - 1):
                    stats.accepted_per_depth[d] += 1
            scored = [None] * n
            if r.params.logprobs is not None:  # token j is scored by the logits of the node before it (eager path only)
                scored = token_logprobs(logits[i, paths[i][:n]], tokens, [r.params.logprobs] * n)
            for token, lp in zip(tokens, scored):
                self._append(r, token, lp)
                if r.finish_reason:
                    break
        if self.prefix:  # the accepted tokens are in output_ids now; finished requests gave their pages back
            self.prefix.after_step([r for r in reqs if not r.finish_reason])

    def _append(self, r: Request, token: int, lp: TokenLogprob | None) -> None:
        r.output_ids.append(token)
        self.num_generated_tokens += 1
        r.first_token_at = r.first_token_at or time.perf_counter()
        if lp is not None:
            r.logprobs.append(lp)
        p, reason = r.params, None
        # min_tokens: the sampler kept stop tokens out until then; stop strings count only from then on.
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, r.matched = "stop", token
            if p.no_stop_trim:  # the stop token's text stays (when it is not a skipped special token)
                r.detokenizer.append(token, check_stop=False)
        elif (matched := r.detokenizer.append(token, check_stop=len(r.output_ids) >= p.min_tokens)) is not None:
            reason, r.matched = "stop", matched
        elif len(r.output_ids) >= p.max_tokens:
            reason = "length"
        self._emit(r, [token], lp, reason)

    def _emit(self, r: Request, tokens: list[int], lp: TokenLogprob | None, reason: str | None) -> None:
        if reason:
            r.finish_reason = reason
            self.num_finished[reason] += 1
            self.scheduler.finish(r)
        first = len(r.output_ids) == 1 and bool(tokens)
        r.on_output(RequestOutput(r.request_id, tokens, r.detokenizer.delta(reason is not None), [lp] if lp else [],
                                  r.prompt_logprobs if first else [], reason is not None, reason,
                                  len(r.prompt_ids), len(r.output_ids), r.cached_prompt_tokens,
                                  r.matched if reason else None, r.spec.copy() if r.spec else None))

    def fail_all(self) -> list[Request]:
        """After a step raised: drop every request (their cache contents are not trustworthy)."""
        with self.scheduler.lock:
            gone = list(self.scheduler.waiting) + list(self.scheduler.running)
            self.scheduler.waiting.clear()
        for r in gone:
            self.scheduler.finish(r)
        return gone

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion in this thread, feeding the queue as it drains; results in prompt order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        pending = deque(zip(prompts, params))
        reqs = []
        while pending or self.has_work():
            while pending and self.scheduler.num_waiting < self.scheduler.max_waiting:
                reqs.append(self.add_request(*pending.popleft()))
            self.step()
        return [r.completion() for r in reqs]


class AsyncEngine:
    """Engine.step in a background thread. `submit` queues a request at once (so bad input and a
    full queue raise before any response starts); its RequestStream yields the outputs."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.wakeup = threading.Event()
        self.stopping = False
        self.streams: dict[str, RequestStream] = {}
        self.calls: deque[tuple[Callable, asyncio.Future]] = deque()
        self.thread = threading.Thread(target=self._loop, name="sala-engine", daemon=True)
        self.thread.start()

    def between_steps(self, fn: Callable):
        """Await fn() run on the step thread between two steps, where the cache is not in use."""
        future = asyncio.get_running_loop().create_future()
        self.calls.append((fn, future))
        self.wakeup.set()
        return future

    def _loop(self) -> None:
        while not self.stopping:
            while self.calls:
                fn, future = self.calls.popleft()
                try:
                    result, error = fn(), None
                except Exception as e:
                    result, error = None, e
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            if not self.engine.has_work():
                self.wakeup.wait()
                self.wakeup.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # a bug or OOM must not leave every client waiting forever
                log.exception("engine step failed; failing all requests")
                for r in self.engine.fail_all():
                    if stream := self.streams.get(r.request_id):
                        stream.push(e)

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Call from the event loop that will read the stream."""
        stream = RequestStream(self, asyncio.get_running_loop())
        stream.request = self.engine.add_request(prompt, params, stream.push, request_id)
        self.streams[stream.request.request_id] = stream
        self.wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Cancel a request by id, as SGLang's /abort_request: its stream still gets the final
        "cancelled" output, so its client sees the request end. False if no such request runs."""
        stream = self.streams.get(request_id)
        if stream is None or stream.finished:
            return False
        self.engine.cancel(stream.request)
        self.wakeup.set()
        return True

    def stats(self):
        """Await Engine.stats() taken between two steps."""
        return self.between_steps(self.engine.stats)

    def close(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.thread.join(timeout=10)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if not future.done():  # its awaiter may have gone
        future.set_exception(error) if error is not None else future.set_result(result)


class RequestStream:
    """One request's outputs, handed from the step thread to an event loop."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.owner, self.loop = owner, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request: Request | None = None
        self.finished = False

    def push(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes; leaving early cancels it and frees its cache."""
        try:
            while not self.finished:
                out = await self.queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError(f"engine failure: {out}") from out
                self.finished = out.finished
                yield out
        finally:
            self.cancel()

    def cancel(self) -> None:
        self.owner.streams.pop(self.request.request_id, None)
        if not self.finished:
            self.finished = True
            self.owner.engine.cancel(self.request)
            self.owner.wakeup.set()


def _default_budget(config, device: torch.device, utilization: float, max_seqs: int, max_model_len: int, page_size: int,
                    kv_plan) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return cuda_cache_budget(config, total, free, utilization, max_seqs)
    states = max_seqs * state_bytes_per_seq(config, kv_plan)
    want = max(max_seqs * min(max_model_len, 4096) * kv_bytes_per_token(config, kv_plan),
               full_request_kv_bytes(config, max_model_len, page_size, kv_plan)) + states
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return int(min(want, ram // 4))


def cuda_cache_budget(config, total: int, free: int, utilization: float, max_seqs: int) -> int:
    """Like vLLM's gpu_memory_utilization: that fraction of the whole device, less what is in use
    (weights, other processes), less room for the largest step's activations and logits."""
    activations = 2048 * (4 * config.hidden_size + 3 * config.intermediate_size) * 4 + max_seqs * config.vocab_size * 4 * 3
    budget = int(total * utilization) - (total - free) - activations
    if budget <= 0:
        raise CacheFull(f"gpu_memory_utilization={utilization} of {total / 2**30:.1f} GiB leaves no room for the cache: "
                        f"{(total - free) / 2**30:.1f} GiB are in use")
    return budget


def _dequantize_once(model) -> None:
    """Packed NVFP4 Linears on CPU keep an fp32 copy of their weight, made now rather than on every call."""
    for m in model.modules():
        if hasattr(m, "cache_dequantized"):
            m.cache_dequantized = True
            m.dequantized_weight()
