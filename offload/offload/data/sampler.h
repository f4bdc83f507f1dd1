// Which samples a step trains on, as a pure function of (seed, step): never of the number of
// processes. A sample is seq_len + 1 consecutive tokens of the token file (inputs and shifted
// targets); sample i starts at token i * seq_len, so there are (tokens - 1) / seq_len of them.
// Epoch e visits them in the order of a permutation keyed by (seed, e) only; the global sample
// counter g (consumed samples) maps to epoch g / N and position g % N. Step s trains on global
// samples [s * G, (s + 1) * G) for a global batch of G samples; a data-parallel rank takes a
// contiguous slice of them (Megatron's rule), so the set per step is the same at any dp.
//
// The permutation. Epoch e of N samples is a Fisher-Yates shuffle of the identity driven by a
// counter-based generator, written out here so any implementation can reproduce it:
//   mix(z)  = splitmix64's finalizer: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
//             z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31   (mod 2^64)
//   key     = mix(mix(seed) ^ e)
//   for i = N-1 down to 1:
//     r = mix(key + (i + 1) * 0x9E3779B97F4A7C15)      (splitmix64's output i + 1 from key)
//     j = floor(r * (i + 1) / 2^64)                     (a 128-bit product: Lemire's range map)
//     swap(perm[i], perm[j])
//   SampleAt(e * N + p) = perm[p]
// Only 64-bit integer arithmetic: no std::mt19937 or std::uniform_int_distribution, whose
// results differ between standard libraries, so every platform and every dp gets the same order
// (sampler_test.cc pins golden values). The range map is not rejection-sampled: its bias is below
// N / 2^64, nothing a training run can see, and it keeps one draw per position.
//
// Resuming. The state is the global sample counter alone (step * G when G is fixed), so a
// checkpoint that stores the step resumes the exact data order, at any dp.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "ucp/base/result.h"

namespace ucp::offload {

/// The data order of one token file. Not thread-safe: SampleAt and Fill are const but keep the
/// current epoch's permutation in a cache (N int64s).
class Sampler {
 public:
  /// A sampler over a token file of `num_tokens` tokens.
  /// Errors: kInvalidArgument (seq_len < 1, fewer than seq_len + 1 tokens: "N tokens hold no
  /// sample of seq_len + 1").
  static Result<Sampler> Create(int64_t num_tokens, int64_t seq_len, uint64_t seed);

  int64_t num_samples() const;  ///< per epoch: (num_tokens - 1) / seq_len
  int64_t seq_len() const;      ///< tokens per input row

  /// The sample index (into the token file, in units of seq_len tokens) of global sample g >= 0
  /// (a negative g is a bug: UCP_CHECK).
  int64_t SampleAt(int64_t global_sample) const;

  /// The global samples of step `step` that data-parallel rank `dp_rank` of `dp` trains on:
  /// [step*G + dp_rank*G/dp, step*G + (dp_rank+1)*G/dp).
  /// Errors: kInvalidArgument when dp does not divide G ("global batch 6 does not divide by dp=4:
  /// 6 = 4 * 1 + 2"), and for step < 0, global_batch < 1, dp < 1, dp_rank outside [0, dp), or a
  /// sample index past INT64_MAX.
  static Result<std::pair<int64_t, int64_t>> RankRange(int64_t step, int64_t global_batch,
                                                       int64_t dp, int64_t dp_rank);

  /// Fills inputs/targets ([n, seq_len] each, row-major) for global samples [first, first + n):
  /// inputs[k][t] = tokens[s * seq_len + t], targets[k][t] = tokens[s * seq_len + t + 1] for
  /// s = SampleAt(first + k). `tokens` must be the file the sampler was created for, and the
  /// spans n * seq_len long (anything else is a bug: UCP_CHECK).
  void Fill(std::span<const uint16_t> tokens, int64_t first, int64_t n, std::span<int32_t> inputs,
            std::span<int32_t> targets) const;

 private:
  Sampler() = default;
  int64_t num_samples_ = 0;
  int64_t seq_len_ = 0;
  uint64_t seed_ = 0;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;  // the permutation of cached_epoch_
};

}  // namespace ucp::offload
