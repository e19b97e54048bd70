// Attention of a few queries over a KV cache, read in place, on x86 CPUs, called from inside
// `jax.jit` through XLA's FFI (gemma4/ops/kernels/cpu_attention.py).
//
// Why: a decode step's attention in XLA:CPU first materializes what it reads. Slicing a cache
// row's first `slots` slots and transposing K for the score product copied ~2 x 4 MiB per full
// layer of the bundled model at 4,096 slots: a third of a decode step (8-10 ms of 25-29 ms on a
// 2-core AMD EPYC Zen 4, bench/step_profile.py). This kernel streams each row's K and V once,
// straight from the cache buffer.
//
//   out[b, t, j, :] = sum_s p[s] v[row_b, s, j / g, :],   p = softmax_s(scale * q[b, t, j] . k[row_b, s, j / g])
//
// over the slots s < `slots` whose position kp is visible from the query's position qp:
// kp >= 0, kp <= qp and (window == 0 or qp - kp < window) — gemma4.model.decoder.attention_mask.
// A query that sees nothing (padding, qp = -1) gets zeros. Softmax is the running (online) form
// over blocks of kBlock slots; a row's slots may be split in parts over threads, whose partial
// (max, sum, weighted values) are combined at the end (split-K, as flash-decoding does), so a
// single decode row uses every thread XLA's pool lends.
//
// The loops are plain C++ over fixed 16-float lanes; each is compiled for AVX-512, AVX2+FMA and a
// portable baseline and chosen at run time. With AVX-512, a block of slots that a query sees whole
// (the usual case: a conversation's filled cache) runs as register tiles for it: scores 4 queries
// x 4 slots (each key read once for 4 queries, the 16 dots summed across lanes together), values
// 4 queries x 64 outputs kept in registers over the block. On a 2-core AMD EPYC Zen 4, one thread:
// a 16-token chunk over 4,096 slots 15.6-16.0 ms → 7.9-9.8 ms, a decode row 0.76-0.83 → 0.41-0.57 ms.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;      // slots per online-softmax step
constexpr int64_t kLane = 16;       // floats per inner vector step (one zmm)
constexpr int64_t kMinPart = 512;   // slots per thread part at least (below, splitting costs more than it saves)

struct Problem {
  const float* q;       // [B, T, nq, d]
  const int32_t* qpos;  // [B, T]
  const float* k;       // [R, S, nkv, d]
  const float* v;
  const int32_t* kpos;  // [R, S]
  const int32_t* rows;  // [B]
  float* out;           // [B, T, nq, d]
  int64_t b, t, nq, nkv, d, r, s, slots, window;
  float scale;
  int64_t g() const { return nq / nkv; }
  int64_t queries() const { return t * g(); }  // queries of one (row, kv head)
};

// One (batch row, kv head, slot part): its queries' running max, sum and weighted values.
struct Partial {
  std::vector<float> m, l, o;  // [n], [n], [n, d]
};

// exp(x) for x <= 0 (scores minus their running max), vectorizable: 2^(x log2 e) split into an
// integer power and a degree-6 polynomial on [-0.5, 0.5] (relative error ~2e-7); inputs below -87
// give 0. Inlined into each instruction set's part function, so it is compiled for that set.
inline __attribute__((always_inline)) void ExpInPlace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float t = std::max(x[i], -87.0f) * 1.44269504088896341f;
    const float fi = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
    const float f = t - fi;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180300e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    std::memcpy(&bits, &p, 4);
    bits += static_cast<int32_t>(fi) * (1 << 23);
    float r;
    std::memcpy(&r, &bits, 4);
    x[i] = x[i] < -87.0f ? 0.0f : r;
  }
}

inline __attribute__((always_inline)) float Dot(const float* a, const float* b, int64_t d) {
  float acc[kLane] = {0};
  for (int64_t c = 0; c < d; c += kLane) {
    for (int64_t l = 0; l < kLane; ++l) acc[l] += a[c + l] * b[c + l];
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLane; ++l) sum += acc[l];
  return sum;
}

inline __attribute__((always_inline)) void Axpy(float w, const float* x, float* y, int64_t d) {
  for (int64_t c = 0; c < d; c += kLane) {
    for (int64_t l = 0; l < kLane; ++l) y[c + l] += w * x[c + l];
  }
}

inline __attribute__((always_inline)) bool Visible(int32_t kp, int32_t qp, int64_t window) {
  return kp >= 0 && kp <= qp && (window == 0 || qp - kp < window);
}

// A tile of scores: kQt = 4 queries x kSt = 4 slots, each a dot product of d floats. The 16
// accumulators are summed across their lanes together (a transpose-and-add tree, 15 adds for 16
// dots) rather than one horizontal sum per dot, and each slot's keys serve the tile's 4 queries.
constexpr int kQt = 4;  // queries per score / value tile
constexpr int kSt = 4;  // slots per score tile

__attribute__((target("avx512f"))) inline __m512 SumLanes16(const __m512 (&a)[16]) {
  __m512 r[8], t[4], u[2];
  for (int i = 0; i < 8; ++i) {  // lanes per 128-bit part: [a0+a2, b0+b2, a1+a3, b1+b3]
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit part: the part's sums of four vectors
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44), _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {  // across the 128-bit parts, two steps: lane 4m + j = vector 4m + j's sum
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

// Scores of queries qs[0..4) against slots k[0..4) (rows `stride` floats apart) into sc (row i at
// sc + i * ld), times scale.
__attribute__((target("avx512f"))) inline void ScoreTile(const float* const* qs, const float* k, int64_t stride,
                                                       int64_t d, float scale, float* sc, int64_t ld) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += kLane) {
    __m512 kv[kSt];
    for (int s = 0; s < kSt; ++s) kv[s] = _mm512_loadu_ps(k + s * stride + c);
    for (int i = 0; i < kQt; ++i) {
      const __m512 qv = _mm512_loadu_ps(qs[i] + c);
      for (int s = 0; s < kSt; ++s) acc[i * kSt + s] = _mm512_fmadd_ps(qv, kv[s], acc[i * kSt + s]);
    }
  }
  const __m512 sums = _mm512_mul_ps(SumLanes16(acc), _mm512_set1_ps(scale));
  alignas(64) float out[16];
  _mm512_store_ps(out, sums);
  for (int i = 0; i < kQt; ++i) std::memcpy(sc + i * ld, out + i * kSt, kSt * sizeof(float));
}

// o[i][c0..c0 + 16 W) += sum_j p[i * ld + j] v[j][c0..] for 4 queries over nb slots, 4 x W
// accumulators in registers for the whole pass over the block's values. Only for blocks whose
// every slot some query sees (written, so finite): a weight of 0 then adds exactly 0.
template <int W>
__attribute__((target("avx512f"))) inline void ValueChunk(const float* p, int64_t ld, const float* v, int64_t stride,
                                                        int64_t nb, int64_t c0, float* const* o) {
  __m512 acc[kQt][W];
  for (int i = 0; i < kQt; ++i)
    for (int t = 0; t < W; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    __m512 vv[W];
    for (int t = 0; t < W; ++t) vv[t] = _mm512_loadu_ps(v + j * stride + c0 + t * kLane);
    for (int i = 0; i < kQt; ++i) {
      const __m512 pb = _mm512_set1_ps(p[i * ld + j]);
      for (int t = 0; t < W; ++t) acc[i][t] = _mm512_fmadd_ps(pb, vv[t], acc[i][t]);
    }
  }
  for (int i = 0; i < kQt; ++i) {
    for (int t = 0; t < W; ++t) {
      float* oi = o[i] + c0 + t * kLane;
      _mm512_storeu_ps(oi, _mm512_add_ps(_mm512_loadu_ps(oi), acc[i][t]));
    }
  }
}

// The weighted values of 4 queries, d outputs each: 64 at a time, then 16.
__attribute__((target("avx512f"))) inline void ValueTile(const float* p, int64_t ld, const float* v, int64_t stride,
                                                       int64_t nb, int64_t d, float* const* o) {
  int64_t c0 = 0;
  for (; c0 + 4 * kLane <= d; c0 += 4 * kLane) ValueChunk<4>(p, ld, v, stride, nb, c0, o);
  for (; c0 < d; c0 += kLane) ValueChunk<1>(p, ld, v, stride, nb, c0, o);
}

// One part: slots [s0, s1) of the cache row of batch row bi, kv head h, for its n = t * g queries
// (query i: token i / g, head h * g + i % g), into `part`. kTiles: the AVX-512 score and value
// tiles above serve each query that sees a block whole (else the per-dot loops). The choice is
// the query's own: a query's result depends on its position and the cache alone, never on the
// other queries of the call — so each token of a multi-token call (speculative decoding's verify
// step) gets the bits a one-token call gives it (a tile's 16 dots share one summation tree, and
// its value rows accumulate apart).
template <bool kTiles>
inline __attribute__((always_inline)) void Part(const Problem& p, int64_t bi, int64_t h, int64_t s0, int64_t s1,
                                                Partial& part) {
  const int64_t g = p.g(), n = p.queries(), d = p.d;
  const int64_t row = p.rows[bi];
  const int64_t stride = p.nkv * d;
  const float* kbase = p.k + row * p.s * stride + h * d;
  const float* vbase = p.v + row * p.s * stride + h * d;
  const int32_t* kpos = p.kpos + row * p.s;
  const int64_t n4 = (n + kQt - 1) / kQt * kQt;  // queries padded to whole tiles (the last repeated)
  std::vector<const float*> qs(n4);
  std::vector<int32_t> qp(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = i / g, head = h * g + i % g;
    qs[i] = p.q + ((bi * p.t + tok) * p.nq + head) * d;
    qp[i] = p.qpos[bi * p.t + tok];
  }
  for (int64_t i = n; i < n4; ++i) qs[i] = qs[n - 1];
  part.m.assign(n, -INFINITY);
  part.l.assign(n, 0.0f);
  part.o.assign(n4 * d, 0.0f);
  std::vector<float> sc(n4 * kBlock), tile_w(kQt * kBlock), spare(d);
  std::vector<uint8_t> vis(n * kBlock), tiled(n4);
  for (int64_t b0 = s0; b0 < s1; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, s1 - b0);
    // which (query, slot) pairs are visible: none (an empty or future block costs no product), or
    // for a query all of the block (its tiles) or some of it (the per-dot loops)
    bool any = false, any_tiled = false;
    for (int64_t i = 0; i < n; ++i) {
      int64_t seen = 0;
      for (int64_t j = 0; j < nb; ++j) seen += vis[i * kBlock + j] = Visible(kpos[b0 + j], qp[i], p.window);
      any |= seen > 0;
      tiled[i] = kTiles && nb % kSt == 0 && seen == nb;
      any_tiled |= tiled[i];
    }
    if (!any) continue;
    for (int64_t i = n; i < n4; ++i) tiled[i] = 0;  // padding rows: weights 0, outputs never read
    if constexpr (kTiles) {
      if (any_tiled) {
        for (int64_t j = 0; j < nb; j += kSt) {
          for (int64_t i = 0; i < n4; i += kQt) {
            if (tiled[i] | tiled[i + 1] | tiled[i + 2] | tiled[i + 3]) {
              ScoreTile(&qs[i], kbase + (b0 + j) * stride, stride, d, p.scale, &sc[i * kBlock + j], kBlock);
            }
          }
        }
      }
    }
    // the other queries' scores: query i against slot j, -inf where not visible (an empty slot
    // costs no product)
    for (int64_t j = 0; j < nb; ++j) {
      const float* kr = kbase + (b0 + j) * stride;
      for (int64_t i = 0; i < n; ++i) {
        if (!tiled[i]) sc[i * kBlock + j] = vis[i * kBlock + j] ? Dot(qs[i], kr, d) * p.scale : -INFINITY;
      }
    }
    // online softmax: rescale what was summed so far; the weights exp(score - max) in sc
    for (int64_t i = 0; i < n; ++i) {
      float* si = &sc[i * kBlock];
      float bm = -INFINITY;
      for (int64_t j = 0; j < nb; ++j) bm = std::max(bm, si[j]);
      if (bm == -INFINITY) {
        std::fill(si, si + nb, 0.0f);
        continue;
      }
      const float m_new = std::max(part.m[i], bm);
      float* oi = &part.o[i * d];
      if (part.m[i] != -INFINITY && part.m[i] != m_new) {
        float f = part.m[i] - m_new;
        ExpInPlace(&f, 1);
        part.l[i] *= f;
        for (int64_t c = 0; c < d; ++c) oi[c] *= f;
      }
      part.m[i] = m_new;
      for (int64_t j = 0; j < nb; ++j) si[j] = si[j] - m_new;  // -inf stays -inf: exp gives 0
      ExpInPlace(si, nb);
      float l = 0.0f;
      for (int64_t j = 0; j < nb; ++j) l += si[j];
      part.l[i] += l;
    }
    // the weighted values: a tile's rows of queries it does not serve weigh 0 into a spare output
    // (the block is one some query sees whole, so written and finite: 0 adds exactly 0); a query
    // not tiled skips its weights of 0, so a slot never written (whatever it holds) adds nothing
    if constexpr (kTiles) {
      if (any_tiled) {
        for (int64_t i = 0; i < n4; i += kQt) {
          const int served = tiled[i] + tiled[i + 1] + tiled[i + 2] + tiled[i + 3];
          if (!served) continue;
          float* os[kQt];
          for (int t = 0; t < kQt; ++t) os[t] = tiled[i + t] ? &part.o[(i + t) * d] : spare.data();
          if (served == kQt) {
            ValueTile(&sc[i * kBlock], kBlock, vbase + b0 * stride, stride, nb, d, os);
            continue;
          }
          for (int t = 0; t < kQt; ++t) {
            float* w = &tile_w[t * kBlock];
            if (tiled[i + t]) std::copy(&sc[(i + t) * kBlock], &sc[(i + t) * kBlock] + nb, w);
            else std::fill(w, w + nb, 0.0f);
          }
          ValueTile(tile_w.data(), kBlock, vbase + b0 * stride, stride, nb, d, os);
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (tiled[i]) continue;
      const float* si = &sc[i * kBlock];
      float* oi = &part.o[i * d];
      for (int64_t j = 0; j < nb; ++j) {
        if (si[j] != 0.0f) Axpy(si[j], vbase + (b0 + j) * stride, oi, d);
      }
    }
  }
}

__attribute__((target("avx512f"))) void PartAvx512(const Problem& p, int64_t bi, int64_t h, int64_t s0, int64_t s1,
                                                   Partial& part) {
  Part<true>(p, bi, h, s0, s1, part);
}
__attribute__((target("avx512f"))) void PartAvx512Plain(const Problem& p, int64_t bi, int64_t h, int64_t s0,
                                                        int64_t s1, Partial& part) {
  Part<false>(p, bi, h, s0, s1, part);
}
__attribute__((target("avx2,fma"))) void PartAvx2(const Problem& p, int64_t bi, int64_t h, int64_t s0, int64_t s1,
                                                  Partial& part) {
  Part<false>(p, bi, h, s0, s1, part);
}
void PartPortable(const Problem& p, int64_t bi, int64_t h, int64_t s0, int64_t s1, Partial& part) {
  Part<false>(p, bi, h, s0, s1, part);
}

using PartFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, Partial&);

PartFn BestPart(bool tiles) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return tiles ? PartAvx512 : PartAvx512Plain;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PartAvx2;
  return PartPortable;
}

// The units of one call, handed out through an atomic counter to the caller and XLA's pool (a busy
// pool can delay but never deadlock a call).
struct Work {
  Problem p;
  PartFn fn;
  int64_t parts, part_slots;
  std::vector<Partial> partials;  // [b, h, part]
  std::atomic<int64_t> next{0}, done{0};

  int64_t units() const { return p.b * p.nkv * parts; }
  void Drain() {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units();) {
      const int64_t part = u % parts, h = (u / parts) % p.nkv, bi = u / (parts * p.nkv);
      const int64_t s0 = part * part_slots, s1 = std::min(p.slots, s0 + part_slots);
      fn(p, bi, h, s0, s1, partials[u]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Combine the parts of each (row, kv head) into the output: weights exp(m_part - m_max).
void Combine(Work& w) {
  const Problem& p = w.p;
  const int64_t g = p.g(), n = p.queries(), d = p.d;
  for (int64_t bi = 0; bi < p.b; ++bi) {
    for (int64_t h = 0; h < p.nkv; ++h) {
      const Partial* parts = &w.partials[(bi * p.nkv + h) * w.parts];
      for (int64_t i = 0; i < n; ++i) {
        float* out = p.out + ((bi * p.t + i / g) * p.nq + h * g + i % g) * d;
        float m = -INFINITY;
        for (int64_t k = 0; k < w.parts; ++k) {
          if (!parts[k].m.empty()) m = std::max(m, parts[k].m[i]);
        }
        std::fill(out, out + d, 0.0f);
        if (m == -INFINITY) continue;  // nothing visible: zeros
        float l = 0.0f;
        for (int64_t k = 0; k < w.parts; ++k) {
          if (parts[k].m.empty() || parts[k].m[i] == -INFINITY) continue;
          const float f = std::exp(parts[k].m[i] - m);
          l += f * parts[k].l[i];
          const float* o = &parts[k].o[i * d];
          for (int64_t c = 0; c < d; ++c) out[c] += f * o[c];
        }
        const float inv = 1.0f / l;
        for (int64_t c = 0; c < d; ++c) out[c] *= inv;
      }
    }
  }
}

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> qpos,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> kpos,
                              ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out, int64_t slots,
                              int64_t window, float scale, int64_t threads_cap, int64_t tiles) {
  // k and v [..., R, S, nkv, d], positions [..., R, S]: leading dims (the layers of a stacked cache,
  // gemma4/model/kv_cache.py) are folded into the rows, which `rows` then index (layer * R + row).
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = kpos.dimensions();
  if (qd.size() != 4 || kd.size() < 4 || pd.size() != kd.size() - 2) {
    return ffi::Error::InvalidArgument("q must be 4-d, k at least 4-d and the positions k's dims but the last two");
  }
  auto work = std::make_shared<Work>();
  Problem& p = work->p;
  const size_t n = kd.size();
  p.b = qd[0], p.t = qd[1], p.nq = qd[2], p.d = qd[3];
  p.r = 1;
  for (size_t i = 0; i + 3 < n; ++i) p.r *= kd[i];
  p.s = kd[n - 3], p.nkv = kd[n - 2];
  if (kd[n - 1] != p.d || p.nkv < 1 || p.nq % p.nkv || p.d % kLane) {
    return ffi::Error::InvalidArgument("head dims must match, nq divide by nkv and d by 16");
  }
  const auto vd = v.dimensions();
  const bool v_ok = vd.size() == n && std::equal(vd.begin(), vd.end(), kd.begin());
  const bool pos_ok = std::equal(pd.begin(), pd.end(), kd.begin());
  if (!v_ok || !pos_ok || rows.dimensions().size() != 1 || rows.dimensions()[0] != p.b) {
    return ffi::Error::InvalidArgument("v, k positions or rows do not match the cache");
  }
  if (slots < 1 || slots > p.s) return ffi::Error::InvalidArgument("slots must be 1..S");
  p.q = q.typed_data(), p.qpos = qpos.typed_data(), p.k = k.typed_data(), p.v = v.typed_data();
  p.kpos = kpos.typed_data(), p.rows = rows.typed_data(), p.out = out->typed_data();
  p.slots = slots, p.window = window, p.scale = scale;
  for (int64_t bi = 0; bi < p.b; ++bi) {
    if (p.rows[bi] < 0 || p.rows[bi] >= p.r) return ffi::Error::InvalidArgument("a cache row is out of range");
  }
  work->fn = BestPart(tiles != 0);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads_cap > 0) threads = std::min(threads, threads_cap);
  // Split a row's slots only where there are fewer (row, head) units than threads.
  const int64_t items = p.b * p.nkv;
  work->parts = std::max<int64_t>(1, std::min((threads + items - 1) / items, (slots + kMinPart - 1) / kMinPart));
  work->part_slots = (slots + work->parts - 1) / work->parts;
  work->partials.resize(work->units());
  const int64_t helpers = std::min<int64_t>(threads, work->units()) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->units()) std::this_thread::yield();
  Combine(*work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Gemma4CacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, T, nq, d]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query positions [B, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k cache [..., R, S, nkv, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v cache [..., R, S, nkv, d]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot positions [..., R, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cache row of each query row [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [B, T, nq, d]
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("tiles"));  // 0: the plain per-dot loops only (tests)
