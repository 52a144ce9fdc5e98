"""Logprobs from an HTTP server, for sala.eval.logprob: our server, SGLang, or any OpenAI-compatible one.

    api="sglang" (also ours): POST /generate with input_ids, return_logprob, top_logprobs_num and
        logprob_start_len; input_top_logprobs / output_top_logprobs as [logprob, token_id, text].
    api="openai" (vLLM, ours): POST /v1/completions with token-id prompts, echo, logprobs: k and
        vLLM's return_tokens_as_token_ids, so tokens come back as ids, never as ambiguous text.

The tokenizer is fingerprinted through /tokenize (vLLM and SGLang both have it), which also
gives the context length. Standard library and numpy only: no torch on a scoring client.
Connection failures, timeouts and 5xx answers are retried a bounded number of times; a 4xx or
an answer of the wrong shape is a SourceError naming the server and what it said.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np

from sala.eval.logprob import TOKENIZER_PROBE, Identity, SourceError, TopLogprobs, tokenizer_hash

APIS = ("sglang", "openai")


class HTTPSource:
    def __init__(self, url: str, api: str = "sglang", *, model: str | None = None, api_key: str | None = None,
                 vocab_size: int | None = None, timeout: float = 120.0, retries: int = 3, backoff: float = 1.0):
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        self.url, self.api, self.model, self.api_key = url.rstrip("/"), api, model, api_key
        self.vocab_size, self.timeout, self.retries, self.backoff = vocab_size, timeout, retries, backoff
        self._identity: Identity | None = None

    # ------------------------------------------------------------------------ transport
    def request(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    payload = r.read()
                break
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    text = text[:500]
                if e.code < 500 and e.code != 429:
                    raise SourceError(f"{self.url}{path} refused the request: HTTP {e.code}: {text}") from None
                last = f"HTTP {e.code}: {text}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        else:
            raise SourceError(f"{self.url}{path} did not answer after {self.retries + 1} tries "
                              f"(timeout {self.timeout:g} s each): {last}")
        try:
            return json.loads(payload)
        except ValueError:
            raise SourceError(f"{self.url}{path} answered something that is not JSON: {payload[:200]!r}") from None

    def _model(self) -> dict:
        return {"model": self.model} if self.model else {}

    # ------------------------------------------------------------------------- identity
    def identity(self) -> Identity:
        if self._identity is None:
            tok = self.request("POST", "/tokenize", {**self._model(), "prompt": TOKENIZER_PROBE})
            if not isinstance(tok, dict) or not isinstance(tok.get("tokens"), list):
                raise SourceError(f"{self.url}/tokenize answered {str(tok)[:200]}, not {{tokens, max_model_len}}")
            name, vocab = self.model, self.vocab_size
            try:
                models = self.request("GET", "/v1/models")["data"]
                entry = next((m for m in models if m["id"] == self.model), models[0])
                name, vocab = name or entry["id"], vocab or entry.get("vocab_size")
            except (SourceError, KeyError, IndexError, TypeError):
                pass  # a bare SGLang /generate server: the name and vocabulary must then be given
            if not vocab:
                raise SourceError(f"{self.url} does not say its vocabulary size (/v1/models); pass vocab_size")
            self._identity = Identity(name or self.url, tokenizer_hash(tok["tokens"]), int(vocab),
                                      int(tok.get("max_model_len") or 1 << 62))
        return self._identity

    # ---------------------------------------------------------------------------- calls
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[TopLogprobs]:
        if self.api == "sglang":
            body = {"input_ids": sequences, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                    "return_logprob": True, "top_logprobs_num": top_k, "logprob_start_len": min(starts)}
            outs = self._list(self.request("POST", "/generate", body), len(sequences))
            return [self._sglang_entries(o["meta_info"], "input", seq, start, top_k)
                    for o, seq, start in zip(outs, sequences, starts)]
        body = {**self._model(), "prompt": sequences, "echo": True, "logprobs": top_k, "max_tokens": 1, "temperature": 0,
                "return_tokens_as_token_ids": True}
        choices = self._choices(self.request("POST", "/v1/completions", body), len(sequences))
        return [self._openai_entries(c["logprobs"], seq, start, len(seq), top_k) for c, seq, start in zip(choices, sequences, starts)]

    def generate(self, prompts: list[list[int]], max_tokens: int, top_k: int) -> list[tuple[list[int], TopLogprobs]]:
        if self.api == "sglang":
            body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
                    "return_logprob": True, "top_logprobs_num": top_k}
            outs = self._list(self.request("POST", "/generate", body), len(prompts))
            result = []
            for o in outs:
                tokens = [int(t) for t in o["output_ids"]]
                result.append((tokens, self._sglang_entries(o["meta_info"], "output", tokens, 0, top_k)))
            return result
        body = {**self._model(), "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "logprobs": top_k,
                "return_tokens_as_token_ids": True}
        result = []
        for c in self._choices(self.request("POST", "/v1/completions", body), len(prompts)):
            tokens = [self._token_id(t) for t in c["logprobs"]["tokens"]]
            result.append((tokens, self._openai_entries(c["logprobs"], tokens, 0, len(tokens), top_k)))
        return result

    # -------------------------------------------------------------------------- parsing
    def _list(self, answer, n: int) -> list[dict]:
        outs = answer if isinstance(answer, list) else [answer]
        if len(outs) != n or not all(isinstance(o, dict) and "meta_info" in o for o in outs):
            raise SourceError(f"{self.url}/generate answered {len(outs)} results for {n} prompts")
        return outs

    def _choices(self, answer, n: int) -> list[dict]:
        choices = sorted(answer.get("choices", []), key=lambda c: c["index"]) if isinstance(answer, dict) else []
        if len(choices) != n or any(not c.get("logprobs") for c in choices):
            raise SourceError(f"{self.url}/v1/completions answered {len(choices)} choices with logprobs for {n} prompts")
        return choices

    def _token_id(self, text: str) -> int:
        if not isinstance(text, str) or not text.startswith("token_id:"):
            raise SourceError(f"{self.url} answered token text {text!r}, not an id: it must honour vLLM's "
                              f"return_tokens_as_token_ids (or use api='sglang')")
        return int(text.removeprefix("token_id:"))

    def _check_tokens(self, got: list[int], want: list[int]) -> None:
        if got != want:
            raise SourceError(f"{self.url}: the logprobs returned are for tokens {got[:8]}..., not the ones sent "
                              f"({want[:8]}...)")

    def _sglang_entries(self, meta: dict, kind: str, seq: list[int], start: int, top_k: int) -> TopLogprobs:
        tokens, tops = meta.get(f"{kind}_token_logprobs"), meta.get(f"{kind}_top_logprobs")
        if tokens is None or tops is None or len(tokens) != len(tops):
            raise SourceError(f"{self.url}/generate answered no {kind}_token_logprobs / {kind}_top_logprobs")
        # Keep the entries with a logprob (an echoed first token has none), aligned on the sequence's end.
        pairs = [(t, top) for t, top in zip(tokens, tops) if t[0] is not None and top is not None]
        n = len(seq) - start
        if len(pairs) < n:
            raise SourceError(f"{self.url}/generate scored {len(pairs)} positions where {n} were asked")
        pairs = pairs[len(pairs) - n:]
        self._check_tokens([int(t[1]) for t, _ in pairs], seq[start:])
        return self._arrays([[(int(e[1]), float(e[0])) for e in top] for _, top in pairs], top_k)

    def _openai_entries(self, lp: dict, seq: list[int], start: int, end: int, top_k: int) -> TopLogprobs:
        tokens = [self._token_id(t) for t in lp["tokens"]]
        self._check_tokens(tokens[start:end], seq[start:end])
        tops = lp["top_logprobs"][start:end]
        if any(t is None for t in tops):
            raise SourceError(f"{self.url}/v1/completions answered null top_logprobs inside the scored positions")
        return self._arrays([[(self._token_id(k), float(v)) for k, v in t.items()] for t in tops], top_k)

    def _arrays(self, rows: list[list[tuple[int, float]]], top_k: int) -> TopLogprobs:
        """Most likely first, the k best (an OpenAI answer may add the chosen token as a k+1-th)."""
        if any(len(r) < top_k for r in rows):
            short = min(len(r) for r in rows)
            raise SourceError(f"{self.url} returned {short} top logprobs per position where {top_k} were asked "
                              f"(vLLM: start it with --max-logprobs {top_k})")
        rows = [sorted(r, key=lambda e: -e[1])[:top_k] for r in rows]
        ids = np.array([[i for i, _ in r] for r in rows], dtype=np.int32).reshape(len(rows), top_k)
        lps = np.array([[v for _, v in r] for r in rows], dtype=np.float32).reshape(len(rows), top_k)
        return TopLogprobs(ids, lps)
