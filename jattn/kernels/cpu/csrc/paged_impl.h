// The fused paged attention kernel for one instruction set, written once with GCC/Clang
// vector extensions and compiled per build (paged_avx512.cc, paged_avx2.cc,
// paged_generic.cc), each under its own target pragma. Before including, define:
//   JATTN_ISA  the namespace (avx512, avx2, generic)
//   JATTN_ISA_NAME  its name
//   JATTN_W    floats per vector register (16, 8, 4)
//
// One item per (row, kv heads, key split): for each of its kv heads, the queries of the
// heads sharing it run an online softmax over blocks of kBlock keys read through the page
// table in place (a pointer per key, so any page size reads alike; each block's lines read
// in a tight loop before it computes, touch_block); a block's logits are q . k over D
// (with several queries, from the block's keys transposed once, a few queries sharing each
// key vector's load; with fewer, W keys' products reduced together, logits_keys), its
// weights a vectorized polynomial exp over the vectors holding its keys, and the values
// accumulate as acc += p v over Dv (two vectors of acc per query held in registers over
// the block's keys, a few queries sharing each value vector's load, or a lone query's sums
// in independent chains). An item of several kv heads
// takes a block of keys for each head in turn, so it reads the block's token records (all
// kv heads of a token, contiguous) together rather than a head's slice of them at a time.
// A split writes its unnormalized state (max, sum, acc) and merge_item combines a row's
// splits in their order. Every sum runs in a fixed order within one item: the results do
// not depend on the number of threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "paged.h"

namespace jattn {
namespace JATTN_ISA {
namespace {

constexpr int W = JATTN_W;
constexpr int64_t kBlock = 64;  // keys per block (a multiple of every W)
// From this many queries per item on, a block's keys are transposed once and every query's
// logits come a vector of keys at a time (no horizontal sum per key).
constexpr int64_t kTransposeMinQueries = 4;
// Queries whose value accumulations share each value vector's load.
constexpr int kQueries = 4;
constexpr float kInf = std::numeric_limits<float>::infinity();

typedef int8_t vb __attribute__((vector_size(W), aligned(1)));

#include "simd.h"

inline vf load(const int8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vb*>(p), vf);
}

// 16-bit pages, read as float32 exactly (no rounding: every bfloat16 and float16 value is a
// float32 value), so a call gives the bits it gives on the pages converted first.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
typedef uint16_t vh __attribute__((vector_size(W * 2), aligned(1)));

inline vu widen(const uint16_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu);
}

inline vf load(const bf16* p) { return (vf)(widen(&p->bits) << 16); }

// float16 -> float32 on the bits: normals rebias the exponent (15 -> 127), inf and NaN
// take the all-ones exponent, subnormals m * 2^-24 come from a float32 normal minus 2^-14
// (no float32 subnormal is read or made: exact even with denormals flushed).
inline vf load(const f16* p) {
  const vu h = widen(&p->bits), u = h & 0x7fffu;
  const vu normal = (u << 13) + (112u << 23);
  const vu sub = (vu)((vf)((u << 13) + (113u << 23)) - splat(0x1p-14f));
  const vu bits = u < 0x400u ? sub : (u >= 0x7c00u ? normal + (112u << 23) : normal);
  return (vf)(bits | ((h & 0x8000u) << 16));
}

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return x; }
inline float to_float(bf16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16);
}
inline float to_float(f16 x) {
  vu h = vu{} + x.bits;  // the vector form, lane 0
  return load(reinterpret_cast<const f16*>(&h))[0];
}

template <typename E>
inline float dot(const float* q, const E* k, int64_t d) {
  vf acc = splat(0.f);
  int64_t i = 0;
  for (; i + W <= d; i += W) acc += load(q + i) * load(k + i);
  float s = hsum(acc);
  for (; i < d; ++i) s += q[i] * to_float(k[i]);
  return s;
}

// acc[0, n) += w * v[0, n)
template <typename E>
inline void axpy(float* acc, float w, const E* v, int64_t n) {
  const vf wv = splat(w);
  int64_t i = 0;
  for (; i + W <= n; i += W) store(acc + i, load(acc + i) + wv * load(v + i));
  for (; i < n; ++i) acc[i] += w * to_float(v[i]);
}

inline void scale_by(float* acc, float a, int64_t n) {
  const vf av = splat(a);
  int64_t i = 0;
  for (; i + W <= n; i += W) store(acc + i, load(acc + i) * av);
  for (; i < n; ++i) acc[i] *= a;
}

// A block of keys of one row and kv head: where each key and value is (null: on an
// unallocated page, read as zeros) and, for int8 pages, its scale.
template <typename E>
struct Block {
  const E* k[kBlock];
  const E* v[kBlock];
  float ks[kBlock], vs[kBlock];
};

template <typename E>
void fill_block(const PagedParams& p, const PagedTensors& t, int64_t row, int64_t head,
                int64_t first, int64_t n, Block<E>* b) {
  const E* kp = static_cast<const E*>(t.k);
  const E* vp = static_cast<const E*>(t.v);
  const int32_t* table = t.table + row * p.P;
  for (int64_t j = 0; j < n;) {  // a page at a time: one division per page, not per key
    const int64_t pos = first + j, index = pos / p.S, offset = pos - index * p.S;
    const int64_t page = table[index], m = std::min(n - j, p.S - offset);
    const bool allocated = page >= 0 && page < p.N;
    const int64_t slot = (page * p.S + offset) * p.K + head;
    for (int64_t i = 0; i < m; ++i, ++j) {
      if (!allocated) {
        b->k[j] = b->v[j] = nullptr;
        b->ks[j] = b->vs[j] = 0.f;
        continue;
      }
      const int64_t at = slot + i * p.K;
      b->k[j] = kp + at * p.D;
      b->v[j] = vp + at * p.Dv;
      b->ks[j] = p.page == PageType::kS8 ? t.k_scales[at] : 1.f;
      b->vs[j] = p.page == PageType::kS8 ? t.v_scales[at] : 1.f;
    }
  }
}

// Reads one byte of every cache line of the keys and values of a block's n keys on kv
// heads [head, head + heads), b being kv head `head`'s block (a token's kv heads are
// contiguous), in a tight loop of loads the compiler must keep, before the block computes.
// Out of the CPU's caches, a block's computation issues its loads a key at a time between
// dependent arithmetic and waits on memory; these loads, with nothing between them, keep
// many misses in flight. A decoding step over 16 rows (4 kv heads of 32) at 743
// positions: 869 -> 548 us, pages out of the caches; 2 rows (8 of 64) at 4096: 1269 -> 729
// us (ab_paged_kernel.py, AVX-512 Zen 4). Software prefetches (prefetcht0) of the next
// block's lines, which this replaces, ran no faster than none at all on that CPU.
template <typename E>
void touch_block(const PagedParams& p, const Block<E>& b, int64_t n, int64_t heads) {
  constexpr uintptr_t kLine = 64;
  auto touch = [](const E* a, int64_t bytes) {  // every line of [a, a + bytes)
    const uintptr_t end = reinterpret_cast<uintptr_t>(a) + bytes;
    for (uintptr_t line = reinterpret_cast<uintptr_t>(a) & ~(kLine - 1); line < end;
         line += kLine)
      (void)*reinterpret_cast<const volatile char*>(line);
  };
  for (int64_t j = 0; j < n; ++j) {
    if (b.k[j] == nullptr) continue;  // an unallocated page
    touch(b.k[j], heads * p.D * static_cast<int64_t>(sizeof(E)));
    touch(b.v[j], heads * p.Dv * static_cast<int64_t>(sizeof(E)));
  }
}

// The block's keys transposed, kt[d * kBlock + j] = key j's element d (dequantized; zeros
// for unallocated keys and past the block), so that many queries' logits take whole
// vectors of keys with no horizontal sums.
template <typename E>
void transpose_block(const PagedParams& p, const Block<E>& b, int64_t n, float* kt) {
  for (int64_t j = 0; j < kBlock; ++j) {
    if (j >= n || b.k[j] == nullptr) {
      for (int64_t d = 0; d < p.D; ++d) kt[d * kBlock + j] = 0.f;
      continue;
    }
    for (int64_t d = 0; d < p.D; ++d) kt[d * kBlock + j] = b.ks[j] * to_float(b.k[j][d]);
  }
}

// s_i[0, kBlock) = scale * q_i . k_j for Q queries from the transposed block (Q x kBlock /
// W accumulators), each vector of keys loaded once for the Q.
template <int Q>
void logits_transposed(const PagedParams& p, const float* const* q, const float* kt,
                       float* const* s) {
  constexpr int64_t kVecs = kBlock / W;
  vf acc[Q][kVecs];
  for (int i = 0; i < Q; ++i)
    for (int64_t v = 0; v < kVecs; ++v) acc[i][v] = splat(0.f);
  for (int64_t d = 0; d < p.D; ++d) {
    vf k[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) k[v] = load(kt + d * kBlock + v * W);
    for (int i = 0; i < Q; ++i) {
      const vf qd = splat(q[i][d]);
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] += qd * k[v];
    }
  }
  for (int i = 0; i < Q; ++i)
    for (int64_t v = 0; v < kVecs; ++v) store(s[i] + v * W, acc[i][v] * splat(p.scale));
}

// Lanes of a where bit H of the lane index is clear, of b where it is set: the lanes
// themselves (Flip false) or their partners at index ^ H (Flip true).
template <int H, bool Flip, int... U>
inline vf pick_lanes(vf a, vf b, std::integer_sequence<int, U...>) {
  return __builtin_shufflevector(a, b, ((U & H) ? W : 0) + (Flip ? (U ^ H) : U)...);
}

// x[0, H) = pair sums of x[m] (lanes with bit H clear) and x[m + H] (set), down to H = 1:
// then lane i of x[0] is the sum of the lanes of the input x[i] (W vectors transposed and
// added in log2(W) levels, W - 1 pair sums of two shuffles and an add each).
template <int H>
inline void lane_sums(vf* x) {
  constexpr auto lanes = std::make_integer_sequence<int, W>{};
  for (int m = 0; m < H; ++m) {
    const vf a = x[m], b = x[m + H];
    x[m] = pick_lanes<H, false>(a, b, lanes) + pick_lanes<H, true>(a, b, lanes);
  }
  if constexpr (H > 1) lane_sums<H / 2>(x);
}

// One query's logits s[j] = scale * q . k_j over a block's first n keys (zeros for keys on
// unallocated pages; lanes past n are left for the caller), W keys at a time: each key's
// products summed over D a vector at a time, then the W keys' vectors reduced together
// (lane_sums) rather than one horizontal sum per key. D a multiple of W.
template <typename E>
void logits_keys(const PagedParams& p, const Block<E>& b, int64_t n, const float* q, float* s) {
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    vf x[W];
    for (int j = 0; j < W; ++j) {
      x[j] = splat(0.f);
      const E* k = j0 + j < n ? b.k[j0 + j] : nullptr;
      if (k == nullptr) continue;
      for (int64_t d = 0; d < p.D; d += W) x[j] += load(q + d) * load(k + d);
    }
    lane_sums<W / 2>(x);
    vf ks = splat(1.f);  // int8 pages: the keys' scales (the block's first n are set)
    if constexpr (std::is_same_v<E, int8_t>)
      for (int j = 0; j < W && j0 + j < n; ++j) ks[j] = b.ks[j0 + j];
    store(s + j0, splat(p.scale) * (ks * x[0]));
  }
}

// Queries whose logits share each transposed key vector's load: as many as keep their
// accumulators within 16 vector registers.
constexpr int kLogitQueries = kBlock / W >= 16 ? 1 : 16 / (kBlock / W);

// One query's online-softmax update over the first `n` keys of a block (st = m, l): leaves
// its weights p_j (times the value scales) in s[0, max(n, zero_to)), zeros past n, and
// returns alpha, the factor its acc must be rescaled by. `logits`: s holds them already,
// else they are computed here key by key.
template <typename E>
float softmax_block(const PagedParams& p, const Block<E>& b, int64_t n, const float* q,
                    bool logits, float* s, float* st, int64_t zero_to) {
  if (!logits) {
    for (int64_t j = 0; j < n; ++j)
      s[j] = b.k[j] == nullptr ? 0.f : p.scale * (b.ks[j] * dot(q, b.k[j], p.D));
  }
  // The vectors holding the n keys; those past them (all -inf, weights 0) would change
  // neither the max nor the sum, so they are skipped, not computed.
  const int64_t used = (n + W - 1) / W * W;
  for (int64_t j = n; j < used; ++j) s[j] = -kInf;
  vf top = load(s);  // the block's largest logit, a vector at a time (max is exact)
  for (int64_t j = W; j < used; j += W) {
    const vf x = load(s + j);
    top = top < x ? x : top;
  }
  const float m_new = std::max(st[0], hmax(top));
  vf sum = splat(0.f);
  for (int64_t j = 0; j < used; j += W) {
    const vf e = vexp(load(s + j) - splat(m_new));
    store(s + j, e);
    sum += e;
  }
  const float alpha = st[0] == -kInf ? 0.f : vexp(splat(st[0] - m_new))[0];
  st[0] = m_new;
  st[1] = st[1] * alpha + hsum(sum);
  if constexpr (std::is_same_v<E, int8_t>)  // the value scales (1 for float pages)
    for (int64_t j = 0; j < n; ++j) s[j] *= b.vs[j];
  for (int64_t j = used; j < zero_to; ++j) s[j] = 0.f;
  return alpha;
}

// acc_i = alpha_i acc_i + sum_{j < n} s_i[j] v_j for Q queries, on the columns of Dv from
// `c`: two vectors at a time (then one), held in registers over the block's keys, each
// value vector loaded once for the Q and each weight broadcast once for the two.
template <int Q, typename E>
void accumulate(const PagedParams& p, const Block<E>& b, int64_t n, const float* const* s,
                const float* alpha, float* const* acc, int64_t c = 0) {
  for (; c + 2 * W <= p.Dv; c += 2 * W) {
    vf a0[Q], a1[Q];
    for (int i = 0; i < Q; ++i) {
      a0[i] = load(acc[i] + c) * splat(alpha[i]);
      a1[i] = load(acc[i] + c + W) * splat(alpha[i]);
    }
    for (int64_t j = 0; j < n; ++j) {
      if (b.v[j] == nullptr) continue;
      const vf v0 = load(b.v[j] + c), v1 = load(b.v[j] + c + W);
      for (int i = 0; i < Q; ++i) {
        const vf w = splat(s[i][j]);
        a0[i] += w * v0;
        a1[i] += w * v1;
      }
    }
    for (int i = 0; i < Q; ++i) {
      store(acc[i] + c, a0[i]);
      store(acc[i] + c + W, a1[i]);
    }
  }
  for (; c + W <= p.Dv; c += W) {
    vf a[Q];
    for (int i = 0; i < Q; ++i) a[i] = load(acc[i] + c) * splat(alpha[i]);
    for (int64_t j = 0; j < n; ++j) {
      if (b.v[j] == nullptr) continue;
      const vf v = load(b.v[j] + c);
      for (int i = 0; i < Q; ++i) a[i] += splat(s[i][j]) * v;
    }
    for (int i = 0; i < Q; ++i) store(acc[i] + c, a[i]);
  }
  for (; c < p.Dv; ++c)
    for (int i = 0; i < Q; ++i) {
      float a = acc[i][c] * alpha[i];
      for (int64_t j = 0; j < n; ++j)
        if (b.v[j] != nullptr) a += s[i][j] * to_float(b.v[j][c]);
      acc[i][c] = a;
    }
}

// The partial sums a lone query's value accumulation keeps over a block's keys (key j in
// chain j % kChains, the keys past the last whole group in the first): a single sum would
// wait on its FMA's latency at every key.
constexpr int kChains = 4;
static_assert(kChains == 4, "accumulate_one adds its chains as a tree of four");

// acc = alpha acc + sum_{j < n} s[j] v_j for one query, two vectors of Dv at a time (then
// one), each in kChains partial sums over the keys (the remainder's keys in the first),
// added in a fixed order at the end.
template <typename E>
void accumulate_one(const PagedParams& p, const Block<E>& b, int64_t n, const float* s,
                    float alpha, float* acc) {
  const int64_t whole = n - n % kChains;
  int64_t c = 0;
  for (; c + 2 * W <= p.Dv; c += 2 * W) {
    vf a0[kChains], a1[kChains];
    a0[0] = load(acc + c) * splat(alpha);
    a1[0] = load(acc + c + W) * splat(alpha);
    for (int i = 1; i < kChains; ++i) a0[i] = a1[i] = splat(0.f);
    for (int64_t j = 0; j < whole; j += kChains)
      for (int i = 0; i < kChains; ++i) {
        if (b.v[j + i] == nullptr) continue;
        const vf w = splat(s[j + i]);
        a0[i] += w * load(b.v[j + i] + c);
        a1[i] += w * load(b.v[j + i] + c + W);
      }
    for (int64_t j = whole; j < n; ++j) {
      if (b.v[j] == nullptr) continue;
      const vf w = splat(s[j]);
      a0[0] += w * load(b.v[j] + c);
      a1[0] += w * load(b.v[j] + c + W);
    }
    store(acc + c, (a0[0] + a0[1]) + (a0[2] + a0[3]));
    store(acc + c + W, (a1[0] + a1[1]) + (a1[2] + a1[3]));
  }
  if (c < p.Dv) {  // the columns left: one vector at a time, then one at a time
    float* ap = acc;
    accumulate<1>(p, b, n, &s, &alpha, &ap, c);
  }
}

// The queries of one block awaiting their logits, softmax and value accumulation, kQueries
// at a time.
struct Pending {
  const float* q[kQueries];
  float* st[kQueries];
  float* s[kQueries];
  float* acc[kQueries];
  float alpha[kQueries];
  int64_t seen[kQueries];
  int count = 0;
};

// The pending queries over the block b: their logits (from kt, the transposed block, when
// not null), softmax updates and value accumulations.
template <typename E>
void flush(const PagedParams& p, const Block<E>& b, const float* kt, Pending* w) {
  if (w->count == 0) return;
  if (kt != nullptr) {
    int at = 0;
    for (; at + kLogitQueries <= w->count; at += kLogitQueries)
      logits_transposed<kLogitQueries>(p, w->q + at, kt, w->s + at);
    for (; at < w->count; ++at) logits_transposed<1>(p, w->q + at, kt, w->s + at);
  }
  const bool by_keys = kt == nullptr && p.D % W == 0;  // else key by key in softmax_block
  for (int i = 0; by_keys && i < w->count; ++i) logits_keys(p, b, w->seen[i], w->q[i], w->s[i]);
  // kQueries queries accumulate together over the keys any of them sees
  const int64_t n = *std::max_element(w->seen, w->seen + w->count);
  const int64_t zero_to = w->count == kQueries ? n : 0;
  const bool logits = kt != nullptr || by_keys;
  for (int i = 0; i < w->count; ++i)
    w->alpha[i] = softmax_block(p, b, w->seen[i], w->q[i], logits, w->s[i], w->st[i], zero_to);
  if (w->count == kQueries) {
    accumulate<kQueries>(p, b, n, w->s, w->alpha, w->acc);
  } else {
    for (int i = 0; i < w->count; ++i)
      accumulate_one(p, b, w->seen[i], w->s[i], w->alpha[i], w->acc[i]);
  }
  w->count = 0;
}

// The output of one query from its state: acc / l, zeros where it saw nothing.
inline void finish(const float* st, int64_t dv, float* o) {
  if (!(st[1] > 0.f)) {
    std::fill(o, o + dv, 0.f);
    return;
  }
  const float inv = 1.f / st[1];
  for (int64_t i = 0; i < dv; ++i) o[i] = st[2 + i] * inv;
}

// The queries of row r on kv head `head` over the block b (n keys from `first`), their
// states at `state` ((t, head of the group) order), into the pending accumulations w.
template <typename E>
void head_block(const PagedParams& p, const PagedTensors& t, int64_t r, int64_t head,
                int64_t first, int64_t n, const Block<E>& b, const float* kt, float* s,
                float* state, Pending* w) {
  const int64_t group = p.H / p.K, stride = 2 + p.Dv;
  const int64_t real = t.real[r], start = t.start[r];
  for (int64_t tq = 0; tq < real; ++tq) {
    const int64_t seen = p.causal ? std::min(n, start + tq + 1 - first) : n;
    if (seen <= 0) continue;
    for (int64_t g = 0; g < group; ++g) {
      float* st = state + (tq * group + g) * stride;
      w->q[w->count] = t.q + ((r * p.T + tq) * p.H + head * group + g) * p.D;
      w->st[w->count] = st;
      w->s[w->count] = s + w->count * kBlock;
      w->acc[w->count] = st + 2;
      w->seen[w->count] = seen;
      if (++w->count == kQueries) flush(p, b, kt, w);
    }
  }
  flush(p, b, kt, w);
}

template <typename E>
void run_item(const PagedParams& p, const PagedTensors& t, const PagedItem& it, float* scratch) {
  const int64_t group = p.H / p.K, r = it.row, stride = 2 + p.Dv;
  const int64_t real = t.real[r], per_head = real * group * stride;
  float* s = scratch;                           // kQueries rows of kBlock weights
  float* kt = scratch + kQueries * kBlock;      // D x kBlock: the transposed block
  float* state = kt + p.D * kBlock;  // per kv head, query (t, head of the group): m, l, acc
  const bool transpose = real * group >= kTransposeMinQueries;
  for (int64_t i = 0; i < p.item_heads * real * group; ++i) {
    float* st = state + i * stride;
    st[0] = -kInf;
    std::fill(st + 1, st + stride, 0.f);
  }
  Block<E> b;
  Pending w;
  for (int64_t first = it.key_begin; first < it.key_end; first += kBlock) {
    const int64_t n = std::min(kBlock, it.key_end - first);
    for (int64_t h = 0; h < p.item_heads; ++h) {
      fill_block(p, t, r, it.head + h, first, n, &b);
      if (h == 0) touch_block(p, b, n, p.item_heads);
      if (transpose) transpose_block(p, b, n, kt);
      head_block(p, t, r, it.head + h, first, n, b, transpose ? kt : nullptr, s,
                 state + h * per_head, &w);
    }
  }
  if (it.part >= 0) {
    std::memcpy(t.part + it.part, state, sizeof(float) * p.item_heads * per_head);
    return;
  }
  for (int64_t h = 0; h < p.item_heads; ++h)
    for (int64_t tq = 0; tq < p.T; ++tq)
      for (int64_t g = 0; g < group; ++g) {
        float* o = t.out + ((r * p.T + tq) * p.H + (it.head + h) * group + g) * p.Dv;
        if (tq < real)
          finish(state + h * per_head + (tq * group + g) * stride, p.Dv, o);
        else
          std::fill(o, o + p.Dv, 0.f);
      }
}

// One query's output o from its partial states at offset `at` of the `splits` items from
// `items`, merged in their order: zeros where no split saw a key.
void merge_query(const PagedParams& p, const PagedTensors& t, const PagedItem* items,
                 int64_t splits, int64_t at, float* o) {
  std::fill(o, o + p.Dv, 0.f);
  float top = -kInf, total = 0.f;
  for (int64_t i = 0; i < splits; ++i) top = std::max(top, t.part[items[i].part + at]);
  if (top == -kInf) return;
  for (int64_t i = 0; i < splits; ++i) {
    const float* st = t.part + items[i].part + at;
    const float w = st[0] == -kInf ? 0.f : std::exp(st[0] - top);
    total += st[1] * w;
    if (w > 0.f) axpy(o, w, st + 2, p.Dv);
  }
  if (total > 0.f) scale_by(o, 1.f / total, p.Dv);
  else std::fill(o, o + p.Dv, 0.f);
}

// Row first.row's outputs on kv heads [first.head, first.head + p.item_heads) from the
// partials of the `splits` consecutive items starting at `first` (an element of the
// handler's item array).
void merge_item(const PagedParams& p, const PagedTensors& t, const PagedItem& first) {
  const int64_t group = p.H / p.K, r = first.row, stride = 2 + p.Dv, real = t.real[r];
  for (int64_t h = 0; h < p.item_heads; ++h)
    for (int64_t tq = 0; tq < p.T; ++tq)
      for (int64_t g = 0; g < group; ++g) {
        float* o = t.out + ((r * p.T + tq) * p.H + (first.head + h) * group + g) * p.Dv;
        if (tq < real)
          merge_query(p, t, &first, first.splits, ((h * real + tq) * group + g) * stride, o);
        else
          std::fill(o, o + p.Dv, 0.f);
      }
}

int64_t scratch_floats(const PagedParams& p) {
  return kQueries * kBlock + p.D * kBlock + p.item_heads * (p.H / p.K) * p.T * (2 + p.Dv);
}

void item(const PagedParams& p, const PagedTensors& t, const PagedItem& it, float* scratch) {
  switch (p.page) {
    case PageType::kS8: return run_item<int8_t>(p, t, it, scratch);
    case PageType::kBF16: return run_item<bf16>(p, t, it, scratch);
    case PageType::kF16: return run_item<f16>(p, t, it, scratch);
    default: return run_item<float>(p, t, it, scratch);
  }
}

}  // namespace

const PagedIsa kPagedIsa = {JATTN_ISA_NAME, scratch_floats, item, merge_item};

}  // namespace JATTN_ISA
}  // namespace jattn
