"""The engine: requests in, tokens out, one `step` at a time.

`Engine` is synchronous and single-threaded: `add_request`, then call `step()` until
`has_work()` is false (or use `generate` for a list of prompts). A step is: the scheduler picks
a batch (sala/engine/scheduler.py), the runner runs it through the model (sala/engine/runner.py)
and says which logits are for what (StepOutput), then the requests it advanced accept their
verified drafts (Medusa) or sample one token, and each gets a RequestOutput through its
callback. `AsyncEngine` (sala/engine/async_engine.py) runs that loop in a thread for servers.

Who owns what: the cache pool owns pages, state slots and the prefix cache
(sala/engine/cache.py), how much memory it gets is sala/engine/memory.py, and an engine with
Medusa heads holds a Speculation (sala/engine/speculation.py) that the scheduler, the runner and
the step all consult; without heads there is none.
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter, deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from kernels.target import require_supported
from sala import lightning
from sala.engine.cache import CachePool
from sala.engine.detokenizer import IncrementalDetokenizer
from sala.engine.memory import default_budget, plan_memory
from sala.engine.request import Completion, Request, RequestOutput
from sala.engine.runner import ModelRunner, StepOutput
from sala.engine.scheduler import Schedule, Scheduler
from sala.engine.speculation import Speculation
from sala.engine.stats import EngineInfo, EngineStats, LayerBytes, PrefixStats
from sala.kv import PLAN_FILE, default_plan, load_plan
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
        budget_given = memory_bytes is not None
        if not budget_given:
            memory_bytes = default_budget(config, self.device, gpu_memory_utilization, max_seqs, self.max_model_len,
                                          page_size, self.kv_plan)
        if prefix_cache and prefix_snapshot_bytes is None:
            prefix_snapshot_bytes = memory_bytes // 8
            if not budget_given and cuda:
                memory_bytes -= prefix_snapshot_bytes
        plan = plan_memory(config, memory_bytes, max_seqs, self.max_model_len, page_size, self.kv_plan)
        log.info("%s; %s", plan.describe(), self.kv_plan.describe())
        self.cache = CachePool(config, plan, self.kv_plan, self.device,
                               (prefix_snapshot_interval, prefix_snapshot_bytes, batch_invariant) if prefix_cache else None)
        if medusa is not None and self.cache.compressed:
            raise ValueError(f"Medusa tree verify does not run InfLLM-v2's sparse path yet: with Medusa, max_model_len "
                             f"({self.max_model_len}) must stay at or below sparse_config.dense_len "
                             f"({config.sparse_config['dense_len']})")
        if medusa is None and medusa_max_batch is not None:
            raise ValueError(f"medusa_max_batch={medusa_max_batch!r} was given but Medusa is off (no heads)")
        self.speculation = None if medusa is None else Speculation(medusa, model, self.cache, medusa_max_batch,
                                                                   typical_threshold, typical_alpha, compile)
        granule = lightning.CHUNK_SIZE if batch_invariant else 1
        tree_rows = self.speculation.tree.num_nodes if self.speculation else 1
        max_batch_tokens = max_batch_tokens or max(MAX_BATCH_TOKENS[kind], plan.max_seqs + granule,
                                                   min(plan.max_seqs, 16) * tree_rows + granule)
        self.scheduler = Scheduler(self.cache, max_batch_tokens, plan.max_seqs, max_waiting, granule,
                                   exact_recompute=batch_invariant, speculation=self.speculation)
        self.runner = ModelRunner(model, self.cache, batch_invariant, compile, plan.max_seqs, self.speculation)
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
        prefix = None
        if p := self.cache.prefix:
            prefix = PrefixStats(p.num_queried_tokens, p.num_hit_tokens, p.num_evictable, p.num_evicted_pages,
                                 p.num_snapshots * p.snapshot_bytes, p.max_snapshots * p.snapshot_bytes)
        spec = self.speculation.stats(self.cache.plan.max_seqs) if self.speculation else None
        return EngineStats(self.scheduler.num_waiting, len(self.scheduler.running), len(self.cache.free_pages),
                           self.num_prompt_tokens, self.num_generated_tokens, self.num_preemptions,
                           {r: self.num_finished[r] for r in FINISH_REASONS}, prefix, spec)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix page no request holds (SGLang's /flush_cache); how many went."""
        return self.cache.flush_prefix()

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a request could take from the prefix cache now."""
        return self.cache.prefix.resumable_len(tokens) if self.cache.prefix else 0

    def warmup(self) -> None:
        """Compile (CPU) or capture (CUDA) the decode step now, not on the first request, and with
        medusa_max_batch='auto' time the steps it chooses by; servers and batch jobs call this at
        start-up. The requests it runs are not counted in the engine's totals."""
        prompt = [self.config.bos_token_id or 0]
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        with self._uncounted():
            if self.speculation:
                self.speculation.warmup(self, prompt, params)
            elif self.runner.fast_decode is not None:
                self.generate([prompt], params)

    @contextmanager
    def _uncounted(self):
        """Leave the engine's running totals as they were (warmup's requests are not traffic)."""
        saved = (self.num_prompt_tokens, self.num_generated_tokens, self.num_finished.copy(), self.scheduler.num_preemptions,
                 self.speculation.totals.copy() if self.speculation else None)
        try:
            yield
        finally:
            self.num_prompt_tokens, self.num_generated_tokens, self.num_finished, self.scheduler.num_preemptions = saved[:4]
            if self.speculation:
                self.speculation.totals = saved[4]

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
        if self.speculation:
            self.speculation.admit(req)
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
        batch = self.scheduler.schedule()
        if not batch.num_tokens:
            return
        out = self.runner.run(batch)
        self._advance(batch, out)
        if out.verified:
            for r, tokens, logprobs in self.speculation.accept(out.verified, self.eos_ids):
                for token, lp in zip(tokens, logprobs):
                    self._append(r, token, lp)
                    if r.finish_reason:
                        break
            # The accepted tokens are in output_ids now; finished requests gave their pages back.
            self.cache.after_step([r for r in out.verified.requests if not r.finish_reason])
        if self.speculation and out.sampled and out.hidden is not None:  # None: a compiled plain step; drafts stay
            self.speculation.draft(out.sampled, out.hidden)
        if out.prompt_targets:
            scored = token_logprobs(out.prompt_logits, [t for _, t in out.prompt_targets],
                                    [r.params.logprobs or 0 for r, _ in out.prompt_targets])
            for (r, _), lp in zip(out.prompt_targets, scored):
                r.prompt_logprobs.append(lp)
        self._sample(out)

    def _advance(self, batch: Schedule, out: StepOutput) -> None:
        """The step's tokens are in the cache (a verified tree's: those its accept commits)."""
        advanced = [r for r, _, _ in batch.prefills]
        for r, _, end in batch.prefills:
            r.num_computed = end
        if not out.verified:
            for r in batch.decodes:
                r.num_computed += 1
            advanced += batch.decodes
        self.cache.after_step(advanced)  # before a request can finish and give its pages back

    def _sample(self, out: StepOutput) -> None:
        """A token for each request whose row was sampled, with its logprobs when asked for."""
        reqs, logits = out.sampled, out.logits
        if any(r.num_computed < r.num_tokens for r in reqs):  # decodes recomputing generated tokens: nothing new
            keep = [i for i, r in enumerate(reqs) if r.num_computed == r.num_tokens]
            reqs, logits = [reqs[i] for i in keep], logits[keep]
        if not reqs:
            return
        tokens = sample(logits, reqs, self.eos_ids)
        logprobs = {}
        if want := [i for i, r in enumerate(reqs) if r.params.logprobs is not None]:
            scored = token_logprobs(logits[want], [tokens[i] for i in want], [reqs[i].params.logprobs for i in want])
            logprobs = dict(zip(want, scored))
        for i, (r, token) in enumerate(zip(reqs, tokens)):
            self._append(r, token, logprobs.get(i))

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


def _dequantize_once(model) -> None:
    """Packed NVFP4 Linears on CPU keep an fp32 copy of their weight, made now rather than on every call."""
    for m in model.modules():
        if hasattr(m, "cache_dequantized"):
            m.cache_dequantized = True
            m.dequantized_weight()
