// Matrix-vector products for decoding on a CPU: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m of
// activations (one token per active sequence) against a weight read once per step.
//
// Why not torch's own: on 2 cores of an AVX2 EPYC, torch's fp32 F.linear reads a [1536, 576] weight at
// 12 GB/s where a plain sum over the same bytes runs at 30, and its int8 weight-only kernel reaches about
// 2 GB/s with fp32 activations. Decoding reads every weight once per token, so those rates are the tokens
// per second. Here each thread owns whole output rows and streams them once for all m activation rows,
// with several accumulators to hide the FMA latency.
//
// Determinism: a row's sum is computed by one thread in a fixed order, so the result does not depend on
// the number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ENLACE_AVX2 1
#endif
// AVX-512 (Zen 4, Xeons since Skylake-SP): sixteen lanes a step, half the instructions per weight. On 2 vCPUs
// that share one core's units, the AVX2 loop's widening and FMAs bound a bf16 decode step, not the memory.
#if defined(ENLACE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define ENLACE_AVX512 1
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // activation rows per call; more is a prefill, which torch's GEMM serves

#ifdef ENLACE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight weights as floats: fp32 loaded as is, int8 and bf16 widened.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// bf16 is the top half of an fp32: widened by a shift, exactly.
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}
#endif

#ifdef ENLACE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(halves, 16));
}
#endif

// out[m * n_out + n] = scale[n] * dot(w row n, x row m), for rows n in [begin, end) and all M rows m:
// each weight is loaded (and widened) once and multiplied into every activation row.
template <int M, typename W>
void rows_dot(const float* x, const W* w, int64_t k, const float* scale, float* out, int64_t n_out,
              int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const W* wr = w + n * k;
    float total[M];
    for (int m = 0; m < M; ++m) total[m] = 0.f;
    int64_t i = 0;
#ifdef ENLACE_AVX512
    // Two chunks of sixteen per step, each with its own accumulators (at most 16 of the 32 registers).
    if (k >= 32) {
      __m512 b0[M], b1[M];
      for (int m = 0; m < M; ++m) b0[m] = b1[m] = _mm512_setzero_ps();
      for (; i + 32 <= k; i += 32) {
        const __m512 w0 = load16(wr + i), w1 = load16(wr + i + 16);
        for (int m = 0; m < M; ++m) {
          b0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * k + i), b0[m]);
          b1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * k + i + 16), b1[m]);
        }
      }
      for (int m = 0; m < M; ++m) total[m] = _mm512_reduce_add_ps(_mm512_add_ps(b0[m], b1[m]));
    }
#endif
#ifdef ENLACE_AVX2
    // Two chunks of eight per step, each with its own accumulators: two FMA chains per activation row.
    if (i + 16 <= k) {
      __m256 a0[M], a1[M];
      for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
      for (; i + 16 <= k; i += 16) {
        const __m256 w0 = load8(wr + i), w1 = load8(wr + i + 8);
        for (int m = 0; m < M; ++m) {
          a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * k + i), a0[m]);
          a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * k + i + 8), a1[m]);
        }
      }
      for (int m = 0; m < M; ++m) total[m] += hsum(_mm256_add_ps(a0[m], a1[m]));
    }
#endif
    for (; i < k; ++i)
      for (int m = 0; m < M; ++m) total[m] += static_cast<float>(wr[i]) * x[m * k + i];
    for (int m = 0; m < M; ++m) out[m * n_out + n] = scale ? total[m] * scale[n] : total[m];
  }
}

template <typename W>
using RowsDot = void (*)(const float*, const W*, int64_t, const float*, float*, int64_t, int64_t, int64_t);

template <typename W>
RowsDot<W> rows_dot_for(int64_t m_rows) {
  static const RowsDot<W> table[kMaxRows] = {rows_dot<1, W>, rows_dot<2, W>, rows_dot<3, W>, rows_dot<4, W>,
                                             rows_dot<5, W>, rows_dot<6, W>, rows_dot<7, W>, rows_dot<8, W>};
  return table[m_rows - 1];
}

// int8 weights times activations quantised to int16 (one scale per activation row): integer products
// summed exactly, so the float work per weight is gone. Widening int8 to fp32 for an FMA took four
// instructions per eight weights and bound the product by arithmetic (about 19 GB/s of int8 on 2 AVX2
// cores); sign-extending to int16 and multiplying pairs (madd) takes one per sixteen, shared by all rows.
// int16 keeps activations to 1 part in 65,534 of their row's largest: far finer than Q8_0's 8-bit blocks.
//
// Overflow: a madd lane adds two products of at most 32767 * 127; a lane takes one madd per 16 columns,
// so 4,096 columns stay below 2^31. Longer rows are summed in chunks of that many into 64-bit totals.
// The sum is exact whatever the order: the AVX2 and the plain loops give the same bits.
constexpr int64_t kChunk = 4096;

template <int M>
void rows_dot_i16(const int16_t* xq, const float* xscale, const int8_t* w, int64_t k, const float* scale,
                  float* out, int64_t n_out, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* wr = w + n * k;
    int64_t total[M] = {};
    for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
      const int64_t c1 = std::min(k, c0 + kChunk);
      int64_t i = c0;
#ifdef ENLACE_AVX512
      // 32 columns per madd (VNNI fuses the add). Exact integer sums: the same bits as the AVX2 loop's.
      if (i + 64 <= c1) {
        __m512i wide[M], wide1[M];
        for (int m = 0; m < M; ++m) wide[m] = wide1[m] = _mm512_setzero_si512();
        for (; i + 64 <= c1; i += 64) {
          const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + i)));
          const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + i + 32)));
          for (int m = 0; m < M; ++m) {
            const __m512i x0 = _mm512_loadu_si512(xq + m * k + i), x1 = _mm512_loadu_si512(xq + m * k + i + 32);
#ifdef __AVX512VNNI__
            wide[m] = _mm512_dpwssd_epi32(wide[m], w0, x0);
            wide1[m] = _mm512_dpwssd_epi32(wide1[m], w1, x1);
#else
            wide[m] = _mm512_add_epi32(wide[m], _mm512_madd_epi16(w0, x0));
            wide1[m] = _mm512_add_epi32(wide1[m], _mm512_madd_epi16(w1, x1));
#endif
          }
        }
        for (int m = 0; m < M; ++m) {  // lanes into the 64-bit totals: 16 lanes' sum can pass 2^31
          alignas(64) int32_t lanes[16];
          _mm512_store_si512(lanes, _mm512_add_epi32(wide[m], wide1[m]));
          for (int l = 0; l < 16; ++l) total[m] += lanes[l];
        }
      }
#endif
#ifdef ENLACE_AVX2
      __m256i acc[M], acc1[M];
      for (int m = 0; m < M; ++m) acc[m] = acc1[m] = _mm256_setzero_si256();
      for (; i + 32 <= c1; i += 32) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i + 16)));
        for (int m = 0; m < M; ++m) {
          const int16_t* xm = xq + m * k + i;
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm))));
          acc1[m] = _mm256_add_epi32(acc1[m], _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 16))));
        }
      }
      for (; i + 16 <= c1; i += 16) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i)));
        for (int m = 0; m < M; ++m)
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + i))));
      }
      for (int m = 0; m < M; ++m) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(acc[m], acc1[m]));
        for (int l = 0; l < 8; ++l) total[m] += lanes[l];
      }
#endif
      for (; i < c1; ++i)
        for (int m = 0; m < M; ++m) total[m] += static_cast<int32_t>(wr[i]) * xq[m * k + i];
    }
    for (int m = 0; m < M; ++m) out[m * n_out + n] = static_cast<float>(total[m]) * xscale[m] * scale[n];
  }
}

using RowsDotI16 = void (*)(const int16_t*, const float*, const int8_t*, int64_t, const float*, float*, int64_t,
                            int64_t, int64_t);

RowsDotI16 rows_dot_i16_for(int64_t m_rows) {
  static const RowsDotI16 table[kMaxRows] = {rows_dot_i16<1>, rows_dot_i16<2>, rows_dot_i16<3>, rows_dot_i16<4>,
                                             rows_dot_i16<5>, rows_dot_i16<6>, rows_dot_i16<7>, rows_dot_i16<8>};
  return table[m_rows - 1];
}

// x's rows as int16 with one scale each (x = q * scale, |q| <= 32767, round to nearest even). False when a
// row holds a NaN or an infinity: the caller takes the float path, so the NaN reaches the output.
bool quantise_rows(const float* x, int64_t rows, int64_t k, int16_t* q, float* scales) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * k;
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      if (!std::isfinite(xr[i])) return false;
      amax = std::max(amax, std::fabs(xr[i]));
    }
    scales[m] = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t i = 0; i < k; ++i)
      q[m * k + i] = static_cast<int16_t>(std::clamp(std::nearbyint(xr[i] * inv), -32767.f, 32767.f));
  }
  return true;
}

at::Tensor as_float_rows(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.size(-1) == k, op, ": activations of width ", x.size(-1), " for a weight of width ", k);
  at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();
  TORCH_CHECK(x2.size(0) >= 1 && x2.size(0) <= kMaxRows, op, ": at most ", kMaxRows, " activation rows, got ", x2.size(0));
  return x2;
}

}  // namespace

namespace enlace {
// y[m, :] = the products of x's rows by each weight in turn, side by side (q, k and v; gate and up): one
// parallel region over the blocks of all of them, and no stacked copy of the weights. The weights are all
// fp32, or all int8 with their scales.
//
// Blocks of about 64 KiB of weight rows for OpenMP's threads. fp32 products are bound by memory: the blocks
// are split evenly (a static schedule), each thread streaming one run of rows (in process, SmolLM2 decoded at
// 50 tokens/s where handing blocks out as threads came free gave 42-46). int8 products are bound by
// arithmetic: blocks go to threads as they come free (dynamic), so a thread the OS preempts (the server's
// event loop waking) delays one block, not half the product (served SmolLM2 int8: about 80 tokens/s
// dynamic, 58 static). at::parallel_for, which wraps the same team, cost half the rate on small matrices.
void products(const float* x, int64_t rows, const at::Tensor* weights, const at::Tensor* scales, int count,
              float* y) {
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "enlace: at most ", kMaxRows, " activation rows, got ", rows);
  const at::ScalarType dtype = weights[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kChar || dtype == at::kBFloat16,
              "enlace: product weights are float32, bfloat16 or int8, not ", dtype);
  const bool int8 = dtype == at::kChar;
  const int64_t k = weights[0].size(1);
  const int64_t block = std::max<int64_t>(8, (64 * 1024) / (k * weights[0].element_size()));
  std::vector<int64_t> first_block{0}, first_column{0};
  for (int j = 0; j < count; ++j) {
    TORCH_CHECK(weights[j].scalar_type() == dtype && weights[j].size(1) == k,
                "enlace: the weights of one product call share their width and dtype");
    first_block.push_back(first_block.back() + (weights[j].size(0) + block - 1) / block);
    first_column.push_back(first_column.back() + weights[j].size(0));
  }
  const int64_t stride = first_column.back(), blocks = first_block.back();
  const RowsDot<float> dot32 = rows_dot_for<float>(rows);
  const RowsDot<c10::BFloat16> dot_bf16 = rows_dot_for<c10::BFloat16>(rows);
  const RowsDot<int8_t> dot8 = rows_dot_for<int8_t>(rows);
  const RowsDotI16 dot16 = rows_dot_i16_for(rows);
  // int8 weights: the activations quantised once here, for every weight of the call.
  std::vector<int16_t> xq(int8 ? rows * k : 0);
  float xscale[kMaxRows];
  const bool integer = int8 && quantise_rows(x, rows, k, xq.data(), xscale);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
  const auto one_block = [&](int64_t b) {
    const int j = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin()) - 1;
    const int64_t n = weights[j].size(0), begin = (b - first_block[j]) * block, end = std::min(n, begin + block);
    float* out = y + first_column[j];
    if (integer)
      dot16(xq.data(), xscale, weights[j].data_ptr<int8_t>(), k, scales[j].data_ptr<float>(), out, stride, begin, end);
    else if (int8)
      dot8(x, weights[j].data_ptr<int8_t>(), k, scales[j].data_ptr<float>(), out, stride, begin, end);
    else if (dtype == at::kBFloat16)
      dot_bf16(x, weights[j].data_ptr<c10::BFloat16>(), k, nullptr, out, stride, begin, end);
    else
      dot32(x, weights[j].data_ptr<float>(), k, nullptr, out, stride, begin, end);
  };
  if (int8) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; ++b) one_block(b);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; ++b) one_block(b);
  }
}

void product(const float* x, int64_t rows, const at::Tensor& w, const at::Tensor& scales, float* y) {
  products(x, rows, &w, &scales, 1, y);
}
}  // namespace enlace

namespace {

at::Tensor run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const char* op) {
  const int64_t n_out = w.size(0), k = w.size(1);
  at::Tensor x2 = as_float_rows(x, k, op);
  at::Tensor y = at::empty({x2.size(0), n_out}, x2.options());
  enlace::product(x2.data_ptr<float>(), x2.size(0), w, scales, y.data_ptr<float>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  return y.view(shape).to(x.scalar_type());
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
              "enlace::linear_f32: the weight must be a contiguous 2-D float32 tensor");
  return run(x, w, at::Tensor(), "enlace::linear_f32");
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "enlace::linear_bf16: the weight must be a contiguous 2-D bfloat16 tensor");
  return run(x, w, at::Tensor(), "enlace::linear_bf16");
}

at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              "enlace::linear_i8: the weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0) && scales.is_contiguous(),
              "enlace::linear_i8: one float32 scale per output row");
  return run(x, w, scales, "enlace::linear_i8");
}

}  // namespace

TORCH_LIBRARY(enlace, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_i8(Tensor x, Tensor w, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(enlace, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_i8", &linear_i8);
}
