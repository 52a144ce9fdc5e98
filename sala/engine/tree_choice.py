"""Which draft tree a Medusa engine's step verifies, if any (`TreeChoice`).

A verify step costs more than a decode step (T rows a request, and the acceptance after it) and
pays for it in accepted tokens; which tree pays best, if any, depends on the machine, the batch
and the text. The heads come with their tree (the largest the engine verifies) and with how
often each of its paths was right on the validation text they were trained against
(MedusaConfig.path_acceptance). Ordered most often right first, every prefix of its paths is a
tree (sala/medusa/tree.py by_acceptance), and a tree's expected accept length is 1 + the sum of
its paths' acceptance. The candidates are the prefixes of CANDIDATE_NODES nodes up to the whole
tree: nested, so a step may verify any of them (a request's drafts are the heads' top-k at every
depth, whatever tree reads them). medusa_nodes (the engine setting):

- "auto" (default): warmup (MedusaDecoding.warmup) times a plain decode step, a plain step right
  after verify steps (a probe) and a verify step of each candidate at batch sizes 1, 2, 4, ...
  max_seqs, for greedy batches and for sampled ones (on CPU: sampled by temperature alone, the
  batches a compiled graph accepts); a step of n decoding requests verifies the candidate with
  the most expected tokens per second,
      speedup = accept_length(tree) x plain(n) / verify(n, tree),
  where that is at least MIN_SPEEDUP, else it decodes plainly (step times interpolated between
  the batch sizes timed; a batch larger than the largest timed decodes plainly, as warmup stops
  timing at a batch size where nothing pays; a larger candidate only where it is expected at
  LARGER_BY times a smaller one, unless the window has measured it). Both factors are corrected
  by the last WINDOW_STEPS decode steps (greedy and sampled batches apart). accept_length(tree)
  is the expected one scaled by what the window's verify steps, of every candidate, accepted
  against what they were expected to (once MIN_OBSERVED requests' verifies are in the window):
  a candidate's own steps say more of the texts decoding while it verified than of the tree.
  The step times are scaled by what steps took against warmup's times for them
  (`TreeChoice.time_scale`, once MIN_TIMED steps of a kind are in the window): the machine's
  speed drifts over a run (by up to 2x over a minute on a 2-core VM). Each step
  is compared with warmup's time for a step taken as it was: a plain step right after a verify
  step takes longer than one after plain steps (on a 2-core VM 2.1 ms against 1.6, about six
  steps to recover: the verify step's code and data displace the plain step's), so the first
  is compared with the probe's time, and a verify right after a plain step is not timed. While
  it verifies, at least one decode step in PROBE_EVERY is plain, so that what a plain step
  takes now is known beside what verify steps take (one in PROBE_SOON until MIN_TIMED are),
  and EXPLORE_STEPS steps in a row out of every EXPLORE_EVERY verify a rival, the candidate
  expected to do best of those the window has not measured (MIN_TIMED of its steps timed) if it
  is expected at RIVAL_WITHIN of the chosen one or more, then the next: a candidate's time is
  judged by its own steps once it has taken them, and warmup's times are noisy enough to rank
  close candidates wrongly.
  While it decodes plainly and the window holds too few verify steps, EXPLORE_STEPS steps in a
  row out of every EXPLORE_EVERY verify the top candidate if it is expected at MIN_EXPLORED or
  more, so that a tree warmup misjudged gets measured (sampled requests accept by typical
  acceptance, more than the greedy priors say). So a text the heads do not know, sampled
  requests, or verify steps dearer than warmup found shrink the tree or stop verification; a
  batch that grows moves to the choice timed for its size; and once the observations that
  stopped it have aged out of the window, it verifies again and looks. Until warmup has timed
  the steps it verifies the whole tree; heads with no measured acceptance have their whole tree
  as the one candidate, and what the window measures it to accept decides.
- N: the N-node candidate at every step; 0: never verify.

The choice is made every decode step, so it costs the step next to nothing: the windows keep
running sums (`Window`), and the candidates at a batch size are weighed again only once what
they are weighed by has changed and REWEIGH_EVERY steps have passed (`Top`). Plain steps' times
scale every candidate alike, so decoding plainly, which times every step, weighs them again only
when a verify step's acceptance or time enters or leaves the window.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from sala.engine.stats import ChosenTree

CANDIDATE_NODES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WINDOW_STEPS = 512  # decode steps an observation counts for
MIN_OBSERVED = 16  # requests' verifies in the window before they correct the expected acceptance
# Below it a tree is not chosen: the estimate leaves out drafting at the end of each prompt, the
# plain probes and the first verify after a plain step (its drafts made a token earlier: tree_drafts), and it is noisy.
MIN_SPEEDUP = 1.15
# A larger candidate is chosen over a smaller one only if expected at LARGER_BY times as much, unless the
# window has measured it (`_measured`: its own steps' times): what warmup's estimate leaves
# out weighs more with a larger tree, and its figures are noisier (on the 2-core VM: a 12-node tree
# expected at 1.46x ran at 1.15x where the 4-node one ran at 1.30x; sampled, a 6-node tree the window
# preferred by its pooled corrections ran at 1.31x, the 4-node one at 1.49x).
LARGER_BY = 1.05
MIN_TIMED = 8  # steps of a kind in the window before their times correct warmup's
# While verifying, a plain step (a probe: the time a plain step takes now) at least every PROBE_EVERY
# decode steps, which keeps MIN_TIMED of them in the window (WINDOW_STEPS / PROBE_EVERY); every
# PROBE_SOON while fewer are. A probe costs a verify step's gain and more (it runs slower after verify
# steps, and the verify after it keeps fewer tokens): on tiny-sala at batch 1, with one in 32 the choice
# ran at 1.33x greedy and 1.50x sampled, with one in 64 at 1.34x and 1.55x.
PROBE_EVERY = WINDOW_STEPS // MIN_TIMED
PROBE_SOON = 4
# A candidate expected at MIN_EXPLORED or more but below MIN_SPEEDUP is still verified, EXPLORE_STEPS
# steps in every EXPLORE_EVERY, while the window holds too few verify steps: warmup's times and the
# heads' greedy acceptance misjudge it (measured on tiny-sala, sampled at batch 1: expected 1.07x
# by warmup, ran at 1.09x; typical acceptance kept 2.22 tokens a step where 1.91 were expected).
MIN_EXPLORED = 0.8
EXPLORE_EVERY, EXPLORE_STEPS = 16, 4  # in a row: the first verify after plain steps has drafts made tokens earlier
# While it verifies, each candidate expected at RIVAL_WITHIN of the chosen one or more is verified the
# same way until the window has measured it, the one expected to do best first: the window judges a
# candidate's time by its own steps only once it has taken them, so warmup's ranking of close candidates
# would stand (on tiny-sala at batch 1: the 2-node tree chosen at 1.24x ran at 1.20x, the 4-node one,
# expected at 1.19x, at 1.33x; with only the runner-up measured, the 3- and 8-node trees took the steps
# while the 4-node one, third by warmup's times, ran at 1.48x forced).
RIVAL_WITHIN = 0.92
# The choice at a batch size is weighed again once what it is weighed by has changed and
# REWEIGH_EVERY decode steps have passed since: a step moves a window's mean by about
# 1/WINDOW_STEPS, and weighing a dozen candidates at every step cost ~35 us (2% of a batch-1 step).
REWEIGH_EVERY = 8
VERIFY = -1  # the node count under which `TreeChoice.verify_times` sums the verify steps of every candidate
PROBE = -2  # the node count under which step_ms holds a plain step right after verify steps (a probe)
MAX_LOG_DRIFT = 1.0  # a step's time counts as at most e times (at least 1/e) warmup's


def candidate_sizes(setting: int | str, nodes: int, measured: bool) -> list[int]:
    """The node counts of the trees an engine may verify, given medusa_nodes, the heads' tree size
    and whether its paths' acceptance was measured."""
    if setting == "auto":
        return sorted({n for n in CANDIDATE_NODES if n < nodes} | {nodes}) if measured else [nodes]
    if setting > nodes:
        raise ValueError(f"medusa_nodes={setting} but the heads' tree has {nodes} nodes: give at most {nodes}, or 'auto'")
    return [setting] if setting else []


class Window:
    """Sums by key of what the last WINDOW_STEPS decode steps recorded, kept as entries come and go."""

    def __init__(self, values: int):
        self.entries: deque = deque()  # (decode step, keys, values) in step order
        self.sums: dict = {}  # key -> [the sum of each of `values` values] over the entries
        self.changes = 0  # entries added and aged so far: a reading of `sums` is stale once it moves
        self.zeros = [0] * values

    def __getitem__(self, key) -> list:
        return self.sums.get(key, self.zeros)

    def add(self, step: int, keys: tuple, values: tuple) -> None:
        self.entries.append((step, keys, values))
        self._apply(keys, values, 1)

    def age(self, step: int) -> None:
        """Drop the entries of decode steps WINDOW_STEPS or more before `step`."""
        while self.entries and self.entries[0][0] <= step - WINDOW_STEPS:
            _, keys, values = self.entries.popleft()
            self._apply(keys, values, -1)

    def mean(self, key, at_least: int) -> float | None:
        """The mean of the second value over the first (a count), None below `at_least` of it."""
        count, total = self[key][:2]
        return total / count if count >= at_least else None

    def _apply(self, keys: tuple, values: tuple, sign: int) -> None:
        self.changes += 1
        for key in keys:
            sums = self.sums.setdefault(key, list(self.zeros))
            for i, v in enumerate(values):
                sums[i] += sign * v


class Top(NamedTuple):
    """The candidates at a batch size as weighed: the top one, its speedup but for the plain
    steps' drift (a factor common to every candidate), the rival (the candidate expected to do
    best of those the window has not measured, if within RIVAL_WITHIN of the top one; 0: none),
    and what they were weighed at."""

    weighed_at: tuple  # the windows' change counts, and whether plain steps were timed enough
    step: int  # the decode step
    nodes: int
    gain: float
    rival: int


@dataclass
class TreeChoice:
    """Which candidate tree (by node count; 0: none) a step verifies: see the module docstring."""

    prior: dict[int, float | None]  # candidate -> its expected accept length (None: not measured)
    max_batch: int | None
    fixed: bool  # medusa_nodes=N: always the one candidate (up to max_batch)
    # batch size -> {(greedy, nodes): ms of such a step}, measured by warmup (nodes 0: a plain
    # step after plain steps, PROBE: after verify steps); set whole, never changed in place
    # (what is read from it is remembered)
    step_ms: dict[int, dict[tuple[bool, int], float]] = field(default_factory=dict)
    force: int | None = None  # set while warmup compiles or times one kind of step
    # greedy -> [requests, drafts accepted, drafts the priors expected] of the window's verify steps
    accepted: Window = field(default_factory=lambda: Window(3))
    # greedy -> [steps, sum of log(ms it took / warmup's time for it)] of the window's plain decode steps
    plain_times: Window = field(default_factory=lambda: Window(2))
    # (greedy, nodes) -> the same of its verify steps; (greedy, VERIFY): of every candidate's
    verify_times: Window = field(default_factory=lambda: Window(2))
    last_plain: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # last decode step chosen plain
    steps: int = 0  # decode steps chosen for so far
    previous: int = 0  # the candidate the decode step before the last one chosen verified (0: none)
    current: int = 0  # ... and the last one's
    # What is read from step_ms (`_times`: n -> step_times(n)), and at each (n, greedy) the candidates
    # as last weighed (`Top`).
    _read_from: dict | None = field(default=None, repr=False)
    _times: dict = field(default_factory=dict, repr=False)
    _tops: dict = field(default_factory=dict, repr=False)

    def __call__(self, n: int, greedy: bool = True, verifiable: bool = True) -> int:
        """The tree a step with n decoding requests verifies (greedy: all of them are greedy
        without logprobs; not verifiable: it decodes plainly whatever the choice); 0: it
        decodes plainly."""
        self.steps += 1
        for window in (self.accepted, self.plain_times, self.verify_times):
            window.age(self.steps)
        nodes = self._choose(n, greedy) if verifiable else 0
        self.previous, self.current = self.current, nodes
        if not nodes:
            self.last_plain[greedy] = self.steps
        return nodes

    def _choose(self, n: int, greedy: bool) -> int:
        if self.force is not None:
            return self.force
        if not self.prior or (self.max_batch is not None and n > self.max_batch):
            return 0
        if self.fixed or not self.step_ms:
            return max(self.prior)
        top = self._weighed(n, greedy, REWEIGH_EVERY)
        speedup = top.gain * self._plain_drift(greedy)
        looks = self.steps % EXPLORE_EVERY < EXPLORE_STEPS
        if speedup >= MIN_SPEEDUP:
            every = PROBE_EVERY if self.plain_times[greedy][0] >= MIN_TIMED else PROBE_SOON
            if self.steps - self.last_plain[greedy] >= every:
                return 0  # a probe
            return top.rival if looks and top.rival and not self._measured(top.rival, greedy) else top.nodes
        # A look: what verify steps take and accept now, when the window has too few.
        return top.nodes if looks and speedup >= MIN_EXPLORED and self._unexplored(greedy) else 0

    def best(self, n: int, greedy: bool) -> tuple[int, float]:
        """The candidate with the most expected tokens/s at n requests and its speedup over plain
        decoding; (0, 1.0) where none reaches MIN_SPEEDUP."""
        nodes, speedup = self.top(n, greedy)
        return (nodes, speedup) if speedup >= MIN_SPEEDUP else (0, 1.0)

    def top(self, n: int, greedy: bool) -> tuple[int, float]:
        """The candidate with the most expected tokens/s at n requests, and its speedup over plain
        decoding; (0, 0.0) where none is timed."""
        top = self._weighed(n, greedy, 0)
        return top.nodes, top.gain * self._plain_drift(greedy)

    def _weighed(self, n: int, greedy: bool, settle: int) -> Top:
        """The candidates at n requests weighed (`Top`): again if what they are weighed by has
        changed since and `settle` decode steps have passed."""
        times = self.step_times(n)
        weighed_at = (self.accepted.changes, self.verify_times.changes, self.plain_times[greedy][0] >= MIN_TIMED)
        top = self._tops.get((n, greedy))
        if top is None or (top.weighed_at != weighed_at and self.steps - top.step >= settle):
            gains = {nodes: self._verify_gain(times, nodes, greedy) for nodes in sorted(self.prior)}
            best = (0, 0.0)
            for nodes, gain in gains.items():
                if gain > best[1] * (1.0 if self._measured(nodes, greedy) else LARGER_BY):
                    best = (nodes, gain)
            rivals = [k for k in gains if k != best[0] and gains[k] >= RIVAL_WITHIN * best[1] and not self._measured(k, greedy)]
            rival = max(rivals, key=gains.get) if best[0] and rivals else 0
            top = self._tops[n, greedy] = Top(weighed_at, self.steps, *best, rival)
        return top

    def _measured(self, nodes: int, greedy: bool) -> bool:
        """Whether the window holds MIN_TIMED of the candidate's own verify steps timed: its time
        is then judged by them alone."""
        return self.verify_times[greedy, nodes][0] >= MIN_TIMED

    def _unexplored(self, greedy: bool) -> bool:
        """Whether the window holds too few verify steps to correct the priors by."""
        return self.verify_times[greedy, VERIFY][0] < MIN_TIMED or self.accepted[greedy][0] < MIN_OBSERVED

    def speedup(self, times: dict[tuple[bool, int], float], nodes: int, greedy: bool, live: bool = True) -> float:
        """Expected tokens/s of verifying the candidate over decoding plainly, by `times` (0: not
        timed) and, when `live`, corrected by what the window's steps accepted and took."""
        if not live:
            return _time_ratio(times, nodes, greedy) * (self.prior[nodes] or 1.0)
        return self._verify_gain(times, nodes, greedy) * self._plain_drift(greedy)

    def _verify_gain(self, times: dict[tuple[bool, int], float], nodes: int, greedy: bool) -> float:
        """The live speedup but for the plain steps' drift, a factor common to every candidate."""
        ratio = _time_ratio(times, nodes, greedy)
        return self.accept_length(nodes, greedy) * ratio / self._verify_drift(nodes, greedy) if ratio else 0.0

    def time_scale(self, nodes: int, greedy: bool) -> float:
        """How much cheaper than warmup measured them the window's steps found verify steps of the
        candidate against plain ones: each kind's steps took exp(mean log(took / warmup's time))
        of what warmup's times predict at their batch sizes. A candidate with too few steps in
        the window is taken as the window's verify steps of every candidate where they are dearer
        than warmup found, as warmup found them where not: another tree's steps may say the machine
        is slower for verify steps now, not that this tree is cheaper (taken so, a tree that warmup
        misjudged dear made every other look cheaper, and the choice went back and forth between
        it and the one it had left once its steps aged out). 1 where plain or verify steps are too
        few (warmup's ratio stands)."""
        return self._plain_drift(greedy) / self._verify_drift(nodes, greedy)

    def _plain_drift(self, greedy: bool) -> float:
        plain = self.plain_times.mean(greedy, MIN_TIMED)
        return 1.0 if plain is None or self.verify_times.mean((greedy, VERIFY), MIN_TIMED) is None else math.exp(plain)

    def _verify_drift(self, nodes: int, greedy: bool) -> float:
        pooled, plain = self.verify_times.mean((greedy, VERIFY), MIN_TIMED), self.plain_times.mean(greedy, MIN_TIMED)
        if pooled is None or plain is None:
            return 1.0
        own = self.verify_times.mean((greedy, nodes), MIN_TIMED)
        return math.exp(max(pooled, plain) if own is None else own)

    def accept_length(self, nodes: int, greedy: bool) -> float:
        """Tokens a verify step of the candidate is expected to yield now: its prior scaled by
        what the window's verify steps, of every candidate, accepted against their trees' priors.
        Not by its own steps alone: those come from the texts that were decoding when it
        verified, and texts differ more than trees do (on tiny-sala at batch 1, the 4-node tree's
        own steps in the window kept from 1.56 to 2.53 tokens a step over one run), while the
        priors' ratios between trees are measured on the same validation text."""
        prior = self.prior[nodes]
        requests, accepted, expected = self.accepted[greedy]
        if prior is None:  # nothing measured with the heads: what the window saw, else try it
            return 1 + accepted / requests if requests >= MIN_OBSERVED else math.inf
        scale = accepted / expected if requests >= MIN_OBSERVED and expected > 0 else 1.0
        return 1 + scale * (prior - 1)

    def observe(self, nodes: int, greedy: bool, requests: int, accepted: int) -> None:
        """A verify step of the `nodes` candidate in which `requests` requests accepted `accepted`
        drafts. Not counted: warmup's steps (a token of no text), and a verify right after a plain
        step, whose drafts were made a token earlier, each depth's by a head further out (what the
        choice weighs is what verifying in a row yields)."""
        if self.force is None and self.previous:
            self.accepted.add(self.steps, (greedy,), (requests, accepted, requests * ((self.prior[nodes] or 1) - 1)))

    def timed(self, nodes: int, greedy: bool, requests: int, ms: float) -> None:
        """A decode step (no prompt work) of `requests` requests, verifying the `nodes` candidate
        (0: plain), took `ms`: against warmup's time for such a step after the kind of step
        before it (a plain one after a verify: a probe's). A verify right after a plain step is
        not timed: warmup times verify steps in a row, and verifying in a row is what the choice
        weighs."""
        if self.force is not None or not self.step_ms or (nodes and not self.previous):
            return
        kind = nodes or (PROBE if self.previous else 0)
        predicted = self.step_times(requests).get((greedy, kind), math.inf)
        if math.isfinite(predicted):
            ratio = min(max(math.log(ms / predicted), -MAX_LOG_DRIFT), MAX_LOG_DRIFT)  # a pause is not the step's cost
            if nodes:
                self.verify_times.add(self.steps, ((greedy, nodes), (greedy, VERIFY)), (1, ratio))
            else:
                self.plain_times.add(self.steps, (greedy,), (1, ratio))

    def table(self) -> tuple[ChosenTree, ...]:
        """The choice now at each batch size warmup timed, greedy and sampled."""
        rows = []
        for n in sorted(self.step_ms):
            for greedy in (True, False):
                nodes, speedup = self.best(n, greedy)
                rows.append(ChosenTree(batch=n, greedy=greedy, nodes=nodes, speedup=speedup,
                                       warmup_speedup=self.speedup(self.step_times(n), nodes, greedy, live=False) if nodes else 1.0,
                                       accept_length=self.accept_length(nodes, greedy) if nodes else 1.0))
        return tuple(rows)

    def named_times(self) -> dict[str, dict[str, float]]:
        """step_ms as JSON names it: batch size -> {"greedy_plain" | "greedy_probe" | "greedy_<nodes>"
        (and "sampled_..."): ms}."""
        names = {0: "plain", PROBE: "probe"}
        return {str(n): {f"{'greedy' if g else 'sampled'}_{names.get(k, k)}": ms for (g, k), ms in row.items()}
                for n, row in self.step_ms.items()}

    @contextmanager
    def forcing(self, nodes: int):
        """Every step verifies the `nodes` candidate (0: decodes plainly) inside the block: warmup's compiling and timing."""
        self.force = nodes
        try:
            yield
        finally:
            self.force = None

    def step_times(self, n: int) -> dict[tuple[bool, int], float]:
        """ms of each kind of step at n requests: linear between the batch sizes timed, the
        smallest one's below them (a kind timed at only one of the two: not known). Past the
        largest, none: warmup stops timing at a batch size where no candidate pays, and a verify's
        cost grows with the batch faster than a plain step's, so a larger batch decodes plainly,
        without looks (the largest one's times make a look there seem to cost far less than it does)."""
        if self._read_from is not self.step_ms:
            self._read_from, self._times, self._tops = self.step_ms, {}, {}
        if (times := self._times.get(n)) is None:
            times = self._times[n] = _interpolate(self.step_ms, n)
        return times


def _interpolate(step_ms: dict[int, dict], n: int) -> dict:
    """step_ms at batch size n: see TreeChoice.step_times."""
    sizes = sorted(step_ms)
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        return {}
    if i == 0:
        return step_ms[sizes[0]]
    lo, hi = step_ms[sizes[i - 1]], step_ms[sizes[i]]
    w = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
    return {k: (1 - w) * lo[k] + w * hi[k] for k in lo.keys() & hi.keys()}


def _time_ratio(times: dict[tuple[bool, int], float], nodes: int, greedy: bool) -> float:
    """A plain step's time over a verify step's of the candidate, by `times`; 0 where either is not timed."""
    plain, verify = times.get((greedy, 0), math.inf), times.get((greedy, nodes), math.inf)
    return plain / verify if math.isfinite(plain) and math.isfinite(verify) else 0.0
