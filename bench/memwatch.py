"""Peak memory of every process of a run, sampled from /proc (Linux, standard library only).

Two peaks, each relative to its value when the watch started:
- `system`: the machine's used memory, MemTotal - MemAvailable from /proc/meminfo (less the
  free pages parked in per-CPU lists, which MemAvailable does not count as free). It counts
  every process (Ray workers, raylets, anything else running), tmpfs and /dev/shm (Ray's object
  store), and not the page cache, which the kernel gives back on demand.
- `tree`: the sum of Pss_Anon + Pss_Shmem (proportional set size: a shared page counts 1/n in
  each of its n processes, so the sum is the tree's real footprint; anonymous and shared memory
  only, since file pages mapped from disk, a checkpoint read through mmap or the libraries, are
  page cache the kernel drops under pressure) over a process and all its descendants,
  found anew at every sample so that processes started later (Ray workers) count. A process
  seen in the tree once stays in it while it lives, even after its parent exits and it is
  reparented (a daemon that `ray start` leaves behind).

One process's own peak is exact instead: `restart_high_water_mark()`, then `status_bytes("VmHWM")`.

Benchmarks and tests import it (`from bench.memwatch import PeakMemory, run_measured` with the
checkout on sys.path, or `from memwatch import ...` from a script in bench/); as a script it
measures one command:

    python bench/memwatch.py -- python -m sala.realwidth --layers 2
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

PROC = Path("/proc")
GIB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
_GONE = (FileNotFoundError, ProcessLookupError, PermissionError)  # a process that exits or is not ours while read


def status_bytes(field: str) -> int:
    """VmRSS, VmHWM, ...: this process's figure in /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def restart_high_water_mark() -> int:
    """Restarts this process's VmHWM from its resident memory now (the kernel's own peak: exact, not
    sampled), and returns that resident memory: `status_bytes("VmHWM")` less it is then the peak's
    growth from here."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def used_system_bytes() -> int:
    """MemTotal - MemAvailable, less the free pages parked in per-CPU lists: memory in use by the
    whole machine, page cache excluded. MemFree (and so MemAvailable) leaves out the pages each
    CPU keeps for fast allocation, which Linux 6.x grows to hundreds of MiB after large frees; an
    allocation served from them would not show as used at all."""
    fields = {}
    for line in (PROC / "meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"] - per_cpu_free_bytes()


def per_cpu_free_bytes() -> int:
    """Free pages in the per-CPU lists of every zone: the `count:` of each pageset in /proc/zoneinfo."""
    pages = sum(int(line.split()[1]) for line in (PROC / "zoneinfo").read_text().splitlines() if line.strip().startswith("count:"))
    return pages * PAGE


def pss_bytes(pid: int) -> int:
    """Pss_Anon + Pss_Shmem of one process (0 for one that is gone or unreadable, kernel threads included)."""
    try:
        return sum(int(line.split()[1]) * 1024 for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines()
                   if line.startswith(("Pss_Anon:", "Pss_Shmem:")))
    except _GONE:
        return 0


def processes() -> dict[tuple[int, int], int]:
    """Every live process as (pid, start time) -> parent pid; the start time tells a reused pid apart."""
    out = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except _GONE:
            continue
        # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        out[(int(entry.name), int(fields[19]))] = int(fields[1])
    return out


class PeakMemory:
    """Context manager: a daemon thread samples both measures every `interval` seconds while the
    block runs, and once more at its end. `root` (default: this process) and `roots` are the
    trees whose anonymous + shared Pss is summed."""

    def __init__(self, root: int | None = None, roots: Iterable[int] = (), interval: float = 0.05):
        self.roots = {os.getpid() if root is None else root, *roots}
        self.interval = interval
        self.baseline_system_bytes = 0
        self.baseline_tree_bytes = 0
        self.peak_system_bytes = 0
        self.peak_tree_bytes = 0
        self.samples = 0
        self.seconds = 0.0
        self.members: set[tuple[int, int]] = set()  # every (pid, start time) seen in the tree
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._t0 = 0.0
        self._error: BaseException | None = None  # the sampling thread's, raised at the block's end

    def tree_bytes(self) -> int:
        """Sum of anonymous + shared Pss over the roots, their descendants, and live processes seen in the tree before."""
        procs = processes()
        children: dict[int, list[tuple[int, int]]] = {}
        for key, ppid in procs.items():
            children.setdefault(ppid, []).append(key)
        live = [key for key in procs if key[0] in self.roots or key in self.members]
        tree = set(live)
        while live:
            for child in children.get(live.pop()[0], ()):
                if child not in tree:
                    tree.add(child)
                    live.append(child)
        self.members |= tree
        return sum(pss_bytes(pid) for pid, _ in tree)

    def sample(self) -> None:
        with self._lock:
            tree = self.tree_bytes() - self.baseline_tree_bytes
            system = used_system_bytes() - self.baseline_system_bytes
            self.peak_tree_bytes = max(self.peak_tree_bytes, tree)
            self.peak_system_bytes = max(self.peak_system_bytes, system)
            self.samples += 1

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.sample()
        except BaseException as e:  # a thread's exception is otherwise lost, and the peaks with it
            self._error = e

    def __enter__(self) -> PeakMemory:
        self.baseline_system_bytes = used_system_bytes()
        self.baseline_tree_bytes = self.tree_bytes()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        self.sample()
        self.seconds = time.perf_counter() - self._t0

    @staticmethod
    def gib(n: int) -> float:
        return round(n / GIB, 3)

    def summary(self) -> dict:
        return {
            "peak_system_gib": self.gib(self.peak_system_bytes),
            "peak_tree_gib": self.gib(self.peak_tree_bytes),
            "baseline_system_gib": self.gib(self.baseline_system_bytes),
            "baseline_tree_gib": self.gib(self.baseline_tree_bytes),
            "processes": len(self.members),
            "samples": self.samples,
            "seconds": round(self.seconds, 2),
        }


def run_measured(cmd: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None, timeout: float | None = None,
                 capture: bool = True, interval: float = 0.05) -> tuple[subprocess.CompletedProcess, PeakMemory]:
    """Run `cmd` in a process group of its own while watching its process tree and the machine.
    Output is captured (text) unless `capture` is false. On timeout the whole group is killed and
    subprocess.TimeoutExpired raised, as subprocess.run does."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=pipe, stderr=pipe, text=True, process_group=0)
    with PeakMemory(root=proc.pid, interval=interval) as peak:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python bench/memwatch.py -- CMD [ARGS...]", file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1 :]
    result, peak = run_measured(cmd, capture=False)
    s = peak.summary()
    print(f"\npeak memory of: {' '.join(cmd)}")
    rows = [("system (MemTotal - MemAvailable, over its start)", f"{s['peak_system_gib']:.3f} GiB"),
            ("process tree (sum of anonymous + shared Pss, over its start)", f"{s['peak_tree_gib']:.3f} GiB"),
            ("processes in the tree", s["processes"]), ("samples", s["samples"]), ("seconds", s["seconds"]),
            ("exit status", result.returncode)]
    for name, value in rows:
        print(f"  {name:<50} {value}")
    print(json.dumps({"peak_system_gib": s["peak_system_gib"], "peak_tree_gib": s["peak_tree_gib"],
                      "seconds": s["seconds"], "rc": result.returncode}))
    return result.returncode if result.returncode >= 0 else 128 - result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
