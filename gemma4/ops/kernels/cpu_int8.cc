// int8-weight matmul for decode-sized activations (M = 1..8 rows) on x86 CPUs, called from
// inside `jax.jit` through XLA's FFI. y_i[m, n] = sum_k x[m, k] * W_i[n, k] for several weights
// W_i that share one activation x (fused q/k/v and gate/up), each W_i stored as int8 q_i[n, k]
// with float32 scales: one per row (group 0) or one per row and group of `group` inputs.
//
// Activations are quantized per row to int16 (scale max|x| / 32767), so the relative error of a
// product is ~1e-4 of the row's largest element — far below the int8 weights' own error, unlike
// int8 activations (6% measured on Gemma hidden states with a few huge channels). The products
// are int16 x int16 pairs summed into int32 lanes (vpdpwssd with AVX512-VNNI, vpmaddwd + vpaddd on
// AVX512BW / AVX2), flushed to float32 at every group boundary — and at least every 256 inputs, so
// an int32 lane (2 products of at most 127 * 32767 per step) can never overflow.
//
// The instruction set is chosen at run time (one .so for every x86 CPU); rows of the weights are
// handed out in blocks through an atomic counter to the caller and to XLA's own intra-op thread
// pool, so a busy pool can delay but never deadlock a call.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFlush = 256;  // inputs per int32 accumulation at most (overflow bound)
constexpr int kMaxRows = 8;      // activation rows one call accepts

// vpdpwssd (acc += pairwise int16 products) written as inline assembly with an in-place
// accumulator. GCC 12's intrinsic made the register allocator copy every accumulator to a fresh
// register and back around each instruction in these loops: 32 zmm moves for the 8 vpdpwssd of the
// panel product's 8-row block, 46 for the GEMM tile's 12 (read in the built library). The
// broadcast form takes the activation's int16 pair straight from memory ({1to16}), one instruction
// instead of a broadcast and a product.
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i Dpwssd(__m512i acc, __m512i x,
                                                                                  __m512i w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i DpwssdPair(__m512i acc, __m512i w,
                                                                                      const int32_t* pair) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*pair));
  return acc;
}

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Vnni = 4, kAvxVnni = 5 };

bool Supports(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  switch (isa) {
    case kPortable: return true;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512: return avx512;
    case kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

// Preference order; AVX-VNNI (Alder Lake and later client CPUs, VEX-encoded) has no AVX-512.
int64_t BestIsa() {
  for (int64_t isa : {kAvx512Vnni, kAvx512, kAvxVnni, kAvx2}) {
    if (Supports(isa)) return isa;
  }
  return kPortable;
}

struct Weight {
  const int8_t* q;
  const float* scale;  // null where the scales are float16 (scale_h)
  int64_t n;      // output rows
  int64_t group;  // 0 = per-row scale
  float* y;       // [M, n]
  bool panels = false;  // q and grouped scales stored as panels (see "panels" below; GEMM only)
  // Grouped scales of a panels weight may be float16 (a GGUF Q8_0 table's own scales, exact): half
  // the scale bytes a decode step reads (the bundled model's LM head: 10.5 of 189 MB).
  const uint16_t* scale_h = nullptr;
  // A panels weight whose values all lie in [-16, 15] (a GGUF Q5_0 table's) may be stored in 5 bits
  // ("panels5" below): q is then uint8 [N/16, K/4, 40], 20 of int8's 32 bytes per input pair.
  // 4: a GGUF Q4_K table as it is ("4-bit panels" below): q uint8 [N/16, K/4, 32], its scales and
  // mins in `sb4` (uint8 [N/16, K/256, 320]); `k` is then the weight's input count.
  int bits = 8;
  const uint8_t* sb4 = nullptr;
  int64_t k = 0;
};

// IEEE half → float, exact for every half (normals, subnormals, infinities, NaN).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3ff) << 13);
  } else {
    bits = sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---------------------------------------------------------------- 4-bit panels
// A GGUF Q4_K table kept in its 4.5 bits (w = d·sc·q − dmin·m, q in 0..15, per 32 inputs a 6-bit sc
// and m, per 256 inputs a float16 d and dmin) as panels of 16 rows:
//   q   uint8 [N/16, K/4, 32]: byte i = 2j + t of block b holds row j's input 4b + t in its low
//       nibble and input 4b + 2 + t in its high nibble (input pairs 2b and 2b + 1, as 5-bit panels)
//   sb4 uint8 [N/16, K/256, 320] per panel and super-block of 256 inputs: sc [8 groups][16 rows],
//       m [8][16], then d float16 [16] and dmin float16 [16].
// A product is sum_g d·sc_g · (q · x over group g) − sum_g dmin·m_g · (sum of x over group g): the
// first part runs as any 32-input-group panels weight with scale d·sc (exact in float32: an 11-bit
// by 6-bit product), the second from the activations' group sums (`SubtractMins`).
constexpr int64_t kQ4Super = 256, kQ4Group = 32, kQ4SuperBytes = 320;

inline const uint8_t* Q4Super(const Weight& w, int64_t panel, int64_t group) {
  return w.sb4 + (panel * (w.k / kQ4Super) + group / 8) * kQ4SuperBytes;
}
inline float Q4Scale(const Weight& w, int64_t panel, int64_t group, int j) {
  const uint8_t* s = Q4Super(w, panel, group);
  uint16_t d;
  std::memcpy(&d, s + 256 + 2 * j, 2);
  return HalfToFloat(d) * float(s[(group % 8) * 16 + j]);
}
inline float Q4Min(const Weight& w, int64_t panel, int64_t group, int j) {
  const uint8_t* s = Q4Super(w, panel, group);
  uint16_t dmin;
  std::memcpy(&dmin, s + 288 + 2 * j, 2);
  return HalfToFloat(dmin) * float(s[128 + (group % 8) * 16 + j]);
}

// Grouped scale `i` of a panels weight ([N/16, K/g, 16] flattened), float32 or float16 as stored,
// or a 4-bit panels weight's d·sc.
inline float GroupScale(const Weight& w, int64_t i) {
  if (w.bits == 4) {
    const int64_t groups = w.k / kQ4Group;
    return Q4Scale(w, i / (groups * 16), (i / 16) % groups, int(i % 16));
  }
  return w.scale_h ? HalfToFloat(w.scale_h[i]) : w.scale[i];
}

// One activation row as quantized (int16 xq [K]) → its sums per 32 inputs (xs [K/32], in the
// units of xq: exact in float32): what a 4-bit weight's mins multiply. Summed from the quantized
// values, so the product is exactly the weight's with those activations: from the float x, the
// rounding of x would meet d·sc·q alone (larger than the weight's values) and err more.
void GroupSums(const int16_t* xq, int64_t k, float* xs) {
  for (int64_t g = 0; g < k / kQ4Group; ++g) {
    int32_t s = 0;
    for (int i = 0; i < kQ4Group; ++i) s += xq[g * kQ4Group + i];
    xs[g] = float(s);
  }
}

// y[m, 16·panel ..+16] −= sx[m] · sum_g dmin·m_g · xs[m, g] for rows m0..m1 of a 4-bit weight
// (the GEMM's: the panel product takes them off in its flushes).
void SubtractMinsPortable(const Weight& w, int64_t panel, const float* xs, const float* sx, int64_t m0, int64_t m1) {
  const int64_t groups = w.k / kQ4Group;
  for (int64_t m = m0; m < m1; ++m) {
    for (int j = 0; j < 16; ++j) {
      float s = 0.f;
      for (int64_t g = 0; g < groups; ++g) s += Q4Min(w, panel, g, j) * xs[m * groups + g];
      w.y[m * w.n + panel * 16 + j] -= s * sx[m];
    }
  }
}

__attribute__((target("avx512f,avx512bw"))) void SubtractMinsAvx512(const Weight& w, int64_t panel, const float* xs,
                                                                    const float* sx, int64_t m0, int64_t m1) {
  const int64_t groups = w.k / kQ4Group;
  constexpr int kRows = 8;
  for (int64_t a = m0; a < m1; a += kRows) {
    const int mr = int(std::min<int64_t>(kRows, m1 - a));
    __m512 acc[kRows];
    for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
    __m512 dmin = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* s = Q4Super(w, panel, g);
      if (g % 8 == 0) dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 288)));
      const __m512 mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 128 + (g % 8) * 16)))));
      for (int i = 0; i < mr; ++i) acc[i] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xs[(a + i) * groups + g]), acc[i]);
    }
    for (int i = 0; i < mr; ++i) {
      float* out = w.y + (a + i) * w.n + panel * 16;
      _mm512_storeu_ps(out, _mm512_fnmadd_ps(acc[i], _mm512_set1_ps(sx[a + i]), _mm512_loadu_ps(out)));
    }
  }
}

void SubtractMins(const Weight& w, int64_t panel, const float* xs, const float* sx, int64_t m0, int64_t m1,
                  bool avx512) {
  if (avx512) return SubtractMinsAvx512(w, panel, xs, sx, m0, m1);
  SubtractMinsPortable(w, panel, xs, sx, m0, m1);
}

bool AnyFourBit(const std::vector<Weight>& weights) {
  for (const auto& w : weights) {
    if (w.bits == 4) return true;
  }
  return false;
}

// ---------------------------------------------------------------- 5-bit panels
// A panels weight (see "panels" below) whose values all lie in [-16, 15] may store two input pairs
// of a 16-row panel in one 40-byte block: byte i (i = 2j + t, as in an int8 panel's 32 bytes) holds
// value i of pair 2b in its low nibble and value i of pair 2b + 1 in its high nibble, each as
// q & 15; bytes 32..39 are a 64-bit mask with bit i set where value i of pair 2b is negative (bit
// 32 + i: of pair 2b + 1), so q = nibble - 16 * bit. A GGUF Q5_0 table's values in 20 bytes per pair
// instead of 32; the integer sums, and so the results, are the int8 panels' exactly.
constexpr int64_t kPanel5Block = 40;

// `blocks` 5-bit blocks → int8 pairs (64 bytes each) with AVX-512: the same values as the loop below.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void Unpack5Avx512(const uint8_t* src, int64_t blocks,
                                                                        int8_t* out) {
  const __m256i nibble = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = src + b * kPanel5Block;
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    uint64_t neg;
    std::memcpy(&neg, blk + 32, sizeof neg);
    const __m256i lo = _mm256_and_si256(t, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), nibble);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 64), _mm256_mask_sub_epi8(lo, __mmask32(neg), lo, sixteen));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 64 + 32),
                        _mm256_mask_sub_epi8(hi, __mmask32(neg >> 32), hi, sixteen));
  }
}

// `blocks` 4-bit blocks (32 bytes) → int8 pairs (64 bytes each) with AVX-512: the loop's values.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void Unpack4Avx512(const uint8_t* src, int64_t blocks,
                                                                        int8_t* out) {
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + b * 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 64), _mm256_and_si256(t, nibble));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * 64 + 32), _mm256_and_si256(_mm256_srli_epi16(t, 4), nibble));
  }
}

// Panels p0..p0+count of a panels weight as int8 panels ([count, K/2, 32]): where they lie, or
// unpacked into `tmp` from 5 or 4 bits (with AVX-512 where `avx512`).
const int8_t* Int8Panels(const Weight& w, int64_t k, int64_t p0, int64_t count, std::vector<int8_t>& tmp,
                         bool avx512 = false) {
  if (w.bits == 8) return w.q + p0 * (k / 2) * 32;
  tmp.resize(size_t(count * (k / 2) * 32));
  if (w.bits == 4) {  // [count, K/4, 32] nibbles → two int8 pairs per block (values 0..15)
    const uint8_t* src4 = reinterpret_cast<const uint8_t*>(w.q) + p0 * (k / 4) * 32;
    if (avx512) {
      Unpack4Avx512(src4, count * (k / 4), tmp.data());
      return tmp.data();
    }
    for (int64_t b = 0; b < count * (k / 4); ++b) {
      for (int i = 0; i < 32; ++i) {
        tmp[size_t(b * 64 + i)] = int8_t(src4[b * 32 + i] & 15);
        tmp[size_t(b * 64 + 32 + i)] = int8_t(src4[b * 32 + i] >> 4);
      }
    }
    return tmp.data();
  }
  const uint8_t* src = reinterpret_cast<const uint8_t*>(w.q) + p0 * (k / 4) * kPanel5Block;
  if (avx512) {
    Unpack5Avx512(src, count * (k / 4), tmp.data());
    return tmp.data();
  }
  for (int64_t b = 0; b < count * (k / 4); ++b) {
    const uint8_t* blk = src + b * kPanel5Block;
    uint64_t neg;
    std::memcpy(&neg, blk + 32, sizeof neg);
    int8_t* out = tmp.data() + b * 64;
    for (int i = 0; i < 32; ++i) {
      out[i] = int8_t((blk[i] & 15) - 16 * int((neg >> i) & 1));
      out[32 + i] = int8_t((blk[i] >> 4) - 16 * int((neg >> (32 + i)) & 1));
    }
  }
  return tmp.data();
}

struct Problem {
  int m = 0;
  int64_t k = 0;
  std::vector<int16_t> xq;  // [m, k]
  float sx[kMaxRows] = {};
  std::vector<Weight> weights;
};

// Inputs per accumulation step and the scale that applies to it (1 for per-row weights, whose
// row scale is applied once at the end).
inline int64_t StepLen(const Weight& w, int64_t k) {
  return w.group ? std::min<int64_t>(w.group, kFlush) : std::min<int64_t>(k, kFlush);
}

// ---------------------------------------------------------------- portable
void RowsPortable(const Problem& p, const Weight& w, int64_t r0, int64_t r1) {
  const int64_t k = p.k;
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* qr = w.q + r * k;
    for (int m = 0; m < p.m; ++m) {
      const int16_t* xr = p.xq.data() + m * k;
      float acc = 0.f;
      const int64_t step = StepLen(w, k);
      for (int64_t k0 = 0; k0 < k; k0 += step) {
        int32_t s = 0;
        for (int64_t i = k0; i < std::min(k0 + step, k); ++i) s += int32_t(xr[i]) * int32_t(qr[i]);
        const float sc = w.group ? w.scale[r * (k / w.group) + k0 / w.group] : 1.f;
        acc += float(s) * sc;
      }
      w.y[m * w.n + r] = acc * p.sx[m] * (w.group ? 1.f : w.scale[r]);
    }
  }
}

// ---------------------------------------------------------------- AVX2 (16 inputs per step)
#define GEMMA4_DEFINE_AVX2_ROWS(NAME, TARGET, DOT)                                                 \
template <int M>                                                                                  \
__attribute__((target(TARGET))) void NAME(const Problem& p, const Weight& w, int64_t r0, int64_t r1) { \
  const int64_t k = p.k, step = StepLen(w, k);                                                     \
  const int64_t groups = w.group ? k / w.group : 0;                                                \
  for (int64_t r = r0; r < r1; ++r) {                                                              \
    const int8_t* qr = w.q + r * k;                                                                \
    const float* sp = w.group ? w.scale + r * groups : nullptr; /* one scale per step */         \
    __m256 facc[M];                                                                                \
    for (int m = 0; m < M; ++m) facc[m] = _mm256_setzero_ps();                                     \
    for (int64_t k0 = 0; k0 < k; k0 += step) {                                                     \
      __m256i iacc[M];                                                                             \
      for (int m = 0; m < M; ++m) iacc[m] = _mm256_setzero_si256();                                \
      for (int64_t i = k0, end = std::min(k0 + step, k); i < end; i += 16) {                       \
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + i))); \
        for (int m = 0; m < M; ++m) {                                                              \
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq.data() + m * k + i)); \
          iacc[m] = DOT(iacc[m], xv, wv);                                                          \
        }                                                                                          \
      }                                                                                            \
      const __m256 sc = _mm256_set1_ps(w.group ? *sp++ : 1.f);                                     \
      for (int m = 0; m < M; ++m) facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m]), sc, facc[m]); \
    }                                                                                              \
    const float row_scale = w.group ? 1.f : w.scale[r];                                            \
    for (int m = 0; m < M; ++m) {                                                                  \
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(facc[m]), _mm256_extractf128_ps(facc[m], 1));   \
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                      \
      s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));                                                  \
      w.y[m * w.n + r] = _mm_cvtss_f32(s) * p.sx[m] * row_scale;                                   \
    }                                                                                              \
  }                                                                                                \
}

#define GEMMA4_DOT2_MADD(acc, x, w) _mm256_add_epi32(acc, _mm256_madd_epi16(x, w))
#define GEMMA4_DOT2_VNNI(acc, x, w) _mm256_dpwssd_avx_epi32(acc, x, w)
GEMMA4_DEFINE_AVX2_ROWS(RowsAvx2T, "avx2,fma", GEMMA4_DOT2_MADD)
GEMMA4_DEFINE_AVX2_ROWS(RowsAvxVnniT, "avx2,fma,avxvnni", GEMMA4_DOT2_VNNI)

// ---------------------------------------------------------------- AVX-512 (32 inputs per step)
// Group 16 is the one group narrower than a step: lanes 0-7 of a step belong to its first group,
// lanes 8-15 to the second, so the step's scale vector holds two values.
// One output row at a time (R = 1; the template keeps R for measuring): M independent accumulator
// chains, each weight vector loaded serves M activation rows. R interleaved rows (R · M chains) were
// twice as slow where the weight streams from memory, as every weight of a decode step does: the
// 262144 × 640 LM head at one row took 10.9 ms with R = 4 and 5.5 ms with R = 1, at two rows 13.6
// vs 7.2 ms (R = 2), on a 2-core AMD EPYC Zen 4 (one sequential stream per thread is what the
// prefetchers follow); R > 1 won only on weights already in cache.
#define GEMMA4_DEFINE_AVX512_ROWS(NAME, TARGET, DOT)                                              \
  template <int M, int R>                                                                         \
  __attribute__((target(TARGET))) void NAME##Block(const Problem& p, const Weight& w, int64_t r) { \
    const int64_t k = p.k;                                                                        \
    const int64_t step = w.group == 16 ? 32 : StepLen(w, k);                                      \
    const int64_t groups = w.group ? k / w.group : 0;                                             \
    const int8_t* qr[R];                                                                          \
    const float* sr[R];                                                                           \
    for (int j = 0; j < R; ++j) {                                                                 \
      qr[j] = w.q + (r + j) * k;                                                                  \
      sr[j] = w.group ? w.scale + (r + j) * groups : nullptr; /* advanced per step */             \
    }                                                                                             \
    __m512 facc[R][M];                                                                            \
    for (int j = 0; j < R; ++j)                                                                   \
      for (int m = 0; m < M; ++m) facc[j][m] = _mm512_setzero_ps();                               \
    for (int64_t k0 = 0; k0 < k; k0 += step) {                                                    \
      __m512i iacc[R][M];                                                                         \
      for (int j = 0; j < R; ++j)                                                                 \
        for (int m = 0; m < M; ++m) iacc[j][m] = _mm512_setzero_si512();                          \
      for (int64_t i = k0, end = std::min(k0 + step, k); i < end; i += 32) {                      \
        __m512i xv[M];                                                                            \
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(p.xq.data() + m * k + i);          \
        for (int j = 0; j < R; ++j) {                                                             \
          const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr[j] + i))); \
          for (int m = 0; m < M; ++m) iacc[j][m] = DOT(iacc[j][m], xv[m], wv);                    \
        }                                                                                         \
      }                                                                                           \
      for (int j = 0; j < R; ++j) {                                                               \
        __m512 sc;                                                                                \
        if (w.group == 16) {                                                                      \
          const __m256d lo = _mm256_castps_pd(_mm256_set1_ps(sr[j][0]));                          \
          const __m256d hi = _mm256_castps_pd(_mm256_set1_ps(sr[j][1]));                          \
          sc = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));           \
          sr[j] += 2;                                                                             \
        } else if (w.group) {                                                                     \
          sc = _mm512_set1_ps(*sr[j]++);                                                          \
        } else {                                                                                  \
          sc = _mm512_set1_ps(1.f);                                                               \
        }                                                                                         \
        for (int m = 0; m < M; ++m) facc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[j][m]), sc, facc[j][m]); \
      }                                                                                           \
    }                                                                                             \
    for (int j = 0; j < R; ++j) {                                                                 \
      const float row_scale = w.group ? 1.f : w.scale[r + j];                                     \
      for (int m = 0; m < M; ++m) w.y[m * w.n + r + j] = _mm512_reduce_add_ps(facc[j][m]) * p.sx[m] * row_scale; \
    }                                                                                             \
  }                                                                                               \
  template <int M>                                                                                \
  void NAME(const Problem& p, const Weight& w, int64_t r0, int64_t r1) {                          \
    constexpr int R = 1;                                                                          \
    int64_t r = r0;                                                                               \
    for (; r + R <= r1; r += R) NAME##Block<M, R>(p, w, r);                                       \
    for (; r < r1; ++r) NAME##Block<M, 1>(p, w, r);                                               \
  }

#define GEMMA4_DOT_VNNI(acc, x, w) Dpwssd(acc, x, w)
#define GEMMA4_DOT_BW(acc, x, w) _mm512_add_epi32(acc, _mm512_madd_epi16(x, w))
GEMMA4_DEFINE_AVX512_ROWS(RowsAvx512VnniT, "avx512f,avx512bw,avx512vnni", GEMMA4_DOT_VNNI)
GEMMA4_DEFINE_AVX512_ROWS(RowsAvx512BwT, "avx512f,avx512bw", GEMMA4_DOT_BW)

using RowsFn = void (*)(const Problem&, const Weight&, int64_t, int64_t);

// The instantiation for each activation row count 1..kMaxRows of one ISA's row function.
#define GEMMA4_BY_ROWS(F) {&F<1>, &F<2>, &F<3>, &F<4>, &F<5>, &F<6>, &F<7>, &F<8>}

RowsFn RowsFor(int64_t isa, int m) {
  static constexpr RowsFn vnni[kMaxRows] = GEMMA4_BY_ROWS(RowsAvx512VnniT);
  static constexpr RowsFn avx512[kMaxRows] = GEMMA4_BY_ROWS(RowsAvx512BwT);
  static constexpr RowsFn avx_vnni[kMaxRows] = GEMMA4_BY_ROWS(RowsAvxVnniT);
  static constexpr RowsFn avx2[kMaxRows] = GEMMA4_BY_ROWS(RowsAvx2T);
  switch (isa) {
    case kAvx512Vnni: return vnni[m - 1];
    case kAvx512: return avx512[m - 1];
    case kAvxVnni: return avx_vnni[m - 1];
    case kAvx2: return avx2[m - 1];
    default: return &RowsPortable;
  }
}

// One activation row → int16 with one scale (max |x| / 32767, round to nearest); returns the scale.
float QuantizeRow(const float* xr, int64_t k, int16_t* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(xr[i]));
  const float s = amax > 0.f ? amax / 32767.f : 1.f;
  const float inv = 1.f / s;
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::nearbyint(xr[i] * inv);
    out[i] = int16_t(std::min(32767.f, std::max(-32767.f, v)));
  }
  return s;
}

// Activation rows → int16 with one scale per row.
void QuantizeRows(const float* x, Problem& p) {
  p.xq.resize(size_t(p.m) * p.k);
  for (int m = 0; m < p.m; ++m) p.sx[m] = QuantizeRow(x + m * p.k, p.k, p.xq.data() + m * p.k);
}

// Work shared between the caller and pool tasks; held by shared_ptr so a task that starts after
// the call returned finds no work and only drops its reference.
struct Work {
  Problem problem;
  RowsFn rows = nullptr;
  std::vector<std::pair<int, int64_t>> blocks;  // (weight, first row)
  std::vector<int64_t> block_rows;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};

  void Drain() {
    for (size_t b; (b = next.fetch_add(1)) < blocks.size();) {
      const auto [wi, r0] = blocks[b];
      rows(problem, problem.weights[wi], r0, r0 + block_rows[b]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The (q, scale) pairs and outputs of a call as Weights (groups already checked): int8 q [N, K] with
// N a multiple of `rows_multiple`, float32 scales [N] or [N, K / group], float32 outputs; with
// `panels`, q [N/16, K/2, 32] and grouped scales [N/16, K/g, 16] (the panel layout).
// Stacked weights (the layers a scan runs: gemma4/model/decoder.py): one more operand after the
// pairs, an int32 layer index l, and each q and scale has a leading layer axis [L, ...]; layer l's
// bytes are read in place (no copy of the layer is made).
ffi::Error ReadWeights(ffi::RemainingArgs& args, ffi::RemainingRets& rets, ffi::Span<const int64_t> groups,
                       int64_t k, int64_t rows_multiple, std::vector<Weight>& out, bool panels = false) {
  const size_t nw = groups.size();
  const bool stacked = args.size() == 2 * nw + 1;
  if ((args.size() != 2 * nw && !stacked) || rets.size() != nw) {
    return ffi::Error::InvalidArgument("expected (q, scale) per weight (then a layer index if stacked) and one output each");
  }
  int64_t layer = 0;
  if (stacked) {
    auto l = args.get<ffi::AnyBuffer>(2 * nw);
    if (!l.has_value() || l->element_type() != ffi::S32 || l->element_count() != 1) {
      return ffi::Error::InvalidArgument("the layer index of stacked weights must be one int32");
    }
    layer = *static_cast<const int32_t*>(l->untyped_data());
  }
  for (size_t i = 0; i < nw; ++i) {
    auto q = args.get<ffi::AnyBuffer>(2 * i);
    auto s = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!q.has_value() || !s.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("bad buffers");
    const bool half = s->element_type() == ffi::F16;
    const auto q_dims = q->dimensions();
    // uint8 q: 5-bit panels ([.., 40] blocks, see "panels5") or 4-bit ones ([.., 32], "4-bit panels")
    const bool packed = panels && q->element_type() == ffi::U8;
    const bool four = packed && q_dims.size() && q_dims[q_dims.size() - 1] == 32;
    const bool five = packed && !four;
    if ((q->element_type() != ffi::S8 && !packed) ||
        (four ? s->element_type() != ffi::U8 : (s->element_type() != ffi::F32 && !half)) ||
        (*y)->element_type() != ffi::F32) {
      return ffi::Error::InvalidArgument("expected int8 q (uint8 for 5-bit panels), float32 (or float16) scale and "
                                         "float32 output, or 4-bit panels (uint8 q and scales)");
    }
    if (half && !(panels && groups[i])) {
      return ffi::Error::InvalidArgument("float16 scales are read only for grouped weights stored as panels");
    }
    const auto all_dims = q->dimensions();
    const int64_t layers = stacked ? (all_dims.size() ? all_dims[0] : 0) : 1;
    if (layers <= 0 || layer < 0 || layer >= layers) return ffi::Error::InvalidArgument("layer index out of range");
    const std::vector<int64_t> qd(all_dims.begin() + (stacked ? 1 : 0), all_dims.end());
    int64_t n = qd.size() ? qd[0] : 0;
    if (four) {  // [N/16, K/4, 32], scales [N/16, K/256, 320]
      if (k % kQ4Super || qd.size() != 3 || qd[1] != k / 4) {
        return ffi::Error::InvalidArgument("4-bit panels q must be [N/16, K/4, 32] with K a multiple of 256");
      }
      if (groups[i] != kQ4Group) return ffi::Error::InvalidArgument("4-bit panels have a group of 32");
      n = qd[0] * 16;
    } else if (five) {  // [N/16, K/4, 40]
      if (k % 4 || qd.size() != 3 || qd[1] != k / 4 || qd[2] != 40) {
        return ffi::Error::InvalidArgument("5-bit panels q must be [N/16, K/4, 40] with K a multiple of 4");
      }
      if (groups[i] % 4) return ffi::Error::InvalidArgument("5-bit panels need a group that is a multiple of 4");
      n = qd[0] * 16;
    } else if (panels) {  // [N/16, K/2, 32]
      if (qd.size() != 3 || qd[1] != k / 2 || qd[2] != 32) return ffi::Error::InvalidArgument("q must be [N/16, K/2, 32]");
      n = qd[0] * 16;
    } else if (qd.size() != 2 || qd[1] != k) {
      return ffi::Error::InvalidArgument("q must be [N, K]");
    }
    if (n % rows_multiple) return ffi::Error::InvalidArgument("N must be a multiple of " + std::to_string(rows_multiple));
    const int64_t g = groups[i];
    const int64_t expect_scales = four ? (n / 16) * (k / kQ4Super) * kQ4SuperBytes : g ? n * (k / g) : n;
    if (int64_t(s->element_count()) != expect_scales * layers) return ffi::Error::InvalidArgument("scale has the wrong size");
    const auto* q_at = static_cast<const int8_t*>(q->untyped_data()) + layer * int64_t(q->size_bytes() / layers);
    const auto* s_at = static_cast<const char*>(s->untyped_data()) + layer * int64_t(s->size_bytes() / layers);
    out.push_back(Weight{q_at, half || four ? nullptr : reinterpret_cast<const float*>(s_at), n, g,
                         static_cast<float*>((*y)->untyped_data()), panels,
                         half ? reinterpret_cast<const uint16_t*>(s_at) : nullptr, four ? 4 : five ? 5 : 8,
                         four ? reinterpret_cast<const uint8_t*>(s_at) : nullptr, k});
  }
  return ffi::Error::Success();
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be [M, K]");
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
  p.m = int(dims[0]);
  p.k = dims[1];
  if (p.m < 1 || p.m > kMaxRows) return ffi::Error::InvalidArgument("x must have 1..8 rows");
  const int64_t best = BestIsa();
  if (isa == kAuto) isa = best;
  if (!Supports(isa)) return ffi::Error::InvalidArgument("requested instruction set not supported by this CPU");
  const int64_t align = (isa == kAvx512 || isa == kAvx512Vnni) ? 32 : isa == kPortable ? 1 : 16;
  if (p.k % align) return ffi::Error::InvalidArgument("K must be a multiple of the vector width");
  for (int64_t g : groups) {
    if (g < 0 || (g && (p.k % g || g > kFlush || g % 16 || (g % 32 && g != 16)))) {
      return ffi::Error::InvalidArgument("group must be 0, 16 or a multiple of 32 up to 256 dividing K");
    }
  }
  if (auto err = ReadWeights(args, rets, groups, p.k, 1, p.weights); err.failure()) return err;
  QuantizeRows(x.typed_data(), p);
  work->rows = RowsFor(isa, p.m);

  int64_t total = 0;
  for (const auto& w : p.weights) total += w.n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // ~8 blocks per thread for balance, at least 16 rows each to keep the per-block cost small.
  const int64_t per_block = std::max<int64_t>(16, total / (threads * 8) + 1);
  for (size_t i = 0; i < p.weights.size(); ++i) {
    for (int64_t r = 0; r < p.weights[i].n; r += per_block) {
      work->blocks.emplace_back(int(i), r);
      work->block_rows.push_back(std::min(per_block, p.weights[i].n - r));
    }
  }
  const int64_t helpers = std::min<int64_t>(threads, int64_t(work->blocks.size())) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->blocks.size()) std::this_thread::yield();
  return ffi::Error::Success();
}

// ================================================================ GEMM: prefill-sized activations
// The row kernel above streams the weight once per 8 activation rows, so a 512-token prefill would
// read every weight 64 times. For many rows the weight is packed once per call, a panel of kPanel
// output rows at a time, into a layout a register tile can use directly: for each input pair
// (2p, 2p+1), the kPanel rows' two int8 values as two int16 in one int32 lane. A broadcast of one
// activation row's pair times a panel vector is then one vpdpwssd for 16 outputs, and a tile of
// kTile activation rows × 32 outputs keeps 12 int32 and 12 float32 accumulators in registers.
// Activations are int16 per row (as above: ~1e-4 of the row's largest element), so the result is
// within the same bound as the row kernel; only the order of the sums differs.
//
// Loops: per panel (a unit of work), pack it (PackPairs, PackScales); then per block of kKBlock inputs (the panel's slice
// stays in L1), per tile of activation rows, accumulate, flushing int32 → float32 at every scale
// group (or every kFlush inputs), and add the block's sum into y.

constexpr int kPanel = 32;     // output rows per packed panel: two 16-lane vectors
constexpr int kTile = 6;       // activation rows per register tile
constexpr int64_t kKBlock = 256;

struct GemmProblem {
  int64_t m = 0, k = 0;
  std::vector<int16_t> xq;  // [m, k]
  std::vector<float> sx;    // [m]
  std::vector<float> xs;    // [m, k / 32]: x's sums per 32 inputs, where a weight is 4-bit (GroupSums)
  std::vector<Weight> weights;
};

// Inputs per int32 flush: the weight's group, or for per-row weights the largest of 256/128/64/32
// dividing K (the caller checks K % 32 == 0).
inline int64_t GemmFlush(const Weight& w, int64_t k) {
  if (w.group) return w.group;
  for (int64_t f : {kFlush, int64_t(128), int64_t(64)}) {
    if (k % f == 0) return f;
  }
  return 32;
}

// Panel o0..o0+kPanel of weight w: wp[p * kPanel + j] = (q[o0+j][2p], q[o0+j][2p+1]) as two int16.
// A panels weight's two 16-row panels are read from `pq` (`Int8Panels`).
void PackPairs(const Weight& w, int64_t k, int64_t o0, const int8_t* pq, int32_t* wp) {
  if (w.panels) {  // row o0 + j's pair p: bytes 2j', 2j' + 1 of 16-row panel j / 16, pair p (o0 % 32 == 0)
    for (int j = 0; j < kPanel; ++j) {
      const int8_t* panel = pq + (j / 16) * (k / 2) * 32 + 2 * (j % 16);
      for (int64_t p = 0; p < k / 2; ++p) {
        const uint32_t lo = uint16_t(int16_t(panel[p * 32])), hi = uint16_t(int16_t(panel[p * 32 + 1]));
        wp[p * kPanel + j] = int32_t(lo | (hi << 16));
      }
    }
    return;
  }
  for (int j = 0; j < kPanel; ++j) {
    const int8_t* row = w.q + (o0 + j) * k;
    for (int64_t p = 0; p < k / 2; ++p) {
      const uint32_t lo = uint16_t(int16_t(row[2 * p])), hi = uint16_t(int16_t(row[2 * p + 1]));
      wp[p * kPanel + j] = int32_t(lo | (hi << 16));
    }
  }
}

// sp[f * kPanel + j] = the scale of flush f for row o0+j (a per-row weight's row scale every time).
void PackScales(const Weight& w, int64_t k, int64_t o0, int64_t flush, float* sp) {
  for (int j = 0; j < kPanel; ++j) {
    for (int64_t f = 0; f < k / flush; ++f) {
      const int64_t r = o0 + j, groups = w.group ? k / w.group : 0;
      if (!w.group) {
        sp[f * kPanel + j] = w.scale[r];
      } else if (w.panels) {  // [N/16, K/g, 16]
        sp[f * kPanel + j] = GroupScale(w, ((r / 16) * groups + f) * 16 + r % 16);
      } else {
        sp[f * kPanel + j] = w.scale[r * groups + f];
      }
    }
  }
}

// PackPairs with AVX-512: 16 rows × 16 pairs at a time, each row's 32 int8 sign-extended to
// 16 int32 lanes of pairs, then a 16 × 16 transpose of 32-bit lanes in registers (unpack 32, unpack
// 64, two 128-bit lane shuffles), stored as 16 whole vectors. The scalar loop above stores one
// int32 at a time at a 128-byte stride: with it a 16-row product of a 2048 × 640 weight took
// 0.37 ms, with this 0.19 ms (2-core AMD EPYC Zen 4; 0.35 ms for the row kernel's 8-row slices).
__attribute__((target("avx512f,avx512bw"))) void PackPairsAvx512(const Weight& w, int64_t k, int64_t o0,
                                                                 const int8_t* pq, int32_t* wp) {
  if (w.panels) {  // already pair-major: sign-extend the two 16-row panels' 32 bytes per pair
    const int8_t* a = pq;
    const int8_t* b = a + (k / 2) * 32;
    for (int64_t p = 0; p < k / 2; ++p) {
      _mm512_store_si512(wp + p * kPanel, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + p * 32))));
      _mm512_store_si512(wp + p * kPanel + 16, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * 32))));
    }
    return;
  }
  for (int j0 = 0; j0 < kPanel; j0 += 16) {
    for (int64_t p0 = 0; p0 < k / 2; p0 += 16) {
      __m512i r[16], t[16];
      for (int j = 0; j < 16; ++j) {
        r[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (o0 + j0 + j) * k + 2 * p0)));
      }
      for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3 → t[4i + c] holds column 4L + c of them in lane L
        const __m512i a = _mm512_unpacklo_epi32(r[4 * i], r[4 * i + 1]), b = _mm512_unpackhi_epi32(r[4 * i], r[4 * i + 1]);
        const __m512i c = _mm512_unpacklo_epi32(r[4 * i + 2], r[4 * i + 3]), d = _mm512_unpackhi_epi32(r[4 * i + 2], r[4 * i + 3]);
        t[4 * i] = _mm512_unpacklo_epi64(a, c);
        t[4 * i + 1] = _mm512_unpackhi_epi64(a, c);
        t[4 * i + 2] = _mm512_unpacklo_epi64(b, d);
        t[4 * i + 3] = _mm512_unpackhi_epi64(b, d);
      }
      for (int c = 0; c < 4; ++c) {  // lane L of the four row groups → column 4L + c, rows 0..15
        const __m512i x0 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x44);
        const __m512i x2 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xEE), x3 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xEE);
        int32_t* out = wp + (p0 + c) * kPanel + j0;
        _mm512_store_si512(out, _mm512_shuffle_i32x4(x0, x1, 0x88));
        _mm512_store_si512(out + 4 * kPanel, _mm512_shuffle_i32x4(x0, x1, 0xDD));
        _mm512_store_si512(out + 8 * kPanel, _mm512_shuffle_i32x4(x2, x3, 0x88));
        _mm512_store_si512(out + 12 * kPanel, _mm512_shuffle_i32x4(x2, x3, 0xDD));
      }
    }
  }
}

// One tile: rows m0..m0+MR of y (+)= x[m0.., k0..k1] · panel, scaled. first: store instead of add.
void GemmTilePortable(const GemmProblem& p, int mr, int64_t m0, int64_t k0, int64_t k1, int64_t flush,
                      const int32_t* wp, const float* sp, float* y, int64_t ldy, bool first) {
  for (int mi = 0; mi < mr; ++mi) {
    const int16_t* xr = p.xq.data() + (m0 + mi) * p.k;
    for (int j = 0; j < kPanel; ++j) {
      float acc = 0.f;
      for (int64_t f0 = k0; f0 < k1; f0 += flush) {
        int32_t s = 0;
        for (int64_t i = f0; i < f0 + flush; i += 2) {
          const int32_t v = wp[(i / 2) * kPanel + j];
          s += int32_t(xr[i]) * int16_t(v & 0xffff) + int32_t(xr[i + 1]) * int16_t(uint32_t(v) >> 16);
        }
        acc += float(s) * sp[(f0 / flush) * kPanel + j];
      }
      float* out = y + (m0 + mi) * ldy + j;
      *out = (first ? 0.f : *out) + acc * p.sx[m0 + mi];
    }
  }
}

#define GEMMA4_DEFINE_AVX512_TILE(NAME, TARGET, DOT)                                               \
  template <int MR>                                                                                \
  __attribute__((target(TARGET))) void NAME(const GemmProblem& p, int64_t m0, int64_t k0, int64_t k1, \
                                            int64_t flush, const int32_t* wp, const float* sp,     \
                                            float* y, int64_t ldy, bool first) {                   \
    __m512 f0[MR], f1[MR];                                                                         \
    for (int i = 0; i < MR; ++i) f0[i] = f1[i] = _mm512_setzero_ps();                              \
    const int16_t* xr[MR];                                                                         \
    for (int i = 0; i < MR; ++i) xr[i] = p.xq.data() + (m0 + i) * p.k;                            \
    const float* sa = sp + (k0 / flush) * kPanel; /* this flush's scales, advanced per flush */  \
    for (int64_t a = k0; a < k1; a += flush, sa += kPanel) {                                       \
      __m512i a0[MR], a1[MR];                                                                      \
      for (int i = 0; i < MR; ++i) a0[i] = a1[i] = _mm512_setzero_si512();                         \
      const int32_t* w = wp + (a / 2) * kPanel;                                                    \
      for (int64_t i2 = a; i2 < a + flush; i2 += 2, w += kPanel) {                                 \
        const __m512i w0 = _mm512_load_si512(w), w1 = _mm512_load_si512(w + 16);                  \
        for (int i = 0; i < MR; ++i) {                                                             \
          int32_t pair;                                                                            \
          std::memcpy(&pair, xr[i] + i2, sizeof pair);                                             \
          const __m512i xb = _mm512_set1_epi32(pair);                                              \
          a0[i] = DOT(a0[i], xb, w0);                                                              \
          a1[i] = DOT(a1[i], xb, w1);                                                              \
        }                                                                                          \
      }                                                                                            \
      const __m512 s0 = _mm512_loadu_ps(sa);                                                       \
      const __m512 s1 = _mm512_loadu_ps(sa + 16);                                                  \
      for (int i = 0; i < MR; ++i) {                                                               \
        f0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]), s0, f0[i]);                             \
        f1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]), s1, f1[i]);                             \
      }                                                                                            \
    }                                                                                              \
    for (int i = 0; i < MR; ++i) {                                                                 \
      float* out = y + (m0 + i) * ldy;                                                             \
      const __m512 sx = _mm512_set1_ps(p.sx[m0 + i]);                                              \
      if (first) {                                                                                 \
        _mm512_storeu_ps(out, _mm512_mul_ps(f0[i], sx));                                           \
        _mm512_storeu_ps(out + 16, _mm512_mul_ps(f1[i], sx));                                      \
      } else {                                                                                     \
        _mm512_storeu_ps(out, _mm512_fmadd_ps(f0[i], sx, _mm512_loadu_ps(out)));                   \
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(f1[i], sx, _mm512_loadu_ps(out + 16)));         \
      }                                                                                            \
    }                                                                                              \
  }

GEMMA4_DEFINE_AVX512_TILE(GemmTileVnniT, "avx512f,avx512bw,avx512vnni", GEMMA4_DOT_VNNI)
GEMMA4_DEFINE_AVX512_TILE(GemmTileBwT, "avx512f,avx512bw", GEMMA4_DOT_BW)

using GemmTileFn = void (*)(const GemmProblem&, int64_t, int64_t, int64_t, int64_t, const int32_t*,
                            const float*, float*, int64_t, bool);
#define GEMMA4_BY_TILE(F) {&F<1>, &F<2>, &F<3>, &F<4>, &F<5>, &F<6>}

// The packed panel of one thread, reused across units (64-byte aligned for the vector loads).
struct PanelBuffer {
  std::vector<int32_t> wp;
  std::vector<float> sp;
  int32_t* Aligned(int64_t n) {
    wp.resize(size_t(n) + 16);
    const uintptr_t a = (reinterpret_cast<uintptr_t>(wp.data()) + 63) & ~uintptr_t(63);
    return reinterpret_cast<int32_t*>(a);
  }
};

void GemmPanel(const GemmProblem& p, const Weight& w, int64_t o0, int64_t isa) {
  static thread_local PanelBuffer buf;
  const int64_t k = p.k, flush = GemmFlush(w, k);
  int32_t* wp = buf.Aligned(k / 2 * kPanel);
  buf.sp.resize(size_t(k / flush) * kPanel);
  static thread_local std::vector<int8_t> unpacked;
  const int8_t* pq = w.panels ? Int8Panels(w, k, o0 / 16, 2, unpacked, isa == kAvx512Vnni || isa == kAvx512) : nullptr;
  if (isa == kAvx512Vnni || isa == kAvx512) {
    PackPairsAvx512(w, k, o0, pq, wp);
  } else {
    PackPairs(w, k, o0, pq, wp);
  }
  PackScales(w, k, o0, flush, buf.sp.data());
  static constexpr GemmTileFn vnni[kTile] = GEMMA4_BY_TILE(GemmTileVnniT);
  static constexpr GemmTileFn bw[kTile] = GEMMA4_BY_TILE(GemmTileBwT);
  // A block holds whole flushes: kKBlock inputs, or one group when groups are wider.
  const int64_t kblock = std::max(flush, kKBlock - kKBlock % flush);
  float* y = w.y + o0;
  for (int64_t k0 = 0; k0 < k; k0 += kblock) {
    const int64_t k1 = std::min(k, k0 + kblock);
    for (int64_t m0 = 0; m0 < p.m; m0 += kTile) {
      const int mr = int(std::min<int64_t>(kTile, p.m - m0));
      if (isa == kAvx512Vnni) {
        vnni[mr - 1](p, m0, k0, k1, flush, wp, buf.sp.data(), y, w.n, k0 == 0);
      } else if (isa == kAvx512) {
        bw[mr - 1](p, m0, k0, k1, flush, wp, buf.sp.data(), y, w.n, k0 == 0);
      } else {
        GemmTilePortable(p, mr, m0, k0, k1, flush, wp, buf.sp.data(), y, w.n, k0 == 0);
      }
    }
  }
  if (w.bits == 4) {
    for (int64_t panel = o0 / 16; panel < o0 / 16 + 2; ++panel) {
      SubtractMins(w, panel, p.xs.data(), p.sx.data(), 0, p.m, isa == kAvx512Vnni || isa == kAvx512);
    }
  }
}

// Rows m0..m1 of x → int16 with one scale per row (as QuantizeRows; the same values: the vector
// conversion rounds to nearest even, as nearbyint does in the default rounding mode).
__attribute__((target("avx512f,avx512bw"))) void GemmQuantizeRowsAvx512(const float* x, GemmProblem& p,
                                                                        int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * p.k;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t i = 0; i < p.k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xr + i)));
    const float amax = _mm512_reduce_max_ps(vmax);
    const float s = amax > 0.f ? amax / 32767.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / s);
    const __m512i lim = _mm512_set1_epi32(32767), neg = _mm512_set1_epi32(-32767);
    int16_t* out = p.xq.data() + m * p.k;
    for (int64_t i = 0; i < p.k; i += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + i), inv));
      v = _mm512_max_epi32(_mm512_min_epi32(v, lim), neg);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(v));
    }
    p.sx[m] = s;
  }
}

void GemmQuantizeRows(const float* x, GemmProblem& p, int64_t m0, int64_t m1, int64_t isa) {
  if (isa == kAvx512Vnni || isa == kAvx512) return GemmQuantizeRowsAvx512(x, p, m0, m1);
  for (int64_t m = m0; m < m1; ++m) p.sx[m] = QuantizeRow(x + m * p.k, p.k, p.xq.data() + m * p.k);
}

// Two phases shared by the caller and pool tasks (as Work): quantize row blocks, then — once every
// row is done — the units of work. Tasks only take what is left, so a late or busy pool never
// deadlocks. `Task` (GemmTask, PanelTask) holds the problem and says how to quantize rows
// [r0, r1) and run unit u of `units`. Used by the GEMM and the panel product.
template <class Task>
struct RowsThenUnits {
  Task task;
  int64_t rows_per_block = 64;
  std::atomic<int64_t> next_rows{0};
  std::atomic<int64_t> rows_done{0};
  std::atomic<size_t> next_unit{0};
  std::atomic<size_t> units_done{0};

  void Drain() {
    const int64_t m = task.problem.m;
    for (int64_t r0; (r0 = next_rows.fetch_add(rows_per_block)) < m;) {
      const int64_t r1 = std::min(m, r0 + rows_per_block);
      task.Quantize(r0, r1);
      rows_done.fetch_add(r1 - r0, std::memory_order_release);
    }
    while (rows_done.load(std::memory_order_acquire) < m) std::this_thread::yield();
    for (size_t u; (u = next_unit.fetch_add(1)) < task.units.size();) {
      task.Run(u);
      units_done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs `work` on the caller and up to threads - 1 pool tasks; returns once every unit is done.
template <class Task>
void RunOnPool(const std::shared_ptr<RowsThenUnits<Task>>& work, ffi::ThreadPool& pool, int64_t threads) {
  const int64_t helpers = std::min<int64_t>(threads, int64_t(work->task.units.size())) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->units_done.load(std::memory_order_acquire) < work->task.units.size()) std::this_thread::yield();
}

// The GEMMs' units, 32 output rows of each weight, run on the caller and the pool after the rows
// are quantized in blocks of at least `min_rows_per_block`.
template <class Task>
void RunByPanels(const std::shared_ptr<RowsThenUnits<Task>>& work, ffi::ThreadPool& pool, int64_t min_rows_per_block) {
  const auto& weights = work->task.problem.weights;
  for (size_t i = 0; i < weights.size(); ++i) {
    for (int64_t r = 0; r < weights[i].n; r += kPanel) work->task.units.emplace_back(int(i), r);
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->rows_per_block = std::max<int64_t>(min_rows_per_block, work->task.problem.m / (threads * 4) + 1);
  RunOnPool(work, pool, threads);
}

struct GemmTask {
  GemmProblem problem;
  const float* x = nullptr;
  int64_t isa = kPortable;
  std::vector<std::pair<int, int64_t>> units;  // (weight, first output row of a 32-row panel)

  void Quantize(int64_t r0, int64_t r1) {
    GemmQuantizeRows(x, problem, r0, r1, isa);
    for (int64_t m = r0; m < r1 && !problem.xs.empty(); ++m) {
      GroupSums(problem.xq.data() + m * problem.k, problem.k, problem.xs.data() + m * (problem.k / kQ4Group));
    }
  }
  void Run(size_t u) { GemmPanel(problem, problem.weights[units[u].first], units[u].second, isa); }
};

ffi::Error Int8GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa, bool panels) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be [M, K]");
  auto work = std::make_shared<RowsThenUnits<GemmTask>>();
  GemmProblem& p = work->task.problem;
  p.m = dims[0];
  p.k = dims[1];
  if (p.m < 1) return ffi::Error::InvalidArgument("x must have at least one row");
  if (p.k % 32) return ffi::Error::InvalidArgument("K must be a multiple of 32");
  if (isa == kAuto) isa = BestIsa();
  if (isa != kAvx512Vnni && isa != kAvx512) isa = kPortable;  // the GEMM has no AVX2 tile
  if (!Supports(isa)) return ffi::Error::InvalidArgument("requested instruction set not supported by this CPU");
  for (int64_t g : groups) {
    if (g < 0 || (g && (p.k % g || g > kFlush || g % 16))) {
      return ffi::Error::InvalidArgument("group must be 0 or a multiple of 16 up to 256 dividing K");
    }
  }
  if (auto err = ReadWeights(args, rets, groups, p.k, kPanel, p.weights, panels); err.failure()) return err;
  p.xq.resize(size_t(p.m) * p.k);
  p.sx.resize(size_t(p.m));
  if (AnyFourBit(p.weights)) p.xs.resize(size_t(p.m) * (p.k / kQ4Group));
  work->task.x = x.typed_data();
  work->task.isa = isa;
  RunByPanels(work, pool, 8);
  return ffi::Error::Success();
}

// ================================================================ panels: weights stored for VNNI
// The layouts above keep a weight's rows as stored ([N, K]), so the row kernel ends every output
// with a horizontal sum and flushes every activation row at every scale group (32 inputs for a GGUF
// Q8_0 table): at 8 rows the LM head took 21.7 ms where one row took 7.5 (2-core AMD EPYC Zen 4), and
// the GEMM repacks each weight on every call. Here a weight is stored once, at load, as panels of
// 16 output rows: qp[p, c, 2j + t] = q[16p + j, 2c + t] (32 bytes per input pair). One vector of
// a panel, sign-extended to int16 once, serves every activation row: one vpdpwssd with the row's
// broadcast input pair gives 16 outputs, and a flush (int32 → float32, × the scales) serves 16
// outputs. The activation is int16 per row as above (max |x| / 32767), stored pair-major
// (xt[c, m] = row m's pair c) so a block of rows reads its pairs at constant offsets. The integer
// sums per flush equal the row kernel's; only the float additions of the flushes differ in order.
constexpr int kPanelRows = 16;
constexpr int kPanelMaxRows = 8;  // activation rows per register block (one int32 + one float32 each)

struct PanelProblem {
  int64_t m = 0, k = 0;
  std::vector<int32_t> xt;  // [k / 2, m]: row m's int16 pair c as one int32
  std::vector<float> sx;    // [m]
  std::vector<float> xs;    // [m, k / 32]: x's sums per 32 inputs, where a weight is 4-bit (GroupSums)
  std::vector<Weight> weights;  // stored as panels: q [n / 16, k / 2, 32], grouped scales [n / 16, k / g, 16]
};

// Inputs per int32 flush: the group, or for per-row scales the largest power of two ≤ 256
// dividing K (a lane sums ≤ 256 products of |x| ≤ 32767 and |q| ≤ 127: < 2^31).
inline int64_t PanelFlush(const Weight& w, int64_t k) {
  if (w.group) return w.group;
  for (int64_t f = kFlush; f > 2; f /= 2) {
    if (k % f == 0) return f;
  }
  return 2;
}

// Activation rows m0..m1 → int16 (QuantizeRow) → pair-major xt.
void PanelQuantizeRows(const float* x, PanelProblem& p, int64_t m0, int64_t m1) {
  std::vector<int16_t> row(size_t(p.k));
  for (int64_t m = m0; m < m1; ++m) {
    p.sx[m] = QuantizeRow(x + m * p.k, p.k, row.data());
    if (!p.xs.empty()) GroupSums(row.data(), p.k, p.xs.data() + m * (p.k / kQ4Group));
    for (int64_t c = 0; c < p.k / 2; ++c) {
      int32_t pair;
      std::memcpy(&pair, row.data() + 2 * c, sizeof pair);
      p.xt[c * p.m + m] = pair;
    }
  }
}

// Rows m0..m0+mr of y for one panel, portable: the same integer sums per flush, in scalar code.
void PanelBlockPortable(const PanelProblem& p, const Weight& w, int64_t panel, int64_t m0, int mr) {
  const int64_t k = p.k, flush = PanelFlush(w, k), groups = w.group ? k / w.group : 0;
  static thread_local std::vector<int8_t> unpacked;
  const int8_t* qp = Int8Panels(w, k, panel, 1, unpacked);
  for (int mi = 0; mi < mr; ++mi) {
    const int64_t m = m0 + mi;
    for (int j = 0; j < kPanelRows; ++j) {
      float acc = 0.f;
      for (int64_t f0 = 0; f0 < k; f0 += flush) {
        int32_t sum = 0;
        for (int64_t c = f0 / 2; c < (f0 + flush) / 2; ++c) {
          const uint32_t pair = uint32_t(p.xt[c * p.m + m]);
          sum += int32_t(int16_t(pair & 0xffff)) * qp[c * 32 + 2 * j] + int32_t(int16_t(pair >> 16)) * qp[c * 32 + 2 * j + 1];
        }
        const float sc = w.group ? GroupScale(w, (panel * groups + f0 / w.group) * kPanelRows + j) : 1.f;
        acc += float(sum) * sc;
      }
      const float row_scale = w.group ? 1.f : w.scale[panel * kPanelRows + j];
      w.y[m * w.n + panel * kPanelRows + j] = acc * p.sx[m] * row_scale;
    }
  }
}

// BITS 8: int8 panels; BITS 5: 5-bit panels, each 40-byte block unpacked to two int16 vectors
// (nibbles zero-extended, 16 taken off where the mask says negative) for the same vpdpwssd; BITS 4:
// 4-bit panels, the same without the mask, each flush (one 32-input group) scaled by d·sc (the
// mins are taken off afterwards: SubtractMins).
template <int MR, int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void PanelBlockVnni(const PanelProblem& p, const Weight& w,
                                                                           int64_t panel, int64_t m0) {
  const int64_t k = p.k, flush = PanelFlush(w, k), groups = w.group ? k / w.group : 0, m = p.m;
  const int8_t* qp = w.q + panel * (k / 2) * 32;
  const uint8_t* q5 = reinterpret_cast<const uint8_t*>(w.q) + panel * (k / 4) * kPanel5Block;
  const float* sp = w.group && w.scale ? w.scale + panel * groups * kPanelRows : nullptr;
  const uint16_t* sph = w.group && w.scale_h ? w.scale_h + panel * groups * kPanelRows : nullptr;
  const int32_t* xt = p.xt.data() + m0;
  __m512 facc[MR];
  for (int i = 0; i < MR; ++i) facc[i] = _mm512_setzero_ps();
  // Few rows: U = 2 accumulator chains per row (even / odd pairs), so a decode row is not bound by
  // vpdpwssd's latency; many rows are bound by its throughput and have chains enough.
  constexpr int U = MR <= 4 ? 2 : 1;
  for (int64_t f0 = 0, fi = 0; f0 < k; f0 += flush, ++fi) {  // fi: the flush's index (its group where grouped)
    __m512i acc[U][MR];
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < MR; ++i) acc[u][i] = _mm512_setzero_si512();
    int64_t c = f0 / 2;
    const int64_t c1 = (f0 + flush) / 2;
    if constexpr (BITS == 4) {  // pairs 2b, 2b + 1 per 32-byte block
      const __m512i nibble = _mm512_set1_epi16(15);
      const uint8_t* q4 = reinterpret_cast<const uint8_t*>(w.q) + panel * (k / 4) * 32;
      for (int64_t b = f0 / 4; b < (f0 + flush) / 4; ++b) {
        const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4 + b * 32)));
        const __m512i w0 = _mm512_and_si512(t, nibble), w1 = _mm512_srli_epi16(t, 4);
        const int32_t* x0 = xt + 2 * b * m;
        for (int i = 0; i < MR; ++i) acc[0][i] = DpwssdPair(acc[0][i], w0, x0 + i);
        for (int i = 0; i < MR; ++i) acc[U - 1][i] = DpwssdPair(acc[U - 1][i], w1, x0 + m + i);
      }
    } else if constexpr (BITS == 5) {  // pairs 2b, 2b + 1 per block; a flush holds whole blocks (K, groups % 4 == 0)
      const __m512i nibble = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
      for (int64_t b = f0 / 4; b < (f0 + flush) / 4; ++b) {
        const uint8_t* blk = q5 + b * kPanel5Block;
        const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        uint64_t neg;
        std::memcpy(&neg, blk + 32, sizeof neg);
        const __m512i lo = _mm512_and_si512(t, nibble), hi = _mm512_srli_epi16(t, 4);
        const __m512i w0 = _mm512_mask_sub_epi16(lo, __mmask32(neg), lo, sixteen);
        const __m512i w1 = _mm512_mask_sub_epi16(hi, __mmask32(neg >> 32), hi, sixteen);
        const int32_t* x0 = xt + 2 * b * m;
        for (int i = 0; i < MR; ++i) acc[0][i] = DpwssdPair(acc[0][i], w0, x0 + i);
        for (int i = 0; i < MR; ++i) acc[U - 1][i] = DpwssdPair(acc[U - 1][i], w1, x0 + m + i);
      }
    } else {
      for (; c + U <= c1; c += U) {
        for (int u = 0; u < U; ++u) {
          const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + (c + u) * 32)));
          const int32_t* xc = xt + (c + u) * m;
          for (int i = 0; i < MR; ++i) acc[u][i] = DpwssdPair(acc[u][i], wv, xc + i);
        }
      }
      for (; c < c1; ++c) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + c * 32)));
        const int32_t* xc = xt + c * m;
        for (int i = 0; i < MR; ++i) acc[0][i] = DpwssdPair(acc[0][i], wv, xc + i);
      }
    }
    for (int u = 1; u < U; ++u)
      for (int i = 0; i < MR; ++i) acc[0][i] = _mm512_add_epi32(acc[0][i], acc[u][i]);
    __m512 sc;
    if constexpr (BITS == 4) {  // d · sc of this group for the panel's 16 rows; dmin · m times the group's sums off
      const uint8_t* sup = Q4Super(w, panel, fi);
      sc = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + 256))),
                         _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + (fi % 8) * 16)))));
      const __m512 mins = _mm512_mul_ps(
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + 288))),
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + 128 + (fi % 8) * 16)))));
      const float* xs = p.xs.data() + m0 * groups + fi;
      for (int i = 0; i < MR; ++i) facc[i] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(xs[i * groups]), facc[i]);
    } else {
      sc = sp    ? _mm512_loadu_ps(sp + fi * kPanelRows)
           : sph ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sph + fi * kPanelRows)))
                 : _mm512_set1_ps(1.f);
    }
    for (int i = 0; i < MR; ++i) facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0][i]), sc, facc[i]);
  }
  const __m512 row_scale = w.group ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(w.scale + panel * kPanelRows);
  for (int i = 0; i < MR; ++i) {
    const __m512 out = _mm512_mul_ps(_mm512_mul_ps(facc[i], _mm512_set1_ps(p.sx[m0 + i])), row_scale);
    _mm512_storeu_ps(w.y + (m0 + i) * w.n + panel * kPanelRows, out);
  }
}

using PanelBlockFn = void (*)(const PanelProblem&, const Weight&, int64_t, int64_t);
#define GEMMA4_BY_PANEL_ROWS(F, B) {&F<1, B>, &F<2, B>, &F<3, B>, &F<4, B>, &F<5, B>, &F<6, B>, &F<7, B>, &F<8, B>}

// Panels p0..p1 of one weight for every activation row: blocks of 8 rows in the outer loop, so the
// panels' weights (sized to stay in L2 by the caller) are reread from cache, not memory, per block.
void PanelRange(const PanelProblem& p, const Weight& w, int64_t p0, int64_t p1, bool vnni) {
  static constexpr PanelBlockFn fns8[kPanelMaxRows] = GEMMA4_BY_PANEL_ROWS(PanelBlockVnni, 8);
  static constexpr PanelBlockFn fns5[kPanelMaxRows] = GEMMA4_BY_PANEL_ROWS(PanelBlockVnni, 5);
  static constexpr PanelBlockFn fns4[kPanelMaxRows] = GEMMA4_BY_PANEL_ROWS(PanelBlockVnni, 4);
  const PanelBlockFn* fns = w.bits == 5 ? fns5 : w.bits == 4 ? fns4 : fns8;
  for (int64_t m0 = 0; m0 < p.m; m0 += kPanelMaxRows) {
    const int mr = int(std::min<int64_t>(kPanelMaxRows, p.m - m0));
    for (int64_t panel = p0; panel < p1; ++panel) {
      if (vnni) {
        fns[mr - 1](p, w, panel, m0);
      } else {
        PanelBlockPortable(p, w, panel, m0, mr);
      }
      if (w.bits == 4 && !vnni) SubtractMins(w, panel, p.xs.data(), p.sx.data(), m0, m0 + mr, false);
    }
  }
}

// The panel product's work for RowsThenUnits: units are panel ranges of one weight.
struct PanelTask {
  PanelProblem problem;
  const float* x = nullptr;
  bool vnni = false;
  std::vector<std::tuple<int, int64_t, int64_t>> units;  // (weight, first panel, end panel)

  void Quantize(int64_t r0, int64_t r1) { PanelQuantizeRows(x, problem, r0, r1); }
  void Run(size_t u) {
    const auto [wi, p0, p1] = units[u];
    PanelRange(problem, problem.weights[wi], p0, p1, vnni);
  }
};

ffi::Error Int8PanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be [M, K]");
  auto work = std::make_shared<RowsThenUnits<PanelTask>>();
  PanelProblem& p = work->task.problem;
  p.m = dims[0];
  p.k = dims[1];
  if (p.m < 1) return ffi::Error::InvalidArgument("x must have at least one row");
  if (p.k % 2) return ffi::Error::InvalidArgument("K must be even");
  if (isa == kAuto) isa = BestIsa();
  if (!Supports(isa)) return ffi::Error::InvalidArgument("requested instruction set not supported by this CPU");
  if (isa != kAvx512Vnni) isa = kPortable;  // the panel product has one vector loop (as the GEMM)
  for (int64_t g : groups) {
    if (g < 0 || (g && (p.k % g || g % 2 || g > kFlush))) {
      return ffi::Error::InvalidArgument("group must be 0 or an even number up to 256 dividing K");
    }
  }
  if (auto err = ReadWeights(args, rets, groups, p.k, kPanelRows, p.weights, true); err.failure()) return err;
  p.xt.resize(size_t(p.m) * (p.k / 2));
  p.sx.resize(size_t(p.m));
  if (AnyFourBit(p.weights)) p.xs.resize(size_t(p.m) * (p.k / kQ4Group));
  work->task.x = x.typed_data();
  work->task.vnni = isa == kAvx512Vnni;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Units: panel ranges of at most ~256 KB of weights (they stay in L2 across the row blocks), and
  // at least ~8 units per thread over all weights for balance.
  int64_t panels_total = 0;
  for (const auto& w : p.weights) panels_total += w.n / kPanelRows;
  const int64_t by_cache = std::max<int64_t>(1, (256 << 10) / (kPanelRows * p.k));
  const int64_t by_balance = std::max<int64_t>(1, panels_total / (threads * 8));
  const int64_t per_unit = std::min(by_cache, by_balance);
  for (size_t i = 0; i < p.weights.size(); ++i) {
    const int64_t np = p.weights[i].n / kPanelRows;
    for (int64_t p0 = 0; p0 < np; p0 += per_unit) work->task.units.emplace_back(int(i), p0, std::min(np, p0 + per_unit));
  }
  work->rows_per_block = std::max<int64_t>(1, p.m / (threads * 4) + 1);
  RunOnPool(work, pool, threads);
  return ffi::Error::Success();
}

ffi::Error Int8GemmRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa) {
  return Int8GemmImpl(pool, x, args, rets, groups, isa, false);
}

// The GEMM on weights stored as panels: its packing only sign-extends (the panels are pair-major).
ffi::Error Int8GemmPanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa) {
  return Int8GemmImpl(pool, x, args, rets, groups, isa, true);
}


// ================================================================ GEMM with int8 activations
// For prefill-sized products where the plan allows it (GEMMA4_INT8_ACTIVATIONS=int8; see
// gemma4.plan.cpu_tuning): the activations are quantized to int8 with one scale per block of 32
// inputs (as llama.cpp's Q8_0 activations; per-row int8 was 2e-2 … 2e-1 off with Gemma's outlier
// channels, a scale per 32 inputs keeps an outlier's coarseness to its own block), and each
// vpdpbusd sums four products per int32 lane where vpdpwssd sums two. vpdpbusd multiplies
// unsigned by signed bytes: the weights are packed as q + 128 (unsigned) and each accumulation
// starts at -128 · (sum of the block's quantized activations), which takes the offset out again,
// so the integer sums are exactly sum(q · xq). Flushes: every 32 inputs (16 for a weight with
// 16-input groups), scaled by the weight's scale times the activation block's.
constexpr int64_t kI8Block = 32;  // activation inputs per int8 scale
// Activation rows per register tile: 4 rows × 32 outputs keep 8 int32 and 8 float32 accumulators,
// the two weight vectors and the scales in registers; with 6 rows GCC 12 kept the float
// accumulators on the stack (measured: no faster than the int16 GEMM on a 2-core Intel Xeon).
constexpr int kI8Tile = 4;

struct GemmI8Problem {
  int64_t m = 0, k = 0;
  std::vector<int8_t> xq;     // [m, k]
  std::vector<float> sx;      // [m, k / 32]
  std::vector<int32_t> c16;   // [m, k / 16]: -128 · sum of xq over each 16 inputs
  std::vector<int32_t> c32;   // [m, k / 32]: the same over each 32
  std::vector<Weight> weights;
};

inline int64_t GemmI8Flush(const Weight& w) { return w.group == 16 ? 16 : kI8Block; }

// One row → int8 per block of 32 (scale max |x| / 127, round to nearest even) and the offsets.
void QuantizeRowI8(const float* xr, int64_t k, int8_t* out, float* s, int32_t* c16, int32_t* c32) {
  for (int64_t b = 0; b < k / kI8Block; ++b) {
    const float* xb = xr + b * kI8Block;
    float amax = 0.f;
    for (int i = 0; i < kI8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float sc = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / sc;
    int32_t half[2] = {0, 0};
    for (int i = 0; i < kI8Block; ++i) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * inv)));
      out[b * kI8Block + i] = int8_t(v);
      half[i / 16] += int32_t(v);
    }
    s[b] = sc;
    c16[2 * b] = -128 * half[0];
    c16[2 * b + 1] = -128 * half[1];
    c32[b] = c16[2 * b] + c16[2 * b + 1];
  }
}

// The same values with AVX-512 (cvtps rounds to nearest even, as nearbyint does by default).
__attribute__((target("avx512f,avx512bw"))) void QuantizeRowI8Avx512(const float* xr, int64_t k, int8_t* out,
                                                                     float* s, int32_t* c16, int32_t* c32) {
  const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
  for (int64_t b = 0; b < k / kI8Block; ++b) {
    const __m512 x0 = _mm512_loadu_ps(xr + b * kI8Block), x1 = _mm512_loadu_ps(xr + b * kI8Block + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float sc = amax > 0.f ? amax / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / sc);
    const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), lim), neg);
    const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)), lim), neg);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * kI8Block), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * kI8Block + 16), _mm512_cvtepi32_epi8(q1));
    s[b] = sc;
    c16[2 * b] = -128 * _mm512_reduce_add_epi32(q0);
    c16[2 * b + 1] = -128 * _mm512_reduce_add_epi32(q1);
    c32[b] = c16[2 * b] + c16[2 * b + 1];
  }
}

void GemmI8QuantizeRows(const float* x, GemmI8Problem& p, int64_t m0, int64_t m1, bool avx512) {
  const int64_t nb = p.k / kI8Block;
  for (int64_t m = m0; m < m1; ++m) {
    auto* fn = avx512 ? &QuantizeRowI8Avx512 : &QuantizeRowI8;
    fn(x + m * p.k, p.k, p.xq.data() + m * p.k, p.sx.data() + m * nb, p.c16.data() + m * 2 * nb, p.c32.data() + m * nb);
  }
}

// Panel o0..o0+kPanel of weight w as quads: wq[p * kPanel + j] = the bytes q[o0+j][4p..4p+3] + 128.
// A panels weight's two 16-row panels are read from `pq` (`Int8Panels`).
void PackQuads(const Weight& w, int64_t k, int64_t o0, const int8_t* pq, uint32_t* wq) {
  for (int j = 0; j < kPanel; ++j) {
    const int64_t r = o0 + j;
    for (int64_t p = 0; p < k / 4; ++p) {
      uint32_t v;
      if (w.panels) {  // pairs 2p and 2p + 1 of row r: bytes 2(r % 16), +1 of its 16-row panel (o0 % 32 == 0)
        const int8_t* panel = pq + (j / 16) * (k / 2) * 32 + 2 * (r % 16);
        uint16_t a, b;
        std::memcpy(&a, panel + (2 * p) * 32, 2);
        std::memcpy(&b, panel + (2 * p + 1) * 32, 2);
        v = uint32_t(a) | (uint32_t(b) << 16);
      } else {
        std::memcpy(&v, w.q + r * k + 4 * p, 4);
      }
      wq[p * kPanel + j] = v ^ 0x80808080u;  // int8 + 128 as unsigned bytes
    }
  }
}

// sp[f * kPanel + j] = the weight scale of flush f (of `flush` inputs) for row o0 + j.
void PackI8Scales(const Weight& w, int64_t k, int64_t o0, int64_t flush, float* sp) {
  const int64_t groups = w.group ? k / w.group : 0;
  for (int j = 0; j < kPanel; ++j) {
    const int64_t r = o0 + j;
    for (int64_t f = 0; f < k / flush; ++f) {
      const int64_t g = w.group ? f * flush / w.group : 0;
      if (!w.group) {
        sp[f * kPanel + j] = w.scale[r];
      } else if (w.panels) {
        sp[f * kPanel + j] = GroupScale(w, ((r / 16) * groups + g) * 16 + r % 16);
      } else {
        sp[f * kPanel + j] = w.scale[r * groups + g];
      }
    }
  }
}

// vpdpbusd (acc += four u8 × s8 products per lane) with the activation quad broadcast from memory.
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i Dpbusd(__m512i acc, __m512i w,
                                                                                  __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// Rows m0..m0+mr of y (+)= x[.., k0..k1] · panel, portable: the same integer sums per flush.
void GemmI8TilePortable(const GemmI8Problem& p, int mr, int64_t m0, int64_t k0, int64_t k1, int64_t flush,
                        const uint32_t* wq, const float* sp, float* y, int64_t ldy, bool first) {
  const int64_t nb = p.k / kI8Block;
  for (int mi = 0; mi < mr; ++mi) {
    const int64_t m = m0 + mi;
    const int8_t* xr = p.xq.data() + m * p.k;
    for (int j = 0; j < kPanel; ++j) {
      float acc = 0.f;
      for (int64_t a = k0; a < k1; a += flush) {
        int32_t s = flush == 16 ? p.c16[m * 2 * nb + a / 16] : p.c32[m * nb + a / 32];
        for (int64_t i = a; i < a + flush; ++i) {
          const uint8_t wu = uint8_t(wq[(i / 4) * kPanel + j] >> (8 * (i % 4)));
          s += int32_t(wu) * int32_t(xr[i]);
        }
        acc += float(s) * (sp[(a / flush) * kPanel + j] * p.sx[m * nb + a / kI8Block]);
      }
      float* out = y + m * ldy + j;
      *out = (first ? 0.f : *out) + acc;
    }
  }
}

template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void GemmI8TileVnni(
    const GemmI8Problem& p, int64_t m0, int64_t k0, int64_t k1, int64_t flush, const uint32_t* wq,
    const float* sp, float* y, int64_t ldy, bool first) {
  const int64_t nb = p.k / kI8Block;
  __m512 f0[MR], f1[MR];
  for (int i = 0; i < MR; ++i) f0[i] = f1[i] = _mm512_setzero_ps();
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = p.xq.data() + (m0 + i) * p.k;
  for (int64_t a = k0; a < k1; a += flush) {
    __m512i a0[MR], a1[MR];
    for (int i = 0; i < MR; ++i) {  // the offset of the u8 weights, taken out up front
      const int64_t m = m0 + i;
      a0[i] = a1[i] = _mm512_set1_epi32(flush == 16 ? p.c16[m * 2 * nb + a / 16] : p.c32[m * nb + a / 32]);
    }
    const uint32_t* w = wq + (a / 4) * kPanel;
    for (int64_t i4 = a; i4 < a + flush; i4 += 4, w += kPanel) {
      const __m512i w0 = _mm512_load_si512(w), w1 = _mm512_load_si512(w + 16);
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, xr[i] + i4, sizeof quad);
        const __m512i xb = _mm512_set1_epi32(quad);
        a0[i] = Dpbusd(a0[i], w0, xb);
        a1[i] = Dpbusd(a1[i], w1, xb);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(sp + (a / flush) * kPanel), s1 = _mm512_loadu_ps(sp + (a / flush) * kPanel + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 sx = _mm512_set1_ps(p.sx[(m0 + i) * nb + a / kI8Block]);
      f0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]), _mm512_mul_ps(s0, sx), f0[i]);
      f1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]), _mm512_mul_ps(s1, sx), f1[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* out = y + (m0 + i) * ldy;
    if (first) {
      _mm512_storeu_ps(out, f0[i]);
      _mm512_storeu_ps(out + 16, f1[i]);
    } else {
      _mm512_storeu_ps(out, _mm512_add_ps(f0[i], _mm512_loadu_ps(out)));
      _mm512_storeu_ps(out + 16, _mm512_add_ps(f1[i], _mm512_loadu_ps(out + 16)));
    }
  }
}

using GemmI8TileFn = void (*)(const GemmI8Problem&, int64_t, int64_t, int64_t, int64_t, const uint32_t*,
                              const float*, float*, int64_t, bool);

void GemmI8Panel(const GemmI8Problem& p, const Weight& w, int64_t o0, bool vnni) {
  static thread_local PanelBuffer buf;
  const int64_t k = p.k, flush = GemmI8Flush(w);
  uint32_t* wq = reinterpret_cast<uint32_t*>(buf.Aligned(k / 4 * kPanel));
  buf.sp.resize(size_t(k / flush) * kPanel);
  static thread_local std::vector<int8_t> unpacked;
  PackQuads(w, k, o0, w.panels ? Int8Panels(w, k, o0 / 16, 2, unpacked, vnni) : nullptr, wq);
  PackI8Scales(w, k, o0, flush, buf.sp.data());
  static constexpr GemmI8TileFn tiles[kI8Tile] = {&GemmI8TileVnni<1>, &GemmI8TileVnni<2>, &GemmI8TileVnni<3>,
                                                    &GemmI8TileVnni<4>};
  // A tile runs the whole of K: the packed panel (K · 32 bytes, 20 KB for K = 640) is read from L1
  // or L2 by every tile, and a tile's accumulators are set up and stored once.
  float* y = w.y + o0;
  for (int64_t m0 = 0; m0 < p.m; m0 += kI8Tile) {
    const int mr = int(std::min<int64_t>(kI8Tile, p.m - m0));
    if (vnni) {
      tiles[mr - 1](p, m0, 0, k, flush, wq, buf.sp.data(), y, w.n, true);
    } else {
      GemmI8TilePortable(p, mr, m0, 0, k, flush, wq, buf.sp.data(), y, w.n, true);
    }
  }
}

struct GemmI8Task {
  GemmI8Problem problem;
  const float* x = nullptr;
  bool vnni = false, avx512 = false;
  std::vector<std::pair<int, int64_t>> units;  // (weight, first output row of a 32-row panel)

  void Quantize(int64_t r0, int64_t r1) { GemmI8QuantizeRows(x, problem, r0, r1, avx512); }
  void Run(size_t u) { GemmI8Panel(problem, problem.weights[units[u].first], units[u].second, vnni); }
};

ffi::Error Int8GemmI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa, bool panels) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be [M, K]");
  auto work = std::make_shared<RowsThenUnits<GemmI8Task>>();
  GemmI8Problem& p = work->task.problem;
  p.m = dims[0];
  p.k = dims[1];
  if (p.m < 1) return ffi::Error::InvalidArgument("x must have at least one row");
  if (p.k % kI8Block) return ffi::Error::InvalidArgument("K must be a multiple of 32");
  if (isa == kAuto) isa = BestIsa();
  if (!Supports(isa)) return ffi::Error::InvalidArgument("requested instruction set not supported by this CPU");
  for (int64_t g : groups) {
    if (g < 0 || (g && (p.k % g || g > kFlush || (g != 16 && g % kI8Block)))) {
      return ffi::Error::InvalidArgument("group must be 0, 16 or a multiple of 32 up to 256 dividing K");
    }
  }
  if (auto err = ReadWeights(args, rets, groups, p.k, kPanel, p.weights, panels); err.failure()) return err;
  if (AnyFourBit(p.weights)) return ffi::Error::InvalidArgument("4-bit panels run in the int16 products only");
  const int64_t nb = p.k / kI8Block;
  p.xq.resize(size_t(p.m) * p.k);
  p.sx.resize(size_t(p.m) * nb);
  p.c16.resize(size_t(p.m) * nb * 2);
  p.c32.resize(size_t(p.m) * nb);
  work->task.x = x.typed_data();
  work->task.vnni = isa == kAvx512Vnni;
  work->task.avx512 = isa == kAvx512Vnni || isa == kAvx512;
  RunByPanels(work, pool, 1);
  return ffi::Error::Success();
}

ffi::Error Int8GemmI8RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa) {
  return Int8GemmI8Impl(pool, x, args, rets, groups, isa, false);
}

ffi::Error Int8GemmI8PanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, ffi::Span<const int64_t> groups, int64_t isa) {
  return Int8GemmI8Impl(pool, x, args, rets, groups, isa, true);
}

}  // namespace

// Both handlers take the same operands: x, then (q, scale) per weight; one output per weight.
#define GEMMA4_INT8_BINDING                                                                        \
  ffi::Ffi::Bind()                                                                                 \
      .Ctx<ffi::ThreadPool>()                                                                      \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                \
      .RemainingArgs()                                                                             \
      .RemainingRets()                                                                             \
      .Attr<ffi::Span<const int64_t>>("groups")                                                    \
      .Attr<int64_t>("isa")

XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Int8Matmul, Int8MatmulImpl, GEMMA4_INT8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Int8Gemm, Int8GemmRowsImpl, GEMMA4_INT8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Int8GemmPanels, Int8GemmPanelsImpl, GEMMA4_INT8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Int8Panels, Int8PanelsImpl, GEMMA4_INT8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Int8GemmI8, Int8GemmI8RowsImpl, GEMMA4_INT8_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4Int8GemmI8Panels, Int8GemmI8PanelsImpl, GEMMA4_INT8_BINDING);

extern "C" int64_t gemma4_int8_best_isa() { return BestIsa(); }
extern "C" int64_t gemma4_int8_isa_supported(int64_t isa) { return Supports(isa) ? 1 : 0; }
