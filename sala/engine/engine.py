"""The engine: requests in, tokens out, one `step` at a time.

`Engine` is synchronous and single-threaded: `add_request`, then call `step()` until
`has_work()` is false (or use `generate` for a list of prompts). A step is three calls: the
scheduler picks a batch (sala/engine/scheduler.py), the runner runs it through the model
(sala/engine/runner.py), and `postprocess` hands each request what it gained. `AsyncEngine`
(sala/engine/async_engine.py) runs that loop in a thread for servers.

Who owns what: one frozen EngineConfig (sala/engine/config.py) reaches every part; the cache
pool owns pages, state slots and the prefix cache (sala/engine/cache.py); the decoding strategy
(sala/engine/decoding.py: plain, or Medusa with heads) says what a decoding request puts in a
step and gains from it.
"""
from __future__ import annotations

import copy
import functools
import logging
import random
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kernels.target import require_supported
from sala.engine.cache import CachePool
from sala.engine.config import EngineConfig
from sala.engine.decoding import Emitted, PlainDecoding, StepOutput, draw
from sala.engine.detokenizer import IncrementalDetokenizer
from sala.engine.medusa_decoding import MedusaDecoding
from sala.engine.request import Completion, Request, RequestOutput
from sala.engine.runner import ModelRunner
from sala.engine.scheduler import Schedule, Scheduler
from sala.engine.stats import EngineInfo, EngineStats, LayerBytes, PrefixStats
from sala.kv import PLAN_FILE, load_plan
from sala.sampling import InvalidParam, SamplingParams, TokenLogprob, token_logprobs
from sala.structured import Grammars
from sala.text_markers import template_text

log = logging.getLogger(__name__)
FINISH_REASONS = ("stop", "length", "cancelled")


def stop_token_ids(model, tokenizer) -> set[int]:
    """Tokens that end a request (unless ignore_eos): the eos ids of config.json, generation_config
    and the tokenizer, as vLLM takes them, plus the chat template's turn markers, so a chat reply
    ends at the template's end-of-turn or start-of-turn marker instead of running on into the next
    turn (a ChatML model that forgets <|im_end|> still begins a turn with <|im_start|>)."""
    ids: set[int] = set()
    for eos in (model.config.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                tokenizer.eos_token_id):
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids | turn_markers(tokenizer)


def turn_markers(tokenizer) -> set[int]:
    """The special tokens the chat template writes around a plain exchange (a user turn, an
    assistant turn, the generation prompt): its turn markers, not the tokens it writes only for
    tool calls (<|tool_call|>) or reasoning, which an output goes on after. A template that
    refuses that exchange: every special token its text names."""
    try:
        text = "".join(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                       for messages, prompt in (([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                                 False), ([{"role": "user", "content": "x"}], True)))
    except Exception:  # no template, or one that raises for this exchange (jinja's errors, transformers' ValueError)
        text = template_text(tokenizer.chat_template)
    return {i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if t in text}


@dataclass
class Counts:
    """Running totals for monitoring: prompt tokens on add, tokens generated and finishes by the step thread."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason


class Engine:
    """`Engine(model, tokenizer, **settings)` serves a loaded model (its projections are fused
    in place); `Engine.from_pretrained(path, **settings)` loads one. The settings are
    EngineConfig's (sala/engine/config.py); `medusa`: MedusaHeads (sala/medusa/heads.py) to
    decode by tree verify."""

    def __init__(self, model, tokenizer, *, medusa=None, **settings):
        settings = EngineConfig(**settings)
        device = next(model.parameters()).device
        require_supported(device)
        model.model.fuse_projections()  # one GEMM for q/k/v/gate and for gate/up, a layer at a time
        self.config = config = settings.resolve(model, medusa.tree.num_nodes if medusa is not None else None)
        _check_medusa(config, medusa)
        log.info("%s; %s", config.memory.describe(), config.kv_plan.describe())
        self.model, self.tokenizer = model, tokenizer
        self.cache = CachePool(config)
        self.runner = ModelRunner(config, model, self.cache)
        self.decoding = PlainDecoding(config, self.runner) if medusa is None else MedusaDecoding(config, medusa, self.runner)
        self.scheduler = Scheduler(config, self.cache, self.decoding)
        self.eos_ids = stop_token_ids(model, tokenizer)
        self.counts = Counts()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                        kv_plan=None, medusa: bool | str | Path | None = None, medusa_tree: list[list[int]] | None = None,
                        **kwargs) -> Engine:
        """A checkpoint directory; its kv_plan.json is used unless `kv_plan` (path or dict) is given.
        medusa: None serves the checkpoint's `medusa/` heads when it has them, False never, True
        requires them, a path loads heads from there; medusa_tree replaces the saved tree."""
        from sala.checkpoint import CheckpointError, load_model, load_tokenizer  # BF16, or NVFP4 through the W4A16 path
        from sala.medusa.heads import has_medusa, load_heads

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available (torch {torch.__version__}); use device='cpu'")
        require_supported(device)  # before minutes of loading weights
        EngineConfig(**kwargs)  # and bad settings
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
        return cls(model, load_tokenizer(path), kv_plan=kv_plan, medusa=heads, **kwargs)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling (CPU) or capturing (CUDA) the decoding's fast paths so far; None before any."""
        seconds = [s.seconds for s in self.decoding.compiled_steps() if s.seconds is not None]
        return sum(seconds) if seconds else None

    def info(self) -> EngineInfo:
        """The engine's settings, fixed for its life."""
        c, kv, model = self.config, self.config.kv_plan, self.model.config
        layers = [LayerBytes(i, "sparse", kv.kv[i], "token", b) for i, b in kv.kv_bytes_per_token(model).items()]
        layers += [LayerBytes(i, "lightning", kv.state[i], "sequence", b) for i, b in kv.state_bytes_per_seq(model).items()]
        return EngineInfo(device=str(c.device), max_model_len=c.max_model_len, vocab_size=model.vocab_size,
                          max_seqs=c.max_seqs, num_pages=c.memory.num_pages, page_size=c.page_size,
                          max_batch_tokens=c.max_batch_tokens, max_waiting=c.max_waiting,
                          compiled_decode=bool(self.decoding.compiled_steps()),
                          kv_bytes_per_token=c.memory.kv_bytes_per_token, state_bytes_per_seq=c.memory.state_bytes_per_seq,
                          layers=tuple(layers))

    def stats(self) -> EngineStats:
        """Counters and queues now (on the step thread; AsyncEngine.stats from an event loop)."""
        prefix = None
        if p := self.cache.prefix:
            prefix = PrefixStats(queried_tokens=p.num_queried_tokens, hit_tokens=p.num_hit_tokens,
                                 evictable_pages=p.num_evictable, evicted_pages=p.num_evicted_pages,
                                 snapshot_bytes=p.num_snapshots * p.snapshot_bytes,
                                 snapshot_capacity_bytes=p.max_snapshots * p.snapshot_bytes)
        return EngineStats(waiting=self.scheduler.num_waiting, running=len(self.scheduler.running),
                           free_pages=len(self.cache.free_pages), prompt_tokens=self.counts.prompt_tokens,
                           generated_tokens=self.counts.generated_tokens, preemptions=self.num_preemptions,
                           finished={r: self.counts.finished[r] for r in FINISH_REASONS}, prefix=prefix,
                           speculation=self.decoding.stats())

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix page no request holds (SGLang's /flush_cache); how many went."""
        return self.cache.flush_prefix()

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a request could take from the prefix cache now."""
        return self.cache.prefix.resumable_len(tokens) if self.cache.prefix else 0

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The structured-output constraints compiled for this engine's vocabulary (made on the first one)."""
        return Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_ids)

    def warmup(self) -> None:
        """Compile (CPU) or capture (CUDA) the decoding's steps now, not on the first request (and
        with medusa_nodes="auto" time them); servers and batch jobs call this at start-up.
        The requests it runs are not counted in the engine's totals."""
        with self._uncounted():
            self.decoding.warmup(self, [self.model.config.bos_token_id or 0],
                                 SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))

    @contextmanager
    def _uncounted(self):
        """Leave the engine's running totals as they were (warmup's requests are not traffic)."""
        saved = copy.deepcopy((self.counts, self.scheduler.num_preemptions, self.decoding.totals))
        try:
            yield
        finally:
            self.counts, self.scheduler.num_preemptions, self.decoding.totals = saved

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (text through the tokenizer, with its special tokens unless told
        otherwise); InvalidParam("prompt") for text no tokenizer takes or ids outside the vocabulary."""
        if isinstance(prompt, str):
            try:
                prompt.encode()
            except UnicodeEncodeError as e:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
                raise InvalidParam("prompt", f"prompt is not valid Unicode: {e.reason} at character {e.start}") from None
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if not all(isinstance(t, int) and 0 <= t < self.model.config.vocab_size for t in prompt):
            raise InvalidParam("prompt", f"token ids must be integers in [0, {self.model.config.vocab_size})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    on_output: Callable[[RequestOutput], None] | None = None, request_id: str | None = None) -> Request:
        """Queue a request, whose outputs go to `on_output` after each step that advances it (None:
        none are made; `Engine.generate` reads the finished requests). Raises InvalidParam for bad
        input and QueueFull when the queue is at its limit."""
        params.validate(self.model.config.vocab_size)
        ids = self.encode(prompt)
        if not ids:
            raise InvalidParam("prompt", "prompt is empty")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise InvalidParam("prompt", f"prompt has {len(ids)} tokens; the model's context is {max_len}")
        if len(ids) + params.max_tokens > min(max_len, self.cache.max_tokens):
            limit = min(max_len, self.cache.max_tokens) - len(ids)
            plan = self.config.memory
            raise InvalidParam("max_tokens", f"max_tokens={params.max_tokens} but the prompt ({len(ids)} tokens) "
                                             f"leaves room for at most {limit}: {len(ids) + params.max_tokens} tokens "
                                             f"need {plan.request_bytes(len(ids) + params.max_tokens) / 2**20:.1f} MiB "
                                             f"(K/V of {len(self.model.config.sparse_layers)} sparse layers, "
                                             f"{plan.page_bytes / plan.page_size:.0f} B a token, plus a "
                                             f"{plan.state_bytes_per_seq / 2**20:.2f} MiB lightning state) and the "
                                             f"cache holds {plan.max_kv_tokens} tokens "
                                             f"({plan.num_pages * plan.page_bytes / 2**20:.1f} MiB of K/V)")
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens, params.no_stop_trim)
        req = Request(ids, params, detokenizer, on_output)
        if params.structured_outputs is not None:  # compiled here unless compiled before (AsyncEngine.prepare)
            req.grammar = self.grammars.matcher(params.structured_outputs)
        self.decoding.admit(req)
        if request_id:
            req.request_id = request_id
        if params.prompt_logprobs_start is not None:
            req.prompt_logprobs_next = max(params.prompt_logprobs_start - 1, 0)
        if not params.greedy:
            # A CPU generator whatever the device: sampling draws its uniforms here (sala/sampling),
            # so a seed gives the same tokens on CPU and CUDA.
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            # Any integer seeds: torch takes [-2**63, 2**64) and reads a negative one as its two's complement.
            req.generator = torch.Generator(device="cpu").manual_seed(seed % 2**64)
        self.scheduler.add(req)
        self.counts.prompt_tokens += len(ids)
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True  # acted on by the step thread, at the start of the next step

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> None:
        start = time.perf_counter()
        for r in self.scheduler.pop_cancelled():
            self._emit(r, [], None, "cancelled")
        batch = self.scheduler.schedule()
        if batch.num_tokens:
            out = self.runner.run(batch)
            for gained in self.postprocess(batch, out):
                self._append(gained)
            self.decoding.took(batch, time.perf_counter() - start)

    def postprocess(self, batch: Schedule, out: StepOutput) -> list[Emitted]:
        """What each request gained from the step. Its tokens are in the cache first (the prefix
        cache takes in their pages before a request can finish and give them back), then each
        decoding request's tokens (the step's decoding), each ended prompt's first token, and
        the prompt tokens scored."""
        for r, _, end in batch.prefills:
            r.num_computed = end
        decoded = batch.decoding.emit(batch.decodes, out, self.eos_ids)
        self.cache.after_step([r for r, _, _ in batch.prefills] + batch.decodes)
        if out.prompt_targets:
            scored = token_logprobs(out.prompt_logits, [t for _, t in out.prompt_targets],
                                    [r.params.logprobs or 0 for r, _ in out.prompt_targets])
            for (r, _), lp in zip(out.prompt_targets, scored):
                r.prompt_logprobs.append(lp)
        return decoded + draw(out.sampled, out.logits, self.eos_ids)

    def _append(self, gained: Emitted) -> None:
        """A request's new tokens, one output each, up to the one that finishes it."""
        r, p = gained.request, gained.request.params
        for token, lp in zip(gained.tokens, gained.logprobs):
            r.output_ids.append(token)
            if r.grammar is not None:
                r.grammar.accept(token)
            self.counts.generated_tokens += 1
            r.first_token_at = r.first_token_at or time.perf_counter()
            if lp is not None:
                r.logprobs.append(lp)
            reason = None
            # min_tokens: the sampler kept stop tokens out until then; stop strings count only from then on.
            # A constrained request ends where its grammar does, at a stop token, whatever ignore_eos says.
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids or (r.grammar and r.grammar.terminated):
                reason, r.matched = "stop", token
                if p.no_stop_trim:  # the stop token's text stays (when it is not a skipped special token)
                    r.detokenizer.append(token, check_stop=False)
            elif (matched := r.detokenizer.append(token, check_stop=len(r.output_ids) >= p.min_tokens)) is not None:
                reason, r.matched = "stop", matched
            elif len(r.output_ids) >= p.max_tokens:
                reason = "length"
            self._emit(r, [token], lp, reason)
            if reason:
                return

    def _emit(self, r: Request, tokens: list[int], lp: TokenLogprob | None, reason: str | None) -> None:
        if reason:
            r.finish_reason = reason
            self.counts.finished[reason] += 1
            self.scheduler.finish(r)
        if r.on_output is None:
            return
        first = len(r.output_ids) == 1 and bool(tokens)
        r.on_output(RequestOutput(request_id=r.request_id, token_ids=tokens, text=r.detokenizer.delta(reason is not None),
                                  logprobs=[lp] if lp else [], prompt_logprobs=r.prompt_logprobs if first else [],
                                  finished=reason is not None, finish_reason=reason, num_prompt_tokens=len(r.prompt_ids),
                                  num_output_tokens=len(r.output_ids), num_cached_tokens=r.cached_prompt_tokens,
                                  matched=r.matched if reason else None, spec=r.spec.copy() if r.spec else None))

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
            while pending and self.scheduler.num_waiting < self.config.max_waiting:
                reqs.append(self.add_request(*pending.popleft()))
            self.step()
        return [r.completion() for r in reqs]


def _check_medusa(config: EngineConfig, medusa) -> None:
    """The settings that need Medusa heads, or cannot have them."""
    if medusa is None:
        for name, default in (("medusa_nodes", "auto"), ("medusa_max_batch", None)):
            if (value := getattr(config, name)) != default:
                raise ValueError(f"{name}={value!r} was given but Medusa is off (no heads)")
    elif config.batch_invariant:
        raise ValueError("Medusa tree verify has no batch-invariant mode: pass medusa=None (or medusa=False to "
                         "from_pretrained) for the evaluation mode")
    elif config.memory.compressed_bytes_per_page:
        raise ValueError(f"Medusa tree verify does not run InfLLM-v2's sparse path yet: with Medusa, max_model_len "
                         f"({config.max_model_len}) must stay at or below sparse_config.dense_len "
                         f"({config.model.sparse_config['dense_len']})")

