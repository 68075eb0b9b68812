"""One layer norm kernel alone, vtc's plain row kernel (row_blocks.BLOCKS off) against the blocks of rows (on), hot
and cold, 1 thread, thread CPU time, in one C++ process.

    PYTHONPATH=$PWD python bench/norm_kernel_ab.py 3136x96 784x192 196x384

Each shape's kernel is generated both ways (an nn.LayerNorm over [1, rows, C]), built with the kernels' own compiler
flags into one program with a timing main: "hot" times blocks of calls on one input (it stays in cache, as in a
module timed alone); "cold" times single calls, each after a 48 MB sweep, on 16 inputs in turn (the input and the
output come from memory, as a layer norm reads a GEMM's output that left the cache).  The two kernels alternate
within each round; min / median of the rounds.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import vtc
from vtc.codegen import row_blocks
from vtc.codegen.cpp import generate
from vtc.runtime import cbuild

MAIN = r"""
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
extern "C" void kern_0(void* const* bufs, int nthreads);
extern "C" void kern_1(void* const* bufs, int nthreads);
static double tcpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const long rows = atol(argv[1]), C = atol(argv[2]), n = rows * C, NB = 16, big = 12L << 20;
  std::vector<float*> xs(NB);
  for (auto& p : xs) { p = (float*)aligned_alloc(64, n * 4); for (long i = 0; i < n; ++i) p[i] = 100 + 0.1f * (rand() / (float)RAND_MAX); }
  float* y = (float*)aligned_alloc(64, n * 4); float* w = (float*)aligned_alloc(64, C * 4); float* b = (float*)aligned_alloc(64, C * 4);
  for (long i = 0; i < C; ++i) { w[i] = 1; b[i] = 0; }
  float* junk = (float*)aligned_alloc(64, big * 4); memset(junk, 0, big * 4);
  void (*f[2])(void* const*, int) = {kern_0, kern_1};
  const char* names[2] = {"plain ", "blocks"};
  std::vector<double> hot[2], cold[2]; volatile float sink = 0;
  const int reps = std::max<long>(1, 4000000 / n);
  for (int round = 0; round < 31; ++round) for (int v = 0; v < 2; ++v) {
    void* bufs[4] = {b, w, xs[0], y};
    f[v](bufs, 1); double t0 = tcpu();
    for (int i = 0; i < reps; ++i) f[v](bufs, 1);
    hot[v].push_back((tcpu() - t0) / reps * 1e6);
    float s = 0; for (long i = 0; i < big; i += 16) s += junk[i]; sink = s;
    void* cbufs[4] = {b, w, xs[1 + round % (NB - 1)], y};
    t0 = tcpu(); f[v](cbufs, 1); cold[v].push_back((tcpu() - t0) * 1e6);
  }
  for (int v = 0; v < 2; ++v) {
    std::sort(hot[v].begin(), hot[v].end()); std::sort(cold[v].begin(), cold[v].end());
    printf("[%ld, %ld] %s  hot %7.2f / %7.2f us   cold %7.2f / %7.2f us\n", rows, C, names[v], hot[v][0],
           hot[v][hot[v].size() / 2], cold[v][0], cold[v][cold[v].size() / 2]);
  }
}
"""


def kernel_source(rows: int, c: int, blocks: bool) -> str:
    row_blocks.BLOCKS = blocks
    try:
        x = torch.randn(1, rows, c)
        compiled = vtc.compile(torch.nn.LayerNorm(c).eval(), (x,))
        (k,) = [s.kernel.step.kernel for s in compiled._first.executor.steps if s.kind == "kernel"]
        return generate(k).replace(f"void {k.name}(", f"void kern_{int(blocks)}(")  # generated under the switch
    finally:
        row_blocks.BLOCKS = False


def main(shapes: list[str]) -> None:
    info = cbuild.compiler_info()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            rows, c = map(int, shape.split("x"))
            libs = []
            for blocks in (False, True):
                src, so = Path(tmp, f"k{int(blocks)}.cpp"), Path(tmp, f"libk{int(blocks)}.so")
                src.write_text(kernel_source(rows, c, blocks))
                subprocess.run([*info.command, str(src), "-o", str(so), *info.flags], check=True)
                libs.append(str(so))
            Path(tmp, "main.cpp").write_text(MAIN)
            exe = Path(tmp, "main")
            subprocess.run([*info.command, str(Path(tmp, "main.cpp")), *libs, "-o", str(exe), "-O2", "-fopenmp",
                            f"-Wl,-rpath,{tmp}"], check=True)
            print(subprocess.run([str(exe), str(rows), str(c)], check=True, capture_output=True, text=True).stdout,
                  end="", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["3136x96", "784x192", "196x384", "49x768", "784x384", "196x768"])
