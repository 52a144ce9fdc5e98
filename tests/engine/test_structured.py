"""Structured outputs in the engine (sala/structured.py), against references outside it: greedy
constrained output equals the masked argmax of the plain model's full forward, step by step,
under xgrammar's own matcher (the reference decodes without the engine, its cache or its
masking); sampled outputs parse and validate against their schemas with a JSON-schema
validator library, full-match their regex, fall in their choices; bad constraints are refused
before anything is queued.
"""
import asyncio
import copy
import json
import re

import jsonschema
import pytest
import torch

from sala.checkpoint import load_model
from sala.engine import AsyncEngine, Engine, InvalidParam, SamplingParams, StructuredOutputs
from sala.engine.engine import stop_token_ids
from sala.structured import MAX_CACHED, Grammars
from sala.tiny import heldout_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_NEW = 40
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
}, "required": ["name", "age", "role"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                                "required": ["x", "y"]},
                                      "label": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "exclusiveMinimum": 0},
                                      "note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["ok", "count"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["a", "b"]}}, "required": ["id", "kind"]},
        "maxItems": 2}}, "required": ["items"]},
]
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{2,3}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
CONSTRAINTS = [StructuredOutputs(json=PERSON), StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES),
               StructuredOutputs(grammar=GRAMMAR), StructuredOutputs(json_object=True), None]


@pytest.fixture(scope="module")
def model(tiny_sala_dir):
    return load_model(tiny_sala_dir)


@pytest.fixture(scope="module")
def prompts(tiny_sala_dir, tokenizer):
    """8 prompts of 72 to 111 tokens: a BOS, the same 63 tokens of held-out text (a prefix the
    prefix cache can share), then a held-out window of their own."""
    stream = tokenizer("\n\n".join(heldout_texts(tiny_sala_dir)))["input_ids"]
    return [stream[:64] + stream[100 + 211 * i : 108 + 211 * i + (13 * i) % 40] for i in range(8)]


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed bitmask [W] int32 -> the allowed token ids (bit i % 32 of word i // 32)."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].nonzero()[:, 0]


@torch.no_grad()
def constrained_greedy_reference(model, tokenizer, prompt: list[int], constraint: StructuredOutputs | None, n: int):
    """Masked argmax decoding by the full forward (no cache) and xgrammar's own matcher, until the
    grammar ends or n tokens; an unconstrained request stops at eos."""
    import xgrammar as xgr

    vocab, stops = model.config.vocab_size, stop_token_ids(model, tokenizer)
    matcher = None
    if constraint is not None:
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=sorted(stops)))
        kind = constraint.kind
        grammar = (compiler.compile_json_schema(constraint.json, any_whitespace=False) if kind == "json" else
                   compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
                   if kind == "json_object" else compiler.compile_regex(constraint.regex) if kind == "regex" else
                   compiler.compile_grammar(" | ".join(json.dumps(c) for c in constraint.choice).join(["root ::= ", ""]))
                   if kind == "choice" else compiler.compile_grammar(constraint.grammar))
        matcher = xgr.GrammarMatcher(grammar)
    ids, out = list(prompt), []
    while len(out) < n:
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        if matcher is not None:
            mask = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(mask)
            allowed = allowed_ids(mask[0], vocab)
            token = int(allowed[logits[allowed].argmax()])
            assert matcher.accept_token(token)
        else:
            token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if (matcher is not None and matcher.is_terminated()) or (matcher is None and token in stops):
            break
    return out


def params_for(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=N_NEW, temperature=0, structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)], **kw)


SETTINGS = {
    "batch 1": dict(max_seqs=1),
    # The shared 64 tokens end a snapshot interval: later requests resume after them.
    "batch 8": dict(max_seqs=8, page_size=16, prefix_snapshot_interval=64),
    "preempted": dict(page_size=16, max_seqs=8, max_model_len=256, memory_bytes=12 * 16 * 1536 + 8 * 81920),
    "evaluation mode": dict(max_seqs=8, batch_invariant=True),
}


def test_greedy_constrained_output_is_the_masked_argmax_of_the_full_forward(model, tokenizer, prompts):
    """Every constraint kind (and an unconstrained request) in one batch, at batch 1 and 8, with
    requests preempted and recomputed, in the evaluation mode, and again with the prefix cache
    warm: token for token the reference's."""
    refs = [constrained_greedy_reference(model, tokenizer, p, CONSTRAINTS[i % len(CONSTRAINTS)], N_NEW)
            for i, p in enumerate(prompts)]
    assert sum(len(r) < N_NEW for r in refs) >= 4, "most constrained references end with their grammar"
    params = [params_for(i) for i in range(len(prompts))]
    for name, settings in SETTINGS.items():
        engine = Engine(copy.deepcopy(model), tokenizer, compile=False, **settings)
        got = engine.generate(prompts, params)
        assert [c.token_ids for c in got] == refs, name
        assert all(c.finish_reason == ("stop" if len(r) < N_NEW else "length") for c, r in zip(got, refs)), name
        if name == "preempted":
            assert engine.num_preemptions > 0
        if name == "batch 8":
            again = engine.generate(prompts, params)
            assert all(c.num_cached_tokens >= 64 for c in again), "the second run resumed from the prefix cache"
            assert [c.token_ids for c in again] == refs, "prefix cache warm"
    text = [tokenizer.decode(r, skip_special_tokens=True) if len(r) < N_NEW else None for r in refs]
    print("greedy outputs:", text)
    assert re.fullmatch(REGEX, text[1]) and text[2] in CHOICES and re.fullmatch(r"\(\d+( \+ \d+)*\)", text[3])
    for t in (text[0], text[6]):  # the schema's outputs that ended within N_NEW tokens
        if t is not None:
            jsonschema.validate(json.loads(t), PERSON)


def test_sampled_outputs_follow_their_constraints(model, tokenizer, prompts):
    """200 requests at temperature 1.0 over five schemas, a regex and a choice: every output that
    ended (not at max_tokens) parses and validates, full-matches, or is one of the choices."""
    kinds = [StructuredOutputs(json=s) for s in SCHEMAS] + [StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES)]
    requests = [(prompts[i % len(prompts)], kinds[i % len(kinds)]) for i in range(200)]
    engine = Engine(copy.deepcopy(model), tokenizer, compile=False, max_seqs=32)
    got = engine.generate([p for p, _ in requests], [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured_outputs=c)
                                                     for i, (_, c) in enumerate(requests)])
    ended = 0
    for i, (c, (_, constraint)) in enumerate(zip(got, requests)):
        if c.finish_reason == "length":
            continue
        ended += 1
        assert c.finish_reason == "stop"
        if constraint.kind == "json":
            value, schema = json.loads(c.text), SCHEMAS[i % len(kinds)]
            jsonschema.validate(value, schema)
            if isinstance(value, dict):  # properties come in the schema's order
                assert list(value) == [k for k in schema["properties"] if k in value], c.text
        elif constraint.kind == "regex":
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES, c.text
    print(f"{ended}/200 ended within 96 tokens")
    assert ended >= 150


BAD = {
    "not JSON": (StructuredOutputs(json="{'type': 'object'}"), "json is not valid JSON"),
    "unknown type": (StructuredOutputs(json={"type": "integr"}), 'Unsupported type "integr"'),
    "unsupported keyword": (StructuredOutputs(json={"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}),
                            "'allOf' at #/properties/a is not supported"),
    "regex": (StructuredOutputs(regex="[a-z"), "invalid regex constraint"),
    "grammar": (StructuredOutputs(grammar="root ::= value"), "invalid grammar constraint"),
    "two at once": (StructuredOutputs(regex="a", choice=["a"]), "got regex, choice"),
    "empty choice": (StructuredOutputs(choice=[]), "choice must be a non-empty list"),
    "too large": (StructuredOutputs(choice=["x" * 40000, "y" * 40000]), "the limit is 65536"),
    "too deep": (StructuredOutputs(json='{"items":' * 20000 + "{}" + "}" * 20000), "nested too deeply"),
}


def test_bad_constraints_are_refused_before_anything_is_queued(model, tokenizer, prompts):
    engine = Engine(copy.deepcopy(model), tokenizer, compile=False)
    for name, (constraint, reason) in BAD.items():
        with pytest.raises(InvalidParam, match=re.escape(reason)) as e:
            engine.add_request(prompts[0], SamplingParams(structured_outputs=constraint))
        assert e.value.param == "structured_outputs" and "\n" not in str(e.value), name
    with pytest.raises(InvalidParam) as e:
        engine.add_request(prompts[0], SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(regex="a+")))
    assert e.value.param == "min_tokens"
    assert not engine.has_work()
    # The same bad constraint again is refused from the cache, and a slow one within the time limit.
    grammars = engine.grammars
    assert grammars.compiling(BAD["regex"][0]) is grammars.compiling(BAD["regex"][0]) and len(grammars.cache) <= MAX_CACHED
    slow = Grammars(tokenizer, model.config.vocab_size, {2}, timeout_s=1e-3)
    wide = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
                                             for i in range(200)}, "required": [f"f{i}" for i in range(200)]}
    with pytest.raises(InvalidParam, match="did not compile within 0.001 s"):
        slow.matcher(StructuredOutputs(json=wide))
    # Through AsyncEngine.prepare (the server's path) the same refusal, and the engine serves on.
    async_engine = AsyncEngine(engine)
    try:
        with pytest.raises(InvalidParam, match="invalid regex constraint"):
            asyncio.run(async_engine.prepare(SamplingParams(structured_outputs=BAD["regex"][0])))
    finally:
        async_engine.close()
    (c,) = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(regex="[0-9]{3}")))
    assert re.fullmatch("[0-9]{3}", c.text) and c.finish_reason == "stop"
