// Transpose -> add kernel variants in C++ (docs/chains.md, "Transposed tiles block by block"): out[i, j] = x[j, i] + y[i, j].
// Build and run (1 thread, CPU time of the thread; WALL=1 for wall time, HUGE=1 for madvise(MADV_HUGEPAGE)):
//   python -c "from vtc.codegen.tiles import PRELUDE; open(\"/tmp/tr.h\",\"w\").write(\"#include <cstdint>\\n#include <algorithm>\\n\"+PRELUDE)"
//   g++ -O3 -march=native -fopenmp -std=c++17 -I/tmp bench/tiles_variants.cpp -o /tmp/tv && /tmp/tv 1448 1 20   # side, threads, calls per round
#include "tr.h"
#include <chrono>
#include <time.h>
static double now_us() { timespec ts; clock_gettime(getenv("WALL") ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3; }
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <vector>
#include <omp.h>
#include <immintrin.h>
#include <sys/mman.h>
template <class T> struct HA { typedef T value_type; HA() = default; template <class U> HA(const HA<U>&) {}
  T* allocate(size_t n) { size_t b = (n * sizeof(T) + (2 << 20) - 1) & ~size_t((2 << 20) - 1); void* p = aligned_alloc(2 << 20, b); if (getenv("HUGE")) madvise(p, b, MADV_HUGEPAGE); return (T*)p; }
  void deallocate(T* p, size_t) { free(p); } };
template <class T, class U> bool operator==(const HA<T>&, const HA<U>&) { return true; }
template <class T, class U> bool operator!=(const HA<T>&, const HA<U>&) { return false; }
typedef void (*K)(const float*, const float*, float*, int64_t, int);
// out[i, j] = x[j, i] + y[i, j]
static void k_add(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t i = 0; i < n; ++i) {
    #pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[i * n + j] = x[i * n + j] + y[i * n + j];
  }
}
template <int TR, int COLS, int PF>
static void k_tiled(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * TR, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + TR <= n) {
      alignas(64) float tr0[TR * COLS];
      for (int64_t r = 0; r < TR; r += 16)
      for (int64_t q = tb0; q < tbf; q += 16) {
        if (PF) { for (int k = 0; k < 16; ++k) __builtin_prefetch(x + (ta0 + r + PF * 16) + n * (q + k)); }
        vtc_tile_transpose16(tr0 + r * COLS + (q - tb0), COLS, x + (ta0 + r + n * q), n);
      }
      for (int64_t i = ta0; i < ta0 + TR; ++i) {
        #pragma omp simd
        for (int64_t j = tb0; j < tbf; ++j) o[n * i + j] = tr0[(i - ta0) * COLS + (j - tb0)] + y[n * i + j];
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
      }
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + TR, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}
// fused: each 16x16 block transposed in registers, added to y's rows and stored (no buffer)
template <int TR, int COLS, int PD = 0>
static void k_fused(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * TR, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + TR <= n) {
      for (int64_t r = 0; r < TR; r += 16)
      for (int64_t q = tb0; q < tbf; q += 16) {
        vtc_v16 v[16];
        const float* src = x + (ta0 + r + n * q);
        if (PD) { const int64_t qp = q + PD * 16; if (qp < tbf) for (int k = 0; k < 16; ++k) __builtin_prefetch(x + (ta0 + r + n * (qp + k))); }
        for (int i = 0; i < 16; ++i) __builtin_memcpy(&v[i], src + n * i, 64);
#define STAGE(s) for (int i = 0; i < 16; ++i) if (!(i & s)) { const vtc_v16 a = v[i], b = v[i + s]; \
   v[i] = __builtin_shufflevector(a, b, LO##s); v[i + s] = __builtin_shufflevector(a, b, HI##s); }
#define LO1 0,16,2,18,4,20,6,22,8,24,10,26,12,28,14,30
#define HI1 1,17,3,19,5,21,7,23,9,25,11,27,13,29,15,31
#define LO2 0,1,16,17,4,5,20,21,8,9,24,25,12,13,28,29
#define HI2 2,3,18,19,6,7,22,23,10,11,26,27,14,15,30,31
#define LO4 0,1,2,3,16,17,18,19,8,9,10,11,24,25,26,27
#define HI4 4,5,6,7,20,21,22,23,12,13,14,15,28,29,30,31
#define LO8 0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23
#define HI8 8,9,10,11,12,13,14,15,24,25,26,27,28,29,30,31
        STAGE(1) STAGE(2) STAGE(4) STAGE(8)
        for (int i = 0; i < 16; ++i) {
          vtc_v16 w; __builtin_memcpy(&w, y + n * (ta0 + r + i) + q, 64);
          w += v[i]; __builtin_memcpy(o + n * (ta0 + r + i) + q, &w, 64);
        }
      }
      for (int64_t i = ta0; i < ta0 + TR; ++i)
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + TR, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}

template <int TR, int COLS>
static void k_blk(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * TR, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + TR <= n) {
      for (int64_t q = tb0; q < tbf; q += 16) {
        alignas(64) float trb[256];
        vtc_tile_transpose16(trb, 16, x + (ta0 + n * q), n);
        for (int64_t i0 = ta0; i0 < ta0 + 16; ++i0) {
          #pragma omp simd
          for (int64_t i1 = q; i1 < q + 16; ++i1) o[n * i0 + i1] = trb[(i0 - ta0) * 16 + (i1 - q)] + y[n * i0 + i1];
        }
      }
      for (int64_t i = ta0; i < ta0 + TR; ++i)
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + TR, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}

// same traversal as blk16x256 but x read in place (no transpose): out = x + y (checked against nothing)
template <int COLS, int TR = 16>
static void k_blkorder(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * TR, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    const int64_t re = std::min<int64_t>(ta0 + TR, n);
    for (int64_t q = tb0; q < tbf; q += 16)
      for (int64_t i0 = ta0; i0 < re; ++i0) {
        #pragma omp simd
        for (int64_t i1 = q; i1 < q + 16; ++i1) o[n * i0 + i1] = x[n * i0 + i1] + y[n * i0 + i1];
      }
  }
}

// whole tile transposed first, the next tile's x lines prefetched during this tile's row loop (HINT 0: L1, 1: L2)
template <int COLS, int HINT>
static void k_tilepf(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + 15) / 16, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * 16, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    const int64_t tn = t + 1, na0 = tn / tb * 16, nb0 = tn % tb * COLS;
    const bool pf = tn < ta * tb && na0 + 16 <= n;
    const int64_t nbf = std::min<int64_t>(nb0 + COLS, n);
    if (ta0 + 16 <= n) {
      alignas(64) float tr0[16 * COLS];
      for (int64_t q = tb0; q < tbf; q += 16)
        vtc_tile_transpose16(tr0 + (q - tb0), COLS, x + (ta0 + n * q), n);
      for (int64_t i = ta0; i < ta0 + 16; ++i) {
        if (pf) for (int64_t k = (i - ta0) * (COLS / 16); k < (i - ta0 + 1) * (COLS / 16); ++k)
          if (nb0 + k < nbf) __builtin_prefetch(x + na0 + n * (nb0 + k), 0, HINT == 0 ? 3 : 2);
        #pragma omp simd
        for (int64_t j = tb0; j < tbf; ++j) o[n * i + j] = tr0[(i - ta0) * COLS + (j - tb0)] + y[n * i + j];
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
      }
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + 16, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}

// block by block in two passes of 8 rows: pass 0 transposes each block into the tile buffer and computes its rows
// 0-7, pass 1 computes rows 8-15 from the buffer (8 rows of y and the output walked at a time)
template <int COLS, int H>
static void k_blkhalf(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + 15) / 16, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * 16, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + 16 <= n) {
      alignas(64) float tr0[16 * COLS];
      for (int h = 0; h < 16 / H; ++h)
        for (int64_t q = tb0; q < tbf; q += 16) {
          if (h == 0) vtc_tile_transpose16(tr0 + (q - tb0) * 16, 16, x + (ta0 + n * q), n);
          for (int64_t i0 = ta0 + h * H; i0 < ta0 + h * H + H; ++i0) {
            #pragma omp simd
            for (int64_t i1 = q; i1 < q + 16; ++i1) o[n * i0 + i1] = tr0[(q - tb0) * 16 + (i0 - ta0) * 16 + (i1 - q)] + y[n * i0 + i1];
          }
        }
      for (int64_t i = ta0; i < ta0 + 16; ++i)
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + 16, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}
// block by block with the 16 rows unrolled (constant trip counts: the compiler may keep the block in registers)
template <int TR, int COLS>
static void k_blku(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * TR, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + TR <= n) {
      for (int64_t q = tb0; q < tbf; q += 16) {
        alignas(64) float trb[256];
        vtc_tile_transpose16(trb, 16, x + (ta0 + n * q), n);
        #pragma GCC unroll 16
        for (int64_t i0 = 0; i0 < 16; ++i0) {
          #pragma omp simd
          for (int64_t i1 = 0; i1 < 16; ++i1) o[n * (ta0 + i0) + q + i1] = trb[i0 * 16 + i1] + y[n * (ta0 + i0) + q + i1];
        }
      }
      for (int64_t i = ta0; i < ta0 + TR; ++i)
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + TR, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}

// register rows: the 16 transposed vectors kept in registers; each row copied to a 16-float local the simd loop reads
template <int TR, int COLS>
static void k_blkr(const float* __restrict x, const float* __restrict y, float* __restrict o, int64_t n, int nt) {
  const int64_t ta = (n + TR - 1) / TR, tb = (n + COLS - 1) / COLS;
  #pragma omp parallel for num_threads(nt)
  for (int64_t t = 0; t < ta * tb; ++t) {
    const int64_t ta0 = t / tb * TR, tb0 = t % tb * COLS;
    const int64_t tb1 = std::min<int64_t>(tb0 + COLS, n), tbf = tb0 + (tb1 - tb0) / 16 * 16;
    if (ta0 + TR <= n) {
      for (int64_t q = tb0; q < tbf; q += 16) {
        vtc_v16 v[16];
        vtc_tile_transpose16_regs(v, x + (ta0 + n * q), n);
        #pragma GCC unroll 16
        for (int64_t i0 = 0; i0 < 16; ++i0) {
          alignas(64) float tr[16];
          __builtin_memcpy(tr, &v[i0], 64);
          #pragma omp simd
          for (int64_t i1 = 0; i1 < 16; ++i1) o[n * (ta0 + i0) + q + i1] = tr[i1] + y[n * (ta0 + i0) + q + i1];
        }
      }
      for (int64_t i = ta0; i < ta0 + TR; ++i)
        for (int64_t j = tbf; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    } else {
      for (int64_t i = ta0; i < std::min<int64_t>(ta0 + TR, n); ++i)
        for (int64_t j = tb0; j < tb1; ++j) o[n * i + j] = x[i + n * j] + y[n * i + j];
    }
  }
}
int main(int argc, char** argv) {
  int64_t n = atoll(argv[1]); int nt = atoi(argv[2]); int reps = atoi(argv[3]);
  std::vector<float, HA<float>> x(n * n), y(n * n), o(n * n), ref(n * n);
  for (int64_t i = 0; i < n * n; ++i) { x[i] = rand() / 1e6f; y[i] = rand() / 1e6f; }
  for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) ref[i * n + j] = x[j * n + i] + y[i * n + j];
  struct V { const char* name; K k; } vs[] = {
    {"add(contig)", k_add}, {"vtc16x256", k_tiled<16, 256, 0>}, {"ind16x16", k_tiled<16, 16, 0>},
    {"16x256pf1", k_tiled<16, 256, 1>}, {"32x128", k_tiled<32, 128, 0>}, {"64x64", k_tiled<64, 64, 0>},
    {"32x128pf", k_tiled<32, 128, 2>}, {"64x64pf", k_tiled<64, 64, 4>},
    {"fused16x256", k_fused<16, 256>}, {"fused32x128", k_fused<32, 128>}, {"fused64x64", k_fused<64, 64>},
    {"fused16x16", k_fused<16, 16>}, {"fused64x256", k_fused<64, 256>},
    {"blk16x256", k_blk<16, 256>}, {"blk16x16", k_blk<16, 16>}, {"blk16x1024", k_blk<16, 1024>}, {"blk16x64", k_blk<16, 64>}, {"f16x64", k_fused<16, 64>},
    {"blkhalf256", k_blkhalf<256, 8>}, {"blkq256", k_blkhalf<256, 4>}, {"blkhalf1024", k_blkhalf<1024, 8>}, {"blkorder256", k_blkorder<256>}, {"blkorder256r8", k_blkorder<256, 8>}, {"blkorder256r4", k_blkorder<256, 4>}, {"blkorder256r2", k_blkorder<256, 2>}, {"blkorder1024", k_blkorder<1024>},
    {"tilepf256", k_tilepf<256, 0>}, {"tilepf256L2", k_tilepf<256, 1>}, {"tilepf512", k_tilepf<512, 0>},
    {"f16x256d1", k_fused<16, 256, 1>}, {"f16x256d2", k_fused<16, 256, 2>}, {"f16x256d4", k_fused<16, 256, 4>},
    {"blku16x256", k_blku<16, 256>}, {"blkr16x256", k_blkr<16, 256>},
    {"f16x1024d2", k_fused<16, 1024, 2>}, {"f16x1024d4", k_fused<16, 1024, 4>}, {"f32x256d2", k_fused<32, 256, 2>},
  };
  const int NV = sizeof(vs) / sizeof(vs[0]);
  std::vector<std::vector<double>> t(NV);
  for (int round = 0; round < 15; ++round)
    for (int v = 0; v < NV; ++v) {
      vs[v].k(x.data(), y.data(), o.data(), n, nt);
      double t0 = now_us();
      for (int r = 0; r < reps; ++r) vs[v].k(x.data(), y.data(), o.data(), n, nt);
      t[v].push_back((now_us() - t0) / reps);
      if (v > 0 && round == 0 && strncmp(vs[v].name, "blkorder", 8)) for (int64_t i = 0; i < n * n; ++i) if (o[i] != ref[i]) { printf("%s wrong at %ld\n", vs[v].name, i); break; }
    }
  for (int v = 0; v < NV; ++v) { auto s = t[v]; std::sort(s.begin(), s.end()); printf("n=%ld T=%d %-12s min %8.1f med %8.1f us\n", n, nt, vs[v].name, s[0], s[s.size() / 2]); }
}
