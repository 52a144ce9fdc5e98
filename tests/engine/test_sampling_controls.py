"""The sampling controls (logit_bias, min_p, min_tokens, repetition / presence / frequency
penalties, no_stop_trim, the matched stop) against naive per-request references.

The batched adjustment (sala/sampling/controls.py) is compared with a per-token Python
loop written from the definitions; through the engine, greedy decoding with the controls is
compared with the model's full-forward greedy loop that applies the same loop at each step.
"""
import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from sala.checkpoint import load_model
from sala.engine import Engine, InvalidParam, SamplingParams
from sala.engine.request import Request
from sala.sampling import filtered_probs, sample
from sala.sampling.controls import adjust_logits
from sala.tiny import heldout_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = {2, 4}


@pytest.fixture(scope="module")
def model(tiny_sala_dir):
    return load_model(tiny_sala_dir)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return Engine(copy.deepcopy(model), tokenizer, compile=False)


@pytest.fixture(scope="module")
def prompt(tiny_sala_dir, tokenizer):
    stream = tokenizer("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    return stream[:1] + stream[200:230]


def naive_adjust(row: list[float], prompt: list[int], output: list[int], p: SamplingParams, eos: set[int]) -> list[float]:
    """One request's logits after its controls, token by token, from the definitions (vLLM's order)."""
    x = list(row)
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            x[t] = -math.inf
    return x


def fake_request(prompt, output, params) -> Request:
    r = Request(list(prompt), params, None, None)
    r.output_ids = list(output)
    return r


def control_cases():
    """Requests with every control, alone and mixed, and none; random logits for them."""
    rng = np.random.default_rng(0)
    vocab = 40
    cases = [
        SamplingParams(),  # no control: the row must come back bitwise unchanged
        SamplingParams(logit_bias={3: 5.0, 7: -100.0, 39: 100.0}),
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=0.4),
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.3, logit_bias={5: 1.0}),
        SamplingParams(max_tokens=30, min_tokens=20, stop_token_ids=[9, 11]),
        SamplingParams(max_tokens=30, min_tokens=20, stop_token_ids=[9], ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=30, min_tokens=3, stop_token_ids=[9]),  # reached: nothing banned
        SamplingParams(temperature=0),
    ]
    reqs = [fake_request(rng.integers(0, vocab, size=rng.integers(1, 12)).tolist(),
                         rng.integers(0, vocab, size=rng.integers(0 if i == 1 else 4, 10)).tolist(), p)
            for i, p in enumerate(cases)]
    reqs[3].output_ids, reqs[4].output_ids = [5, 5, 5, 9, 9, 1], [2, 2, 3]  # repeats: frequency counts each one
    logits = torch.from_numpy(rng.normal(size=(len(cases), vocab)).astype(np.float32) * 3)
    return cases, reqs, logits


def test_adjust_logits_matches_the_per_request_reference():
    cases, reqs, logits = control_cases()
    before = logits.clone()
    got = adjust_logits(logits, reqs, EOS)
    assert torch.equal(logits, before), "the caller's logits (for the reported logprobs) must not change"
    for i, (r, p) in enumerate(zip(reqs, cases)):
        want = torch.tensor(naive_adjust(logits[i].tolist(), r.prompt_ids, r.output_ids, p, EOS))
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5, msg=f"row {i}: {p}")
    assert torch.equal(got[0], logits[0]) and torch.equal(got[-1], logits[-1])
    assert adjust_logits(logits, [reqs[0], reqs[-1]], EOS) is logits  # nothing to do: not even a copy


@pytest.mark.gpu
def test_controls_and_seeded_draws_on_cuda_match_cpu():
    """The adjustment runs on the logits' device; the same seeds draw the same tokens there."""
    cases, reqs, logits = control_cases()
    torch.testing.assert_close(adjust_logits(logits.cuda(), reqs, EOS).cpu(), adjust_logits(logits, reqs, EOS))
    for r in reqs:
        r.generator = torch.Generator().manual_seed(11)
    cpu = sample(logits, reqs, EOS)
    for r in reqs:
        r.generator = torch.Generator().manual_seed(11)
    assert sample(logits.cuda(), reqs, EOS) == cpu


def test_min_p_matches_a_numpy_reference():
    rng = np.random.default_rng(1)
    cases = [(1.0, 0.1), (0.7, 0.3), (1.5, 0.0), (1.0, 1.0)]
    logits = rng.normal(size=(len(cases), 50)).astype(np.float32) * 3
    got = filtered_probs(torch.from_numpy(logits), [SamplingParams(temperature=t, min_p=m) for t, m in cases]).numpy()
    for row, (temperature, min_p) in enumerate(cases):
        z = logits[row] / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        p = np.where(p < min_p * p.max(), 0, p)
        np.testing.assert_allclose(got[row], p / p.sum(), atol=1e-6)


def reference_greedy(model, prompt, n, p: SamplingParams, eos: set[int]) -> list[int]:
    """Full forward of the whole sequence per token, the naive controls, argmax; stops as the engine does."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float().tolist()
        x = naive_adjust(row, prompt, out, p, eos)
        t = max(range(len(x)), key=x.__getitem__)
        out.append(t)
        ids.append(t)
        if (t in eos and not p.ignore_eos) or t in p.stop_token_ids:
            break
    return out


def test_greedy_with_penalties_and_bias_equals_the_reference(engine, model, prompt):
    plain = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    settings = [dict(repetition_penalty=1.4), dict(presence_penalty=1.0, frequency_penalty=0.8),
                dict(logit_bias={plain[2]: -5.0, 17: 3.0}, frequency_penalty=0.5)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **s) for s in settings]
    got = engine.generate([prompt] * len(params), params)  # one batch: each row its own controls
    for c, p in zip(got, params):
        want = reference_greedy(model, prompt, 16, p, engine.eos_ids)
        print(f"{p.repetition_penalty=} {p.presence_penalty=} {p.frequency_penalty=}: {c.token_ids}")
        assert c.token_ids == want
        assert c.token_ids != plain, "the control changed nothing: the comparison proves little"


def test_logit_bias_forces_and_bans_tokens(engine, prompt):
    forced = 17
    for temperature in (0, 1.0):
        (c,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True,
                                                        logit_bias={forced: 100.0}))
        assert c.token_ids == [forced] * 8
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    banned = {plain[0]: -100.0, plain[1]: -100.0}
    for temperature in (0, 1.0):
        (c,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True,
                                                        logit_bias=banned))
        assert not set(c.token_ids) & set(banned)


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(engine, model, tokenizer):
    """A chat prompt tiny-sala answers briefly, ending at <|im_end|>: with min_tokens past that
    point the reply goes on, no stop token inside the first min_tokens, as the masked reference."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is a list?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = engine.encode(text)
    (short,) = engine.generate([ids], SamplingParams(max_tokens=60, temperature=0))
    assert short.finish_reason == "stop" and short.matched in engine.eos_ids
    k = len(short.token_ids) + 4
    p = SamplingParams(max_tokens=60, temperature=0, min_tokens=k)
    (c,) = engine.generate([ids], p)
    assert len(c.token_ids) > k and not set(c.token_ids[:k]) & engine.eos_ids
    assert c.token_ids == reference_greedy(model, ids, 60, p, engine.eos_ids)[: len(c.token_ids)]
    # A stop string found in the first tokens is not one until min_tokens.
    stop = short.text[:4]
    assert stop.strip()
    (early,) = engine.generate([ids], SamplingParams(max_tokens=60, temperature=0, stop=[stop]))
    assert early.text == "" and early.matched == stop
    (held,) = engine.generate([ids], SamplingParams(max_tokens=60, temperature=0, stop=[stop], min_tokens=k))
    assert len(held.token_ids) >= k


def test_no_stop_trim_keeps_the_stop_and_matched_names_it(engine, prompt):
    (plain,) = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stop = plain.text[len(plain.text) // 2: len(plain.text) // 2 + 3]
    assert stop.strip()
    cut = plain.text.index(stop)
    (trimmed,) = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    (kept,) = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop],
                                                       no_stop_trim=True))
    assert trimmed.text == plain.text[:cut] and kept.text == plain.text[: cut + len(stop)]
    assert trimmed.matched == kept.matched == stop
    token = plain.token_ids[5]
    first = plain.token_ids.index(token)
    (by_token,) = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[token], no_stop_trim=True))
    assert by_token.matched == token and by_token.token_ids == plain.token_ids[: first + 1]
    assert by_token.text == engine.tokenizer.decode(plain.token_ids[: first + 1])  # the stop token's text kept
    (length,) = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert length.matched is None


def test_seeded_sampling_with_controls_does_not_depend_on_the_batch(model, tokenizer, prompt):
    def run(prompts, params):
        return [c.token_ids for c in Engine(copy.deepcopy(model), tokenizer, batch_invariant=True).generate(prompts, params)]

    p = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True, min_p=0.05, repetition_penalty=1.3,
                       presence_penalty=0.5, logit_bias={17: 2.0})
    alone = run([prompt], [p])[0]
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=1, ignore_eos=True)
    assert run([prompt[:5], prompt, prompt[3:]], [other, p, replace(p, seed=9)])[1] == alone


def test_sample_bans_stop_tokens_until_min_tokens_for_every_draw():
    """4000 seeded draws from a distribution that puts nearly all its mass on eos: none is eos."""
    logits = torch.zeros(1, 10)
    logits[0, 2] = 20.0
    params = SamplingParams(max_tokens=5, min_tokens=2)
    reqs = [Request([1], params, None, None, generator=torch.Generator().manual_seed(s)) for s in range(4000)]
    assert 2 not in sample(logits.expand(4000, -1), reqs, {2})
    reqs[0].output_ids = [5, 6]
    assert sample(logits, reqs[:1], {2}) == [2]


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("min_p", -0.1), ("min_tokens", 99), ("min_tokens", -1),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", math.nan),
                                          ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("logit_bias", {10**6: 1.0}), ("logit_bias", {3: 101.0}),
                                          ("logit_bias", {3: math.nan}), ("temperature", math.inf)])
def test_bad_control_values_name_the_field(field, value):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(max_tokens=16, **{field: value}).validate(vocab_size=100)
    assert e.value.param == field

