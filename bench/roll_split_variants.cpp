// Roll -> add over [B, H, H, 64] rolled by 3 along H and W: one loop nest (as vtc generated it) vs split at the wrap,
// row by row (split: each row's long run then its short run, vtc since cpp.WRAP_ROWS) or as two loops one after the
// other (loops: vtc's first split form), and the contiguous add of the same bytes (contig: the floor).
//   g++ -O3 -march=native -fopenmp -std=c++17 bench/roll_split_variants.cpp -o /tmp/rs && /tmp/rs 1 64 200 && /tmp/rs 2 128 20
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <time.h>
static double now_us() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3; }
// out[h, w, c] = x[(h+3)%H, (w+3)%W, c] + y[h, w, c]; H = W = 64 (or 128), C = 64, B batches
static void gen(const float* __restrict b1, const float* __restrict b0, float* __restrict b2, int64_t B, int64_t H, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t o = 0; o < B * H * H; ++o) {
    const int64_t i0 = o / (H * H), i1 = (o / H) % H, i2 = o % H;
    #pragma omp simd
    for (int64_t i3 = 0; i3 < 64; ++i3)
      b2[H * H * 64 * i0 + H * 64 * i1 + 64 * i2 + i3] = b1[H * H * 64 * i0 + H * 64 * ((i1 + 3) % H) + 64 * ((i2 + 3) % H) + i3] + b0[H * H * 64 * i0 + H * 64 * i1 + 64 * i2 + i3];
  }
}
static void split(const float* __restrict b1, const float* __restrict b0, float* __restrict b2, int64_t B, int64_t H, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t o = 0; o < B * H; ++o) {
    const int64_t i0 = o / H, i1 = o % H;
    const float* xs = b1 + H * H * 64 * i0 + H * 64 * ((i1 + 3) % H);
    const float* ys = b0 + H * H * 64 * i0 + H * 64 * i1;
    float* os = b2 + H * H * 64 * i0 + H * 64 * i1;
    const int64_t m = (H - 3) * 64;
    #pragma omp simd
    for (int64_t j = 0; j < m; ++j) os[j] = xs[j + 192] + ys[j];
    #pragma omp simd
    for (int64_t j = m; j < H * 64; ++j) os[j] = xs[j - m] + ys[j];
  }
}
static void loops(const float* __restrict b1, const float* __restrict b0, float* __restrict b2, int64_t B, int64_t H, int nt) {
  const int64_t R = B * H, W = H * 64, m = (H - 3) * 64;
  #pragma omp parallel num_threads(nt)
  {
  #pragma omp for nowait
  for (int64_t o = 0; o < R; ++o) {
    const int64_t i0 = o / H, i1 = o % H;
    #pragma omp simd
    for (int64_t j = 0; j < m; ++j) b2[W * o + j] = b1[H * W * i0 + W * ((i1 + 3) % H) + j + 192] + b0[W * o + j];
  }
  #pragma omp for
  for (int64_t o = 0; o < R; ++o) {
    const int64_t i0 = o / H, i1 = o % H;
    #pragma omp simd
    for (int64_t j = 0; j < 192; ++j) b2[W * o + j + m] = b1[H * W * i0 + W * ((i1 + 3) % H) + j] + b0[W * o + j + m];
  }
  }
}
static void contig(const float* __restrict b1, const float* __restrict b0, float* __restrict b2, int64_t B, int64_t H, int nt) {
  #pragma omp parallel for num_threads(nt)
  for (int64_t o = 0; o < B * H; ++o) {
    #pragma omp simd
    for (int64_t j = 0; j < H * 64; ++j) b2[o * H * 64 + j] = b1[o * H * 64 + j] + b0[o * H * 64 + j];
  }
}
int main(int argc, char** argv) {
  int64_t B = atoi(argv[1]), H = atoi(argv[2]); int reps = atoi(argv[3]);
  size_t n = B * H * H * 64;
  std::vector<float> x(n), y(n), o(n), r(n);
  for (size_t i = 0; i < n; ++i) { x[i] = rand() / 1e6f; y[i] = rand() / 1e6f; }
  gen(x.data(), y.data(), r.data(), B, H, 1); split(x.data(), y.data(), o.data(), B, H, 1);
  for (size_t i = 0; i < n; ++i) if (o[i] != r[i]) { printf("bad %zu\n", i); return 1; }
  loops(x.data(), y.data(), o.data(), B, H, 1);
  for (size_t i = 0; i < n; ++i) if (o[i] != r[i]) { printf("bad loops %zu\n", i); return 1; }
  typedef void (*Kf)(const float*, const float*, float*, int64_t, int64_t, int);
  const char* names[] = {"gen", "split", "loops", "contig"}; Kf ks[] = {gen, split, loops, contig};
  std::vector<double> t[4];
  for (int k = 0; k < 21; ++k)
    for (int v = 0; v < 4; ++v) {
      double t0 = now_us(); for (int i = 0; i < reps; ++i) ks[v](x.data(), y.data(), o.data(), B, H, 1); t[v].push_back((now_us() - t0) / reps);
    }
  printf("B=%ld H=%ld", B, H);
  for (int v = 0; v < 4; ++v) { std::sort(t[v].begin(), t[v].end()); printf("  %s %.1f/%.1f", names[v], t[v][0], t[v][10]); }
  printf(" us (min/med)\n");
}
