"""A/B of the gathered rows' software prefetch (``vtc.codegen.prefetch``) in one process, with eager, Inductor and
the same table read without the index alongside.

Systems: ``t3a<A>``: vtc with the rows A ahead prefetched into L1 (``prefetcht0``, ``prefetch.AHEAD``; the form for
tables within L2); ``t2a<A>``: the rows A ahead into L2 (``prefetcht1``, ``prefetch.FAR_AHEAD``), ``t2a<A>n``: and
the rows ``AHEAD`` on into L1 (``prefetch.FAR_AND_NEAR``; the form for tables larger than L2), each whatever the
table's size (``prefetch.L2_BYTES``); ``vtc``: the module's settings as they are; ``contig-vtc`` / ``contig-torch``: ``table.sum(-1)`` by vtc /
torch (the same bytes read contiguously: the floor of the gathered read)::

    PYTHONPATH=$PWD python -m bench.prefetch_ab micro_index_select_sum_64mb --systems inductor,t3a4,t2a16,t2a16n,contig-vtc
    PYTHONPATH=$PWD python -m bench.prefetch_ab micro_index_select_sum_8mb --threads 1 --clock cpu
    PYTHONPATH=$PWD python -m bench.prefetch_ab micro_index_select_sum_64mb --per-call --rounds 31

Rounds interleave every system (``bench.gemm_side_by_side.time_side_by_side``, or ``--per-call``: single calls,
``bench.micro_side_by_side.per_call_times``); median / min ms per system (``--per-call``: median / 10th percentile).
"""
from __future__ import annotations

import argparse
import os
import re

import torch

from bench import workloads as W
from bench.gemm_side_by_side import CLOCKS, time_side_by_side
from bench.micro_side_by_side import baselines, per_call_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-call", action="store_true")
    ap.add_argument("--systems", default="eager,inductor,t3a4,t2a16,t2a16n,contig-vtc,contig-torch")
    args = ap.parse_args()
    if args.clock == "cpu" and (args.threads != 1 or args.per_call):
        ap.error("--clock cpu: 1 thread, rounds of calls")
    torch.set_num_threads(args.threads)
    import vtc
    from vtc.codegen import prefetch

    saved = prefetch.AHEAD, prefetch.FAR_AHEAD, prefetch.L2_BYTES, prefetch.FAR_AND_NEAR
    systems = args.systems.split(",")
    for name in args.workloads.split(","):
        model, inputs = W.get(name).build(False)
        table = inputs[0]
        with torch.no_grad():
            ref = model(*inputs)
            fns = baselines(model, inputs, systems)
            for label in systems:
                m = re.fullmatch(r"t([23])a(\d+)(n?)", label)
                if m or label == "vtc":
                    if m and m[1] == "3":
                        prefetch.AHEAD, prefetch.L2_BYTES = int(m[2]), 1 << 62
                    elif m:
                        prefetch.FAR_AHEAD, prefetch.L2_BYTES, prefetch.FAR_AND_NEAR = int(m[2]), 0, bool(m[3])
                    cv = vtc.compile(model, inputs, plan="all")
                    prefetch.AHEAD, prefetch.FAR_AHEAD, prefetch.L2_BYTES, prefetch.FAR_AND_NEAR = saved
                    torch.testing.assert_close(cv(*inputs), ref, rtol=1e-4, atol=1e-4)
                    fns[label] = lambda cv=cv: cv(*inputs)
                elif label == "contig-vtc":
                    cs = vtc.compile(lambda t: t.sum(-1), (table,), plan="all")
                    fns[label] = lambda cs=cs: cs(table)
                elif label == "contig-torch":
                    fns[label] = lambda: table.sum(-1)
            res = per_call_times(fns, args.rounds) if args.per_call else \
                time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
        print(name, f"threads={args.threads} clock={'per-call' if args.per_call else args.clock}",
              " ".join(f"{k} {r['median_ms']:.4f}/{r['min_ms']:.4f}" for k, r in res.items()),
              f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
