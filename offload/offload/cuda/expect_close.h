// Test-only: the CUDA ops' tests' closeness check, shared by the GPU's (cuda_ops_test.cc) and the
// host emulation's (kernels_emulated_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace ucp::offload::cuda {

/// max |got - want| <= tol x max(1, max |want|); any NaN fails.
inline void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                        double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1.0, err = 0.0;
  size_t worst = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(e)) {  // (a NaN would not stay the worst below)
      ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << want[i];
      return;
    }
    if (e > err) {
      err = e;
      worst = i;
    }
  }
  EXPECT_LE(err, tol * scale) << what << ": worst element " << worst << " got " << got[worst]
                              << " want " << want[worst];
}

}  // namespace ucp::offload::cuda
