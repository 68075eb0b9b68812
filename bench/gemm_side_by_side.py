"""GEMM workloads timed side by side in one process, interleaved, reporting min and median per system.

The harness (``vtc bench --workloads gemm``) times one system after the other and reports medians; on a
shared, loaded machine those swing by 10x (a 2-thread call that loses its core waits a scheduler quantum).
This script runs every system once per round, round after round, so each sees the same load, and records
the minimum (the undisturbed time) next to the median::

    python -m bench.gemm_side_by_side [--workloads gemm] [--threads 2] [--rounds 15] [--out DIR]
    python -m bench.gemm_side_by_side --threads 1 --clock cpu   # CPU time of the calling thread

With ``--clock cpu`` (one thread only: every system then runs in the calling thread) the time is the
thread's CPU time, which does not count the time the thread waited for a core: on a machine shared with
other jobs it is the figure that stays put while wall times swing.

Systems: eager (torch.matmul: MKL/oneDNN), onnxruntime (MLAS), vtc-all (gemm="auto"), vtc-gemm-vtc (every
GEMM generated), vtc-gemm-torch (every GEMM through torch, non-strided operands copied first); ``--systems``
picks some (and may add openvino).

``--workloads sweep`` (or ``sweep_sq*``, ``sweep_rect*``, ``sweep_skinny*``, ``swin_*``: globs over the grid) takes
the issue-4 grid defined here instead of the registry's: contiguous float32 ``M x K @ K x N`` with both operands
runtime inputs (``sweep_*_rt_m<M>_k<K>_n<N>``) and ``x @ W^T`` of an ``nn.Linear(K, N)`` (B a constant weight,
``sweep_*_lin_m<M>_k<K>_n<N>``): every square 64 .. 2048, rectangular cells of M, N, K in {64 .. 2048}, the
skinny rows of decoding (M = 1 .. 16 against 1024 / 4096-wide weights) and swin_t's Linear layers (``swin_*``,
M = 3136 / 784 / 196 / 49 rows).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from bench import workloads as W
from bench.harness import SETTLE_S, run_delay_s
from bench.systems import PREPARE, Context, SystemFailure

SYSTEMS = ("eager", "onnxruntime", "vtc-all", "vtc-gemm-vtc", "vtc-gemm-torch")
SWEEP_SIZES = (64, 128, 256, 512, 1024, 2048)
# rectangular (M, K, N): each of the three long / short in turn, the 256-row and 2048-row prefill-like cells
SWEEP_RECT = [(64, 2048, 2048), (2048, 64, 2048), (2048, 2048, 64), (128, 1024, 512), (512, 128, 1024),
              (1024, 512, 128), (256, 2048, 1024), (1024, 256, 2048), (2048, 1024, 256), (64, 512, 2048),
              (2048, 128, 512), (512, 2048, 128), (1024, 2048, 512), (256, 64, 1024)]
SWEEP_SKINNY = [(m, k, n) for m in (1, 2, 4, 8, 16) for k, n in ((1024, 1024), (4096, 4096), (1024, 4096), (4096, 1024))]
# swin_t's nn.Linear layers at batch 1 (rows = tokens of the stage: 56^2, 28^2, 14^2, 7^2): qkv (C -> 3C), proj
# (C -> C), MLP (C -> 4C -> C), patch merging (4C -> 2C)
SWIN = [(rows, k, n) for rows, c in ((3136, 96), (784, 192), (196, 384), (49, 768))
        for k, n in ((c, 3 * c), (c, c), (c, 4 * c), (4 * c, c))] + [(784, 384, 192), (196, 768, 384), (49, 1536, 768)]


def sweep_workloads() -> list:
    """The sweep grid as Workloads (runtime operands and a constant weight for every (M, K, N))."""
    from torch import nn

    from bench.workloads import Workload, randn
    from bench.workloads.micro import Fn

    def rt(m, k, n):
        return lambda quick: (Fn(lambda _, a, b: a @ b, f"mm_{m}_{k}_{n}"), (randn(m, k, seed=1), randn(k, n, seed=2)))

    def lin(m, k, n):
        return lambda quick: (nn.Linear(k, n, bias=False), (randn(m, k, seed=3),))

    cells = ([("sq", s, s, s) for s in SWEEP_SIZES] + [("rect", *c) for c in SWEEP_RECT]
             + [("skinny", *c) for c in SWEEP_SKINNY] + [("swin", *c) for c in SWIN])
    out = []
    for kind, m, k, n in cells:
        for form, build, what in (("rt", rt, "a @ b, both runtime inputs"), ("lin", lin, "x @ W^T, W a constant")):
            name = f"{kind}_{form}_m{m}_k{k}_n{n}" if kind == "swin" else f"sweep_{kind}_{form}_m{m}_k{k}_n{n}"
            out.append(Workload(name, "gemm", f"{what}: {m} x {k} @ {k} x {n}", build(m, k, n), default=False,
                                params=dict(m=m, n=n, k=k)))
    return out


def select(spec: str) -> list:
    """Workloads for a comma list: registry names / globs / groups, or globs over the sweep grid."""
    import fnmatch

    grid = sweep_workloads()
    out, rest = [], []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        hits = [w for w in grid if item == "sweep" and w.name.startswith("sweep_") or fnmatch.fnmatchcase(w.name, item)]
        if hits:
            out += [w for w in hits if w not in out]
        else:
            rest.append(item)
    return out + (W.select(",".join(rest)) if rest else [])
MIN_ROUND_S = 0.02  # each system's calls per round last at least this long (small GEMMs repeat)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _reps(fn) -> int:
    """Calls of `fn` per timed block: enough for MIN_ROUND_S (after two warm-up calls)."""
    fn(); fn()
    t0 = time.perf_counter()
    fn()
    return max(1, int(MIN_ROUND_S / max(time.perf_counter() - t0, 1e-7)))


def run_delay_ms() -> float:
    """ms the threads of this process have spent runnable but waiting for a core (``bench.harness.run_delay_s``)."""
    return run_delay_s() * 1e3


def _block(fn, reps: int, clock) -> tuple[float, float]:
    """(ms per call, ms per call this process's threads waited for a core) of one timed block: a SETTLE_S pause, an
    untimed call, then `reps` timed calls."""
    time.sleep(SETTLE_S)  # the previous system's spinning threads go idle (bench/harness.py, step 3)
    fn()
    w0 = run_delay_ms()
    t0 = clock()
    for _ in range(reps):
        fn()
    t1 = clock()
    return (t1 - t0) / reps * 1e3, (run_delay_ms() - w0) / reps


def _summary(samples: list, reps: int) -> dict:
    """min / median ms per call over the rounds, with the rounds' waits for a core (`samples`: (ms, waited ms)):
    the median wait per call, and the wait in the fastest round."""
    ms = [m for m, _ in samples]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "calls_per_round": reps,
            "waited_ms_median": statistics.median(w for _, w in samples), "waited_ms_at_min": min(samples)[1],
            "rounds_ms": [round(m, 5) for m in ms], "rounds_waited_ms": [round(w, 5) for _, w in samples]}


def time_side_by_side(fns: dict, rounds: int, clock=time.perf_counter) -> dict:
    """{system: {"min_ms", "median_ms", "calls_per_round", "waited_ms_median", ...}} from interleaved rounds (each
    opened by a pause and an untimed call); ``waited_ms_*``: per call, how long this process's threads were runnable
    but had no core (load from other processes: on a shared machine a 2-thread kernel whose threads must meet at a
    barrier loses far more to it than its share)."""
    reps = {name: _reps(fn) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_block(fn, reps[name], clock))
    return {n: _summary(s, reps[n]) for n, s in samples.items()}


WORKER_TAG = "GEMM_SBS_WORKER "


class Workers:
    """One worker process per system (``python -m bench.gemm_side_by_side worker SYSTEM``), each preparing and
    timing only its own system, driven round after round from this process, one worker at a time: the rounds
    interleave as in `time_side_by_side`, and no system's thread pools, libraries or settings share a process
    with another's.  Use as a context manager."""

    def __init__(self, systems: list, threads: int, clock: str, log_dir: Path):
        self.procs = {}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                          *filter(None, [os.environ.get("PYTHONPATH")])]))
        for s in systems:
            log = open(log_dir / f"worker-{s}.log", "w")
            self.procs[s] = (subprocess.Popen(
                [sys.executable, "-m", "bench.gemm_side_by_side", "worker", s, "--threads", str(threads),
                 "--clock", clock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                cwd=Path(__file__).resolve().parent.parent), log)

    def ask(self, system: str, line: str) -> dict:
        proc, log = self.procs[system]
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        except OSError:  # the worker is gone
            pass
        for out in proc.stdout:
            if out.startswith(WORKER_TAG):
                return json.loads(out[len(WORKER_TAG):])
        log.flush()
        tail = [ln for ln in Path(log.name).read_text().splitlines() if ln.strip()]
        raise SystemFailure("failed", f"worker exited {proc.wait()}: {tail[-1][:200] if tail else 'no output'}")

    def time(self, workload: str, rounds: int) -> tuple[dict, dict]:
        """({system: summary}, {system: why it failed}) for one workload."""
        reps, failed, self.pids = {}, {}, {}
        for s in self.procs:
            try:
                r = self.ask(s, "prepare " + workload)
            except SystemFailure as e:
                r = {"failed": e.reason}
            if "failed" in r:
                failed[s] = r["failed"]
            else:
                reps[s], self.pids[s] = r["reps"], r["pid"]
        samples = {s: [] for s in reps}
        for _ in range(rounds):
            for s in [s for s in reps if s not in failed]:
                try:
                    r = self.ask(s, "round")
                except SystemFailure as e:  # the worker died in a timed call
                    r = {"failed": e.reason}
                if "failed" in r:
                    failed[s] = f"failed on a timed call: {r['failed']}"
                else:
                    samples[s].append((r["ms"], r["waited_ms"]))
        return {s: _summary(samples[s], reps[s]) for s in reps if s not in failed}, failed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for proc, log in self.procs.values():
            with contextlib.suppress(OSError):
                proc.stdin.write("quit\n")
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def worker_main(system: str, threads: int, clock: str) -> int:
    """A worker process of `Workers`: reads "prepare WORKLOAD", "round" and "quit" lines on stdin and answers each
    with one tagged JSON line on stdout."""
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    fn = reps = None
    with tempfile.TemporaryDirectory() as tmp:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "quit":
                break
            if cmd == "prepare":
                fn = None
                try:
                    [w] = select(arg)
                    model, inputs = w.build()
                    fn, why = _prepare(system, Context(w.name, model, inputs, threads, Path(tmp)))
                    out = {"failed": why} if fn is None else {"reps": _reps(fn), "pid": os.getpid()}
                except Exception as e:  # noqa: BLE001 - a workload that does not build is a result
                    out = {"failed": _why(e)}
                reps = out.get("reps")
            elif cmd == "round":
                try:
                    ms, waited = _block(fn, reps, CLOCKS[clock])
                    out = {"ms": ms, "waited_ms": waited}
                except Exception as e:  # a system failing on a later call is a result
                    out = {"failed": _why(e)}
            else:
                out = {"failed": f"unknown command {line.strip()!r}"}
            print(WORKER_TAG + json.dumps(out), flush=True)
    return 0


def _why(e: Exception) -> str:
    """A failure's one-line reason: the exception's type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _prepare(system: str, ctx: Context) -> tuple:
    """(the system's call, None), or (None, why it could not be prepared)."""
    try:
        return PREPARE[system](ctx).fn, None
    except SystemFailure as e:
        return None, e.reason
    except Exception as e:  # noqa: BLE001 - e.g. ONNX Runtime has no CPU MatMul for bf16
        return None, _why(e)


def _time_here(w, systems: list, args, tmp: Path) -> tuple[dict, dict]:
    """({system: summary}, {system: why it failed}) for workload w, every system prepared and timed in this process
    (``--process one``)."""
    model, inputs = w.build()
    ctx = Context(w.name, model, inputs, args.threads, tmp)
    fns, failed = {}, {}
    for s in systems:
        fn, why = _prepare(s, ctx)
        if fn is None:
            failed[s] = why
        else:
            fns[s] = fn
    with torch.no_grad():
        times = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
    return times, failed


def _row(w, times: dict, failed: dict) -> dict:
    """One workload's JSON row: the times, the failures and vtc's ratios to the faster library (of minima)."""
    libs = [times[s]["min_ms"] for s in ("eager", "onnxruntime") if s in times]
    best_lib = min(libs) if libs else None

    def vs(s):
        return best_lib / times[s]["min_ms"] if best_lib is not None and s in times else None
    return {"workload": w.name, "desc": w.desc, "params": w.params, "times": times, "failed": failed,
            "vtc_all_vs_best_library": vs("vtc-all"), "vtc_gemm_vs_best_library": vs("vtc-gemm-vtc"),
            "vtc_gemm_vs_copy_plus_torch": times["vtc-gemm-torch"]["min_ms"] / times["vtc-gemm-vtc"]["min_ms"]
            if "vtc-gemm-torch" in times and "vtc-gemm-vtc" in times else None}  # bf16 virtual operands: no bf16 copy kernel


def _print_row(row: dict) -> None:
    ratios = ", ".join(f"{k} x{row[v]:.2f}" for k, v in (("vtc-all", "vtc_all_vs_best_library"),
                                                         ("vtc-gemm", "vtc_gemm_vs_best_library")) if row[v])
    print(f"{row['workload']:<20} " + "  ".join(f"{s} {t['min_ms']:.3f}/{t['median_ms']:.3f} (w {t['waited_ms_median']:.3f})"
                                                 for s, t in row["times"].items())
          + f"  | {ratios} of the best library (min ms/median ms (waited for a core per call, median))"
          + "".join(f"  [{s} failed: {why}]" for s, why in row["failed"].items()), flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        p = argparse.ArgumentParser(prog="bench.gemm_side_by_side worker")
        p.add_argument("system", choices=sorted(PREPARE))
        p.add_argument("--threads", type=int, required=True)
        p.add_argument("--clock", choices=sorted(CLOCKS), required=True)
        a = p.parse_args(argv[1:])
        return worker_main(a.system, a.threads, a.clock)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gemm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list (of " + ", ".join(SYSTEMS)
                   + ", openvino)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the calling thread's CPU time (with --threads 1 only)")
    p.add_argument("--process", choices=("each", "one"), default="each",
                   help="each: every system in a worker process of its own (the default); one: all in this process")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures the calling thread only: it needs --threads 1, not {args.threads}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = []
    systems = args.systems.split(",")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workers = stack.enter_context(Workers(systems, args.threads, args.clock, Path(tmp))) \
            if args.process == "each" else None
        for w in select(args.workloads):
            if workers is not None:
                times, failed = workers.time(w.name, args.rounds)
            else:
                times, failed = _time_here(w, systems, args, Path(tmp))
            row = _row(w, times, failed)
            results.append(row)
            _print_row(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gemm-side-by-side-{socket.gethostname()}-{datetime.now():%Y-%m-%d-%H%M%S}.json"
    data = {"command": "python -m bench.gemm_side_by_side " + " ".join(argv), "threads": args.threads,
            "clock": args.clock, "process": args.process, "settle_s": SETTLE_S,
            "thread_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))},
            "rounds": args.rounds, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "cpu_count": os.cpu_count(), "results": results}
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}; load average before {load_before}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
