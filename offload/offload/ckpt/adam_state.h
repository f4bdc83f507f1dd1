// The bridge between the CPU Adam's state and libucp's universal checkpoint (docs/format.md):
// each parameter's fp32 master weight ("fp32"), exp_avg and exp_avg_sq (and max_exp_avg_sq with
// amsgrad) at its logical shape, the step, and the hyper-parameters in the manifest. Because the
// update is element-wise, a state restored here can be stepped as one span or as any set of
// contiguous fragments (any sharding) with bitwise the same result.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

#include "offload/optim/adam.h"
#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/tensor/shape.h"

namespace ucp::offload {

/// One parameter's Adam state, viewing the caller's memory. Every span has NumElements(shape)
/// elements; max_exp_avg_sq is used (and required) only with amsgrad.
struct AdamParamState {
  std::string name;
  Shape shape;
  std::span<float> param;  ///< the fp32 master weight
  std::span<float> exp_avg;
  std::span<float> exp_avg_sq;
  std::span<float> max_exp_avg_sq;
};

/// What the manifest says about the optimizer.
struct AdamCheckpointInfo {
  AdamConfig config;
  int64_t step = 0;
};

/// Writes a universal checkpoint at `dst` (which must not exist): one parameter file per entry,
/// optimizer kind "adamw" (decoupled) or "adam" (L2), hyper-parameters lr, beta1, beta2, eps,
/// weight_decay, amsgrad and bias_correction (0 or 1), source_framework "ucp-offload". Atomic.
/// Errors: kInvalidArgument (config; step < 0; a span's size differs from its shape's element
/// count, naming parameter, state and both sizes; missing max_exp_avg_sq with amsgrad; a bad or
/// duplicate name), kAlreadyExists (dst exists), kIoError.
Status SaveAdamCheckpoint(const std::filesystem::path& dst, const AdamConfig& config,
                          int64_t step, std::span<const AdamParamState> params);

/// Reads the optimizer section of the manifest at `src`: kind, hyper-parameters and step.
/// amsgrad and bias_correction default to torch's (0 and 1) when absent; the others must be
/// present.
/// Errors: as UniversalReader::Open; kFailedPrecondition (optimizer kind not adam/adamw, naming
/// it); kDataLoss (a required hyper-parameter missing, or a flag not 0 or 1, naming it), and
/// kInvalidArgument from ValidateAdamConfig.
Result<AdamCheckpointInfo> ReadAdamCheckpointInfo(const std::filesystem::path& src);

/// Restores every entry of `params` from `src` into the caller's spans (checksums verified) and
/// returns the manifest's optimizer info. The checkpoint may hold more parameters than asked for.
/// Errors: as ReadAdamCheckpointInfo; kNotFound (parameter or state missing, naming it);
/// kFailedPrecondition (a shape differs from the checkpoint's, naming both); kInvalidArgument
/// (span sizes, as SaveAdamCheckpoint); kDataLoss (as UniversalReader::ReadStateInto).
Result<AdamCheckpointInfo> LoadAdamCheckpoint(const std::filesystem::path& src,
                                              std::span<const AdamParamState> params);

}  // namespace ucp::offload
