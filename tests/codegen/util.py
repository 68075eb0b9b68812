"""Helpers of the code generator tests: random inputs, compile + compare, what ran where."""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Callable, Sequence

import torch

import vtc

# Tolerances (float32): elementwise math, and anything that accumulates.
POINTWISE_TOL = dict(rtol=1e-5, atol=1e-5)
ROW_TOL = dict(rtol=1e-4, atol=1e-4)



@contextmanager
def torch_threads(n: int | None):
    """torch's thread count (which generated kernels take as theirs) set to n inside the block, the old count
    restored after; None leaves it as it is."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

def gen(seed: int) -> torch.Generator:
    """A CPU generator with this seed."""
    return torch.Generator().manual_seed(seed)


def case_seed(case, modulus: int = 1000) -> int:
    """A seed from a test case's parameters, the same in every process (``hash`` of a str is salted per
    process, so a seed made from it gives other inputs on every run)."""
    return zlib.crc32(repr(case).encode()) % modulus


def rand(shape: Sequence[int], g: torch.Generator, dtype: torch.dtype = torch.float32, *,
         positive: bool = False, low: float = 0.25, high: float = 2.0) -> torch.Tensor:
    """Random values, never zero: floats of magnitude in [low, high) with a random sign
    (positive only when asked); integers in [1, 9] with a random sign (or positive);
    bools half true."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    sign = torch.ones(shape) if positive else torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    if dtype.is_floating_point:
        mag = torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low
        return (mag * sign).to(dtype)
    mag = torch.randint(1, 10, shape, generator=g)
    if dtype == torch.uint8:
        return mag.to(dtype)
    return (mag * sign.long()).to(dtype)


def compile_cpu(fn: Callable, inputs: tuple, **options) -> vtc.Compiled:
    """vtc.compile(fn, inputs, backend="cpu", plan="all", ...): the code generator reading through every
    mapping, whatever the planner would keep (the default plan is "greedy")."""
    return vtc.compile(fn, inputs, backend="cpu", **{"plan": "all", **options})


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_matches_eager(compiled, fn: Callable, inputs: tuple, *, rtol: float, atol: float,
                         names: Sequence[str] | None = None) -> None:
    """compiled(*inputs) equals fn(*inputs): same dtype and shape, values within the tolerances."""
    want = as_tuple(fn(*inputs))
    got = as_tuple(compiled(*inputs))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        what = names[k] if names else f"output {k}"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, what=what: f"{what}: {m}")


def check(fn: Callable, inputs: tuple, *, rtol: float, atol: float, names: Sequence[str] | None = None,
          **options) -> vtc.Compiled:
    """Compiles fn for the CPU backend, compares with eager, and returns the compiled object."""
    compiled = compile_cpu(fn, inputs, **options)
    assert_matches_eager(compiled, fn, inputs, rtol=rtol, atol=atol, names=names)
    return compiled


def channel_shuffle(x: torch.Tensor, groups: int = 2) -> torch.Tensor:
    """ShuffleNet's channel shuffle of an NCHW tensor (view -> transpose -> reshape)."""
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


def bn_relu(g: torch.Generator, channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An eval-mode batch norm (random statistics and affine terms) followed by ReLU."""
    mean, var = rand((channels,), g), rand((channels,), g, positive=True)
    gamma, beta = rand((channels,), g), rand((channels,), g)
    return lambda y: torch.relu(torch.nn.functional.batch_norm(y, mean, var, gamma, beta, False, eps=1e-5))


def gemm_paths(compiled) -> list[str]:
    """The kernel path of each GEMM / convolution of the report, in order."""
    return [q["path"] for q in report(compiled)["gemm"]]


def check_conv_bias_relu_on_two_threads(cases, form: str, **conv_args) -> None:
    """relu(conv2d(x, W, bias, **conv_args)) compiled and run on two threads for each (batch, out channels, in
    channels, kernel size, height, width) of `cases`: matches eager and the convolution takes kernel path `form`."""
    with torch_threads(2):
        for b, o, c, k, h, w in cases:
            g = gen(b * 100 + o)
            weight, bias = rand((o, c, k, k), g), rand((o,), g)

            def fn(x):
                return torch.relu(torch.nn.functional.conv2d(x, weight, bias, **conv_args))

            x = rand((b, c, h, w), g)
            compiled = compile_cpu(fn, (x,))
            assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
            assert gemm_paths(compiled) == [form]


def executor(compiled):
    return compiled._first.executor


def steps(compiled, kind: str | None = None) -> list:
    """The executor's steps (of one kind: "kernel" | "run" | "view" | "gather")."""
    return [s for s in executor(compiled).steps if kind is None or s.kind == kind]


def kernels(compiled) -> list:
    """The generated kernels (kernel IR) in execution order."""
    return [s.kernel.step.kernel for s in steps(compiled, "kernel")]


def report(compiled) -> dict:
    return compiled.report.to_dict()


def assert_all_generated(compiled) -> None:
    """Nothing ran through torch: no "run" step, no reason in why_torch, no fallback op."""
    runs = [s.node.op for s in steps(compiled, "run")]
    assert runs == [], f"ran through torch instead of a generated kernel: {runs}"
    why = executor(compiled).lowering.why_torch
    assert why == {}, f"lowering left nodes to torch: {why}"
    assert report(compiled)["fallback_ops"] == []


def assert_no_movement(compiled) -> None:
    """Every movement op is read through its mapping: nothing materialised, no copy kernel, no gather."""
    r = report(compiled)
    assert r["materialized_movement_bytes"] == 0, compiled.report
    assert r["eliminated_movement_ops"] == r["movement_ops"], compiled.report
    copies = [k.source_nodes for k in kernels(compiled) if k.kind == "copy"]
    assert copies == [], f"copy kernels realise movement: {copies}"
    assert steps(compiled, "gather") == []


def graph_input_names(compiled) -> set[str]:
    g = compiled.graph
    return {v.name for v in g.inputs} | {v.name for v in g.consts}


def index_tensor_names(compiled) -> set[str]:
    return {t for m in compiled._first.plan.mappings.values() for t in m.index_tensors}


def kernel_storing(compiled, k: int):
    """The kernel (IR) that stores graph output k."""
    name = compiled.graph.outputs[k].name
    hits = [kn for kn in kernels(compiled) if any(st.buffer.name == name for st in kn.stores)]
    assert len(hits) == 1, f"output {name} is stored by {len(hits)} kernels"
    return hits[0]


def gathered_prefetches(compiled) -> list[tuple[int, int]]:
    """(rows ahead, locality) of every gathered-row prefetch (``vtc.codegen.prefetch``) in the compiled graph's
    kernels."""
    import re

    from vtc.codegen.cpp import generate

    out = []
    for k in kernels(compiled):
        src = generate(k)
        ahead = re.findall(r"if \(o \+ (\d+) < \d+\) \{", src)
        localities = re.findall(r"__builtin_prefetch\(p_ \+ 64 \* q_(?:, 0, (\d))?\)", src)
        out += [(int(a), int(loc or 3)) for a, loc in zip(ahead, localities)]  # 3: the default
    return out


def data_reads(compiled, kernel) -> set[str]:
    """The buffers a kernel reads for data (its inputs that are not index tensors of a mapping)."""
    return {b.name for b in kernel.inputs} - index_tensor_names(compiled)


def errors_in_threads(work, n: int) -> list[str]:
    """Runs work(k) for k in range(n), each in its own thread, all started together (a barrier);
    returns what each raised ("thread k: ...")."""
    import threading

    barrier = threading.Barrier(n)
    errors: list[str] = []

    def run(k: int) -> None:
        try:
            barrier.wait()
            work(k)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(f"thread {k}: {e}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def rss_growth_kb(call: Callable[[], object], warmup: int, calls: int) -> int:
    """How many kB the process's resident memory grew over `calls` calls of `call`, after `warmup` calls
    (allocator caches, lazy initialisation)."""
    import gc
    from pathlib import Path

    def rss_kb() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS in /proc/self/status")

    for _ in range(warmup):
        call()
    gc.collect()
    before = rss_kb()
    for _ in range(calls):
        call()
    gc.collect()
    return rss_kb() - before


def run_gemm_built_for(march: str, k, compiled, inputs: tuple, tmp_path, stem: str = "gemm") -> torch.Tensor:
    """GEMM kernel `k` of `compiled` built from its generated source for `-march=<march>` (instead of the
    host's) and called directly on `inputs`: its output."""
    import ctypes
    import subprocess

    from vtc.codegen.gemm import generate as generate_gemm
    from vtc.runtime import cbuild

    info = cbuild.compiler_info()
    flags = [f for f in info.flags if not f.startswith("-march")] + [f"-march={march}"]
    src, so = tmp_path / f"{stem}.cpp", tmp_path / f"{stem}-{march}.so"
    src.write_text(generate_gemm(k))
    subprocess.run([*info.command, str(src), "-o", str(so), *flags], check=True, capture_output=True)
    return call_gemm_kernel(ctypes.CDLL(str(so)), k, compiled, inputs, 2)


def call_gemm_kernel(lib, k, compiled, inputs: tuple, nthreads: int) -> torch.Tensor:
    """GEMM kernel `k` of `compiled`, loaded in `lib`, called directly on `inputs` with `nthreads`: its output."""
    import ctypes

    from vtc.codegen.cpp import buffer_order

    fn_c = getattr(lib, k.name)
    fn_c.argtypes, fn_c.restype = [ctypes.c_void_p, ctypes.c_int], None
    env = dict(zip([v.name for v in compiled.graph.inputs], inputs))
    out = torch.empty(k.stores[0].buffer.shape)
    tensors = [env[b.name].contiguous() if b.name in env else out for b in buffer_order(k)]
    fn_c((ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]), nthreads)
    return out


def run_cpp_program(source: str, tmp_path, stdin: str = ""):
    """C++ program `source` built with the kernels' compiler and flags (an executable, not a library) and run on
    `stdin`: the finished process (``subprocess.CompletedProcess``, its output as text)."""
    import subprocess

    from vtc.runtime import cbuild

    info = cbuild.compiler_info()
    src, exe = tmp_path / "t.cpp", tmp_path / "t"
    src.write_text(source)
    flags = [f for f in info.flags if f not in ("-shared", "-fPIC")]
    subprocess.run([*info.command, *flags, "-o", str(exe), str(src)], check=True, capture_output=True)
    return subprocess.run([str(exe)], input=stdin, capture_output=True, text=True)
