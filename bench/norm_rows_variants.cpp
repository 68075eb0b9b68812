// Layer norm row kernels, hand-written variants timed alone (session 27, helper norms; docs/prefill.md).
//   g++ -O3 -march=native -fopenmp -std=c++17 bench/norm_rows_variants.cpp -o /tmp/lnv && /tmp/lnv
// v0: the one-row kernel vtc generated before row_blocks; v3: R rows a block, two passes, interleaved per vector
// step; v4: as v3 but one pass (sum and sum of squares of x - the row's first element); v5: R rows a block, each
// row's pass in turn (not interleaved); v6: v5 in one pass.  Inputs 100 + 0.1 U(-1.7, 1.7); err: max |y - float64|.
#include <immintrin.h>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>
#include <algorithm>
#include <cstring>

static double tcpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// V0: the generated kernel (as vtc emits it today), C as a template constant
template <int C>
void v0(const float* __restrict b0, const float* __restrict b1, const float* __restrict b2, float* __restrict b3, int64_t rows) {
  for (int64_t o = 0; o < rows; ++o) {
    const int64_t i1 = o;
    float acc_s = (float)0;
    alignas(64) float acc_s_part[16] = {};
    for (int64_t rb_ = 0; rb_ + 16 <= C; rb_ += 16) {
      #pragma omp simd
      for (int64_t r = rb_; r < rb_ + 16; ++r) acc_s_part[r - rb_] = acc_s_part[r - rb_] + b2[(C*i1 + r)];
    }
    float acc_s_tail = 0;
    for (int64_t r = (C - C % 16); r < C; ++r) acc_s_tail = acc_s_tail + b2[(C*i1 + r)];
    #pragma omp simd
    for (int64_t l = 0; l < 8; ++l) acc_s_part[l] = acc_s_part[l] + acc_s_part[l + 8];
    #pragma omp simd
    for (int64_t l = 0; l < 4; ++l) acc_s_part[l] = acc_s_part[l] + acc_s_part[l + 4];
    #pragma omp simd
    for (int64_t l = 0; l < 2; ++l) acc_s_part[l] = acc_s_part[l] + acc_s_part[l + 2];
    acc_s = acc_s + ((acc_s_part[0] + acc_s_part[1]) + acc_s_tail);
    float acc_q = (float)0;
    alignas(64) float acc_q_part[16] = {};
    for (int64_t rb_ = 0; rb_ + 16 <= C; rb_ += 16) {
      #pragma omp simd
      for (int64_t r = rb_; r < rb_ + 16; ++r) {
        const float t0 = (b2[(C*i1 + r)] - (acc_s / (float)C));
        acc_q_part[r - rb_] = acc_q_part[r - rb_] + (t0 * t0);
      }
    }
    float acc_q_tail = 0;
    for (int64_t r = (C - C % 16); r < C; ++r) { const float t0 = (b2[(C*i1 + r)] - (acc_s / (float)C)); acc_q_tail = acc_q_tail + (t0 * t0); }
    #pragma omp simd
    for (int64_t l = 0; l < 8; ++l) acc_q_part[l] = acc_q_part[l] + acc_q_part[l + 8];
    #pragma omp simd
    for (int64_t l = 0; l < 4; ++l) acc_q_part[l] = acc_q_part[l] + acc_q_part[l + 4];
    #pragma omp simd
    for (int64_t l = 0; l < 2; ++l) acc_q_part[l] = acc_q_part[l] + acc_q_part[l + 2];
    acc_q = acc_q + ((acc_q_part[0] + acc_q_part[1]) + acc_q_tail);
    const float t0 = (acc_s / (float)C);
    const float t1 = ((float)1 / std::sqrt(((acc_q / (float)C) + 1e-05f)));
    #pragma omp simd
    for (int64_t r = 0; r < C; ++r) b3[(C*i1 + r)] = ((((b2[(C*i1 + r)] - t0) * t1) * b1[r]) + b0[r]);
  }
}

// V1: intrinsics, one row at a time, two passes, _mm512_reduce_add_ps
template <int C>
void v1(const float* __restrict bb, const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t rows) {
  constexpr int V = C / 16;
  for (int64_t o = 0; o < rows; ++o) {
    const float* xr = x + C * o;
    __m512 s = _mm512_setzero_ps();
    for (int v = 0; v < V; ++v) s = _mm512_add_ps(s, _mm512_loadu_ps(xr + 16 * v));
    const float mean = _mm512_reduce_add_ps(s) * (1.0f / C);
    const __m512 m = _mm512_set1_ps(mean);
    __m512 q = _mm512_setzero_ps();
    for (int v = 0; v < V; ++v) { __m512 d = _mm512_sub_ps(_mm512_loadu_ps(xr + 16 * v), m); q = _mm512_fmadd_ps(d, d, q); }
    const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(q) * (1.0f / C) + 1e-5f);
    const __m512 rs = _mm512_set1_ps(rstd);
    for (int v = 0; v < V; ++v) {
      __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + 16 * v), m), rs);
      _mm512_storeu_ps(y + C * o + 16 * v, _mm512_add_ps(_mm512_mul_ps(d, _mm512_loadu_ps(w + 16 * v)), _mm512_loadu_ps(bb + 16 * v)));
    }
  }
}

// V2: plain C, R rows at a time: each pass over r for R rows, partials per row as 16-lane arrays
template <int C, int R>
void v2(const float* __restrict bb, const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t rows) {
  int64_t o = 0;
  for (; o + R <= rows; o += R) {
    alignas(64) float sp[R][16] = {};
    for (int64_t rb = 0; rb + 16 <= C; rb += 16)
      for (int k = 0; k < R; ++k) {
        #pragma omp simd
        for (int l = 0; l < 16; ++l) sp[k][l] += x[C * (o + k) + rb + l];
      }
    float mean[R];
    for (int k = 0; k < R; ++k) { float t = 0; for (int l = 0; l < 16; ++l) t += sp[k][l]; mean[k] = t / C; }
    alignas(64) float qp[R][16] = {};
    for (int64_t rb = 0; rb + 16 <= C; rb += 16)
      for (int k = 0; k < R; ++k) {
        #pragma omp simd
        for (int l = 0; l < 16; ++l) { float d = x[C * (o + k) + rb + l] - mean[k]; qp[k][l] += d * d; }
      }
    float rs[R];
    for (int k = 0; k < R; ++k) { float t = 0; for (int l = 0; l < 16; ++l) t += qp[k][l]; rs[k] = 1.0f / std::sqrt(t / C + 1e-5f); }
    for (int k = 0; k < R; ++k) {
      #pragma omp simd
      for (int64_t r = 0; r < C; ++r) y[C * (o + k) + r] = (x[C * (o + k) + r] - mean[k]) * rs[k] * w[r] + bb[r];
    }
  }
  v1<C>(bb, w, x + C * o, y + C * o, rows - o);
}

// V3: intrinsics, R rows at a time (two passes), reductions of the R rows combined
template <int C, int R>
void v3(const float* __restrict bb, const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t rows) {
  constexpr int V = C / 16;
  int64_t o = 0;
  for (; o + R <= rows; o += R) {
    __m512 s[R], m[R], q[R], rs[R];
    for (int k = 0; k < R; ++k) s[k] = _mm512_setzero_ps();
    for (int v = 0; v < V; ++v) for (int k = 0; k < R; ++k) s[k] = _mm512_add_ps(s[k], _mm512_loadu_ps(x + C * (o + k) + 16 * v));
    for (int k = 0; k < R; ++k) m[k] = _mm512_set1_ps(_mm512_reduce_add_ps(s[k]) * (1.0f / C));
    for (int k = 0; k < R; ++k) q[k] = _mm512_setzero_ps();
    for (int v = 0; v < V; ++v) for (int k = 0; k < R; ++k) { __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + C * (o + k) + 16 * v), m[k]); q[k] = _mm512_fmadd_ps(d, d, q[k]); }
    for (int k = 0; k < R; ++k) rs[k] = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(q[k]) * (1.0f / C) + 1e-5f));
    for (int v = 0; v < V; ++v) {
      const __m512 wv = _mm512_loadu_ps(w + 16 * v), bv = _mm512_loadu_ps(bb + 16 * v);
      for (int k = 0; k < R; ++k) {
        __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + C * (o + k) + 16 * v), m[k]), rs[k]);
        _mm512_storeu_ps(y + C * (o + k) + 16 * v, _mm512_fmadd_ps(d, wv, bv));
      }
    }
  }
  v1<C>(bb, w, x + C * o, y + C * o, rows - o);
}

// V4: one pass, shifted by the row's first element: sum d, sum d^2 (d = x - x0)
template <int C, int R>
void v4(const float* __restrict bb, const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t rows) {
  constexpr int V = C / 16;
  int64_t o = 0;
  for (; o + R <= rows; o += R) {
    __m512 s[R], q[R], sh[R], m[R], rs[R];
    for (int k = 0; k < R; ++k) { s[k] = _mm512_setzero_ps(); q[k] = _mm512_setzero_ps(); sh[k] = _mm512_set1_ps(x[C * (o + k)]); }
    for (int v = 0; v < V; ++v) for (int k = 0; k < R; ++k) {
      __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + C * (o + k) + 16 * v), sh[k]);
      s[k] = _mm512_add_ps(s[k], d); q[k] = _mm512_fmadd_ps(d, d, q[k]);
    }
    for (int k = 0; k < R; ++k) {
      float ds = _mm512_reduce_add_ps(s[k]) * (1.0f / C);
      float var = _mm512_reduce_add_ps(q[k]) * (1.0f / C) - ds * ds;
      var = var > 0 ? var : 0;
      m[k] = _mm512_set1_ps(x[C * (o + k)] + ds);
      rs[k] = _mm512_set1_ps(1.0f / std::sqrt(var + 1e-5f));
    }
    for (int v = 0; v < V; ++v) {
      const __m512 wv = _mm512_loadu_ps(w + 16 * v), bv = _mm512_loadu_ps(bb + 16 * v);
      for (int k = 0; k < R; ++k) {
        __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + C * (o + k) + 16 * v), m[k]), rs[k]);
        _mm512_storeu_ps(y + C * (o + k) + 16 * v, _mm512_fmadd_ps(d, wv, bv));
      }
    }
  }
  v1<C>(bb, w, x + C * o, y + C * o, rows - o);
}


// V5: R rows a block, each row's pass as its own loop (as an emitter would write it), masked steps, partials in
// per-row __m512 arrays, horizontal sums after each pass for the block
static inline __mmask16 mk(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }
template <int C, int R>
void v5(const float* __restrict bb, const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t rows) {
  for (int64_t ob = 0; ob < (rows + R - 1) / R; ++ob) {
    const int64_t o0 = ob * R; const int nr = rows - o0 < R ? rows - o0 : R;
    float as[R], aq[R];
    __m512 ps[R];
    #pragma GCC unroll 16
    for (int k = 0; k < R; ++k) {
      const int64_t o = o0 + (k < nr ? k : nr - 1);
      __m512 a = _mm512_setzero_ps();
      for (int64_t r = 0; r < C; r += 16) { const __mmask16 vm = mk(C - r); const __m512 v0 = _mm512_maskz_loadu_ps(vm, x + C * o + r); a = _mm512_mask_add_ps(a, vm, a, v0); }
      ps[k] = a;
    }
    #pragma GCC unroll 16
    for (int k = 0; k < R; ++k) as[k] = _mm512_reduce_add_ps(ps[k]);
    #pragma GCC unroll 16
    for (int k = 0; k < R; ++k) {
      const int64_t o = o0 + (k < nr ? k : nr - 1);
      const float acc_s = as[k];
      __m512 a = _mm512_setzero_ps();
      for (int64_t r = 0; r < C; r += 16) { const __mmask16 vm = mk(C - r); const __m512 v0 = _mm512_maskz_loadu_ps(vm, x + C * o + r); const __m512 v1 = v0 - _mm512_set1_ps(acc_s / (float)C); a = _mm512_mask_add_ps(a, vm, a, v1 * v1); }
      ps[k] = a;
    }
    #pragma GCC unroll 16
    for (int k = 0; k < R; ++k) aq[k] = _mm512_reduce_add_ps(ps[k]);
    for (int k = 0; k < nr; ++k) {
      const int64_t o = o0 + k;
      const float acc_s = as[k], acc_q = aq[k];
      const float t0 = acc_s / (float)C; const float t1 = 1.0f / std::sqrt(acc_q / (float)C + 1e-5f);
      for (int64_t r = 0; r < C; r += 16) { const __mmask16 vm = mk(C - r);
        const __m512 v = (_mm512_maskz_loadu_ps(vm, x + C * o + r) - _mm512_set1_ps(t0)) * _mm512_set1_ps(t1) * _mm512_maskz_loadu_ps(vm, w + r) + _mm512_maskz_loadu_ps(vm, bb + r);
        _mm512_mask_storeu_ps(y + C * o + r, vm, v); }
    }
  }
}
// V6: as V5 but one pass shifted by the row's first element
template <int C, int R>
void v6(const float* __restrict bb, const float* __restrict w, const float* __restrict x, float* __restrict y, int64_t rows) {
  for (int64_t ob = 0; ob < (rows + R - 1) / R; ++ob) {
    const int64_t o0 = ob * R; const int nr = rows - o0 < R ? rows - o0 : R;
    float as[R], aq[R];
    __m512 ps[R], pq[R];
    #pragma GCC unroll 16
    for (int k = 0; k < R; ++k) {
      const int64_t o = o0 + (k < nr ? k : nr - 1);
      const float x0 = x[C * o];
      __m512 a = _mm512_setzero_ps(), q = _mm512_setzero_ps();
      for (int64_t r = 0; r < C; r += 16) { const __mmask16 vm = mk(C - r); const __m512 d = _mm512_maskz_loadu_ps(vm, x + C * o + r) - _mm512_set1_ps(x0); a = _mm512_mask_add_ps(a, vm, a, d); q = _mm512_mask_add_ps(q, vm, q, d * d); }
      ps[k] = a; pq[k] = q;
    }
    #pragma GCC unroll 16
    for (int k = 0; k < R; ++k) { as[k] = _mm512_reduce_add_ps(ps[k]); aq[k] = _mm512_reduce_add_ps(pq[k]); }
    for (int k = 0; k < nr; ++k) {
      const int64_t o = o0 + k;
      const float ds = as[k] / (float)C; float var = aq[k] / (float)C - ds * ds; var = var > 0 ? var : 0;
      const float t0 = x[C * o] + ds; const float t1 = 1.0f / std::sqrt(var + 1e-5f);
      for (int64_t r = 0; r < C; r += 16) { const __mmask16 vm = mk(C - r);
        const __m512 v = (_mm512_maskz_loadu_ps(vm, x + C * o + r) - _mm512_set1_ps(t0)) * _mm512_set1_ps(t1) * _mm512_maskz_loadu_ps(vm, w + r) + _mm512_maskz_loadu_ps(vm, bb + r);
        _mm512_mask_storeu_ps(y + C * o + r, vm, v); }
    }
  }
}
typedef void (*fn_t)(const float*, const float*, const float*, float*, int64_t);

template <int C>
void run(int64_t rows) {
  const int n = rows * C;
  float* x = (float*)aligned_alloc(64, n * 4); float* y = (float*)aligned_alloc(64, n * 4);
  float* ref = (float*)aligned_alloc(64, n * 4);
  float w[C], b[C];
  srand(1);
  for (int i = 0; i < n; ++i) x[i] = 100.0f + 0.1f * ((rand() / (float)RAND_MAX) * 3.4641f - 1.732f);
  for (int i = 0; i < C; ++i) { w[i] = 1 + 0.1f * (rand() / (float)RAND_MAX - 0.5f); b[i] = 0.1f * (rand() / (float)RAND_MAX - 0.5f); }
  // reference in double
  for (int64_t o = 0; o < rows; ++o) { double s = 0, q = 0; for (int r = 0; r < C; ++r) s += x[o*C+r]; s /= C; for (int r = 0; r < C; ++r) q += (x[o*C+r]-s)*(x[o*C+r]-s); q /= C; for (int r = 0; r < C; ++r) ref[o*C+r] = (x[o*C+r]-s)/std::sqrt(q+1e-5)*w[r]+b[r]; }
  const char* names[] = {"v0 gen", "v3 R4", "v4 1p R4", "v5 R1", "v5 R2", "v5 R4", "v5 R8", "v6 1p R1", "v6 1p R4", "v6 1p R8"};
  fn_t fns[] = {v0<C>, v3<C, 4>, v4<C, 4>, v5<C, 1>, v5<C, 2>, v5<C, 4>, v5<C, 8>, v6<C, 1>, v6<C, 4>, v6<C, 8>};
  const int NF = sizeof(fns) / sizeof(fns[0]);
  std::vector<double> t[NF];
  int reps = std::max<int64_t>(1, 2000000 / n);
  for (int round = 0; round < 15; ++round)
    for (int f = 0; f < NF; ++f) {
      fns[f](b, w, x, y, rows);
      double t0 = tcpu();
      for (int i = 0; i < reps; ++i) { fns[f](b, w, x, y, rows); __asm__ volatile("" ::: "memory"); }
      t[f].push_back((tcpu() - t0) / reps * 1e6);
    }
  printf("rows %ld C %d (%d KB in)\n", rows, C, n * 4 / 1024);
  for (int f = 0; f < NF; ++f) {
    fns[f](b, w, x, y, rows);
    double err = 0; for (int i = 0; i < n; ++i) err = std::max(err, (double)std::fabs(y[i] - ref[i]));
    std::sort(t[f].begin(), t[f].end());
    printf("  %-10s min %7.2f us  med %7.2f us  err %.2e\n", names[f], t[f][0], t[f][t[f].size() / 2], err);
  }
}

int main() {
  run<96>(3136); run<192>(784); run<384>(196); run<768>(49); run<384>(784); run<768>(196); run<1536>(49);
}
