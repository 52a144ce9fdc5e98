"""The engine's InfLLM-v2 path: paged K/V with compressed keys kept by page, chunked prefill of
long prompts, sparse decode, against transformers' one-shot prefill and cached decode."""
import contextlib
import copy

import pytest
import torch

from sala.checkpoint import load_model
from sala.config import SALAConfig
from sala.engine import Engine, SamplingParams
from sala.engine.memory import plan_memory
from sala.kv import default_plan
from sala.model import SALAForCausalLM
from sala.sampling import InvalidParam

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# tiny-sala's weights with a short dense_len: requests past 256 tokens go sparse, and late
# queries see 5 blocks of up to 16: the init block, the local one, their own and 2 by score.
SPARSE = {"block_size": 64, "dense_len": 256, "init_blocks": 1, "kernel_size": 32, "kernel_stride": 16,
          "topk": 4, "window_size": 64}
N_NEW = 12
# Measured: engine logprobs differ from transformers' by at most ~3e-6 here (chunked vs one-shot
# lightning forms, fused GEMMs); a selection that differs by one block moves them by > 1e-2.
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_sala_dir):
    tiny = load_model(tiny_sala_dir)
    config = SALAConfig.from_dict({**tiny.config.to_dict(), "sparse_config": SPARSE})
    m = SALAForCausalLM(config).eval()
    m.load_state_dict(tiny.state_dict())
    return m


def prompt(n, seed):
    return torch.randint(3, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def transformers_greedy(model, ids, n):
    """One-shot prefill, then cached one-token decode steps (the official call pattern)."""
    out = model(torch.tensor([ids]), use_cache=True)
    cache, tokens, logprobs = out.past_key_values, [], []
    for _ in range(n):
        lp = torch.log_softmax(out.logits[0, -1], -1)
        tokens.append(int(lp.argmax()))
        logprobs.append(float(lp.max()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
    return tokens, logprobs


def engine_greedy(model, tokenizer, prompts, **kw):
    engine = Engine(copy.deepcopy(model), tokenizer, max_model_len=1024, **kw)
    assert engine.cache.compressed
    done = engine.generate([p for p, _ in prompts],
                           [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0) for _, n in prompts])
    if kw.get("compile"):  # dense decode steps ran compiled, the window upkeep inside the graph
        assert engine.compile_seconds is not None and not engine.decoding.fast_decode.failed
    return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in done]


# (prompt tokens, seed, new tokens): prompts past dense_len, one (639 % 64 == 63) with the
# kernel's one-fewer K1 and K2 windows in its prompt rows; a short prompt whose decode runs
# dense (compiled, when asked) and then sparse, over windows made by those decode steps.
PROMPTS = [(600, 0, N_NEW), (639, 1, N_NEW), (40, 2, 400)]


def requests():
    return [(prompt(n, s), new) for n, s, new in PROMPTS]


@pytest.fixture(scope="module")
def reference(model):
    return [transformers_greedy(model, p, new) for p, new in requests()]


@pytest.mark.parametrize("settings", [dict(max_batch_tokens=128, compile=False), dict(max_batch_tokens=1024, compile=False),
                                      dict(max_batch_tokens=96, compile=True)],
                         ids=["chunked", "one-shot", "chunked+compiled-decode"])
def test_engine_sparse_path_equals_transformers(model, tokenizer, reference, settings):
    # Compiled: another compiled engine in this process first, over a pool without compressed keys,
    # and dynamo allowed one graph per function: this engine must still run its own graph (once it
    # ran the first engine's, without the window upkeep: logprobs off by 9e-2).
    with torch._dynamo.config.patch(recompile_limit=1) if settings["compile"] else contextlib.nullcontext():
        if settings["compile"]:
            short = Engine(copy.deepcopy(model), tokenizer, max_model_len=255, compile=True)
            assert not short.cache.compressed
            short.generate([prompt(8, 4)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            assert short.compile_seconds is not None
        got = engine_greedy(model, tokenizer, requests(), **settings)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, reference):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < TOL


def test_reference_really_is_sparse(model, reference):
    """The same requests attended densely give other logprobs: the tests above would notice a
    dense fallback."""
    dense = copy.deepcopy(model)
    for layer in dense.model.layers:
        if hasattr(layer.self_attn, "sparse"):
            layer.self_attn.sparse = type(layer.self_attn.sparse)(**{**layer.self_attn.sparse.__dict__, "dense_len": 1 << 20})
    tokens, lps = transformers_greedy(dense, *requests()[0])
    assert max(abs(a - b) for a, b in zip(lps, reference[0][1])) > 1e-3


def test_memory_plan_counts_compressed_keys_only_when_reachable(model):
    c = model.config
    kv = default_plan(c, torch.float32)
    short = plan_memory(c, 64 << 20, 4, 255, 64, kv)
    long = plan_memory(c, 64 << 20, 4, 1024, 64, kv)
    assert short.compressed_bytes_per_page == 0
    # 4 K1 + 1 K2 windows a page, fp32, kv heads x head dim, each sparse layer
    assert long.compressed_bytes_per_page == len(c.sparse_layers) * 5 * c.num_key_value_heads * c.head_dim * 4
    assert long.request_bytes(1000) == 16 * long.page_bytes + long.state_bytes_per_seq
    with pytest.raises(ValueError, match="page_size=48 must be a multiple of 64"):
        plan_memory(c, 64 << 20, 4, 1024, 48, kv)


def test_a_request_that_cannot_fit_is_refused_with_the_numbers(model, tokenizer):
    engine = Engine(copy.deepcopy(model), tokenizer, max_model_len=1024, memory_bytes=8 << 20, max_seqs=2, compile=False)
    with pytest.raises(InvalidParam, match=r"need [0-9.]+ MiB \(K/V of 3 sparse layers.*lightning state.*cache holds"):
        engine.add_request(prompt(900, 3), SamplingParams(max_tokens=1000))
    with pytest.raises(InvalidParam, match="context is 1024"):
        engine.add_request(prompt(1100, 3), SamplingParams(max_tokens=1))
