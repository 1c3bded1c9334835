// XLA FFI handlers of jattn's fused CPU attention (forward with lse, backward), the
// instruction-set dispatch, and a parallel loop over XLA's own intra-op thread pool.
//
// Exported (loaded with ctypes, registered by jattn.kernels.cpu._library):
//   JattnCpuAttentionForward, JattnCpuAttentionBackward: the FFI handlers;
//   JattnCpuPagedAttention: the paged attention handler (the block at the end);
//   jattn_cpu_isa(): the instruction set the kernels run with ("avx512", "avx2", "generic");
//   jattn_cpu_ffi_api_version(): the XLA FFI API version the handlers were built against.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jattn {
namespace {

bool cpu_has(const char* feature) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (std::strcmp(feature, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  if (std::strcmp(feature, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2");
#endif
  return false;
}

// The widest instruction set this CPU runs; JATTN_CPU_ISA=avx2|generic asks for a narrower
// one (tests and benchmarks compare them).
const Isa* choose_isa() {
  const char* asked = std::getenv("JATTN_CPU_ISA");
  std::string want = asked == nullptr ? "" : asked;
  if ((want.empty() || want == "avx512") && isa_avx512() != nullptr && cpu_has("avx512"))
    return isa_avx512();
  if ((want.empty() || want == "avx512" || want == "avx2") && isa_avx2() != nullptr &&
      cpu_has("avx2"))
    return isa_avx2();
  return isa_generic();
}

const Isa& isa() {
  static const Isa* chosen = choose_isa();
  return *chosen;
}

// This thread's scratch of at least n floats, kept between calls (grown, never shrunk): a
// fresh buffer per call cost a zero-fill and, past malloc's mmap threshold, page faults and
// an unmap each time, tens of microseconds, as much as a decoding step's attention. Every
// kernel writes the scratch it reads before reading it, so old contents never show. To
// check: `CPPFLAGS=-DJATTN_POISON_SCRATCH python setup.py build_ext --inplace --force`
// fills it with NaNs for every call; the kernel tests pass so with each instruction set.
float* worker_scratch(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.assign(n, 0.f);
#ifdef JATTN_POISON_SCRATCH
  std::fill(buffer.begin(), buffer.end(), std::numeric_limits<float>::quiet_NaN());
#endif
  return buffer.data();
}

// How long parallel_for's caller, out of items, watches the count of those other workers
// hold before it sleeps on it. Being put to sleep and woken cost the caller tens of
// microseconds on the 2-core VM, more than a decoding step's last item takes: spinning
// instead made each paged call of a 16-row decoding step at 10% filled 54 -> 34 us, and
// the whole step at 10% / 100% 0.61 -> 0.57 / 1.87 -> 1.77 ms (in runs; ab_paged_kernel.py
// --step). Items longer than this (prefill, training) sleep as before.
constexpr int64_t kSpinMicros = 50;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Runs body(item, scratch) for item in [0, n) on up to `threads` workers: the caller and
// tasks scheduled on XLA's pool take items from one counter. Each item is computed by one
// worker in a fixed order, so the results do not depend on which worker or how many. The
// caller waits for the items, not for the tasks: a task that starts late finds no item and
// touches only the shared state it co-owns (no deadlock when the pool is busy or size 1).
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t threads, int64_t scratch_floats,
                  const std::function<void(int64_t, float*)>& body) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0, scratch_floats = 0;
    const std::function<void(int64_t, float*)>* body = nullptr;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  shared->n = n;
  shared->scratch_floats = scratch_floats;
  shared->body = &body;
  auto work = [](const std::shared_ptr<Shared>& s) {
    if (s->next.load() >= s->n) return;
    float* scratch = worker_scratch(s->scratch_floats);
    for (int64_t item; (item = s->next.fetch_add(1)) < s->n;) {
      (*s->body)(item, scratch);
      if (s->done.fetch_add(1) + 1 == s->n) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->cv.notify_all();
      }
    }
  };
  int64_t workers = std::max<int64_t>(1, std::min(threads, n));
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([shared, work] { work(shared); });
  work(shared);
  // The items left are in other workers' hands: watch their count before sleeping on it.
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  while (shared->done.load() != n && std::chrono::steady_clock::now() < until) cpu_relax();
  if (shared->done.load() == n) return;
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n; });
}

// The backward's single pass (one item per (batch, kv head) pair, five tile products a
// tile) when its items keep the workers about as busy as the two passes' (seven products,
// finer items): its makespan, ceil(pairs / workers) items, within 7/5 of pairs / workers.
// Both compute every sum in the same order, bit for bit, so the choice may follow the
// thread count without the results doing so.
bool single_pass_backward(int64_t pairs, int64_t workers) {
  return 5 * workers * ((pairs + workers - 1) / workers) <= 7 * pairs;
}
// Split-KV decoding: up to this many queries against at least two splits of this many keys
// split the keys (a multiple of every block_k used); the split count follows the shapes
// alone, never the thread count, so the result does not either.
constexpr int64_t kSplitMaxQueries = 16;
constexpr int64_t kSplitKeys = 512;

int64_t worker_count(ffi::ThreadPool& pool, int64_t max_threads) {
  int64_t available = std::max<int64_t>(1, pool.num_threads());
  return max_threads > 0 ? std::min(available, max_threads) : available;
}

// One key tile of x [B, Tk, K, E] transposed into xt [B, K, E, Tkp] (item: b, kv head, tile
// of bk keys; the last tile also zero-fills the columns past Tk). The kernels read their
// tile products' K^T (and the backward's V^T) from this copy, made here in parallel: XLA's
// transpose of the same copy ran on one thread, 6 ms of a 60 ms forward at T = 4096.
void transpose_tile(const Params& p, const float* x, int64_t e, float* xt, int64_t item) {
  const int64_t nkb = (p.Tk + p.bk - 1) / p.bk, kb = item % nkb, bkh = item / nkb;
  const int64_t b = bkh / p.K, kh = bkh % p.K, j0 = kb * p.bk;
  const int64_t j1 = kb == nkb - 1 ? p.Tkp : j0 + p.bk, stride = p.K * e;
  const float* src = x + (b * p.Tk * p.K + kh) * e;
  float* dst = xt + bkh * e * p.Tkp;
  constexpr int64_t kRows = 16;  // keys per pass: each row of xt gets a whole cache line
  for (int64_t j = j0; j < j1; j += kRows) {
    const int64_t n = std::min(kRows, std::min(j1, p.Tk) - j);  // keys left (<= 0: padding)
    for (int64_t d = 0; d < e; ++d) {
      float* row = dst + d * p.Tkp + j;
      const int64_t m = std::min(kRows, j1 - j);
      for (int64_t u = 0; u < m; ++u) row[u] = u < n ? src[(j + u) * stride + d] : 0.f;
    }
  }
}

// x [batch..., Tk, K, e] transposed on the workers into xt, once xt's shape is checked in
// full ([batch..., K, e, Tkp], q's rank, qd); false (nothing written) on another shape.
bool transpose_keys(ffi::ThreadPool& pool, int64_t threads, const Params& p, const float* x,
                    int64_t e, ffi::ResultBuffer<ffi::F32>& xt, ffi::Span<const int64_t> qd) {
  const ffi::Span<const int64_t> dims = xt->dimensions();
  const size_t r = dims.size();
  if (r != qd.size() || dims[r - 3] != p.K || dims[r - 2] != e || dims[r - 1] != p.Tkp)
    return false;
  int64_t b = 1;
  for (size_t a = 0; a + 3 < r; ++a) b *= dims[a];
  if (b != p.B) return false;
  float* dst = xt->typed_data();
  const int64_t items = p.B * p.K * ((p.Tk + p.bk - 1) / p.bk);
  if (items > 0)
    parallel_for(pool, items, threads, 0,
                 [&](int64_t item, float*) { transpose_tile(p, x, e, dst, item); });
  return true;
}

// [batch..., T, heads, dim] -> (prod(batch), T, heads, dim).
void dims4(ffi::Span<const int64_t> d, int64_t* b, int64_t* t, int64_t* h, int64_t* e) {
  int64_t r = static_cast<int64_t>(d.size());
  *b = 1;
  for (int64_t i = 0; i + 3 < r; ++i) *b *= d[i];
  *t = d[r - 3];
  *h = d[r - 2];
  *e = d[r - 1];
}

// The bias's or mask's strides and per-batch-row offsets: `arr` has q's rank, dims
// [batch..., H|1, Tq|1, Tk|1] (a size-1 axis is broadcast: stride 0).
ffi::Error broadcast_layout(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> ad,
                            const Params& p, const char* name, std::vector<int64_t>* offsets,
                            int64_t* sh, int64_t* si, int64_t* sj,
                            const int64_t* last = nullptr) {
  const int64_t r = static_cast<int64_t>(qd.size());
  const int64_t logits[3] = {p.H, p.Tq, p.Tk};
  const int64_t* want = last == nullptr ? logits : last;  // the last three axes' full sizes
  if (static_cast<int64_t>(ad.size()) != r)
    return ffi::Error::InvalidArgument(std::string("jattn cpu attention: ") + name +
                                       " must have q's rank");
  std::vector<int64_t> stride(r);
  int64_t acc = 1;
  for (int64_t a = r - 1; a >= 0; --a) {
    const int64_t full = a >= r - 3 ? want[a - (r - 3)] : qd[a];
    if (ad[a] != 1 && ad[a] != full)
      return ffi::Error::InvalidArgument(std::string("jattn cpu attention: ") + name +
                                         " does not broadcast to the logits");
    stride[a] = ad[a] == 1 ? 0 : acc;
    acc *= ad[a];
  }
  *sh = stride[r - 3];
  *si = stride[r - 2];
  *sj = stride[r - 1];
  offsets->assign(p.B, 0);
  for (int64_t b = 0; b < p.B; ++b) {  // b's multi-index over q's batch dims, row-major
    int64_t rest = b, off = 0;
    for (int64_t a = r - 4; a >= 0; --a) {
      off += (rest % qd[a]) * stride[a];
      rest /= qd[a];
    }
    (*offsets)[b] = off;
  }
  return ffi::Error::Success();
}

ffi::Error make_params(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                       ffi::Span<const int64_t> vd, ffi::Span<const int64_t> ktd, float scale, float softcap, int64_t causal,
                       int64_t window_left, int64_t window_right, int64_t has_seg,
                       int64_t has_sinks, int64_t has_dropout, int64_t alibi, int64_t block_q,
                       int64_t block_k, Params* p) {
  int64_t kb, vb, vt, vk;
  if (qd.size() < 3 || kd.size() != qd.size() || vd.size() != qd.size())
    return ffi::Error::InvalidArgument("jattn cpu attention: q, k, v need equal ranks >= 3");
  dims4(qd, &p->B, &p->Tq, &p->H, &p->D);
  dims4(kd, &kb, &p->Tk, &p->K, &p->D);
  dims4(vd, &vb, &vt, &vk, &p->Dv);
  if (kb != p->B || vb != p->B || vt != p->Tk || vk != p->K || p->K == 0 || p->H % p->K)
    return ffi::Error::InvalidArgument("jattn cpu attention: q, k, v shapes do not match");
  // kt [batch..., K, D, Tkp], or a placeholder of another rank: no transposed keys.
  p->Tkp = ktd.size() == qd.size() ? ktd[ktd.size() - 1] : p->Tk;
  p->scale = scale;
  p->softcap = softcap;
  p->causal = causal != 0;
  p->wl = window_left;
  p->wr = window_right;
  p->has_seg = has_seg != 0;
  p->has_sinks = has_sinks != 0;
  p->has_dropout = has_dropout != 0;
  p->alibi = alibi;
  // The query tile: a multiple of the micro-kernel's rows unless asked for; 16 of them
  // (192 queries on AVX-512) read each key tile for more rows than 8 did (the forward 8%
  // faster at T >= 4096 on the AVX-512 EPYC, no slower at 1024; the backward unchanged).
  p->bq = block_q > 0 ? block_q : 16 * isa().mr;
  p->bk = block_k;
  if (p->bk <= 0 || p->bk % isa().nr || p->Tkp < p->Tk ||
      (ktd.size() == qd.size() && p->Tkp < (p->Tk + p->bk - 1) / p->bk * p->bk))
    return ffi::Error::InvalidArgument(
        "jattn cpu attention: block_k must be a multiple of 32 and kt's last axis cover whole "
        "key tiles");
  return ffi::Error::Success();
}

// The per-batch-row offsets of the bias, mask, block tile map and tile mask that the
// Tensors point into.
struct Layouts {
  std::vector<int64_t> bias, mask, blocks, tile_mask;
};

// Points t at the block mask's tile map (has_blocks) of [bm_q, bm_k] tiles and at the bits
// of its PARTIAL tiles, tile_mask [batch...|1, n_partial, bm_q, bm_k].
ffi::Error block_states(ffi::Span<const int64_t> qd, ffi::Buffer<ffi::S32>& blocks,
                        ffi::Buffer<ffi::PRED>& tile_mask, int64_t has_blocks, int64_t bm_q,
                        int64_t bm_k, Params* p, Tensors* t, Layouts* lay) {
  p->has_blocks = has_blocks != 0;
  if (!p->has_blocks) return ffi::Error::Success();
  if (bm_q <= 0 || bm_k <= 0)
    return ffi::Error::InvalidArgument("jattn cpu attention: block mask tiles of size 0");
  p->bm_q = bm_q;
  p->bm_k = bm_k;
  p->nbq = (p->Tq + bm_q - 1) / bm_q;
  p->nbk = (p->Tk + bm_k - 1) / bm_k;
  const int64_t last[3] = {p->H, p->nbq, p->nbk};
  int64_t si, sj;
  ffi::Error err = broadcast_layout(qd, blocks.dimensions(), *p, "block states", &lay->blocks,
                                    &p->blocks_sh, &si, &sj, last);
  if (err.failure()) return err;
  if ((si != p->nbk && p->nbq != 1) || (sj != 1 && p->nbk != 1))
    return ffi::Error::InvalidArgument("jattn cpu attention: block states of another size");
  auto td = tile_mask.dimensions();
  const int64_t tiles[3] = {td.size() == qd.size() ? td[td.size() - 3] : 0, bm_q, bm_k};
  err = broadcast_layout(qd, td, *p, "block tile mask", &lay->tile_mask, &p->tm_sn,
                         &p->tm_si, &p->tm_sj, tiles);
  if (err.failure()) return err;
  t->blocks = blocks.typed_data();
  t->blocks_offset = lay->blocks.data();
  t->tile_mask = reinterpret_cast<const uint8_t*>(tile_mask.typed_data());
  t->tile_mask_offset = lay->tile_mask.data();
  return ffi::Error::Success();
}

ffi::Error bias_and_mask(ffi::Span<const int64_t> qd, ffi::Buffer<ffi::F32>& bias,
                         ffi::Buffer<ffi::PRED>& mask, int64_t has_bias, int64_t has_mask,
                         Params* p, Tensors* t, Layouts* lay) {
  p->has_bias = has_bias != 0;
  p->has_mask = has_mask != 0;
  p->bias_sh = p->bias_si = p->bias_sj = p->mask_sh = p->mask_si = p->mask_sj = 0;
  p->dbias_mode = 0;
  p->split_k = 0;
  if (p->has_bias) {
    ffi::Error err = broadcast_layout(qd, bias.dimensions(), *p, "bias", &lay->bias,
                                      &p->bias_sh, &p->bias_si, &p->bias_sj);
    if (err.failure()) return err;
    t->bias = bias.typed_data();
    t->bias_offset = lay->bias.data();
  }
  if (p->has_mask) {
    ffi::Error err = broadcast_layout(qd, mask.dimensions(), *p, "mask", &lay->mask,
                                      &p->mask_sh, &p->mask_si, &p->mask_sj);
    if (err.failure()) return err;
    t->mask = reinterpret_cast<const uint8_t*>(mask.typed_data());
    t->mask_offset = lay->mask.data();
  }
  return ffi::Error::Success();
}

// The operands the forward and backward handlers share, pointed at by t (lay owns the
// bias's, mask's and block states' per-batch-row offsets).
struct SharedOperands {
  ffi::Buffer<ffi::F32>&q, &k, &v;
  ffi::Buffer<ffi::S32>&q_len, &kv_len, &q_seg, &kv_seg;
  ffi::Buffer<ffi::U32>&drop_k0, &drop_k1, &drop_threshold;
  ffi::Buffer<ffi::F32>&drop_scale, &slopes, &bias;
  ffi::Buffer<ffi::PRED>& mask;
  ffi::Buffer<ffi::S32>& blocks;
  ffi::Buffer<ffi::PRED>& tile_mask;
  int64_t has_bias, has_mask, has_blocks, block_mask_q, block_mask_k;
};

ffi::Error shared_operands(const SharedOperands& a, Params* p, Tensors* t, Layouts* lay) {
  t->q = a.q.typed_data();
  t->k = a.k.typed_data();
  t->v = a.v.typed_data();
  t->q_len = a.q_len.typed_data();
  t->kv_len = a.kv_len.typed_data();
  t->q_seg = a.q_seg.typed_data();
  t->kv_seg = a.kv_seg.typed_data();
  t->drop_k0 = a.drop_k0.typed_data();
  t->drop_k1 = a.drop_k1.typed_data();
  t->drop_threshold = a.drop_threshold.typed_data();
  t->drop_scale = a.drop_scale.typed_data();
  t->slopes = a.slopes.typed_data();
  ffi::Error err =
      bias_and_mask(a.q.dimensions(), a.bias, a.mask, a.has_bias, a.has_mask, p, t, lay);
  if (err.failure()) return err;
  return block_states(a.q.dimensions(), a.blocks, a.tile_mask, a.has_blocks, a.block_mask_q,
                      a.block_mask_k, p, t, lay);
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_len,
                   ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> q_seg,
                   ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::F32> sinks,
                   ffi::Buffer<ffi::U32> drop_k0, ffi::Buffer<ffi::U32> drop_k1,
                   ffi::Buffer<ffi::U32> drop_threshold, ffi::Buffer<ffi::F32> drop_scale,
                   ffi::Buffer<ffi::F32> slopes, ffi::Buffer<ffi::F32> bias,
                   ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> blocks,
                   ffi::Buffer<ffi::PRED> tile_mask, float scale,
                   float softcap, int64_t causal,
                   int64_t window_left, int64_t window_right, int64_t has_seg,
                   int64_t has_sinks, int64_t has_dropout, int64_t alibi, int64_t has_bias,
                   int64_t has_mask, int64_t has_blocks, int64_t block_mask_q,
                   int64_t block_mask_k, int64_t block_q, int64_t block_k, int64_t max_threads,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                   ffi::ResultBuffer<ffi::F32> kt) {
  Params p;
  ffi::Error err = make_params(q.dimensions(), k.dimensions(), v.dimensions(), kt->dimensions(),
                               scale, softcap,
                               causal, window_left, window_right, has_seg, has_sinks,
                               has_dropout, alibi, block_q, block_k, &p);
  if (err.failure()) return err;
  Tensors t;
  Layouts lay;
  err = shared_operands({q, k, v, q_len, kv_len, q_seg, kv_seg, drop_k0, drop_k1,
                         drop_threshold, drop_scale, slopes, bias, mask, blocks, tile_mask,
                         has_bias, has_mask, has_blocks, block_mask_q, block_mask_k},
                        &p, &t, &lay);
  if (err.failure()) return err;
  t.sinks = sinks.typed_data();
  t.out = out->typed_data();
  t.lse = lse->typed_data();
  if (p.B * p.H * p.Tq == 0) return ffi::Error::Success();
  const Isa& k_isa = isa();
  const int64_t nqb = (p.Tq + p.bq - 1) / p.bq, threads = worker_count(pool, max_threads);
  const int64_t scratch = k_isa.scratch_floats(p);
  // kt [batch..., K, D, Tkp], the keys transposed here, or a placeholder of another rank
  // (a few queries: the kernel reads the keys in place).
  if (kt->dimensions().size() == q.dimensions().size()) {
    if (!transpose_keys(pool, threads, p, t.k, p.D, kt, q.dimensions()))
      return ffi::Error::InvalidArgument("jattn cpu attention: kt of another shape");
    t.kt = kt->typed_data();
  }
  p.split_k = p.Tq <= kSplitMaxQueries && p.Tk >= 2 * kSplitKeys && kSplitKeys % p.bk == 0
                  ? kSplitKeys
                  : 0;
  if (p.split_k == 0) {
    parallel_for(pool, nqb * p.B * p.H, threads, scratch,
                 [&](int64_t item, float* s) { k_isa.forward_item(p, t, item, s); });
    return ffi::Error::Success();
  }
  const int64_t ns = (p.Tk + p.split_k - 1) / p.split_k, rows = p.B * p.H * ns * p.Tq;
  std::vector<float> part(rows * (2 + p.Dv));
  t.part_m = part.data();
  t.part_l = t.part_m + rows;
  t.part_o = t.part_l + rows;
  parallel_for(pool, nqb * ns * p.B * p.H, threads, scratch,
               [&](int64_t item, float* s) { k_isa.split_item(p, t, item, s); });
  parallel_for(pool, nqb * p.B * p.H, threads, scratch,
               [&](int64_t item, float* s) { k_isa.merge_item(p, t, item, s); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_len,
                    ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> q_seg,
                    ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::F32> dout,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                    ffi::Buffer<ffi::U32> drop_k0, ffi::Buffer<ffi::U32> drop_k1,
                    ffi::Buffer<ffi::U32> drop_threshold, ffi::Buffer<ffi::F32> drop_scale,
                    ffi::Buffer<ffi::F32> slopes, ffi::Buffer<ffi::F32> bias,
                    ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> blocks,
                    ffi::Buffer<ffi::PRED> tile_mask, float scale,
                    float softcap, int64_t causal,
                    int64_t window_left, int64_t window_right, int64_t has_seg,
                    int64_t has_dropout, int64_t alibi, int64_t has_bias, int64_t has_mask,
                    int64_t has_blocks, int64_t block_mask_q, int64_t block_mask_k,
                    int64_t dbias_mode, int64_t block_q, int64_t block_k, int64_t max_threads,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv, ffi::ResultBuffer<ffi::F32> dslope,
                    ffi::ResultBuffer<ffi::F32> dbias, ffi::ResultBuffer<ffi::F32> kt,
                    ffi::ResultBuffer<ffi::F32> vt) {
  Params p;
  ffi::Error err = make_params(q.dimensions(), k.dimensions(), v.dimensions(), kt->dimensions(),
                               scale, softcap,
                               causal, window_left, window_right, has_seg, 0, has_dropout,
                               alibi, block_q, block_k, &p);
  if (err.failure()) return err;
  Tensors t;
  Layouts lay;
  err = shared_operands({q, k, v, q_len, kv_len, q_seg, kv_seg, drop_k0, drop_k1,
                         drop_threshold, drop_scale, slopes, bias, mask, blocks, tile_mask,
                         has_bias, has_mask, has_blocks, block_mask_q, block_mask_k},
                        &p, &t, &lay);
  if (err.failure()) return err;
  t.dout = dout.typed_data();
  t.lse = lse.typed_data();
  t.delta = delta.typed_data();
  t.dq = dq->typed_data();
  t.dk = dk->typed_data();
  t.dv = dv->typed_data();
  t.dslope = dslope->typed_data();
  p.dbias_mode = p.has_bias ? dbias_mode : 0;
  t.dbias = dbias->typed_data();
  const Isa& k_isa = isa();
  const int64_t threads = worker_count(pool, max_threads), scratch = k_isa.scratch_floats(p);
  const int64_t nqb = (p.Tq + p.bq - 1) / p.bq, nkb = (p.Tk + p.bk - 1) / p.bk;
  if (!transpose_keys(pool, threads, p, t.k, p.D, kt, q.dimensions()) ||  // K^T, V^T here
      !transpose_keys(pool, threads, p, t.v, p.Dv, vt, q.dimensions()))
    return ffi::Error::InvalidArgument("jattn cpu attention: the backward needs kt and vt");
  t.kt = kt->typed_data();
  t.vt = vt->typed_data();
  if (single_pass_backward(p.B * p.K, threads)) {  // one pass per pair, dQ in place
    if (p.B * p.K * (p.Tq + p.Tk) > 0)
      parallel_for(pool, p.B * p.K, threads, scratch, [&](int64_t item, float* s) {
        k_isa.backward_head_item(p, t, item, s);
      });
    return ffi::Error::Success();
  }
  // Key blocks that no query sees still get their (zero) gradients written.
  if (p.B * p.K * p.Tk > 0)
    parallel_for(pool, nkb * p.B * p.K, threads, scratch, [&](int64_t item, float* s) {
      k_isa.backward_kv_item(p, t, item, s);
    });
  if (p.B * p.H * p.Tq > 0)
    parallel_for(pool, nqb * p.B * p.H, threads, scratch, [&](int64_t item, float* s) {
      k_isa.backward_q_item(p, t, item, s);
    });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnCpuAttentionForward, jattn::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seg
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Arg<ffi::Buffer<ffi::U32>>()  // drop_k0
                                  .Arg<ffi::Buffer<ffi::U32>>()  // drop_k1
                                  .Arg<ffi::Buffer<ffi::U32>>()  // drop_threshold
                                  .Arg<ffi::Buffer<ffi::F32>>()  // drop_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // slopes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Arg<ffi::Buffer<ffi::S32>>()  // blocks (tile map)
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // tile_mask
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<int64_t>("has_segments")
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<int64_t>("has_dropout")
                                  .Attr<int64_t>("alibi")
                                  .Attr<int64_t>("has_bias")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<int64_t>("has_blocks")
                                  .Attr<int64_t>("block_mask_q")
                                  .Attr<int64_t>("block_mask_k")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::Buffer<ffi::F32>>());  // kt (workspace)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnCpuAttentionBackward, jattn::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seg
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta
                                  .Arg<ffi::Buffer<ffi::U32>>()  // drop_k0
                                  .Arg<ffi::Buffer<ffi::U32>>()  // drop_k1
                                  .Arg<ffi::Buffer<ffi::U32>>()  // drop_threshold
                                  .Arg<ffi::Buffer<ffi::F32>>()  // drop_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // slopes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Arg<ffi::Buffer<ffi::S32>>()  // blocks (tile map)
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // tile_mask
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<int64_t>("has_segments")
                                  .Attr<int64_t>("has_dropout")
                                  .Attr<int64_t>("alibi")
                                  .Attr<int64_t>("has_bias")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<int64_t>("has_blocks")
                                  .Attr<int64_t>("block_mask_q")
                                  .Attr<int64_t>("block_mask_k")
                                  .Attr<int64_t>("dbias_mode")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dslope
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias
                                  .Ret<ffi::Buffer<ffi::F32>>()   // kt (workspace)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // vt (workspace)

extern "C" {
__attribute__((visibility("default"))) const char* jattn_cpu_isa() {
  return jattn::isa().name;
}
__attribute__((visibility("default"))) int jattn_cpu_ffi_api_version() {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}
}

// ----------------------------------------------------------------------------------------
// Paged attention (forward): attention read through a page table (paged.h, paged_impl.h).
// ----------------------------------------------------------------------------------------

#include "paged.h"

namespace jattn {
namespace {

// The paged kernels of the attention kernels' instruction set (JATTN_CPU_ISA included).
const PagedIsa& paged_isa() {
  static const PagedIsa* chosen = [] {
    const std::string name = isa().name;
    if (name == "avx512" && paged_isa_avx512() != nullptr) return paged_isa_avx512();
    if (name == "avx2" && paged_isa_avx2() != nullptr) return paged_isa_avx2();
    return paged_isa_generic();
  }();
  return *chosen;
}

// Split-KV decoding for paged rows: up to this many queries per kv head (the group's heads
// times the chunk) against at least two splits of about kPagedSplitKeys keys (whole pages)
// split the row's keys; the split count follows the shapes and lengths alone.
constexpr int64_t kPagedSplitMaxQueries = 16;
constexpr int64_t kPagedSplitKeys = 512;

ffi::Error paged_params(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                        ffi::Span<const int64_t> vd, ffi::Span<const int64_t> td,
                        ffi::DataType kt, ffi::DataType vt, float scale, int64_t causal,
                        PagedParams* p) {
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "jattn paged attention: q [R, T, H, D], pages [N, S, K, D] and page_table [R, P]");
  p->R = qd[0];
  p->T = qd[1];
  p->H = qd[2];
  p->D = qd[3];
  p->N = kd[0];
  p->S = kd[1];
  p->K = kd[2];
  p->Dv = vd[3];
  p->P = td[1];
  p->scale = scale;
  p->causal = causal != 0;
  if (kd[3] != p->D || vd[0] != p->N || vd[1] != p->S || vd[2] != p->K || td[0] != p->R ||
      p->K == 0 || p->H % p->K != 0 || p->S == 0)
    return ffi::Error::InvalidArgument("jattn paged attention: shapes do not match");
  switch (kt == vt ? kt : ffi::DataType::INVALID) {
    case ffi::DataType::F32: p->page = PageType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: p->page = PageType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: p->page = PageType::kF16; return ffi::Error::Success();
    case ffi::DataType::S8: p->page = PageType::kS8; return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(
          "jattn paged attention: pages must be both float32, bfloat16, float16 or int8");
  }
}

// Items of all kv heads of a row read its token records whole (paged_impl.h): from this
// many (row, key split) pairs with real queries on, and for calls of up to this many
// queries a row (the states of all its kv heads' queries are a worker's scratch).
// Otherwise an item per kv head, for more items to share out. Results are the same.
constexpr int64_t kPagedRowItemsMin = 4;
constexpr int64_t kPagedRowItemsMaxQueries = 64;

// The work items: per row (ascending) and kv heads (all of them, or one at a time), one
// item, or consecutive key splits of whole pages when few queries meet a long row;
// `part_floats` the partials they write. Sets p->item_heads.
std::vector<PagedItem> paged_items(PagedParams* p, const std::vector<int32_t>& start,
                                   const std::vector<int32_t>& real,
                                   const std::vector<int32_t>& length, int64_t* part_floats) {
  const int64_t queries = p->H / p->K * p->T, stride = 2 + p->Dv;
  const int64_t split = p->S * std::max<int64_t>(1, kPagedSplitKeys / p->S);
  std::vector<int64_t> end(p->R), splits(p->R);
  int64_t pairs = 0;
  for (int64_t r = 0; r < p->R; ++r) {
    // the keys any real query sees: below the length, and to the last query if causal
    end[r] = real[r] == 0 ? 0 : length[r];
    if (p->causal) end[r] = std::min<int64_t>(end[r], static_cast<int64_t>(start[r]) + real[r]);
    splits[r] =
        queries <= kPagedSplitMaxQueries && end[r] >= 2 * split ? (end[r] + split - 1) / split : 1;
    if (real[r] > 0) pairs += splits[r];
  }
  p->item_heads =
      pairs >= kPagedRowItemsMin && p->T * p->H <= kPagedRowItemsMaxQueries ? p->K : 1;
  std::vector<PagedItem> items;
  *part_floats = 0;
  for (int64_t r = 0; r < p->R; ++r)
    for (int64_t g = 0; g < p->K; g += p->item_heads)
      for (int64_t i = 0; i < splits[r]; ++i) {
        int64_t part = -1;
        if (splits[r] > 1) {
          part = *part_floats;
          *part_floats += p->item_heads * real[r] * (p->H / p->K) * stride;
        }
        // one item takes the whole row (not its first split's keys alone)
        const int64_t key_end = splits[r] == 1 ? end[r] : std::min(end[r], (i + 1) * split);
        items.push_back({r, g, i * split, key_end, part, splits[r]});
      }
  return items;
}

// Workers for a call: a second worker only for work worth waking it. Waking one of XLA's
// pool threads cost the caller about 15 us on the 2-core VM, as much as a decoding step
// over one page of keys (16 rows, 4 kv heads of 32). Two workers paid from about three
// pages a row with the pages in memory, six with them cached (ab_paged_kernel.py); the
// threshold, two workers from 2 x 96 K, is the lower. Results never depend on the count.
constexpr int64_t kPagedWorkPerWorker = 96 * 1024;  // multiply-adds

int64_t paged_workers(const PagedParams& p, const std::vector<PagedItem>& items,
                      const std::vector<int32_t>& real, int64_t threads) {
  int64_t work = 0;  // key-query pairs, then multiply-adds
  for (const PagedItem& it : items) work += (it.key_end - it.key_begin) * real[it.row];
  work *= p.item_heads * (p.H / p.K) * (p.D + p.Dv);
  return std::clamp<int64_t>(work / kPagedWorkPerWorker, 1, threads);
}

ffi::Error PagedForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                        ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
                        ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> page_table,
                        ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> num_real,
                        ffi::Buffer<ffi::S32> lengths, float scale, int64_t causal,
                        int64_t max_threads, ffi::ResultBuffer<ffi::F32> out) {
  PagedParams p;
  ffi::Error err = paged_params(q.dimensions(), k_pages.dimensions(), v_pages.dimensions(),
                                page_table.dimensions(), k_pages.element_type(),
                                v_pages.element_type(), scale, causal, &p);
  if (err.failure()) return err;
  if (p.page == PageType::kS8 && (k_scales.element_count() != static_cast<size_t>(p.N * p.S * p.K) ||
                 v_scales.element_count() != static_cast<size_t>(p.N * p.S * p.K)))
    return ffi::Error::InvalidArgument("jattn paged attention: int8 pages need their scales");
  // Each row's real queries (capped at the table's capacity past its start) and length.
  const int64_t capacity = p.P * p.S;
  std::vector<int32_t> start(p.R), real(p.R), length(p.R);
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t s = std::max<int32_t>(starts.typed_data()[r], 0);
    start[r] = static_cast<int32_t>(std::min(s, capacity));
    real[r] = static_cast<int32_t>(std::clamp<int64_t>(
        std::min<int64_t>(num_real.typed_data()[r], capacity - start[r]), 0, p.T));
    length[r] = static_cast<int32_t>(
        std::clamp<int64_t>(lengths.typed_data()[r], 0, capacity));
  }
  PagedTensors t;
  t.q = q.typed_data();
  t.k = k_pages.untyped_data();
  t.v = v_pages.untyped_data();
  t.k_scales = k_scales.typed_data();
  t.v_scales = v_scales.typed_data();
  t.table = page_table.typed_data();
  t.start = start.data();
  t.real = real.data();
  t.length = length.data();
  t.out = out->typed_data();
  if (p.R * p.T * p.H * p.Dv == 0) return ffi::Error::Success();
  int64_t part_floats = 0;
  const std::vector<PagedItem> items = paged_items(&p, start, real, length, &part_floats);
  std::vector<float> part(part_floats);
  t.part = part.data();
  const PagedIsa& k_isa = paged_isa();
  const int64_t threads = paged_workers(p, items, real, worker_count(pool, max_threads));
  parallel_for(pool, static_cast<int64_t>(items.size()), threads, k_isa.scratch_floats(p),
               [&](int64_t i, float* s) { k_isa.item(p, t, items[i], s); });
  if (part_floats == 0) return ffi::Error::Success();
  std::vector<int64_t> merges;  // the first item of each split (row, kv heads)
  for (size_t i = 0; i < items.size(); i += items[i].splits)
    if (items[i].splits > 1) merges.push_back(static_cast<int64_t>(i));
  parallel_for(pool, static_cast<int64_t>(merges.size()), threads, 0,
               [&](int64_t i, float*) { k_isa.merge_item(p, t, items[merges[i]]); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnCpuPagedAttention, jattn::PagedForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_real
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
