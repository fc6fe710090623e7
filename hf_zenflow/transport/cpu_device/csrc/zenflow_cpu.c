/* CPU kernels of hf_zenflow's device path when the "device" is the CPU (compiled on first use by kernels.py).
 *
 * A weight matrix is [rows, cols] row-major; the selected input columns are `k` sorted indices into a row. Picking
 * 10% of the columns of a row touches ~80% of its cache lines, so every pass over the selected columns costs
 * nearly a pass over the whole matrix. These kernels therefore do the column work in the same row sweep as the
 * work that streams the row anyway, and run the sweep on several threads:
 *   - zf_norm_gather: sum of squares of the whole gradient row (the non-finite check and the norms) and the gather
 *     of its selected columns into a contiguous [rows, k] buffer (fp32, or bf16 as they are from a bf16 gradient);
 *     optionally each row's sum of squares as fp32
 *     (the selection scores of a matrix whose selectable units are its rows);
 *   - zf_scatter: write the (rounded) fp32 master columns into the parameter;
 *   - zf_accumulate: the host window sum, acc = g * coef (first step) or acc = fma(g, coef, acc), reading a bf16
 *     gradient directly (torch needs a conversion pass first); fma is what torch's vectorised add with alpha does.
 *     A bf16 sum is widened on load and the fp32 result rounded to nearest even on store, in the same loop.
 * Copies are exact; bf16 results round to nearest even exactly as torch does. Every call takes a batch of tensors
 * and splits them into fixed row chunks, so partial sums (and hence the norms) do not depend on the thread count.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZF_AVX512 1
#include <immintrin.h>
#else
#define ZF_AVX512 0
#endif
#include <stdlib.h>
#include <string.h>

enum { ZF_NORM_GATHER = 0, ZF_SCATTER = 1, ZF_ACCUMULATE = 3 };
#define ZF_CHUNK_ELEMS 32768
#define ZF_MAX_THREADS 64

typedef struct {
  int kind;
  int64_t n;                 /* tensors in the batch */
  void *const *big;          /* the [rows, cols] tensor: gradient (norm_gather, accumulate) or parameter (scatter) */
  const int32_t *big_bf16;   /* 1 when that tensor is bf16, 0 when fp32 */
  float *const *small;       /* the fp32 [rows, k] buffer: gather output, or the master columns to write;
                                accumulate: the window sum ([rows, cols], or [rows, k] when idx is given) */
  const int32_t *small_bf16; /* 1 when that buffer is bf16: norm_gather's output (of a bf16 gradient),
                                accumulate's window sum, or scatter's source into a bf16 tensor */
  float *const *row_sums;    /* norm_gather: per tensor, NULL or an fp32 [rows] output of row sums of squares */
  const int64_t *const *idx; /* sorted selected columns, k of them (may be NULL when k == 0) */
  int32_t **before;          /* accumulate with AVX-512: per tensor with idx, the idx columns before each column */
  const int64_t *rows, *cols, *k;
  int64_t *item_tensor, *item_row0, *item_row1;
  double *item_sum;
  float coef;  /* accumulate: the clip coefficient (1 when none) */
  int first;   /* accumulate: 1 on the first step of a window (overwrite instead of add) */
  int64_t n_items;
  atomic_llong next;
} zf_job;

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* c10::round_to_nearest_even */
  if (f != f) return 0x7FC0;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

/* Stochastic rounding to bf16 with the random 16-bit value r16: added to the low half of f's bits, which are then
 * dropped (up with probability (the dropped half) / 2^16: the exact value in expectation; rounding.py:round_bf16) */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r16) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + r16) >> 16);
}

/* lowbias32: the bijective 32-bit hash of the random bits (rounding.py:mix32) */
static inline uint32_t zf_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352DU;
  x ^= x >> 15;
  x *= 0x846CA68BU;
  return x ^ (x >> 16);
}

static double row_norm_gather(const zf_job *job, int64_t t, int64_t r) {
  const int64_t cols = job->cols[t], k = job->k[t];
  const int64_t *idx = job->idx[t];
  double s = 0.0;
  if (job->big_bf16[t]) {
    const uint16_t *row = (const uint16_t *)job->big[t] + r * cols;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < cols; ++c) {
      double x = bf16_to_f32(row[c]);
      s += x * x;
    }
    if (job->small_bf16[t]) {
      uint16_t *out16 = (uint16_t *)job->small[t] + r * k;
      for (int64_t j = 0; j < k; ++j) out16[j] = row[idx[j]];
    } else {
      float *out = job->small[t] + r * k;
      for (int64_t j = 0; j < k; ++j) out[j] = bf16_to_f32(row[idx[j]]);
    }
  } else {
    float *out = job->small[t] + r * k;
    const float *row = (const float *)job->big[t] + r * cols;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < cols; ++c) {
      double x = row[c];
      s += x * x;
    }
    for (int64_t j = 0; j < k; ++j) out[j] = row[idx[j]];
  }
  if (job->row_sums && job->row_sums[t]) job->row_sums[t][r] = (float)s;
  return s;
}

static void row_scatter(const zf_job *job, int64_t t, int64_t r) {
  const int64_t cols = job->cols[t], k = job->k[t];
  const int64_t *idx = job->idx[t];
  const float *src = job->small[t] + r * k;
  if (job->small_bf16[t]) { /* a bf16 source into a bf16 tensor: the bits as they are */
    const uint16_t *src16 = (const uint16_t *)(const void *)job->small[t] + r * k;
    uint16_t *row = (uint16_t *)job->big[t] + r * cols;
    for (int64_t j = 0; j < k; ++j) row[idx[j]] = src16[j];
    return;
  }
  if (job->big_bf16[t]) {
    uint16_t *row = (uint16_t *)job->big[t] + r * cols;
    for (int64_t j = 0; j < k; ++j) row[idx[j]] = f32_to_bf16(src[j]);
  } else {
    float *row = (float *)job->big[t] + r * cols;
    for (int64_t j = 0; j < k; ++j) row[idx[j]] = src[j];
  }
}

/* acc[0, n) += g[0, n) * coef (acc = g * coef when first), fp32 or bf16 on either side: the fp32 fma of torch's
 * vectorised add_(g, alpha=coef); a bf16 window sum is widened, gets the same fp32 rule and is rounded to nearest
 * even after every add */
static inline void accumulate_run(void *acc_p, int acc16, const void *g_p, int g16, int64_t n, float coef,
                                  int first) {
  if (acc16) {
    uint16_t *acc = (uint16_t *)acc_p;
    if (g16) {
      const uint16_t *g = (const uint16_t *)g_p;
      if (first) {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] = f32_to_bf16(bf16_to_f32(g[c]) * coef);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] = f32_to_bf16(fmaf(bf16_to_f32(g[c]), coef, bf16_to_f32(acc[c])));
      }
    } else {
      const float *g = (const float *)g_p;
      if (first) {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] = f32_to_bf16(g[c] * coef);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] = f32_to_bf16(fmaf(g[c], coef, bf16_to_f32(acc[c])));
      }
    }
    return;
  }
  float *acc = (float *)acc_p;
  if (g16) {
    const uint16_t *g = (const uint16_t *)g_p;
    if (first) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) acc[c] = bf16_to_f32(g[c]) * coef;
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) acc[c] = fmaf(bf16_to_f32(g[c]), coef, acc[c]);
    }
  } else {
    const float *g = (const float *)g_p;
    if (first) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) acc[c] = g[c] * coef;
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) acc[c] = fmaf(g[c], coef, acc[c]);
    }
  }
}

#if ZF_AVX512
static inline __m512 bf16_to_f32_x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* row_accumulate's kept columns: by pieces of ZF_COMPRESS_COLS columns, the gradient's kept values compressed into
 * consecutive fp32 lanes of a buffer on the stack (16 columns at a time: one compress, one store), then added into
 * the sum by the contiguous loop of a whole row (accumulate_run: the same arithmetic per element) */
#define ZF_COMPRESS_COLS 1024
static void row_accumulate_compressed(const int32_t *b, int64_t cols, const uint16_t *g16, const float *g32,
                                      char *acc, int acc16, int64_t at, float coef, int first) {
  float kept[ZF_COMPRESS_COLS + 16];
  const size_t size = acc16 ? 2 : 4;
  for (int64_t c0 = 0; c0 < cols; c0 += ZF_COMPRESS_COLS) {
    const int64_t c1 = c0 + ZF_COMPRESS_COLS < cols ? c0 + ZF_COMPRESS_COLS : cols;
    int64_t c = c0, n = 0;
    for (; c + 16 <= c1; c += 16) {
      const __mmask16 keep = _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(b + c), _mm512_loadu_si512(b + c + 1));
      const __m512 g = g16 ? bf16_to_f32_x16(_mm256_loadu_si256((const __m256i *)(const void *)(g16 + c)))
                           : _mm512_loadu_ps(g32 + c);
      _mm512_storeu_ps(kept + n, _mm512_maskz_compress_ps(keep, g)); /* (lanes past the kept ones: overwritten) */
      n += b[c + 16] - b[c];
    }
    for (; c < c1; ++c)
      if (b[c + 1] > b[c]) kept[n++] = g16 ? bf16_to_f32(g16[c]) : g32[c];
    accumulate_run(acc + (at + b[c0]) * (int64_t)size, acc16, kept, 0, n, coef, first);
  }
}
#endif

/* A row of the gradient into its window sum: the whole row, or, with an index (a sum that keeps the columns idx
 * only, [rows, k]), the kept columns, element by element with the same arithmetic (runs of consecutive kept columns
 * are short: a tenth of the columns on the device leaves runs of about 9) */
static void row_accumulate(const zf_job *job, int64_t t, int64_t r) {
  const int64_t cols = job->cols[t], k = job->k[t];
  const int acc16 = job->small_bf16[t], g16 = job->big_bf16[t];
  const float coef = job->coef;
  const int first = job->first;
  if (k == 0) {
    accumulate_run((char *)(void *)job->small[t] + r * cols * (acc16 ? 2 : 4), acc16,
                   (const char *)job->big[t] + r * cols * (g16 ? 2 : 4), g16, cols, coef, first);
    return;
  }
  const int64_t *idx = job->idx[t];
  const uint16_t *g16_row = g16 ? (const uint16_t *)job->big[t] + r * cols : NULL;
  const float *g32_row = g16 ? NULL : (const float *)job->big[t] + r * cols;
#if ZF_AVX512
  if (job->before && job->before[t]) {
    row_accumulate_compressed(job->before[t], cols, g16_row, g32_row, (char *)(void *)job->small[t], acc16, r * k,
                              coef, first);
    return;
  }
#endif
  if (acc16) {
    uint16_t *acc = (uint16_t *)(void *)job->small[t] + r * k;
    for (int64_t j = 0; j < k; ++j) {
      const float x = g16_row ? bf16_to_f32(g16_row[idx[j]]) : g32_row[idx[j]];
      acc[j] = f32_to_bf16(first ? x * coef : fmaf(x, coef, bf16_to_f32(acc[j])));
    }
  } else {
    float *acc = job->small[t] + r * k;
    for (int64_t j = 0; j < k; ++j) {
      const float x = g16_row ? bf16_to_f32(g16_row[idx[j]]) : g32_row[idx[j]];
      acc[j] = first ? x * coef : fmaf(x, coef, acc[j]);
    }
  }
}

static void *worker(void *arg) {
  zf_job *job = (zf_job *)arg;
  for (;;) {
    int64_t i = atomic_fetch_add(&job->next, 1);
    if (i >= job->n_items) break;
    const int64_t t = job->item_tensor[i];
    double s = 0.0;
    for (int64_t r = job->item_row0[i]; r < job->item_row1[i]; ++r) {
      if (job->kind == ZF_NORM_GATHER) s += row_norm_gather(job, t, r);
      else if (job->kind == ZF_SCATTER) row_scatter(job, t, r);
      else row_accumulate(job, t, r);
    }
    job->item_sum[i] = s;
  }
  return NULL;
}

/* Runs one batch; `sums` (n doubles, may be NULL) receives each tensor's sum of squares (norm_gather).
 * Returns 0, or -1 when memory for the work list could not be allocated. */
/* Runs `fn(job)` on `threads` threads (at most one per work item) and returns when all are done: the calling thread
 * works too, and a helper that fails to start only costs speed (the items are taken from a shared counter). */
static void run_team(int threads, int64_t n_items, void *(*fn)(void *), void *job) {
  if (threads < 1) threads = 1;
  if (threads > ZF_MAX_THREADS) threads = ZF_MAX_THREADS;
  if (threads > n_items) threads = n_items > 0 ? (int)n_items : 1;
  pthread_t helpers[ZF_MAX_THREADS];
  int started = 0;
  for (int h = 1; h < threads; ++h)
    if (pthread_create(&helpers[started], NULL, fn, job) == 0) ++started;
  fn(job);
  for (int h = 0; h < started; ++h) pthread_join(helpers[h], NULL);
}

#if ZF_AVX512
static void free_before(zf_job *job) {
  if (!job->before) return;
  for (int64_t t = 0; t < job->n; ++t) free(job->before[t]);
  free(job->before);
  job->before = NULL;
}
#endif

int zf_run(int kind, int64_t n, void *const *big, const int32_t *big_bf16, float *const *small,
           const int32_t *small_bf16, float *const *row_sums, const int64_t *const *idx, const int64_t *rows,
           const int64_t *cols, const int64_t *k, int threads, double *sums, float coef, int first) {
  zf_job job = {.kind = kind, .n = n, .big = big, .big_bf16 = big_bf16, .small = small, .small_bf16 = small_bf16,
                .row_sums = row_sums,
                .idx = idx, .rows = rows, .cols = cols, .k = k, .coef = coef, .first = first};
  int64_t n_items = 0;
  for (int64_t t = 0; t < n; ++t) {
    int64_t per = cols[t] > 0 ? ZF_CHUNK_ELEMS / cols[t] : rows[t];
    if (per < 1) per = 1;
    n_items += (rows[t] + per - 1) / per;
  }
  job.item_tensor = malloc(sizeof(int64_t) * (size_t)(n_items + 1));
  job.item_row0 = malloc(sizeof(int64_t) * (size_t)(n_items + 1));
  job.item_row1 = malloc(sizeof(int64_t) * (size_t)(n_items + 1));
  job.item_sum = calloc((size_t)(n_items + 1), sizeof(double));
  if (!job.item_tensor || !job.item_row0 || !job.item_row1 || !job.item_sum) {
    free(job.item_tensor); free(job.item_row0); free(job.item_row1); free(job.item_sum);
    return -1;
  }
  int64_t i = 0;
  for (int64_t t = 0; t < n; ++t) {
    int64_t per = cols[t] > 0 ? ZF_CHUNK_ELEMS / cols[t] : rows[t];
    if (per < 1) per = 1;
    for (int64_t r = 0; r < rows[t]; r += per, ++i) {
      job.item_tensor[i] = t;
      job.item_row0[i] = r;
      job.item_row1[i] = r + per < rows[t] ? r + per : rows[t];
    }
  }
  job.n_items = n_items;
#if ZF_AVX512
  if (kind == ZF_ACCUMULATE) { /* the kept columns as counts before each column: what the compressed add reads */
    int ok = (job.before = calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t *))) != NULL;
    for (int64_t t = 0; ok && t < n; ++t) {
      if (k[t] == 0) continue;
      ok = (job.before[t] = malloc(sizeof(int32_t) * (size_t)(cols[t] + 1))) != NULL;
      for (int64_t c = 0, j = 0; ok && c <= cols[t]; ++c) {
        job.before[t][c] = (int32_t)j;
        if (c < cols[t] && j < k[t] && idx[t][j] == c) ++j;
      }
    }
    if (!ok) {
      free_before(&job);
      free(job.item_tensor); free(job.item_row0); free(job.item_row1); free(job.item_sum);
      return -1;
    }
  }
#endif
  atomic_init(&job.next, 0);
  run_team(threads, n_items, worker, &job);
#if ZF_AVX512
  free_before(&job);
#endif
  if (sums) {
    for (int64_t t = 0; t < n; ++t) sums[t] = 0.0;
    for (int64_t j = 0; j < n_items; ++j) sums[job.item_tensor[j]] += job.item_sum[j]; /* fixed order */
  }
  free(job.item_tensor); free(job.item_row0); free(job.item_row1); free(job.item_sum);
  return 0;
}

/* ---- zf_window_adamw: the host AdamW of a window in one pass over the state -----------------------------------
 * Per element: the window's gradient sum, with the last step's gradient folded in (g = grad * coef on a one-step
 * window, else fma(grad, coef, acc), as zf_accumulate; acc alone when that gradient was summed already), divided by
 * the window's length (a true division, as torch's div_ by an integer), then AdamW exactly as torch's fused CPU
 * kernel (ATen FusedAdamKernel.cpp, ADAMW mode, fp32) as this torch build computes it: its vectorised body for
 * every element but the last numel % `width` of each tensor, which torch runs through its scalar tail, whose
 * second-moment update its compiler contracted differently (see adam_range). `width` is torch's
 * Vectorized<float>::size() (16 with
 * AVX512, 8 otherwise). The file is compiled without contraction (-ffp-contract=off): every multiply and add
 * rounds as torch's do, and the fmaf calls are the fmas torch's build makes. The accumulator is left as it was
 * (the next window overwrites it). A bf16 accumulator (acc_bf16) is widened as it is read, and a folded gradient's
 * sum rounded to nearest bf16 before the division, as zf_accumulate would have stored it. */
typedef struct {
  int64_t n;
  float *const *master, *const *acc, *const *exp_avg, *const *exp_avg_sq;
  const void *const *grad;   /* per tensor: the last step's gradient, or NULL (already summed) */
  const int32_t *grad_bf16;  /* 1 when that gradient is bf16 */
  const int32_t *first;      /* 1 when the window's sum is that gradient alone (acc not read) */
  const int32_t *acc_bf16;   /* 1 when that tensor's accumulator is bf16 (its bits, storage order) */
  const int64_t *count, *numel;
  const double *step;        /* the step count after this update, as torch reads it */
  double lr, beta1, beta2, eps, weight_decay;
  float coef;
  int64_t width;
  /* 8-bit moments (NULL for fp32 moments in exp_avg / exp_avg_sq): per tensor the codes, storage order, and one
     fp32 scale per ZF_QBLOCK elements (hf_zenflow/engine/quantized_moments.py) */
  int8_t *const *m_codes;
  uint8_t *const *v_codes;
  float *const *m_scale, *const *v_scale;
  /* bf16 moments (NULL otherwise): per tensor the moments' bf16 bits, storage order */
  uint16_t *const *m_bf16, *const *v_bf16;
  /* a window sum that keeps some columns (rows, acc_rows) only (NULL, or NULL per tensor: every element): per tensor
     acc_map, the kept columns (rows) before each column (row) c of the [.., cols] matrix, c = 0 .. its count (c is
     kept when acc_map[c + 1] > acc_map[c], at acc_map[c] in the kept sum; the others read as 0), acc_skip, the
     columns (rows) not kept, sorted; the matrix's row length and the kept sum's row length */
  const int32_t *const *acc_map;
  const int32_t *const *acc_skip;
  const int32_t *acc_rows;
  const int64_t *cols, *acc_kept;
  /* bf16 and 8-bit moments: per tensor the 64-bit key of this pass's random bits, and where its elements sit in the
     whole parameter: local element e (storage order, rows of g_local element) is global element
     g_base + (e / g_local) * g_global + e % g_local (see random_block) */
  const uint64_t *round_key;
  const int64_t *g_base, *g_local, *g_global;
  int64_t *item_tensor, *item_begin, *item_end;
  int64_t n_items;
  atomic_llong next;
} zf_adam_job;

/* ---- 8-bit moments: blocks of ZF_QBLOCK elements, each with an fp32 scale A (the block's largest magnitude) ------
 * Each element is stored as y = |x| / A in [0, 1] (a product by the reciprocal 1 / A) on a floating-point code with
 * 3 mantissa bits: y's fp32 bits rounded stochastically at bit 20 (sign-less exponent and 3 mantissa bits), less a
 * bias that makes 1.0 the top code. exp_avg: int8, the sign apart, codes 0..127 (16 binades; 0 under them);
 * exp_avg_sq: uint8, codes 1..255 (32 binades; the floor of 1 keeps every element of a non-zero block above zero).
 * Decoding puts the code plus the bias back at bit 20 and multiplies by A. Integer steps and one product each way:
 * the torch version (hf_zenflow/engine/quantized_moments.py) gives the same bits. */
#define ZF_QBLOCK 256
#define ZF_ONE_BITS20 1016 /* (the fp32 bits of 1.0f) >> 20 */

typedef union {
  float f;
  int32_t i;
} zf_bits;

/* y >= 0 rounded stochastically at bit 20 with the random r (< 2^20): the code below y, or the one above with
 * probability (y's bits under bit 20) / 2^20; y = 1 + 2^-23 (see quant_block) would reach past the top code */
static inline int32_t code_of(float y, int32_t top, uint32_t r) {
  zf_bits u = {.f = y};
  const int32_t c = (int32_t)(((uint32_t)u.i + r) >> 20) - (ZF_ONE_BITS20 - top);
  return c < top ? c : top;
}

static inline float value_of(int32_t code, int32_t top) {
  zf_bits u = {.i = (code + (ZF_ONE_BITS20 - top)) << 20};
  return u.f;
}

static inline void dequant_signed(const int8_t *restrict q, float scale, float *restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const int32_t c = q[i], mag = c < 0 ? -c : c;
    const float v = (mag ? value_of(mag, 127) : 0.0f) * scale;
    out[i] = c < 0 ? -v : v;
  }
}

static inline void dequant_unsigned(const uint8_t *restrict q, float scale, float *restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = value_of(q[i], 255) * scale;
}

/* Both moments' scales and codes of `n` elements (one quantisation block), from their fp32 values, rounded
 * stochastically with the random bits `rnd` (low 16 bits: exp_avg, high 16: exp_avg_sq, each placed at bits 4..19).
 * Comparisons, not fmaxf / fminf (library calls that keep the loops scalar; the moments are finite). y <= 1 + 2^-23
 * (|x| <= A times the rounded 1 / A): code_of caps the code at the top one; the lower bounds are the clamps. */
static inline void quant_block(const float *restrict m, const float *restrict v, int8_t *restrict qm,
                               uint8_t *restrict qv, int64_t n, float *m_scale, float *v_scale,
                               const uint32_t *restrict rnd) {
  float pm = 0.0f, pv = 0.0f;
#pragma omp simd reduction(max : pm, pv)
  for (int64_t i = 0; i < n; ++i) {
    const float a = fabsf(m[i]);
    pm = a > pm ? a : pm;
    pv = v[i] > pv ? v[i] : pv;
  }
  const float im = 1.0f / (pm > 0.0f ? pm : 1.0f), iv = 1.0f / (pv > 0.0f ? pv : 1.0f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    zf_bits b = {.f = m[i]};
    const int32_t sign = b.i >> 31; /* 0 or -1 */
    int32_t c = code_of(fabsf(m[i]) * im, 127, (rnd[i] & 0xFFFFu) << 4);
    c = c < 0 ? 0 : c;
    qm[i] = (int8_t)((c ^ sign) - sign);
    const int32_t d = code_of(v[i] * iv, 255, (rnd[i] >> 16) << 4);
    qv[i] = (uint8_t)(d < 1 ? 1 : d);
  }
  *m_scale = pm;
  *v_scale = pv;
}

#define ZF_ADAM_BLOCK 1024

typedef struct {
  float decay, w, b2, c2, bc2_sqrt, eps, neg_step;
} zf_adam_consts;

/* AdamW on `n` elements whose gradient is in `g` (an L1-resident block). small_w: torch's lerp form for a weight
 * under 0.5; scalar_v: the second-moment contraction of torch's scalar tail (see above). Both are constants at
 * every call, so each combination compiles to its own vectorised loop. `hashed` (a constant too; 8-bit moments whose
 * elements' global indices run from `lo` on): the loop also writes their random bits into `rnd`,
 * zf_mix32((lo + i) ^ kc) (random_block's, in the integer units that the loop's divisions and square root leave
 * idle). */
static inline __attribute__((always_inline)) void adam_block(float *restrict p, float *restrict m,
                                                             float *restrict v, const float *restrict g, int64_t n,
                                                             const zf_adam_consts *k, const int small_w,
                                                             const int scalar_v, uint32_t *restrict rnd, uint32_t lo,
                                                             uint32_t kc, const int hashed) {
  const float decay = k->decay, w = k->w, b2 = k->b2, c2 = k->c2, bc2_sqrt = k->bc2_sqrt, eps = k->eps;
  const float neg_step = k->neg_step, cw = small_w ? w : w - 1.0f;
  const uint32_t count = (uint32_t)n; /* (a 32-bit counter: see random_block) */
#pragma omp simd
  for (uint32_t i = 0; i < count; ++i) {
    if (hashed) rnd[i] = zf_mix32((lo + i) ^ kc);
    const float gi = g[i], mi = m[i];
    const float pv = p[i] * decay; /* (x 1.0f when there is no weight decay: exact) */
    const float mv = fmaf(cw, gi - mi, small_w ? mi : gi);
    const float vv = scalar_v ? fmaf(v[i], b2, (c2 * gi) * gi) : fmaf(c2 * gi, gi, v[i] * b2);
    const float denom = sqrtf(vv) / bc2_sqrt + eps;
    p[i] = pv + (neg_step * mv) / denom;
    m[i] = mv;
    v[i] = vv;
  }
}

/* adam_block on bf16 moments: each widened on load (exactly) and rounded back stochastically on store with its
 * random bits (low 16 bits: exp_avg, high 16: exp_avg_sq), in the same loop (the bits of widening the moments,
 * torch's fp32 update and rounding.py:round_bf16); the bits are read from `rnd`, or, `hashed` (a constant),
 * made in the loop as adam_block makes them */
static inline __attribute__((always_inline)) void adam_block_bf16(float *restrict p, uint16_t *restrict m,
                                                                  uint16_t *restrict v, const float *restrict g,
                                                                  const uint32_t *restrict rnd, int64_t n,
                                                                  const zf_adam_consts *k, const int small_w,
                                                                  const int scalar_v, uint32_t lo, uint32_t kc,
                                                                  const int hashed) {
  const float decay = k->decay, w = k->w, b2 = k->b2, c2 = k->c2, bc2_sqrt = k->bc2_sqrt, eps = k->eps;
  const float neg_step = k->neg_step, cw = small_w ? w : w - 1.0f;
  const uint32_t count = (uint32_t)n; /* (a 32-bit counter: see random_block) */
#pragma omp simd
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t r = hashed ? zf_mix32((lo + i) ^ kc) : rnd[i];
    const float gi = g[i], mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
    const float pv = p[i] * decay; /* (x 1.0f when there is no weight decay: exact) */
    const float mv = fmaf(cw, gi - mi, small_w ? mi : gi);
    const float vv = scalar_v ? fmaf(vi, b2, (c2 * gi) * gi) : fmaf(c2 * gi, gi, vi * b2);
    const float denom = sqrtf(vv) / bc2_sqrt + eps;
    p[i] = pv + (neg_step * mv) / denom;
    m[i] = f32_to_bf16_sr(mv, r & 0xFFFFu);
    v[i] = f32_to_bf16_sr(vv, r >> 16);
  }
}

/* The block [b0, b0 + n) of a sum that keeps some columns (or rows) only, in fp32 in `wide` (zeros where not kept):
 * the kept values widened as a bf16 accumulator's would be, so the pass reads the bits of a full sum there */
/* `n` values of a kept sum from `src` (bf16 bits when acc16), widened into `out` */
static inline void widen_run(float *restrict out, const void *src, int64_t n, int acc16) {
  if (acc16) {
    const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_f32(h[j]);
  } else {
    memcpy(out, src, sizeof(float) * (size_t)n);
  }
}

static void spread_block(const zf_adam_job *job, int64_t t, int64_t b0, int64_t n, float *restrict wide) {
  const int32_t *before = job->acc_map[t];
  const int64_t cols = job->cols[t], kept = job->acc_kept[t];
  const int acc16 = job->acc_bf16[t];
  const size_t size = acc16 ? 2 : 4;
  const char *acc = (const char *)job->acc[t];
  for (int64_t i = 0, e = b0; i < n;) {
    const int64_t r = e / cols, c = e - r * cols;
    const int64_t len = cols - c < n - i ? cols - c : n - i;
    float *restrict out = wide + i;
    if (job->acc_rows[t]) { /* kept rows: a kept row is a contiguous row of the sum */
      if (before[r + 1] > before[r])
        widen_run(out, acc + ((int64_t)before[r] * cols + c) * size, len, acc16);
      else
        memset(out, 0, sizeof(float) * (size_t)len);
    } else { /* kept columns: row r of the sum holds them in order */
      const char *src = acc + (r * kept + before[c]) * (int64_t)size;
#if ZF_AVX512
      /* 16 columns at a time: their kept values loaded consecutively and expanded into place (zeros between) */
      int64_t j = 0;
      const int32_t *b = before + c;
      for (; j + 16 <= len; j += 16) {
        const __mmask16 keep = _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(b + j), _mm512_loadu_si512(b + j + 1));
        const int count = b[j + 16] - b[j];
        __m512 v;
        if (acc16) {
          const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1u), src);
          v = _mm512_maskz_expand_ps(keep, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        } else {
          v = _mm512_maskz_expandloadu_ps(keep, src);
        }
        _mm512_storeu_ps(out + j, v);
        src += count * (int64_t)size;
      }
      for (; j < len; ++j) {
        const int k = b[j + 1] - b[j];
        out[j] = !k     ? 0.0f
                 : acc16 ? bf16_to_f32(*(const uint16_t *)(const void *)src)
                         : *(const float *)(const void *)src;
        src += k * (int64_t)size;
      }
#else
      /* in runs between the columns not kept (zeros) */
      const int32_t *skip = job->acc_skip[t];
      const int64_t n_skip = cols - kept;
      int64_t s = c - before[c]; /* the first column not kept at or after c */
      for (int64_t j = 0; j < len;) {
        int64_t next = s < n_skip ? skip[s] - c : len;
        if (next > len) next = len;
        widen_run(out + j, src, next - j, acc16);
        src += (next - j) * (int64_t)size;
        j = next;
        if (j < len) {
          out[j++] = 0.0f;
          ++s;
        }
      }
#endif
    }
    i += len;
    e += len;
  }
}

/* The random bits of elements [b0, b0 + n) of tensor t in this pass (rounding.py:RandomStream.bits):
 * zf_mix32((global index mod 2^32) ^ k), k = (low word of the pass's key) ^ zf_mix32(high word of the index + high
 * word of the key), by runs of consecutive global indices (a row of a share of columns; never across a multiple of
 * 2^32) */
static void random_block(const zf_adam_job *job, int64_t t, int64_t b0, int64_t n, uint32_t *restrict out) {
  const uint64_t key = job->round_key[t];
  const int64_t local = job->g_local[t], global = job->g_global[t];
  for (int64_t i = 0, e = b0; i < n;) {
    int64_t len = n - i;
    uint64_t g = (uint64_t)(job->g_base[t] + e);
    if (local > 0 && local != global) {
      const int64_t r = e / local, c = e - r * local;
      len = local - c < len ? local - c : len;
      g = (uint64_t)(job->g_base[t] + r * global + c);
    }
    const uint64_t room = (1ull << 32) - (g & 0xFFFFFFFFull);
    if ((uint64_t)len > room) len = (int64_t)room;
    const uint32_t k = (uint32_t)key ^ zf_mix32((uint32_t)(g >> 32) + (uint32_t)(key >> 32)), lo = (uint32_t)g;
    uint32_t *restrict o = out + i;
    /* (a 32-bit counter: a 64-bit one costs more lane shuffles than the hash itself) */
    const uint32_t count = (uint32_t)len;
#pragma omp simd
    for (uint32_t j = 0; j < count; ++j) o[j] = zf_mix32((lo + j) ^ k);
    i += len;
    e += len;
  }
}

static void adam_range(const zf_adam_job *job, int64_t t, int64_t begin, int64_t end) {
  const double bc1 = 1 - pow(job->beta1, job->step[t]);
  const double bc2 = 1 - pow(job->beta2, job->step[t]);
  const double step_size = job->lr / bc1;
  const zf_adam_consts k = {.decay = (float)(1 - job->lr * job->weight_decay), .w = (float)(1 - job->beta1),
                            .b2 = (float)job->beta2, .c2 = (float)(1 - job->beta2), .bc2_sqrt = (float)sqrt(bc2),
                            .eps = (float)job->eps, .neg_step = (float)(-step_size)};
  const int small_w = fabsf(k.w) < 0.5f;
  /* torch's vectorised body, and the 8-wide vectorised part of its scalar tail, contract the second moment's
     update as fma(c2 * g, g, v * b2); the rest of the tail (from `scalar_from`) as fma(v, b2, (c2 * g) * g) */
  const int64_t tail = job->numel[t] - job->numel[t] % job->width;
  const int64_t scalar_from = tail + (job->numel[t] - tail) / 8 * 8;
  float *p = job->master[t], *acc = job->acc[t];
  const int narrow = job->m_codes || job->m_bf16; /* moments stored in another dtype than fp32 */
  float *m = narrow ? NULL : job->exp_avg[t], *v = narrow ? NULL : job->exp_avg_sq[t];
  float mq[ZF_ADAM_BLOCK], vq[ZF_ADAM_BLOCK]; /* 8-bit moments: the block's fp32 values */
  uint32_t rnd[ZF_ADAM_BLOCK];                /* narrow moments: the block's random bits */
  const void *gp = job->grad[t];
  const int bf16 = job->grad_bf16[t], first = job->first[t], acc16 = job->acc_bf16[t];
  const float coef = job->coef, count = (float)job->count[t];
  float g[ZF_ADAM_BLOCK], wide[ZF_ADAM_BLOCK]; /* wide: a block of a bf16 accumulator, widened */
  for (int64_t b0 = begin; b0 < end; b0 += ZF_ADAM_BLOCK) {
    const int64_t n = end - b0 < ZF_ADAM_BLOCK ? end - b0 : ZF_ADAM_BLOCK;
    const float *a = acc + b0;
    if (job->acc_map && job->acc_map[t]) {
      if (!(gp && first)) {
        spread_block(job, t, b0, n, wide);
        a = wide;
      }
    } else if (acc16 && !(gp && first)) {
      const uint16_t *h = (const uint16_t *)(const void *)acc + b0;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) wide[i] = bf16_to_f32(h[i]);
      a = wide;
    }
    /* the window's gradient sum, as zf_accumulate would leave it, then its mean (a true division, as div_) */
    if (!gp || !first) memcpy(g, a, sizeof(float) * (size_t)n);
    if (gp) accumulate_run(g, 0, (const char *)gp + b0 * (bf16 ? 2 : 4), bf16, n, coef, first);
    if (acc16 && gp) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) g[i] = bf16_to_f32(f32_to_bf16(g[i]));
    }
    if (job->count[t] > 1) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) g[i] = g[i] / count;
    }
    /* [b0, split): the vector form; [split, b0 + n): the scalar tail's */
    const int64_t split = scalar_from < b0 ? 0 : (scalar_from - b0 < n ? scalar_from - b0 : n);
    float *pb = p + b0, *mb = mq, *vb = vq;
    /* narrow moments of consecutive global indices (a share of whole rows) under one high word: their random bits
       are made in the AdamW loop (adam_block, adam_block_bf16); others (a share of columns): here */
    const uint64_t first_index = narrow ? (uint64_t)(job->g_base[t] + b0) : 0;
    const int bits_in_loop = narrow && (job->g_local[t] == 0 || job->g_local[t] == job->g_global[t]) &&
                             (first_index & 0xFFFFFFFFull) + (uint64_t)n <= (1ull << 32);
    uint32_t *loop_bits = bits_in_loop ? rnd : NULL, lo = (uint32_t)first_index, kc = 0;
    if (bits_in_loop) {
      const uint64_t key = job->round_key[t];
      kc = (uint32_t)key ^ zf_mix32((uint32_t)(first_index >> 32) + (uint32_t)(key >> 32));
    } else if (narrow) {
      random_block(job, t, b0, n, rnd);
    }
    if (job->m_bf16) {
      uint16_t *mh = job->m_bf16[t] + b0, *vh = job->v_bf16[t] + b0;
      const uint32_t lt = lo + (uint32_t)split;
      if (small_w && loop_bits) {
        adam_block_bf16(pb, mh, vh, g, rnd, split, &k, 1, 0, lo, kc, 1);
        adam_block_bf16(pb + split, mh + split, vh + split, g + split, rnd + split, n - split, &k, 1, 1, lt, kc, 1);
      } else if (small_w) {
        adam_block_bf16(pb, mh, vh, g, rnd, split, &k, 1, 0, 0, 0, 0);
        adam_block_bf16(pb + split, mh + split, vh + split, g + split, rnd + split, n - split, &k, 1, 1, 0, 0, 0);
      } else if (loop_bits) {
        adam_block_bf16(pb, mh, vh, g, rnd, split, &k, 0, 0, lo, kc, 1);
        adam_block_bf16(pb + split, mh + split, vh + split, g + split, rnd + split, n - split, &k, 0, 1, lt, kc, 1);
      } else {
        adam_block_bf16(pb, mh, vh, g, rnd, split, &k, 0, 0, 0, 0, 0);
        adam_block_bf16(pb + split, mh + split, vh + split, g + split, rnd + split, n - split, &k, 0, 1, 0, 0, 0);
      }
      continue;
    }
    if (job->m_codes) { /* (b0 is a multiple of ZF_ADAM_BLOCK, itself a multiple of ZF_QBLOCK) */
      for (int64_t q0 = 0; q0 < n; q0 += ZF_QBLOCK) {
        const int64_t len = n - q0 < ZF_QBLOCK ? n - q0 : ZF_QBLOCK, blk = (b0 + q0) / ZF_QBLOCK;
        dequant_signed(job->m_codes[t] + b0 + q0, job->m_scale[t][blk], mq + q0, len);
        dequant_unsigned(job->v_codes[t] + b0 + q0, job->v_scale[t][blk], vq + q0, len);
      }
    } else {
      mb = m + b0;
      vb = v + b0;
    }
    float *pt = pb + split, *mt = mb + split, *vt = vb + split; /* (the scalar tail's part) */
    const uint32_t lt = lo + (uint32_t)split;
    if (small_w && loop_bits) {
      adam_block(pb, mb, vb, g, split, &k, 1, 0, rnd, lo, kc, 1);
      adam_block(pt, mt, vt, g + split, n - split, &k, 1, 1, rnd + split, lt, kc, 1);
    } else if (small_w) {
      adam_block(pb, mb, vb, g, split, &k, 1, 0, NULL, 0, 0, 0);
      adam_block(pt, mt, vt, g + split, n - split, &k, 1, 1, NULL, 0, 0, 0);
    } else if (loop_bits) {
      adam_block(pb, mb, vb, g, split, &k, 0, 0, rnd, lo, kc, 1);
      adam_block(pt, mt, vt, g + split, n - split, &k, 0, 1, rnd + split, lt, kc, 1);
    } else {
      adam_block(pb, mb, vb, g, split, &k, 0, 0, NULL, 0, 0, 0);
      adam_block(pt, mt, vt, g + split, n - split, &k, 0, 1, NULL, 0, 0, 0);
    }
    if (job->m_codes) {
      for (int64_t q0 = 0; q0 < n; q0 += ZF_QBLOCK) {
        const int64_t len = n - q0 < ZF_QBLOCK ? n - q0 : ZF_QBLOCK, blk = (b0 + q0) / ZF_QBLOCK;
        quant_block(mq + q0, vq + q0, job->m_codes[t] + b0 + q0, job->v_codes[t] + b0 + q0, len,
                    &job->m_scale[t][blk], &job->v_scale[t][blk], rnd + q0);
      }
    }
  }
}

static void *adam_worker(void *arg) {
  zf_adam_job *job = (zf_adam_job *)arg;
  for (;;) {
    int64_t i = atomic_fetch_add(&job->next, 1);
    if (i >= job->n_items) break;
    adam_range(job, job->item_tensor[i], job->item_begin[i], job->item_end[i]);
  }
  return NULL;
}

static int window_adamw(zf_adam_job job, int threads);

int zf_window_adamw(int64_t n, float *const *master, float *const *acc, float *const *exp_avg,
                    float *const *exp_avg_sq, const void *const *grad, const int32_t *grad_bf16,
                    const int32_t *first, const int64_t *count, const int64_t *numel, const double *step,
                    double lr, double beta1, double beta2, double eps, double weight_decay, float coef,
                    int64_t width, int threads, const int32_t *acc_bf16, const int32_t *const *acc_map,
                    const int32_t *const *acc_skip, const int32_t *acc_rows, const int64_t *cols,
                    const int64_t *acc_kept) {
  zf_adam_job job = {.n = n, .master = master, .acc = acc, .acc_bf16 = acc_bf16, .exp_avg = exp_avg,
                     .exp_avg_sq = exp_avg_sq,
                     .grad = grad, .grad_bf16 = grad_bf16, .first = first, .count = count, .numel = numel,
                     .step = step, .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps,
                     .weight_decay = weight_decay, .coef = coef, .width = width > 0 ? width : 1,
                     .acc_map = acc_map, .acc_skip = acc_skip, .acc_rows = acc_rows, .cols = cols,
                     .acc_kept = acc_kept};
  return window_adamw(job, threads);
}

/* zf_window_adamw with 8-bit moments: codes and scales instead of fp32 exp_avg / exp_avg_sq */
int zf_window_adamw_q(int64_t n, float *const *master, float *const *acc, int8_t *const *m_codes,
                      float *const *m_scale, uint8_t *const *v_codes, float *const *v_scale,
                      const void *const *grad, const int32_t *grad_bf16, const int32_t *first,
                      const int64_t *count, const int64_t *numel, const double *step, double lr, double beta1,
                      double beta2, double eps, double weight_decay, float coef, int64_t width, int threads,
                      const int32_t *acc_bf16, const int32_t *const *acc_map, const int32_t *const *acc_skip,
                      const int32_t *acc_rows, const int64_t *cols, const int64_t *acc_kept,
                      const uint64_t *round_key, const int64_t *g_base, const int64_t *g_local,
                      const int64_t *g_global) {
  zf_adam_job job = {.n = n, .master = master, .acc = acc, .acc_bf16 = acc_bf16, .m_codes = m_codes, .m_scale = m_scale,
                     .v_codes = v_codes, .v_scale = v_scale, .grad = grad, .grad_bf16 = grad_bf16,
                     .first = first, .count = count, .numel = numel, .step = step, .lr = lr, .beta1 = beta1,
                     .beta2 = beta2, .eps = eps, .weight_decay = weight_decay, .coef = coef,
                     .width = width > 0 ? width : 1, .acc_map = acc_map, .acc_skip = acc_skip,
                     .acc_rows = acc_rows, .cols = cols, .acc_kept = acc_kept, .round_key = round_key,
                     .g_base = g_base, .g_local = g_local, .g_global = g_global};
  return window_adamw(job, threads);
}

/* zf_window_adamw with bf16 moments (adam_block_bf16): the bits of widening the moments, torch's fused AdamW in fp32
 * and rounding back stochastically (rounding.py) */
int zf_window_adamw_bf16(int64_t n, float *const *master, float *const *acc, uint16_t *const *exp_avg,
                         uint16_t *const *exp_avg_sq, const void *const *grad, const int32_t *grad_bf16,
                         const int32_t *first, const int64_t *count, const int64_t *numel, const double *step,
                         double lr, double beta1, double beta2, double eps, double weight_decay, float coef,
                         int64_t width, int threads, const int32_t *acc_bf16, const int32_t *const *acc_map,
                         const int32_t *const *acc_skip, const int32_t *acc_rows, const int64_t *cols,
                         const int64_t *acc_kept, const uint64_t *round_key, const int64_t *g_base,
                         const int64_t *g_local, const int64_t *g_global) {
  zf_adam_job job = {.n = n, .master = master, .acc = acc, .acc_bf16 = acc_bf16, .m_bf16 = exp_avg, .v_bf16 = exp_avg_sq, .grad = grad,
                     .grad_bf16 = grad_bf16, .first = first, .count = count, .numel = numel, .step = step,
                     .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
                     .coef = coef, .width = width > 0 ? width : 1, .acc_map = acc_map, .acc_skip = acc_skip,
                     .acc_rows = acc_rows, .cols = cols, .acc_kept = acc_kept, .round_key = round_key,
                     .g_base = g_base, .g_local = g_local, .g_global = g_global};
  return window_adamw(job, threads);
}

static int window_adamw(zf_adam_job job, int threads) {
  const int64_t n = job.n, *numel = job.numel;
  int64_t n_items = 0;
  for (int64_t t = 0; t < n; ++t) n_items += (numel[t] + ZF_CHUNK_ELEMS - 1) / ZF_CHUNK_ELEMS;
  job.item_tensor = malloc(sizeof(int64_t) * (size_t)(n_items + 1));
  job.item_begin = malloc(sizeof(int64_t) * (size_t)(n_items + 1));
  job.item_end = malloc(sizeof(int64_t) * (size_t)(n_items + 1));
  if (!job.item_tensor || !job.item_begin || !job.item_end) {
    free(job.item_tensor); free(job.item_begin); free(job.item_end);
    return -1;
  }
  int64_t i = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < numel[t]; b += ZF_CHUNK_ELEMS, ++i) {
      job.item_tensor[i] = t;
      job.item_begin[i] = b;
      job.item_end[i] = b + ZF_CHUNK_ELEMS < numel[t] ? b + ZF_CHUNK_ELEMS : numel[t];
    }
  job.n_items = n_items;
  atomic_init(&job.next, 0);
  run_team(threads, n_items, adam_worker, &job);
  free(job.item_tensor); free(job.item_begin); free(job.item_end);
  return 0;
}
