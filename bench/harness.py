"""The benchmark harness: every selected system on every selected workload, one JSON of raw numbers.

Per workload, in this process:

1. build the model and inputs (deterministic), run eager once for the reference outputs;
2. prepare each system (compile / export / session) under a time limit, run it once
   (prepare + first call = its time to first result), check its outputs against eager;
3. time all prepared systems *interleaved*: rounds in which each system (in a rotating
   order) runs one untimed call and then a block of timed calls, so that load from
   other processes on a shared machine falls on every system alike; the median, min
   and max of all timed calls are the latency figures.  Each block starts after a pause
   of ``settle_s`` (60 ms): the thread pools of the system before it spin on their
   cores after its last call (ONNX Runtime's for ~45 ms, libgomp's for ~10 ms on this
   machine, measured as process CPU time while the main thread sleeps), and would
   otherwise take one of the two cores from the next system's timed calls.  Per block the JSON also records
   how long (per call) the process's threads were runnable but had no core (``waited_s``, from
   ``/proc/self/task/*/schedstat``): on a shared machine, load from other processes that falls on one system's
   2-thread calls far more than on another's (vtc's OpenMP team must have both threads on a core to finish a
   call; ONNX Runtime's calling thread finishes the work its pool has not started), docs/gemm.md, session 18;
4. memory (unless off): for each system that ran, a fresh process
   (``python -m bench.harness probe ...``) with ``MALLOC_MMAP_THRESHOLD_=65536`` in
   its environment builds the workload, prepares the system (ONNX Runtime with its
   CPU arena off, vtc with its buffer pool off: ``VTC_BUFFER_POOL=0``), runs two warm-up calls, resets the peak-RSS mark by writing "5"
   to ``/proc/self/clear_refs``, runs one inference and reports VmHWM minus the RSS
   before that inference.

The JSON (``<out>/<host>-<date>.json``) is rewritten after every workload, so an
interrupted run keeps what it measured; at the end ``bench/report.py`` renders it
into BENCHMARKS.md and a PNG chart.  A system that fails on a workload is
recorded with a status ("failed", "not installed", "n/a", "skipped") and a
one-line reason; nothing a system does stops the suite.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from bench import workloads as W
from bench.systems import (OTHERS, PREPARE, QUICK_SKIP, SYSTEMS, VTC_HEADLINE_ORDER, VTC_VARIANTS, Context,
                           SystemFailure, flat_outputs, one_line, parse_systems)
from vtc.plan.cost import waited_s as run_delay_s  # seconds this process's threads waited for a core

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
SCHEMA = 1
PROBE_TAG = "VTC_BENCH_PROBE "
RTOL = 1e-3  # outputs must match eager within this, relative to the output's largest magnitude
# ... for 16-bit outputs: about 10 and 6 units in the last place of the largest element (a 4-layer Llama's logits
# in float16 / bfloat16 eager differ from its float32 ones by 9.6e-4 / 8.1e-3 of the largest, 2026-12-01)
LOW_PRECISION_RTOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}
SETTLE_S = 0.06  # s of pause before each timed block (see step 3 above)
BOOL_MISMATCH = 1e-3  # fraction of boolean outputs allowed to differ (thresholds flip on rounding)
MEMORY_GROUPS = ("unit", "model")  # default groups with memory probes in a full run


class BenchTimeout(BaseException):
    """A system took longer than its time limit (BaseException so library code cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raises BenchTimeout in this block after `seconds` (main thread with SIGALRM only; else no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise BenchTimeout(f"took longer than the {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- settings


class Settings:
    """Run parameters; `quick` changes the defaults (fewer runs, no memory probes, no max-autotune)."""

    def __init__(self, quick: bool = False, runs: int | None = None, threads: int | None = None,
                 memory: bool | None = None, memory_groups: tuple[str, ...] | None = None,
                 memory_systems: tuple[str, ...] | None = None,
                 prepare_timeout: float | None = None, probe_timeout: float = 300.0,
                 probe_jobs: int = 2, max_timing_s: float | None = None):
        self.quick = quick
        self.runs = runs or (5 if quick else 20)
        self.block = min(5, self.runs)
        self.settle_s = SETTLE_S  # pause before each block: the previous system's spinning threads go idle
        self.warmup = 1 if quick else 2
        self.threads = threads or os.cpu_count() or 1
        self.memory = (not quick) if memory is None else memory
        # groups whose workloads get memory probes: a fresh process per system costs ~10-30 s each
        if memory_groups is None:
            memory_groups = MEMORY_GROUPS if memory is None else tuple(W.GROUPS)
        self.memory_groups = tuple(memory_groups) if self.memory else ()
        self.memory_systems = tuple(memory_systems) if memory_systems else None  # None: every system
        self.prepare_timeout = prepare_timeout or (90.0 if quick else 240.0)
        self.probe_timeout = probe_timeout
        self.probe_jobs = max(1, probe_jobs)
        # a system whose calls would take longer than this in all gets fewer timed runs (recorded)
        self.max_timing_s = max_timing_s or (20.0 if quick else 30.0)
        self.min_runs = min(self.runs, 5 if quick else 10)

    def to_dict(self) -> dict:
        """The settings as plain data."""
        return dict(quick=self.quick, runs=self.runs, block=self.block, settle_s=self.settle_s, warmup=self.warmup, threads=self.threads,
                    memory=self.memory, memory_groups=list(self.memory_groups),
                    memory_systems=list(self.memory_systems) if self.memory_systems else None, prepare_timeout_s=self.prepare_timeout, probe_timeout_s=self.probe_timeout,
                    probe_jobs=self.probe_jobs, max_timing_s=self.max_timing_s, min_runs=self.min_runs, rtol=RTOL)


# ----------------------------------------------------------------------------- machine


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info(threads: int) -> dict:
    """CPU model, cores, memory, versions, thread count, load average, git commit."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    git = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                       timeout=10).stdout.strip()
        git["dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                                           text=True, timeout=10).stdout.strip())
    return {
        "host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "threads": threads,
        "memory_bytes": mem, "python": platform.python_version(), "platform": platform.platform(),
        "versions": {d: _version(d) for d in ("torch", "onnxruntime", "openvino", "onnx", "onnxscript",
                                               "transformers", "numpy", "vtc")},
        "load_avg_start": list(os.getloadavg()), "git": git,
    }


# ----------------------------------------------------------------------------- checks and timing


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[bool, float | None, str]:
    """(ok, worst error, why not): floats relative to the output's max magnitude, bools as mismatch fraction."""
    if len(ref) != len(got):
        return False, None, f"wrong result: {len(got)} outputs, eager has {len(ref)}"
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref, got)):
        if tuple(a.shape) != tuple(b.shape):
            return False, None, f"wrong result: output {i} has shape {list(b.shape)}, eager {list(a.shape)}"
        if a.numel() == 0:
            continue
        if a.is_floating_point():
            scale = max(float(a.abs().max()), 1e-6)
            err = float((a.double() - b.double()).abs().max()) / scale
            tol = LOW_PRECISION_RTOL.get(a.dtype, RTOL)
            if not err <= tol:  # also catches NaN
                return False, err, f"wrong result: output {i} max relative error {err:.2g} (tolerance {tol:g})"
        else:
            err = float((a != b.to(a.dtype)).double().mean())
            if err > (BOOL_MISMATCH if a.dtype == torch.bool else 0.0):
                return False, err, f"wrong result: {err:.2%} of output {i} differs from eager"
        worst = max(worst, err)
    return True, worst, ""


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    return dt


def time_interleaved(fns: dict[str, Callable[[], Any]], call_s: dict[str, float],
                     st: Settings, waited: dict[str, list[float]] | None = None
                     ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """(timed calls, errors) per system, interleaved in rounds (rotating order; one untimed call opens each block).

    `call_s` is a warm call's time per system: a system whose `runs` calls would take longer than
    `max_timing_s` gets fewer (at least `min_runs`; the JSON records how many).  `waited` (if given) gets, per
    system and block, the seconds per timed call this process's threads waited for a core (``run_delay_s``): load
    from other processes, which costs a 2-thread kernel whose threads meet at a barrier far more than its share
    (docs/gemm.md, session 18).
    """
    runs = {}
    for name in fns:
        est = max(call_s.get(name, 0.0), 1e-6)
        runs[name] = st.runs if est * st.runs <= st.max_timing_s else max(st.min_runs, int(st.max_timing_s / est))
    times: dict[str, list[float]] = {n: [] for n in fns}
    errors: dict[str, str] = {}
    order = list(fns)
    rnd = 0
    while any(len(times[n]) < runs[n] for n in order if n not in errors):
        for name in order[rnd % len(order):] + order[: rnd % len(order)]:
            left = runs[name] - len(times[name])
            if left <= 0 or name in errors:
                continue
            try:
                time.sleep(st.settle_s)
                fns[name]()
                w0, n = run_delay_s(), min(st.block, left)
                for _ in range(n):
                    times[name].append(_timed(fns[name]))
                if waited is not None:
                    waited.setdefault(name, []).append((run_delay_s() - w0) / n)
            except Exception as e:  # noqa: BLE001 - a system failing on a later call is a result
                errors[name] = f"failed on timed call {len(times[name]) + 1}: {one_line(e)}"
        rnd += 1
        gc.collect()
    return times, errors


# ----------------------------------------------------------------------------- one workload


def _prepare_one(name: str, ctx: Context, ref: list[torch.Tensor], st: Settings) -> dict:
    """Prepares one system and runs it once; returns its result entry (with `_fn` when it runs)."""
    res: dict[str, Any] = {"status": "ok", "reason": None}
    try:
        with time_limit(st.prepare_timeout):
            prep = PREPARE[name](ctx)
            t0 = time.perf_counter()
            out = prep.fn()
            first = time.perf_counter() - t0
        ok, err, why = compare(ref, flat_outputs(out))
        del out
        res.update(prepare_s=prep.prepare_s, first_call_s=first, compile_s=prep.prepare_s + first, max_err=err)
        info = dict(prep.info)
        if "report" in info:
            res["vtc"] = {"compile_cold_s": info.pop("compile_cold_s"), "compile_warm_s": info.pop("compile_warm_s", None),
                          "report": info.pop("report")}
        res["info"] = info
        if not ok:
            res.update(status="failed", reason=why)
            return res
        for _ in range(st.warmup):
            res["warm_call_s"] = _timed(prep.fn)
        res["_fn"] = prep.fn
    except SystemFailure as e:
        res.update(status=e.status, reason=e.reason)
    except BenchTimeout as e:
        res.update(status="failed", reason=f"timeout: preparing and first call {e}")
        _reset_dynamo()
    except Exception as e:  # noqa: BLE001 - any failure of a system is a result
        res.update(status="failed", reason=one_line(e))
    return res


def _reset_dynamo() -> None:
    with contextlib.suppress(Exception):
        import torch._dynamo

        torch._dynamo.reset()


def run_workload(w: W.Workload, systems: list[str], st: Settings, workdir: Path, log: Callable[[str], None]) -> dict:
    """Everything measured for one workload (times, checks, vtc reports, memory) as plain data."""
    t_start = time.perf_counter()
    entry: dict[str, Any] = {"name": w.name, "group": w.group, "desc": w.desc, "notes": w.notes,
                             "params": w.params, "load_avg": list(os.getloadavg()), "results": {}}
    try:
        model, inputs = w.build(st.quick)
        with torch.no_grad():
            ref = flat_outputs(model(*inputs))
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"could not build or run the workload in eager: {one_line(e)}"
        for s in systems:
            entry["results"][s] = {"status": "failed", "reason": entry["error"]}
        return entry
    entry["inputs"] = [{"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for t in inputs]
    entry["input_bytes"] = sum(t.numel() * t.element_size() for t in inputs)
    entry["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()) if isinstance(
        model, torch.nn.Module) else 0
    ctx = Context(w.name, model, inputs, st.threads, workdir, vtc_cache=workdir / f"vtc-cache-{w.name}")
    results: dict[str, dict] = {}
    for s in systems:
        if st.quick and s in QUICK_SKIP:
            results[s] = {"status": "skipped", "reason": "skipped in --quick"}
            continue
        results[s] = _prepare_one(s, ctx, ref, st)
    entry["export"] = {k: v for k, v in ctx.export.items() if k != "path"}
    fns = {s: r.pop("_fn") for s, r in results.items() if "_fn" in r}
    waited: dict[str, list[float]] = {}
    times, errors = time_interleaved(fns, {s: results[s].get("warm_call_s", results[s]["first_call_s"]) for s in fns},
                                     st, waited) if fns else ({}, {})
    for s, ts in times.items():
        if s in errors:
            results[s].update(status="failed", reason=errors[s], times_s=ts)
        else:
            results[s].update(times_s=ts, runs=len(ts), median_s=median(ts), min_s=min(ts), max_s=max(ts),
                              waited_s=waited.get(s, []), waited_median_s=median(waited[s]) if waited.get(s) else None)
    del fns
    gc.collect()
    if w.group in st.memory_groups:
        probe_all(w, [s for s in systems if results[s]["status"] == "ok" and
                      (st.memory_systems is None or s in st.memory_systems)], results, st, ctx.onnx_path, ctx.vtc_cache)
    entry["results"] = results
    entry["wall_s"] = time.perf_counter() - t_start
    return entry


# ----------------------------------------------------------------------------- memory probes


def _read_status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def probe_env(threads: int) -> dict:
    """The environment of a memory probe: the mmap threshold, threads, the repo on PYTHONPATH."""
    env = dict(os.environ)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", VTC_BUFFER_POOL="0", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]))
    return env


def probe_one(w: W.Workload, system: str, st: Settings, onnx_path: Path | None, vtc_cache: Path | None) -> dict:
    """Peak memory of one inference of `system` on `w`, measured in a fresh process."""
    cmd = [sys.executable, "-m", "bench.harness", "probe", w.name, system, "--threads", str(st.threads)]
    if st.quick:
        cmd.append("--quick")
    if onnx_path is not None and system in ("onnxruntime", "openvino"):
        cmd += ["--onnx", str(onnx_path)]
    env = probe_env(st.threads)
    if vtc_cache is not None and system.startswith("vtc-"):
        env["VTC_CACHE_DIR"] = str(vtc_cache)  # filled by this process's compile: the probe's compile is warm
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=st.probe_timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"memory probe took longer than {st.probe_timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(PROBE_TAG):
            out = json.loads(line[len(PROBE_TAG):])
            out["probe_wall_s"] = time.perf_counter() - t0
            return out
    tail = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()]
    return {"status": "failed", "reason": f"memory probe exited {p.returncode}: {tail[-1][:200] if tail else 'no output'}"}


def probe_all(w: W.Workload, systems: list[str], results: dict, st: Settings, onnx_path: Path | None,
              vtc_cache: Path | None = None) -> None:
    """Runs the memory probes of `systems` (`probe_jobs` at a time) into results[s]["memory"]."""
    with ThreadPoolExecutor(max_workers=st.probe_jobs) as pool:
        futs = {s: pool.submit(probe_one, w, s, st, onnx_path, vtc_cache) for s in systems}
        for s, f in futs.items():
            results[s]["memory"] = f.result()
            if "vtc" in results[s] and results[s]["memory"].get("prepare_s") is not None:
                results[s]["vtc"]["compile_fresh_process_s"] = results[s]["memory"]["prepare_s"]


def probe_main(args: argparse.Namespace) -> int:
    """Entry point of a memory probe process: prints one tagged JSON line."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    out: dict[str, Any] = {"status": "ok", "reason": None}
    try:
        w = W.get(args.workload)
        model, inputs = w.build(args.quick)
        workdir = Path(tempfile.mkdtemp(prefix="vtc-bench-probe-"))
        try:
            ctx = Context(w.name, model, inputs, args.threads, workdir, memory_probe=True,
                          onnx_path=Path(args.onnx) if args.onnx else None)
            prep = PREPARE[args.system](ctx)
            fn = prep.fn
            out["prepare_s"] = prep.prepare_s
            for _ in range(2):
                r = fn()
                del r
            gc.collect()
            rss = _read_status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
            hwm_reset = _read_status("VmHWM")
            r = fn()
            hwm = _read_status("VmHWM")
            del r
            out.update(rss_before_bytes=rss, hwm_after_reset_bytes=hwm_reset, vmhwm_bytes=hwm,
                       peak_delta_bytes=max(0, hwm - rss))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    except SystemFailure as e:
        out.update(status=e.status, reason=e.reason)
    except OSError as e:
        out.update(status="failed", reason=f"cannot read or reset the peak-RSS mark: {one_line(e)}")
    except Exception as e:  # noqa: BLE001
        out.update(status="failed", reason=one_line(e))
    print(PROBE_TAG + json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------------------- the suite


def _fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3g} ms"


def _write_json(data: dict, path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def default_out(quick: bool) -> Path:
    """bench/results (full runs) or bench/results/quick (quick runs)."""
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR


def run_suite(workloads: str | None = None, systems: str | None = None, quick: bool = False, out: str | Path | None = None,
              markdown: str | Path | None = None, chart: str | Path | None = None, command: str | None = None,
              log: Callable[[str], None] = print, **settings) -> dict:
    """Runs the suite, writes the JSON and the report; returns {"json": path, "markdown": path, "data": dict}.

    Without `out`, a full run writes bench/results/<host>-<date>.json, BENCHMARKS.md at the repo root and
    bench/results/speedup.png; a quick run or an explicit `out` keeps all three inside that directory.
    """
    st = Settings(quick=quick, **settings)
    selected = W.select(workloads, quick)
    names = parse_systems(systems, quick)
    default = out is None
    out_dir = Path(out) if out is not None else default_out(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    if markdown is None:
        markdown = REPO_ROOT / "BENCHMARKS.md" if default and not quick else out_dir / "BENCHMARKS.md"
    if chart is None:
        chart = out_dir / "speedup.png"
    now = _dt.datetime.now().astimezone()
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    json_path = out_dir / f"{host}-{now:%Y-%m-%d-%H%M%S}{'-quick' if quick else ''}.json"
    data: dict[str, Any] = {
        "schema": SCHEMA, "created": now.isoformat(timespec="seconds"),
        "command": command or "python -m bench.harness " + " ".join(sys.argv[1:]),
        "machine": machine_info(st.threads), "settings": st.to_dict(), "systems": names,
        "others": [s for s in OTHERS if s in names], "vtc_variants": [s for s in VTC_VARIANTS if s in names],
        "vtc_headline_order": list(VTC_HEADLINE_ORDER),
        "default_workloads": [w.name for w in W.select(None, quick)], "workloads": [],
    }
    prev_threads, prev_cache = torch.get_num_threads(), os.environ.get("VTC_CACHE_DIR")
    prev_machine = os.environ.get("VTC_MACHINE_FILE")
    torch.set_num_threads(st.threads)
    if data["vtc_variants"]:  # one set of machine figures for every workload's plans (and the probes)
        from dataclasses import asdict

        from vtc.plan.cost import machine, machine_file

        os.environ["VTC_MACHINE_FILE"] = str(machine_file())  # the user's, before each workload's cache dir
        data["vtc_machine"] = asdict(machine())
    workdir = Path(tempfile.mkdtemp(prefix="vtc-bench-"))
    t0 = time.perf_counter()
    log(f"vtc bench: {len(selected)} workloads x {len(names)} systems, {st.threads} threads, {st.runs} runs"
        f"{', memory probes for ' + ','.join(st.memory_groups) if st.memory_groups else ''}; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            for i, w in enumerate(selected, 1):
                try:
                    entry = run_workload(w, names, st, workdir, log)
                except Exception as e:  # noqa: BLE001 - a harness bug on one workload must not lose the others
                    why = f"harness error: {one_line(e)}"
                    entry = {"name": w.name, "group": w.group, "desc": w.desc, "notes": w.notes, "params": w.params,
                             "error": why, "results": {s: {"status": "failed", "reason": why} for s in names}}
                data["workloads"].append(entry)
                data["wall_s"] = time.perf_counter() - t0
                _write_json(data, json_path)
                log(_progress_line(i, len(selected), entry))
    finally:
        torch.set_num_threads(prev_threads)
        for key, prev in (("VTC_CACHE_DIR", prev_cache), ("VTC_MACHINE_FILE", prev_machine)):
            if prev is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = prev
        shutil.rmtree(workdir, ignore_errors=True)
    data["wall_s"] = time.perf_counter() - t0
    data["load_avg_end"] = list(os.getloadavg())
    _write_json(data, json_path)
    from bench import report

    md = report.write(data, Path(markdown), Path(chart), json_path=json_path)
    log(f"wrote {json_path}\nwrote {md}" + (f"\nwrote {chart}" if Path(chart).exists() else ""))
    return {"json": json_path, "markdown": md, "chart": Path(chart), "data": data}


def _progress_line(i: int, n: int, entry: dict) -> str:
    parts = []
    for s, r in entry["results"].items():
        if r["status"] == "ok":
            w = r.get("waited_median_s")
            parts.append(f"{s} {_fmt_ms(r.get('median_s'))}" + (f" (waited {_fmt_ms(w)})" if w and w > 1e-5 else ""))
        else:
            parts.append(f"{s} {r['status']}")
    return f"[{i}/{n}] {entry['name']} ({entry.get('wall_s', 0):.0f} s): " + ", ".join(parts)


# ----------------------------------------------------------------------------- command line


def list_all(quick: bool = False) -> str:
    """The workloads (with group and description) and the systems, as text."""
    lines = ["workloads (q = in --quick, d = in a plain run, others with --workloads all or by name):"]
    for w in W.all_workloads().values():
        mark = ("q" if w.in_quick else " ") + ("d" if w.default and w.group != "smoke" else " ")
        lines.append(f"  {mark} {w.name:32s} {w.group:9s} {w.desc}")
    lines.append("systems: " + ", ".join(SYSTEMS))
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace, command: str | None = None) -> dict | None:
    """Runs the suite for parsed `vtc bench` arguments (None after --list)."""
    if args.list:
        print(list_all())
        return None
    kwargs = {k: getattr(args, k) for k in ("runs", "threads", "memory") if getattr(args, k) is not None}
    if getattr(args, "memory_groups", None):
        groups = tuple(g.strip() for g in args.memory_groups.split(",") if g.strip())
        bad = [g for g in groups if g not in W.GROUPS]
        if bad:
            raise ValueError(f"unknown group(s) {bad} in --memory-groups; valid: {', '.join(W.GROUPS)}")
        kwargs.update(memory=True, memory_groups=groups)
    if getattr(args, "memory_systems", None):
        kwargs["memory_systems"] = tuple(parse_systems(args.memory_systems, False))
    return run_suite(args.workloads, args.systems, args.quick, args.out, args.markdown, command=command, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.harness [options]`` or ``python -m bench.harness probe WORKLOAD SYSTEM``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["probe"]:
        p = argparse.ArgumentParser(prog="bench.harness probe")
        p.add_argument("workload")
        p.add_argument("system", choices=SYSTEMS)
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
        p.add_argument("--quick", action="store_true")
        p.add_argument("--onnx")
        return probe_main(p.parse_args(argv[1:]))
    from vtc.commands.bench import add_run_arguments

    p = argparse.ArgumentParser(prog="python -m bench.harness", description="vtc's benchmark suite")
    add_run_arguments(p)
    run_from_args(p.parse_args(argv), command="python -m bench.harness " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
