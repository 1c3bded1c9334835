// Vector helpers the kernels of one instruction set share (attention_impl.h, paged_impl.h),
// written with GCC/Clang vector extensions. Include inside the ISA's namespace, with W (floats
// per vector) defined; JATTN_SCALEF (AVX-512) takes exp's power of two from vscalefps.

typedef float vf __attribute__((vector_size(W * 4)));
typedef float vfu __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef int32_t viu __attribute__((vector_size(W * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
inline vi loadi(const int32_t* p) { return *reinterpret_cast<const viu*>(p); }
inline vf splat(float x) { return vf{} + x; }
inline vi splati(int32_t x) { return vi{} + x; }

inline vi iota() {
  vi r;
  for (int i = 0; i < W; ++i) r[i] = i;
  return r;
}

// x with its lanes rotated by K (lane u takes lane u + K mod W).
template <int K, int... U>
inline vf rotate_lanes(vf x, std::integer_sequence<int, U...>) {
  return __builtin_shufflevector(x, x, ((U + K) % W)...);
}

template <int K>
inline vf rotate(vf x) {
  return rotate_lanes<K>(x, std::make_integer_sequence<int, W>{});
}

// Horizontal max and sum as trees (log2(W) dependent steps, not W).
inline float hmax(vf x) {
  if constexpr (W >= 16) x = x > rotate<8>(x) ? x : rotate<8>(x);
  if constexpr (W >= 8) x = x > rotate<4>(x) ? x : rotate<4>(x);
  x = x > rotate<2>(x) ? x : rotate<2>(x);
  x = x > rotate<1>(x) ? x : rotate<1>(x);
  return x[0];
}

inline float hsum(vf x) {
  if constexpr (W >= 16) x += rotate<8>(x);
  if constexpr (W >= 8) x += rotate<4>(x);
  x += rotate<2>(x);
  x += rotate<1>(x);
  return x[0];
}

// y * 2^n for integral n (vscalefps with AVX-512; else n's exponent bits, n >= -127, where
// -127 gives 0).
inline vf times_pow2(vf y, vf n) {
#if JATTN_SCALEF
  return _mm512_scalef_ps(y, n);
#else
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * (vf)bits;
#endif
}

// The polynomial c0 x^n + c1 x^(n-1) + ... + cn by Horner's rule, the highest coefficient
// first: y = c0, then y = y * x + c for each next c (the same operations in the same order
// as written out, so the same bits).
template <typename... C>
inline vf horner(vf x, float c0, C... cs) {
  vf y = splat(c0);
  ((y = y * x + splat(cs)), ...);
  return y;
}

// exp(x) to about 1 ulp (Cephes' expf polynomial); exactly 0 below -87 (and for -inf).
// With AVX-512 the power of two is applied by vscalefps (one instruction for the shifts and
// the product; beyond 88 it gives inf by itself, so no upper clamp is needed).
inline vf vexp(vf x) {
  vf xc = x < splat(-87.f) ? splat(-87.f) : x;
#if !JATTN_SCALEF
  xc = xc > splat(88.f) ? splat(88.f) : xc;
#endif
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (xc * splat(1.44269504088896341f) + magic) - magic;
  vf r = xc - n * splat(0.693359375f);
  r = r + n * splat(2.12194440e-4f);
  vf y = horner(r, 1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                1.6666665459e-1f, 5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.f);
  return x < splat(-87.f) ? splat(0.f) : times_pow2(y, n);
}

// 2^x for x <= 0 (a softmax's exponent in base 2: logits minus their max, times log2 e), to
// about 2 ulp (Cephes' exp2f polynomial on [-1/2, 1/2]); exactly 0 below -126 (and for
// -inf). Fewer operations than vexp (no two-step reduction, no upper clamp): the forward's
// softmax pass computes one per logit.
inline vf vexp2_nonpositive(vf x) {
  vf xc = x < splat(-127.f) ? splat(-127.f) : x;
#if JATTN_SCALEF
  vf n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (xc + magic) - magic;
#endif
  vf f = xc - n;
  vf y = horner(f, 1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f);
  return x < splat(-126.f) ? splat(0.f) : times_pow2(y, n);
}

