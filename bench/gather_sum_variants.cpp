// index_select -> sum over rows of 256 floats picked by a random index (micro_index_select_sum_*): kernel forms side by
// side, each checked against a double-precision reference (docs/chains.md, session 19).  Build and run:
//   g++ -O3 -march=native -fopenmp -std=c++17 bench/gather_sum_variants.cpp -o /tmp/gsv && /tmp/gsv 8192 1 20 [names]
// (rows, threads, calls per timing; the calling thread's CPU time, WALL=1: wall time; HUGE=1: the table on 2 MB pages;
// PT=1: each of the threads runs its static share of the rows on 1 thread, timed by its own CPU clock, the call's time the
// slowest thread's: a 2-thread figure that a preempted thread does not spoil)
// contig: the same bytes without the index (the floor); gen<A>: vtc's kernel (prefetch A rows ahead, one vector of
// partial sums); v<A>_<NACC>_<G>: intrinsics, NACC vectors of partials, G rows interleaved; l<L>a<A>: only the first
// L lines of a row prefetched; s<S>a8: every S-th line; nta8 / ..l2: prefetchnta / prefetcht1; scr<P><L>: the
// prefetches (P) / loads (L) of a row's lines in a scrambled order; gen<A>t1 / t2: vtc's kernel prefetching with
// prefetcht1 / prefetcht2 (__builtin_prefetch locality 2 / 1); t1a<A>, t2a<A>: the same, intrinsics; gen<F>t1n<N>, two<F>_<N>: prefetcht1
// F rows ahead and prefetcht0 N rows ahead.
#include <immintrin.h>
#include <sys/mman.h>
#include <omp.h>
#include <time.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <string>
#include <algorithm>
#include <cmath>
static double now_us() { timespec ts; clock_gettime(getenv("WALL") ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3; }
typedef void (*K)(const float*, const int64_t*, float*, int64_t, int);
#define D 256
template <int AHEAD, int LOC, int NEAR = 0>
static void k_gen(const float* __restrict b0, const int64_t* __restrict b1, float* __restrict b2, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t o = 0; o < n; ++o) {
    const int64_t ix0 = b1[o];
    if (AHEAD && o + AHEAD < n) { const char* p_ = (const char*)(b0 + D * b1[o + AHEAD]); for (int q_ = 0; q_ < 16; ++q_) __builtin_prefetch(p_ + 64 * q_, 0, LOC); }
    if (NEAR && o + NEAR < n) { const char* p_ = (const char*)(b0 + D * b1[o + NEAR]); for (int q_ = 0; q_ < 16; ++q_) __builtin_prefetch(p_ + 64 * q_, 0, 3); }
    float acc_a = 0;
    alignas(64) float acc_a_part[16] = {};
    for (int64_t rb_ = 0; rb_ + 16 <= D; rb_ += 16) {
      #pragma omp simd
      for (int64_t r = rb_; r < rb_ + 16; ++r) acc_a_part[r - rb_] = acc_a_part[r - rb_] + b0[D * ix0 + r];
    }
    #pragma omp simd
    for (int64_t l = 0; l < 8; ++l) acc_a_part[l] = acc_a_part[l] + acc_a_part[l + 8];
    #pragma omp simd
    for (int64_t l = 0; l < 4; ++l) acc_a_part[l] = acc_a_part[l] + acc_a_part[l + 4];
    #pragma omp simd
    for (int64_t l = 0; l < 2; ++l) acc_a_part[l] = acc_a_part[l] + acc_a_part[l + 2];
    b2[o] = acc_a + (acc_a_part[0] + acc_a_part[1]);
  }
}
// contiguous rows (no index): the floor
static void k_contig(const float* __restrict b0, const int64_t* __restrict b1, float* __restrict b2, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t o = 0; o < n; ++o) {
    __m512 a = _mm512_setzero_ps();
    for (int r = 0; r < D; r += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(b0 + D * o + r));
    b2[o] = _mm512_reduce_add_ps(a);
  }
}
// intrinsics, NACC vectors of partials, prefetch AHEAD rows, locality LOC, G rows per step interleaved
template <int AHEAD, int LOC, int NACC, int G, int NL = 16, int STEP = 1>
static void k_v(const float* __restrict b0, const int64_t* __restrict b1, float* __restrict b2, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t o0 = 0; o0 < n / G; ++o0) {
    const int64_t o = o0 * G;
    if (AHEAD && o + AHEAD + G - 1 < n)
      for (int g = 0; g < G; ++g) { const char* p_ = (const char*)(b0 + D * b1[o + AHEAD + g]); for (int q_ = 0; q_ < NL; q_ += STEP) __builtin_prefetch(p_ + 64 * q_, 0, LOC); }
    __m512 a[G][NACC];
    const float* rows[G];
    for (int g = 0; g < G; ++g) { rows[g] = b0 + D * b1[o + g]; for (int k = 0; k < NACC; ++k) a[g][k] = _mm512_setzero_ps(); }
    #pragma GCC unroll 16
    for (int r = 0; r < D / 16; ++r)
      for (int g = 0; g < G; ++g) a[g][r % NACC] = _mm512_add_ps(a[g][r % NACC], _mm512_loadu_ps(rows[g] + 16 * r));
    for (int g = 0; g < G; ++g) {
      for (int k = 1; k < NACC; ++k) a[g][0] = _mm512_add_ps(a[g][0], a[g][k]);
      b2[o + g] = _mm512_reduce_add_ps(a[g][0]);
    }
  }
}

// two prefetch distances: row o + FAR into L2 (prefetcht1: no L1 miss buffer held while the line comes from memory),
// row o + NEAR into L1 (NEAR 0: none)
template <int FAR, int NEAR>
static void k_two(const float* __restrict b0, const int64_t* __restrict b1, float* __restrict b2, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t o = 0; o < n; ++o) {
    if (o + FAR < n) { const char* p_ = (const char*)(b0 + D * b1[o + FAR]); for (int q_ = 0; q_ < 16; ++q_) __builtin_prefetch(p_ + 64 * q_, 0, 2); }
    if (NEAR && o + NEAR < n) { const char* p_ = (const char*)(b0 + D * b1[o + NEAR]); for (int q_ = 0; q_ < 16; ++q_) __builtin_prefetch(p_ + 64 * q_, 0, 3); }
    const float* row = b0 + D * b1[o];
    __m512 a = _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) a = _mm512_add_ps(a, _mm512_loadu_ps(row + 16 * r));
    b2[o] = _mm512_reduce_add_ps(a);
  }
}
// lines of each row visited in a scrambled order (PF: the prefetches; LD: the loads), so the L2 streamer may not train
static const int SCR[16] = {0, 9, 2, 11, 4, 13, 6, 15, 8, 1, 10, 3, 12, 5, 14, 7};
template <int AHEAD, int PF, int LD>
static void k_scr(const float* __restrict b0, const int64_t* __restrict b1, float* __restrict b2, int64_t n, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t o = 0; o < n; ++o) {
    if (o + AHEAD < n) { const char* p_ = (const char*)(b0 + D * b1[o + AHEAD]);
      #pragma GCC unroll 16
      for (int q_ = 0; q_ < 16; ++q_) __builtin_prefetch(p_ + 64 * (PF ? SCR[q_] : q_)); }
    const float* row = b0 + D * b1[o];
    __m512 a = _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) a = _mm512_add_ps(a, _mm512_loadu_ps(row + 16 * (LD ? SCR[r] : r)));
    b2[o] = _mm512_reduce_add_ps(a);
  }
}
int main(int argc, char** argv) {
  int64_t n = atoll(argv[1]); int nt = atoi(argv[2]); int reps = atoi(argv[3]);
  std::string only = argc > 4 ? std::string(",") + argv[4] + "," : "";
  size_t tb_ = (n * D * 4 + (2 << 20) - 1) & ~size_t((2 << 20) - 1); float* t = (float*)aligned_alloc(2 << 20, tb_); if (getenv("HUGE")) madvise(t, tb_, MADV_HUGEPAGE); int64_t* idx = (int64_t*)aligned_alloc(64, n * 8);
  float* out = (float*)aligned_alloc(64, n * 4); std::vector<float> ref(n);
  srand(5); for (int64_t i = 0; i < n * D; ++i) t[i] = rand() / (float)RAND_MAX - 0.5f;
  for (int64_t i = 0; i < n; ++i) idx[i] = rand() % n;
  for (int64_t o = 0; o < n; ++o) { double s = 0; for (int r = 0; r < D; ++r) s += t[D * idx[o] + r]; ref[o] = s; }
  { FILE* f = fopen("/proc/self/smaps_rollup", "r"); char l[256]; while (fgets(l, 256, f)) if (strstr(l, "AnonHuge")) printf("%s", l); fclose(f); }
  struct V { const char* name; K k; } all[] = {
    {"contig", k_contig}, {"scr00", k_scr<4,0,0>}, {"scr10", k_scr<4,1,0>}, {"scr11", k_scr<4,1,1>}, {"scr01", k_scr<4,0,1>}, {"scr11a8", k_scr<8,1,1>}, {"gen4", k_gen<4, 3>}, {"gen0", k_gen<0, 3>}, {"gen8", k_gen<8, 3>},
    {"v4_1_1", k_v<4, 3, 1, 1>}, {"v4_2_1", k_v<4, 3, 2, 1>}, {"v4_4_1", k_v<4, 3, 4, 1>}, {"v4_1_2", k_v<4, 3, 1, 2>},
    {"v4_2_2", k_v<4, 3, 2, 2>}, {"v8_2_2", k_v<8, 3, 2, 2>}, {"v4_1_4", k_v<4, 3, 1, 4>}, {"v8_1_4", k_v<8, 3, 1, 4>},
    {"v2_1_1", k_v<2, 3, 1, 1>}, {"v8_1_1", k_v<8, 3, 1, 1>}, {"v8_1_1l2", k_v<8, 2, 1, 1>}, {"v16_1_1l2", k_v<16, 2, 1, 1>},
    {"v0_1_1", k_v<0, 3, 1, 1>}, {"l1a8", k_v<8,3,1,1,1>}, {"l2a8", k_v<8,3,1,1,2>}, {"l4a8", k_v<8,3,1,1,4>}, {"l8a8", k_v<8,3,1,1,8>}, {"l2a16", k_v<16,3,1,1,2>}, {"l4a16", k_v<16,3,1,1,4>}, {"s2a8", k_v<8,3,1,1,16,2>}, {"s4a8", k_v<8,3,1,1,16,4>}, {"nta8", k_v<8,0,1,1>}, {"v12_1_1", k_v<12,3,1,1>}, {"v6_1_1", k_v<6,3,1,1>}, {"v0_2_2", k_v<0, 3, 2, 2>}, {"v0_1_4", k_v<0, 3, 1, 4>},
    {"gen4t1", k_gen<4, 2>}, {"gen8t1", k_gen<8, 2>}, {"gen16t1", k_gen<16, 2>}, {"gen32t1", k_gen<32, 2>}, {"gen8t2", k_gen<8, 1>}, {"gen16t1n4", k_gen<16, 2, 4>}, {"gen16t1n2", k_gen<16, 2, 2>}, {"gen32t1n4", k_gen<32, 2, 4>}, {"gen16t2", k_gen<16, 1>},
    {"t1a2", k_v<2, 2, 1, 1>}, {"t1a4", k_v<4, 2, 1, 1>}, {"t1a32", k_v<32, 2, 1, 1>}, {"t2a8", k_v<8, 1, 1, 1>}, {"t2a16", k_v<16, 1, 1, 1>},
    {"two8_0", k_two<8, 0>}, {"two8_2", k_two<8, 2>}, {"two16_2", k_two<16, 2>}, {"two16_4", k_two<16, 4>},
  };
  std::vector<V> vs;
  for (auto& v : all) if (only.empty() || only.find(std::string(",") + v.name + ",") != std::string::npos) vs.push_back(v);
  const int NV = vs.size(); std::vector<std::vector<double>> tt(NV);
  for (int round = 0; round < 15; ++round)
    for (int v = 0; v < NV; ++v) {
      vs[v].k(t, idx, out, n, nt);
      if (round == 0 && strcmp(vs[v].name, "contig")) for (int64_t o = 0; o < n; ++o) if (fabsf(out[o] - ref[o]) > 1e-3f) { printf("%s wrong at %ld\n", vs[v].name, (long)o); break; }
      if (getenv("PT")) {  // each thread its static share (the kernel on 1 thread), timed by its own CPU clock: max of the threads
        double worst = 0;
        #pragma omp parallel num_threads(nt) reduction(max: worst)
        {
          const int th = omp_get_thread_num();
          const int64_t lo = n * th / nt, hi = n * (th + 1) / nt;
          double mine = 0;
          for (int r = 0; r < reps; ++r) {
            #pragma omp barrier
            const double t0 = now_us();
            vs[v].k(t, idx + lo, out + lo, hi - lo, 1);
            mine += now_us() - t0;
          }
          worst = mine;
        }
        tt[v].push_back(worst / reps);
        continue;
      }
      double t0 = now_us();
      for (int r = 0; r < reps; ++r) vs[v].k(t, idx, out, n, nt);
      tt[v].push_back((now_us() - t0) / reps);
    }
  for (int v = 0; v < NV; ++v) { auto s = tt[v]; std::sort(s.begin(), s.end()); printf("n=%ld T=%d %-10s min %8.1f med %8.1f us\n", (long)n, nt, vs[v].name, s[0], s[s.size() / 2]); }
}
