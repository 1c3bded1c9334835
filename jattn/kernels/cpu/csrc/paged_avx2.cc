// The paged attention kernel built for avx2, chosen when the attention kernels are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi2")
#endif
#define JATTN_ISA avx2
#define JATTN_ISA_NAME "avx2"
#define JATTN_W 8
#include "paged_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace jattn {
const PagedIsa* paged_isa_avx2() { return &avx2::kPagedIsa; }
}  // namespace jattn
#else
namespace jattn {
const PagedIsa* paged_isa_avx2() { return nullptr; }
}  // namespace jattn
#endif
