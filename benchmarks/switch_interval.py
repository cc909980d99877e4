"""Run a module with another GIL switch interval: `python
benchmarks/switch_interval.py MS -m pegaflow.cli ARGS...`. For benchmarks that
ask whether the server's event loop waits on threads holding the GIL (a
waiting thread gets the GIL after at most the interval, 5 ms by default)."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.setswitchinterval(float(sys.argv[1]) / 1e3)
    if sys.argv[2] != "-m":
        sys.exit("usage: switch_interval.py MS -m MODULE [ARGS...]")
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
