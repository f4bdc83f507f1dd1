// The model's oracle: the same graph as Model (model.cc), composed of the scalar reference ops
// (ops::ref) in double, with no threads and no BLAS. For tests and parity checks only: it
// allocates its activations on every call.
#pragma once

#include <span>
#include <vector>

#include "offload/model/model.h"
#include "ucp/base/result.h"

namespace ucp::offload {

/// The parameters of `config` in canonical order (as Model::params()).
/// Errors: kInvalidArgument naming the hyper-parameter, as ModelConfig::FromSpec.
Result<std::vector<ParamInfo>> ModelParams(const ModelConfig& config);

/// Model::ForwardBackward in double through ops::ref; forward only when `grads` is empty.
/// Errors: kInvalidArgument (config, sizes, a token >= vocab).
Result<double> RefForwardBackward(const ModelConfig& config, std::span<const double> weights,
                                  std::span<double> grads, const Batch& batch, double grad_scale);

}  // namespace ucp::offload
