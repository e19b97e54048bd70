// How many of each vector instruction one thread of this CPU retires per second, in registers
// only (no memory): the ceiling a compute-bound kernel can reach. Built and run by
// bench/instruction_peak.py, which also runs one copy per core at once.
//
//   instruction_peak <seconds per instruction>  → one line per instruction: name, G instructions/s
//
// Twelve independent accumulator chains per instruction, so latency does not bound the loop (with
// eight, the ymm forms measured at two thirds of their rate on an AMD EPYC Zen 4), and few enough
// for AVX2's 16 registers with the two inputs. Each product is inline assembly with its
// accumulator in place (GCC 12 copies intrinsics' accumulators around every instruction in such
// loops). An instruction the CPU lacks prints "-".

#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kChains = 12;
constexpr int64_t kBatch = 1 << 20;  // loop iterations between clock reads

#define GEMMA4_PEAK_LOOP(NAME, TARGET, TYPE, INIT, ASM)                                      \
  __attribute__((target(TARGET))) double NAME(double seconds) {                              \
    TYPE acc[kChains];                                                                       \
    for (int i = 0; i < kChains; ++i) acc[i] = INIT;                                         \
    const TYPE a = INIT, b = INIT;                                                           \
    int64_t done = 0;                                                                        \
    const auto t0 = std::chrono::steady_clock::now();                                        \
    double elapsed = 0;                                                                      \
    while (elapsed < seconds) {                                                              \
      for (int64_t t = 0; t < kBatch; ++t) {                                                 \
        for (int i = 0; i < kChains; ++i) asm volatile(ASM : "+v"(acc[i]) : "v"(a), "v"(b)); \
      }                                                                                      \
      done += kBatch * kChains;                                                              \
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); \
    }                                                                                        \
    volatile TYPE sink = acc[0];                                                             \
    (void)sink;                                                                              \
    return done / elapsed / 1e9;                                                             \
  }

GEMMA4_PEAK_LOOP(Fma512, "avx512f", __m512, _mm512_set1_ps(1.0f), "vfmadd231ps %2, %1, %0")
GEMMA4_PEAK_LOOP(Fma256, "avx2,fma", __m256, _mm256_set1_ps(1.0f), "vfmadd231ps %2, %1, %0")
GEMMA4_PEAK_LOOP(Dpwssd512, "avx512f,avx512vnni", __m512i, _mm512_set1_epi32(1), "vpdpwssd %2, %1, %0")
GEMMA4_PEAK_LOOP(Dpbusd512, "avx512f,avx512vnni", __m512i, _mm512_set1_epi32(1), "vpdpbusd %2, %1, %0")
GEMMA4_PEAK_LOOP(Dpbf16512, "avx512f,avx512bf16", __m512, _mm512_set1_ps(1.0f), "vdpbf16ps %2, %1, %0")
GEMMA4_PEAK_LOOP(Madd256, "avx2", __m256i, _mm256_set1_epi32(1), "vpmaddwd %2, %1, %0")

struct Case {
  const char* name;
  bool supported;  // by this CPU (__builtin_cpu_supports takes literals only)
  double (*run)(double);
};

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f"), vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  const Case cases[] = {
      {"vfmadd231ps-zmm", avx512, Fma512},
      {"vfmadd231ps-ymm", __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), Fma256},
      {"vpdpwssd-zmm", vnni, Dpwssd512},
      {"vpdpbusd-zmm", vnni, Dpbusd512},
      {"vdpbf16ps-zmm", avx512 && __builtin_cpu_supports("avx512bf16"), Dpbf16512},
      {"vpmaddwd-ymm", __builtin_cpu_supports("avx2") != 0, Madd256},
  };
  for (const Case& c : cases) {
    if (c.supported) {
      std::printf("%s %.3f\n", c.name, c.run(seconds));
    } else {
      std::printf("%s -\n", c.name);
    }
    std::fflush(stdout);
  }
  return 0;
}
