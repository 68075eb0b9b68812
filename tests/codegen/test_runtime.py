"""Runtime of the CPU backend: the disk cache across processes, threads, memory over many calls."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

from vtc.runtime import cbuild, checks

from .util import ROW_TOL, assert_all_generated, compile_cpu, errors_in_threads, gen, rand, rss_growth_kb, steps

REPO = Path(__file__).resolve().parents[2]

# The function of the cache tests (source text: run in child processes and in this one).
FN = textwrap.dedent("""\
    def f(x, y):
        return torch.softmax(x.transpose(0, 1) + y, -1), (x * 2).sum(0)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(17, 3, generator=g), torch.randn(3, 17, generator=g)
    """)

# A fresh process: compiles FN for the CPU backend, checks it against eager, and reports how
# many kernel libraries it had to compile (cbuild._compile is the one place that does).
CHILD = textwrap.dedent("""\
    import json, warnings
    warnings.filterwarnings("ignore")
    import torch, vtc
    from vtc.runtime import cbuild

    compiles = []
    real = cbuild._compile
    def counting(source, stem, *rest):
        compiles.append(stem.name)
        return real(source, stem, *rest)
    cbuild._compile = counting
    """) + FN + textwrap.dedent("""\
    c = vtc.compile(f, (x, y), backend="cpu")
    ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(c(x, y), f(x, y)))
    kernels = sum(1 for s in c._first.executor.steps if s.kind == "kernel")
    print(json.dumps({"compiles": len(compiles), "ok": bool(ok), "kernels": kernels}))
    """)


def run_child(cache: Path) -> dict:
    env = {**os.environ, "VTC_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def libraries(cache: Path) -> dict[str, tuple[int, int]]:
    """Every kernel library in the cache: name -> (mtime_ns, size)."""
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.rglob("*.so")}


def build_here(cache: Path, monkeypatch) -> list[str]:
    """Compiles FN in this process into `cache`, with no library loaded in memory (the in-memory
    table is content-keyed: FN's kernels may be loaded from the session cache already; the call plan's
    C helpers, vtc.runtime.checks, are loaded once per process); returns the names of the libraries it
    had to compile."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(cache))
    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setattr(checks, "_fns", None)
    compiles: list[str] = []
    real = cbuild._compile
    monkeypatch.setattr(cbuild, "_compile", lambda source, stem, *rest: compiles.append(stem.name)
                        or real(source, stem, *rest))
    env: dict = {"torch": torch}
    exec(FN, env)
    f, x, y = env["f"], env["x"], env["y"]
    compiled = compile_cpu(f, (x, y))
    for got, want in zip(compiled(x, y), f(x, y)):
        torch.testing.assert_close(got, want, **ROW_TOL)
    return compiles


def test_second_process_reuses_the_disk_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    built = build_here(cache, monkeypatch)  # a cold cache: FN's kernels were compiled (one library per
    before = libraries(cache)                # compiler job, so they build in parallel)
    assert len(built) >= 1 and len(before) == len(built)
    second = run_child(cache)
    assert second["ok"] and second["kernels"] == 2
    assert second["compiles"] == 0, "a fresh process recompiled kernels that were in the disk cache"
    assert libraries(cache) == before  # nothing rewritten


def test_corrupt_cache_entry_is_detected_and_rebuilt(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    assert len(build_here(cache, monkeypatch)) >= 1
    so = sorted(cache.rglob("*.so"))[0]  # one of the libraries (a unit per compiler job)
    data = so.read_bytes()
    # Truncate the entry: write the first half to a new file and rename it over the library (this
    # process has the original mapped; truncating that inode in place would crash it with SIGBUS).
    half = so.with_name("half.tmp")
    half.write_bytes(data[: len(data) // 2])
    half.chmod(0o600)
    os.replace(half, so)
    third = run_child(cache)  # a fresh process: it must not dlopen the truncated file
    assert third["ok"] and third["kernels"] == 2
    assert third["compiles"] == 1  # the corrupt entry, and only it, was rebuilt
    rebuilt = so.read_bytes()
    assert len(rebuilt) > len(data) // 2
    assert so.with_suffix(".sha256").read_text().strip() == hashlib.sha256(rebuilt).hexdigest()


# ---------------------------------------------------------------------------
def test_compiled_model_called_from_four_threads():
    def f(x, y, w):
        return (torch.softmax(x.transpose(0, 1) + y, -1),  # 160 x 256: a parallel (OpenMP) row kernel
                F.layer_norm(x * 2, (160,), w),
                (x.t() * y).sum(0))

    g = gen(60)
    sets = [(rand((256, 160), g), rand((160, 256), g), rand((160,), g)) for _ in range(4)]
    compiled = compile_cpu(f, sets[0])
    assert_all_generated(compiled)
    expected = [f(*s) for s in sets]
    def work(k: int) -> None:
        for _ in range(25):
            for got, want in zip(compiled(*sets[k]), expected[k]):
                torch.testing.assert_close(got, want, **ROW_TOL)

    assert errors_in_threads(work, 4) == []


def test_many_calls_do_not_grow_memory():
    f = lambda x, y: torch.softmax(x.transpose(0, 1) + y, -1) * 2  # noqa: E731
    g = gen(61)
    x, y = rand((17, 3), g), rand((3, 17), g)
    compiled = compile_cpu(f, (x, y))
    assert [s.kind for s in steps(compiled)] == ["kernel", "kernel"]
    grown = rss_growth_kb(lambda: compiled(x, y), warmup=200, calls=2000)
    assert grown < 4 * 1024, f"RSS grew by {grown} kB over 2,000 calls"
