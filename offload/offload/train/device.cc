// The CPU twin of the trainer's device (device.h): what the CUDA device does, on host buffers.
#include "offload/train/device.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "offload/train/page_vector.h"
#include "ucp/base/status_macros.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

class CpuTwinDevice final : public TrainDevice {
 public:
  CpuTwinDevice(TrainDeviceSpec spec, Model model,
                std::vector<std::pair<int64_t, int64_t>> group_ranges)
      : spec_(std::move(spec)), model_(std::move(model)), group_ranges_(std::move(group_ranges)) {
    const size_t n = static_cast<size_t>(model_.num_params());
    w32_.assign(n, 0.0f);
    grads_.assign(n, 0.0f);
    if (lowp()) w16_.assign(n, 0);
    for (const DevicePiece& pc : spec_.device_pieces) pieces_n_ += pc.n;
    master_.assign(static_cast<size_t>(pieces_n_), 0.0f);
    m_ = master_;
    v_ = master_;
  }

  std::string Describe() const override {
    // As the CUDA device's Describe: the host buffers it would pin (page_vector.h).
    int pinnable = 0, buffers = 0;
    const std::pair<const void*, size_t> host[] = {
        {spec_.h_grads.data(), spec_.h_grads.size()},
        {spec_.h_weights32.data(), spec_.h_weights32.size()},
        {spec_.h_weights16.data(), lowp() ? spec_.h_weights16.size() : 0}};
    for (const auto& [p, n] : host) {
      if (n == 0) continue;  // not used (bf16 has no host fp32 weights, fp32 no 16-bit ones)
      ++buffers;
      pinnable += StartsOnPage(p) ? 1 : 0;
    }
    return "twin (the CPU standing in for a device), " + std::to_string(pieces_n_) +
           " parameters stepped by the device Adam; " + std::to_string(pinnable) + " of " +
           std::to_string(buffers) + " host buffers pinnable";
  }

  Status UploadWeights() override {
    // As the CUDA device: bf16 "over the link", widened on the "device".
    if (spec_.weights == LowpDType::kBf16) {
      std::memcpy(w16_.data(), spec_.h_weights16.data(), w16_.size() * 2);
    }
    WidenRange(0, static_cast<int64_t>(w32_.size()));
    return Status::Ok();
  }

  Status ZeroGrads() override {
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    return Status::Ok();
  }

  Result<double> ForwardBackward(const Batch& batch, float grad_scale,
                                 const BackwardHook* hook) override {
    return hook != nullptr ? model_.ForwardBackward(w32_, grads_, batch, grad_scale, *hook)
                           : model_.ForwardBackward(w32_, grads_, batch, grad_scale);
  }

  Result<double> Forward(const Batch& batch) override { return model_.Forward(w32_, batch); }

  Status GradsToHost() override {
    std::memcpy(spec_.h_grads.data(), grads_.data(), grads_.size() * 4);
    return Status::Ok();
  }

  Status GroupGradsToHost(int group) override {
    if (group < 0 || group >= static_cast<int>(group_ranges_.size())) {
      return InvalidArgumentError("twin device: no grad group " + std::to_string(group));
    }
    const auto [b, e] = group_ranges_[static_cast<size_t>(group)];
    std::memcpy(spec_.h_grads.data() + b, grads_.data() + b, static_cast<size_t>(e - b) * 4);
    return Status::Ok();
  }

  Status PushState(std::span<const float> master, std::span<const float> exp_avg,
                   std::span<const float> exp_avg_sq) override {
    int64_t at = 0;
    for (const DevicePiece& pc : spec_.device_pieces) {
      const size_t b = static_cast<size_t>(pc.n) * 4;
      std::memcpy(master_.data() + at, master.data() + pc.state_offset, b);
      std::memcpy(m_.data() + at, exp_avg.data() + pc.state_offset, b);
      std::memcpy(v_.data() + at, exp_avg_sq.data() + pc.state_offset, b);
      at += pc.n;
    }
    return Status::Ok();
  }

  Status PullState(std::span<float> master, std::span<float> exp_avg,
                   std::span<float> exp_avg_sq) override {
    int64_t at = 0;
    for (const DevicePiece& pc : spec_.device_pieces) {
      const size_t b = static_cast<size_t>(pc.n) * 4;
      std::memcpy(master.data() + pc.state_offset, master_.data() + at, b);
      std::memcpy(exp_avg.data() + pc.state_offset, m_.data() + at, b);
      std::memcpy(exp_avg_sq.data() + pc.state_offset, v_.data() + at, b);
      at += pc.n;
    }
    return Status::Ok();
  }

  Status StepDevicePieces(int64_t step, float lr, float grad_scale) override {
    AdamConfig ac = spec_.adam;
    ac.lr = lr;
    int64_t at = 0;
    for (const DevicePiece& pc : spec_.device_pieces) {
      const size_t off = static_cast<size_t>(at), n = static_cast<size_t>(pc.n);
      AdamSpans a;
      a.param = std::span<float>(master_).subspan(off, n);
      a.grad = GradSpan::Fp32(std::span<const float>(grads_).subspan(
          static_cast<size_t>(pc.model_offset), n));
      a.exp_avg = std::span<float>(m_).subspan(off, n);
      a.exp_avg_sq = std::span<float>(v_).subspan(off, n);
      // The "device" weights and the host's copy of them, as the CUDA device writes both.
      auto out = std::span<uint16_t>(spec_.h_weights16).subspan(
          static_cast<size_t>(pc.model_offset), n);
      a.out = spec_.weights == LowpDType::kBf16 ? LowpOutSpan::Bf16(out) : LowpOutSpan::Fp16(out);
      AdamFusedOptions fo;
      fo.grad_scale = grad_scale;
      UCP_RETURN_IF_ERROR(AdamStepFused(ac, step, a, fo), "device Adam (twin)");
      if (lowp()) {
        std::memcpy(w16_.data() + pc.model_offset, out.data(), n * 2);
      }
      at += pc.n;
    }
    return Status::Ok();
  }

  DevicePipelineView PipelineView() override { return {grads_, w16_}; }

  // Backward runs on the caller's thread and the hook follows each group's last write, so plain
  // copies are ordered after it.
  Result<std::unique_ptr<PipelineBackend>> MakePipelineBackend() override {
    return CpuPipelineBackend();
  }

  Status WeightsWritten() override {
    WidenRange(0, static_cast<int64_t>(w32_.size()));
    return Status::Ok();
  }

  Status GroupWeightsWritten(int group) override {
    if (group < 0 || group >= static_cast<int>(group_ranges_.size())) {
      return InvalidArgumentError("twin device: no grad group " + std::to_string(group));
    }
    const auto [b, e] = group_ranges_[static_cast<size_t>(group)];
    WidenRange(b, e);
    return Status::Ok();
  }

  int64_t device_bytes() const override {
    return static_cast<int64_t>(w32_.size() * 8 + w16_.size() * 2) + pieces_n_ * 12;
  }

 private:
  bool lowp() const { return spec_.weights != LowpDType::kFp32; }
  // The compute copy of elements [b, e) from the device's weights: bf16 widened on the
  // "device"; fp16 and fp32 runs take the host's fp32 compute copy.
  void WidenRange(int64_t b, int64_t e) {
    if (spec_.weights == LowpDType::kBf16) {
      for (int64_t i = b; i < e; ++i) w32_[i] = FloatFromBf16(w16_[i]);
    } else {
      std::memcpy(w32_.data() + b, spec_.h_weights32.data() + b, static_cast<size_t>(e - b) * 4);
    }
  }

  TrainDeviceSpec spec_;
  Model model_;
  std::vector<std::pair<int64_t, int64_t>> group_ranges_;
  std::vector<float> w32_, grads_, master_, m_, v_;
  std::vector<uint16_t> w16_;
  int64_t pieces_n_ = 0;
};

}  // namespace

Result<std::vector<std::pair<int64_t, int64_t>>> GradGroupRanges(const ModelConfig& config) {
  UCP_ASSIGN_OR_RETURN(ParamTable table, ModelParamTable(config));
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const GradGroup& g : table.groups) {
    int64_t b = table.total, e = 0;
    for (int64_t i = g.first_param; i < g.end_param; ++i) {
      const ParamInfo& p = table.params[static_cast<size_t>(i)];
      b = std::min(b, p.offset);
      e = std::max(e, p.offset + p.numel);
    }
    out.emplace_back(std::min(b, e), e);
  }
  return out;
}

Result<std::unique_ptr<TrainDevice>> MakeCpuTwinDevice(const TrainDeviceSpec& spec) {
  UCP_ASSIGN_OR_RETURN(Model model, Model::Create(spec.model, spec.max_batch, spec.seq_len,
                                                  spec.threads));
  const int64_t n = model.num_params();
  // As the CUDA device: bf16 training needs no host fp32 weights (may be empty).
  const auto w32 = static_cast<int64_t>(spec.h_weights32.size());
  if (static_cast<int64_t>(spec.h_grads.size()) != n ||
      (w32 != n && !(w32 == 0 && spec.weights == LowpDType::kBf16)) ||
      (spec.weights != LowpDType::kFp32 && static_cast<int64_t>(spec.h_weights16.size()) != n)) {
    return InvalidArgumentError("twin device: host buffers do not hold the model's " +
                                std::to_string(n) + " parameters");
  }
  UCP_ASSIGN_OR_RETURN(auto ranges, GradGroupRanges(spec.model));
  return std::unique_ptr<TrainDevice>(
      std::make_unique<CpuTwinDevice>(spec, std::move(model), std::move(ranges)));
}

}  // namespace ucp::offload
