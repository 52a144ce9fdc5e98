"""Which draft tree a Medusa engine's step verifies, if any (`TreeChoice`).

The candidates are plain decoding (0 nodes) and the prefixes of the heads' tree of
CANDIDATE_NODES nodes, its paths ordered most often right first (sala/medusa/tree.py
by_acceptance): each is the best tree of its size, they are nested, and any step may verify any
of them (a request's drafts are the heads' top-k at every depth, whatever tree reads them). For
each kind of batch (`step_kind`) and batch size class (1, 2, 4, 8, ...) the choice keeps two
running estimates, both from the decode steps the engine takes anyway: what each candidate's
step takes (ms), and how many tokens each tree's verify steps yield (its accept length: the
heads' validation figure for it, 1 + the sum of its paths' acceptance, scaled by what the last
few hundred verify steps of every tree kept against their figures, as a step keeps anything from
no draft to a whole path). One scale for every tree: how much drafts keep moves with the text
(a stretch the model repeats keeps whole paths) far more than from one tree to the next (on
tiny-sala's held-out text the 2-, 4- and 8-node trees each kept 1.18-1.28 times their figure), so
a tree scaled by its own steps would be credited with the text it happened to verify.
A step takes the timed candidate with the most expected tokens per second, accept length / ms
(plain decoding: 1 / ms; a tree only at PLAIN_MARGIN times plain decoding's or more). A
candidate is timed once TIMED of its steps were: read from the disk cache
(sala/engine/step_costs.py, which keeps the acceptance too, each scale with the steps it came
from), or measured at the first decode steps of the class (plain first, then the trees smallest
first, until one does worse than STOP_BELOW the best so far: a larger tree costs more still;
weighed at every step, so the walk goes on where the estimates later bring that tree within
STOP_BELOW); `Engine.warmup` runs those steps up front. Then EXPLORE_STEPS steps in every
EXPLORE_EVERY visit the other timed trees in turn, every other time plain decoding where a tree
is chosen, so that every estimate is measured again as the machine and the text change: one
timed in a slow stretch (or read from the disk cache) and never the runner-up would otherwise
never be, however good the tree (read at 4.87 ms from the disk cache beside the 12-node tree's
4.11, the 4-node tree was not verified once in three rounds of batch-1 greedy decoding on the
2-core VM; verified at every step it ran 1.31-1.53x plain decoding, the choice 1.32-1.41x).
The first SETTLE steps after a change of candidate are not measured: a plain step right after
verify steps runs slower (the verify's code and data displace it), and a verify right after
plain steps reads drafts made tokens earlier (medusa_decoding.tree_drafts).
medusa_nodes=N verifies the N-node candidate at every step, 0 never; medusa_max_batch caps the
batch sizes that may verify.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from sala.engine.stats import ChosenTree

CANDIDATE_NODES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Measured steps before a candidate's time counts: one step's time varies by 10-20% from the next,
# and trees a few percent apart are to be told apart (at batch 1 on the 2-core VM the 2- to 8-node
# trees ran at 1.30-1.34x plain decoding, the 4-node one at 1.41x).
TIMED = 8
# Steps of a candidate after a change before its steps are measured: a plain step right after verify
# steps runs slower (on the 2-core VM at batch 1: 2.11, 1.98, 1.84, then 1.6-1.7 ms), and a verify
# right after plain steps reads drafts made tokens earlier.
SETTLE = 3
STOP_BELOW = 0.85  # timing a class stops at the first tree expected below this share of the best so far
# A visit of EXPLORE_STEPS in a row in every EXPLORE_EVERY steps: where plain decoding is chosen, its
# verify steps and the slower plain steps after them cost more than they gain (at batch 4 on the
# 2-core VM, 0.95x plain decoding with a visit in every 128 steps, 0.98-1.00x with one in 512).
EXPLORE_EVERY, EXPLORE_STEPS = 512, SETTLE + TIMED
WEIGHT = 1 / 16  # of a new step in a running estimate
ACCEPT_WEIGHT = 1 / 256  # of a new verify step in a running acceptance: one step keeps 0 to depth drafts
# The heads' validation figure counts as this many verify steps of a kind's acceptance where none was
# measured: from its first few steps alone (a step keeps anything from no draft to a whole path) a
# class has gone to plain decoding until a visit, half the steps of a run's first round of
# bench/medusa.py at batch 1 on the 2-core VM.
PRIOR_STEPS = 16
PLAIN_MARGIN = 1.1  # a tree is chosen over plain decoding where expected at this many times its tokens/s or more
OUTLIER = 3.0  # a step past this many times the estimate is a pause (a recompile, the collector), not its cost


def candidate_sizes(setting: int | str, nodes: int, measured: bool) -> list[int]:
    """The node counts of the trees an engine may verify, given medusa_nodes, the heads' tree size
    and whether its paths' acceptance was measured (else the whole tree is the one candidate)."""
    if setting == "auto":
        return sorted({n for n in CANDIDATE_NODES if n < nodes} | {nodes}) if measured else [nodes]
    if setting > nodes:
        raise ValueError(f"medusa_nodes={setting} but the heads' tree has {nodes} nodes: give at most {nodes}, or 'auto'")
    return [setting] if setting else []


def size_class(n: int) -> int:
    """The batch size class of n decoding requests: the largest power of two <= n."""
    return 1 << (n.bit_length() - 1)


@dataclass
class Running:
    """An exponentially weighted running mean, and how many values went into it."""

    mean: float = 0.0
    count: int = 0
    weight: float = WEIGHT

    def add(self, value: float) -> None:
        self.count += 1
        self.mean = value if self.count == 1 else self.mean + max(self.weight, 1 / self.count) * (value - self.mean)


class TreeChoice:
    """Which candidate (by node count; 0: plain decoding) a step verifies: see the module docstring."""

    def __init__(self, prior: dict[int, float | None], max_batch: int | None, fixed: int | None,
                 step_ms: list[list] = (), acceptance: list[list] = ()):
        self.prior = prior  # candidate -> its expected accept length (None: not measured with the heads)
        self.candidates = [0, *sorted(prior)]
        self.max_batch, self.fixed = max_batch, fixed
        # (kind, size class, nodes) -> its steps' ms; `step_ms` rows (the disk cache's) count as timed
        self.ms = {(kind, cls, nodes): Running(ms, TIMED) for kind, cls, nodes, ms in step_ms}
        # kind -> drafts its verify steps kept / drafts the priors expected, every tree's together
        self.acceptance: dict[str, Running] = {}
        self.learned(acceptance)
        self.force: int | None = None  # set while warmup compiles a step
        self.steps = 0
        self.current: tuple | None = None  # the step in flight's (kind, size class, nodes)
        self.run = 0  # steps of it in a row before the step in flight

    def __call__(self, n: int, kind: str, verifiable: bool = True) -> int:
        """The candidate a step of n decoding requests of this kind verifies (not verifiable: plain)."""
        self.steps += 1
        if self.force is not None:
            nodes = self.force
        elif not self.prior or not verifiable or (self.max_batch is not None and n > self.max_batch):
            nodes = 0
        elif self.fixed is not None:
            nodes = self.fixed
        else:
            nodes = self._choose(kind, size_class(n))
        step = (kind, size_class(n), nodes)
        self.run = self.run + 1 if step == self.current else 0
        self.current = step
        return nodes

    def _choose(self, kind: str, cls: int) -> int:
        untimed, rates = self.weigh(kind, cls)
        if untimed is not None:
            return untimed
        best = self.best(rates)
        if self.steps % EXPLORE_EVERY >= EXPLORE_EVERY - EXPLORE_STEPS and len(rates) > 1:
            visit, trees = self.steps // EXPLORE_EVERY, [n for n in rates if n and n != best]
            if not trees or best and visit % 2:
                return 0  # plain decoding, what every tree is weighed against, every other time
            return trees[(visit // 2 if best else visit) % len(trees)]  # the other timed trees in turn
        return best

    @staticmethod
    def best(rates: dict[int, float]) -> int:
        """The candidate with the most expected tokens per ms; a tree only at PLAIN_MARGIN times plain
        decoding's or more: plain steps measured among verify steps run slower than in a run of them."""
        best = max(rates, key=rates.get)
        return best if best == 0 or rates[best] >= PLAIN_MARGIN * rates[0] else 0

    def weigh(self, kind: str, cls: int) -> tuple[int | None, dict[int, float]]:
        """The candidate being timed at this class (None: every one that may pay is timed), and the
        expected tokens per ms of each timed one. Candidates are timed in order, plain first, until
        a tree does worse than STOP_BELOW of the best before it: larger ones cost more still."""
        rates, best, stopped = {}, 0.0, False
        for nodes in self.candidates:
            est = self.ms.get((kind, cls, nodes))
            if est is None or est.count < TIMED:
                if not stopped:
                    return nodes, rates
                continue
            rates[nodes] = rate = self.accept_length(kind, nodes) / est.mean
            stopped |= rate < STOP_BELOW * best
            best = max(best, rate)
        return None, rates

    def untimed(self, kind: str, cls: int) -> int | None:
        """The candidate being timed at this class, if any (`weigh`)."""
        return self.weigh(kind, cls)[0]

    def rates(self, kind: str, cls: int) -> dict[int, float]:
        """Expected tokens per ms of each timed candidate at this class."""
        return {nodes: self.accept_length(kind, nodes) / est.mean for nodes in self.candidates
                if (est := self.ms.get((kind, cls, nodes))) is not None and est.count >= TIMED}

    def accept_length(self, kind: str, nodes: int) -> float:
        """Tokens a request's step of the candidate is expected to yield now."""
        if not nodes:
            return 1.0
        return 1 + self._acceptance(kind).mean * self._expected_drafts(nodes)

    def _acceptance(self, kind: str) -> Running:
        """The kind's acceptance scale; before its steps are measured, the heads' figures as they are
        (1.0), counted as PRIOR_STEPS steps."""
        return self.acceptance.get(kind) or Running(mean=1.0, count=PRIOR_STEPS, weight=ACCEPT_WEIGHT)

    def _expected_drafts(self, nodes: int) -> float:
        """Drafts a request's verify step of the candidate keeps by the heads' validation acceptance
        (1 where that was not measured: the scale is then what its steps keep)."""
        prior = self.prior[nodes]
        return 1.0 if prior is None else prior - 1

    def _measured(self) -> bool:
        """Whether the step in flight is measured: chosen freely, SETTLE steps into a run of its candidate."""
        return self.force is None and self.run >= SETTLE

    def timed(self, ms: float) -> bool:
        """The step in flight (a decode step with no prompt work) took `ms`; whether that timed a candidate now."""
        if not self._measured():
            return False
        est = self.ms.setdefault(self.current, Running())
        est.add(min(ms, OUTLIER * est.mean) if est.count >= TIMED else ms)
        return est.count == TIMED

    def observe(self, requests: int, accepted: int) -> None:
        """The verify step in flight kept `accepted` drafts of `requests` requests."""
        if self._measured():
            kind, _, nodes = self.current
            scale = accepted / (requests * self._expected_drafts(nodes))
            self.acceptance[kind] = est = self._acceptance(kind)
            est.add(scale)

    def step_ms(self) -> list[list]:
        """[kind, size class, nodes, ms] of each timed candidate: what the disk cache keeps, with `kept`."""
        return [[*key, est.mean] for key, est in sorted(self.ms.items()) if est.count >= TIMED]

    def learned(self, acceptance: list[list]) -> None:
        """Take these acceptance scales (`kept`'s rows, from the disk cache) as running means of as
        many steps as they came from."""
        self.acceptance |= {kind: Running(mean=mean, count=steps, weight=ACCEPT_WEIGHT) for kind, mean, steps in acceptance}

    def kept(self) -> list[list]:
        """[kind, scale, steps] of each kind's acceptance measured so far."""
        return [[kind, est.mean, est.count] for kind, est in sorted(self.acceptance.items())]

    def table(self) -> tuple[ChosenTree, ...]:
        """The choice now at each class and kind whose timing is done, outside exploration."""
        rows = []
        for kind, cls in sorted({(k, c) for k, c, _, _ in self.step_ms()}):
            untimed, rates = self.weigh(kind, cls)
            if untimed is None and rates:
                nodes = self.best(rates)
                rows.append(ChosenTree(batch=cls, kind=kind, nodes=nodes, accept_length=self.accept_length(kind, nodes),
                                       speedup=rates[nodes] / rates[0]))
        return tuple(rows)

    @contextmanager
    def forcing(self, nodes: int):
        """Every step verifies the `nodes` candidate (0: decodes plainly) inside the block, unmeasured."""
        self.force = nodes
        try:
            yield
        finally:
            self.force = None
