"""The engine's parts built the way Engine builds them, on a small random SALA model, for the
unit tests of each part (no tokenizer, no checkpoint: seconds, not minutes)."""
from dataclasses import dataclass

import torch

from sala.engine.cache import CachePool
from sala.engine.config import EngineConfig
from sala.engine.decoding import PlainDecoding
from sala.engine.medusa_decoding import MedusaDecoding
from sala.engine.request import Request
from sala.engine.runner import ModelRunner
from sala.engine.scheduler import Scheduler
from sala.sampling import SamplingParams
from tests.model.test_model import random_model


@dataclass
class Parts:
    config: EngineConfig
    model: object
    cache: CachePool
    runner: ModelRunner
    decoding: PlainDecoding | MedusaDecoding
    scheduler: Scheduler


def build(medusa: bool = False, **settings) -> Parts:
    """The parts of an engine over a random model (with random Medusa heads when `medusa`)."""
    model = random_model()
    heads = random_heads(model) if medusa else None
    model.model.fuse_projections()
    settings = {"compile": False, "prefix_cache": False, "page_size": 16, "max_model_len": 256} | settings
    config = EngineConfig(**settings).resolve(model, heads.tree.num_nodes if heads is not None else None)
    cache = CachePool(config)
    runner = ModelRunner(config, model, cache)
    decoding = PlainDecoding(config, runner) if heads is None else MedusaDecoding(config, heads, runner)
    return Parts(config, model, cache, runner, decoding, Scheduler(config, cache, decoding))


def with_pages(num_pages: int, **settings) -> Parts:
    """build(**settings) with a cache of exactly num_pages K/V pages and max_seqs states."""
    plan = build(**settings).config.memory
    parts = build(memory_bytes=num_pages * plan.page_bytes + plan.max_seqs * plan.state_bytes_per_seq, **settings)
    assert parts.cache.plan.num_pages == num_pages and parts.config.max_seqs == plan.max_seqs
    return parts


def timed(decoding, ms: dict[int, float]) -> None:
    """A Medusa decoding's choice given step times (candidate -> ms) for every kind of batch and
    batch size class, as if read from the disk cache."""
    from sala.engine.tree_choice import TIMED, Running

    decoding.choice.ms = {(kind, 1 << i, nodes): Running(t, TIMED) for kind in ("greedy", "tempered", "eager")
                          for i in range(decoding.config.max_seqs.bit_length()) for nodes, t in ms.items()}


def request(n_prompt: int, max_tokens: int = 8, first: int = 1, **params) -> Request:
    return Request(list(range(first, first + n_prompt)), SamplingParams(**{"max_tokens": max_tokens, "temperature": 0} | params),
                   None, lambda out: None)


def prefill(p: Parts, reqs: list[Request]) -> None:
    """One step over the prompts of `reqs` (all of them within its budget): each request's first
    token is its argmax, and with Medusa its drafts are made, as the engine's postprocess would."""
    for r in reqs:
        p.scheduler.add(r)
    batch = p.scheduler.schedule()
    out = p.runner.run(batch)
    assert [c.end for c in batch.prefills] == [len(r.prompt_ids) for r in reqs]
    for r, _, end in batch.prefills:
        r.num_computed = end
    batch.decoding.emit([], out, set())
    for r, logits in zip(out.sampled, out.logits):
        r.output_ids.append(int(logits.argmax()))


def random_heads(model, seed: int = 0):
    """Four heads' top-4 drafts in a six-node tree (paths up to depth 3)."""
    from sala.medusa.heads import MedusaConfig, MedusaHeads

    torch.manual_seed(seed)
    c = model.config
    return MedusaHeads(MedusaConfig(c.hidden_size, c.vocab_size, tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], topk=4),
                       model.lm_head).eval()
