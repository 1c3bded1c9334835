// The kernels built for avx512 (16-float vectors), chosen at run time when the CPU has it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2")
#endif
#define JATTN_ISA avx512
#define JATTN_ISA_NAME "avx512"
#define JATTN_W 16
#define JATTN_MR 12
#define JATTN_WIDE_MR 6
#define JATTN_SCALEF 1
#include <immintrin.h>
#include "attention_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace jattn {
const Isa* isa_avx512() { return &avx512::kIsa; }
}  // namespace jattn
#else
namespace jattn {
const Isa* isa_avx512() { return nullptr; }
}  // namespace jattn
#endif
