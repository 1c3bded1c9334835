// jnp.argmax over one float32 row, for one instruction set: argmax.cc includes this once
// per set, inside the set's namespace and target pragma, with W (floats per vector)
// defined.
//
// One pass over the row: each lane of kArgmaxVectors independent vectors keeps the largest
// value it has met and the block where it first met it (a strict >, so a later equal value
// leaves it: -0.0 and 0.0 tie, as ==); the lanes then merge in index order, the scalar tail
// after them. A row that holds a NaN (looked for apart: a NaN never wins a >) answers its
// first NaN instead, from a second scan, as jnp.argmax does.

constexpr int64_t kArgmaxVectors = 4;  // 4 * W floats a step, in independent vectors

#include "simd.h"

inline int32_t row_argmax(const float* x, int64_t n) {
  constexpr int64_t kStep = W * kArgmaxVectors;
  const float lowest = -std::numeric_limits<float>::infinity();
  vf top[kArgmaxVectors];
  vi at[kArgmaxVectors], nan = splati(0);
  for (int64_t j = 0; j < kArgmaxVectors; ++j) {
    top[j] = splat(lowest);
    at[j] = splati(0);  // a lane of -inf only: its first element, in the first block
  }
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    const vi block = splati(static_cast<int32_t>(i));
    for (int64_t j = 0; j < kArgmaxVectors; ++j) {
      const vf v = load(x + i + j * W);
      const vi above = v > top[j];
      top[j] = above ? v : top[j];
      at[j] = above ? block : at[j];
      nan |= v != v;
    }
  }
  float best = lowest;
  int64_t arg = -1;  // none yet
  for (int64_t j = 0; i > 0 && j < kArgmaxVectors; ++j)
    for (int64_t l = 0; l < W; ++l) {
      const int64_t index = at[j][l] + j * W + l;
      if (arg < 0 || top[j][l] > best || (top[j][l] == best && index < arg)) {
        best = top[j][l];
        arg = index;
      }
    }
  bool any_nan = false;
  for (int64_t l = 0; l < W; ++l) any_nan = any_nan || nan[l] != 0;
  for (; i < n; ++i) {
    any_nan = any_nan || x[i] != x[i];
    if (arg < 0 || x[i] > best) {
      best = x[i];
      arg = i;
    }
  }
  if (any_nan)
    for (int64_t k = 0; k < n; ++k)
      if (x[k] != x[k]) return static_cast<int32_t>(k);
  return static_cast<int32_t>(arg);
}
