"""sala.process_exit.exit_now ends a process as sys.exit would (its threads finished, a thread
pool left open stopped, its exit handlers run, what it printed flushed, its code returned) and
skips only the interpreter's teardown: a module global's finalizer, which the teardown would
run, never runs."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from sala.process_exit import exit_now

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()  # a module global: only the interpreter's teardown finalizes it
atexit.register(print, "exit handler ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
pool = ThreadPoolExecutor(2)  # left open: its idle workers are non-daemon threads that wait to be told to stop
pool.submit(time.sleep, 0).result()
print("written before exit", end="")  # block-buffered into the pipe: only a flush sends it
exit_now({code})
"""


@pytest.mark.parametrize("code, expected", [(3, 3), (0, 0), (None, 0)])
def test_exit_now_runs_threads_handlers_and_flushes_then_skips_the_teardown(code, expected):
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(code=code)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == expected, r.stderr
    assert r.stdout.split("\n") == ["written before exitthread finished", "exit handler ran", ""], r.stdout
    assert r.stderr == ""


def test_the_same_script_through_sys_exit_runs_the_teardown():
    """The reference: without exit_now the finalizer above does run, so the test above can tell."""
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(code=3).replace("exit_now(3)", "sys.exit(3)")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "teardown ran" in r.stdout, r.stdout
