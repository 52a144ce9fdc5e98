"""Prefix reuse for a hybrid model: shared K/V pages and snapshots of the lightning states.

A request whose tokens begin like an earlier one's need not recompute that beginning, but a
hybrid model needs two things to skip it: the sparse layers' K/V of those tokens, and the
lightning layers' recurrent state after them. K/V is kept per page, as vLLM and SGLang keep it;
a state only exists where a forward stopped, so it cannot be cut out at an arbitrary token
(which is why SGLang turns its radix cache off for this model). Here:

- Every full page of every request (prompt and generated tokens) enters a trie keyed by its
  tokens under its predecessor page: a node is one page of K/V, shared by reference count
  among the running requests whose page tables hold it. A request whose full page equals an
  existing node's takes the node's page and frees its own copy.
- The lightning states of a request are copied into a snapshot pool (its own memory budget)
  at fixed token intervals (`interval`, a multiple of the page size and of the lightning chunk;
  the scheduler ends prompt chunks there so the state exists) and at the end of each prompt.
  An interval snapshot hangs on the node of the page it ends; a prompt-end snapshot that falls
  inside a page hangs on a *tail*: the page's first tokens, with a private copy of its K/V.
- A new request walks the trie along its tokens and resumes from the deepest snapshot it
  matches (leaving at least one token to compute): its page table starts with the shared
  pages up to there (a tail's page is copied into a page of its own, which it then fills), its
  state slot gets the snapshot, and the rest is computed as usual.
- Pages no running request holds stay cached until memory is needed: the pool counts them as
  free and takes them back least recently used, leaves first (a page's successors go before
  it). Snapshots are evicted least recently used when their pool is full, and with their page.

Outputs do not change: shared K/V and snapshots are what the request would have computed
itself. In the evaluation mode (batch_invariant) they are bit for bit that: there a prompt may
only be cut at multiples of lightning.CHUNK_SIZE, so only snapshots at such positions are used,
and logprobs with reuse equal those without it bitwise (tests/engine/test_prefix.py). Elsewhere they
are equal as outputs of differently batched steps are, to rounding.

The trie is exact (children are keyed by the token tuples themselves, so no hash collision can
join two prefixes). It lives inside the cache pool (sala/engine/cache.py), which owns every
page: what needs a page or the states takes the pool as an argument, and evicting hands pages
back to the pool instead of writing its free list. Everything here runs on the engine's step
thread.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from sala import lightning
from sala.engine.config import EngineConfig
from sala.engine.request import Request


class PagePool(Protocol):
    """What the prefix cache asks of the pool that owns it (sala/engine/cache.py CachePool):
    pages it may take and hand back, never a free list of its own."""

    states: dict[int, torch.Tensor]  # each lightning layer's state pool [slots, H, Dk, Dv]

    def grow(self, req: Request, n_tokens: int) -> bool: ...
    def take_page(self) -> int | None: ...
    def give_back(self, pages: list[int]) -> None: ...
    def copy_page(self, src: int, dst: int) -> None: ...


class Node:
    """One page of K/V in the trie: a full page (`tokens` page_size long, in its parent's
    `children`) or a tail (fewer tokens, in its parent's `tails`, always with a snapshot and a
    page that no request table holds)."""

    __slots__ = ("tokens", "parent", "page", "end", "children", "tails", "refs", "last_used", "snapshot")

    def __init__(self, tokens: tuple[int, ...], parent: Node | None, page: int, end: int):
        self.tokens, self.parent, self.page, self.end = tokens, parent, page, end  # end: position after its last token
        self.children: dict[tuple[int, ...], Node] = {}
        self.tails: dict[tuple[int, ...], Node] = {}
        self.refs = 0  # running requests whose page tables hold `page`
        self.last_used = 0
        self.snapshot: int | None = None  # slot in the snapshot pool: the lightning states after `end` tokens

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.tails


@dataclass
class Hit:
    """Where a request can resume: `nodes` are the full pages it shares, `tail` (or None) a
    partial page it copies, `at` the snapshot's node; `length` tokens need no computing."""

    nodes: list[Node]
    tail: Node | None
    length: int

    @property
    def at(self) -> Node:
        return self.tail or self.nodes[-1]

    @property
    def pages_held_back(self) -> int:
        """Cached pages counted as free now that resuming here takes: the shared pages no other
        request holds, and the tail copied from."""
        return sum(n.refs == 0 for n in self.nodes) + (self.tail is not None)


class PrefixCache:
    def __init__(self, config: EngineConfig, states: dict[int, torch.Tensor]):
        """`states`: the pool's state tensors, whose slots a snapshot copies. From the config:
        the snapshot interval, the snapshots' own budget (prefix_snapshot_bytes), and in the
        evaluation mode (batch_invariant) resuming only at multiples of lightning.CHUNK_SIZE."""
        self.page_size, self.interval, self.batch_invariant = config.page_size, config.prefix_snapshot_interval, config.batch_invariant
        device, snapshot_bytes = config.device, config.prefix_snapshot_bytes
        self.root = Node((), None, -1, 0)
        self.clock = itertools.count(1)
        self.evictable: list[tuple[int, int, Node]] = []  # heap of (last_used, tie, node): ref-0 leaves, lazily pruned
        self.num_evictable = 0  # nodes no request holds (each one page the pool may take back)
        self.snapshot_bytes = sum(s[0].numel() * s.element_size() for s in states.values())  # one sequence's states
        self.max_snapshots = int(snapshot_bytes // self.snapshot_bytes) if self.snapshot_bytes else 0
        self.snapshots = {i: torch.zeros(self.max_snapshots, *s.shape[1:], dtype=s.dtype, device=device)
                          for i, s in states.items()}
        self.free_snapshots = list(range(self.max_snapshots - 1, -1, -1))
        self.snapshot_lru: OrderedDict[int, Node] = OrderedDict()  # slot -> node, least recently used first
        # Totals for monitoring (each request counted at its first admission; a preempted one resuming is not).
        self.num_queried_tokens = 0  # prompt tokens of admitted requests
        self.num_hit_tokens = 0  # of which were taken from the cache
        self.num_evicted_pages = self.num_evicted_snapshots = 0

    # ------------------------------------------------------------------ lookup and admission
    def match(self, req: Request) -> Hit | None:
        """The deepest snapshot req can resume from: at most its tokens (its prompt, with
        recompute_by_decode) less one (the last must be computed for its logits), and no
        further than the first prompt position whose logprob it asked for."""
        limit = req.prefill_end - 1
        if req.prompt_logprobs_next is not None:
            limit = min(limit, req.prompt_logprobs_next)
        return self._deepest(req.token_slice(0, req.num_tokens), limit)

    def resumable_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a request could take from the cache now (what a
        replica reports holding to the router); touches nothing."""
        hit = self._deepest(tokens, len(tokens))
        return hit.length if hit is not None else 0

    def _deepest(self, tokens: list[int], limit: int) -> Hit | None:
        ps, node, path, best = self.page_size, self.root, [], None
        while True:
            pos = len(path) * ps
            for tail in node.tails.values():
                end = pos + len(tail.tokens)
                if end <= limit and (best is None or end > best.length) and tuple(tokens[pos:end]) == tail.tokens \
                        and self._usable(end):
                    best = Hit(list(path), tail, end)
            if pos + ps > limit:
                break
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            path.append(child)
            node = child
            if child.snapshot is not None and self._usable(child.end):
                best = Hit(list(path), None, child.end)
        return best

    def _usable(self, pos: int) -> bool:
        return not self.batch_invariant or pos % lightning.CHUNK_SIZE == 0

    def admit(self, req: Request, hit: Hit | None, pool: PagePool) -> None:
        """Inside CachePool.admit: req's pages start with the shared ones, its state slot holds
        the snapshot, its first `hit.length` tokens count as computed."""
        if req.num_cached_tokens is None:  # first admission: count it
            req.num_cached_tokens = hit.length if hit else 0
            self.num_queried_tokens += len(req.prompt_ids)
            self.num_hit_tokens += min(req.num_cached_tokens, len(req.prompt_ids))
        if hit is None:
            return
        now = next(self.clock)
        for n in hit.nodes:
            self._hold(n)
            n.last_used = now
        req.prefix_chain = list(hit.nodes)
        req.pages = [n.page for n in hit.nodes]
        if hit.tail is not None:
            self._hold(hit.tail)  # so that taking a page for the copy cannot evict it
            if not pool.grow(req, hit.length):
                raise RuntimeError("no page for a prefix tail although can_admit said there was")
            pool.copy_page(hit.tail.page, req.pages[-1])
            self._release(hit.tail, now)
        at = hit.at
        for layer, states in pool.states.items():
            states[req.state_slot].copy_(self.snapshots[layer][at.snapshot])
        self.snapshot_lru.move_to_end(at.snapshot)
        req.num_computed = hit.length

    # ------------------------------------------------------------------ after each step
    def after_step(self, reqs: list[Request], pool: PagePool) -> None:
        """For each request the step advanced (before any is finished): enter its newly full
        pages into the trie, and snapshot its states where it reached a snapshot position."""
        for r in reqs:
            self._register(r, pool)
            pos = r.num_computed
            if pos % self.interval == 0:
                self._snapshot_page(r, pos, pool)
            elif pos == len(r.prompt_ids) and not r.output_ids:  # the end of its prompt, first time
                if pos % self.page_size == 0:
                    self._snapshot_page(r, pos, pool)
                elif self._usable(pos):
                    self._snapshot_tail(r, pos, pool)

    def _register(self, r: Request, pool: PagePool) -> None:
        # Pages whose tokens are all known: a verify step computes tokens the engine appends only
        # after this (Engine.postprocess); their page is entered at the next step.
        ps, chain = self.page_size, r.prefix_chain
        while len(chain) < min(r.num_computed, r.num_tokens) // ps:
            i = len(chain)
            parent = chain[-1] if chain else self.root
            tokens = tuple(r.token_slice(i * ps, (i + 1) * ps))
            node = parent.children.get(tokens)
            if node is None:
                node = parent.children[tokens] = Node(tokens, parent, r.pages[i], (i + 1) * ps)
                node.refs = 1
            else:
                if node.page != r.pages[i]:  # the same tokens computed twice: keep one copy
                    if self.batch_invariant:
                        # Not bitwise the same copy: K/V rounds differently in chunks of other lengths.
                        break
                    pool.give_back([r.pages[i]])
                    r.pages[i] = node.page
                self._hold(node)
            node.last_used = next(self.clock)
            chain.append(node)

    def _snapshot_page(self, r: Request, pos: int, pool: PagePool) -> None:
        if pos == 0 or len(r.prefix_chain) < pos // self.page_size or not self._usable(pos):
            return
        node = r.prefix_chain[pos // self.page_size - 1]
        if node.snapshot is None:
            self._take_snapshot(r, node, pool)
        else:
            self.snapshot_lru.move_to_end(node.snapshot)

    def _snapshot_tail(self, r: Request, pos: int, pool: PagePool) -> None:
        full = pos // self.page_size
        if len(r.prefix_chain) < full:
            return
        parent = r.prefix_chain[full - 1] if full else self.root
        tokens = tuple(r.token_slice(full * self.page_size, pos))
        if (tail := parent.tails.get(tokens)) is not None:
            self.snapshot_lru.move_to_end(tail.snapshot)
            return
        page = pool.take_page() if self.max_snapshots else None
        if page is None:
            return
        tail = parent.tails[tokens] = Node(tokens, parent, page, pos)
        pool.copy_page(r.pages[full], tail.page)
        self.num_evictable += 1  # held by no request from the start
        tail.last_used = next(self.clock)
        self._push_if_leaf(tail)
        self._take_snapshot(r, tail, pool)

    def _take_snapshot(self, r: Request, node: Node, pool: PagePool) -> None:
        if not self.free_snapshots:
            if not self.snapshot_lru:
                return
            slot, victim = self.snapshot_lru.popitem(last=False)
            victim.snapshot = None
            self.num_evicted_snapshots += 1
            if len(victim.tokens) < self.page_size:  # a tail exists only for its snapshot
                pool.give_back([self._remove(victim)])
            self.free_snapshots.append(slot)
        slot = self.free_snapshots.pop()
        for layer, states in pool.states.items():
            self.snapshots[layer][slot].copy_(states[r.state_slot])
        node.snapshot = slot
        self.snapshot_lru[slot] = node

    # ------------------------------------------------------------------ references and eviction
    def release(self, req: Request) -> None:
        """req leaves the running set (finished, cancelled or preempted): its shared pages stay
        cached for later requests; only its private pages are left in req.pages, for the pool
        to free (CachePool.free)."""
        now = next(self.clock)
        for n in req.prefix_chain:
            self._release(n, now)
        req.pages = req.pages[len(req.prefix_chain) :]
        req.prefix_chain = []

    def _hold(self, n: Node) -> None:
        if n.refs == 0:
            self.num_evictable -= 1
        n.refs += 1

    def _release(self, n: Node, now: int) -> None:
        n.refs -= 1
        if n.refs == 0:
            self.num_evictable += 1
            n.last_used = now
            self._push_if_leaf(n)

    def _push_if_leaf(self, n: Node) -> None:
        if n.refs == 0 and n.is_leaf:
            heapq.heappush(self.evictable, (n.last_used, id(n), n))

    def evict(self, n_pages: int) -> list[int]:
        """Take n_pages cached pages out of the trie, least recently used leaves first; the pool
        frees them."""
        pages = []
        for _ in range(n_pages):
            while True:
                last_used, _, n = heapq.heappop(self.evictable)  # never empty: see num_evictable
                if n.parent is not None and n.refs == 0 and n.is_leaf and n.last_used == last_used:
                    break
            self.num_evicted_pages += 1
            if n.snapshot is not None:
                self.num_evicted_snapshots += 1
                del self.snapshot_lru[n.snapshot]
                self.free_snapshots.append(n.snapshot)
                n.snapshot = None
            pages.append(self._remove(n))
        return pages

    def _remove(self, n: Node) -> int:
        """Take a leaf no request holds out of the trie; its page, for the pool to free."""
        parent = n.parent
        (parent.children if len(n.tokens) == self.page_size else parent.tails).pop(n.tokens)
        n.parent = None
        self.num_evictable -= 1
        if parent is not self.root:
            self._push_if_leaf(parent)
        return n.page

    # ------------------------------------------------------------------ monitoring
    @property
    def num_snapshots(self) -> int:
        return len(self.snapshot_lru)
