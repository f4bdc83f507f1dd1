// The sampler: the permutation spelled out in sampler.h, and Megatron's data-parallel slice.
#include "offload/data/sampler.h"

#include <numeric>
#include <optional>
#include <string>

#include "ucp/base/check.h"
#include "ucp/base/checked_math.h"

namespace ucp::offload {
namespace {

// __extension__: the 128-bit product is GCC/Clang's, and -Wpedantic would flag the type.
__extension__ typedef unsigned __int128 Uint128;

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;  // splitmix64's increment

// splitmix64's finalizer (Steele, Lea, Flood, "Fast splittable pseudorandom number generators").
constexpr uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
static_assert(Mix64(kGoldenGamma) == 0xE220A8397B1DCDAFULL,
              "splitmix64 seeded with 0 must start with its published first output");

}  // namespace

Result<Sampler> Sampler::Create(int64_t num_tokens, int64_t seq_len, uint64_t seed) {
  if (seq_len < 1) {
    return InvalidArgumentError("seq_len is " + std::to_string(seq_len) + ", must be at least 1");
  }
  if (num_tokens < 1 || num_tokens - 1 < seq_len) {
    return InvalidArgumentError(
        std::to_string(num_tokens) +
        " tokens hold no sample of seq_len + 1 = " + std::to_string(seq_len) + " + 1 tokens");
  }
  Sampler s;
  s.num_samples_ = (num_tokens - 1) / seq_len;
  s.seq_len_ = seq_len;
  s.seed_ = seed;
  return s;
}

int64_t Sampler::num_samples() const { return num_samples_; }
int64_t Sampler::seq_len() const { return seq_len_; }

int64_t Sampler::SampleAt(int64_t global_sample) const {
  UCP_CHECK(global_sample >= 0) << "global sample " << global_sample << " is negative";
  const int64_t epoch = global_sample / num_samples_;
  const int64_t position = global_sample % num_samples_;
  if (epoch != cached_epoch_) {
    perm_.resize(static_cast<size_t>(num_samples_));
    std::iota(perm_.begin(), perm_.end(), int64_t{0});
    const uint64_t key = Mix64(Mix64(seed_) ^ static_cast<uint64_t>(epoch));
    for (int64_t i = num_samples_ - 1; i >= 1; --i) {
      const uint64_t bound = static_cast<uint64_t>(i) + 1;
      const uint64_t r = Mix64(key + bound * kGoldenGamma);
      const auto j = static_cast<int64_t>((static_cast<Uint128>(r) * bound) >> 64);
      std::swap(perm_[static_cast<size_t>(i)], perm_[static_cast<size_t>(j)]);
    }
    cached_epoch_ = epoch;
  }
  return perm_[static_cast<size_t>(position)];
}

Result<std::pair<int64_t, int64_t>> Sampler::RankRange(int64_t step, int64_t global_batch,
                                                       int64_t dp, int64_t dp_rank) {
  if (step < 0) return InvalidArgumentError("step is " + std::to_string(step) + ", negative");
  if (global_batch < 1) {
    return InvalidArgumentError("global batch is " + std::to_string(global_batch) +
                                " samples, must be at least 1");
  }
  if (dp < 1) return InvalidArgumentError("dp is " + std::to_string(dp) + ", must be at least 1");
  if (dp_rank < 0 || dp_rank >= dp) {
    return InvalidArgumentError("dp rank " + std::to_string(dp_rank) + " is outside [0, " +
                                std::to_string(dp) + ")");
  }
  if (global_batch % dp != 0) {
    return InvalidArgumentError("global batch " + std::to_string(global_batch) +
                                " does not divide by dp=" + std::to_string(dp) + ": " +
                                std::to_string(global_batch) + " = " + std::to_string(dp) + " * " +
                                std::to_string(global_batch / dp) + " + " +
                                std::to_string(global_batch % dp));
  }
  const int64_t per_rank = global_batch / dp;
  const std::optional<int64_t> step_first = CheckedMul(step, global_batch);
  const std::optional<int64_t> end =
      step_first ? CheckedAdd(*step_first, global_batch) : std::nullopt;
  if (!end) {
    return InvalidArgumentError("step " + std::to_string(step) + " of a global batch of " +
                                std::to_string(global_batch) + " samples passes INT64_MAX samples");
  }
  const int64_t first = *step_first + dp_rank * per_rank;
  return std::pair<int64_t, int64_t>(first, first + per_rank);
}

void Sampler::Fill(std::span<const uint16_t> tokens, int64_t first, int64_t n,
                   std::span<int32_t> inputs, std::span<int32_t> targets) const {
  UCP_CHECK(first >= 0 && n >= 0) << "first " << first << ", n " << n;
  const auto row = static_cast<size_t>(seq_len_);
  UCP_CHECK(inputs.size() == static_cast<size_t>(n) * row &&
            targets.size() == static_cast<size_t>(n) * row)
      << "inputs " << inputs.size() << " and targets " << targets.size() << " values for " << n
      << " samples of seq_len " << seq_len_;
  UCP_CHECK(tokens.size() >= static_cast<size_t>(num_samples_) * row + 1)
      << tokens.size() << " tokens, but the sampler was made for " << num_samples_
      << " samples of seq_len " << seq_len_;
  for (int64_t k = 0; k < n; ++k) {
    const size_t start = static_cast<size_t>(SampleAt(first + k)) * row;
    const size_t out = static_cast<size_t>(k) * row;
    for (size_t t = 0; t < row; ++t) {
      inputs[out + t] = tokens[start + t];
      targets[out + t] = tokens[start + t + 1];
    }
  }
}

}  // namespace ucp::offload
