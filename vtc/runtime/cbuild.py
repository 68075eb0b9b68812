"""Builds C++ kernel sources into shared libraries, caches them on disk, loads them.

How it works:

- ``compiler_info()`` finds the compiler (``$CXX``, else ``g++``, else
  ``clang++``) and probes once per process which flag set works: the preferred
  one, without ``-march=native`` if that fails, without OpenMP if that fails
  (``-fopenmp-simd`` keeps ``#pragma omp simd`` working; other ``#pragma omp``
  lines are then ignored).
- The cache key is a sha256 of the source, the compiler path and version, the
  host's ``-march=native`` target (its predefined macros), the flags and
  ``CACHE_FORMAT``.  Until a build is needed the probe does not run: a process
  first looks up the entry keyed by the preferred flag set (``--version`` and
  the macros name it in tens of milliseconds, the probe's build takes a few
  hundred), which exists only if an earlier probe picked those flags with the
  same compiler and target; a miss probes, then looks up or builds.  An entry is ``<name>-<key16>.so``, a ``.sha256`` sidecar
  holding the hash of the ``.so`` and the ``.cpp`` it was built from.
- Only verified files are loaded: the directory and the file must belong to
  the current user and not be group/other-writable (else ``PermissionError``),
  and the ``.so`` must match its sidecar (else both are deleted and rebuilt).
- Builds write to ``mkstemp`` files in the cache directory and ``os.replace``
  them into place, under a per-key lock: a ``threading.Lock`` within the
  process and an ``flock`` on ``<entry>.lock`` across processes, so a second
  builder waits and then loads the first one's library instead of compiling.
- Loaded libraries are kept in a dict by key; a repeated ``build`` is a lookup.

Nothing here imports torch.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

CACHE_FORMAT = 1  # bump when the entry layout or the key changes
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c++17")
NUMERIC_FLAGS = ("-ffp-contract=off",  # no FMA contraction: elementwise results match torch bit for bit
                 "-fno-math-errno")  # sqrt, log, ... need not set errno, so loops calling them vectorise
NATIVE_FLAGS = ("-march=native",)
OPENMP_FLAGS = ("-fopenmp",)
OPENMP_SIMD_FLAGS = ("-fopenmp-simd",)  # fallback when the OpenMP runtime is missing
COMPILE_TIMEOUT_S = 600
STDERR_LINES = 60

_PROBE_SOURCE = """#include <omp.h>
extern "C" int vtc_probe(float* x, long n) {
  #pragma omp parallel for simd
  for (long i = 0; i < n; ++i) x[i] += 1.0f;
  return omp_get_max_threads();
}
"""
_PROBE_SOURCE_NO_OMP = 'extern "C" int vtc_probe() { return 0; }\n'


class KernelBuildError(RuntimeError):
    """The compiler rejected a kernel source, or its library could not be loaded."""


@dataclass(frozen=True)
class CompilerInfo:
    """The compiler and the flag set this process builds with."""

    path: str  # resolved compiler executable
    version: str  # first line of `--version`
    flags: tuple[str, ...]  # flags every build uses (callers' flags come after)
    native: bool  # -march=native in use
    openmp: bool  # -fopenmp in use (else #pragma omp other than simd is ignored)
    target: str  # digest of the predefined macros under these flags (the CPU features)
    command: tuple[str, ...] = ()  # argv prefix: $CXX may carry arguments ("ccache g++")

    @property
    def is_clang(self) -> bool:
        """Whether the compiler is clang (its remarks and options differ from gcc's)."""
        return "clang" in self.version.lower()


_env = {**os.environ, "LC_ALL": "C"}  # compiler messages in English, whatever the locale
_loaded: dict[str, ctypes.CDLL] = {}
_key_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_info_lock = threading.Lock()
_info: CompilerInfo | None = None
_preferred: CompilerInfo | bool | None = None  # _preferred_info(): None until looked up, False when unavailable
compile_count = 0  # compiler runs that built a library in this process (tests assert a cache hit by it)


def _run_compiler(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    """Runs one compiler command (the single place that spawns the compiler)."""
    return subprocess.run(list(cmd), capture_output=True, text=True, env=_env, timeout=COMPILE_TIMEOUT_S)


def _find_compiler() -> list[str]:
    """Returns the compiler argv prefix: $CXX if set, else g++, else clang++."""
    if os.environ.get("CXX"):
        argv = shlex.split(os.environ["CXX"])
        exe = shutil.which(argv[0]) if argv else None
        if not exe:
            raise RuntimeError(f"no C++ compiler: $CXX={os.environ['CXX']!r} is not an executable")
        return [exe, *argv[1:]]
    for name in ("g++", "clang++"):
        if exe := shutil.which(name):
            return [exe]
    raise RuntimeError("no C++ compiler: $CXX is not set and neither g++ nor clang++ is on PATH")


def _probe(cxx: list[str], flags: tuple[str, ...], source: str) -> bool:
    """Whether a tiny library builds with these flags."""
    with tempfile.TemporaryDirectory(prefix="vtc-probe-") as tmp:
        Path(tmp, "probe.cpp").write_text(source)
        cmd = [*cxx, str(Path(tmp, "probe.cpp")), "-o", str(Path(tmp, "probe.so")), *flags]
        try:
            return _run_compiler(cmd).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def compiler_info() -> CompilerInfo:
    """The compiler and the working flag set, probed once per process."""
    global _info
    if _info is None:
        with _info_lock:
            if _info is None:
                _info = _probe_compiler()
    return _info


def _version(cxx: list[str]) -> str:
    """The first line of the compiler's --version."""
    try:
        return _run_compiler([*cxx, "--version"]).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"C++ compiler {shlex.join(cxx)!r} does not answer --version: {e}") from None


def _flag_sets() -> list[tuple[tuple[str, ...], bool, bool]]:
    """(flags, native, openmp) in order of preference."""
    return [((*BASE_FLAGS, *(NATIVE_FLAGS if native else ()), *omp, *NUMERIC_FLAGS), native, omp == OPENMP_FLAGS)
            for native in (True, False) for omp in (OPENMP_FLAGS, OPENMP_SIMD_FLAGS, ())]


def _info_for(cxx: list[str], version: str, flags: tuple[str, ...], native: bool, openmp: bool) -> CompilerInfo | None:
    """The CompilerInfo of a flag set: its target is the digest of the predefined macros under it (None when
    the preprocessor rejects the flags)."""
    try:
        proc = _run_compiler([*cxx, *flags, "-E", "-dM", "-x", "c++", os.devnull])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    target = hashlib.sha256("\n".join(sorted(proc.stdout.splitlines())).encode()).hexdigest()
    return CompilerInfo(cxx[0], version, flags, native, openmp, target, tuple(cxx))


def _probe_compiler() -> CompilerInfo:
    """Finds the compiler and the first flag set that builds a library."""
    cxx = _find_compiler()
    version = _version(cxx)
    tried = []
    for flags, native, openmp in _flag_sets():
        tried.append(shlex.join(flags))
        if _probe(cxx, flags, _PROBE_SOURCE if openmp else _PROBE_SOURCE_NO_OMP):
            info = _info_for(cxx, version, flags, native, openmp)
            if info is not None:
                return info
    raise RuntimeError(f"C++ compiler {shlex.join(cxx)} ({version}) cannot build a shared library; "
                       f"tried flag sets: {tried}")


def _preferred_info() -> CompilerInfo | None:
    """The compiler with the preferred flag set, as ``compiler_info()`` describes it when the probe picks that
    set, found without building anything (``--version`` and the predefined macros: tens of milliseconds
    instead of the probe's build); None when it cannot be described, or once the probe has run.

    A cache entry under this info's key was built with exactly that compiler, version, target and flag set
    (only the probe's pick ever builds), so ``build`` loads such an entry without probing; on a miss it probes.
    """
    global _preferred
    if _info is not None:
        return None
    if _preferred is None:
        with _info_lock:
            if _preferred is None:
                try:
                    cxx = _find_compiler()
                    _preferred = _info_for(cxx, _version(cxx), *_flag_sets()[0]) or False
                except RuntimeError:
                    _preferred = False
    return _preferred or None


def _check_private(path: Path, *, is_dir: bool) -> None:
    """Raises PermissionError unless path is ours and not writable by group or others."""
    st = os.stat(path) if is_dir else os.lstat(path)
    kind = "directory" if is_dir else "file"
    if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        raise PermissionError(f"vtc kernel cache: {path} is not a {kind} (a link?); refusing to load from it")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"vtc kernel cache: refusing to load code from {kind} {path} (owner uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):04o}); it must belong to uid {os.getuid()} and not be writable "
            f"by group or others. Fix: `chmod {'700' if is_dir else '600'} {path}` if it is yours, "
            f"or set VTC_CACHE_DIR to a private directory.")


def cache_dir() -> Path:
    """The kernel cache directory (created 0700; checked to be private)."""
    if os.environ.get("VTC_CACHE_DIR"):
        root = Path(os.environ["VTC_CACHE_DIR"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vtc"
    path = root / f"cbuild-v{CACHE_FORMAT}"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)  # parents above root get the umask's mode
    path.mkdir(mode=0o700, exist_ok=True)
    _check_private(root, is_dir=True)
    _check_private(path, is_dir=True)
    return path


def _key(source: str, flags: Sequence[str], info: CompilerInfo | None = None) -> str:
    """The cache key of a source under the process's compiler (or `info`) and these extra flags."""
    info = info or compiler_info()
    blob = json.dumps([CACHE_FORMAT, source, info.command, info.version, info.target, info.flags, list(flags)])
    return hashlib.sha256(blob.encode()).hexdigest()


def _stem(name: str, key: str) -> Path:
    """The path, without suffix, of a cache entry."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError(f"kernel name {name!r}: use 1-64 letters, digits, '_' or '-'")
    return cache_dir() / f"{name}-{key[:16]}"


def _sha256(path: Path) -> str:
    """The sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Writes data to path through a temporary file and os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _verified(so: Path, sidecar: Path) -> bool:
    """Whether so exists and matches its sidecar; deletes a mismatching pair."""
    if not so.exists() and not so.is_symlink():
        return False
    _check_private(so, is_dir=False)
    try:
        if sidecar.read_text().strip() == _sha256(so):
            return True
    except FileNotFoundError:
        pass
    so.unlink(missing_ok=True)
    sidecar.unlink(missing_ok=True)
    return False


def _compile(source: str, stem: Path, flags: Sequence[str], info: CompilerInfo) -> None:
    """Compiles source with `info`'s compiler into stem.so (atomically) and writes the stem.sha256 sidecar."""
    global compile_count
    src, so = stem.with_suffix(".cpp"), stem.with_suffix(".so")
    with _locks_guard:
        compile_count += 1
    src.write_text(source)  # kept next to the library: the copy to read when debugging
    fd, tmp = tempfile.mkstemp(dir=stem.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        cmd = [*info.command, str(src), "-o", tmp, *info.flags, *flags]
        try:
            proc = _run_compiler(cmd)
        except subprocess.TimeoutExpired:
            raise KernelBuildError(f"compiler timed out after {COMPILE_TIMEOUT_S} s\n"
                                   f"command: {shlex.join(cmd)}\nsource: {src}") from None
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).splitlines()
            more = f"\n... ({len(lines) - STDERR_LINES} more lines)" if len(lines) > STDERR_LINES else ""
            raise KernelBuildError(f"kernel {stem.name} failed to compile (exit {proc.returncode})\n"
                                   f"command: {shlex.join(cmd)}\nsource: {src}\n"
                                   + "\n".join(lines[:STDERR_LINES]) + more)
        os.chmod(tmp, 0o600)  # the linker creates it with the umask's mode
        digest = _sha256(Path(tmp))
        os.replace(tmp, so)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _write_atomic(stem.with_suffix(".sha256"), (digest + "\n").encode())


def _load(so: Path) -> ctypes.CDLL:
    """dlopens a verified library, explaining the usual OpenMP-runtime mismatch."""
    try:
        return ctypes.CDLL(str(so))
    except OSError as e:
        hint = ""
        if "OMP_" in str(e):
            hint = ("\nhint: the process's libgomp (torch bundles one from an older GCC) lacks an OpenMP API "
                    "this kernel uses; keep kernels to OpenMP 4.5/5.0 (no omp_alloc, omp scope, teams).")
        raise KernelBuildError(f"cannot load {so}: {e}{hint}") from None


def _key_lock(key: str) -> threading.Lock:
    """The in-process lock for one key."""
    with _locks_guard:
        return _key_locks.setdefault(key, threading.Lock())


def build(source: str, *, name: str = "kernel", flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compiles (or fetches from the cache) a C++ translation unit and loads it.

    Before the compiler has been probed in this process, an entry built with the preferred flag set is
    looked up first (``_preferred_info``); anything else probes and then looks up or builds."""
    flags = tuple(flags)
    preferred = _preferred_info()
    if preferred is not None:
        try:
            lib = _cached_or_built(source, name, flags, preferred, compile=False)
        except KernelBuildError:
            lib = None  # a library that no longer loads (its OpenMP runtime gone?): the probe decides
        if lib is not None:
            return lib
    return _cached_or_built(source, name, flags, compiler_info(), compile=True)


def _cached_or_built(source: str, name: str, flags: tuple[str, ...], info: CompilerInfo,
                     compile: bool) -> ctypes.CDLL | None:
    """The loaded library of `source` built by `info`'s compiler and flags: from this process, the disk
    cache, or (when `compile`) the compiler; None on a miss without `compile`."""
    key = _key(source, flags, info)
    if (lib := _loaded.get(key)) is not None:
        return lib
    stem = _stem(name, key)
    so, sidecar = stem.with_suffix(".so"), stem.with_suffix(".sha256")
    if not compile and not so.exists():
        return None
    with _key_lock(key):
        if (lib := _loaded.get(key)) is not None:
            return lib
        with open(stem.with_suffix(".lock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
            if not _verified(so, sidecar):
                if not compile:
                    return None
                _compile(source, stem, flags, info)
                _check_private(so, is_dir=False)
            lib = _loaded[key] = _load(so)
    return lib


def build_jobs() -> int:
    """How many compiler processes run at once: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def build_many(sources: Sequence[str], *, name: str = "kernel", flags: Sequence[str] = (),
               jobs: int | None = None) -> list[ctypes.CDLL]:
    """Builds independent sources in parallel (one compiler process per thread, `build_jobs()` at most), the
    longest started first (so that the longest is not left to build alone at the end); libraries in the
    order of `sources`."""
    if not sources:
        return []
    if _preferred_info() is None:
        compiler_info()  # probe once, before the threads start
    jobs = max(1, min(jobs or build_jobs(), len(sources)))
    longest_first = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="vtc-cbuild") as pool:
        built = dict(zip(longest_first, pool.map(lambda i: build(sources[i], name=name, flags=flags), longest_first)))
    return [built[i] for i in range(len(sources))]


def vectorized_loops(source: str, flags: Sequence[str] = ()) -> list[str]:
    """The compiler's "loop vectorized" remarks (file:line: text) for a source."""
    info = compiler_info()
    report = ["-Rpass=loop-vectorize"] if info.is_clang else ["-fopt-info-vec-optimized"]
    with tempfile.TemporaryDirectory(prefix="vtc-vec-") as tmp:
        src = Path(tmp, "kernel.cpp")
        src.write_text(source)
        cmd = [*info.command, str(src), "-c", "-o", str(Path(tmp, "kernel.o")), *info.flags, *flags, *report]
        proc = _run_compiler(cmd)
        if proc.returncode != 0:
            lines = proc.stderr.splitlines()[:STDERR_LINES]
            raise KernelBuildError(f"vectorisation report failed to compile\ncommand: {shlex.join(cmd)}\n"
                                   + "\n".join(lines))
    wanted = "vectorized loop" if info.is_clang else "loop vectorized"
    return [line.replace(tmp + os.sep, "") for line in proc.stderr.splitlines() if wanted in line]
