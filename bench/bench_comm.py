"""Communication audit table: every collective of one training iteration (kind, group, calls, bytes) measured with
parallel.count_collectives() against the analytic volume (tests/test_comm_audit.py's `expected`), for the layouts
of the test at the default model's width: h 256, 8 heads, seq 128, 4 layers, vocab 8192, micro-batch 2, 2 micro-
batches, float64; MoE with 4 experts, top-2. Bytes are summed over all ranks (2 or 4 gloo ranks on CPU).

    .venv/bin/python bench/bench_comm.py                    (or --layouts tp2 tp2_sp ...)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from test_comm_audit import LAYOUTS, expected, measure  # noqa: E402

from harness import Pools  # noqa: E402

SHAPE = dict(L=4, h=256, heads=8, s=128, b=2, M=2, V=8192, E=4, k=2)


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    return ap.parse_args(argv)


def main():
    args = parse_args()
    print("command: .venv/bin/python bench/bench_comm.py" + (" --layouts " + " ".join(args.layouts)
                                                             if args.layouts != list(LAYOUTS) else ""))
    print("shape: " + ", ".join(f"{k} {v}" for k, v in SHAPE.items()) + " (float64; bytes summed over the ranks)")
    pools, ok = Pools(), True
    try:
        for name in args.layouts:
            t0 = time.time()
            got, want = measure(pools, name, shape=SHAPE), expected(SHAPE, name)
            print(f"\n{name} ({time.time() - t0:.1f} s)")
            print(f"| {'kind':<14} | {'group':<9} | {'calls':>5} | {'bytes measured':>14} | {'bytes expected':>14} | ratio |")
            print(f"|{'-' * 16}|{'-' * 11}|{'-' * 7}|{'-' * 16}|{'-' * 16}|{'-' * 7}|")
            for key in sorted(set(got) | set(want)):
                (c, b), (ce, be) = got.get(key, (0, 0)), want.get(key, (0, 0))
                ratio = b / be if be else float("inf")
                ok &= (c, b) == (ce, be)
                calls = f"{c}" if c == ce else f"{c}/{ce}"
                print(f"| {key[0]:<14} | {key[1]:<9} | {calls:>5} | {b:>14,} | {be:>14,} | {ratio:5.2f} |")
    finally:
        pools.close()
    print("\nevery kind measured / expected = 1.00" if ok else "\nMISMATCH: see the rows whose ratio is not 1.00")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
