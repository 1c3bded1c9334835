// jattn's fused CPU attention: what the FFI handlers (ffi.cc) and the per-ISA kernels share.
//
// Layouts (row-major, batch dims flattened to B by the handlers):
//   q [B, Tq, H, D], k [B, Tk, K, D], v [B, Tk, K, Dv], out [B, Tq, H, Dv], lse [B, H, Tq];
//   kt [B, K, D, Tkp], vt [B, K, Dv, Tkp] (k, v transposed and zero-padded to Tkp keys);
//   q_len, kv_len int32 [B]; q_seg int32 [B, Tq], kv_seg int32 [B, Tk]; sinks float [B, H];
//   bias float and mask bool in their own broadcast shapes [batch..., H|1, Tq|1, Tk|1], read
//   through per-batch offsets and strides (0 on a broadcast axis).
// Query i of batch b sees key j iff i < q_len[b], j < kv_len[b], (not causal or j <= i),
// (wl < 0 or j >= i - wl), (wr < 0 or j <= i + wr), (no segments or q_seg[i] == kv_seg[j])
// (no mask or mask[b, h, i, j]) and (no block mask or its tile's state allows it: FULL, or
// PARTIAL with the tile mask's bit set). The bias is added to the logits after the soft-cap and
// ALiBi (jattn.dense's order: scale, score_mod, bias).
// Dropout keeps weight (i, j) iff top24(mix(mix(j ^ k0[i]) ^ k1[i])) < threshold, with jattn's
// position-keyed generator (jattn/_prng.py), so the mask is the blockwise and dense paths'.
#ifndef JATTN_KERNELS_CPU_ATTENTION_H_
#define JATTN_KERNELS_CPU_ATTENTION_H_

#include <cstdint>

namespace jattn {

// A block mask's tile map entries other than a PARTIAL tile's slot (>= 0).
constexpr int32_t kTileEmpty = -1;
constexpr int32_t kTileFull = -2;

struct Params {
  int64_t B, Tq, Tk, H, K, D, Dv;
  int64_t Tkp;  // the row length of kt and vt: at least Tk rounded up to a multiple of bk
  float scale;
  float softcap;  // 0: none; else logits become softcap * tanh(logits / softcap)
  bool causal;
  int64_t wl, wr;  // window left / right; -1: unlimited
  bool has_seg, has_sinks, has_dropout;
  int64_t alibi;  // 0: none, 1: slope * (j - i), 2: symmetric, -slope * |j - i|
  int64_t bq, bk;  // tile sizes (bk a multiple of the ISA's micro-kernel width)
  bool has_bias, has_mask;
  int64_t bias_sh, bias_si, bias_sj;  // the bias's head, query and key strides (0: broadcast)
  int64_t mask_sh, mask_si, mask_sj;
  // The bias gradient the backward writes (before XLA sums the broadcast batch/head axes):
  // 0 none, 1 dS itself [B, H, Tq, Tk], 2 its row sums [B, H, Tq], 3 its column sums [B, H, Tk].
  int64_t dbias_mode;
  // A block mask's tile map int32 [batch...|1, H|1, nbq, nbk] of [bm_q, bm_k] tiles (its
  // head stride blocks_sh, 0: broadcast): kTileEmpty, kTileFull, or a PARTIAL tile's slot
  // s >= 0 in the tile mask [batch...|1, n_partial, bm_q, bm_k] (the mask_mod XLA evaluated
  // on the partial tiles alone; strides tm_sn, tm_si, tm_sj). Its bits are ANDed with the
  // call's mask array (has_mask), which is read as without a block mask.
  bool has_blocks;
  int64_t bm_q, bm_k, nbq, nbk, blocks_sh;
  int64_t tm_sn, tm_si, tm_sj;
  // Split-KV decoding (forward): key splits of split_k keys each, merged in order (0: off).
  int64_t split_k;
};

struct Tensors {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* kt = nullptr;  // [B, K, D, Tkp]: the keys transposed (ffi.cc did it), zero-padded
  const float* vt = nullptr;  // [B, K, Dv, Tkp]: the values transposed (backward only)
  const int32_t* q_len = nullptr;
  const int32_t* kv_len = nullptr;
  const int32_t* q_seg = nullptr;
  const int32_t* kv_seg = nullptr;
  const float* sinks = nullptr;
  const float* slopes = nullptr;  // ALiBi [B, H]
  const float* bias = nullptr;
  const int64_t* bias_offset = nullptr;  // [B]: where each flattened batch row's bias starts
  const uint8_t* mask = nullptr;          // bool, True = attend
  const int64_t* mask_offset = nullptr;   // [B]
  const int32_t* blocks = nullptr;        // the block mask's tile map (Params::has_blocks)
  const int64_t* blocks_offset = nullptr;  // [B]
  const uint8_t* tile_mask = nullptr;      // its PARTIAL tiles' bits, bool, True = attend
  const int64_t* tile_mask_offset = nullptr;  // [B]
  // Split-KV partials [B, H, n_splits, Tq] (m, l) and [B, H, n_splits, Tq, Dv] (o).
  float* part_m = nullptr;
  float* part_l = nullptr;
  float* part_o = nullptr;
  // Dropout (jattn._prng): each row's two Philox keys [B, H, Tq]; per batch row the keep
  // threshold on the top 24 bits and 1 / keep probability.
  const uint32_t* drop_k0 = nullptr;
  const uint32_t* drop_k1 = nullptr;
  const uint32_t* drop_threshold = nullptr;
  const float* drop_scale = nullptr;
  // forward outputs
  float* out = nullptr;
  float* lse = nullptr;
  // backward inputs (lse above is then an input) and outputs
  const float* dout = nullptr;
  const float* delta = nullptr;  // [B, H, Tq]: rowsum(dout * out) - (lse cotangent)
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  float* dslope = nullptr;  // ALiBi [B, H, Tq]: each row's slope gradient
  float* dbias = nullptr;   // see Params::dbias_mode
};

// One instruction set's kernels. Each work item is independent and computed in a fixed
// order, so results do not depend on the number of threads or on scheduling.
struct Isa {
  const char* name;
  int64_t nr;                                   // micro-kernel width: bk's multiple
  int64_t mr;                                   // micro-kernel rows
  int64_t (*scratch_floats)(const Params&);     // per-thread scratch size
  void (*forward_item)(const Params&, const Tensors&, int64_t item, float* scratch);
  void (*split_item)(const Params&, const Tensors&, int64_t item, float* scratch);
  void (*merge_item)(const Params&, const Tensors&, int64_t item, float* scratch);
  void (*backward_kv_item)(const Params&, const Tensors&, int64_t item, float* scratch);
  void (*backward_q_item)(const Params&, const Tensors&, int64_t item, float* scratch);
  void (*backward_head_item)(const Params&, const Tensors&, int64_t item, float* scratch);
};

// The kernels of each build (attention_<isa>.cc); avx512 and avx2 are null off x86-64.
const Isa* isa_generic();
const Isa* isa_avx2();
const Isa* isa_avx512();

}  // namespace jattn

#endif  // JATTN_KERNELS_CPU_ATTENTION_H_
