// jattn's fused paged attention (forward): what the FFI handler (the paged block at the end
// of ffi.cc) and the per-ISA kernels (paged_<isa>.cc, from paged_impl.h) share.
//
// Layouts (row-major): q [R, T, H, D]; k_pages [N, S, K, D] and v_pages [N, S, K, Dv],
// float32, bfloat16, float16 (read as float32, exactly), or int8 with float32 scales
// [N, S, K] (key = k_pages * k_scales); page_table int32
// [R, P] (position p of row r is at offset p % S of page page_table[r, p / S]; an entry
// outside [0, N) is unallocated and never read: its keys and values count as zeros);
// out [R, T, H, Dv].
// Query t of row r (t < real[r]) sees key p iff p < length[r] and, if causal,
// p <= start[r] + t; other queries get zero output. Query head h reads kv head h / (H / K).
#ifndef JATTN_KERNELS_CPU_PAGED_H_
#define JATTN_KERNELS_CPU_PAGED_H_

#include <cstdint>

namespace jattn {

enum class PageType { kF32, kBF16, kF16, kS8 };

struct PagedParams {
  int64_t R, T, H, K, D, Dv, N, S, P;
  int64_t item_heads = 1;  // kv heads per work item (1 or K), set with the items
  float scale;
  bool causal;
  PageType page;  // the pages' element type (int8: with float32 scales)
};

struct PagedTensors {
  const float* q = nullptr;
  const void* k = nullptr;  // pages of PagedParams::page
  const void* v = nullptr;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  const int32_t* table = nullptr;
  const int32_t* start = nullptr;  // [R]: tokens held before the chunk
  const int32_t* real = nullptr;   // [R]: real queries, already capped to [0, T] and capacity
  const int32_t* length = nullptr;  // [R]: tokens held after the chunk, capped to capacity
  float* out = nullptr;
  float* part = nullptr;  // split partials: per (item, query of its group) m, l, acc[Dv]
};

// One work item: the queries of row `row` on the heads of kv heads [head, head +
// PagedParams::item_heads) against keys [key_begin, key_end); `part` < 0: write the
// normalized output, else the unnormalized partial state at part (merged by merge_item,
// over the `splits` consecutive items). Each kv head's arithmetic is the same whatever
// item_heads: only the order in which memory is read changes.
struct PagedItem {
  int64_t row, head, key_begin, key_end, part, splits;
};

struct PagedIsa {
  const char* name;
  int64_t (*scratch_floats)(const PagedParams&);
  void (*item)(const PagedParams&, const PagedTensors&, const PagedItem&, float* scratch);
  // Merges the partials of `splits` items from `first` in order into the output.
  void (*merge_item)(const PagedParams&, const PagedTensors&, const PagedItem& first);
};

const PagedIsa* paged_isa_generic();
const PagedIsa* paged_isa_avx2();
const PagedIsa* paged_isa_avx512();

}  // namespace jattn

#endif  // JATTN_KERNELS_CPU_PAGED_H_
