/* CPU kernels the bundled jobs call through ctypes (training/speed/native/__init__.py builds this file with the node's
   gcc, -march=native, at first use). Each one does in one pass what torch does in several. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_in(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* round to nearest even, as torch's float -> bfloat16 conversion */
static inline uint16_t bf16_out(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

typedef struct {
  int64_t tensor, begin, end;
} chunk_t;

typedef struct {
  float keep;       /* 1 - lr * weight_decay */
  float step_size;  /* lr / (1 - beta1^step) */
  float bc2_sqrt;   /* sqrt(1 - beta2^step) */
} adamw_coef_t;

/* AdamW over fp32 masters whose gradients are the model's bf16 ones: each element's bf16 gradient is read once,
   its master and moments updated as torch's fused AdamW does (fp32 arithmetic, coefficients rounded from double),
   and the model's bf16 weight written from the new master. grads[t] NULL: tensor t is not stepped. */
void xc_adamw_bf16(const uint16_t *const *grads, uint16_t *const *weights, float *const *masters,
                   float *const *exp_avgs, float *const *exp_avg_sqs, const adamw_coef_t *coef, const chunk_t *chunks,
                   int64_t nchunks, double beta1, double beta2, double eps, float grad_scale, int threads) {
  const float c1 = (float)(1.0 - beta1), b2 = (float)beta2, c2 = (float)(1.0 - beta2);
  const float e = (float)eps;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < nchunks; c++) {
    const int64_t t = chunks[c].tensor;
    const uint16_t *g = grads[t];
    if (!g) continue;
    uint16_t *w = weights[t];
    float *p = masters[t], *m = exp_avgs[t], *v = exp_avg_sqs[t];
    const float keep = coef[t].keep, step_size = coef[t].step_size, bc2 = coef[t].bc2_sqrt;
#pragma omp simd
    for (int64_t i = chunks[c].begin; i < chunks[c].end; i++) {
      const float gi = bf16_in(g[i]) / grad_scale;
      const float mi = fmaf(c1, gi - m[i], m[i]); /* torch's lerp(m, g, 1 - beta1) */
      const float vi = fmaf(gi, gi * c2, v[i] * b2);
      const float pi = p[i] * keep - step_size * mi / (sqrtf(vi) / bc2 + e);
      m[i] = mi;
      v[i] = vi;
      p[i] = pi;
      w[i] = bf16_out(pi);
    }
  }
}

/* Each chunk's sum of squares of bf16 gradients in fp32 (a tensor's norm is the root of its chunks' sums):
   grads[t] NULL gives 0. LANES partial sums, whole vectors, then the chunk's last elements one by one. */
void xc_sumsq_bf16(const uint16_t *const *grads, const chunk_t *chunks, int64_t nchunks, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < nchunks; c++) {
    const uint16_t *g = grads[chunks[c].tensor];
    float lane[16] = {0};
    float sum = 0.0f;
    if (g) {
      const int64_t b = chunks[c].begin, e = chunks[c].end, whole = b + (e - b) / 16 * 16;
      for (int64_t i = b; i < whole; i += 16)
        for (int l = 0; l < 16; l++) {
          const float x = bf16_in(g[i + l]);
          lane[l] += x * x;
        }
      for (int l = 0; l < 16; l++) sum += lane[l];
      for (int64_t i = whole; i < e; i++) sum += bf16_in(g[i]) * bf16_in(g[i]);
    }
    out[c] = sum;
  }
}

/* Dropout. Element i's 16-bit uniform is bits 16*(i%4).. of splitmix64(seed + i/4), a counter-based stream, so
   every chunk, thread count and core draws the same mask for a seed; kept where uniform >= threshold (p in
   1/65536ths). Forward writes y = x * scale where kept, else 0, and the mask as bytes; backward applies it. */
static inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

#define DROPOUT_BLOCK (1 << 14) /* elements a task: a multiple of 4, so a task starts on a word */

#define DROPOUT(NAME, T, IN, OUT)                                                                                   \
  void NAME##_forward(const T *x, T *y, uint8_t *mask, int64_t n, uint64_t seed, uint32_t threshold, float scale, \
                      int threads) {                                                                            \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                           \
    for (int64_t b = 0; b < n; b += DROPOUT_BLOCK) {                                                            \
      const int64_t e = b + DROPOUT_BLOCK < n ? b + DROPOUT_BLOCK : n;                                          \
      _Pragma("omp simd")                                                                                       \
      for (int64_t i = b; i < e; i++) {                                                                         \
        const uint64_t word = splitmix64(seed + (uint64_t)(i >> 2) * 0x9e3779b97f4a7c15ull);                  \
        const uint8_t keep = ((word >> (16 * (i & 3))) & 0xffffu) >= threshold;                                 \
        mask[i] = keep;                                                                                         \
        y[i] = OUT(IN(x[i]) * (keep ? scale : 0.0f)); /* x * 0: a NaN stays NaN, as in torch */               \
      }                                                                                                         \
    }                                                                                                           \
  }                                                                                                             \
  void NAME##_backward(const T *g, const uint8_t *mask, T *out, int64_t n, float scale, int threads) {          \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                           \
    for (int64_t b = 0; b < n; b += DROPOUT_BLOCK) {                                                            \
      const int64_t e = b + DROPOUT_BLOCK < n ? b + DROPOUT_BLOCK : n;                                          \
      _Pragma("omp simd")                                                                                       \
      for (int64_t i = b; i < e; i++) out[i] = OUT(IN(g[i]) * (mask[i] ? scale : 0.0f));                       \
    }                                                                                                           \
  }

static inline float f32_in(float f) { return f; }
static inline float f32_out(float f) { return f; }
DROPOUT(xc_dropout_bf16, uint16_t, bf16_in, bf16_out)
DROPOUT(xc_dropout_f32, float, f32_in, f32_out)

#define ROW_MAX 4096 /* widest row (a layer norm's width) the output kernels take; the caller checks */
#define LANES 16     /* reductions over a row in this many partial sums: whole vectors, no per-row set-up */

/* Inside a parallel region, after a barrier: out[j] = the threads' partial sums scratch[t * stride + offset + j]
   added in thread order (so a thread count gives one result), columns shared among the threads. */
static void column_sums(const float *scratch, int nt, int64_t stride, int64_t offset, int64_t cols, float *out) {
#pragma omp for schedule(static)
  for (int64_t j = 0; j < cols; j++) {
    float s = 0.0f;
    for (int t = 0; t < nt; t++) s += scratch[(int64_t)t * stride + offset + j];
    out[j] = s;
  }
}

/* An encoder layer's output block after its bias-free matmul h: r = dropout(h + bias) + residual (rounded to bf16,
   as torch's add would give), y = layer_norm(r) * gamma + beta. Dropout as the dropout kernels above draw it
   (threshold 0 keeps all). Writes y, r (for the backward), the mask as bytes, each row's mean and 1/std. */
void xc_dense_out_bf16_forward(const uint16_t *h, const uint16_t *bias, const uint16_t *residual,
                               const uint16_t *gamma, const uint16_t *beta, uint16_t *y, uint16_t *r_out,
                               uint8_t *mask, float *mean_out, float *rstd_out, int64_t rows, int64_t cols,
                               uint64_t seed, uint32_t threshold, float scale, float eps, int threads) {
  const int64_t padded = (cols + LANES - 1) / LANES * LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < rows; row++) {
    float r[ROW_MAX + LANES], lane[LANES];
    const int64_t base = row * cols;
    const uint16_t *hr = h + base, *res = residual + base;
    uint16_t *ro = r_out + base;
    uint8_t *mr = mask + base;
#pragma omp simd
    for (int64_t j = 0; j < cols; j++) {
      const int64_t i = base + j;
      const uint64_t word = splitmix64(seed + (uint64_t)(i >> 2) * 0x9e3779b97f4a7c15ull);
      const uint8_t keep = ((word >> (16 * (i & 3))) & 0xffffu) >= threshold;
      const uint16_t rb = bf16_out((bf16_in(hr[j]) + bf16_in(bias[j])) * (keep ? scale : 0.0f) + bf16_in(res[j]));
      mr[j] = keep;
      ro[j] = rb;
      r[j] = bf16_in(rb);
    }
    for (int64_t j = cols; j < padded; j++) r[j] = 0.0f;
    for (int l = 0; l < LANES; l++) lane[l] = 0.0f;
    for (int64_t j = 0; j < padded; j += LANES)
      for (int l = 0; l < LANES; l++) lane[l] += r[j + l];
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += lane[l];
    const float mean = sum / (float)cols;
    for (int l = 0; l < LANES; l++) lane[l] = 0.0f;
    for (int64_t j = 0; j < cols; j++) r[j] -= mean;
    for (int64_t j = 0; j < padded; j += LANES)
      for (int l = 0; l < LANES; l++) lane[l] += r[j + l] * r[j + l];
    float ss = 0.0f;
    for (int l = 0; l < LANES; l++) ss += lane[l];
    const float rstd = 1.0f / sqrtf(ss / (float)cols + eps);
    uint16_t *yr = y + base;
#pragma omp simd
    for (int64_t j = 0; j < cols; j++) yr[j] = bf16_out(fmaf(r[j] * rstd, bf16_in(gamma[j]), bf16_in(beta[j])));
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

/* Its backward from grad (of y): the layer norm's input gradient g_r (bf16: the residual's gradient), the dropped
   gradient of h + bias (g_z = g_r * keep * scale), and the column sums of grad * xhat, grad and g_z: gamma's,
   beta's and the bias's gradients (per-thread partial sums in scratch, 3 x threads x cols floats). */
void xc_dense_out_bf16_backward(const uint16_t *grad, const uint16_t *r_in, const float *mean_in, const float *rstd_in,
                                const uint16_t *gamma, const uint8_t *mask, float scale, uint16_t *g_res,
                                uint16_t *g_z, float *d_gamma, float *d_beta, float *d_bias, float *scratch,
                                int64_t rows, int64_t cols, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    float *acc_g = scratch + (int64_t)me * 3 * cols, *acc_b = acc_g + cols, *acc_z = acc_b + cols;
    for (int64_t j = 0; j < 3 * cols; j++) acc_g[j] = 0.0f;
    const int64_t r0 = rows * me / nt, r1 = rows * (me + 1) / nt;
    const int64_t padded = (cols + LANES - 1) / LANES * LANES;
    for (int64_t row = r0; row < r1; row++) {
      float xh[ROW_MAX + LANES], gx[ROW_MAX + LANES], la[LANES], lb[LANES];
      const int64_t base = row * cols;
      const uint16_t *g = grad + base, *rr = r_in + base;
      const float mean = mean_in[row], rstd = rstd_in[row];
#pragma omp simd
      for (int64_t j = 0; j < cols; j++) {
        const float gj = bf16_in(g[j]), x = (bf16_in(rr[j]) - mean) * rstd;
        xh[j] = x;
        gx[j] = gj * bf16_in(gamma[j]);
        acc_g[j] += gj * x;
        acc_b[j] += gj;
      }
      for (int64_t j = cols; j < padded; j++) xh[j] = gx[j] = 0.0f;
      for (int l = 0; l < LANES; l++) la[l] = lb[l] = 0.0f;
      for (int64_t j = 0; j < padded; j += LANES)
        for (int l = 0; l < LANES; l++) {
          la[l] += gx[j + l];
          lb[l] += gx[j + l] * xh[j + l];
        }
      float a = 0.0f, b = 0.0f;
      for (int l = 0; l < LANES; l++) {
        a += la[l];
        b += lb[l];
      }
      a /= (float)cols;
      b /= (float)cols;
      uint16_t *gr = g_res + base, *gz = g_z + base;
      const uint8_t *mr = mask + base;
#pragma omp simd
      for (int64_t j = 0; j < cols; j++) {
        const uint16_t v = bf16_out(rstd * (gx[j] - a - xh[j] * b));
        const uint16_t z = bf16_out(bf16_in(v) * (mr[j] ? scale : 0.0f));
        gr[j] = v;
        gz[j] = z;
        acc_z[j] += bf16_in(z);
      }
    }
#pragma omp barrier
    column_sums(scratch, nt, 3 * cols, 0, cols, d_gamma);
    column_sums(scratch, nt, 3 * cols, cols, cols, d_beta);
    column_sums(scratch, nt, 3 * cols, 2 * cols, cols, d_bias);
  }
}
