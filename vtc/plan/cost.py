"""What removing a movement op saves: the planner's cost model.

Three layers, from facts to policy:

- ``Machine``: figures of this machine (copy bandwidth and GEMM rate, each the
  fastest of several timed torch copies / torch.mm, and at least the 1-thread
  CPU-time figure; how torch's GEMM compares with vtc's generated one, float32
  and bf16, which ``library_gemm_speed`` hands to ``vtc.codegen.gemm.choose``;
  cache line, vector width from torch's CPU capability, threads), cached in the
  vtc cache directory or ``$VTC_MACHINE_FILE``; figures measured while other
  processes kept the cores busy are provisional there and measured again by a
  few later processes;
  ``VTC_NO_MEASURE=1`` gives the fixed ``FALLBACK`` instead (tests set it).
- ``access(mapping)``: how a reader walks a tensor through a mapping (the
  contiguity class, the contiguous chunk, cache lines touched per element, the
  index arithmetic per element), found by evaluating the mapping on a sample of
  consecutive output positions, and the lines a block of rows touches (a
  transposed read brings each line from memory once when they fit in cache).
- ``CostModel``: prices (seconds) for reading through an access, writing,
  copying, and whether a library takes a strided view.  This is the policy:
  one swappable class with no correctness duties.

``Estimator`` ties them to a graph: ``compute()`` prices the compute nodes
(GEMM/conv flops at the GEMM rate, anything else its bytes), the part of the
latency no plan changes; given a strategy (the set of movement ops
made virtual), it lists the latency *terms* the movement-related work costs —
a kept op's copy, a kernel's reads of a (virtual) tensor, the realisation of a
virtual tensor that a library node or the graph output needs (a zero-copy view
or a copy), a library's own copy of a view it cannot take — following what the
lowering (``vtc.codegen.lower``) and the executor do.  ``saving(choice,
state)`` is latency without the choice minus latency with it, over the terms
the choice can change; it comes as a ``Saving(seconds, reason)``.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from vtc.index.expr import walk
from vtc.index.mapping import Mapping, Piece, Strided, compose, contiguous_strides, out_vars
from vtc.ir.graph import Node, Value
from vtc.plan.virtualize import is_dense, needs_dense
from vtc.plan.vtog import PUSH, VTOG, Choice, category

# ---------------------------------------------------------------------------
# the machine


@dataclass(frozen=True)
class Machine:
    """Figures of one machine that the prices use."""

    bandwidth_gbs: float  # sustained copy bandwidth: (bytes read + bytes written) per second / 1e9
    cache_line: int = 64  # bytes
    vector_bytes: int = 32  # SIMD register width in bytes
    cache_bytes: int = 1 << 20  # a working set that stays in cache (strided re-reads hit it)
    threads: int = 1
    measured: bool = False
    gemm_gflops: float = 20.0  # float32 GEMM rate of torch.mm on a mid-sized square problem
    library_gemm_ratio: float = 0.0  # torch.mm's float32 rate / vtc's generated GEMM's, 1 thread (0: not measured)
    library_bf16_ratio: float = 0.0  # the same in bf16 (vtc.codegen.gemm_bf16; 0: not measured, no AVX512_BF16)
    library_few_rows_ratio: float = 0.0  # the float32 ratio on a Linear of FEW_ROWS_SHAPE (0: not measured)


FALLBACK = Machine(bandwidth_gbs=10.0, cache_line=64, vector_bytes=32, cache_bytes=1 << 20, threads=1, measured=False,
                   gemm_gflops=20.0)
MACHINE_VERSION = 7  # bump when Machine gains a figure or the file changes form: older cached files are measured again
_VECTOR_BYTES = {"AVX512": 64, "AVX512_BF16": 64, "AMX": 64, "AVX2": 32, "SVE256": 32, "ZVECTOR": 16,
                 "VSX": 16, "NEON": 16, "DEFAULT": 16, "NO AVX": 16}
MEASURE_BYTES = 64 << 20
MEASURE_RUNS = 7  # timed calls per figure
# The 2-thread figures (bandwidth_gbs, gemm_gflops) are wall clock: each is the fastest of MEASURE_RUNS calls, and a
# figure whose fastest call waited for a core (other processes on the machine) longer than BUSY_WAITED of its wall
# time is provisional: a later process, at most REMEASURES times, measures the two again and keeps a quiet
# measurement, else the faster one; the k-th time at least REMEASURE_AFTER_S * 2 ** (k - 1) after the last
# measurement, so the few measurements span a busy spell of 15 minutes (docs/call_cost.md, session 21).
BUSY_WAITED = 0.1
REMEASURE_AFTER_S = 60.0
REMEASURES = 4
TIMED_FIGURES = ("bandwidth_gbs", "gemm_gflops")  # the figures measured again while provisional
# Measurements of one 2-thread figure on this machine while it was quiet (no call waited for a core) spread by a
# factor up to 1.27 (docs/call_cost.md, session 21: bandwidth 41.9-53.0 GB/s, GEMM 155-193 GFLOP/s): figures closer
# than TIMED_SPREAD are one figure measured twice, and a plan made from the one stands for the other (vtc.plan.cache)
TIMED_SPREAD = 1.3


def same_timed_figures(a: dict, b: dict, names: tuple[str, ...] = TIMED_FIGURES) -> bool:
    """Whether the 2-thread figures `names` (of ``TIMED_FIGURES``) of two sets of Machine figures are within
    TIMED_SPREAD of each other."""
    return all(max(a[f], b[f]) <= TIMED_SPREAD * min(a[f], b[f]) for f in names)


_measuring = False  # machine() is measuring (it compiles a GEMM, whose planning asks for machine())


def machine() -> Machine:
    """This machine's figures: measured once and cached on disk, or FALLBACK when VTC_NO_MEASURE=1 (and for
    the compile that measures the generated GEMM, which must not measure again nor be cached as the figures)."""
    return FALLBACK if _measuring else _machine()


@lru_cache(maxsize=1)
def _machine() -> Machine:
    """machine(), read from the machine file once per process; measured where the file has no figures for this
    machine, or measured again in part where its figures are provisional and a new measurement is due."""
    if os.environ.get("VTC_NO_MEASURE", "") not in ("", "0"):
        return FALLBACK
    cap = torch.backends.cpu.get_cpu_capability()
    key = {"capability": cap, "threads": torch.get_num_threads(), "host": os.uname().nodename,
           "version": MACHINE_VERSION}
    path = None
    record = None
    try:
        path = machine_file()
        data = json.loads(path.read_text())
        if data.get("key") == key:
            record = {"key": key, "machine": asdict(Machine(**data["machine"])),
                      "waited": {f: float(data["waited"][f]) for f in TIMED_FIGURES},
                      "measurements": int(data["measurements"]), "measured_at": float(data["measured_at"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if record is None:
        record = _measure(key, cap)
    elif _remeasure_due(record):
        record = _measure_timed_again(record)
    else:
        return Machine(**record["machine"])
    if path is not None:
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError:
            pass
    return Machine(**record["machine"])


machine.cache_clear = _machine.cache_clear


def provisional(record: dict) -> bool:
    """Whether a machine file's figures were measured while other processes kept its threads waiting."""
    return max(record["waited"].values()) > BUSY_WAITED


def _remeasure_due(record: dict) -> bool:
    """Whether this process measures a machine file's provisional figures again (bounded in number and spaced in
    time, so that a machine that stays busy is not measured on every compile)."""
    return (provisional(record) and record["measurements"] <= REMEASURES
            and time.time() - record["measured_at"] >= REMEASURE_AFTER_S * 2 ** (record["measurements"] - 1))


def _measure(key: dict, cap: str) -> dict:
    """The machine file's record of every figure measured now."""
    (bandwidth, bandwidth_waited), (gemm, gemm_waited) = _measure_bandwidth(), _measure_gemm()
    m = Machine(bandwidth_gbs=bandwidth, vector_bytes=_VECTOR_BYTES.get(cap, 16), threads=torch.get_num_threads(),
                measured=True, gemm_gflops=gemm, **_measure_ratios())
    return {"key": key, "machine": asdict(m), "waited": {"bandwidth_gbs": bandwidth_waited, "gemm_gflops": gemm_waited},
            "measurements": 1, "measured_at": time.time()}


def _measure_ratios() -> dict:
    """The Machine figures that compare torch's GEMM with the generated one: each compiles a GEMM (whose planning
    asks for machine(): FALLBACK meanwhile), their kernels built in one parallel build, then each is timed."""
    from vtc.runtime.cbuild import KernelBuildError
    from vtc.runtime.executor import kernels_built_together

    global _measuring
    _measuring = True
    try:
        with _one_thread(), torch.no_grad():
            try:
                with kernels_built_together():
                    timers = _ratio_timers()
            except KernelBuildError:  # one does not build: each compiled and built alone, its ratio 0.0
                timers = _ratio_timers()
            return {name: timer() for name, timer in timers.items()}
    finally:
        _measuring = False


def _ratio_timers() -> dict:
    """The GEMM ratios' timers (each compiled now, timed when called)."""
    return {"library_gemm_ratio": _library_ratio_timer(),
            "library_bf16_ratio": _library_ratio_timer(dtype=torch.bfloat16),
            "library_few_rows_ratio": _few_rows_ratio_timer()}


def _measure_timed_again(record: dict) -> dict:
    """`record` with its 2-thread figures measured again: each takes the new measurement where only it is quiet,
    the old where only that is, else the faster of the two.  Where both new ones are quiet, the GEMM ratios are
    measured again too: they were measured with the provisional figures, on a machine whose other processes can
    move even a 1-thread CPU-time ratio (the few-rows ratio read 0.49 under a test run, 0.57-0.72 quiet)."""
    figures, waited = dict(record["machine"]), dict(record["waited"])
    new = dict(zip(TIMED_FIGURES, (_measure_bandwidth(), _measure_gemm())))
    for name, (value, share) in new.items():
        old = (figures[name], waited[name])
        quiet_old, quiet_new = old[1] <= BUSY_WAITED, share <= BUSY_WAITED
        figures[name], waited[name] = max(old, (value, share)) if quiet_old == quiet_new else \
            old if quiet_old else (value, share)
    if all(share <= BUSY_WAITED for _, share in new.values()):
        figures.update(_measure_ratios())
    return {**record, "machine": figures, "waited": waited, "measurements": record["measurements"] + 1,
            "measured_at": time.time()}


def machine_file() -> Path:
    """Where the measured figures are kept: $VTC_MACHINE_FILE, else machine.json in the kernel cache dir.

    Several cache dirs on one machine (the benchmark gives each workload its own) can share one file,
    so every plan of a run is made with the same figures."""
    if os.environ.get("VTC_MACHINE_FILE"):
        return Path(os.environ["VTC_MACHINE_FILE"])
    from vtc.runtime.cbuild import cache_dir

    return cache_dir() / "machine.json"


def waited_s() -> float:
    """Seconds the threads of this process have spent runnable but waiting for a core (the second field of each
    /proc/self/task/*/schedstat; 0 where the kernel does not report it)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def _steady(fn, runs: int = MEASURE_RUNS) -> tuple[float, float]:
    """(seconds, waited share) of the fastest of `runs` wall-clock calls of fn after one warm-up call: the
    undisturbed time where other processes leave the cores alone for one call, with the seconds this process's
    threads waited for a core during that call over its seconds (0: none of them waited)."""
    fn()
    calls = []
    for _ in range(runs):
        w0 = waited_s()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        calls.append((t1 - t0, (waited_s() - w0) / max(t1 - t0, 1e-9)))
    return min(calls)


@contextlib.contextmanager
def _one_thread():
    """torch (and vtc's kernels, which take its thread count) on 1 thread inside the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _one_thread_s(fn, runs: int = MEASURE_RUNS) -> float:
    """CPU seconds of the fastest of `runs` calls of fn on 1 thread after one warm-up call: the calling thread's
    CPU time, which other processes on the machine hardly move (no time waiting for a core in it)."""
    with _one_thread():
        fn()
        times = []
        for _ in range(runs):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
    return min(times)


# A 2-thread figure is at least its 1-thread one (CPU time): on a busy machine the 1-thread figure stays within ~3x
# of the quiet 2-thread one where the wall-clock one falls 15-150x (docs/call_cost.md, session 21)
def _measure_bandwidth() -> tuple[float, float]:
    """((read + written) GB/s, waited share) of a copy of MEASURE_BYTES with torch: the fastest call (``_steady``),
    or the fastest 1-thread call (``_one_thread_s``) where that is faster."""
    n = MEASURE_BYTES // 4
    src, dst = torch.ones(n), torch.empty(n)
    seconds, waited = _steady(lambda: dst.copy_(src))
    return 2 * n * 4 / min(seconds, _one_thread_s(lambda: dst.copy_(src))) / 1e9, waited


def _measure_gemm(n: int = 384) -> tuple[float, float]:
    """(GFLOP/s, waited share) of a float32 torch.mm of n x n by n x n: the fastest call (``_steady``), or the
    fastest 1-thread call (``_one_thread_s``) where that is faster."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds, waited = _steady(lambda: torch.mm(a, b))
    return 2 * n ** 3 / min(seconds, _one_thread_s(lambda: torch.mm(a, b))) / 1e9, waited


def _library_ratio_timer(n: int = 384, dtype: torch.dtype = torch.float32) -> Callable[[], float]:
    """The timer of torch.mm's rate over vtc's generated GEMM's (gemm="vtc") on an n^3 product in `dtype`
    (float32, or bfloat16: vtc.codegen.gemm_bf16), ``_cpu_time_ratio``'s; 0.0 where the kernel cannot be built
    (no AVX512_BF16 for bf16: vtc then runs torch's GEMMs anyway).
    torch's float32 GEMM (MKL) runs as fast as the generated one on the Intel CPUs the rates of
    vtc.codegen.gemm were measured on, and at half its speed on an AMD EPYC (Zen 5: 1024^3 at 1 thread 20.2 vs
    9.75 ms, ONNX Runtime 9.5 ms); torch's bf16 GEMM runs on AMX tiles where the CPU has them (~11x the
    generated vdpbf16ps kernel on a Sapphire Rapids-class Xeon) and as fast as it where not (Zen 5: 1024^3
    4.52 vs 4.64 ms), so gemm="auto" asks how the two compare here."""
    from vtc.codegen import gemm_bf16

    if dtype == torch.bfloat16 and gemm_bf16.support():
        return lambda: 0.0
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return _cpu_time_ratio(lambda x, y: x @ y, (a, b), lambda: torch.mm(a, b))


# the Linear (rows, in, out) of the few-rows ratio: MKL's packed GEMM against the generated panels on W packed
# once, both on whole 12 x 32 tiles (so the ratio compares the rates vtc.codegen.gemm assumes); a Zen 4 EPYC
# measured MKL at 0.52-0.65x there (32-96 rows x 768 -> 3072, 1 thread CPU time) and 0.85x at 384^3
FEW_ROWS_SHAPE = (48, 768, 3072)
FEW_ROWS_MAX = 127  # rows up to which a GEMM over more than vtc.codegen.gemm.SKINNY_M rows takes the few-rows ratio


def _few_rows_ratio_timer() -> Callable[[], float]:
    """The timer of torch's float32 Linear of FEW_ROWS_SHAPE on its weight packed once (as the call plan runs it:
    vtc.runtime.packed; torch's plain mm where MKL's packed GEMM is not available) over the generated kernel's
    rate, ``_cpu_time_ratio``'s."""
    rows, k, n = FEW_ROWS_SHAPE
    linear = torch.nn.Linear(k, n)
    return _cpu_time_ratio(linear, (torch.randn(rows, k),), None)


def _cpu_time_ratio(fn, inputs: tuple, library) -> Callable[[], float]:
    """fn compiled now with gemm="vtc" (and with gemm="torch" where `library` is None); returns the timer of the
    ratio: seconds of the generated over seconds of `library()` (else of fn compiled with gemm="torch"), on the
    1 thread of ``_measure_ratios``, the calling thread's CPU time (a ratio that other jobs on the machine do not
    move), calls alternating, median of 2 * MEASURE_RUNS each; 0.0 where the generated kernel cannot be built."""
    import vtc
    from vtc.runtime.cbuild import KernelBuildError

    try:
        generated = vtc.compile(fn, inputs, plan="all", gemm="vtc")
        if library is None:
            compiled = vtc.compile(fn, inputs, plan="all", gemm="torch")
            library = lambda: compiled(*inputs)  # noqa: E731
    except KernelBuildError:
        return lambda: 0.0

    def ratio() -> float:
        fns = (library, lambda: generated(*inputs))
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(2 * MEASURE_RUNS + 1):
            for f, ts in zip(fns, times):
                t0 = time.thread_time()
                f()
                if i:  # the first round warms up
                    ts.append(time.thread_time() - t0)
        return statistics.median(times[1]) / statistics.median(times[0])
    return ratio


# relative band around the assumed library / generated GEMM ratio counted as equal: a Zen 4 EPYC measured 0.90-0.93
# (factor 0.87-0.90), inside the 0.2 band of before, so Linear layers of 32 rows and more ran MKL's packed GEMM,
# 20% slower there than the generated one at 2 threads (llama3 prefill 43.2 -> 34.6 ms; docs/gemm.md, session 19)
LIBRARY_SPEED_NOISE = 0.05


def library_gemm_speed(m: Machine | None = None, dtype: torch.dtype = torch.float32, rows: int | None = None,
                       packed: bool = False) -> float:
    """How fast torch's GEMM in `dtype` is here relative to the rates its generated twin's cost model assumes
    for it (vtc.codegen.gemm for float32: 1.0 is about as fast as the generated GEMM, 0.5 half as fast;
    vtc.codegen.gemm_bf16 for bfloat16: 1.0 is AMX, ~8x the generated kernel, 0.125 as fast as it).
    A float32 GEMM of `rows` rows, more than vtc.codegen.gemm.SKINNY_M and at most FEW_ROWS_MAX, or of any
    rows where torch runs it on its weight packed once (`packed`: vtc.runtime.packed, the path that ratio is
    measured on), takes the ratio measured on a Linear of few rows (``library_few_rows_ratio``) where there is
    one; any other the square one (torch.mm on runtime operands).  Measured ratios within LIBRARY_SPEED_NOISE
    of the assumed one count as 1.0, so a noisy measurement does not flip the choices the fixed rates were
    tuned for; 1.0 where nothing was measured (VTC_NO_MEASURE=1, no compiler, no AVX512_BF16)."""
    from vtc.codegen import gemm, gemm_bf16

    m = m or machine()
    ratio, rates = ((m.library_bf16_ratio, gemm_bf16) if dtype == torch.bfloat16 else (m.library_gemm_ratio, gemm))
    if (dtype != torch.bfloat16 and rows is not None and gemm.SKINNY_M < rows and (packed or rows <= FEW_ROWS_MAX)
            and m.library_few_rows_ratio > 0):
        ratio = m.library_few_rows_ratio
    if not m.measured or ratio <= 0:
        return 1.0
    speed = ratio / (rates.TORCH_GFLOPS / rates.VTC_GFLOPS)
    return 1.0 if abs(speed - 1.0) <= LIBRARY_SPEED_NOISE else speed


# ---------------------------------------------------------------------------
# how a mapping is walked

CONTIGUOUS, VIEW, BROADCAST, CHUNKED, SCATTERED, INDIRECT = (
    "contiguous", "view", "broadcast", "chunked", "scattered", "indirect")
TYPE_I = (CONTIGUOUS, VIEW, BROADCAST)
INDEX_OPS = ("floordiv", "mod", "select", "load", "min", "max")
PROBE = 512  # consecutive output positions sampled per probe


@dataclass(frozen=True)
class Access:
    """How a reader walks a tensor through a mapping, in the tensor's row-major order.

    kind: "contiguous" (a dense strided view), "view" (another strided view),
    "broadcast" (a strided view that repeats elements), "chunked" (contiguous
    runs of at least a cache line), "scattered" (shorter runs), "indirect"
    (index loads from a tensor).
    """

    kind: str
    chunk_bytes: float  # mean bytes read contiguously
    stride: int  # most common step (in source elements) between neighbouring output elements
    lines_per_element: float  # distinct cache lines touched per element read
    index_ops: int  # div/mod/select/min/max/load nodes per element, plus one per extra piece
    source_bytes: int  # bytes of the sources the mapping reads
    strided: Strided | None = None
    window_lines: float = float("inf")  # cache lines per element over a block of inner rows (see _window)
    window_bytes: float = float("inf")  # bytes of the distinct lines that block touches (reuse if it fits cache)
    sourced_pieces: int = 1  # pieces that read a source (a cat of two: 2): more than one is a choice per element
    run_ops: int = 0  # of index_ops, those a generated kernel computes once per run of the innermost dim (op_counts)
    run: int = 1  # elements of that run

    @property
    def type_i(self) -> bool:
        return self.kind in TYPE_I

    @property
    def loop_ops(self) -> float:
        """Index ops per element of a generated kernel's loop: ``run_ops`` shared by the run."""
        return self.index_ops - self.run_ops + self.run_ops / self.run

    def describe(self) -> str:
        """A short phrase for logs: "Type I (strided view, stride 1)", "contiguous chunks of 32 B", ..."""
        if self.kind == CONTIGUOUS:
            return "Type I (contiguous)"
        if self.kind in (VIEW, BROADCAST):
            return f"Type I (strided view, inner stride {self.stride})"
        if self.kind == INDIRECT:
            return f"indirect (index loads, {self.loop_ops:.3g} index ops per element)"
        what = "chunked" if self.kind == CHUNKED else "scattered"
        return (f"{what}: contiguous runs of {self.chunk_bytes:.0f} B, {self.lines_per_element:.2f} cache lines "
                f"and {self.loop_ops:.3g} index ops per element")


def index_ops(m: Mapping) -> int:
    """div/mod/select/min/max/load nodes per element, in each piece's linear source offset (as the code
    generator emits it) and predicate, plus one select per extra piece."""
    return sum(op_counts(m))


def op_counts(m: Mapping) -> tuple[int, int]:
    """``index_ops`` of m split in two: (those that depend on the innermost index, those that do not).

    The innermost index is that of the last dim of more than one element, over which the generated kernels'
    inner loop runs; the C compiler computes an op that does not depend on it once per run of that dim (GCC
    -O3: loop-invariant motion, and a piece test that picks the source by an outer index, as a channel
    shuffle's cat does, unswitches the inner loop: ``-fopt-info-loop`` on its gather says "Unswitching loop
    on condition")."""
    from vtc.index.expr import free_vars, lift

    k = _inner_dim(m)
    inner = None if k is None else f"i{k}"
    seen: set[int] = set()
    inside = outside = 0
    for p in m.pieces:
        exprs = [p.when]
        if p.source is not None:
            lin = lift(0)
            for i, s in zip(p.index, contiguous_strides(m.sources[p.source])):
                lin = lin + i * s
            exprs.append(lin)
        for e in exprs:
            for x in walk(e):
                if id(x) not in seen and x.op in INDEX_OPS:
                    if inner in free_vars(x):
                        inside += 1
                    else:
                        outside += 1
                seen.add(id(x))
    if any(inner in free_vars(p.when) for p in m.pieces):
        inside += len(m.pieces) - 1
    else:
        outside += len(m.pieces) - 1
    return inside, outside


def _inner_dim(m: Mapping) -> int | None:
    """m's innermost dim of more than one element (the generated kernels' inner loop), None where it has none."""
    return next((k for k in reversed(range(len(m.shape))) if m.shape[k] > 1), None)


def _run(m: Mapping) -> int:
    """Elements of m's innermost dim of more than one element (1 where it has none)."""
    k = _inner_dim(m)
    return 1 if k is None else m.shape[k]


def access(m: Mapping, itemsize: int, line: int = 64) -> Access:
    """How reading the tensor `m` describes, in row-major order, touches its sources."""
    src_bytes = sum(_numel(s) for s in m.sources.values()) * itemsize
    inside, outside = op_counts(m)
    ops, hoisted = inside + outside, dict(run_ops=outside, run=_run(m))
    if any(x.op == "load" for p in m.pieces for e in (*p.index, p.when) for x in walk(e)):  # reads index tensors
        chunk, stride, lines = _probe(m, itemsize, line)  # with random indices in each load's range
        return Access(INDIRECT, chunk, stride, lines, ops, src_bytes, None, *_window(m, itemsize, line), **hoisted)
    st = m.strided()
    if st is not None:
        chunk, stride, lines = _strided_walk(st, m.shape, itemsize, line)
        dense = [s for s, n in zip(st.strides, m.shape) if n > 1]
        want = [s for s, n in zip(contiguous_strides(m.shape), m.shape) if n > 1]
        kind = CONTIGUOUS if dense == want else BROADCAST if stride == 0 else VIEW
        window = _window(m, itemsize, line) if kind == VIEW and lines * line > itemsize else (float("inf"),) * 2
        return Access(kind, chunk, stride, lines, ops, src_bytes, st, *window, **hoisted)
    chunk, stride, lines = _probe(m, itemsize, line)
    return Access(CHUNKED if chunk >= line else SCATTERED, chunk, stride, lines, ops, src_bytes, None,
                  *_window(m, itemsize, line), sum(p.source is not None for p in m.pieces), **hoisted)


def structure(m: Mapping) -> tuple | None:
    """m with its tensors named by position (sources, then index tensors): mappings with equal structures
    read their sources in the same pattern, so ``access`` of one is ``access`` of the other up to the
    source named in ``strided``.  None when a tensor's name could be mistaken for an index variable."""
    names = [*m.sources, *m.index_tensors]
    if any(re.fullmatch(r"i\d+", n) for n in names):
        return None
    text = "\n".join(str(p) for p in m.pieces)
    for k, n in enumerate(names):
        text = re.sub(rf"\b{re.escape(n)}\b", f"${k}", text)
    return (text, m.shape, tuple(m.sources.values()), tuple(m.index_tensors.values()))


def _strided_walk(st: Strided, shape: tuple[int, ...], itemsize: int, line: int) -> tuple[float, int, float]:
    """(contiguous run in bytes, inner stride, cache lines per element) of a strided view, from its strides."""
    dims = [(n, s) for n, s in zip(shape, st.strides) if n > 1]
    if not dims:
        return float(itemsize), 1, itemsize / line
    run, want = 1, 1
    for n, s in reversed(dims):
        if s == 0:
            continue  # a repeated element: read from cache
        if s != want:
            break
        run, want = run * n, want * n
    inner = dims[-1][1]
    if inner == 0:
        lines = 1 / (dims[-1][0] * max(1, line // itemsize))
    elif inner == 1:  # runs of `run` elements, each run on at least one line of its own
        lines = max(itemsize / line, 1 / run) if run * itemsize < line else itemsize / line
    else:
        lines = min(1.0, abs(inner) * itemsize / line)
    return float(run * itemsize), inner, lines


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _offsets(m: Mapping, lin: torch.Tensor, tensors: dict[str, torch.Tensor], base: dict[str, int]) -> torch.Tensor:
    """Linear source offsets (plus base[source]) read at row-major output positions `lin`; -1 where none."""
    from vtc.index.expr import evaluate

    env, rest = {}, lin
    for d in reversed(range(len(m.shape))):
        env[f"i{d}"] = rest % max(m.shape[d], 1)
        rest = rest // max(m.shape[d], 1)
    off = torch.full(lin.shape, -1, dtype=torch.int64)
    todo = torch.ones(lin.shape, dtype=torch.bool)
    for p in m.pieces:
        when = evaluate(p.when, env, tensors).bool().expand(lin.shape) & todo
        todo &= ~when
        if p.source is None:
            continue
        o = torch.full(lin.shape, base[p.source], dtype=torch.int64)
        for i, s in zip(p.index, contiguous_strides(m.sources[p.source])):
            o = o + evaluate(i, env, tensors).expand(lin.shape) * s
        off = torch.where(when, o, off)
    return off


def _probe(m: Mapping, itemsize: int, line: int) -> tuple[float, int, float]:
    """(mean contiguous run in bytes, most common step, cache lines per element) over sampled positions."""
    numel = _numel(m.shape)
    if numel <= 1:
        return float(itemsize), 1, itemsize / line
    k = min(numel, PROBE)
    tensors = _random_indices(m)
    starts = sorted({0, (numel // 2) // k * k if numel > 2 * k else 0})
    runs, n_read, lines, steps = [], 0, 0, []
    base = {s: j << 40 for j, s in enumerate(m.sources)}  # different sources are never contiguous
    for start in starts:
        off = _offsets(m, torch.arange(start, min(start + k, numel)), tensors, base)
        off = off[off >= 0]
        if off.numel() == 0:
            continue
        n_read += off.numel()
        lines += torch.unique(off * itemsize // line).numel()
        if off.numel() > 1:
            d = off[1:] - off[:-1]
            steps.append(d)
            brk = ((d != 0) & (d != 1)).nonzero().flatten()
            edges = torch.cat([torch.tensor([-1]), brk, torch.tensor([off.numel() - 1])])
            runs.extend((edges[1:] - edges[:-1]).tolist())
        else:
            runs.append(1)
    if n_read == 0:
        return float(itemsize), 1, 0.0
    stride = int(torch.cat(steps).mode().values) if steps else 1
    return sum(runs) / len(runs) * itemsize, stride, lines / n_read


WINDOW = 1 << 13  # output positions of the reuse window (at least 16 rows of the innermost dim, up to 4x this)


def _window(m: Mapping, itemsize: int, line: int) -> tuple[float, float]:
    """(cache lines per element, bytes of distinct lines) over the first output positions (see WINDOW).

    A reader walking a transposed or head-repeated tensor touches one line per
    element in a row, but the next rows read the rest of those lines: when the
    lines a block of rows touches fit in cache, each is brought from memory once.
    Infinite when the window does not span two rows of the innermost dim.
    """
    inner = _run(m)
    size = min(_numel(m.shape), max(WINDOW, min(16 * inner, 4 * WINDOW)))
    if size < 2 * inner:
        return float("inf"), float("inf")
    base = {s: j << 40 for j, s in enumerate(m.sources)}
    off = _offsets(m, torch.arange(size), _random_indices(m), base)
    off = off[off >= 0]
    if off.numel() == 0:
        return 0.0, 0.0
    lines = torch.unique(off * itemsize // line).numel()
    return lines / off.numel(), float(lines * line)


def _random_indices(m: Mapping) -> dict[str, torch.Tensor]:
    """A stand-in for each index tensor a mapping loads: random values in the range its loads declare."""
    rng: dict[str, tuple[int, int]] = {}
    for p in m.pieces:
        for e in (*p.index, p.when):
            for x in walk(e):
                if x.op == "load":
                    lo, hi = rng.get(x.args[0], (x.args[2], x.args[3]))
                    rng[x.args[0]] = (min(lo, x.args[2]), max(hi, x.args[3]))
    g = torch.Generator().manual_seed(0)
    return {name: torch.randint(int(lo), int(hi) + 1, tuple(shape) or (), generator=g)
            for name, shape in m.index_tensors.items() if (lo_hi := rng.get(name)) is not None
            for lo, hi in [lo_hi]}


DENSE = Access(CONTIGUOUS, float("inf"), 1, 0.0, 0, 0)  # a physical buffer read in order


# ---------------------------------------------------------------------------
# prices (the policy)


@dataclass(frozen=True)
class Saving:
    """Estimated latency without a choice minus latency with it (positive: the choice pays), and why."""

    seconds: float
    reason: str

    def __str__(self) -> str:
        return f"{fmt_seconds(self.seconds)}: {self.reason}"


def fmt_seconds(s: float) -> str:
    """A signed time in ms or µs: "+0.21 ms", "-3.05 µs"."""
    if abs(s) >= 1e-4:
        return f"{s * 1e3:+.2f} ms"
    return f"{s * 1e6:+.2f} µs"


FILL_FIRST = ("aten.constant_pad_nd.default",)  # kept ops torch runs as a fill of the output, then a copy
# kept out-of-place scatters torch runs as a clone of the base, then the updates written into it: one dense
# pass more than the copy through the pull mapping.  Priced as one pass, a kept KV-cache index_put (torch,
# 0.4-0.5 ms at 512 KB, 1 thread) looked cheaper than its push (a copy kernel for the base and one for the
# update: 0.2 ms), which plan="all" takes and the greedy did not (docs/prefill.md)
CLONE_FIRST = tuple(f"aten.{op}" for op in ("index_put.default", "index_copy.default", "scatter.src",
                                            "scatter.value", "slice_scatter.default", "select_scatter.default"))


class CostModel:
    """Prices of data movement on one machine.

    The policy of the planner: subclass or replace it to change what is
    considered profitable; nothing here affects correctness.  All prices are
    seconds.  Traffic goes at the machine's copy bandwidth; index arithmetic and
    scalar (non-vector) loads cost per element, split over the threads.
    """

    index_op_ns = 0.4  # one div/mod/select/min/max/load per element
    scalar_load_ns = 0.25  # an element that cannot come from a vector load (inner stride not 0 or 1)
    # an element of a choice between sources (a cat) read at an inner stride not 0 or 1: the vectorised loop
    # gathers every element of each side (no register-tiled transposed read applies); measured ~7.5 ns per
    # element in all, 1 thread (EfficientViT's q/k/v read through cat + view + permute by the ReLUs: 1.5 ms
    # per 200k elements, vs 0.09 ms on a physical cat)
    picked_gather_ns = 6.0
    l1_bytes = 32 << 10  # sources this small are read from L1: their gathers cost no more than scalar loads
    # torch copying an input whose inner stride is not 0 or 1 (a kept op on a transposed view, a library making
    # its operand contiguous): its scalar loop, on top of the scalar load; measured ~2.9 ns per element in all,
    # 1 thread (EfficientViT's constant_pad_nd of the transposed v slice, 212k elements: 0.61 ms in torch vs
    # 0.38 ms for the generated copy kernel, which also gathered through a cat)
    torch_strided_ns = 2.0
    call_us = 1.0  # one torch call / kernel launch
    uncertain = 1.25  # pessimism on the traffic of accesses of unknown locality (scattered, indirect)
    chunk_penalty = 0.05  # extra traffic of "chunked" accesses (partly used lines at the run ends)
    derive_us = 30.0  # deriving a scatter's inverse index before a kernel reads through it (a few torch calls)
    # ... where the graph's large ops evict the caches between the calls (``Estimator.cold``): the about nine
    # small torch calls of ``movement._inverse`` over 256 positions took 55 µs in a loop of their own but
    # 388 µs right after a 256 x 3584 x 1024 GEMM, and 383 µs inside the Llama prefill layer (the V-cache
    # update's kernel step; its kernel itself 0.06 ms), 1 thread, load ~5: the dispatcher's code and data
    # come back from memory.  Priced warm, the greedy read that update through the inverse (0.5 ms per call)
    # instead of pushing it (0.1 ms, no inverse; docs/prefill.md)
    derive_cold_us = 330.0
    page_fault_us = 1.0  # one fresh 4 KiB page of a buffer the framework allocates (measured 1-6 µs on a 2-core VM)
    fresh_bytes = 32 << 20  # glibc's largest mmap threshold: from here on every allocation is fresh pages

    def __init__(self, machine_: Machine | None = None) -> None:
        self.machine = machine_ or machine()

    # traffic
    def transfer(self, nbytes: float) -> float:
        """Seconds to move nbytes through memory."""
        return nbytes / (self.machine.bandwidth_gbs * 1e9)

    def traffic(self, numel: int, itemsize: int, acc: Access) -> float:
        """Bytes brought from memory to read numel elements through acc once."""
        dense = numel * itemsize
        if acc is DENSE or acc.kind == CONTIGUOUS:
            return dense
        if acc.kind == BROADCAST:
            return min(dense, max(acc.source_bytes, itemsize))
        touched = numel * acc.lines_per_element * self.machine.cache_line
        if acc.window_bytes <= self.machine.cache_bytes:  # a block of rows re-reads its lines from cache
            touched = min(touched, numel * acc.window_lines * self.machine.cache_line)
        if acc.source_bytes <= self.machine.cache_bytes:  # lines come back from cache for the next rows
            touched = min(touched, max(dense, acc.source_bytes))
        if acc.kind == CHUNKED:
            return max(dense, touched) * (1 + self.chunk_penalty)
        if acc.kind in (SCATTERED, INDIRECT):
            return max(dense, touched) * self.uncertain
        return max(dense, touched)

    def compute(self, numel: int, acc: Access, itemsize: int = 4) -> float:
        """Seconds of index arithmetic and scalar loads to read numel elements through acc once.

        Where neighbouring elements are neighbours in memory (inner stride 0 or 1) the loop is vectorised and
        its index arithmetic is shared by the lanes of a vector; elsewhere every element pays for its own.  Ops
        that do not depend on the innermost index are computed once per run of it (``Access.loop_ops``)."""
        if acc.stride in (0, 1):
            ns = acc.loop_ops * self.index_op_ns * itemsize / max(self.machine.vector_bytes, itemsize)
        else:
            ns = acc.loop_ops * self.index_op_ns + self.scalar_load_ns
            if acc.sourced_pieces > 1 and acc.source_bytes > self.l1_bytes:
                ns += self.picked_gather_ns
        return numel * ns * 1e-9 / max(self.machine.threads, 1)

    # the operations the estimator prices
    def read(self, numel: int, itemsize: int, acc: Access, reads: int = 1) -> float:
        """A kernel reading every element `reads` times through acc (re-reads hit cache, redo the index)."""
        return self.transfer(self.traffic(numel, itemsize, acc)) + reads * self.compute(numel, acc, itemsize)

    def write(self, numel: int, itemsize: int) -> float:
        return self.transfer(numel * itemsize)

    def copy(self, numel: int, itemsize: int, acc: Access, generated: bool = True) -> float:
        """One copy into a new buffer reading through acc: a generated copy kernel computes the index per
        element; the framework's copy (a kept op, a library making an operand contiguous) walks a strided
        view incrementally and pays only for scalar loads, but its indexing kernels (index_put, index_select,
        gather) compute every element's offset from the index in a scalar loop."""
        if generated:
            read = self.read(numel, itemsize, acc)
        elif acc.kind == INDIRECT:
            ns = acc.index_ops * self.index_op_ns + self.scalar_load_ns
            read = self.transfer(self.traffic(numel, itemsize, acc)) + numel * ns * 1e-9 / max(self.machine.threads, 1)
        else:
            no_index = replace(acc, index_ops=0, run_ops=0)
            read = self.transfer(self.traffic(numel, itemsize, acc)) + self.compute(numel, no_index, itemsize)
            if acc.stride not in (0, 1):  # TensorIterator's scalar loop over a non-contiguous input
                read += numel * self.torch_strided_ns * 1e-9 / max(self.machine.threads, 1)
        return self.call_us * 1e-6 + self.write(numel, itemsize) + read

    def derive(self, m: Mapping, cold: bool = False) -> float:
        """Seconds to compute the derived index tensors (a scatter's inverse) that a kernel reading through
        `m` needs on every call (``vtc.virtual.movement.derive_index_tensors``, a few torch calls each);
        `cold`: amid ops whose data does not fit the cache (``Estimator.cold``)."""
        from vtc.virtual.movement import _parse_derived

        us = self.derive_us + (self.derive_cold_us if cold else 0.0)
        return sum(_parse_derived(n) is not None for n in m.index_tensors) * us * 1e-6

    def fresh(self, nbytes: int) -> float:
        """Page faults of a new buffer of nbytes that the framework allocates on every call (a kept op's
        output, a library's contiguous copy of its operand): above glibc's mmap threshold each allocation is a
        new mapping whose pages fault on first write.  Generated kernels write such buffers into recycled
        storage (``vtc.runtime.buffers``) and pay nothing."""
        if nbytes < self.fresh_bytes:
            return 0.0
        return -(-nbytes // 4096) * self.page_fault_us * 1e-6

    def store(self, numel: int, itemsize: int, acc: Access) -> float:
        """Extra seconds of writing through acc instead of in order (a push)."""
        return self.transfer(self.traffic(numel, itemsize, acc) - numel * itemsize) + self.compute(numel, acc, itemsize)

    def node(self, node: Node) -> float:
        """Seconds of one compute node, whatever the plan: GEMM/conv flops at the machine's GEMM rate,
        anything else its operand and result bytes at the copy bandwidth; plus one call."""
        flops = _flops(node)
        if flops:
            sec = flops / (self.machine.gemm_gflops * 1e9)
        else:
            sec = self.transfer(sum(v.nbytes for v in [*node.inputs, *node.outputs]))
        return self.call_us * 1e-6 + sec

    # what libraries take
    def library_takes(self, reader: Node, operand: Value, st: Strided, shape: tuple[int, ...]) -> str | None:
        """None when library node `reader` takes this strided view as is, else why it copies it."""
        cat = category(reader)
        if cat == "matmul" and not _is_bias(reader, operand):
            return None if blas_layout(st, shape) else (
                f"composed mapping reads stride {_inner(st, shape)} inside a GEMM operand ({reader.op}): "
                f"the library copies it anyway")
        if is_dense(st, shape):
            return None
        if cat in ("conv", "attention", "pool", "norm", "fallback", "scan"):
            return f"{reader.op} makes its non-contiguous operand contiguous"
        return None


def blas_layout(st: Strided, shape: tuple[int, ...]) -> bool:
    """True when the last two dims are row- or column-major (any batch strides): BLAS reads it in place."""
    if len(shape) < 2:
        return len(shape) == 0 or shape[0] <= 1 or st.strides[0] == 1
    r, c = shape[-2], shape[-1]
    sr, sc = st.strides[-2], st.strides[-1]
    row = (c <= 1 or sc == 1) and (r <= 1 or sr >= max(c, 1))
    col = (r <= 1 or sr == 1) and (c <= 1 or sc >= max(r, 1))
    return row or col


def _inner(st: Strided, shape) -> int:
    dims = [k for k, n in enumerate(shape) if n > 1]
    return st.strides[dims[-1]] if dims else 1


def _is_bias(reader: Node, operand: Value) -> bool:
    first = reader.args[0] if reader.args else None
    return reader.target is not None and getattr(reader.target, "_opname", "") in ("addmm", "baddbmm", "addbmm",
                                                                                   "addmv") and first is operand


# ---------------------------------------------------------------------------
# latency of a strategy, term by term (mechanism facts, model prices)


@dataclass(frozen=True)
class Term:
    """One priced piece of work: what, how long, and a phrase for the logs."""

    key: tuple
    seconds: float
    note: str
    cost: bool = True  # False for reads that happen in every strategy (the baseline of a reader)


class Estimator:
    """Latency terms of the movement-related work of `vtog.graph` under a strategy; savings of choices.

    A state is the frozenset of movement ops whose pull choice is taken (their
    outputs are virtual).  Push choices are priced against a pull state but do
    not enter it; ``pushed`` names the ops whose pushes are taken (the planner
    sets it before it prices the remaining pulls again): such an op copies
    nothing, its writers read their inputs through its push mapping as a kernel
    reads an operand.
    """

    def __init__(self, vtog: VTOG, model: CostModel | None = None) -> None:
        self.vtog, self.model = vtog, model or CostModel()
        g = vtog.graph
        self.graph = g
        self.values: dict[str, Value] = {v.name: v for v in g.values()}
        self.nodes: dict[str, Node] = {n.name: n for n in g.nodes}
        self.producer, self.users = vtog.producer, vtog.users
        self.outputs = {v.name for v in g.outputs}
        self._maps: dict[tuple, Mapping] = {}
        self._acc: dict[tuple, Access] = {}
        self._acc_by_structure: dict[tuple, Access] = {}  # access() of a mapping by its structure()
        self._st: dict[int, tuple[Mapping, Strided | None]] = {}
        self._runs: dict[tuple, Mapping] = {}
        self._packs: dict[str, bool] = {}  # packs_through, per node
        self.rereads: dict[str, int] = {}
        self._compute: float | None = None
        self.anc: dict[str, frozenset[str]] = {}
        for n in g.nodes:
            for o in n.outputs:
                up: set[str] = set()
                if n.kind == "movement" and n.name in vtog.pulls:
                    up.add(n.name)
                    for v in n.inputs:
                        up |= self.anc.get(v.name, frozenset())
                self.anc[o.name] = frozenset(up)
        self.component = self._components()
        self.pushed: frozenset[str] = frozenset()
        # a compute node whose operands and result exceed the cache evicts it between the small torch calls
        # around it (CostModel.derive_cold_us): a transformer layer's GEMMs do, a toy graph's ops do not
        self.cold = any(sum(v.nbytes for v in [*n.inputs, *n.outputs]) > self.model.machine.cache_bytes
                        for n in g.nodes if n.kind != "movement")

    # -- mechanism facts ------------------------------------------------------
    def _components(self) -> dict[str, int]:
        """Movement node -> id of its connected group (movement ops sharing a value)."""
        parent: dict[str, str] = {}

        def find(x: str) -> str:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for n in self.graph.nodes:
            if n.kind != "movement":
                continue
            for v in [*n.inputs, *n.outputs]:
                parent[find("v:" + v.name)] = find(n.name)
        roots: dict[str, int] = {}
        return {n.name: roots.setdefault(find(n.name), len(roots)) for n in self.graph.nodes if n.kind == "movement"}

    def reads_of(self, node: Node) -> int:
        """How many times a generated kernel for `node` reads each operand element."""
        hit = self.rereads.get(node.name)
        if hit is not None:
            return hit
        r = 1
        if self.vtog.kinds.get(node.name) == "kernel":
            r = _row_passes(node)
            if r == 1:  # a pointwise node inlined into its one kernel reader is evaluated as often as it reads
                users = self.users.get(node.outputs[0].name, [])
                if len(users) == 1 and self.vtog.kinds.get(users[0].name) == "kernel":
                    r = self.reads_of(users[0])
        self.rereads[node.name] = r
        return r

    def mapping(self, value: str, state: frozenset) -> Mapping | None:
        """The composed mapping of `value` over physical tensors under `state`, or None when it is physical."""
        p = self.producer.get(value)
        if p is None or p.name not in state:
            return None
        key = (value, state & self.anc[value])
        hit = self._maps.get(key)
        if hit is not None:
            return hit
        k = next(i for i, o in enumerate(p.outputs) if o.name == value)
        m = self.vtog.pulls[p.name][k]
        inner = {s: mi for s in m.sources if (mi := self.mapping(s, state)) is not None}
        out = compose(m, inner) if inner else m
        self._maps[key] = out
        return out

    def strided(self, m: Mapping) -> Strided | None:
        """m.strided(), memoised (the memo keeps m alive, so its id stays its own)."""
        hit = self._st.get(id(m))
        if hit is None:
            hit = self._st[id(m)] = (m, m.strided())
        return hit[1]

    def access(self, m: Mapping, value: str) -> Access:
        v = self.values[value]
        size = _size(v)
        key = (m.shape, m.pieces, tuple(m.sources.items()), tuple(m.index_tensors.items()), size)
        hit = self._acc.get(key)
        if hit is None:  # the same walk under other tensor names (the next layer of a model) is not redone
            same = structure(m)
            twin = self._acc_by_structure.get((same, size)) if same is not None else None
            if twin is not None:
                hit = replace(twin, strided=self.strided(m))
            else:
                hit = access(m, size, self.model.machine.cache_line)
                if same is not None:
                    self._acc_by_structure[(same, size)] = hit
            self._acc[key] = hit
        return hit

    def kernel_access(self, m: Mapping, value: str, reader: Node, reads: int = 1) -> Access:
        """How generated kernel `reader` walks `value` through `m`: the row-major walk, or a cheaper order
        the kernel really takes (vtc.codegen): a GEMM or attention kernel packs its operands in blocks
        (each block is read along whichever of its last two dims is contiguous: a key row of the QKᵀ of
        attention), a row kernel puts the row dim whose loads step least through memory innermost among
        its rows (``vtc.codegen.cpp._row_order``: a permute in front of softmax), so rows that share cache
        lines run together."""
        acc = self.access(m, value)
        if acc.kind in (CONTIGUOUS, BROADCAST) or len(m.shape) < 2:
            return acc
        orders = []
        rank = len(m.shape)
        if category(reader) == "matmul" or self._scales_a_matmul_operand(reader):
            orders.append([*range(rank - 2), rank - 1, rank - 2])
        elif _is_row(reader) and acc.strided is not None:
            rows = [d for d in range(rank - 1) if m.shape[d] > 1]
            steps = {d: abs(acc.strided.strides[d]) for d in rows if acc.strided.strides[d]}
            if steps:
                best = min(steps, key=lambda d: (steps[d], -d))
                if best != rows[-1]:
                    orders.append([d for d in range(rank - 1) if d != best] + [best, rank - 1])
        size = _size(self.values[value])
        for order in orders:
            alt = self.access(_reordered(m, order), value)
            if self.model.read(_numel(m.shape), size, alt, reads) < self.model.read(_numel(m.shape), size, acc, reads):
                acc = alt
        return acc

    def _scales_a_matmul_operand(self, reader: Node) -> bool:
        """A scale or cast whose result only movement ops carry to a GEMM (SDPA's decomposition scales K^T):
        the code generator recomputes it where the GEMM or attention kernel packs that operand
        (``vtc.codegen.attention.is_cheap``), so the operand is walked as the GEMM walks it."""
        from vtc.codegen.attention import is_cheap

        if category(reader) != "pointwise" or not is_cheap(reader):
            return False
        todo, seen = [reader.outputs[0].name], set()
        while todo:
            for u in self.users.get(todo.pop(), []):
                if u.kind == "movement" and u.name not in seen:
                    seen.add(u.name)
                    todo.extend(o.name for o in u.outputs)
                elif u.kind != "movement" and category(u) != "matmul":
                    return False
        return bool(seen)

    def readers(self, value: str, state: frozenset) -> list[str]:
        """Who needs `value` itself under `state`: node names, "<output>", "<index>" (virtual ops read through;
        a pushed op is its writers, which read it as a kernel does)."""
        out = []
        for u in self.users.get(value, []):
            if u.kind == "movement" and u.name in state:
                maps = self.vtog.pulls[u.name]
                if any(value in m.index_tensors for m in maps):
                    out.append("<index>")
                continue
            out.append(u.name)
        if value in self.outputs:
            out.append("<output>")
        return list(dict.fromkeys(out))

    # -- terms ----------------------------------------------------------------
    def value_terms(self, value: str, state: frozenset) -> list[Term]:
        """Reads of `value` by kernels, and its realisation for everything else, under `state`."""
        v = self.values[value]
        size = _size(v)
        m = self.mapping(value, state)
        terms = []
        if m is None:
            for r in self.readers(value, state):
                if self.vtog.kinds.get(r) == "kernel" or r in self.pushed:
                    t = self.model.read(v.numel, size, DENSE, self.reads_of(self.nodes[r]))
                    terms.append(Term(("read", value, r), t, f"{r} reads it from memory", cost=False))
            return terms
        acc = self.access(m, value)
        st = self.strided(m)
        copied = False
        packs = []  # library GEMMs the generated kernel may run instead, packing `value` through its mapping
        for r in self.readers(value, state):
            kind = "kernel" if r in self.pushed else self.vtog.kinds.get(r)
            if kind == "kernel":
                n = self.reads_of(self.nodes[r])
                acc = self.kernel_access(m, value, self.nodes[r], n)
                t = self.model.read(v.numel, size, acc, n) + self.model.derive(m, self.cold)
                again = f" {n}x" if n > 1 else ""
                terms.append(Term(("read", value, r), t, f"{r} reads it{again} through its mapping, "
                                                             f"{acc.describe()}", cost=not acc.type_i or n > 1))
                continue
            if (r not in ("<output>", "<index>") and self.nodes[r].kind == "movement"
                    and self.vtog.backend == "cpu" and self.generated_move(r, state)):
                continue  # a kept op's copy kernel reads it through the mapping (priced in op_terms)
            if st is None:
                if r not in ("<output>", "<index>") and self.packs_through(r):
                    packs.append(r)
                    continue
                if not copied:
                    copied = True
                    who = "the graph output" if r == "<output>" else "an index" if r == "<index>" else r
                    t = self.model.copy(v.numel, size, acc) + self.model.derive(m, self.cold)
                    terms.append(Term(("realise", value), t,
                                      f"not a strided view: a copy kernel realises it for {who} "
                                      f"({acc.describe()})"))
                continue
            if r == "<output>":  # the output takes any view: one step of the executor makes it (_realize)
                terms.append(Term(("view", value), self.model.call_us * 1e-6, "a view step hands it to the output"))
                continue
            if r == "<index>":
                continue  # index loads take any view
            if self.nodes[r].kind == "movement":  # a kept op reads views in place (its own copy is priced) ...
                if needs_dense(self.nodes[r]) and not is_dense(st, v.shape) and not copied:
                    copied = True  # ... except aten.view, which needs it row-major: a copy kernel realises it
                    terms.append(Term(("realise", value), self.model.copy(v.numel, size, acc),
                                      f"{r} ({self.nodes[r].op}) needs it row-major: a copy kernel realises it"))
                continue
            why = self.model.library_takes(self.nodes[r], v, st, v.shape)
            if why:
                t = self.model.copy(v.numel, size, acc, generated=False) + self.model.fresh(v.nbytes)
                terms.append(Term(("libcopy", value, r), t, why))
        if packs and not copied:  # (with a copy made for another reader, torch's GEMM reads that copy)
            terms.extend(self._pack_terms(value, m, packs))
        return terms

    def packs_through(self, r: str) -> bool:
        """Whether library node `r` is a GEMM that the lowering may run as a generated kernel instead when an
        operand is virtual and no strided view (``vtc.codegen.gemm.choose`` under gemm="auto", CPU backend):
        ``node_kinds`` asked with every movement op virtual, where a plan may leave other operands' copies."""
        hit = self._packs.get(r)
        if hit is None:
            from vtc.codegen.gemm import could_generate

            hit = self._packs[r] = (self.vtog.backend == "cpu" and self.vtog.gemm == "auto"
                                    and self.vtog.kinds.get(r) == "library" and could_generate(self.nodes[r]))
        return hit

    def _pack_terms(self, value: str, m: Mapping, packs: list[str]) -> list[Term]:
        """Virtual `value` (no strided view) read by library GEMMs `packs` (``packs_through``) and nothing else
        that needs it in memory: the lowering either realises it with a copy kernel for torch's GEMM or runs
        the generated GEMM, whose pack loops read it through its mapping (``gemm.choose`` takes the cheaper);
        each GEMM is priced as the cheaper of the two here, the pack through the mapping as what it costs
        over packing a row-major operand (a kept movement op in front would leave torch only the copy)."""
        v = self.values[value]
        size = _size(v)
        base = self.access(m, value)
        copy = self.model.copy(v.numel, size, base) + self.model.derive(m, self.cold)
        dense = self.model.read(v.numel, size, DENSE)
        reads = []
        for r in packs:
            acc = self.kernel_access(m, value, self.nodes[r])
            t = max(0.0, self.model.read(v.numel, size, acc) - dense) + self.model.derive(m, self.cold)
            reads.append(Term(("read", value, r), t, f"{r} (torch's, or the generated GEMM packing it through its "
                                                     f"mapping when cheaper) reads it through its mapping, "
                                                     f"{acc.describe()}"))
        if sum(t.seconds for t in reads) < copy:
            return reads
        return [Term(("realise", value), copy, f"not a strided view: a copy kernel realises it for {packs[0]} "
                                               f"({base.describe()})")]

    def generated_move(self, op: str, state: frozenset) -> bool:
        """True when kept movement op `op` runs as a generated copy kernel (``vtc.codegen.lower.move_kernels``):
        it has a pull mapping, every dtype it touches has generated code, it is no scatter (``CLONE_FIRST``)
        with a virtual input under `state`, and no index tensor of its mapping is virtual under `state` (the
        kernel's range check would name a tensor no step fills: torch runs it on the realised index).  Such a
        kernel reads a virtual input through that input's mapping, as any kernel does (before session 17 torch
        ran every kept op with a virtual input, on realised views); else torch runs it on realised inputs."""
        from vtc.codegen.ops import C_TYPES

        n = self.nodes[op]
        maps = self.vtog.pulls.get(op)
        if maps is None or not all(v.dtype in C_TYPES for v in [*n.inputs, *n.outputs]):
            return False
        if any(self.mapping(t, state) is not None for mp in maps for t in mp.index_tensors if t in self.values):
            return False
        if self.vtog.backend != "cpu" or n.op in CLONE_FIRST:  # (another backend: priced as before session 17)
            return all(self.mapping(v.name, state) is None for v in n.inputs)
        return True

    def op_terms(self, op: str, state: frozenset) -> list[Term]:
        """The copy a kept movement op makes, as the lowering runs it (``vtc.codegen.lower.move_kernels``): a
        generated copy kernel through its pull mapping composed with its virtual inputs' mappings (into recycled
        storage); else (no pull mapping, a dtype without generated code) torch on the inputs (reading strided
        views of virtual ones in place) into a fresh buffer."""
        n = self.nodes[op]
        if op in state or op in self.pushed:
            return []
        maps = self.vtog.pulls.get(op)
        generated = self.generated_move(op, state)
        out = []
        for k, o in enumerate(n.outputs):
            size = _size(o)
            if maps is None:
                acc = DENSE
            else:
                inner = {s: mi for s in maps[k].sources if (mi := self.mapping(s, state)) is not None
                         and (generated or self.strided(mi) is not None)}
                key = (op, k, tuple(id(mi) for mi in inner.values()))
                m = self._runs.get(key)
                if m is None:
                    m = self._runs[key] = compose(maps[k], inner) if inner else maps[k]
                acc = self.access(m, o.name)
            if generated:
                t, how = self.model.copy(o.numel, size, acc) + self.model.derive(m, self.cold), "a copy kernel"
            else:
                fresh = self.model.fresh(o.nbytes)
                t = self.model.copy(o.numel, size, acc, generated=False) + fresh
                how = "torch" + (", into fresh pages" if fresh else "")
                if n.op in FILL_FIRST:  # torch fills the whole output, then copies the input into its part
                    t += self.model.call_us * 1e-6 + self.model.write(o.numel, size)
                    how += ", filled first"
                if n.op in CLONE_FIRST:  # torch clones the base, then writes the updates into the clone
                    t += self.model.copy(o.numel, size, DENSE, generated=False)
                    how += ", the base cloned first"
            out.append(Term(("run", op, o.name), t, f"{op} runs and copies {_bytes(o.nbytes)} ({how}, "
                                                    f"{acc.describe()})"))
        return out

    def terms(self, values: list[str], ops: list[str], state: frozenset) -> list[Term]:
        out = []
        for v in values:
            out.extend(self.value_terms(v, state))
        for op in ops:
            out.extend(self.op_terms(op, state))
        return out

    def affected(self, ops: set[str], state: frozenset) -> tuple[list[str], list[str]]:
        """The values and kept ops whose terms taking the pulls of `ops` from `state` can change."""
        after = state | ops
        values: list[str] = []
        for name in sorted(ops):
            op = self.nodes[name]
            values += [v.name for v in op.inputs] + [o.name for o in op.outputs]
        values = list(dict.fromkeys(values))
        seen = set(values)
        stack = [o.name for name in ops for o in self.nodes[name].outputs]
        while stack:
            x = stack.pop()
            for u in self.users.get(x, []):
                if u.kind == "movement" and u.name in after:
                    for o in u.outputs:
                        if o.name not in seen:
                            seen.add(o.name)
                            values.append(o.name)
                            stack.append(o.name)
        kept = sorted(ops) + sorted({u.name for x in values for u in self.users.get(x, [])
                                     if u.kind == "movement" and u.name not in after})
        return values, kept

    def compute(self) -> float:
        """Estimated seconds of the compute nodes, the part of the latency no plan changes."""
        if self._compute is None:
            self._compute = sum(self.model.node(n) for n in self.graph.nodes if n.kind != "movement")
        return self._compute

    def latency(self, state: frozenset) -> float:
        """Estimated latency of the whole graph under `state`: compute plus movement-related work."""
        return self.compute() + self.total(state)

    def total(self, state: frozenset) -> float:
        """Estimated seconds of all movement-related work (copies, realisations, reads) under `state`."""
        ops = [n.name for n in self.graph.nodes if n.kind == "movement"]
        return sum(t.seconds for t in self.terms(list(self.values), ops, state))

    # -- savings --------------------------------------------------------------
    def saving(self, choice: Choice, state: frozenset) -> Saving:
        """Latency without `choice` minus latency with it, from `state`."""
        if choice.direction == PUSH:
            return self._push_saving(choice, state)
        return self.saving_of({choice.op}, state, choice)

    def saving_of(self, ops: set[str], state: frozenset, choice: Choice | None = None) -> Saving:
        """Latency without minus latency with the pulls of every op in `ops` taken together, from `state`."""
        values, kept = self.affected(ops, state)
        before = self.terms(values, kept, state)
        after = self.terms(values, kept, state | ops)
        sec = sum(t.seconds for t in before) - sum(t.seconds for t in after)
        if choice is None:
            why = _worst(before, after) if sec <= 0 else "one composed mapping"
            return Saving(sec, f"{len(ops)} ops together: {why}")
        return Saving(sec, self._reason(choice, before, after, sec, state | ops))

    def _reason(self, choice: Choice, before: list[Term], after: list[Term], sec: float, state: frozenset) -> str:
        if sec <= 0:
            return _worst(before, after)
        runs = [t for t in before if t.key[0] == "run" and t.key[1] == choice.op]
        moved = sum(self.values[t.key[2]].nbytes for t in runs)
        outs = [v for v in choice.values if self.mapping(v, state) is not None]
        if not outs:
            return f"removes {choice.op}'s copy of {_bytes(moved)}"
        acc = self.access(self.mapping(outs[0], state), outs[0])
        readers = self.readers(outs[0], state)
        how = []
        ks = [r for r in readers if self.vtog.kinds.get(r) == "kernel"]
        if ks:
            how.append(f"read through by {', '.join(ks[:3])}{'...' if len(ks) > 3 else ''}")
        packed = [r for r in readers if r not in ks and ("read", outs[0], r) in {t.key for t in after}]
        if packed:  # _pack_terms
            how.append(f"packed through by the generated GEMM ({', '.join(packed[:3])})")
        libs = [r for r in readers if r not in ks and r not in packed]
        if libs:
            st = self.strided(self.mapping(outs[0], state))
            how.append(("zero-copy view for " if st is not None else "one copy kernel for ") + ", ".join(libs[:3]))
        if not readers:
            how.append("read by later movement ops through the composed mapping")
        return f"{acc.describe()}; removes {choice.op}'s copy of {_bytes(moved)}; {'; '.join(how)}"

    def _push_saving(self, choice: Choice, state: frozenset) -> Saving:
        """A push: the op's copy disappears; the producers write through, readers read through the target.

        Where the push would replace the op's pull (`state` holds it: ``vtc.codegen.push.take_pushes``), it is
        priced against that pull (``_against_pull``), not against the op kept."""
        op = self.nodes[choice.op]
        after = self._push_terms(choice, state)
        if op.name in state:
            before, rest = self._against_pull(choice, state)
            after += rest
        else:
            before = self.op_terms(op.name, state - {op.name})  # the op kept, run as the lowering would
        sec = sum(t.seconds for t in before) - sum(t.seconds for t in after)
        if sec > 0:
            acc = self.access(choice.edges[0].mapping, choice.edges[0].src)
            pushed = {e.src for e in choice.edges}
            reason = (f"{', '.join('%' + s for s in sorted(pushed))} written in place into "
                      f"%{choice.edges[0].dst} ({acc.describe()}); removes {op.name}'s copy")
        else:
            bad = sorted(after, key=lambda t: -t.seconds)
            reason = bad[0].note if bad else "removing it saves nothing measurable"
        return Saving(sec, reason)

    def _push_terms(self, choice: Choice, state: frozenset) -> list[Term]:
        """What push `choice` costs: its inputs that no kernel computes copied into place, the stores through
        its mapping, and the other readers of its inputs reading them through its output."""
        op = self.nodes[choice.op]
        pushed = {e.src for e in choice.edges}
        after: list[Term] = []
        for x in op.inputs:
            if x.name in pushed:
                continue
            size = _size(x)
            after.append(Term(("run", op.name, x.name), self.model.copy(x.numel, size, DENSE, generated=False),
                              f"{op.name} still copies %{x.name} into place"))
        for e in choice.edges:
            v = self.values[e.src]
            size = _size(v)
            acc = self.access(e.mapping, e.src)
            after.append(Term(("store", e.src), self.model.store(v.numel, size, acc),
                              f"the producer of %{e.src} writes through {acc.describe()}"))
            if not self._stored_by_kernel(e.src, state):  # no kernel computes it: a copy kernel
                after.append(Term(("pushcopy", e.src), self.model.copy(v.numel, size, DENSE),
                                  f"no kernel computes %{e.src}: a copy kernel writes it into place"))
            for r in self.readers(e.src, state):
                if r == op.name:
                    continue
                if self.vtog.kinds.get(r) == "kernel":
                    n = self.reads_of(self.nodes[r])
                    extra = self.model.read(v.numel, size, acc, n) - self.model.read(v.numel, size, DENSE, n)
                    after.append(Term(("read", e.src, r), extra, f"{r} reads %{e.src} through %{e.dst}"))
                elif r not in ("<output>", "<index>") and acc.strided is not None:
                    why = self.model.library_takes(self.nodes[r], v, acc.strided, v.shape)
                    if why:
                        t = self.model.copy(v.numel, size, acc, generated=False) + self.model.fresh(v.nbytes)
                        after.append(Term(("libcopy", e.src, r), t, why))
                else:
                    after.append(Term(("realise", e.src), self.model.copy(v.numel, size, acc),
                                      f"%{e.src} is not a strided view of %{e.dst}: a copy realises it for {r}"))
        return after

    def _against_pull(self, choice: Choice, state: frozenset) -> tuple[list[Term], list[Term]]:
        """(before, after) terms of push `choice` in place of its op's pull in `state`, over the op's group.

        Pulled, the op copies nothing, and a kept op reading through it is a copy kernel that reads its
        inputs through the mapping (``generated_move``): nothing is copied for it.  Pushed, the op's output is
        physical, and a kept op of its group may then pay as a pull (``vtc.plan.greedy.resume`` takes it):
        EfficientViT's q/k/v view of the cat that its convolutions store into is read through as a strided
        view, where a channel shuffle's clone stays the graph output's one copy and the push only adds the
        copy of the input that no kernel computes (the split half)."""
        from vtc.plan.greedy import EPSILON_S

        op = choice.op
        without = state - {op}
        old = self.pushed
        self.pushed = old | {op}
        try:
            pulled: set[str] = set()
            while True:
                values, kept = self.affected({op} | pulled, without)
                free = [k for k in kept if k not in pulled and k != op and k not in self.pushed
                        and (c := self.vtog.choice(k)) is not None and not c.invalid
                        and not self.vtog.conflict(choice, c)]
                gains = {k: self.saving_of({k}, without | pulled).seconds for k in free}
                best = max(gains, key=gains.get, default=None)
                if best is None or gains[best] <= EPSILON_S:
                    break
                pulled.add(best)
            after = [t for t in self.terms(values, kept, without | pulled)
                     if not (t.key[0] == "read" and t.key[2] == op)]  # its writers: _push_terms
        finally:
            self.pushed = old
        return self.terms(values, kept, state), after

    def pull_to_push_saving(self, choice: Choice, state: frozenset) -> Saving:
        """A push taken in place of the pull of the same op (``state`` holds it): a head merge that a generated
        GEMM would pack through its mapping, whose input an attention kernel computes
        (``vtc.codegen.push.merged_heads_reader``).  Before: the readers read through the pulled mapping.
        After: they read the op's output from memory (a strided view of it), and the kernel that computes
        each pushed input stores its rows through the push mapping (priced as a store through the input's
        mapping over that kernel's result, the same runs in the other direction); it reads nothing."""
        op = choice.op
        without = state - {op}
        values, kept = self.affected({op}, without)
        before = self.terms(values, kept, state)
        old = self.pushed
        self.pushed = old | {op}
        try:
            after = [t for t in self.terms(values, kept, without) if not (t.key[0] == "read" and t.key[2] == op)]
        finally:
            self.pushed = old
        for e in choice.edges:
            v = self.values[e.src]
            m = self.mapping(e.src, without)
            acc = self.access(m if m is not None else e.mapping, e.src)
            after.append(Term(("store", e.src), self.model.store(v.numel, _size(v), acc),
                              f"the kernel computing %{e.src} stores it merged ({acc.describe()})"))
        sec = sum(t.seconds for t in before) - sum(t.seconds for t in after)
        if sec > 0:
            reads = [t for t in before if t.key[0] == "read" and t.cost]
            how = f", where {reads[0].note}" if reads else ""
            reason = f"the producer stores %{choice.edges[0].dst} in place of the pull{how}"
        else:
            reason = _worst(before, after)
        return Saving(sec, reason)

    def _stored_by_kernel(self, value: str, state: frozenset) -> bool:
        """True when a generated kernel computes `value`, or `value` is virtual over one source that a generated
        GEMM or convolution computes (it stores through the chain's push form, vtc.codegen.gemm_push)."""
        p = self.producer.get(value)
        m = self.mapping(value, state) if p is not None and p.kind == "movement" else None
        if m is not None and len(m.pieces) == 1 and m.pieces[0].source is not None:
            p = self.producer.get(m.pieces[0].source)
            return p is not None and self.vtog.kinds.get(p.name) == "kernel" and category(p) in ("matmul", "conv")
        return p is not None and self.vtog.kinds.get(p.name) == "kernel"


def _reordered(m: Mapping, order: list[int]) -> Mapping:
    """`m` with its output dims in `order` (dim k of the result is dim order[k] of m): the same elements
    walked in another order."""
    shape = tuple(m.shape[d] for d in order)
    idx: list = [None] * len(order)
    for k, d in enumerate(order):
        idx[d] = out_vars(shape)[k]
    walk_ = Mapping(shape, (Piece("_walk", tuple(idx)),), {"_walk": tuple(m.shape)})
    return compose(walk_, {"_walk": m})


def _is_row(node: Node) -> bool:
    """True when the code generator runs `node` as a row kernel (a reduction over rows: softmax, norms, sum)."""
    from vtc.codegen.ops import ROW, lookup

    return lookup(ROW, node.target) is not None


def _flops(node: Node) -> int:
    """Multiply-adds x 2 of a GEMM or convolution node (0 for anything else)."""
    cat = category(node)
    out = node.outputs[0] if node.outputs else None
    mats = [v for v in node.inputs if len(v.shape) >= 2]
    if out is None or not mats:
        return 0
    if cat == "matmul":
        a = mats[1] if _is_bias(node, node.inputs[0]) and len(mats) > 1 else mats[0]
        return 2 * out.numel * int(a.shape[-1])
    if cat == "conv" and len(node.inputs) > 1 and len(node.inputs[1].shape) >= 2:
        w = node.inputs[1]
        return 2 * out.numel * (w.numel // max(int(w.shape[0]), 1))
    return 0


def _worst(before: list[Term], after: list[Term]) -> str:
    """The note of the term that grows most from `before` to `after` (why a choice does not pay)."""
    was = {t.key: t.seconds for t in before}
    grew = sorted(((t.seconds - was.get(t.key, 0.0), k, t) for k, t in enumerate(after) if t.cost),
                  key=lambda x: (-x[0], x[1]))
    if grew and grew[0][0] > 0:
        return grew[0][2].note
    return "removing it saves nothing measurable"


def _row_passes(node: Node) -> int:
    """Passes a generated row kernel makes over its input (accumulator phases, plus per-element stores)."""
    from vtc.codegen.lower import _ProbeCtx
    from vtc.codegen.ops import ROW, NotSupported, lookup
    from vtc.virtual.movement import bind

    fn = lookup(ROW, node.target)
    if fn is None:
        return 1
    try:
        spec = fn(_ProbeCtx(node), bind(node.target, node.args, node.kwargs), node.outputs)
    except (NotSupported, TypeError, ValueError, KeyError):
        return 2
    return len(spec.phases) + any(per_r for _, _, per_r in spec.stores)  # per-element stores read it again


def _size(v: Value) -> int:
    """Bytes per element of value v."""
    return _elem_size(v.dtype)


@lru_cache(maxsize=None)
def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KB"
    return f"{n} B"
