"""Python's cycle collector, tuned for processes that import torch, transformers and Ray.

CPython collects its youngest generation every 700 container allocations, and every so often
collects every object alive. Importing torch, transformers and Ray builds about half a million
such objects, so a process spends about a fifth of its imports in the collector: on the 2-core
Xeon, `import serve.server` after `import ray` took 6.0-6.8 s, and 4.7-6.0 s with the youngest
generation collected every 20,000 allocations (far fewer full collections run). A Serve replica
that restarts spends most of its start importing (docs/faults.md), and so does every Ray worker
the pipelines start. So `serve` and `pipelines`, the packages those processes import first, call
`collect_less()` before any of their modules imports torch. Garbage in reference cycles is freed a
little later; the rest is freed by reference counting, as before.
"""
import gc

YOUNGEST = 20_000  # allocations between collections of the youngest generation


def collect_less() -> None:
    """Collect the youngest generation every YOUNGEST allocations: a threshold already higher, or 0
    (collection off), is left as it is, and so are the older generations'."""
    first, *older = gc.get_threshold()
    if 0 < first < YOUNGEST:
        gc.set_threshold(YOUNGEST, *older)
