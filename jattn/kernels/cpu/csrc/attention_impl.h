// The attention kernels for one instruction set, written once with GCC/Clang vector
// extensions and compiled three times (attention_avx512.cc, attention_avx2.cc,
// attention_generic.cc), each under its own target pragma. Before including, define:
//   JATTN_ISA  the namespace (avx512, avx2, generic)
//   JATTN_W    floats per vector register (16, 8, 4)
//   JATTN_MR   micro-kernel rows (accumulators: 2 * JATTN_MR vectors)
//   JATTN_WIDE_MR  rows of the micro-kernel four vectors wide (4 * JATTN_WIDE_MR
//              accumulators), taken where a product is that wide; 0: none. Per operand
//              loaded it does more multiply-adds than the MR x 2 one (measured on the
//              AVX-512 EPYC: the forward's products 20% faster at D = 64).
//
// FlashAttention-2 structure. Forward, one item per (batch, head, query block): for each key
// block that the masks leave visible, S = Q K^T (a register-blocked micro-kernel against
// the keys XLA transposed once per call), then one pass per row fusing scale, soft-capping, the
// mask, the running max, a polynomial exp and the running sum, then O += P V. Backward, two
// passes that each write their own outputs (no atomics, no reductions across threads):
// per (batch, kv head, key block) dK and dV over every query block of the heads sharing the
// kv head; per (batch, head, query block) dQ over every key block. Or, where its items
// balance on the workers, one pass per (batch, kv head) with dQ accumulated in place: the
// same sums in the same order, so the same bits. Tiles run in row blocks of 4 MR rows; on
// a partial tile each block's products stop at the last column its rows can see.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "attention.h"

namespace jattn {
namespace JATTN_ISA {
namespace {

constexpr int W = JATTN_W;
constexpr int NR = 2 * W;
constexpr int MR = JATTN_MR;
constexpr int WMR = JATTN_WIDE_MR;
constexpr float kInf = std::numeric_limits<float>::infinity();
// jattn.large_negative(float32): the lse of a row that attends nothing.
constexpr float kLargeNegative = -0.7f * std::numeric_limits<float>::max();

// Unrolls a loop over a few rows, so that their vectors stay in registers.
#if defined(__clang__)
#define JATTN_UNROLL_ROWS _Pragma("unroll")
#else
#define JATTN_UNROLL_ROWS _Pragma("GCC unroll 8")
#endif

#include "simd.h"

// jattn._prng's element stage: lowbias32 twice over the key index and the row's keys.
inline vu mix(vu x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

// Row i's dropout: its Philox keys, the keep threshold and the survivors' scale.
struct RowDropout {
  bool on;
  uint32_t k0, k1, threshold;
  float scale;
};

// The vector of dropout multipliers (scale or 0) of keys j0 + c ... j0 + c + W - 1.
inline vf dropout_factor(const RowDropout& rd, int64_t key) {
  vu col = (vu)iota() + static_cast<uint32_t>(key);
  vu top = mix(mix(col ^ rd.k0) ^ rd.k1) >> 8;  // jattn._prng keeps the top 24 bits
  return top < (vu{} + rd.threshold) ? splat(rd.scale) : splat(0.f);
}

// ---------------------------------------------------------------------------------------
// Tile products: C[m, n] (+)= sum_p A[i, p] B[p, n], A read with strides (so A or A^T),
// B with unit column stride (row stride b_rs), C with row stride c_rs.
// ---------------------------------------------------------------------------------------

template <int M, int VN>
inline void ukernel(int64_t kc, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                    int64_t b_rs, float* c, int64_t c_rs, bool acc) {
  vf cv[M][VN];
  for (int i = 0; i < M; ++i)
    for (int u = 0; u < VN; ++u) cv[i][u] = vf{};
  for (int64_t p = 0; p < kc; ++p) {
    vf bv[VN];
    for (int u = 0; u < VN; ++u) bv[u] = load(b + p * b_rs + u * W);
    const float* ap = a + p * a_cs;
    for (int i = 0; i < M; ++i) {
      vf ai = splat(ap[i * a_rs]);
      for (int u = 0; u < VN; ++u) cv[i][u] += ai * bv[u];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int u = 0; u < VN; ++u) {
      float* cp = c + i * c_rs + u * W;
      store(cp, acc ? load(cp) + cv[i][u] : cv[i][u]);
    }
}

template <int M, int VN>
inline void ukernel_rows(int64_t rows, int64_t kc, const float* a, int64_t a_rs, int64_t a_cs,
                         const float* b, int64_t b_rs, float* c, int64_t c_rs, bool acc) {
  if constexpr (M > 0) {
    if (rows == M) {
      ukernel<M, VN>(kc, a, a_rs, a_cs, b, b_rs, c, c_rs, acc);
    } else {
      ukernel_rows<M - 1, VN>(rows, kc, a, a_rs, a_cs, b, b_rs, c, c_rs, acc);
    }
  }
}

template <int M, int VN>
inline void gemm_columns(int64_t m, int64_t kc, const float* a, int64_t a_rs, int64_t a_cs,
                         const float* b, int64_t b_rs, float* c, int64_t c_rs, bool acc) {
  int64_t i = 0;
  for (; i + M <= m; i += M)
    ukernel<M, VN>(kc, a + i * a_rs, a_rs, a_cs, b, b_rs, c + i * c_rs, c_rs, acc);
  if (i < m)
    ukernel_rows<M - 1, VN>(m - i, kc, a + i * a_rs, a_rs, a_cs, b, b_rs, c + i * c_rs, c_rs,
                            acc);
}

void gemm(int64_t m, int64_t n, int64_t kc, const float* a, int64_t a_rs, int64_t a_cs,
          const float* b, int64_t b_rs, float* c, int64_t c_rs, bool acc) {
  int64_t j = 0;
  if constexpr (WMR > 0)  // one B panel (kc x 4W, then kc x NR) stays in L1 across the rows
    for (; j + 4 * W <= n; j += 4 * W)
      gemm_columns<WMR, 4>(m, kc, a, a_rs, a_cs, b + j, b_rs, c + j, c_rs, acc);
  for (; j + NR <= n; j += NR)
    gemm_columns<MR, 2>(m, kc, a, a_rs, a_cs, b + j, b_rs, c + j, c_rs, acc);
  for (; j + W <= n; j += W)
    gemm_columns<MR, 1>(m, kc, a, a_rs, a_cs, b + j, b_rs, c + j, c_rs, acc);
  for (; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      float s = 0.f;
      for (int64_t p = 0; p < kc; ++p) s += a[i * a_rs + p * a_cs] * b[p * b_rs + j];
      c[i * c_rs + j] = acc ? c[i * c_rs + j] + s : s;
    }
}

// C[i, j] = A[i, :] . B[j, :] for a few rows of A (decoding): dot products along the rows,
// reading B (the keys) in place instead of a transposed copy; columns n..n_pad get 0.
void gemm_rows_dot(int64_t m, int64_t n, int64_t n_pad, int64_t kc, const float* a,
                   int64_t a_rs, const float* b, int64_t b_rs, float* c, int64_t c_rs) {
  const int64_t kv = kc / W * W;
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = a + i * a_rs;
    float* ci = c + i * c_rs;
    for (int64_t j = 0; j < n; ++j) {
      const float* bj = b + j * b_rs;
      vf acc = vf{};
      for (int64_t p = 0; p < kv; p += W) acc += load(ai + p) * load(bj + p);
      float sum = hsum(acc);
      for (int64_t p = kv; p < kc; ++p) sum += ai[p] * bj[p];
      ci[j] = sum;
    }
    for (int64_t j = n; j < n_pad; ++j) ci[j] = 0.f;
  }
}

// ---------------------------------------------------------------------------------------
// Which tiles the masks leave visible
// ---------------------------------------------------------------------------------------

enum class TileState { kEmpty, kPartial, kFull };

struct Batch {  // one batch row's lengths, segment ids, dropout rate, bias and masks
  int64_t q_len, kv_len;
  const int32_t* q_seg;
  const int32_t* kv_seg;
  uint32_t drop_threshold;
  float drop_scale;
  const float* bias;         // null: none
  const uint8_t* mask;       // null: none
  const int32_t* blocks;     // the block mask's tile map (null: none)
  const uint8_t* tile_mask;  // its PARTIAL tiles' bits
};

Batch batch(const Params& p, const Tensors& t, int64_t b) {
  Batch r;
  r.q_len = std::min<int64_t>(std::max<int32_t>(t.q_len[b], 0), p.Tq);
  r.kv_len = std::min<int64_t>(std::max<int32_t>(t.kv_len[b], 0), p.Tk);
  r.q_seg = p.has_seg ? t.q_seg + b * p.Tq : nullptr;
  r.kv_seg = p.has_seg ? t.kv_seg + b * p.Tk : nullptr;
  r.drop_threshold = p.has_dropout ? t.drop_threshold[b] : 0;
  r.drop_scale = p.has_dropout ? t.drop_scale[b] : 1.f;
  r.bias = p.has_bias ? t.bias + t.bias_offset[b] : nullptr;
  r.mask = p.has_mask ? t.mask + t.mask_offset[b] : nullptr;
  r.blocks = p.has_blocks ? t.blocks + t.blocks_offset[b] : nullptr;
  r.tile_mask = p.has_blocks ? t.tile_mask + t.tile_mask_offset[b] : nullptr;
  return r;
}

inline RowDropout row_dropout(const Params& p, const Tensors& t, const Batch& bt, int64_t b,
                              int64_t h, int64_t i) {
  if (!p.has_dropout) return {false, 0, 0, 0, 1.f};
  const int64_t row = (b * p.H + h) * p.Tq + i;
  return {true, t.drop_k0[row], t.drop_k1[row], bt.drop_threshold, bt.drop_scale};
}

// The keys [lo, hi) query i sees from the position masks and the key length (hi <= lo: none).
inline void row_range(const Params& p, const Batch& bt, int64_t i, int64_t* lo, int64_t* hi) {
  int64_t l = 0, h = bt.kv_len;
  if (p.causal) h = std::min(h, i + 1);
  if (p.wl >= 0) l = std::max(l, i - p.wl);
  if (p.wr >= 0) h = std::min(h, i + p.wr + 1);
  *lo = l;
  *hi = h;
}

// Whether any / all of n bools (bytes 0 or 1, stride sj) are set, into *any and *all.
inline void scan_bools(const uint8_t* row, int64_t n, int64_t sj, bool* any, bool* all) {
  int64_t j = 0;
  if (sj == 1) {  // eight at a time
    constexpr uint64_t kOnes = 0x0101010101010101ull;
    for (; j + 8 <= n; j += 8) {
      uint64_t word;
      std::memcpy(&word, row + j, 8);
      *any |= word != 0;
      *all &= word == kOnes;
    }
  }
  for (; j < n; ++j) {
    const bool on = row[j * sj] != 0;
    *any |= on;
    *all &= on;
  }
}

inline TileState verdict(bool any, bool all) {
  return !any ? TileState::kEmpty : all ? TileState::kFull : TileState::kPartial;
}

// Whether a mask array hides every position of the tile (kEmpty), none (kFull) or some.
TileState mask_tile_state(const Params& p, const Batch& bt, int64_t h, int64_t i0, int64_t ie,
                          int64_t j0, int64_t je) {
  const uint8_t* mh = bt.mask + h * p.mask_sh;
  const int64_t rows_end = p.mask_si == 0 ? i0 + 1 : ie;  // a broadcast axis: read it once
  const int64_t cols_end = p.mask_sj == 0 ? j0 + 1 : je;
  bool any = false, all = true;
  for (int64_t i = i0; i < rows_end; ++i) {
    scan_bools(mh + i * p.mask_si + j0 * p.mask_sj, cols_end - j0, p.mask_sj, &any, &all);
    if (any && !all) return TileState::kPartial;
  }
  return verdict(any, all);
}

// Row i's block-mask bits of keys [j0, j0 + n) into dst (1: visible): each block tile's
// state, a PARTIAL one's row of the tile mask, ANDed with the mask array's row when the
// call has one. False, dst unwritten, when every block tile the row crosses there is FULL.
bool block_row_bits(const Params& p, const Batch& bt, int64_t h, int64_t i, int64_t j0,
                    int64_t n, uint8_t* dst) {
  const int64_t qb = i / p.bm_q, r = i - qb * p.bm_q, kb0 = j0 / p.bm_k;
  const int64_t kb1 = (j0 + n - 1) / p.bm_k;
  const int32_t* tiles = bt.blocks + h * p.blocks_sh + qb * p.nbk;
  bool all_full = true;
  for (int64_t kb = kb0; kb <= kb1; ++kb) all_full &= tiles[kb] == kTileFull;
  if (all_full) return false;
  for (int64_t kb = kb0, j = j0; kb <= kb1; ++kb) {
    const int64_t end = std::min(j0 + n, (kb + 1) * p.bm_k);
    const int32_t slot = tiles[kb];
    if (slot >= 0)
      std::memcpy(dst + (j - j0),
                  bt.tile_mask + slot * p.tm_sn + r * p.tm_si + (j - kb * p.bm_k) * p.tm_sj,
                  end - j);
    else
      std::memset(dst + (j - j0), slot == kTileFull ? 1 : 0, end - j);
    j = end;
  }
  if (bt.mask != nullptr) {
    const uint8_t* m = bt.mask + h * p.mask_sh + i * p.mask_si + j0 * p.mask_sj;
    for (int64_t u = 0; u < n; ++u) dst[u] &= m[u * p.mask_sj];
  }
  return true;
}

// The block mask's bits (with the mask array's) on the tile [i0, ie) x [j0, je), row by row
// into the scratch row bits: empty, full or partial.
TileState block_bits_tile_state(const Params& p, const Batch& bt, int64_t h, int64_t i0,
                                int64_t ie, int64_t j0, int64_t je, uint8_t* bits) {
  bool any = false, all = true;
  for (int64_t i = i0; i < ie; ++i) {
    if (block_row_bits(p, bt, h, i, j0, je - j0, bits))
      scan_bools(bits, je - j0, 1, &any, &all);
    else if (bt.mask != nullptr)
      scan_bools(bt.mask + h * p.mask_sh + i * p.mask_si + j0 * p.mask_sj,
                 p.mask_sj == 0 ? 1 : je - j0, p.mask_sj, &any, &all);
    else
      any = true;
    if (any && !all) return TileState::kPartial;
  }
  return verdict(any, all);
}

// The block mask's verdict on the kernel tile [i0, ie) x [j0, je): empty if every block it
// overlaps is, full if every one is (the kernel's tiles need not be the block mask's).
TileState block_tile_state(const Params& p, const Batch& bt, int64_t h, int64_t i0, int64_t ie,
                           int64_t j0, int64_t je) {
  const int32_t* tiles = bt.blocks + h * p.blocks_sh;
  bool any = false, all = true;
  for (int64_t qb = i0 / p.bm_q; qb <= (ie - 1) / p.bm_q; ++qb)
    for (int64_t kb = j0 / p.bm_k; kb <= (je - 1) / p.bm_k; ++kb) {
      const int32_t tile = tiles[qb * p.nbk + kb];
      any |= tile != kTileEmpty;
      all &= tile == kTileFull;
    }
  return verdict(any, all);
}

// lo and hi are nondecreasing in i, so a tile's union and intersection of row ranges come
// from its first and last rows; segment ids by their ranges (exact for any ids: disjoint
// ranges share no id, one id on both sides is full); a mask array by reading its tile; a
// block mask by its tile map, and where that is partial by its bits (built in bits, a row
// of bk bytes of scratch), ANDed with the mask array's.
TileState tile_state(const Params& p, const Batch& bt, int64_t h, int64_t i0, int64_t i1,
                     int64_t j0, int64_t j1, uint8_t* bits) {
  int64_t ie = std::min(i1, bt.q_len);
  if (ie <= i0 || j0 >= bt.kv_len) return TileState::kEmpty;
  int64_t lo_first, hi_first, lo_last, hi_last;
  row_range(p, bt, i0, &lo_first, &hi_first);
  row_range(p, bt, ie - 1, &lo_last, &hi_last);
  if (std::max(lo_first, j0) >= std::min(hi_last, j1)) return TileState::kEmpty;
  bool full = ie == i1 && lo_last <= j0 && hi_first >= j1;
  if (p.has_seg) {
    int32_t qmin = bt.q_seg[i0], qmax = qmin, kmin = bt.kv_seg[j0], kmax = kmin;
    for (int64_t i = i0; i < ie; ++i) {
      qmin = std::min(qmin, bt.q_seg[i]);
      qmax = std::max(qmax, bt.q_seg[i]);
    }
    int64_t je = std::min(j1, bt.kv_len);
    for (int64_t j = j0; j < je; ++j) {
      kmin = std::min(kmin, bt.kv_seg[j]);
      kmax = std::max(kmax, bt.kv_seg[j]);
    }
    if (qmax < kmin || kmax < qmin) return TileState::kEmpty;
    full = full && qmin == qmax && kmin == kmax && qmin == kmin;
  }
  const int64_t je = std::min(j1, bt.kv_len);
  TileState blocked = TileState::kFull;
  if (bt.blocks != nullptr) {
    blocked = block_tile_state(p, bt, h, i0, ie, j0, je);
    if (blocked == TileState::kEmpty) return TileState::kEmpty;
  }
  TileState masked = TileState::kFull;
  if (blocked == TileState::kPartial)
    masked = block_bits_tile_state(p, bt, h, i0, ie, j0, je, bits);
  else if (bt.mask != nullptr)
    masked = mask_tile_state(p, bt, h, i0, ie, j0, je);
  if (masked == TileState::kEmpty) return TileState::kEmpty;
  full = full && masked == TileState::kFull;
  return full ? TileState::kFull : TileState::kPartial;
}

// Row i's visible columns of the tile starting at key j0 with nk keys: [cl, ch) and, when
// use_seg is set, only those whose key segment equals seg, and when mrow is set (the mask
// array's row at j0, key stride msj, or the block mask's bits of the row in scratch), only
// those it lets through.
struct RowMask {
  int32_t cl, ch;
  bool use_seg;
  int32_t seg;
  const uint8_t* mrow;
  int64_t msj;
};

// A block mask's bits are built in bits (bk bytes of scratch, read before the next row's).
inline RowMask row_mask(const Params& p, const Batch& bt, TileState state, int64_t h, int64_t i,
                        int64_t j0, int64_t nk, uint8_t* bits) {
  if (state == TileState::kFull) return {0, static_cast<int32_t>(nk), false, 0, nullptr, 0};
  if (i >= bt.q_len) return {0, 0, false, 0, nullptr, 0};
  int64_t lo, hi;
  row_range(p, bt, i, &lo, &hi);
  int64_t cl = std::max<int64_t>(lo - j0, 0), ch = std::min<int64_t>(hi - j0, nk);
  if (ch < cl) ch = cl;
  const uint8_t* mrow =
      bt.mask == nullptr ? nullptr : bt.mask + h * p.mask_sh + i * p.mask_si + j0 * p.mask_sj;
  int64_t msj = p.mask_sj;
  if (bt.blocks != nullptr && block_row_bits(p, bt, h, i, j0, nk, bits)) {
    mrow = bits;
    msj = 1;
  }
  return {static_cast<int32_t>(cl), static_cast<int32_t>(ch), p.has_seg,
          p.has_seg ? bt.q_seg[i] : 0, mrow, msj};
}

// The tile's key segment ids, padded to its column count (read by the vector mask).
void copy_kv_segments(const Params& p, const Batch& bt, int64_t j0, int64_t nk, int64_t ncols,
                      int32_t* dst) {
  if (!p.has_seg) return;
  for (int64_t j = 0; j < nk; ++j) dst[j] = bt.kv_seg[j0 + j];
  for (int64_t j = nk; j < ncols; ++j) dst[j] = 0;
}

// The mask array's bits of columns c ... c + W - 1 (false from ch on: never read past it).
inline vi mask_bits(const RowMask& rm, int64_t c) {
  if (rm.msj == 0) return splati(rm.mrow[0] ? -1 : 0);
  if (c + W <= rm.ch) {
    typedef uint8_t vb __attribute__((vector_size(W)));
    vb x;
    std::memcpy(&x, rm.mrow + c, W);
    return __builtin_convertvector(x, vi) != splati(0);
  }
  vi r = splati(0);
  for (int u = 0; u < W && c + u < rm.ch; ++u) r[u] = rm.mrow[c + u] ? -1 : 0;
  return r;
}

inline vi visible(const RowMask& rm, int64_t c, const int32_t* kseg) {
  if (!rm.use_seg && rm.mrow == nullptr && c >= rm.cl && c + W <= rm.ch) return splati(-1);
  vi col = iota() + static_cast<int32_t>(c);
  vi ok = (col >= splati(rm.cl)) & (col < splati(rm.ch));
  if (rm.use_seg) ok &= loadi(kseg + c) == splati(rm.seg);
  if (rm.mrow != nullptr) ok &= mask_bits(rm, c);
  return ok;
}

// Row i's ALiBi: its head's slope; the logit of key j gains slope * (j - i) (symmetric:
// -slope * |j - i|).
struct RowAlibi {
  bool on, symmetric;
  float slope;
  int64_t i;
};

inline RowAlibi row_alibi(const Params& p, const Tensors& t, int64_t b, int64_t h, int64_t i) {
  if (p.alibi == 0) return {false, false, 0.f, i};
  return {true, p.alibi == 2, t.slopes[b * p.H + h], i};
}

inline vf alibi_distance(const RowAlibi& ra, int64_t key) {
  vi d = iota() + static_cast<int32_t>(key - ra.i);
  vf x = __builtin_convertvector(d, vf);
  return ra.symmetric ? (x < splat(0.f) ? x : -x) : x;
}

// The soft-capped logits of one row, in place: cap * tanh(s * scale / cap), tanh kept in t
// (when not null); logits() then reads them unscaled.
inline void softcap_logits(const Params& p, float* s, int64_t ncols, float* t) {
  for (int64_t c = 0; c < ncols; ++c) {
    float th = std::tanh(s[c] * p.scale / p.softcap);
    if (t != nullptr) t[c] = th;
    s[c] = p.softcap * th;
  }
}

// Columns c ... c + W - 1 of row brow of the bias (0 past nk: padding, never visible).
inline vf bias_vec(const Params& p, const float* brow, int64_t c, int64_t nk) {
  if (p.bias_sj == 0) return splat(brow[0]);
  if (c + W <= nk) return load(brow + c);
  vf x = vf{};
  for (int u = 0; c + u < nk; ++u) x[u] = brow[c + u];
  return x;
}

// The scale and whether the logits are soft-capped, read once into registers (p's floats
// would be read again after every store to a row of floats: they might alias).
struct LogitScale {
  float scale;
  bool capped;
};

inline LogitScale logit_scale(const Params& p) { return {p.scale, p.softcap != 0.f}; }

// Columns c ... c + W - 1 of one row's logits from its products s (key j0 on): scaled and
// ALiBi-biased (or soft-capped before, by softcap_logits), then the bias (brow, null: none).
// Read where they are used, so the row is not rewritten before its max and exp passes.
inline vf logits(const Params& p, const LogitScale& ls, const float* s, int64_t c,
                 const RowAlibi& ra, const float* brow, int64_t nk, int64_t j0) {
  vf x = load(s + c);
  if (!ls.capped) {
    x *= splat(ls.scale);
    if (ra.on) x += splat(ra.slope) * alibi_distance(ra, j0 + c);
  }
  return brow == nullptr ? x : x + bias_vec(p, brow, c, nk);
}

// Row i's bias from key j0 on (null: no bias).
inline const float* bias_row(const Params& p, const Batch& bt, int64_t h, int64_t i,
                             int64_t j0) {
  return bt.bias == nullptr ? nullptr
                            : bt.bias + h * p.bias_sh + i * p.bias_si + j0 * p.bias_sj;
}

// ---------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------

// How many of key tile [j0, j0 + ncols)'s columns rows [i0, i1) can see at all: up to the
// last row's right bound (causal, a right window, the key length; nondecreasing in the row),
// rounded up to whole vectors (the rest are masked where they are read).
inline int64_t visible_columns(const Params& p, const Batch& bt, int64_t i0, int64_t i1,
                               int64_t j0, int64_t ncols) {
  const int64_t last = std::min(i1, bt.q_len) - 1;
  if (last < i0) return 0;
  int64_t lo, hi;
  row_range(p, bt, last, &lo, &hi);
  return std::clamp<int64_t>((hi - j0 + W - 1) / W * W, 0, ncols);
}

// A tile's row blocks: the whole tile when it is full, else blocks of 4 MR rows, each with
// the columns its rows can see (visible_columns); P and dS are 0 past them, so the products
// stop there.
inline int64_t row_block_rows(TileState state, int64_t nq) {
  return state == TileState::kFull ? nq : 4 * MR;
}

inline int64_t row_block_columns(const Params& p, const Batch& bt, TileState state,
                                 int64_t i0, int64_t nr, int64_t j0, int64_t ncols) {
  return state == TileState::kFull ? ncols : visible_columns(p, bt, i0, i0 + nr, j0, ncols);
}

struct Blocks {
  int64_t nqb, nkb;
};

inline Blocks blocks(const Params& p) {
  return {(p.Tq + p.bq - 1) / p.bq, (p.Tk + p.bk - 1) / p.bk};
}

// Whether R rows' logits over ncols columns are their products times a positive scale and
// nothing else: every column visible, no soft-capping, ALiBi, bias or mask. Rounding is
// monotone, so then max(s * scale) is max(s) * scale bit for bit: the max pass only reads
// s, and the exp pass scales as it reads (the bits of the general passes, fewer stores).
template <int R>
inline bool plain_rows(const Params& p, const RowMask* rm, const RowAlibi* ra,
                       const float* const* brow, int64_t ncols) {
  if (p.softcap != 0.f || !(p.scale > 0.f)) return false;
  for (int r = 0; r < R; ++r)
    if (rm[r].use_seg || rm[r].mrow != nullptr || rm[r].cl > 0 || rm[r].ch < ncols ||
        ra[r].on || brow[r] != nullptr)
      return false;
  return true;
}

// The running max's candidates of R rows: their logits' maxima (the logits written over
// the products, -inf where masked), or in the plain case the products' maxima, scaled.
template <int R>
inline void rows_max(const Params& p, bool plain, float* const* s, int64_t ncols, int64_t nk,
                     const RowMask* rm, const int32_t* kseg, const RowAlibi* ra,
                     const float* const* brow, int64_t j0, float* row_max) {
  const LogitScale ls = logit_scale(p);  // in registers: the stores to s may alias p
  vf vmax[R];
  for (int r = 0; r < R; ++r) vmax[r] = splat(-kInf);
  if (plain) {
    for (int64_t c = 0; c < ncols; c += W)
      JATTN_UNROLL_ROWS for (int r = 0; r < R; ++r) {
        vf x = load(s[r] + c);
        vmax[r] = vmax[r] > x ? vmax[r] : x;
      }
    for (int r = 0; r < R; ++r) row_max[r] = hmax(vmax[r]) * ls.scale;
    return;
  }
  for (int64_t c = 0; c < ncols; c += W)
    JATTN_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      vf x = visible(rm[r], c, kseg) ? logits(p, ls, s[r], c, ra[r], brow[r], nk, j0)
                                     : splat(-kInf);
      store(s[r] + c, x);
      vmax[r] = vmax[r] > x ? vmax[r] : x;
    }
  for (int r = 0; r < R; ++r) row_max[r] = hmax(vmax[r]);
}

// P = exp(logits - m) in place over R rows, as 2^((logits - m) log2 e) (mv: each row's
// m; the logits scaled as they are read when kPlain, in the same multiply-add); kDrop:
// dropout applied. The rows' sums of the weights before dropout into sum. The difference
// comes first: 2^(logits log2 e - m log2 e), two rounded products, stopped cancelling once
// |m| neared 1e9 (a -1e10 bias on a row's keys gave inf / inf = NaN).
template <int R, bool kPlain, bool kDrop>
inline void rows_exp(float scale, float* const* s, int64_t ncols, const vf* mv,
                     const RowDropout* rd, int64_t j0, float* sum) {
  const vf log2e = splat(1.44269504088896341f), zero = splat(0.f);
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vf{};
  const vf c = splat(kPlain ? scale : 1.f);
  for (int64_t col = 0; col < ncols; col += W)
    JATTN_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      vf x = (load(s[r] + col) * c - mv[r]) * log2e;
      vf e = vexp2_nonpositive(x < zero ? x : zero);
      acc[r] += e;  // the normaliser counts every weight; dropout drops from the values' sum
      if constexpr (kDrop) e *= dropout_factor(rd[r], j0 + col);
      store(s[r] + col, e);
    }
  for (int r = 0; r < R; ++r) sum[r] = hsum(acc[r]);
}

// R rows of the online softmax, interleaved: each row's logits s[r] (ncols) become P in
// place; m, l and the output rows o[r] (length dv) are updated for the new running max.
// The rows' passes run side by side so that their exp chains overlap (one row at a time
// left the vector units waiting on each exp's latency, about a quarter of the forward);
// each row's arithmetic and order are a lone row's, so R does not change a bit.
template <int R>
inline void softmax_rows(const Params& p, float* const* s, int64_t ncols, int64_t nk,
                         const RowMask* rm, const int32_t* kseg, const RowDropout* rd,
                         const RowAlibi* ra, const float* const* brow, int64_t j0, float* m,
                         float* l, float* const* o, int64_t dv) {
  if (p.softcap != 0.f)
    for (int r = 0; r < R; ++r) softcap_logits(p, s[r], ncols, nullptr);
  const bool plain = plain_rows<R>(p, rm, ra, brow, ncols);
  float m_new[R], sum[R];
  rows_max<R>(p, plain, s, ncols, nk, rm, kseg, ra, brow, j0, m_new);
  vf mv[R];
  for (int r = 0; r < R; ++r) {
    m_new[r] = std::max(m[r], m_new[r]);
    // nothing visible in this row yet: every logit is -inf and exp(-inf - 0) writes P = 0
    mv[r] = splat(m_new[r] == -kInf ? 0.f : m_new[r]);
  }
  RowDropout drop[R];  // local copies, kept in registers across the stores to s
  for (int r = 0; r < R; ++r) drop[r] = rd[r];
  if (plain)
    drop[0].on ? rows_exp<R, true, true>(p.scale, s, ncols, mv, drop, j0, sum)
               : rows_exp<R, true, false>(p.scale, s, ncols, mv, drop, j0, sum);
  else
    drop[0].on ? rows_exp<R, false, true>(p.scale, s, ncols, mv, drop, j0, sum)
               : rows_exp<R, false, false>(p.scale, s, ncols, mv, drop, j0, sum);
  for (int r = 0; r < R; ++r) {
    if (m_new[r] == -kInf) continue;  // m, l and o stay as they are
    // exp(0) is exactly 1: a row whose max did not move skips the exp
    float alpha = m[r] == -kInf ? 0.f : m[r] == m_new[r] ? 1.f : vexp(splat(m[r] - m_new[r]))[0];
    l[r] = l[r] * alpha + sum[r];
    if (alpha != 1.f)
      for (int64_t d = 0; d < dv; ++d) o[r][d] *= alpha;
    m[r] = m_new[r];
  }
}

// Rows of the online softmax run side by side (softmax_rows), each with its own bits row.
constexpr int kSoftmaxRows = 4;

int64_t forward_scratch(const Params& p) {
  // o, m, l, s, the key segment ids and (bytes, in floats) the softmax rows' bits
  return p.bq * p.Dv + 2 * p.bq + p.bq * p.bk + p.bk + (kSoftmaxRows * p.bk + 3) / 4;
}

struct ForwardTile {  // one item's running state (o unnormalised, m, l) and tile scratch
  float *o, *m, *l, *s;
  int32_t* kseg;
  uint8_t* bits;  // kSoftmaxRows rows' block-mask bits (row_mask, tile_state)
};

ForwardTile forward_tile(const Params& p, float* scratch) {
  ForwardTile w;
  w.o = scratch;            // [bq, Dv]
  w.m = w.o + p.bq * p.Dv;  // [bq]
  w.l = w.m + p.bq;         // [bq]
  w.s = w.l + p.bq;         // [bq, bk]
  w.kseg = reinterpret_cast<int32_t*>(w.s + p.bq * p.bk);  // [bk]
  w.bits = reinterpret_cast<uint8_t*>(w.kseg + p.bk);     // [kSoftmaxRows, bk] bytes
  return w;
}

// softmax_rows over tile rows r ... r + R - 1 (queries i0 + r ...) of key tile j0.
template <int R>
inline void softmax_group(const Params& p, const Tensors& t, const Batch& bt, int64_t b,
                          int64_t h, int64_t i0, int64_t r, TileState state, int64_t j0,
                          int64_t nk, int64_t nc, const ForwardTile& w) {
  float* s[R];
  float* o[R];
  const float* brow[R];
  RowMask rm[R];
  RowDropout rd[R];
  RowAlibi ra[R];
  for (int u = 0; u < R; ++u) {
    const int64_t i = i0 + r + u;
    s[u] = w.s + (r + u) * p.bk;
    o[u] = w.o + (r + u) * p.Dv;
    brow[u] = bias_row(p, bt, h, i, j0);
    rm[u] = row_mask(p, bt, state, h, i, j0, nk, w.bits + u * p.bk);
    rd[u] = row_dropout(p, t, bt, b, h, i);
    ra[u] = row_alibi(p, t, b, h, i);
  }
  softmax_rows<R>(p, s, nc, nk, rm, w.kseg, rd, ra, brow, j0, w.m + r, w.l + r, o, p.Dv);
}

// The online softmax of rows [i0, i0 + nq) of (b, h) over key blocks [kb0, kb1), from an
// empty state (or the sink's logit, with_sink: the running max starts there).
void forward_blocks(const Params& p, const Tensors& t, int64_t b, int64_t h, int64_t i0,
                    int64_t nq, int64_t kb0, int64_t kb1, bool with_sink, const ForwardTile& w) {
  const int64_t kh = h / (p.H / p.K);
  const Batch bt = batch(p, t, b);
  std::fill(w.o, w.o + nq * p.Dv, 0.f);
  for (int64_t r = 0; r < nq; ++r) {
    w.m[r] = with_sink ? t.sinks[b * p.H + h] : -kInf;
    w.l[r] = with_sink ? 1.f : 0.f;
  }
  const float* qp = t.q + ((b * p.Tq + i0) * p.H + h) * p.D;
  const int64_t q_rs = p.H * p.D, v_rs = p.K * p.Dv;
  const float* kt_head = t.kt == nullptr ? nullptr : t.kt + (b * p.K + kh) * p.D * p.Tkp;
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int64_t j0 = kb * p.bk, nk = std::min(p.bk, p.Tk - j0);
    const TileState state = tile_state(p, bt, h, i0, i0 + nq, j0, j0 + nk, w.bits);
    if (state == TileState::kEmpty) continue;
    const int64_t ncols = (nk + NR - 1) / NR * NR;
    const float* vp = t.v + ((b * p.Tk + j0) * p.K + kh) * p.Dv;
    copy_kv_segments(p, bt, j0, nk, ncols, w.kseg);
    if (kt_head == nullptr) {  // a few queries: no transposed copy of the keys was made
      const float* kp = t.k + ((b * p.Tk + j0) * p.K + kh) * p.D;
      gemm_rows_dot(nq, nk, ncols, p.D, qp, q_rs, kp, p.K * p.D, w.s, p.bk);
    }
    // Row blocks of 4 MR rows, each through S, softmax and PV while its rows of S are in L1;
    // on a partial tile only the columns the block's last row can see.
    const int64_t step = kt_head == nullptr ? nq : 4 * MR;
    for (int64_t r0 = 0; r0 < nq; r0 += step) {
      const int64_t nr = std::min(step, nq - r0);
      const int64_t nc =
          kt_head == nullptr ? ncols : row_block_columns(p, bt, state, i0 + r0, nr, j0, ncols);
      float* s = w.s + r0 * p.bk;
      if (kt_head != nullptr)
        gemm(nr, nc, p.D, qp + r0 * q_rs, q_rs, 1, kt_head + j0, p.Tkp, s, p.bk, false);
      int64_t r = r0;
      for (; r + kSoftmaxRows <= r0 + nr; r += kSoftmaxRows)
        softmax_group<kSoftmaxRows>(p, t, bt, b, h, i0, r, state, j0, nk, nc, w);
      for (; r < r0 + nr; ++r) softmax_group<1>(p, t, bt, b, h, i0, r, state, j0, nk, nc, w);
      // P is 0 past column nc, so the product stops there (adding 0 * V changes no bit).
      gemm(nr, p.Dv, std::min(nk, nc), s, p.bk, 1, vp, v_rs, w.o + r0 * p.Dv, p.Dv, true);
    }
  }
}

// Row i's output and lse from its unnormalised output o, running max m and sum l. No
// visible key (and no sink): zero output, jattn.large_negative as the lse.
inline void finish_row(const Params& p, const Tensors& t, int64_t b, int64_t h, int64_t i,
                       const float* o, float m, float l) {
  float* out = t.out + ((b * p.Tq + i) * p.H + h) * p.Dv;
  const bool none = l == 0.f;
  const float inv = none ? 0.f : 1.f / l;
  for (int64_t d = 0; d < p.Dv; ++d) out[d] = o[d] * inv;
  t.lse[(b * p.H + h) * p.Tq + i] = none ? kLargeNegative : m + std::log(l);
}

// One (batch, head, query block) over every key block.
void forward_item(const Params& p, const Tensors& t, int64_t item, float* scratch) {
  const Blocks nb = blocks(p);
  const int64_t bh = item % (p.B * p.H);
  const int64_t qb = nb.nqb - 1 - item / (p.B * p.H);  // the longest rows first
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qb * p.bq, nq = std::min(p.bq, p.Tq - i0);
  const ForwardTile w = forward_tile(p, scratch);
  forward_blocks(p, t, b, h, i0, nq, 0, nb.nkb, p.has_sinks, w);
  for (int64_t r = 0; r < nq; ++r) finish_row(p, t, b, h, i0 + r, w.o + r * p.Dv, w.m[r], w.l[r]);
}

// Split-KV decoding: one (batch, head, query block, key split) into the partials; the
// sink enters split 0 only.
inline int64_t splits(const Params& p) { return (p.Tk + p.split_k - 1) / p.split_k; }

void split_item(const Params& p, const Tensors& t, int64_t item, float* scratch) {
  const Blocks nb = blocks(p);
  const int64_t ns = splits(p), per_split = p.split_k / p.bk;
  const int64_t bh = item % (p.B * p.H), split = item / (p.B * p.H) % ns;
  const int64_t qb = item / (p.B * p.H * ns);
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qb * p.bq, nq = std::min(p.bq, p.Tq - i0);
  const ForwardTile w = forward_tile(p, scratch);
  const int64_t kb0 = split * per_split, kb1 = std::min(nb.nkb, kb0 + per_split);
  forward_blocks(p, t, b, h, i0, nq, kb0, kb1, p.has_sinks && split == 0, w);
  const int64_t row = (bh * ns + split) * p.Tq + i0;
  std::copy(w.m, w.m + nq, t.part_m + row);
  std::copy(w.l, w.l + nq, t.part_l + row);
  std::copy(w.o, w.o + nq * p.Dv, t.part_o + row * p.Dv);
}

// The partial softmaxes of one (batch, head, query block) merged in split order.
void merge_item(const Params& p, const Tensors& t, int64_t item, float* scratch) {
  const int64_t ns = splits(p);
  const int64_t bh = item % (p.B * p.H), qb = item / (p.B * p.H);
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qb * p.bq, nq = std::min(p.bq, p.Tq - i0);
  float* o = scratch;  // [Dv]
  for (int64_t i = i0; i < i0 + nq; ++i) {
    float m = -kInf;
    for (int64_t sp = 0; sp < ns; ++sp) m = std::max(m, t.part_m[(bh * ns + sp) * p.Tq + i]);
    float l = 0.f;
    std::fill(o, o + p.Dv, 0.f);
    for (int64_t sp = 0; sp < ns; ++sp) {
      const int64_t row = (bh * ns + sp) * p.Tq + i;
      if (t.part_m[row] == -kInf) continue;  // nothing visible in this split
      const float alpha = std::exp(t.part_m[row] - m);
      l += t.part_l[row] * alpha;
      const float* po = t.part_o + row * p.Dv;
      for (int64_t d = 0; d < p.Dv; ++d) o[d] += po[d] * alpha;
    }
    finish_row(p, t, b, h, i, o, m, l);
  }
}

// ---------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------

// P of one row from the saved lse (in place), tanh kept in t when soft-capping.
inline void probabilities_row(const Params& p, float* s, int64_t ncols, int64_t nk,
                              const RowMask& rm, const int32_t* kseg, float lse, float* t,
                              const RowAlibi& ra, const float* brow, int64_t j0) {
  if (p.softcap != 0.f) softcap_logits(p, s, ncols, t);
  const vf lv = splat(lse);
  const LogitScale ls = logit_scale(p);
  for (int64_t c = 0; c < ncols; c += W) {
    vf x = visible(rm, c, kseg) ? logits(p, ls, s, c, ra, brow, nk, j0) - lv : splat(-kInf);
    store(s + c, vexp(x));
  }
}

// Where one row's bias gradient goes (Params::dbias_mode; p null: not this pass's):
// mode 1 the row of dS from key j0 on, 2 the row's sum, 3 the column sums from key j0 on.
struct DbiasRow {
  int64_t mode;
  float* p;
};

// Rows are owned by the dQ pass (and the single pass), key columns by the dK/dV pass.
inline DbiasRow dbias_row(const Params& p, const Tensors& t, int64_t b, int64_t h, int64_t i,
                          int64_t j0, bool rows, bool cols) {
  const int64_t bh = b * p.H + h;
  if (p.dbias_mode == 1 && rows) return {1, t.dbias + (bh * p.Tq + i) * p.Tk + j0};
  if (p.dbias_mode == 2 && rows) return {2, t.dbias + bh * p.Tq + i};
  if (p.dbias_mode == 3 && cols) return {3, t.dbias + bh * p.Tk + j0};
  return {0, nullptr};
}

// dS of columns c ... c + W - 1 into the bias gradient (columns past nk are padding).
inline void record_dbias(const DbiasRow& db, int64_t c, int64_t nk, vf ds, vf* row_sum) {
  if (db.mode == 2) {
    *row_sum += ds;  // padding columns hold exactly 0 (P is 0 there)
  } else if (c + W <= nk) {
    store(db.p + c, db.mode == 1 ? ds : load(db.p + c) + ds);
  } else {
    for (int u = 0; c + u < nk; ++u) db.p[c + u] = db.mode == 1 ? ds[u] : db.p[c + u] + ds[u];
  }
}

// dS = P * (Z dP - delta) (* (1 - tanh^2) when soft-capping) * scale, into dp, with Z the
// dropout multipliers; with drop_p, P becomes Z P in place (for dV). With dslope, the row's
// ALiBi slope gradient sum_j dS_ij (j - i) (before the scale) is added to *dslope; dS
// before the scale and the soft-cap (the bias's gradient) goes where db says.
inline void dlogits_row(const Params& p, float* prob, float* dp, int64_t ncols, int64_t nk,
                        float delta, const float* t, const RowDropout& rd, int64_t j0,
                        bool drop_p, const RowAlibi& ra, float* dslope, const DbiasRow& db) {
  const vf dv = splat(delta), sc = splat(p.scale);
  vf slope_acc = vf{}, bias_acc = vf{};
  for (int64_t c = 0; c < ncols; c += W) {
    vf pr = load(prob + c), g = load(dp + c);
    if (rd.on) {
      vf z = dropout_factor(rd, j0 + c);
      g *= z;
      if (drop_p) store(prob + c, pr * z);
    }
    vf ds = pr * (g - dv);
    if (dslope != nullptr) slope_acc += ds * alibi_distance(ra, j0 + c);
    if (db.p != nullptr) record_dbias(db, c, nk, ds, &bias_acc);
    store(dp + c, ds * sc);
  }
  if (dslope != nullptr) *dslope += hsum(slope_acc);
  if (db.mode == 2 && db.p != nullptr) *db.p += hsum(bias_acc);
  if (p.softcap != 0.f)
    for (int64_t c = 0; c < ncols; ++c) dp[c] *= 1.f - t[c] * t[c];
}

struct BackwardTile {  // the scratch of one (query block, key block) tile
  const float *kt, *vt;  // the key block's K^T [D, Tkp] and V^T [Dv, Tkp], at column j0
  float *s, *dp, *th;
  int32_t* kseg;
  uint8_t* bits;  // one row's block-mask bits (row_mask, tile_state)
  // Copies with contiguous rows (set_kv_tile, set_q_tile): the key block's K [bk, D], the
  // query block's Q [bq, D] and dO [bq, Dv]. In place their rows are H or K heads apart,
  // a power of two that maps a product's operand panel onto a few L1 sets.
  float *k, *q, *dout;
};

// S -> P and dP -> dS for one tile whose kt, vt and kseg are packed. cols: this pass owns
// the tile's key columns (dK, dV: P becomes Z P for dV; the bias's column sums); rows: its
// query rows (the slopes' and the bias's row gradients).
void backward_tile(const Params& p, const Tensors& t, const Batch& bt, const BackwardTile& w,
                   TileState state, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t j0,
                   int64_t nk, int64_t ncols, bool cols, bool rows) {
  const float* lse = t.lse + (b * p.H + h) * p.Tq + i0;
  const float* delta = t.delta + (b * p.H + h) * p.Tq + i0;
  const int64_t step = row_block_rows(state, nq);
  for (int64_t r0 = 0; r0 < nq; r0 += step) {
    const int64_t nr = std::min(step, nq - r0);
    const int64_t nc = row_block_columns(p, bt, state, i0 + r0, nr, j0, ncols);
    gemm(nr, nc, p.D, w.q + r0 * p.D, p.D, 1, w.kt, p.Tkp, w.s + r0 * p.bk, p.bk, false);
    gemm(nr, nc, p.Dv, w.dout + r0 * p.Dv, p.Dv, 1, w.vt, p.Tkp, w.dp + r0 * p.bk, p.bk, false);
    for (int64_t r = r0; r < r0 + nr; ++r) {
      const int64_t i = i0 + r;
      const RowMask rm = row_mask(p, bt, state, h, i, j0, nk, w.bits);
      float* th = p.softcap != 0.f ? w.th + r * p.bk : nullptr;
      const RowAlibi ra = row_alibi(p, t, b, h, i);
      probabilities_row(p, w.s + r * p.bk, nc, nk, rm, w.kseg, lse[r], th, ra,
                        bias_row(p, bt, h, i, j0), j0);
      const RowDropout rd = row_dropout(p, t, bt, b, h, i);
      float* dslope = rows && ra.on ? t.dslope + (b * p.H + h) * p.Tq + i : nullptr;
      dlogits_row(p, w.s + r * p.bk, w.dp + r * p.bk, nc, nk, delta[r], th, rd, j0, cols, ra,
                  dslope, dbias_row(p, t, b, h, i, j0, rows, cols));
    }
  }
}

// The products after backward_tile, row block by row block: (Z P)^T dO into dv [nk, Dv] and
// dS^T Q into dk [nk, D] (when dv is set), dS K into dq (row stride dq_rs, when set). Both
// backward schedules take them from here, in this order.
void backward_products(const Params& p, const Batch& bt, const BackwardTile& w,
                       TileState state, int64_t i0, int64_t nq, int64_t j0, int64_t nk,
                       int64_t ncols, float* dk, float* dv, float* dq, int64_t dq_rs) {
  const int64_t step = row_block_rows(state, nq);
  for (int64_t r0 = 0; r0 < nq; r0 += step) {
    const int64_t nr = std::min(step, nq - r0);
    const int64_t kc = std::min(nk, row_block_columns(p, bt, state, i0 + r0, nr, j0, ncols));
    const float* s = w.s + r0 * p.bk;
    const float* dp = w.dp + r0 * p.bk;
    if (dv != nullptr) {
      gemm(kc, p.Dv, nr, s, 1, p.bk, w.dout + r0 * p.Dv, p.Dv, dv, p.Dv, true);
      gemm(kc, p.D, nr, dp, 1, p.bk, w.q + r0 * p.D, p.D, dk, p.D, true);
    }
    if (dq != nullptr) gemm(nr, p.D, kc, dp, p.bk, 1, w.k, p.D, dq + r0 * dq_rs, dq_rs, true);
  }
}

// Zeroes the bias gradient of head h's rows [i0, i0 + nq) (modes 1, 2: the rows' owner) and
// of its keys [j0, j0 + nk) (mode 3: the columns' owner), before the tiles add to it.
void zero_dbias_rows(const Params& p, const Tensors& t, int64_t b, int64_t h, int64_t i0,
                     int64_t nq) {
  const int64_t bh = b * p.H + h;
  if (p.dbias_mode == 1) std::fill_n(t.dbias + (bh * p.Tq + i0) * p.Tk, nq * p.Tk, 0.f);
  if (p.dbias_mode == 2) std::fill_n(t.dbias + bh * p.Tq + i0, nq, 0.f);
}

void zero_dbias_cols(const Params& p, const Tensors& t, int64_t b, int64_t h, int64_t j0,
                     int64_t nk) {
  if (p.dbias_mode == 3) std::fill_n(t.dbias + (b * p.H + h) * p.Tk + j0, nk, 0.f);
}

int64_t backward_accumulator_floats(const Params& p) {
  return std::max(p.bk * (p.D + p.Dv), p.bq * p.D);
}

int64_t backward_scratch(const Params& p) {
  return 3 * p.bq * p.bk + 2 * p.bk + backward_accumulator_floats(p) + p.bk * p.D +
         p.bq * (p.D + p.Dv);
}

float* backward_accumulators(const Params& p, float* scratch) {
  return scratch + 3 * p.bq * p.bk + 2 * p.bk;
}

BackwardTile backward_scratch_tile(const Params& p, float* scratch) {
  BackwardTile w;
  w.kt = w.vt = nullptr;
  w.s = scratch;
  w.dp = w.s + p.bq * p.bk;
  w.th = w.dp + p.bq * p.bk;
  w.kseg = reinterpret_cast<int32_t*>(w.th + p.bq * p.bk);
  w.bits = reinterpret_cast<uint8_t*>(w.kseg + p.bk);
  w.k = backward_accumulators(p, scratch) + backward_accumulator_floats(p);
  w.q = w.k + p.bk * p.D;
  w.dout = w.q + p.bq * p.D;
  return w;
}

// Copies m rows of n floats, row stride rs, to contiguous rows.
void copy_rows(int64_t m, int64_t n, const float* src, int64_t rs, float* dst) {
  for (int64_t i = 0; i < m; ++i) std::memcpy(dst + i * n, src + i * rs, sizeof(float) * n);
}

// Copies the rows of query block [i0, i0 + nq) of head h (Q and dO).
void set_q_tile(const Params& p, const Tensors& t, BackwardTile* w, int64_t b, int64_t h,
                int64_t i0, int64_t nq) {
  const int64_t row = (b * p.Tq + i0) * p.H + h;
  copy_rows(nq, p.D, t.q + row * p.D, p.H * p.D, w->q);
  copy_rows(nq, p.Dv, t.dout + row * p.Dv, p.H * p.Dv, w->dout);
}

// Points the tile at key block j0 of kv head kh and copies its key segment ids.
void set_kv_tile(const Params& p, const Tensors& t, const Batch& bt, BackwardTile* w, int64_t b,
                 int64_t kh, int64_t j0, int64_t nk, int64_t ncols) {
  w->kt = t.kt + (b * p.K + kh) * p.D * p.Tkp + j0;
  w->vt = t.vt + (b * p.K + kh) * p.Dv * p.Tkp + j0;
  copy_rows(nk, p.D, t.k + ((b * p.Tk + j0) * p.K + kh) * p.D, p.K * p.D, w->k);
  copy_kv_segments(p, bt, j0, nk, ncols, w->kseg);
}

// dK, dV of one (batch, kv head, key block) over the query blocks of its heads; with the dQ
// pass below, the two-pass backward (no reduction across workers, parallel over key blocks).
void backward_kv_item(const Params& p, const Tensors& t, int64_t item, float* scratch) {
  const Blocks nb = blocks(p);
  const int64_t bk_index = item / (p.B * p.K), bkh = item % (p.B * p.K);
  const int64_t b = bkh / p.K, kh = bkh % p.K, group = p.H / p.K;
  const int64_t j0 = bk_index * p.bk, nk = std::min(p.bk, p.Tk - j0);
  const int64_t ncols = (nk + NR - 1) / NR * NR;
  const Batch bt = batch(p, t, b);
  BackwardTile w = backward_scratch_tile(p, scratch);
  float* dk = backward_accumulators(p, scratch);  // [nk, D]
  float* dv = dk + p.bk * p.D;                    // [nk, Dv]
  std::fill(dk, dk + nk * p.D, 0.f);
  std::fill(dv, dv + nk * p.Dv, 0.f);
  set_kv_tile(p, t, bt, &w, b, kh, j0, nk, ncols);
  for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
    zero_dbias_cols(p, t, b, h, j0, nk);
    for (int64_t qb = 0; qb < nb.nqb; ++qb) {
      const int64_t i0 = qb * p.bq, nq = std::min(p.bq, p.Tq - i0);
      const TileState state = tile_state(p, bt, h, i0, i0 + nq, j0, j0 + nk, w.bits);
      if (state == TileState::kEmpty) continue;
      set_q_tile(p, t, &w, b, h, i0, nq);
      backward_tile(p, t, bt, w, state, b, h, i0, nq, j0, nk, ncols, true, false);
      backward_products(p, bt, w, state, i0, nq, j0, nk, ncols, dk, dv, nullptr, 0);
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    std::memcpy(t.dk + ((b * p.Tk + j0 + j) * p.K + kh) * p.D, dk + j * p.D,
                sizeof(float) * p.D);
    std::memcpy(t.dv + ((b * p.Tk + j0 + j) * p.K + kh) * p.Dv, dv + j * p.Dv,
                sizeof(float) * p.Dv);
  }
}

// dQ of one (batch, head, query block) over its key blocks.
void backward_q_item(const Params& p, const Tensors& t, int64_t item, float* scratch) {
  const Blocks nb = blocks(p);
  const int64_t bh = item % (p.B * p.H);
  const int64_t qb = nb.nqb - 1 - item / (p.B * p.H);
  const int64_t b = bh / p.H, h = bh % p.H, kh = h / (p.H / p.K);
  const int64_t i0 = qb * p.bq, nq = std::min(p.bq, p.Tq - i0);
  const Batch bt = batch(p, t, b);
  BackwardTile w = backward_scratch_tile(p, scratch);
  float* dq = backward_accumulators(p, scratch);  // [nq, D]
  std::fill(dq, dq + nq * p.D, 0.f);
  if (p.alibi != 0) std::fill_n(t.dslope + (b * p.H + h) * p.Tq + i0, nq, 0.f);
  zero_dbias_rows(p, t, b, h, i0, nq);
  set_q_tile(p, t, &w, b, h, i0, nq);
  for (int64_t kb = 0; kb < nb.nkb; ++kb) {
    const int64_t j0 = kb * p.bk, nk = std::min(p.bk, p.Tk - j0);
    const TileState state = tile_state(p, bt, h, i0, i0 + nq, j0, j0 + nk, w.bits);
    if (state == TileState::kEmpty) continue;
    const int64_t ncols = (nk + NR - 1) / NR * NR;
    set_kv_tile(p, t, bt, &w, b, kh, j0, nk, ncols);
    backward_tile(p, t, bt, w, state, b, h, i0, nq, j0, nk, ncols, false, true);
    backward_products(p, bt, w, state, i0, nq, j0, nk, ncols, nullptr, nullptr, dq, p.D);
  }
  for (int64_t r = 0; r < nq; ++r)
    std::memcpy(t.dq + ((b * p.Tq + i0 + r) * p.H + h) * p.D, dq + r * p.D,
                sizeof(float) * p.D);
}

// dK, dV and dQ of one (batch, kv head) in a single pass over its tiles: dQ accumulates in
// place in the output (only this item writes those rows), key block by key block in order.
// Five tile products per tile instead of the two passes' seven, for calls with enough
// (batch, kv head) pairs to keep every worker busy.
void backward_head_item(const Params& p, const Tensors& t, int64_t item, float* scratch) {
  const Blocks nb = blocks(p);
  const int64_t b = item / p.K, kh = item % p.K, group = p.H / p.K;
  const Batch bt = batch(p, t, b);
  BackwardTile w = backward_scratch_tile(p, scratch);
  float* dk = backward_accumulators(p, scratch);  // [bk, D]
  float* dv = dk + p.bk * p.D;                    // [bk, Dv]
  for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
    for (int64_t i = 0; i < p.Tq; ++i)
      std::fill_n(t.dq + ((b * p.Tq + i) * p.H + h) * p.D, p.D, 0.f);
    if (p.alibi != 0) std::fill_n(t.dslope + (b * p.H + h) * p.Tq, p.Tq, 0.f);
    zero_dbias_rows(p, t, b, h, 0, p.Tq);
    zero_dbias_cols(p, t, b, h, 0, p.Tk);
  }
  for (int64_t kb = 0; kb < nb.nkb; ++kb) {
    const int64_t j0 = kb * p.bk, nk = std::min(p.bk, p.Tk - j0);
    const int64_t ncols = (nk + NR - 1) / NR * NR;
    std::fill(dk, dk + nk * p.D, 0.f);
    std::fill(dv, dv + nk * p.Dv, 0.f);
    set_kv_tile(p, t, bt, &w, b, kh, j0, nk, ncols);
    for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
      for (int64_t qb = 0; qb < nb.nqb; ++qb) {
        const int64_t i0 = qb * p.bq, nq = std::min(p.bq, p.Tq - i0);
        const TileState state = tile_state(p, bt, h, i0, i0 + nq, j0, j0 + nk, w.bits);
        if (state == TileState::kEmpty) continue;
        set_q_tile(p, t, &w, b, h, i0, nq);
        backward_tile(p, t, bt, w, state, b, h, i0, nq, j0, nk, ncols, true, true);
        float* dq = t.dq + ((b * p.Tq + i0) * p.H + h) * p.D;
        backward_products(p, bt, w, state, i0, nq, j0, nk, ncols, dk, dv, dq, p.H * p.D);
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      std::memcpy(t.dk + ((b * p.Tk + j0 + j) * p.K + kh) * p.D, dk + j * p.D,
                  sizeof(float) * p.D);
      std::memcpy(t.dv + ((b * p.Tk + j0 + j) * p.K + kh) * p.Dv, dv + j * p.Dv,
                  sizeof(float) * p.Dv);
    }
  }
}

int64_t scratch_floats(const Params& p) {
  return std::max(forward_scratch(p), backward_scratch(p)) + 64;
}

const Isa kIsa = {JATTN_ISA_NAME,   NR,           MR,         scratch_floats,
                  forward_item,     split_item,   merge_item, backward_kv_item,
                  backward_q_item,  backward_head_item};

}  // namespace
}  // namespace JATTN_ISA
}  // namespace jattn
