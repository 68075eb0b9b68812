// Roll -> add over [B, H, H, 64] rolled by 3 along H and W: one loop nest (as vtc generated it) vs split at the wrap.
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
int main(int argc, char** argv) {
  int64_t B = atoi(argv[1]), H = atoi(argv[2]); int reps = atoi(argv[3]);
  size_t n = B * H * H * 64;
  std::vector<float> x(n), y(n), o(n), r(n);
  for (size_t i = 0; i < n; ++i) { x[i] = rand() / 1e6f; y[i] = rand() / 1e6f; }
  gen(x.data(), y.data(), r.data(), B, H, 1); split(x.data(), y.data(), o.data(), B, H, 1);
  for (size_t i = 0; i < n; ++i) if (o[i] != r[i]) { printf("bad %zu\n", i); return 1; }
  std::vector<double> tg, ts;
  for (int k = 0; k < 21; ++k) {
    double t0 = now_us(); for (int i = 0; i < reps; ++i) gen(x.data(), y.data(), o.data(), B, H, 1); tg.push_back((now_us() - t0) / reps);
    t0 = now_us(); for (int i = 0; i < reps; ++i) split(x.data(), y.data(), o.data(), B, H, 1); ts.push_back((now_us() - t0) / reps);
  }
  std::sort(tg.begin(), tg.end()); std::sort(ts.begin(), ts.end());
  printf("B=%ld H=%ld gen %.1f/%.1f split %.1f/%.1f us (min/med)\n", B, H, tg[0], tg[10], ts[0], ts[10]);
}
