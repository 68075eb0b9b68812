// Transpose -> add register-form variants for 2 threads (docs/chains.md, "Session 15"): out[i, j] = x[j, i] + y[i, j].
// Build and run (WALL=1: wall time, for 2 threads; otherwise the calling thread's CPU time):
//   python -c "from vtc.codegen.tiles import PRELUDE; open(\"/tmp/tr.h\",\"w\").write(\"#include <cstdint>\\n#include <algorithm>\\n\"+PRELUDE)"
//   g++ -O3 -march=native -fopenmp -std=c++17 -I/tmp bench/tiles_2t_variants.cpp -o /tmp/t2v && WALL=1 /tmp/t2v 1448 2 20 [names]
// Variants: g<RB>x<CB>c<COLS>[o<ORDER>][s<SCHED>][p<PF>]: bands of 16*RB rows, groups of 16*CB columns per step, tiles
// of COLS columns; ORDER 1 walks the tiles column-major (each thread a column half); SCHED 1 interleaves the tiles
// between the threads (schedule(static, 1)); PF prefetches the next group's transposed lines.
// Session 19: two<COLS> (each tile's x panel transposed into a buffer, then rows of buffer + y), py<D> / pyw<D> (y's /
// y's and the output's lines prefetched D blocks ahead), b2 (each block's loads before its stores), g1r / b2r (blocks
// walked right to left), yo (the walk of y and the output alone).  OFFX / OFFY / OFFO=k: that array starts k floats
// past a 2 MB boundary (the arrays' placement mod 4 KB: the store -> load 4 KB aliasing of docs/chains.md, session 19).
// Session 27: px<D> / pxy<D> / pyo<D> (x's lines / x's, y's and the output's / y's and the output's, D blocks ahead, into L2);
// h2c<COLS> (16-row bands walked as two 8-row halves, each block transposed twice).
#include "tr.h"
#include <chrono>
#include <time.h>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>
#include <omp.h>
#include <sys/mman.h>
// 2 MB aligned buffers; HUGE=1: madvise(MADV_HUGEPAGE) (transparent huge pages in madvise mode)
template <class T> struct HA { typedef T value_type; HA() = default; template <class U> HA(const HA<U>&) {}
  T* allocate(size_t n) { size_t b = (n * sizeof(T) + (2 << 20) - 1) & ~size_t((2 << 20) - 1); void* p = aligned_alloc(2 << 20, b);
    if (getenv("HUGE")) madvise(p, b, MADV_HUGEPAGE); return (T*)p; }
  void deallocate(T* p, size_t) { free(p); } };
template <class T, class U> bool operator==(const HA<T>&, const HA<U>&) { return true; }
template <class T, class U> bool operator!=(const HA<T>&, const HA<U>&) { return false; }
static double now_us() { timespec ts; clock_gettime(getenv("WALL") ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3; }
typedef void (*K)(const float*, const float*, float*, int64_t, int);

static void k_add(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t i = 0; i < n; ++i) {
    #pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[i * n + j] = x[i * n + j] + y[i * n + j];
  }
}

static inline __attribute__((always_inline)) void block(const float* __restrict x, const float* __restrict y,
                                                        float* __restrict o, int64_t n, int64_t r0, int64_t c0) {
  vtc_v16 v[16];
  vtc_tile_transpose16_regs(v, x + (r0 + n * c0), n);
  const float* yp = y + n * r0 + c0;
  float* op = o + n * r0 + c0;
  #pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    vtc_v16 w; __builtin_memcpy(&w, yp + n * i, 64);
    w += v[i]; __builtin_memcpy(op + n * i, &w, 64);
  }
}

template <int RB, int CB, int COLS, int ORDER = 0, int SCHED = 0, int PF = 0>
static void k_g(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  constexpr int TR = 16 * RB, G = 16 * CB;
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  auto tile = [&](int64_t t) {
    const int64_t ia = ORDER ? t % ta : t / tb, ib = ORDER ? t / ta : t % tb;
    const int64_t ta0 = ia * TR, tb0 = ib * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbg = tb0 + (tb1 - tb0) / G * G;
    const int64_t tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + TR <= n) {
      for (int64_t q = tb0; q < tbg; q += G) {
        if (PF == 1 && q + G < tbg)
          for (int k = 0; k < G; ++k) for (int rb = 0; rb < RB; ++rb) __builtin_prefetch(x + ta0 + 16 * rb + n * (q + G + k));
        if (PF >= 2 && ta0 + TR * (PF - 1) + 16 <= n)  // the lines of the band PF - 1 bands on, into L2
          for (int k = 0; k < G; ++k) __builtin_prefetch(x + ta0 + TR * (PF - 1) + n * (q + k), 0, 2);
        for (int cb = 0; cb < CB; ++cb)
          for (int rb = 0; rb < RB; ++rb) block(x, y, o, n, ta0 + 16 * rb, q + 16 * cb);
      }
      for (int64_t q = tbg; q < tbf; q += 16)
        for (int rb = 0; rb < RB; ++rb) block(x, y, o, n, ta0 + 16 * rb, q);
      for (int64_t i = ta0; i < ta0 + TR; ++i)
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + TR, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  };
  if (SCHED) {
    #pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int64_t t = 0; t < ta * tb; ++t) tile(t);
  } else {
    #pragma omp parallel for num_threads(nt)
    for (int64_t t = 0; t < ta * tb; ++t) tile(t);
  }
}

// the same walk with x read contiguously (no transpose): the cost of the 16-row walk alone
static void k_order(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta; ++t)
    for (int64_t q = 0; q + 16 <= n; q += 16)
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        vtc_v16 w, v; __builtin_memcpy(&w, y + n * (t * 16 + i) + q, 64); __builtin_memcpy(&v, x + n * (t * 16 + i) + q, 64);
        w += v; __builtin_memcpy(o + n * (t * 16 + i) + q, &w, 64);
      }
}
// out = x^T alone (register transposes, no y)
static void k_tonly(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta; ++t)
    for (int64_t q = 0; q + 16 <= n; q += 16) {
      vtc_v16 v[16];
      vtc_tile_transpose16_regs(v, x + (t * 16 + n * q), n);
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) __builtin_memcpy(o + n * (t * 16 + i) + q, &v[i], 64);
    }
}
// bands of 8 rows: per block 16 half-lines of x (8 floats) transposed into 8 vectors of 16 (the 8 x 16 transpose)
typedef float vtc_v8 __attribute__((vector_size(32)));
static void k_r8(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 8;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta; ++t)
    for (int64_t q = 0; q + 16 <= n; q += 16) {
      vtc_v16 r[8];
      const float* src = x + t * 8 + n * q;
      for (int i = 0; i < 8; ++i) { vtc_v8 a, b; __builtin_memcpy(&a, src + n * (2 * i), 32); __builtin_memcpy(&b, src + n * (2 * i + 1), 32);
        r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
      for (int i = 0; i < 8; ++i) if (!(i & 1)) { const vtc_v16 a = r[i], b = r[i + 1];
        r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        r[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
      for (int i = 0; i < 8; ++i) if (!(i & 2)) { const vtc_v16 a = r[i], b = r[i + 2];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        r[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
      for (int i = 0; i < 8; ++i) if (!(i & 4)) { const vtc_v16 a = r[i], b = r[i + 4];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        r[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31); }
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const vtc_v16 v = __builtin_shufflevector(r[i], r[i], 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        vtc_v16 w; __builtin_memcpy(&w, y + n * (t * 8 + i) + q, 64);
        w += v; __builtin_memcpy(o + n * (t * 8 + i) + q, &w, 64);
      }
    }
  for (int64_t i = 0; i < n; ++i) for (int64_t j = n / 16 * 16; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// two passes per band of 16 rows and COLS columns: the x panel transposed into a buffer (16 x COLS), then rows of buf + y
template <int COLS>
static void k_two(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel num_threads(nt)
  {
    constexpr int W = COLS + 16;
    alignas(64) static thread_local float buf[16 * W];
    #pragma omp for
    for (int64_t t = 0; t < ta * tb; ++t) {
      const int64_t i0 = t / tb * 16, c0 = t % tb * COLS, c1 = std::min<int64_t>(c0 + COLS, n), cf = c0 + (c1 - c0) / 16 * 16;
      for (int64_t q = c0; q < cf; q += 16) {
        vtc_v16 v[16];
        vtc_tile_transpose16_regs(v, x + (i0 + n * q), n);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) __builtin_memcpy(buf + W * i + (q - c0), &v[i], 64);
      }
      for (int i = 0; i < 16; ++i) {
        const float* yr = y + n * (i0 + i); float* orow = o + n * (i0 + i); const float* br = buf + W * i - c0;
        #pragma omp simd
        for (int64_t j = c0; j < cf; ++j) orow[j] = br[j] + yr[j];
        for (int64_t j = cf; j < c1; ++j) orow[j] = x[(i0 + i) + n * j] + yr[j];
      }
    }
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) for (int64_t j = 0; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// the band walk with software prefetch of y's lines D blocks (of 16 columns) ahead; WO: the output's too (for writing)
template <int D, int WO>
static void k_py(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta; ++t) {
    const int64_t i0 = t * 16, qe = n / 16 * 16;
    for (int64_t q = 0; q < qe; q += 16) {
      if (q + 16 * D < n) {
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          __builtin_prefetch(y + n * (i0 + i) + q + 16 * D, 0, 3);
          if (WO) __builtin_prefetch(o + n * (i0 + i) + q + 16 * D, 1, 3);
        }
      }
      block(x, y, o, n, i0, q);
    }
    for (int64_t i = i0; i < i0 + 16; ++i) for (int64_t j = qe; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) for (int64_t j = 0; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// the register block with every row's loads before any store (no load behind a store to the same address mod 4 KB)
static inline __attribute__((always_inline)) void block2(const float* __restrict x, const float* __restrict y,
                                                        float* __restrict o, int64_t n, int64_t r0, int64_t c0) {
  vtc_v16 v[16];
  vtc_tile_transpose16_regs(v, x + (r0 + n * c0), n);
  const float* yp = y + n * r0 + c0;
  float* op = o + n * r0 + c0;
  vtc_v16 s[16];
  #pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) { vtc_v16 w; __builtin_memcpy(&w, yp + n * i, 64); s[i] = w + v[i]; }
  #pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) __builtin_memcpy(op + n * i, &s[i], 64);
}
static void k_b2(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16, tb = (n + 255) / 256;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t i0 = t / tb * 16, c0 = t % tb * 256, c1 = std::min<int64_t>(c0 + 256, n), cf = c0 + (c1 - c0) / 16 * 16;
    for (int64_t q = c0; q < cf; q += 16) block2(x, y, o, n, i0, q);
    for (int64_t i = i0; i < i0 + 16; ++i) for (int64_t j = cf; j < c1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) for (int64_t j = 0; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// the tiles' blocks walked right to left (REV: loads first, block2)
template <int REV>
static void k_b2d(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16, tb = (n + 255) / 256;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t i0 = t / tb * 16, c0 = t % tb * 256, c1 = std::min<int64_t>(c0 + 256, n), cf = c0 + (c1 - c0) / 16 * 16;
    if (REV) { for (int64_t q = cf - 16; q >= c0; q -= 16) block2(x, y, o, n, i0, q); }
    else { for (int64_t q = cf - 16; q >= c0; q -= 16) block(x, y, o, n, i0, q); }
    for (int64_t i = i0; i < i0 + 16; ++i) for (int64_t j = cf; j < c1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) for (int64_t j = 0; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// session 27: the band walk of vtc's form (tiles of 256 columns) with prefetcht1 (into L2) of the next blocks' lines, D
// blocks (of 16 columns) ahead: x's 16 transposed lines (WHAT 0), x's, y's and the output's (1), y's and the output's (2)
template <int D, int WHAT>
static void k_pl2(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16, tb = (n + 255) / 256;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t i0 = t / tb * 16, c0 = t % tb * 256, c1 = std::min<int64_t>(c0 + 256, n), cf = c0 + (c1 - c0) / 16 * 16;
    for (int64_t q = c0; q < cf; q += 16) {
      const int64_t qa = q + 16 * D;
      if (qa + 16 <= n) {
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          if (WHAT < 2) __builtin_prefetch(x + i0 + n * (qa + i), 0, 2);
          if (WHAT > 0) { __builtin_prefetch(y + n * (i0 + i) + qa, 0, 2); __builtin_prefetch(o + n * (i0 + i) + qa, 1, 2); }
        }
      }
      block(x, y, o, n, i0, q);
    }
    for (int64_t i = i0; i < i0 + 16; ++i) for (int64_t j = cf; j < c1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) for (int64_t j = 0; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// session 27: 16-row bands walked as two 8-row halves: per tile of COLS columns, rows 0-7 over every block (the 16 x 16
// transpose, half of it used), then rows 8-15 (the same transposes again, x's lines from L1 / L2): y and the output
// walked 8 rows at a time, as r8, with whole lines of x
template <int COLS>
static void k_h2(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = n / 16, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t i0 = t / tb * 16, c0 = t % tb * COLS, c1 = std::min<int64_t>(c0 + COLS, n), cf = c0 + (c1 - c0) / 16 * 16;
    for (int h = 0; h < 16; h += 8)
      for (int64_t q = c0; q < cf; q += 16) {
        vtc_v16 v[16];
        vtc_tile_transpose16_regs(v, x + (i0 + n * q), n);
        const float* yp = y + n * i0 + q;
        float* op = o + n * i0 + q;
        #pragma GCC unroll 8
        for (int i = h; i < h + 8; ++i) {
          vtc_v16 w; __builtin_memcpy(&w, yp + n * i, 64);
          w += v[i]; __builtin_memcpy(op + n * i, &w, 64);
        }
      }
    for (int64_t i = i0; i < i0 + 16; ++i) for (int64_t j = cf; j < c1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) for (int64_t j = 0; j < n; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
}

// a piece of the band walk: yo = y + 1 stored (no x)
static void k_yo(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < n / 16; ++t)
    for (int64_t q = 0; q + 16 <= n; q += 16)
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) { vtc_v16 w; __builtin_memcpy(&w, y + n * (t * 16 + i) + q, 64); w += 1.0f; __builtin_memcpy(o + n * (t * 16 + i) + q, &w, 64); }
}
int main(int argc, char** argv) {
  int64_t n = atoll(argv[1]); int nt = atoi(argv[2]); int reps = atoi(argv[3]);
  std::string only = argc > 4 ? std::string(",") + argv[4] + "," : "";
  std::vector<float, HA<float>> xs(n * n + 4096), ys(n * n + 4096), os_(n * n + 4096), ref(n * n);
  // an array at an offset, with data() and [] as the vectors had
  struct P { float* p; float* data() { return p; } float& operator[](int64_t i) { return p[i]; } };
  auto off = [](const char* e) { return getenv(e) ? atoi(getenv(e)) : 0; };
  P x{xs.data() + off("OFFX")}, y{ys.data() + off("OFFY")}, o{os_.data() + off("OFFO")};
  for (int64_t i = 0; i < n * n; ++i) { x[i] = rand() / 1e6f; y[i] = rand() / 1e6f; }
  for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) ref[i * n + j] = x[j * n + i] + y[i * n + j];
  struct V { const char* name; K k; } all[] = {
    {"add", k_add}, {"yo", k_yo}, {"b2r", k_b2d<1>}, {"g1r", k_b2d<0>}, {"b2", k_b2}, {"py1", k_py<1,0>}, {"py2", k_py<2,0>}, {"py4", k_py<4,0>}, {"py8", k_py<8,0>}, {"pyw1", k_py<1,1>}, {"pyw2", k_py<2,1>}, {"pyw4", k_py<4,1>}, {"pyw8", k_py<8,1>}, {"two256", k_two<256>}, {"two1024", k_two<1024>}, {"two4096", k_two<4096>}, {"g1x1c256", k_g<1, 1, 256>}, {"g1x1c16", k_g<1, 1, 16>}, {"g1x1c4096", k_g<1, 1, 4096>},
    {"g1x2c256", k_g<1, 2, 256>}, {"g2x1c256", k_g<2, 1, 256>}, {"g2x2c256", k_g<2, 2, 256>},
    {"g2x1c128", k_g<2, 1, 128>}, {"g1x4c256", k_g<1, 4, 256>}, {"g4x1c256", k_g<4, 1, 256>},
    {"g1x1c256o1", k_g<1, 1, 256, 1>}, {"g1x1c256s1", k_g<1, 1, 256, 0, 1>}, {"g1x1c256p1", k_g<1, 1, 256, 0, 0, 1>},
    {"g1x1c4096s1", k_g<1, 1, 4096, 0, 1>}, {"g1x1c64", k_g<1, 1, 64>}, {"g1x1c512", k_g<1, 1, 512>},
    {"order", k_order}, {"r8", k_r8}, {"tonly", k_tonly}, {"g1x1c256p2", k_g<1, 1, 256, 0, 0, 2>}, {"g1x1c256p3", k_g<1, 1, 256, 0, 0, 3>},
    {"g1x1c256p5", k_g<1, 1, 256, 0, 0, 5>}, {"g1x2c256p3", k_g<1, 2, 256, 0, 0, 3>},
    {"g2x1c256p1", k_g<2, 1, 256, 0, 0, 1>},
    {"h2c256", k_h2<256>}, {"h2c64", k_h2<64>}, {"h2c4096", k_h2<4096>}, {"px1", k_pl2<1, 0>}, {"px2", k_pl2<2, 0>}, {"px4", k_pl2<4, 0>}, {"px8", k_pl2<8, 0>}, {"pxy2", k_pl2<2, 1>}, {"pxy4", k_pl2<4, 1>}, {"pyo2", k_pl2<2, 2>}, {"pyo4", k_pl2<4, 2>}, {"g1x2c256p1", k_g<1, 2, 256, 0, 0, 1>}, {"g2x2c512", k_g<2, 2, 512>},
  };
  std::vector<V> vs;
  for (auto& v : all) if (only.empty() || only.find(std::string(",") + v.name + ",") != std::string::npos) vs.push_back(v);
  const int NV = vs.size();
  std::vector<std::vector<double>> t(NV);
  for (int round = 0; round < 15; ++round)
    for (int v = 0; v < NV; ++v) {
      vs[v].k(x.data(), y.data(), o.data(), n, nt);
      if (round == 0 && strcmp(vs[v].name, "add") && strcmp(vs[v].name, "order") && strcmp(vs[v].name, "tonly") && strcmp(vs[v].name, "yo"))
        for (int64_t i = 0; i < n * n; ++i) if (o[i] != ref[i]) { printf("%s wrong at %ld\n", vs[v].name, (long)i); break; }
      double t0 = now_us();
      for (int r = 0; r < reps; ++r) vs[v].k(x.data(), y.data(), o.data(), n, nt);
      t[v].push_back((now_us() - t0) / reps);
    }
  { FILE* f = fopen("/proc/self/smaps_rollup", "r"); char l[256]; while (fgets(l, 256, f)) if (strstr(l, "AnonHuge")) printf("%s", l); fclose(f); }
  for (int v = 0; v < NV; ++v) { auto s = t[v]; std::sort(s.begin(), s.end()); printf("n=%ld T=%d %-12s min %8.1f med %8.1f us\n", (long)n, nt, vs[v].name, s[0], s[s.size() / 2]); }
}
