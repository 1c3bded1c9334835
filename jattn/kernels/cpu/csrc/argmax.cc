// XLA FFI handler of the greedy pick: jnp.argmax over the last axis of float32 logits.
//
// Exported (loaded with ctypes, registered by jattn.kernels.cpu._library):
//   JattnCpuArgmax: x [rows..., V] float32 -> int32 [rows...], per row the index of the
//   first NaN if the row holds one, else of the first largest value (jnp.argmax's answer;
//   -0.0 and 0.0 tie, as ==). XLA's CPU argmax, a reduction over (value, index) pairs,
//   takes about 10x as long on decoding's [16, 8192] logits.
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jattn {
namespace {

#if defined(__GNUC__)  // GCC and Clang: vector extensions (SSE2 and up on x86-64)
typedef float Floats __attribute__((vector_size(16)));
typedef int32_t Ints __attribute__((vector_size(16)));
constexpr int64_t kWidth = 4, kVectors = 4;  // 16 floats a step, in 4 independent vectors

Floats load(const float* x) {
  Floats v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// The row's largest non-NaN value (-inf if none) and whether it holds a NaN.
float row_max(const float* x, int64_t n, bool* has_nan) {
  const float lowest = -std::numeric_limits<float>::infinity();
  Floats top[kVectors];
  Ints nan[kVectors];
  for (int64_t j = 0; j < kVectors; ++j) {
    top[j] = Floats{lowest, lowest, lowest, lowest};
    nan[j] = Ints{0, 0, 0, 0};
  }
  int64_t i = 0;
  for (; i + kWidth * kVectors <= n; i += kWidth * kVectors)
    for (int64_t j = 0; j < kVectors; ++j) {
      const Floats v = load(x + i + j * kWidth);
      top[j] = v > top[j] ? v : top[j];  // a NaN never wins: it is looked for apart
      nan[j] |= v != v;
    }
  float best = lowest;
  bool any = false;
  for (int64_t j = 0; j < kVectors; ++j)
    for (int64_t l = 0; l < kWidth; ++l) {
      best = top[j][l] > best ? top[j][l] : best;
      any = any || nan[j][l] != 0;
    }
  for (; i < n; ++i) {
    best = x[i] > best ? x[i] : best;
    any = any || x[i] != x[i];
  }
  *has_nan = any;
  return best;
}

// Whether x[0, kWidth * kVectors) holds a NaN (has_nan) or `best`.
bool block_has(const float* x, float best, bool has_nan) {
  Ints hit = Ints{0, 0, 0, 0};
  const Floats b = Floats{best, best, best, best};
  for (int64_t j = 0; j < kVectors; ++j) {
    const Floats v = load(x + j * kWidth);
    hit |= has_nan ? v != v : v == b;
  }
  return (hit[0] | hit[1] | hit[2] | hit[3]) != 0;
}
#else  // other compilers: plain loops
constexpr int64_t kWidth = 1, kVectors = 1;

float row_max(const float* x, int64_t n, bool* has_nan) {
  float best = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (int64_t i = 0; i < n; ++i) {
    best = x[i] > best ? x[i] : best;
    any = any || x[i] != x[i];
  }
  *has_nan = any;
  return best;
}

bool block_has(const float* x, float best, bool has_nan) {
  return has_nan ? x[0] != x[0] : x[0] == best;
}
#endif

// The first index where the row holds a NaN (has_nan) or `best`: whole blocks skipped
// with one vector compare each, then the block that holds it searched in order.
int64_t first_match(const float* x, int64_t n, float best, bool has_nan) {
  int64_t i = 0;
  while (i + kWidth * kVectors <= n && !block_has(x + i, best, has_nan)) i += kWidth * kVectors;
  for (; i < n; ++i)
    if (has_nan ? x[i] != x[i] : x[i] == best) return i;
  return 0;  // a row of -inf only: its first index, as jnp.argmax
}

int32_t row_argmax(const float* x, int64_t n) {
  bool has_nan = false;
  const float best = row_max(x, n, &has_nan);
  return static_cast<int32_t>(first_match(x, n, best, has_nan));
}

ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1)
    return ffi::Error::InvalidArgument("jattn argmax: x must be [rows..., V] with V >= 1");
  const int64_t n = dims.back(), rows = static_cast<int64_t>(x.element_count()) / n;
  if (static_cast<int64_t>(out->element_count()) != rows || n > (int64_t{1} << 31) - 1)
    return ffi::Error::InvalidArgument("jattn argmax: the output must be int32 [rows...]");
  const float* data = x.typed_data();
  int32_t* result = out->typed_data();
  for (int64_t r = 0; r < rows; ++r) result[r] = row_argmax(data + r * n, n);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnCpuArgmax, jattn::Argmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [rows..., V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // int32 [rows...]
