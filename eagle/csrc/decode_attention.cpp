// Grouped-query attention of a few query rows over a KV cache, for CPU decode steps.
//
// Flash-attention's online softmax (Dao et al., arXiv 2205.14135, section 3.1) over blocks of 16 keys, one
// task per (batch row, kv head): the query rows that share a kv head (its heads times the query length) read
// each key and value once. Keys and values are read in their storage dtype (bf16 or fp32); scores, softmax
// and the weighted sum are accumulated in fp32, in 16-lane vectors (GCC vector extensions: AVX-512 registers
// where the machine has them, pairs of AVX2 registers where not). eagle/decode_attention.py builds this file
// and decides when a step uses it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

constexpr int kLanes = 16;  // keys per block, and floats per vector

inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load16(const at::BFloat16* p) {  // bf16 -> fp32: the 16 bits are the top of the float
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline vf splat(float x) { return vf{} + x; }

typedef uint8_t vb __attribute__((vector_size(16)));

// Halving reductions: four shuffle-and-combine levels, not a chain of fifteen.
inline float hsum(vf v) {
  vf t = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  t = t + __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  t = t + __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  t = t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return t[0];
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hmax(vf v) {
  vf t = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  t = vmax(t, __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  t = vmax(t, __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  t = vmax(t, __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return t[0];
}

// The 16 lane sums of v[0..15] as one vector (lane j: the sum of v[j]), by four levels of pairwise
// shuffle-and-add; the levels leave the keys in bit-reversed lane order, undone by the last shuffle.
inline vf transpose_sum(const vf* v) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const vf d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// exp(x) for x <= 0 (scores minus their running maximum), lane-wise: Cephes' expf (range reduction by ln 2 in
// two parts, a degree-6 polynomial, 2^n built in the exponent bits), relative error about 2e-7; lanes below
// -87.3 (masked keys are -inf) give exactly 0.
inline vf exp_nonpositive(vf x) {
  const vf clamped = x < -87.3f ? splat(-87.3f) : x;
  const vf n = (clamped * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  vf r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? splat(0.f) : p * scale;
}

template <typename T, int kDim, int kRows>
void attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
            double scale, at::Tensor& out) {
  constexpr int kChunks = kDim / kLanes;
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2);
  const int64_t kv_heads = keys.size(1), kv_len = keys.size(2), group = heads / kv_heads;
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = keys.data_ptr<T>();
  const T* v_ptr = values.data_ptr<T>();
  const bool* m_ptr = mask.data_ptr<bool>();
  T* o_ptr = out.data_ptr<T>();
  const auto qs = query.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      vf q[kRows][kChunks], acc[kRows][kChunks];
      float run_max[kRows], run_sum[kRows];
      const bool* row_mask[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t head = h * group + r / q_len, qi = r % q_len;
        const T* src = q_ptr + b * qs[0] + head * qs[1] + qi * qs[2];
        for (int c = 0; c < kChunks; ++c) {
          q[r][c] = load16(src + c * kLanes) * fscale;
          acc[r][c] = vf{};
        }
        run_max[r] = neg_inf;
        run_sum[r] = 0.f;
        row_mask[r] = m_ptr + b * ms[0] + qi * ms[2];
      }
      const T* k_base = k_ptr + b * ks[0] + h * ks[1];
      const T* v_base = v_ptr + b * vs[0] + h * vs[1];
      for (int64_t j0 = 0; j0 < kv_len; j0 += kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, kv_len - j0));
        vf partial[kRows][kLanes];  // per row and key: the 16 lane products, summed by transpose_sum
        for (int j = 0; j < kLanes; ++j) {
          if (j >= n) {
            for (int r = 0; r < kRows; ++r) partial[r][j] = vf{};
            continue;
          }
          const T* kr = k_base + (j0 + j) * ks[2];
          vf k[kChunks];
          for (int c = 0; c < kChunks; ++c) k[c] = load16(kr + c * kLanes);
          for (int r = 0; r < kRows; ++r) {
            vf t = q[r][0] * k[0];
            for (int c = 1; c < kChunks; ++c) t += q[r][c] * k[c];
            partial[r][j] = t;
          }
        }
        vf p[kRows];
        for (int r = 0; r < kRows; ++r) {
          vf s = transpose_sum(partial[r]);
          const bool* mr = row_mask[r] + j0 * ms[3];
          if (n == kLanes && ms[3] == 1) {  // 16 mask bytes at once
            vb bytes;
            std::memcpy(&bytes, mr, sizeof bytes);
            s = __builtin_convertvector(bytes, vi) != 0 ? s : splat(neg_inf);
          } else {
            for (int j = 0; j < kLanes; ++j)
              if (j >= n || !mr[j * ms[3]]) s[j] = neg_inf;
          }
          const float block_max = hmax(s);
          if (block_max == neg_inf) {  // nothing visible in this block for this row
            p[r] = vf{};
            continue;
          }
          const float new_max = std::max(run_max[r], block_max);
          const float correction = exp_nonpositive(splat(run_max[r] - new_max))[0];  // 0 on the first block
          p[r] = exp_nonpositive(s - new_max);
          run_sum[r] = run_sum[r] * correction + hsum(p[r]);
          run_max[r] = new_max;
          for (int c = 0; c < kChunks; ++c) acc[r][c] *= correction;
        }
        for (int j = 0; j < n; ++j) {
          const T* vr = v_base + (j0 + j) * vs[2];
          vf v[kChunks];
          for (int c = 0; c < kChunks; ++c) v[c] = load16(vr + c * kLanes);
          for (int r = 0; r < kRows; ++r) {
            const vf w = splat(p[r][j]);
            for (int c = 0; c < kChunks; ++c) acc[r][c] += w * v[c];
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const float inv = run_sum[r] > 0.f ? 1.f / run_sum[r] : 0.f;  // a row that may attend to nothing: zeros
        T* dst = o_ptr + ((b * heads + h * group + r / q_len) * q_len + r % q_len) * kDim;
        for (int c = 0; c < kChunks; ++c) {
          const vf o = acc[r][c] * inv;
          for (int i = 0; i < kLanes; ++i) dst[c * kLanes + i] = static_cast<T>(o[i]);
        }
      }
    }
  });
}

template <typename T, int kDim>
void dispatch_rows(int64_t rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m,
                   double scale, at::Tensor& out) {
  switch (rows) {
    case 1: return attend<T, kDim, 1>(q, k, v, m, scale, out);
    case 2: return attend<T, kDim, 2>(q, k, v, m, scale, out);
    case 3: return attend<T, kDim, 3>(q, k, v, m, scale, out);
    case 4: return attend<T, kDim, 4>(q, k, v, m, scale, out);
    case 5: return attend<T, kDim, 5>(q, k, v, m, scale, out);
    case 6: return attend<T, kDim, 6>(q, k, v, m, scale, out);
    case 7: return attend<T, kDim, 7>(q, k, v, m, scale, out);
    case 8: return attend<T, kDim, 8>(q, k, v, m, scale, out);
    default: TORCH_CHECK(false, "decode_attention: at most 8 query rows per kv head, got ", rows);
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 4,
              "decode_attention: query, keys, values and mask are 4-D");
  TORCH_CHECK(query.device().is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK(keys.sizes() == values.sizes(), "decode_attention: keys and values differ in shape");
  TORCH_CHECK(query.size(0) == keys.size(0) && query.size(3) == keys.size(3), "decode_attention: batch or head_dim differ");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0, "decode_attention: heads is not a multiple of kv_heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == query.size(0) && mask.size(1) == 1 &&
                  mask.size(2) == query.size(2) && mask.size(3) == keys.size(2),
              "decode_attention: mask is bool [batch, 1, q, kv]");
  TORCH_CHECK(query.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: the head dimension is contiguous");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "decode_attention: query, keys and values share a dtype");
  TORCH_CHECK(query.size(3) == 64 || query.size(3) == 128, "decode_attention: head_dim 64 or 128 only");
  auto out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = query.size(1) / keys.size(1) * query.size(2);
  const bool wide = query.size(3) == 128;
  if (query.scalar_type() == at::kBFloat16) {
    wide ? dispatch_rows<at::BFloat16, 128>(rows, query, keys, values, mask, scale, out)
         : dispatch_rows<at::BFloat16, 64>(rows, query, keys, values, mask, scale, out);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kFloat, "decode_attention: bfloat16 or float32 only");
    wide ? dispatch_rows<float, 128>(rows, query, keys, values, mask, scale, out)
         : dispatch_rows<float, 64>(rows, query, keys, values, mask, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(eagle, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle, CPU, m) { m.impl("decode_attention", &decode_attention); }
