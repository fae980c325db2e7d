/* CPU kernels the bundled jobs call through ctypes (training/native/__init__.py builds this file with the node's
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

/* exp(x) for x <= 0, as the softmax needs it: 2^k * e^r with |r| <= ln2/2 and e^r by its Taylor series to r^7
   (relative error ~1e-8, below fp32's rounding); 0 below -87 (fp32's smallest normal), as torch gives. */
static inline float exp_nonpositive(float x) {
  const float xc = x < -88.0f ? -88.0f : x; /* -inf: no infinite k below */
  const float k = rintf(xc * 1.44269504088896341f);
  float r = fmaf(k, -0.693145751953125f, xc);
  r = fmaf(k, -1.42860682030941723e-6f, r);
  float q = 1.0f / 5040.0f;
  q = fmaf(q, r, 1.0f / 720.0f);
  q = fmaf(q, r, 1.0f / 120.0f);
  q = fmaf(q, r, 1.0f / 24.0f);
  q = fmaf(q, r, 1.0f / 6.0f);
  q = fmaf(q, r, 0.5f);
  q = fmaf(q, r, 1.0f);
  q = fmaf(q, r, 1.0f);
  const int32_t e = ((int32_t)k + 127) << 23;
  float two_k;
  memcpy(&two_k, &e, 4);
  return x < -87.0f ? 0.0f : q * two_k;
}

#define ROW_MAX 4096 /* longest row (keys) the attention kernels take; the caller checks */
#define LANES 16     /* reductions over a row in this many partial sums: whole vectors, no per-row set-up */
#define VL LANES

/* Attention probabilities for training: p = softmax(scores * scaling + mask) over each row of `cols` keys, then
   dropout as above on p (seed, threshold, scale_drop; threshold 0 keeps all). Rows are (batch, head, query);
   mask (NULL: none) is fp32 with element strides mb, mh, mq for batch, head and query and 1 for keys. Writes y
   (the dropped probabilities), probs (p rounded as y is, for the backward) and keep (bytes). */
#define ATTN_PROBS(NAME, TI, IN, TO, OUT, IN_O, OUT_I)                                                             \
  void NAME##_forward(const TI *scores, const float *mask, int64_t heads, int64_t queries, int64_t cols,           \
                      int64_t mb, int64_t mh, int64_t mq, float scaling, TO *y, TO *probs, uint8_t *keep,           \
                      int64_t rows, uint64_t seed, uint32_t threshold, float scale_drop, int threads) {            \
    const int64_t padded = (cols + LANES - 1) / LANES * LANES;                                                    \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (int64_t row = 0; row < rows; row++) {                                                                    \
      float s[ROW_MAX + LANES], lane[LANES];                                                                      \
      const TI *in = scores + row * cols;                                                                         \
      const int64_t q = row % queries, h = (row / queries) % heads, b = row / (queries * heads);                  \
      const float *mrow = mask ? mask + b * mb + h * mh + q * mq : 0;                                             \
      if (mrow)                                                                                                   \
        for (int64_t j = 0; j < cols; j++) s[j] = IN(in[j]) * scaling + mrow[j];                                  \
      else                                                                                                        \
        for (int64_t j = 0; j < cols; j++) s[j] = IN(in[j]) * scaling;                                           \
      for (int64_t j = cols; j < padded; j++) s[j] = -INFINITY;                                                   \
      for (int l = 0; l < LANES; l++) lane[l] = -INFINITY;                                                       \
      for (int64_t j = 0; j < padded; j += LANES)                                                                 \
        for (int l = 0; l < LANES; l++) lane[l] = s[j + l] > lane[l] ? s[j + l] : lane[l];                       \
      float top = lane[0];                                                                                        \
      for (int l = 1; l < LANES; l++) top = lane[l] > top ? lane[l] : top;                                        \
      for (int l = 0; l < LANES; l++) lane[l] = 0.0f;                                                            \
      for (int64_t j = 0; j < padded; j += LANES)                                                                 \
        for (int l = 0; l < LANES; l++) {                                                                         \
          s[j + l] = exp_nonpositive(s[j + l] - top);                                                             \
          lane[l] += s[j + l];                                                                                    \
        }                                                                                                         \
      float sum = 0.0f;                                                                                           \
      for (int l = 0; l < LANES; l++) sum += lane[l];                                                            \
      const float inv = 1.0f / sum;                                                                               \
      TO *out = y + row * cols, *pr = probs + row * cols;                                                         \
      uint8_t *kp = keep + row * cols;                                                                            \
      /* the row's uniforms: its elements' words, drawn once each; little-endian, so the 16-bit halves of word w  \
         in memory are elements 4w .. 4w+3 */                                                                     \
      const int64_t first = row * cols, w0 = first >> 2, words = padded / 4 + 1;                                  \
      uint64_t draw[ROW_MAX / 4 + VL];                                                                            \
      for (int64_t w = 0; w < words; w++) draw[w] = splitmix64(seed + (uint64_t)(w0 + w) * 0x9e3779b97f4a7c15ull); \
      const uint16_t *u = (const uint16_t *)draw + (first & 3);                                                   \
      /* whole vectors into row buffers (no scalar remainder), then the row's own elements out */                 \
      TO yb[ROW_MAX + VL], pb[ROW_MAX + VL];                                                                      \
      uint8_t kb[ROW_MAX + VL];                                                                                   \
      for (int64_t j = 0; j < padded; j++) {                                                                      \
        const uint8_t k = u[j] >= threshold;                                                                      \
        const TO p = OUT(s[j] * inv);                                                                             \
        pb[j] = p;                                                                                                \
        kb[j] = k;                                                                                                \
        yb[j] = OUT(IN_O(p) * (k ? scale_drop : 0.0f));                                                           \
      }                                                                                                           \
      memcpy(out, yb, (size_t)cols * sizeof(TO));                                                                 \
      memcpy(pr, pb, (size_t)cols * sizeof(TO));                                                                  \
      memcpy(kp, kb, (size_t)cols);                                                                               \
    }                                                                                                             \
  }                                                                                                               \
  /* grad of scores from grad of y: g_p = g_y * keep * scale_drop, g_s = p * (g_p - sum(g_p * p)), times scaling */ \
  void NAME##_backward(const TO *grad, const TO *probs, const uint8_t *keep, int64_t rows, int64_t cols,          \
                       float scaling, float scale_drop, TI *out, int threads) {                                     \
    const int64_t padded = (cols + LANES - 1) / LANES * LANES;                                                    \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (int64_t row = 0; row < rows; row++) {                                                                    \
      float gp[ROW_MAX + LANES], p[ROW_MAX + LANES], lane[LANES];                                                 \
      const TO *g = grad + row * cols, *pr = probs + row * cols;                                                  \
      const uint8_t *kp = keep + row * cols;                                                                      \
      for (int64_t j = 0; j < cols; j++) {                                                                        \
        gp[j] = IN_O(g[j]) * (kp[j] ? scale_drop : 0.0f);                                                         \
        p[j] = IN_O(pr[j]);                                                                                       \
      }                                                                                                           \
      for (int64_t j = cols; j < padded; j++) gp[j] = p[j] = 0.0f;                                                \
      for (int l = 0; l < LANES; l++) lane[l] = 0.0f;                                                            \
      for (int64_t j = 0; j < padded; j += LANES)                                                                 \
        for (int l = 0; l < LANES; l++) lane[l] += gp[j + l] * p[j + l];                                          \
      float dot = 0.0f;                                                                                           \
      for (int l = 0; l < LANES; l++) dot += lane[l];                                                             \
      TI ob[ROW_MAX + VL];                                                                                        \
      for (int64_t j = 0; j < padded; j++) ob[j] = OUT_I(p[j] * (gp[j] - dot) * scaling);                        \
      memcpy(out + row * cols, ob, (size_t)cols * sizeof(TI));                                                    \
    }                                                                                                             \
  }

ATTN_PROBS(xc_attn_bf16, uint16_t, bf16_in, uint16_t, bf16_out, bf16_in, bf16_out)
ATTN_PROBS(xc_attn_bf16_f32, uint16_t, bf16_in, float, f32_out, f32_in, bf16_out)
ATTN_PROBS(xc_attn_f32, float, f32_in, float, f32_out, f32_in, f32_out)

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

/* GELU (erf form, torch's default) and its slope at x as torch's CPU kernels compute them: erf(x/sqrt2) by
   Abramowitz and Stegun 7.1.26 (absolute error < 1.5e-7, torch's vectorised erf), exp(-x^2/2) shared by erf and
   the density, y = x/2 (1 + erf), slope = (1 + erf)/2 + x phi(x). */
static inline void gelu_slope(float x, float *y, float *slope) {
  const float z = x * 0.70710678118654752f, az = fabsf(z);
  const float t = 1.0f / fmaf(0.3275911f, az, 1.0f);
  float r = 1.061405429f;
  r = fmaf(r, t, -1.453152027f);
  r = fmaf(r, t, 1.421413741f);
  r = fmaf(r, t, -0.284496736f);
  r = fmaf(r, t, 0.254829592f);
  const float e = exp_nonpositive(-(z * z));
  const float erf = copysignf(fmaf(-(t * r), e, 1.0f), x);
  const float cdf = 0.5f * (1.0f + erf);
  *y = x * 0.5f * (1.0f + erf);
  *slope = fmaf(x, e * 0.3989422804014327f, cdf);
}

/* round to nearest even without bf16_out's NaN test: for values computed from bf16 inputs, whose NaNs carry no
   payload in the low 16 bits */
static inline uint16_t bf16_out_computed(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The FFN's bias and GELU after a bias-free matmul: x = h + bias in fp32 (torch's addmm rounds it to bf16 first),
   y = gelu(x) and its slope, both bf16; rows x cols, bias one per column. */
void xc_bias_gelu_bf16_forward(const uint16_t *h, const uint16_t *bias, uint16_t *y, uint16_t *slope, int64_t rows,
                               int64_t cols, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *hr = h + r * cols;
    uint16_t *yr = y + r * cols, *sr = slope + r * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; j++) {
      float yv, sv;
      gelu_slope(bf16_in(hr[j]) + bf16_in(bias[j]), &yv, &sv);
      yr[j] = bf16_out_computed(yv);
      sr[j] = bf16_out_computed(sv);
    }
  }
}

/* Its backward: g_x = bf16(g_y * slope), and the bias gradient, the column sums of g_x in fp32 (partial sums per
   thread in scratch, threads x cols floats, then added in thread order). */
void xc_gelu_bf16_backward(const uint16_t *grad, const uint16_t *slope, uint16_t *out, float *bias_grad,
                           float *scratch, int64_t rows, int64_t cols, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    float *acc = scratch + (int64_t)me * cols;
    for (int64_t j = 0; j < cols; j++) acc[j] = 0.0f;
    const int64_t r0 = rows * me / nt, r1 = rows * (me + 1) / nt;
    for (int64_t r = r0; r < r1; r++) {
      const uint16_t *gr = grad + r * cols, *sr = slope + r * cols;
      uint16_t *o = out + r * cols;
#pragma omp simd
      for (int64_t j = 0; j < cols; j++) {
        const uint16_t v = bf16_out_computed(bf16_in(gr[j]) * bf16_in(sr[j]));
        o[j] = v;
        acc[j] += bf16_in(v);
      }
    }
#pragma omp barrier
    column_sums(scratch, nt, cols, 0, cols, bias_grad);
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
