"""When a Medusa engine verifies draft trees and when it decodes plainly, by batch size.

A verify step costs more than a decode step (T rows a request instead of one) and pays for it
in accepted tokens. Where a step is overhead-bound (small batches, a GPU) that is a gain; where
the rows already fill the machine (large batches, a CPU) it is a loss. So, as vLLM's
`disable_by_batch_size`, a step whose decoding requests number more than `max_batch` decodes
plainly. `max_batch`:

- None: always verify;
- an integer N: verify while at most N requests decode;
- "auto": `Engine.warmup` times a plain decode step and a verify step at batch sizes 1, 2, 4,
  ... up to the engine's max_seqs, and a step of n requests verifies when
  accept_length x plain(n) >= verify(n) (step times interpolated between the sizes timed). A
  verify step is timed twice: for greedy requests, whose acceptance and commit run compiled on
  CPU, and for sampled ones (typical acceptance, eager); a step with any sampled or logprobs
  request is judged by the second.
  accept_length is the engine's running mean once MIN_VERIFY_STEPS verify steps have been
  measured, before that the tree's expected accept length from the heads' measured per-rank
  accuracy (tree.expected_accept_length, an underestimate), and with neither, verify. Until
  warmup has timed the steps, it always verifies.

Greedy output does not depend on it (both kinds of step are lossless); a sampled request's
tokens do (typical acceptance and plain sampling draw differently), as with vLLM's setting.
Requests keep their last drafts through plain steps: the first verify after them usually
accepts less, never anything wrong.
"""
from __future__ import annotations

import bisect
from contextlib import contextmanager
from dataclasses import dataclass, field

from sala.engine.request import Request, SpecStats

MIN_VERIFY_STEPS = 32


def greedy_batch(reqs: list[Request]) -> bool:
    """Greedy requests without logprobs only: their verify needs nothing but argmaxes (on CPU the
    compiled greedy tail; a batch with any other request accepts eagerly)."""
    return all(r.params.greedy and r.params.logprobs is None for r in reqs)


class SpeculationSettingError(ValueError):
    """medusa_max_batch is neither an integer >= 0, "auto" nor None."""


def parse_max_batch(value) -> int | str | None:
    """medusa_max_batch as given (an integer >= 0, "auto" or None), or SpeculationSettingError naming it."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):  # from a command line or YAML
        try:
            value = int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpeculationSettingError(f"medusa_max_batch={value!r}: give an integer >= 0 (0 never verifies), 'auto' (timed at "
                         "warmup) or None (always verify)")
    return value


@dataclass
class SpeculationPolicy:
    max_batch: int | str | None
    stats: SpecStats  # the engine's running totals
    prior_accept_length: float | None = None  # expected from measured per-rank accuracy, when recorded
    # auto: batch -> (plain, greedy verify, sampled verify) ms
    step_ms: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    force: bool | None = None  # set while warmup times one kind of step

    @property
    def accept_length(self) -> float | None:
        if self.stats.verify_steps >= MIN_VERIFY_STEPS:
            return self.stats.accept_length
        return self.prior_accept_length

    def __call__(self, n: int, greedy: bool = True) -> bool:
        """Whether a step with n decoding requests verifies their trees (greedy: all of them are
        greedy without logprobs)."""
        if self.force is not None:
            return self.force
        if self.max_batch is None:
            return True
        if self.max_batch != "auto":
            return n <= self.max_batch
        if not self.step_ms or self.accept_length is None:
            return True
        plain, verify_greedy, verify_sampled = self.step_times(n)
        return self.accept_length * plain >= (verify_greedy if greedy else verify_sampled)

    @contextmanager
    def forcing(self, verify: bool):
        """Every step verifies (True) or decodes plainly (False) inside the block: warmup's compiling and timing."""
        self.force = verify
        try:
            yield
        finally:
            self.force = None

    def step_times(self, n: int) -> tuple[float, ...]:
        """(plain, greedy verify, sampled verify) ms of a step of n requests: linear between the
        sizes timed, the nearest one's outside them."""
        sizes = sorted(self.step_ms)
        i = bisect.bisect_left(sizes, n)
        if i == 0 or i == len(sizes):
            return self.step_ms[sizes[min(i, len(sizes) - 1)]]
        lo, hi = sizes[i - 1], sizes[i]
        w = (n - lo) / (hi - lo)
        return tuple((1 - w) * a + w * b for a, b in zip(self.step_ms[lo], self.step_ms[hi]))

    def largest_batch(self, max_seqs: int, greedy: bool = True) -> int:
        """The largest batch size up to max_seqs that verifies now (0: none)."""
        return max((n for n in range(1, max_seqs + 1) if self(n, greedy)), default=0)

    def describe(self, max_seqs: int) -> str:
        if self.max_batch is None:
            return "Medusa verifies at every batch size"
        if self.max_batch != "auto":
            return f"Medusa verifies while at most {self.max_batch} requests decode"
        if not self.step_ms:
            return "Medusa verifies at every batch size until warmup times the steps (medusa_max_batch='auto')"
        times = ", ".join(f"{n}: {p:.1f} / {g:.1f} / {v:.1f} ms" for n, (p, g, v) in sorted(self.step_ms.items()))
        accept = "unknown" if self.accept_length is None else f"{self.accept_length:.2f}"
        return (f"Medusa verifies greedy batches up to {self.largest_batch(max_seqs)} requests, sampled ones up to "
                f"{self.largest_batch(max_seqs, greedy=False)} (medusa_max_batch='auto': accept length {accept}; plain "
                f"/ greedy verify / sampled verify step at batch {times})")
