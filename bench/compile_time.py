"""Compile time of vtc and torch.compile (Inductor) on one workload, cold and warm cache.

Each measurement runs in a fresh process (nothing cached in memory):

- ``vtc cold``: ``vtc.compile`` + first call with an empty cache (``VTC_CACHE_DIR`` a new
  directory), so every kernel is generated and built by the C++ compiler and the plan is made;
- ``vtc warm``: the same with the cache the cold run filled (kernels loaded, plan looked up);
- ``vtc-dynamo cold`` / ``warm``: ``torch.compile(model, backend="vtc")`` + first call (dynamo
  and aot_autograd capture the graph, vtc does the rest), with an empty / the filled cache;
- ``inductor cold`` / ``warm``: ``torch.compile(model)`` + first call with an empty /
  the filled ``TORCHINDUCTOR_CACHE_DIR`` (and a fresh Triton/FX cache under it).

``total_s`` (compile + first call) is the figure to compare: torch.compile compiles lazily,
in the first call.  The vtc runs also time their stages (capture, plan, lowering, kernel
build and load, report) by wrapping the stage functions, and every run records
``setup_s``, the seconds before compiling (importing torch, transformers and vtc, building
the model).  Results go to ``bench/results/compile_time.json`` with the command, the
machine's load (``uptime``) before and after, and the thread count.

    python -m bench.compile_time [--workload llama_model] [--threads 2] [--repeat 1]
                                 [--systems vtc,vtc-dynamo,inductor]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULT = BENCH_DIR / "results" / "compile_time.json"
TAG = "VTC_COMPILE_TIME "


def _child(system: str, workload: str, threads: int) -> dict:
    """Runs in the measuring process: builds the workload, compiles it, calls it once; returns timings."""
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from bench import workloads as W

    model, inputs = W.get(workload).build()
    stages: dict[str, float] = {}
    kernels = None
    if system in ("vtc", "vtc-dynamo"):
        import vtc
        import vtc.codegen.lower as L
        import vtc.compiler as C
        import vtc.runtime.executor as E

        def timed(name, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
            return wrapper

        C.export_graph = timed("capture", C.export_graph)
        C.make_plan = timed("plan", C.make_plan)
        L.lower = timed("lower", L.lower)
        E.build_kernels = timed("build_kernels", E.build_kernels)
        C.build_report = timed("report", C.build_report)
    setup_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    if system == "vtc":
        compiled = vtc.compile(model, inputs)
        kernels = compiled.report.kernels
    else:
        compiled = torch.compile(model, backend="vtc" if system == "vtc-dynamo" else "inductor")
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.no_grad():
        compiled(*inputs)
    first_call_s = time.perf_counter() - t1
    return dict(compile_s=compile_s, first_call_s=first_call_s, total_s=compile_s + first_call_s,
                setup_s=setup_s, stages=stages, kernels=kernels)


def _measure(system: str, workload: str, threads: int, env: dict) -> dict:
    """One fresh process measuring `system`; its result dict."""
    cmd = [sys.executable, "-m", "bench.compile_time", "--child", system, "--workload", workload,
           "--threads", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=BENCH_DIR.parent, timeout=1800)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            out = json.loads(line[len(TAG):])
            out["process_wall_s"] = wall
            return out
    raise RuntimeError(f"{system} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="llama_model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="cold/warm pairs per system")
    p.add_argument("--systems", default="vtc,vtc-dynamo,inductor")
    p.add_argument("--out", default=str(RESULT))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(TAG + json.dumps(_child(a.child, a.workload, a.threads)), flush=True)
        return 0
    result = {"command": " ".join([Path(sys.executable).name, "-m", "bench.compile_time", *(argv or sys.argv[1:])]),
              "workload": a.workload, "threads": a.threads, "uptime_before": _uptime(), "runs": {}}
    for system in a.systems.split(","):
        runs = result["runs"].setdefault(system, {"cold": [], "warm": []})
        for _ in range(a.repeat):
            with tempfile.TemporaryDirectory(prefix=f"vtc-ct-{system}-") as tmp:
                env = {**os.environ, "PYTHONPATH": str(BENCH_DIR.parent)}
                if system.startswith("vtc"):
                    env["VTC_CACHE_DIR"] = tmp
                else:
                    env["TORCHINDUCTOR_CACHE_DIR"] = tmp
                    env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
                for state in ("cold", "warm"):
                    r = _measure(system, a.workload, a.threads, env)
                    runs[state].append(r)
                    stages = {k: round(v, 2) for k, v in r["stages"].items()}
                    print(f"{system:10s} {state}: compile {r['compile_s']:.2f} s + first call {r['first_call_s']:.2f} s"
                          f" = {r['total_s']:.2f} s  (setup {r['setup_s']:.1f} s)  {stages or ''}", flush=True)
    result["uptime_after"] = _uptime()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}\n{result['uptime_before']}\n{result['uptime_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
