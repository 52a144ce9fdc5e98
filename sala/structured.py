"""Structured outputs: a request's constraint (StructuredOutputs, sala/sampling/params.py) as a
grammar over the model's vocabulary, through xgrammar.

- `Grammars` (one per engine) compiles each distinct constraint once, on a worker thread: never
  on the step loop, so a request whose grammar compiles waits and the others keep stepping.
  The cache is bounded (least recently used first out, failures cached too, so a bad schema
  sent again is refused at once); a constraint that takes longer than `timeout_s` to compile is
  refused (InvalidParam), and an invalid one is refused with xgrammar's reason.
- `Grammar` is one request's matcher. The engine advances it with every token the request
  keeps (Engine._append), once: preemption, recompute, chunked prefill and prefix reuse touch
  the cache, never the output, so it needs nothing from them. Its stop tokens are the engine's.
- A constraint with a reasoning_end holds from the first occurrence of that text on: compiled as
  a structural tag of free text up to it, then the constraint as a format of its own
  (`constraint_format`), as vLLM applies a grammar once the reasoning has ended.
- `masked` applies the bitmasks of a step's constrained rows to a copy of its logits, before
  the logits controls and sampling; `tree_masks` fills one per node of a Medusa draft tree, the
  grammar's state after the node's path (xgrammar's traverse_draft_tree), so that a drafted
  token the grammar forbids is never accepted.

Reported logprobs stay those of the model's raw distribution, as for every other control
(sala/sampling/sampler.py): the mask decides which token is chosen, not what it is reported to
have cost.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from sala.sampling import InvalidParam, StructuredOutputs

COMPILE_TIMEOUT_S = 10.0
MAX_CACHED = 256  # compiled constraints kept
# Compiles at once: one past its time limit runs on (it cannot be stopped) without holding up the others.
COMPILE_THREADS = 4
# JSON-schema keywords a grammar cannot hold an output to (xgrammar accepts and ignores them, or
# they are no context-free language): refused rather than honoured in appearance only.
UNSUPPORTED_KEYWORDS = frozenset({"not", "allOf", "contains", "minContains", "maxContains", "if", "then", "else",
                                  "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "uniqueItems",
                                  "$dynamicRef", "$dynamicAnchor", "$recursiveRef"})
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames")


def xgrammar():
    import xgrammar as xgr  # imported on the first constrained request: it costs ~1 s

    return xgr


class Grammars:
    """The engine's compiled constraints: `compiling(c)` is the future of c's compiled grammar,
    `matcher(c)` a fresh Grammar for a request (waiting at most timeout_s for the compile)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int], timeout_s: float = COMPILE_TIMEOUT_S,
                 max_cached: int = MAX_CACHED):
        xgr = xgrammar()
        self.vocab_size, self.timeout_s, self.max_cached = vocab_size, timeout_s, max_cached
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # the cache is ours, bounded
        # JSON has no raw control character anywhere (inside strings they are escaped, and our JSON
        # grammars write no whitespace but spaces), yet xgrammar's strings with a length bound let
        # them through: JSON constraints also mask every token holding one.
        vocab = self.info.decoded_vocab[:vocab_size]
        self.json_tokens = packed([not any(b < 0x20 for b in piece) for piece in vocab] + [False] * (vocab_size - len(vocab)))
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="sala-grammar")
        self.cache: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self.lock = threading.Lock()

    def compiling(self, c: StructuredOutputs) -> Future:
        """The compile of c: cached, or started now on the worker thread."""
        with self.lock:
            if (future := self.cache.get(c)) is not None:
                self.cache.move_to_end(c)
                return future
            future = self.cache[c] = self.pool.submit(self._compile, c)
            while len(self.cache) > self.max_cached:
                self.cache.popitem(last=False)
            return future

    def compiled(self, c: StructuredOutputs):
        """c's compiled grammar; InvalidParam where it is invalid or slower than timeout_s to compile."""
        try:
            return self.compiling(c).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self.too_slow(c) from None

    def too_slow(self, c: StructuredOutputs) -> InvalidParam:
        return InvalidParam("structured_outputs", f"the {c.kind} constraint did not compile within {self.timeout_s:g} s; "
                                                  "simplify it")

    def matcher(self, c: StructuredOutputs) -> Grammar:
        json_only = c.kind in ("json", "json_object") and c.reasoning_end is None  # reasoning has newlines
        return Grammar(xgrammar().GrammarMatcher(self.compiled(c)), self.json_tokens if json_only else None)

    def _compile(self, c: StructuredOutputs):
        try:
            if c.kind == "json":
                unsupported_keyword(json.loads(c.json))
            if c.reasoning_end is not None:
                return self.compiler.compile_structural_tag(structural_tag(after_reasoning(c.reasoning_end,
                                                                                           constraint_format(c))))
            if c.kind == "json":
                return self.compiler.compile_json_schema(c.json, any_whitespace=False)
            if c.kind == "json_object":
                return self.compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
            if c.kind == "regex":
                return self.compiler.compile_regex(c.regex)
            if c.kind == "choice":
                alternatives = " | ".join(_gbnf_string(s) for s in c.choice)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if c.kind == "structural_tag":
                return self.compiler.compile_structural_tag(c.structural_tag)
            return self.compiler.compile_grammar(c.grammar)
        except InvalidParam:
            raise
        except RecursionError:
            raise InvalidParam("structured_outputs", f"the {c.kind} constraint is nested too deeply") from None
        except Exception as e:  # xgrammar's parse and conversion errors
            raise InvalidParam("structured_outputs", f"invalid {c.kind} constraint: {one_line(e)}") from None


ANY_OBJECT = '{"type": "object"}'  # json_object: any object, what strict mode would close left open
# An EBNF token as xgrammar prints its grammars: a string literal, a character class, a name, or
# any other character (operators, parentheses, spaces).
EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)
CONTROL = "\\0-\\x1f"  # raw control characters, as a character class writes them


def json_grammar(schema: str, strict: bool = True) -> str:
    """The EBNF of JSON valid for `schema` (JSON text), written as the json constraint writes it
    (compact: ", " and ": " the only whitespace): xgrammar's own conversion, as text, to put
    into a structural tag. InvalidParam for a schema it cannot convert, or one holding a keyword
    no grammar enforces."""
    try:
        unsupported_keyword(json.loads(schema))
        ebnf = str(xgrammar().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    except InvalidParam:
        raise
    except RecursionError:
        raise InvalidParam("structured_outputs", "the schema is nested too deeply") from None
    except Exception as e:  # xgrammar's conversion errors: the reason, in one line
        raise InvalidParam("structured_outputs", f"invalid JSON schema: {one_line(e)}") from None
    # A string with a length bound lets raw control characters in (the json constraint masks
    # their tokens, which a structural tag's free text needs): JSON has none, json.loads refuses them.
    return "".join(f"[^{CONTROL}{t[2:]}" if t.startswith("[^") and CONTROL not in t else t for t in EBNF_TOKEN.findall(ebnf))


def constraint_format(c: StructuredOutputs) -> dict:
    """The constraint as a format of xgrammar's structural tags, the same language it compiles to alone."""
    if c.kind == "json":
        return {"type": "grammar", "grammar": json_grammar(c.json)}
    if c.kind == "json_object":
        return {"type": "grammar", "grammar": json_grammar(ANY_OBJECT, strict=False)}
    if c.kind == "regex":
        return {"type": "regex", "pattern": c.regex}
    if c.kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": s} for s in c.choice]}
    if c.kind == "structural_tag":
        return json.loads(c.structural_tag)["format"]
    return {"type": "grammar", "grammar": c.grammar}


def after_reasoning(end: str, constraint: dict) -> dict:
    """A format: free text up to `end` (the reasoning, the output starting inside it), then
    `constraint`. The reasoning holds none of what starts the constraint's tagged regions (its
    triggers: a tool call comes after the reasoning) nor what its free text may not hold."""
    excludes = [end, *constraint.get("triggers", []), *constraint.get("excludes", [])]
    return {"type": "sequence", "elements": [{"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": excludes},
                                              "end": end}, constraint]}


def structural_tag(format: dict) -> str:
    """xgrammar's structural tag of a format, as JSON text."""
    return json.dumps({"type": "structural_tag", "format": format}, ensure_ascii=False)


def one_line(e: Exception) -> str:
    """An xgrammar error's reason, in one line, without its C++ source location."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", " ".join(str(e).split())) or type(e).__name__


def unsupported_keyword(schema, path: str = "#") -> None:
    """InvalidParam naming the first keyword of UNSUPPORTED_KEYWORDS in the schema, and where."""
    if not isinstance(schema, dict):
        return
    if bad := sorted(UNSUPPORTED_KEYWORDS & schema.keys()):
        raise InvalidParam("structured_outputs", f"JSON-schema keyword {bad[0]!r} at {path} is not supported: a grammar "
                                                 "cannot hold the output to it")
    for key in SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            unsupported_keyword(sub, f"{path}/{key}/{name}")
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            unsupported_keyword(sub, f"{path}/{key}/{i}")
    for key in SCHEMA_ONE:
        unsupported_keyword(schema.get(key), f"{path}/{key}")


def _gbnf_string(s: str) -> str:
    """A GBNF string literal of s."""
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


def packed(allowed: list[bool]) -> torch.Tensor:
    """Token flags -> one row of xgrammar's packed bitmask [ceil(V / 32)] int32 (bit j of word w:
    token 32 w + j), in tensor ops: a Python step per token cost ~0.3 s on a 73k vocabulary."""
    flags = torch.tensor(allowed, dtype=torch.int64)
    flags = torch.cat([flags, flags.new_zeros(-len(flags) % 32)]).view(-1, 32)
    words = (flags << torch.arange(32)).sum(1)  # < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign


class Grammar:
    """One request's matcher: what may come next, advanced by each token it keeps; `allowed`
    [W]: a bitmask ANDed into each of its rows after xgrammar fills it (None: none)."""

    def __init__(self, matcher, allowed: torch.Tensor | None):
        self.matcher, self.allowed = matcher, allowed

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # every chosen token was allowed by the mask
            raise RuntimeError(f"token {token} was chosen but the request's grammar does not allow it")

    @property
    def terminated(self) -> bool:
        """The grammar has ended (a stop token accepted after a complete output)."""
        return self.matcher.is_terminated()


def bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, xgrammar's packed bitmask (bit j of word w: token 32 w + j
    allowed), uninitialised: a row is read only once a matcher has filled it."""
    return torch.empty(rows, (vocab_size + 31) // 32, dtype=torch.int32)


def masked(logits: torch.Tensor, reqs: list) -> torch.Tensor:
    """logits [n, V], one row per request -> the same with each constrained request's disallowed
    tokens at -inf (a copy; `logits` itself when no request is constrained)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    mask = bitmask(len(reqs), logits.shape[-1])
    grammars = [reqs[i].grammar for i in rows]
    # One call fills every row: a Python call per row cost twice as much at 8 rows.
    batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in grammars], mask, indices=rows)
    for i, g in zip(rows, grammars):
        if g.allowed is not None:
            mask[i] &= g.allowed
    return apply(logits, mask, rows)


@functools.cache
def batch_matcher():
    return xgrammar().BatchGrammarMatcher(max_threads=1)  # the step's thread: a second one only waited on the first


def apply(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of logits [n, V] whose `rows` keep only the tokens their row of mask [n, W] allows
    (xgrammar's apply: its CPU loop, or its CUDA kernel)."""
    out = logits.clone()
    xgrammar().apply_token_bitmask_inplace(out, mask.to(out.device, non_blocking=True),
                                           indices=None if len(rows) == len(out) == len(mask) else rows)
    return out


def tree_links(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree given by parent indices (topologically ordered, the root's -1) as first-child and
    next-sibling indices (-1: none), the form xgrammar's traverse_draft_tree reads."""
    first_child, next_sibling = [-1] * len(parents), [-1] * len(parents)
    last_child: dict[int, int] = {}
    for i, p in enumerate(parents):
        if p < 0:
            continue
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            first_child[p] = i
        last_child[p] = i
    return torch.tensor(first_child, dtype=torch.int64), torch.tensor(next_sibling, dtype=torch.int64)


def tree_masks(grammar: Grammar, links: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor, mask: torch.Tensor,
               first_row: int) -> None:
    """mask[first_row + i] = what may follow node i of a draft tree whose tokens are `tokens` [T]
    (the root's already accepted), for every node the grammar allows; a node it forbids, and
    what hangs below it, allows nothing."""
    view = mask[first_row : first_row + len(tokens)]
    view.zero_()
    grammar.matcher.traverse_draft_tree(*links, tokens.to("cpu", torch.int64), view)
    if grammar.allowed is not None:
        view &= grammar.allowed
