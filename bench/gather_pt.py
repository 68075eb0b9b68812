"""index_select -> sum 64 MB with 2 threads, timed as ``bench/gather_sum_variants.cpp``'s ``PT=1`` (a 2-thread figure
that a loaded machine does not spoil): two Python threads, each calling a 1-thread vtc kernel over its half of the
index (ctypes releases the GIL), each timed by its own CPU clock, both started together; a call's time is the slower
thread's.  Systems: ``before`` (the gathered rows prefetched into L1 only: ``prefetch.L2_BYTES`` huge), ``now``, and
the same table read contiguously, each thread its half (``table.sum(-1)`` by vtc and by torch)::

    PYTHONPATH=$PWD N=15 python bench/gather_pt.py
"""
import os, statistics, threading, time, warnings
warnings.simplefilter("ignore")
import torch
from bench import workloads as W
import vtc
from vtc.codegen import prefetch
torch.set_num_threads(1)
model, (table, idx) = W.get("micro_index_select_sum_64mb").build(False)
h = len(idx) // 2
halves = [idx[:h].clone(), idx[h:].clone()]
f = lambda t, i: t.index_select(0, i).sum(-1)
fns = {}
with torch.no_grad():
    saved = prefetch.L2_BYTES
    prefetch.L2_BYTES = 1 << 62
    before = [vtc.compile(f, (table, i), plan="all") for i in halves]
    prefetch.L2_BYTES = saved
    now = [vtc.compile(f, (table, i), plan="all") for i in halves]
    for c, i in zip(before + now, halves + halves):
        torch.testing.assert_close(c(table, i), f(table, i), rtol=1e-4, atol=1e-4)
    parts = [table[:table.shape[0] // 2], table[table.shape[0] // 2:]]
    cs = [vtc.compile(lambda t: t.sum(-1), (p,), plan="all") for p in parts]
fns["before"] = [lambda c=c, i=i: c(table, i) for c, i in zip(before, halves)]
fns["now"] = [lambda c=c, i=i: c(table, i) for c, i in zip(now, halves)]
fns["contig-vtc"] = [lambda c=c, p=p: c(p) for c, p in zip(cs, parts)]
fns["contig-torch"] = [lambda p=p: p.sum(-1) for p in parts]
go, done = threading.Barrier(3), threading.Barrier(3)
job = {"f": None, "t": [0.0, 0.0]}
def worker(k):
    while True:
        go.wait()
        if job["f"] is None:
            return
        fn = job["f"][k]
        t0 = time.thread_time(); fn(); job["t"][k] = time.thread_time() - t0
        done.wait()
ths = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
for t in ths: t.start()
res = {n: [] for n in fns}
N = int(os.environ.get("N", "15"))
for r in range(N + 2):
    for n, pair in fns.items():
        job["f"] = pair
        go.wait(); done.wait()
        if r >= 2:
            res[n].append(max(job["t"]) * 1e3)
job["f"] = None
go.wait()
for t in ths: t.join()
print(" ".join(f"{n} {statistics.median(v):.3f}/{min(v):.3f}" for n, v in res.items()), f"ms (median/min of {N}), load {os.getloadavg()[0]:.2f}")
