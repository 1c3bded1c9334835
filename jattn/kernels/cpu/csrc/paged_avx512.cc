// The paged attention kernel built for avx512, chosen when the attention kernels are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged.h"

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
#include "paged_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace jattn {
const PagedIsa* paged_isa_avx512() { return &avx512::kPagedIsa; }
}  // namespace jattn
#else
namespace jattn {
const PagedIsa* paged_isa_avx512() { return nullptr; }
}  // namespace jattn
#endif
