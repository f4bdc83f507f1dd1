// Seeded generators for property tests. A failing case prints its seed (SCOPED_TRACE), and the
// seed list can be widened locally with UCP_TEST_SEEDS=N.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "ucp/tensor/dtype.h"
#include "ucp/tensor/tensor.h"

namespace ucp::testing {

/// How many seeds a property test runs: 20 by default, or $UCP_TEST_SEEDS.
inline int NumSeeds(int default_seeds = 20) {
  const char* env = std::getenv("UCP_TEST_SEEDS");
  return env ? std::atoi(env) : default_seeds;
}

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  DType AnyDType() { return kAllDTypes[static_cast<size_t>(Int(0, kAllDTypes.size() - 1))]; }
  /// A tensor with random bytes (any bit pattern, NaNs included: round trips must move bytes).
  Tensor RandomTensor(DType dtype, Shape shape) {
    Tensor t = std::move(Tensor::Zeros(dtype, std::move(shape))).value();
    auto bytes = t.as<uint8_t>();
    for (auto& b : bytes) b = static_cast<uint8_t>(rng_());
    if (dtype == DType::kBool) {
      for (auto& b : bytes) b &= 1;
    }
    return t;
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

}  // namespace ucp::testing
