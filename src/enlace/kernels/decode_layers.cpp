// One decode step through every layer of the decoder (enlace.model's Block), in one call.
//
// Why: with the products at the memory's rate (decode_linear.cpp), what is left of a step on a CPU is the
// rest of the layer, and eager PyTorch spends it in about fifty small operator calls and as many Python
// module calls per layer: on 2 AVX2 cores, about 12 ms of SmolLM2's 30 per token. Here the same
// arithmetic runs as plain loops: RMSNorm (plain or Gemma's 1 + w), q/k/v in one pass over their weights, QK-norm, rotary embeddings
// in the half-split convention, the KV cache written at each row's own position, attention of one query
// per head (grouped KV heads, a sliding window on local layers), the output projection, sandwich norms, the
// gated MLP (SiLU or tanh-GELU) and both residual adds. Activations and the KV cache are fp32; weights are
// fp32, bf16, or int8 with one scale per row (enlace::product). Tests hold it to the model's own forward pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace enlace {
void product(const float* x, int64_t rows, const at::Tensor& w, const at::Tensor& scales, float* y);
void products(const float* x, int64_t rows, const at::Tensor* weights, const at::Tensor* scales, int count,
              float* y);
}

namespace {

// The tensors of one layer, in the order decode_layers takes them (generate.KernelDecode lists them).
// Products come as (weight, scales) pairs, the scales empty for fp32 weights.
enum Weight { kNormIn, kNormAttnOut, kNormPreMlp, kNormPostMlp, kQNorm, kKNorm, kQ, kK, kV, kOut, kGate, kUp,
              kDown, kScales = kDown + 1, kPerLayer = kScales + 7 };

// The scales of product weight `which` (kQ..kDown).
inline int scales_of(int which) { return kScales + which - kQ; }

struct Shape {
  int64_t layers, heads, kv_heads, head_dim, d_model, ffn;
  bool sandwich, qk_norm, unit_offset, gelu;
  float eps, scale;
};

void rms_norm(const float* in, const at::Tensor& weight, const Shape& s, int64_t n, float* out) {
  const float* w = weight.data_ptr<float>();
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += in[i] * in[i];
  const float r = 1.f / std::sqrt(squares / static_cast<float>(n) + s.eps);
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * r * (s.unit_offset ? 1.f + w[i] : w[i]);
}

// Rotate pairs (i, i + D/2) of one head by the angles of its position (cos, sin: the row of the table).
void rope(float* h, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = h[i], b = h[i + half];
    h[i] = a * cos[i] - b * sin[i];
    h[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One query head against positions [first, last] of its KV head's cache rows: softmax(q.k * scale) v.
void attend(const float* q, const float* keys, const float* values, int64_t first, int64_t last, const Shape& s,
            float* out) {
  const int64_t d = s.head_dim;
  std::vector<float> scores(last - first + 1);
  float top = -INFINITY;
  for (int64_t j = first; j <= last; ++j) {
    const float* k = keys + j * d;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < d; ++i) dot += q[i] * k[i];
    scores[j - first] = dot * s.scale;
    top = std::max(top, scores[j - first]);
  }
  float total = 0.f;
  for (auto& e : scores) total += (e = std::exp(e - top));
  std::fill(out, out + d, 0.f);
  for (int64_t j = first; j <= last; ++j) {
    const float p = scores[j - first] / total;
    const float* v = values + j * d;
    for (int64_t i = 0; i < d; ++i) out[i] += p * v[i];
  }
}

float activation(float g, bool gelu) {
  if (!gelu) return g / (1.f + std::exp(-g));
  return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

void decode_layers(const at::Tensor& x, at::TensorList weights, at::TensorList keys, at::TensorList values,
                   const at::Tensor& positions, at::TensorList cos, at::TensorList sin,
                   at::IntArrayRef layer_table, at::IntArrayRef windows, at::IntArrayRef dims,
                   at::ArrayRef<double> floats) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "enlace::decode_layers: x must be contiguous fp32 [rows, d_model]");
  TORCH_CHECK(dims.size() == 10 && floats.size() == 2, "enlace::decode_layers: dims has 10 entries, floats 2");
  const Shape s{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5],
                dims[6] != 0, dims[7] != 0, dims[8] != 0, dims[9] != 0,
                static_cast<float>(floats[0]), static_cast<float>(floats[1])};
  const int64_t rows = x.size(0), d = s.head_dim, qd = s.heads * d, kvd = s.kv_heads * d;
  TORCH_CHECK(x.size(1) == s.d_model, "enlace::decode_layers: x has width ", x.size(1), ", not ", s.d_model);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == s.layers * kPerLayer && keys.size() == s.layers &&
                  values.size() == s.layers && positions.numel() == rows,
              "enlace::decode_layers: ", kPerLayer, " weights, a key and a value cache per layer, a position per row");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "enlace::decode_layers: positions must be contiguous int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  // Every operand checked before the first write: a refused call leaves x and the caches as they were.
  for (int64_t layer = 0; layer < s.layers; ++layer)
    for (const at::Tensor& cache : {keys[layer], values[layer]})
      TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.dim() == 4 &&
                      cache.size(0) >= rows && cache.size(1) == s.kv_heads && cache.size(3) == s.head_dim,
                  "enlace::decode_layers: layer ", layer, "'s cache must be contiguous fp32 [rows, KV, capacity, D]");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < keys[0].size(2) && pos[r] < cos[0].size(0),
                "enlace::decode_layers: position ", pos[r], " is outside the cache or the rotary table");
  const auto opts = x.options();
  at::Tensor h = at::empty({rows, s.d_model}, opts), qkv = at::empty({rows, qd + 2 * kvd}, opts),
             att = at::empty({rows, qd}, opts), o = at::empty({rows, s.d_model}, opts),
             gu = at::empty({rows, 2 * s.ffn}, opts), act = at::empty({rows, s.ffn}, opts);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(),
        *attp = att.data_ptr<float>(), *op = o.data_ptr<float>(), *gup = gu.data_ptr<float>(),
        *actp = act.data_ptr<float>();
  for (int64_t layer = 0; layer < s.layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kPerLayer;
    const int64_t capacity = keys[layer].size(2);
    float *kc = keys[layer].data_ptr<float>(), *vc = values[layer].data_ptr<float>();
    const float *ct = cos[layer_table[layer]].data_ptr<float>(), *st = sin[layer_table[layer]].data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) rms_norm(xp + r * s.d_model, w[kNormIn], s, s.d_model, hp + r * s.d_model);
    enlace::products(hp, rows, w + kQ, w + scales_of(kQ), 3, qkvp);
    for (int64_t r = 0; r < rows; ++r) {
      float* q = qkvp + r * (qd + 2 * kvd);
      float *k = q + qd, *v = k + kvd;
      for (int64_t head = 0; head < s.heads + s.kv_heads; ++head) {
        float* hv = q + head * d;  // q's heads, then k's
        if (s.qk_norm) rms_norm(hv, w[head < s.heads ? kQNorm : kKNorm], s, d, hv);
        rope(hv, ct + pos[r] * d, st + pos[r] * d, d);
      }
      // Row r of a [rows, KV, capacity, D] cache: each KV head's position pos[r].
      for (int64_t kh = 0; kh < s.kv_heads; ++kh) {
        const int64_t at_pos = ((r * s.kv_heads + kh) * capacity + pos[r]) * d;
        std::copy(k + kh * d, k + (kh + 1) * d, kc + at_pos);
        std::copy(v + kh * d, v + (kh + 1) * d, vc + at_pos);
      }
    }
    // Attention, one (row, head) pair per task: threads share it once the context makes it worth a task.
    const int64_t longest = *std::max_element(pos, pos + rows) + 1;
    const int64_t grain = std::max<int64_t>(1, 32768 / (longest * d));
    at::parallel_for(0, rows * s.heads, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / s.heads, head = task % s.heads, kh = head / (s.heads / s.kv_heads);
        const int64_t first = windows[layer] > 0 ? std::max<int64_t>(0, pos[r] - windows[layer] + 1) : 0;
        const int64_t base = (r * s.kv_heads + kh) * capacity * d;
        const float* q = qkvp + r * (qd + 2 * kvd) + head * d;
        attend(q, kc + base, vc + base, first, pos[r], s, attp + r * qd + head * d);
      }
    });
    enlace::product(attp, rows, w[kOut], w[scales_of(kOut)], op);
    for (int64_t r = 0; r < rows; ++r) {
      float *xr = xp + r * s.d_model, *orow = op + r * s.d_model, *hr = hp + r * s.d_model;
      if (s.sandwich) rms_norm(orow, w[kNormAttnOut], s, s.d_model, orow);
      for (int64_t i = 0; i < s.d_model; ++i) xr[i] += orow[i];
      rms_norm(xr, w[s.sandwich ? kNormPreMlp : kNormAttnOut], s, s.d_model, hr);
    }
    enlace::products(hp, rows, w + kGate, w + scales_of(kGate), 2, gup);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < s.ffn; ++i)
        actp[r * s.ffn + i] = activation(gup[r * 2 * s.ffn + i], s.gelu) * gup[r * 2 * s.ffn + s.ffn + i];
    enlace::product(actp, rows, w[kDown], w[scales_of(kDown)], op);
    for (int64_t r = 0; r < rows; ++r) {
      float *xr = xp + r * s.d_model, *orow = op + r * s.d_model;
      if (s.sandwich) rms_norm(orow, w[kNormPostMlp], s, s.d_model, orow);
      for (int64_t i = 0; i < s.d_model; ++i) xr[i] += orow[i];
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(enlace, m) {
  m.def(
      "decode_layers(Tensor(a!) x, Tensor[] weights, Tensor(b!)[] keys, Tensor(c!)[] values, Tensor positions, "
      "Tensor[] cos, Tensor[] sin, int[] layer_table, int[] windows, int[] dims, float[] floats) -> ()");
}

TORCH_LIBRARY_IMPL(enlace, CPU, m) { m.impl("decode_layers", &decode_layers); }
