"""Tests of vtc.runtime.cbuild: build, cache, verify and load C++ kernels."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from vtc.runtime import cbuild

ADD1 = textwrap.dedent("""\
    extern "C" void add1(float* x, long n) {
      #pragma omp parallel for simd
      for (long i = 0; i < n; ++i) x[i] += 1.0f;
    }
    """)


def ret(value: str, tag: str = "") -> str:
    """A source whose `int ret()` returns value (tag makes the source, hence the key, unique)."""
    return f'// {tag}\nextern "C" int ret() {{ return {value}; }}\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache directory and a counter of kernel compiles (probing happens first)."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path / "cache"))
    cbuild.compiler_info()
    monkeypatch.setattr(cbuild, "_loaded", {})
    calls: list[list[str]] = []
    real = cbuild._run_compiler

    def counting(cmd):
        calls.append(list(cmd))
        return real(cmd)

    monkeypatch.setattr(cbuild, "_run_compiler", counting)
    return calls


def entry(source: str, name: str = "kernel", flags=()) -> tuple[Path, Path]:
    """The .so and .sha256 paths of a source's cache entry."""
    stem = cbuild._stem(name, cbuild._key(source, tuple(flags)))
    return stem.with_suffix(".so"), stem.with_suffix(".sha256")


def call_add1(lib: ctypes.CDLL, n: int = 10_001) -> None:
    """Runs add1 on a torch tensor in place and checks the result."""
    lib.add1.argtypes = [ctypes.c_void_p, ctypes.c_long]
    lib.add1.restype = None
    x = torch.arange(n, dtype=torch.float32)
    expected = x + 1
    lib.add1(x.data_ptr(), x.numel())
    assert torch.equal(x, expected)


# A child process that loads cbuild by path (no torch, no vtc import: fast), waits
# for a go-file, builds the source and calls ret(); prints its result and compile count.
CHILD = textwrap.dedent("""\
    import ctypes, importlib.util, json, os, sys, time
    spec = importlib.util.spec_from_file_location("cbuild", sys.argv[1])
    cb = importlib.util.module_from_spec(spec); sys.modules["cbuild"] = cb; spec.loader.exec_module(cb)
    cb.compiler_info()
    compiles = []
    real = cb._run_compiler
    cb._run_compiler = lambda cmd: compiles.append(cmd) or real(cmd)
    source = open(sys.argv[2]).read()
    while len(sys.argv) > 3 and not os.path.exists(sys.argv[3]):
        time.sleep(0.001)
    lib = cb.build(source, name="shared")
    print(json.dumps({"ret": lib.ret(), "compiles": len(compiles)}))
    """)


def start_child(tmp_path: Path, source: str, go: Path | None = None) -> subprocess.Popen:
    """Starts a CHILD process on the test's cache directory."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "child.cpp").write_text(source)
    args = [sys.executable, str(tmp_path / "child.py"), cbuild.__file__, str(tmp_path / "child.cpp")]
    return subprocess.Popen(args + ([str(go)] if go else []), stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "VTC_CACHE_DIR": os.environ["VTC_CACHE_DIR"]})


def child_result(proc: subprocess.Popen) -> dict:
    """Waits for a CHILD process and returns its JSON line."""
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_add1_on_torch_tensor(cache):
    lib = cbuild.build(ADD1, name="add1")
    call_add1(lib)
    so, sidecar = entry(ADD1, "add1")
    assert so.name.startswith("add1-") and so.exists() and sidecar.exists()
    assert so.with_suffix(".cpp").read_text() == ADD1  # the source is kept next to the library
    assert so.stat().st_mode & 0o777 == 0o600
    assert len(cache) == 1


def test_cache_hits_do_not_compile(cache):
    lib = cbuild.build(ADD1)
    assert cbuild.build(ADD1) is lib  # in-process: a dict lookup
    assert len(cache) == 1
    cbuild._loaded.clear()  # as a new process would: the library comes from disk
    call_add1(cbuild.build(ADD1))
    assert len(cache) == 1


def test_flags_change_the_key(cache):
    src = ret("VAL", "flags")
    assert cbuild._key(src, ()) == cbuild._key(src, ())
    assert cbuild._key(src, ("-DVAL=1",)) != cbuild._key(src, ("-DVAL=2",))
    assert cbuild._key(src, ("-DVAL=1",)) != cbuild._key(src + " ", ("-DVAL=1",))
    assert cbuild.build(src, flags=["-DVAL=1"]).ret() == 1
    assert cbuild.build(src, flags=["-DVAL=2"]).ret() == 2
    assert entry(src, flags=["-DVAL=1"])[0] != entry(src, flags=["-DVAL=2"])[0]
    assert len(cache) == 2


@pytest.mark.parametrize("plant", ["garbage-no-sidecar", "garbage-wrong-sidecar", "empty-stale-sidecar"])
def test_planted_corrupt_entry_is_rebuilt(cache, plant):
    src = ret("7", plant)
    so, sidecar = entry(src)
    so.write_bytes(b"\x7fELF not really a library" * 100)
    so.chmod(0o600)
    if plant == "garbage-wrong-sidecar":
        sidecar.write_text("0" * 64 + "\n")
    elif plant == "empty-stale-sidecar":
        so.write_bytes(b"")
        sidecar.write_text("f" * 64 + "\n")
    assert cbuild.build(src).ret() == 7
    assert len(cache) == 1
    assert sidecar.read_text().strip() == cbuild._sha256(so)


def test_truncated_entry_is_rebuilt(cache, tmp_path):
    src = ret("11", "truncated")
    first = child_result(start_child(tmp_path, src))  # built (and loaded) in another process only
    assert first == {"ret": 11, "compiles": 1}
    so, sidecar = entry(src, "shared")
    size = so.stat().st_size
    with open(so, "r+b") as f:
        f.truncate(size // 2)
    assert cbuild.build(src, name="shared").ret() == 11  # this process dlopens the rebuilt file
    assert len(cache) == 1 and so.stat().st_size == size
    assert sidecar.read_text().strip() == cbuild._sha256(so)


def test_group_writable_cache_dir_is_refused(cache):
    cbuild.build(ADD1)
    directory = cbuild.cache_dir()
    cbuild._loaded.clear()
    directory.chmod(0o770)
    try:
        with pytest.raises(PermissionError, match=r"mode 0770.*chmod 700") as err:
            cbuild.build(ADD1)
        assert str(directory) in str(err.value)
    finally:
        directory.chmod(0o700)
    directory.parent.chmod(0o777)  # the VTC_CACHE_DIR root too
    try:
        with pytest.raises(PermissionError, match="chmod 700"):
            cbuild.build(ADD1)
    finally:
        directory.parent.chmod(0o700)
    call_add1(cbuild.build(ADD1))
    assert len(cache) == 1


def test_cache_dir_is_created_private(tmp_path, monkeypatch):
    monkeypatch.delenv("VTC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    d = cbuild.cache_dir()
    assert d.parent == tmp_path / "xdg" / "vtc"
    assert d.stat().st_mode & 0o777 == 0o700 and d.parent.stat().st_mode & 0o777 == 0o700
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cbuild.cache_dir().parent == tmp_path / "home" / ".cache" / "vtc"


def test_unsafe_library_files_are_refused(cache):
    src = ret("3", "perm")
    cbuild.build(src)
    so, _ = entry(src)
    cbuild._loaded.clear()
    so.chmod(0o666)  # a valid library that others could have rewritten
    with pytest.raises(PermissionError, match=r"file .*kernel-.*\.so .*mode 0666.*chmod 600"):
        cbuild.build(src)
    so.chmod(0o600)
    target = so.with_name("elsewhere.so")
    so.rename(target)
    so.symlink_to(target)  # a link planted in place of the library
    with pytest.raises(PermissionError, match="not a file"):
        cbuild.build(src)


def test_foreign_owner_is_refused(cache, monkeypatch):
    cbuild.cache_dir()
    monkeypatch.setattr(cbuild.os, "getuid", lambda: os.geteuid() + 4242)
    with pytest.raises(PermissionError, match=r"owner uid \d+.*must belong to uid"):
        cbuild.build(ret("1", "owner"))


def test_compile_error_reports_command_stderr_and_source(cache):
    src = 'extern "C" int broken() { return undefined_name + ; }\n'
    with pytest.raises(cbuild.KernelBuildError) as err:
        cbuild.build(src, name="broken")
    msg = str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert cbuild.compiler_info().path in msg and "-o" in msg  # the command
    assert "undefined_name" in msg and "error" in msg  # the compiler's stderr
    saved = Path(msg.split("source: ")[1].splitlines()[0])
    assert saved.read_text() == src
    assert not entry(src, "broken")[0].exists()
    assert not [p for p in cbuild.cache_dir().iterdir() if p.name.startswith(".tmp-")]


def test_compile_error_is_trimmed(cache):
    src = "".join(f'extern "C" int f{i}() {{ return nope{i}; }}\n' for i in range(200))
    with pytest.raises(cbuild.KernelBuildError, match=r"more lines\)$") as err:
        cbuild.build(src)
    assert len(str(err.value).splitlines()) <= cbuild.STDERR_LINES + 5


def test_build_many_in_parallel(cache, monkeypatch):
    active, peak, guard = [0], [0], threading.Lock()
    counting = cbuild._run_compiler

    def tracking(cmd):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)  # make the overlap visible even on a loaded machine
            return counting(cmd)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(cbuild, "_run_compiler", tracking)
    sources = [ret(str(i), "many") for i in range(4)]
    libs = cbuild.build_many(sources, jobs=4)
    assert [lib.ret() for lib in libs] == [0, 1, 2, 3]
    assert len(cache) == 4 and peak[0] >= 2
    assert cbuild.build_many(sources + sources[:1], jobs=2) == libs + libs[:1]
    assert len(cache) == 4 and cbuild.build_many([]) == []


def test_build_many_starts_the_longest_source_first(cache, monkeypatch):
    """On one job the sources build longest first (the longest is not left to build alone at the end on several);
    the libraries come back in the sources' order."""
    started = []
    run = cbuild._run_compiler

    def recording(cmd):
        started.extend(Path(c).read_text() for c in cmd if c.endswith(".cpp"))
        return run(cmd)

    monkeypatch.setattr(cbuild, "_run_compiler", recording)
    sources = [ret("1", "short"), ret("2", "the longest of the three"), ret("3", "middling one")]
    libs = cbuild.build_many(sources, jobs=1)
    assert [lib.ret() for lib in libs] == [1, 2, 3]
    assert started == [sources[1], sources[2], sources[0]]


def test_threads_building_one_kernel_compile_once(cache):
    src = ret("5", "threads")
    results: list = [None] * 6
    barrier = threading.Barrier(6)

    def worker(i):
        barrier.wait()
        results[i] = cbuild.build(src)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is results[0] for r in results) and results[0].ret() == 5
    assert len(cache) == 1


def test_processes_building_one_kernel_at_once(cache, tmp_path):
    src = ret("42", "processes") + "\n".join(f"static int pad{i}[{i + 1}];" for i in range(300))
    go = tmp_path / "go"
    procs = [start_child(tmp_path, src, go) for _ in range(2)]
    time.sleep(0.3)  # both children are waiting for the go-file
    go.touch()
    results = [child_result(p) for p in procs]
    assert [r["ret"] for r in results] == [42, 42]
    assert sum(r["compiles"] for r in results) == 1  # the second waited for the first one's build
    assert not [p for p in cbuild.cache_dir().iterdir() if p.name.startswith(".tmp-")]


def test_vectorized_loops():
    remarks = cbuild.vectorized_loops(ADD1)
    assert remarks and all("kernel.cpp:3:" in r for r in remarks), remarks
    recurrence = 'extern "C" void f(float* x, long n) { for (long i = 1; i < n; ++i) x[i] = x[i - 1] * 0.5f + x[i]; }'
    assert cbuild.vectorized_loops(recurrence) == []
    with pytest.raises(cbuild.KernelBuildError):
        cbuild.vectorized_loops("this is not C++")


def test_compiler_lookup_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match=r"\$CXX='/nonexistent/c\+\+'"):
        cbuild._find_compiler()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"g\+\+ nor clang\+\+"):
        cbuild._find_compiler()


@pytest.mark.parametrize("reject", ["-march=native", "-fopenmp"])
def test_flag_fallbacks(cache, tmp_path, monkeypatch, reject):
    real = cbuild.compiler_info()
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nfor a; do [ "$a" = "{reject}" ] && exit 1; done\nexec {real.path} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    base_key = cbuild._key(ADD1, ())
    info = cbuild._probe_compiler()
    assert reject not in info.flags and info.version == real.version
    if reject == "-fopenmp":
        assert not info.openmp and "-fopenmp-simd" in info.flags and info.native == real.native
    else:
        assert info.openmp and not info.native
    monkeypatch.setattr(cbuild, "_info", info)
    assert cbuild._key(ADD1, ()) != base_key  # the flag set in force is part of the key
    call_add1(cbuild.build(ADD1))  # `#pragma omp parallel` is ignored without -fopenmp; simd still applies
    assert reject not in cache[-1]


def test_one_openmp_runtime_with_torch(cache):
    src = textwrap.dedent("""\
        #include <omp.h>
        extern "C" int team(int nthreads) {
          int t = 0;
          #pragma omp parallel num_threads(nthreads)
          {
            #pragma omp single
            t = omp_get_num_threads();
          }
          return t;
        }
        """)
    lib = cbuild.build(src)
    assert torch.ones(4).sum().item() == 4  # torch's OpenMP runtime is loaded
    gomps = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(gomps) == 1, f"two OpenMP runtimes in one process: {gomps}"
    lib.team.argtypes = [ctypes.c_int]
    assert lib.team(1) == 1


def test_openmp_5_api_load_failure_is_explained(cache):
    # torch's bundled libgomp (OpenMP 5.0) is the process's runtime; newer API needs a newer one.
    src = '#include <omp.h>\nextern "C" int ok() { void* p = omp_aligned_alloc(64, 64, omp_default_mem_alloc);'
    src += ' omp_free(p, omp_default_mem_alloc); return p != 0; }\n'
    assert torch.ones(1).sum().item() == 1
    try:
        lib = cbuild.build(src)
    except cbuild.KernelBuildError as e:
        assert "OMP_5" in str(e) and "hint: the process's libgomp" in str(e)
    else:  # the runtime in this process is new enough
        assert lib.ok() == 1


def test_a_new_process_loads_cached_entries_without_probing(cache, monkeypatch):
    src = ret("21", "lazy-probe")
    assert cbuild.build(src).ret() == 21
    monkeypatch.setattr(cbuild, "_info", None)  # as a fresh process: nothing probed, nothing loaded
    monkeypatch.setattr(cbuild, "_preferred", None)
    monkeypatch.setattr(cbuild, "_loaded", {})
    cache.clear()
    assert cbuild.build(src).ret() == 21
    assert cbuild._info is None  # the probe did not run
    assert not [c for c in cache if "-o" in c], cache  # nothing was built: only --version and the macros
    other = ret("22", "lazy-probe")  # a miss probes the compiler, then builds
    assert cbuild.build(other).ret() == 22
    assert cbuild._info is not None and cbuild._info == cbuild._preferred
    assert any("probe.cpp" in " ".join(c) for c in cache) and any("-o" in c and "probe.cpp" not in " ".join(c)
                                                                     for c in cache)


@pytest.mark.parametrize("reject", ["-march=native", "-fopenmp"])
def test_entries_of_the_preferred_flags_are_not_loaded_when_the_compiler_rejects_them(cache, tmp_path, monkeypatch,
                                                                                        reject):
    real = cbuild.compiler_info().path
    wrapper = tmp_path / "cxx"
    monkeypatch.setenv("CXX", str(wrapper))

    def fresh_process(script: str) -> None:
        wrapper.write_text(script)
        wrapper.chmod(0o755)
        monkeypatch.setattr(cbuild, "_info", None)
        monkeypatch.setattr(cbuild, "_preferred", None)
        monkeypatch.setattr(cbuild, "_loaded", {})
        cache.clear()

    src = ret("23", "lazy-fallback")
    fresh_process(f'#!/bin/sh\nexec {real} "$@"\n')
    assert cbuild.build(src).ret() == 23  # an entry built by this compiler command with the preferred flags
    assert reject in cache[-1]
    fresh_process(f'#!/bin/sh\nfor a; do [ "$a" = "{reject}" ] && exit 1; done\nexec {real} "$@"\n')
    assert cbuild.build(src).ret() == 23
    assert cbuild._info is not None and reject not in cbuild._info.flags  # probed, and built with the fallback
    assert reject not in cache[-1] and "-o" in cache[-1]
