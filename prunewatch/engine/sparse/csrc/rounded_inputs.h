// Decode inputs rounded to int16, one scale per group of 32, for the integer dense products (int4_dense.cpp,
// int8_dense.cpp).
//
// Why int16 and not llama.cpp's int8 (one `maddubs` per 32 weights instead of two `madd` per 16): a group's
// largest input sets its step, and LLM activations have outlier channels, so at 8 bits the other inputs of an
// outlier's group lose most of their precision. On SmolLM2-135M's 63 held-out prompts int4 dense agreed with fp32
// dense on 0.989 of the tokens with int16 inputs (bench/results/precision-cpu.json) and 0.961 with int8 ones
// (bench/results/precision-cpu-int4-int8-inputs.json), under the quality floor, for no measurable gain in a whole
// decode step. At 16 bits a step is 1/65534 of the group's largest input, far below the weights' own rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace prunewatch {
namespace rounded_inputs {

constexpr int64_t kGroup = 32;  // inputs per input scale
constexpr float kLevels = 32767.0f;  // int16 inputs: -32767..32767

// Input of the rounded order at position j: 0-7, 16-23, then 8-15, 24-31 (a 128-bit lane each), the order in
// which int4's nibbles unpack; int8 weights are laid out in it too (quantize.pack_int8_by_output).
inline int64_t position(int64_t j) { return (j % 16 < 8 ? 0 : 16) + (j < 16 ? 0 : 8) + j % 8; }

// One row's group of 32 inputs rounded: q gets them in the rounded order, dx the scale, sx the exact sum.
inline void round_group(const float* v, int16_t* q, float* dx, float* sx) {
  float amax = 0.0f, sum = 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) {
    amax = std::max(amax, std::fabs(v[j]));
    sum += v[j];
  }
  const float inv = amax > 0.0f ? kLevels / amax : 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) {
    q[j] = static_cast<int16_t>(std::nearbyint(v[position(j)] * inv));
  }
  *dx = amax / kLevels;
  *sx = sum;
}

struct RoundedRows {
  std::vector<int16_t> q;  // (rows, groups, 32)
  std::vector<float> dx, sx;  // (rows, groups)
};

inline RoundedRows round_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t groups = in / kGroup;
  RoundedRows out{std::vector<int16_t>(rows * groups * kGroup), std::vector<float>(rows * groups),
                  std::vector<float>(rows * groups)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
      round_group(x + r * in + g * kGroup, out.q.data() + at * kGroup, &out.dx[at], &out.sx[at]);
    }
  }
  return out;
}

}  // namespace rounded_inputs
}  // namespace prunewatch
