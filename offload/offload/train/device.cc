// The CPU twin of the trainer's device (device.h): what the CUDA device does, on host buffers.
#include "offload/train/device.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <tbb/parallel_for.h>

#include "offload/comm/ordered_sum.h"
#include "offload/train/page_vector.h"
#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

// The twin's copy stream for staged host buffers: one thread running the queued copies in
// order; Wait(slot) returns once every copy queued for the slot has run.
class CopyQueue {
 public:
  CopyQueue() = default;
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;
  ~CopyQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void Queue(int slot, std::function<void()> copy) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    tasks_.push_back({slot, std::move(copy)});
    ++pending_[slot];
    cv_.notify_all();
  }
  void Wait(int slot) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_[slot] == 0; });
  }
  void WaitAll() {
    for (int s = 0; s < kStagedSlots; ++s) Wait(s);
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, nothing left
      auto [slot, copy] = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      copy();
      lock.lock();
      --pending_[slot];
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int, std::function<void()>>> tasks_;
  int pending_[kStagedSlots] = {};
  bool stop_ = false;
  std::thread thread_;
};

// The twin's reductions in chunks this long: small, so that the tests' tiny models cross
// several chunk boundaries, inside pieces too.
constexpr int64_t kTwinReduceChunk = 1000;

class CpuTwinDevice final : public TrainDevice {
 public:
  CpuTwinDevice(TrainDeviceSpec spec, Model model,
                std::vector<std::pair<int64_t, int64_t>> group_ranges,
                std::vector<ExchangeChunk> step_chunks,
                std::vector<std::vector<ExchangeChunk>> bucket_chunks)
      : spec_(std::move(spec)),
        model_(std::move(model)),
        group_ranges_(std::move(group_ranges)),
        step_chunks_(std::move(step_chunks)),
        bucket_chunks_(std::move(bucket_chunks)) {
    const size_t n = static_cast<size_t>(model_.num_params());
    w32_.assign(n, 0.0f);
    grads_.assign(n, 0.0f);
    if (lowp()) w16_.assign(n, 0);
    for (const DevicePiece& pc : spec_.device_pieces) pieces_n_ += pc.n;
    master_.assign(static_cast<size_t>(pieces_n_), 0.0f);
    m_ = master_;
    v_ = master_;
  }

  bool ComputesOnHost() const override { return true; }
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
    UCP_RETURN_IF_ERROR(NotStaged("UploadWeights"));
    // As the CUDA device: bf16 "over the link", widened on the "device".
    if (spec_.weights == LowpDType::kBf16) {
      std::memcpy(w16_.data(), spec_.h_weights16.data(), w16_.size() * 2);
    }
    WidenRange(0, static_cast<int64_t>(w32_.size()));
    return Status::Ok();
  }

  Status ZeroGrads() override {
    copies_.WaitAll();  // (a queued gradient copy reads them)
    std::fill(grads_.begin(), grads_.end(), 0.0f);
    return Status::Ok();
  }

  Result<double> ForwardBackward(const Batch& batch, float grad_scale,
                                 const BackwardHook* hook) override {
    copies_.WaitAll();  // (as a GPU's kernels queued after the copies)
    return hook != nullptr ? model_.ForwardBackward(w32_, grads_, batch, grad_scale, *hook)
                           : model_.ForwardBackward(w32_, grads_, batch, grad_scale);
  }

  Result<double> Forward(const Batch& batch) override {
    copies_.WaitAll();
    return model_.Forward(w32_, batch);
  }

  Status GradsToHost() override {
    UCP_RETURN_IF_ERROR(NotStaged("GradsToHost"));
    std::memcpy(spec_.h_grads.data(), grads_.data(), grads_.size() * 4);
    return Status::Ok();
  }

  // Staged: the copies run on the twin's copy thread in the order queued, as on a GPU's copy
  // stream, so a trainer that reads a window before WaitStaged reads it mid-copy here too.
  Status GradsRangeToHostAsync(int64_t begin, int64_t n, int slot, int64_t at) override {
    UCP_RETURN_IF_ERROR(
        CheckStagedRange(spec_, model_.num_params(), begin, n, slot, "twin device", at));
    float* dst = spec_.h_grads.data() + slot * spec_.host_window + at;
    staged_bytes_ += n * 4;
    copies_.Queue(slot, [this, dst, begin, n] {
      std::memcpy(dst, grads_.data() + begin, static_cast<size_t>(n) * 4);
    });
    return Status::Ok();
  }

  Status WeightsRangeToDeviceAsync(int64_t begin, int64_t n, int slot) override {
    UCP_RETURN_IF_ERROR(
        CheckStagedRange(spec_, model_.num_params(), begin, n, slot, "twin device"));
    const uint16_t* src = spec_.h_weights16.data() + slot * spec_.host_window;
    staged_bytes_ += n * 2;
    copies_.Queue(slot, [this, src, begin, n] {
      std::memcpy(w16_.data() + begin, src, static_cast<size_t>(n) * 2);
      WidenRange(begin, begin + n);
    });
    return Status::Ok();
  }

  Status WaitStaged(int slot) override {
    UCP_RETURN_IF_ERROR(CheckStagedSlot(spec_, slot, "twin device"));
    copies_.Wait(slot);
    return Status::Ok();
  }

  Status WeightsRangeToHost(int64_t begin, int64_t n) override {
    UCP_RETURN_IF_ERROR(CheckStagedRange(spec_, model_.num_params(), begin, n, 0, "twin device"));
    copies_.WaitAll();  // (the device's weights as queued)
    staged_bytes_ += n * 2;
    std::memcpy(spec_.h_weights16.data(), w16_.data() + begin, static_cast<size_t>(n) * 2);
    return Status::Ok();
  }

  Status GroupGradsToHost(int group) override {
    UCP_RETURN_IF_ERROR(NotStaged("GroupGradsToHost"));
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
    UCP_RETURN_IF_ERROR(NotStaged("the overlapped pipeline"));
    return CpuPipelineBackend();
  }

  Status WeightsWritten() override {
    UCP_RETURN_IF_ERROR(NotStaged("WeightsWritten"));
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

  // The CUDA device's kernel does this arithmetic; here it is the host's own function.
  Status GradNormChunks(std::span<double> partial, std::span<float> maxabs) override {
    UCP_RETURN_IF_ERROR(CheckGradNormSpans(model_.num_params(), partial, maxabs, "twin device"));
    copies_.WaitAll();  // (as a GPU's kernel queued after the copies)
    tbb::parallel_for(int64_t{0}, static_cast<int64_t>(partial.size()), [&](int64_t c) {
      SumChunk(grads_, c, &partial[static_cast<size_t>(c)], &maxabs[static_cast<size_t>(c)]);
    });
    return Status::Ok();
  }
  bool SumsGradNorm() const override { return true; }
  int64_t staged_bytes() const override { return staged_bytes_; }

  // The GPU's bucket exchange, on the host.
  Status ExchangeBucketToHost(int group, std::span<float> sum) override {
    if (spec_.reduce.comm == nullptr || spec_.reduce.buckets.empty()) {
      return TrainDevice::ExchangeBucketToHost(group, sum);
    }
    if (group < 0 || group >= static_cast<int>(spec_.reduce.buckets.size())) {
      return InvalidArgumentError("twin device: no grad group " + std::to_string(group));
    }
    return ExchangeOnHost(bucket_chunks_[static_cast<size_t>(group)], *spec_.reduce.comm, grads_,
                          send_, recv_, sum);
  }

  // The GPU's sums, on the host.
  Status AllReduceGradsToHost() override {
    if (spec_.reduce.comm == nullptr || !spec_.reduce.all_reduce) {
      return TrainDevice::AllReduceGradsToHost();
    }
    return ExchangeOnHost(step_chunks_, *spec_.reduce.comm, grads_, send_, recv_, spec_.h_grads);
  }

  // The GPU's chunks, packed and reduce-scattered on the host.
  Status ReduceGradsToHost(std::span<float> h_block) override {
    if (spec_.reduce.comm == nullptr || spec_.reduce.all_reduce) {
      return TrainDevice::ReduceGradsToHost(h_block);
    }
    UCP_RETURN_IF_ERROR(CheckReduceOutput(h_block, spec_.reduce.block, "twin device", "the block"));
    return ExchangeOnHost(step_chunks_, *spec_.reduce.comm, grads_, send_, recv_, h_block);
  }

 private:
  bool lowp() const { return spec_.weights != LowpDType::kFp32; }
  Status NotStaged(const char* what) const { return CheckNotStaged(spec_, "twin device", what); }
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
  // The reductions' chunks: the synchronous step's, and by grad group the buckets'; their
  // scratch.
  std::vector<ExchangeChunk> step_chunks_;
  std::vector<std::vector<ExchangeChunk>> bucket_chunks_;
  std::vector<float> send_, recv_;
  std::vector<float> w32_, grads_, master_, m_, v_;
  std::vector<uint16_t> w16_;
  int64_t pieces_n_ = 0;
  int64_t staged_bytes_ = 0;
  CopyQueue copies_;  // last: joined first, while the buffers its copies touch are alive
};

// The twin with streamed weights (TrainDeviceSpec::stream_weights): its "device" memory is the
// book's arena of weights, compute copy and gradients; every crossing is a memcpy on the
// model's thread.
class CpuTwinStreamedDevice final : public TrainDevice, public WeightWindows {
 public:
  CpuTwinStreamedDevice(TrainDeviceSpec spec, Model model,
                        std::vector<std::pair<int64_t, int64_t>> group_ranges)
      : spec_(std::move(spec)), model_(std::move(model)), book_(std::move(group_ranges)) {
    const size_t n = static_cast<size_t>(book_.elements());
    // Only bf16 crosses as training-dtype bits (widened on the device); fp16 and fp32 cross as
    // the host's fp32 compute copy.
    if (spec_.weights == LowpDType::kBf16) w16_.assign(n, 0);
    w32_.assign(n, 0.0f);
    grads_.assign(n, 0.0f);
  }

  bool ComputesOnHost() const override { return true; }
  std::string Describe() const override {
    return "twin (the CPU standing in for a device), weights streamed: the embeddings, the head "
           "and 2 layer windows on the device (" + std::to_string(device_bytes()) + " bytes)";
  }

  // The host's weights are new: each group crosses again when the graph next needs it.
  Status UploadWeights() override {
    book_.WeightsChanged();
    return Status::Ok();
  }
  Status WeightsWritten() override { return UploadWeights(); }
  Status GroupWeightsWritten(int group) override { return book_.GroupWeightsChanged(group); }
  void WeightsInFlight() override { book_.WeightsInFlight(); }

  Status ZeroGrads() override {
    book_.NewStep();
    return Status::Ok();
  }

  Result<double> ForwardBackward(const Batch& batch, float grad_scale,
                                 const BackwardHook* hook) override {
    Result<double> r = model_.ForwardBackward(*this, batch, grad_scale, hook);
    if (!r.ok()) book_.ReleaseAll();
    return r;
  }
  Result<double> Forward(const Batch& batch) override {
    Result<double> r = model_.Forward(*this, batch);
    if (!r.ok()) book_.ReleaseAll();
    return r;
  }

  // The released groups' gradients are on the host already; a group backward has not reached
  // this step holds the device's zeros.
  Status GradsToHost() override {
    for (int k = 0; k < book_.groups(); ++k) book_.ZeroGradsNotOnHost(k, spec_.h_grads);
    return Status::Ok();
  }
  Status GroupGradsToHost(int group) override {
    if (group < 0 || group >= book_.groups()) {
      return InvalidArgumentError("twin device: no grad group " + std::to_string(group));
    }
    book_.ZeroGradsNotOnHost(group, spec_.h_grads);
    return Status::Ok();
  }

  // No device pieces (MakeCpuTwinDevice refuses them with streaming).
  Status PushState(std::span<const float>, std::span<const float>,
                   std::span<const float>) override {
    return Status::Ok();
  }
  Status PullState(std::span<float>, std::span<float>, std::span<float>) override {
    return Status::Ok();
  }
  Status StepDevicePieces(int64_t, float, float) override { return Status::Ok(); }

  // The pipeline's "device" buffers are the host's: its copies are no-ops (pipeline.cc), and
  // the weights it writes cross when the graph next acquires their group.
  DevicePipelineView PipelineView() override { return {spec_.h_grads, spec_.h_weights16}; }
  Result<std::unique_ptr<PipelineBackend>> MakePipelineBackend() override {
    return CpuPipelineBackend();
  }

  int64_t device_bytes() const override {
    return static_cast<int64_t>(w16_.size() * 2 + w32_.size() * 4 + grads_.size() * 4);
  }
  int64_t streamed_bytes() const override { return moved_; }

  // WeightWindows: the graph's calls.
  Result<Slot> Acquire(int group, bool grads) override {
    UCP_ASSIGN_OR_RETURN(WeightWindowBook::Use u, book_.Acquire(group, grads), "twin device");
    const size_t at = static_cast<size_t>(u.offset), n = static_cast<size_t>(u.n);
    if (u.load_weights) LoadWeights(u);
    // The next layer's weights into the other window (a GPU copies them on its copy stream
    // while this layer computes; here at once).
    if (std::optional<WeightWindowBook::Use> next = book_.PrefetchAfter(group, grads)) {
      LoadWeights(*next);
    }
    if (grads && u.grads_from_host) {
      // An earlier micro-batch's sum: backward adds into it, as into resident gradients.
      std::memcpy(grads_.data() + at, spec_.h_grads.data() + u.begin, n * 4);
      moved_ += static_cast<int64_t>(n * 4);
    } else if (grads) {
      std::fill_n(grads_.begin() + static_cast<std::ptrdiff_t>(at), n, 0.0f);
    }
    return Slot{w32_.data() + at, grads ? grads_.data() + at : nullptr};
  }

  Status Release(int group, bool grads) override {
    UCP_ASSIGN_OR_RETURN(WeightWindowBook::Use u, book_.Release(group, grads), "twin device");
    if (grads) {
      // Backward is done with the group: its gradients leave (the hook's on_group_done follows).
      std::memcpy(spec_.h_grads.data() + u.begin, grads_.data() + u.offset,
                  static_cast<size_t>(u.n) * 4);
      moved_ += u.n * 4;
    }
    return Status::Ok();
  }

 private:
  // As the resident device's upload: bf16 crosses and is widened on the device; fp16 and fp32
  // runs take the host's fp32 compute copy.
  void LoadWeights(const WeightWindowBook::Use& u) {
    const size_t at = static_cast<size_t>(u.offset), n = static_cast<size_t>(u.n);
    if (spec_.weights == LowpDType::kBf16) {
      std::memcpy(w16_.data() + at, spec_.h_weights16.data() + u.begin, n * 2);
      for (size_t i = 0; i < n; ++i) w32_[at + i] = FloatFromBf16(w16_[at + i]);
      moved_ += static_cast<int64_t>(n * 2);
    } else {
      std::memcpy(w32_.data() + at, spec_.h_weights32.data() + u.begin, n * 4);
      moved_ += static_cast<int64_t>(n * 4);
    }
  }

  TrainDeviceSpec spec_;
  Model model_;
  WeightWindowBook book_;
  std::vector<uint16_t> w16_;  // the arena (WeightWindowBook)
  std::vector<float> w32_, grads_;
  int64_t moved_ = 0;
};

}  // namespace

Status CheckGradNormSpans(int64_t n, std::span<const double> partial, std::span<const float> maxabs,
                          const char* who) {
  const int64_t chunks = NumGradNormChunks(n);
  if (static_cast<int64_t>(partial.size()) != chunks ||
      static_cast<int64_t>(maxabs.size()) != chunks) {
    return InvalidArgumentError(std::string(who) + ": the gradient norm of " + std::to_string(n) +
                                " parameters has " + std::to_string(chunks) + " chunks, not " +
                                std::to_string(partial.size()) + " / " +
                                std::to_string(maxabs.size()));
  }
  return Status::Ok();
}

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

WeightWindowBook::WeightWindowBook(std::vector<std::pair<int64_t, int64_t>> ranges)
    : ranges_(std::move(ranges)) {
  const int last = groups() - 1;
  auto size = [&](int k) { return range(k).second - range(k).first; };
  int64_t window = 0;
  for (int k = 1; k < last; ++k) window = std::max(window, size(k));
  store_offset_[1] = size(0) + kAlign - 1;
  store_offset_[2] = store_offset_[1] + size(last) + kAlign - 1;
  store_offset_[3] = store_offset_[2] + window + kAlign - 1;
  elements_ = store_offset_[3] + window + kAlign - 1;
  UCP_CHECK(elements_ == ArenaElements(size(0), size(last), window));
  store_group_[0] = 0;
  store_group_[1] = last;
  where_.assign(ranges_.size(), -1);
  where_[0] = 0;
  where_[static_cast<size_t>(last)] = 1;
  loaded_.assign(ranges_.size(), 0);
  grads_on_host_.assign(ranges_.size(), 0);
  held_.assign(ranges_.size(), 0);
  in_flight_.assign(ranges_.size(), 0);
}

Status WeightWindowBook::Check(int group) const {
  if (group < 0 || group >= groups()) {
    return InvalidArgumentError("streamed weights: no grad group " + std::to_string(group));
  }
  return Status::Ok();
}

Result<WeightWindowBook::Use> WeightWindowBook::Acquire(int group, bool grads) {
  UCP_RETURN_IF_ERROR(Check(group));
  const size_t k = static_cast<size_t>(group);
  if (held_[k]) {
    return FailedPreconditionError("streamed weights: grad group " + std::to_string(group) +
                                   " acquired twice");
  }
  if (where_[k] < 0) {
    // A layer not in a window: the window not holding the layer acquired last (in forward and
    // backward alike that is the one the graph is done with), unless it is still held.
    int s = store_group_[3] == last_layer_ || store_group_[2] < 0 ? 2 : 3;
    if (store_group_[s] >= 0 && held_[static_cast<size_t>(store_group_[s])]) s = 5 - s;
    if (store_group_[s] >= 0) {
      const size_t old = static_cast<size_t>(store_group_[s]);
      if (held_[old]) {
        return FailedPreconditionError("streamed weights: no free layer window for grad group " +
                                       std::to_string(group));
      }
      where_[old] = -1;
      loaded_[old] = 0;
    }
    store_group_[s] = group;
    where_[k] = s;
    loaded_[k] = 0;
  }
  if (group != 0 && group != groups() - 1) last_layer_ = group;
  return Take(group, grads);
}

// Marks a placed group held (Acquire) and says what must cross.
WeightWindowBook::Use WeightWindowBook::Take(int group, bool grads) {
  const size_t k = static_cast<size_t>(group);
  Use u = Place(group);
  u.load_weights = loaded_[k] == 0;
  u.grads_from_host = grads && grads_on_host_[k] != 0;
  loaded_[k] = 1;
  held_[k] = 1;
  return u;
}

std::optional<WeightWindowBook::Use> WeightWindowBook::PrefetchAfter(int group, bool grads) {
  const int layers = groups() - 2;  // layer groups are 1..layers (1 the last layer)
  if (group < 1 || group > layers) return std::nullopt;
  const int next = grads ? group + 1 : group - 1;  // backward goes down the layers, forward up
  if (next < 1 || next > layers) return std::nullopt;
  const size_t k = static_cast<size_t>(next);
  if ((where_[k] >= 0 && loaded_[k]) || in_flight_[k]) return std::nullopt;
  if (where_[k] < 0) {
    const int s = store_group_[2] == group ? 3 : 2;  // the window `group` is not in
    if (store_group_[s] >= 0) {
      const size_t old = static_cast<size_t>(store_group_[s]);
      if (held_[old]) return std::nullopt;  // (the graph holds one layer at a time)
      where_[old] = -1;
      loaded_[old] = 0;
    }
    store_group_[s] = next;
    where_[k] = s;
  }
  loaded_[k] = 1;
  Use u = Place(next);
  u.load_weights = true;
  return u;
}

Result<WeightWindowBook::Use> WeightWindowBook::Release(int group, bool grads) {
  UCP_RETURN_IF_ERROR(Check(group));
  const size_t k = static_cast<size_t>(group);
  if (!held_[k]) {
    return FailedPreconditionError("streamed weights: grad group " + std::to_string(group) +
                                   " released but not acquired");
  }
  held_[k] = 0;
  if (grads) grads_on_host_[k] = 1;
  return Place(group);
}

// Where a group held in a store sits: the store's first element congruent to its model offset.
WeightWindowBook::Use WeightWindowBook::Place(int group) const {
  const size_t k = static_cast<size_t>(group);
  Use u;
  const int64_t base = store_offset_[where_[k]];
  u.store = where_[k];
  u.begin = ranges_[k].first;
  u.n = ranges_[k].second - ranges_[k].first;
  u.offset = base + ((u.begin - base) % kAlign + kAlign) % kAlign;
  return u;
}

void WeightWindowBook::WeightsChanged() {
  std::fill(loaded_.begin(), loaded_.end(), 0);
  std::fill(in_flight_.begin(), in_flight_.end(), 0);
}

Status WeightWindowBook::GroupWeightsChanged(int group) {
  UCP_RETURN_IF_ERROR(Check(group));
  loaded_[static_cast<size_t>(group)] = 0;
  in_flight_[static_cast<size_t>(group)] = 0;
  return Status::Ok();
}

void WeightWindowBook::WeightsInFlight() {
  std::fill(loaded_.begin(), loaded_.end(), 0);
  std::fill(in_flight_.begin(), in_flight_.end(), 1);
}

void WeightWindowBook::ZeroGradsNotOnHost(int group, std::span<float> h_grads) const {
  if (grads_on_host(group)) return;
  const auto [b, e] = range(group);
  std::fill(h_grads.begin() + b, h_grads.begin() + e, 0.0f);
}

void WeightWindowBook::NewStep() { std::fill(grads_on_host_.begin(), grads_on_host_.end(), 0); }

void WeightWindowBook::ReleaseAll() { std::fill(held_.begin(), held_.end(), 0); }

Status CheckStagedSlot(const TrainDeviceSpec& spec, int slot, const char* who) {
  if (spec.host_window == 0) {
    return FailedPreconditionError(std::string(who) + ": no staged host buffers "
                                   "(--host-buffers staged)");
  }
  if (slot < 0 || slot >= kStagedSlots) {
    return InvalidArgumentError(std::string(who) + ": no staged slot " + std::to_string(slot));
  }
  return Status::Ok();
}

Status CheckNotStaged(const TrainDeviceSpec& spec, const char* who, const char* what) {
  if (spec.host_window == 0) return Status::Ok();
  return FailedPreconditionError(std::string(who) + ": " + what + " needs whole host buffers "
                                 "(these are staged: --host-buffers staged)");
}

Status CheckStagedRange(const TrainDeviceSpec& spec, int64_t numel, int64_t begin, int64_t n,
                        int slot, const char* who, int64_t at) {
  UCP_RETURN_IF_ERROR(CheckStagedSlot(spec, slot, who));
  if (begin < 0 || n < 0 || at < 0 || n > spec.host_window - at || begin > numel - n) {
    return InvalidArgumentError(std::string(who) + ": staged range [" + std::to_string(begin) +
                                ", +" + std::to_string(n) + ") outside the model's " +
                                std::to_string(numel) + " elements, or from element " +
                                std::to_string(at) + " past the window of " +
                                std::to_string(spec.host_window));
  }
  return Status::Ok();
}

Status CheckStagedSpec(const TrainDeviceSpec& spec, int64_t numel, const char* who) {
  const std::string w = std::string(who) + ": staged host buffers (--host-buffers staged)";
  if (spec.host_window < 0) return InvalidArgumentError(w + ": a negative window");
  if (spec.weights != LowpDType::kBf16) {
    return UnimplementedError(w + " need bf16 training (fp16 and fp32 upload the host's fp32 "
                              "compute copy)");
  }
  if (spec.stream_weights) {
    return UnimplementedError(w + " with streamed weights: streaming reads the host's whole "
                              "weights (--weights resident)");
  }
  if (!spec.device_pieces.empty()) {
    return UnimplementedError(w + " with device pieces (--gpu-tail-buckets)");
  }
  const int64_t need = kStagedSlots * spec.host_window;
  if (spec.host_window > numel || static_cast<int64_t>(spec.h_grads.size()) < need ||
      static_cast<int64_t>(spec.h_weights16.size()) < need || !spec.h_weights32.empty()) {
    return InvalidArgumentError(w + ": the host buffers hold fewer than " +
                                std::to_string(kStagedSlots) + " windows of " +
                                std::to_string(spec.host_window) + " elements (at most the " +
                                std::to_string(numel) + " of the model)");
  }
  return Status::Ok();
}

Result<std::vector<ExchangeChunk>> PlanReduceChunks(const DeviceReduceSpec& spec, int ranks,
                                                    int64_t numel, int64_t chunk) {
  const std::string who = "the devices' reduction";
  if (chunk < 1 || ranks < 1 || spec.block < 0) {
    return InvalidArgumentError(who + ": chunks of " + std::to_string(chunk) + " elements of " +
                                std::to_string(ranks) + " blocks of " + std::to_string(spec.block));
  }
  // Every block's [b, b + n), each rank's recv_n = n of this one's.
  std::vector<ExchangeChunk> chunks;
  for (int64_t b = 0; b < spec.block; b += chunk) {
    const int64_t n = std::min(chunk, spec.block - b);
    chunks.push_back({b, std::vector<int64_t>(static_cast<size_t>(ranks), n), n, {}});
  }
  // Pieces in block order, so that each chunk's copies come in packed order.
  std::vector<FlatPiece> pieces = spec.pieces;
  std::sort(pieces.begin(), pieces.end(), [](const FlatPiece& a, const FlatPiece& b) {
    return a.block != b.block ? a.block < b.block : a.flat_offset < b.flat_offset;
  });
  for (const FlatPiece& pc : pieces) {
    if (pc.block < 0 || pc.block >= ranks || pc.n < 0 || pc.flat_offset < 0 ||
        pc.flat_offset > spec.block - pc.n || pc.model_offset < 0 ||
        pc.model_offset > numel - pc.n) {
      return InvalidArgumentError(
          who + ": the piece of " + std::to_string(pc.n) + " elements at model element " +
          std::to_string(pc.model_offset) + " -> block " + std::to_string(pc.block) + " element " +
          std::to_string(pc.flat_offset) + " is outside the model (" + std::to_string(numel) +
          "), its block (" + std::to_string(spec.block) + ") or the ranks (" +
          std::to_string(ranks) + ")");
    }
    // A piece may cross chunk boundaries: a copy per chunk it touches.
    for (int64_t at = pc.flat_offset; at < pc.flat_offset + pc.n;) {
      ExchangeChunk& c = chunks[static_cast<size_t>(at / chunk)];
      const int64_t len = std::min(pc.flat_offset + pc.n, c.begin + c.recv_n) - at;
      c.copies.push_back({pc.model_offset + (at - pc.flat_offset),
                          int64_t{pc.block} * c.recv_n + (at - c.begin), len});
      at += len;
    }
  }
  return chunks;
}

Result<std::vector<ExchangeChunk>> PlanBucketChunks(const BucketExchange& ex, int ranks,
                                                    int64_t chunk) {
  const bool all_reduce = ex.send_counts.empty();
  const int64_t packed = ex.packed();
  int64_t sent = 0, longest = ex.sum_n;
  for (int64_t c : ex.send_counts) {
    sent += c;
    longest = std::max(longest, c);
  }
  const bool counts_ok =
      all_reduce ? ex.recv_counts.empty() && packed == ex.sum_n
                 : static_cast<int>(ex.send_counts.size()) == ranks &&
                       static_cast<int>(ex.recv_counts.size()) == ranks && sent == packed &&
                       std::all_of(ex.recv_counts.begin(), ex.recv_counts.end(),
                                   [&](int64_t c) { return c == ex.sum_n; }) &&
                       std::all_of(ex.send_counts.begin(), ex.send_counts.end(),
                                   [](int64_t c) { return c >= 0; });
  if (chunk < 1 || ex.sum_n < 0 || !counts_ok) {
    return InvalidArgumentError("bucket exchange: " + std::to_string(packed) +
                                " packed floats, a sum of " + std::to_string(ex.sum_n) +
                                ", counts for " + std::to_string(ex.send_counts.size()) +
                                " of " + std::to_string(ranks) + " ranks, chunks of " +
                                std::to_string(chunk) + " do not agree");
  }
  // The segments (one per rank; ZeRO-0: the whole pack) and where each starts in the pack.
  const std::vector<int64_t> segments =
      all_reduce ? std::vector<int64_t>{packed} : ex.send_counts;
  std::vector<ExchangeChunk> chunks;
  for (int64_t b = 0; b < longest; b += chunk) {
    ExchangeChunk c;
    c.begin = b;
    c.recv_n = std::clamp<int64_t>(ex.sum_n - b, 0, chunk);
    int64_t seg_start = 0, to = 0;
    size_t range = 0;
    int64_t range_start = 0;  // the pack element where ex.pack[range] starts
    for (const int64_t seg : segments) {
      const int64_t len = std::clamp<int64_t>(seg - b, 0, chunk);
      if (!all_reduce) c.send_counts.push_back(len);
      // Pack elements [seg_start + b, + len) from the ranges that hold them.
      int64_t at = seg_start + b;
      const int64_t end = at + len;
      while (at < end) {
        while (range_start + ex.pack[range].n <= at) range_start += ex.pack[range++].n;
        const BucketExchange::Range& r = ex.pack[range];
        const int64_t n = std::min(end, range_start + r.n) - at;
        c.copies.push_back({r.model_offset + (at - range_start), to, n});
        to += n;
        at += n;
      }
      seg_start += seg;
    }
    chunks.push_back(std::move(c));
  }
  return chunks;
}

Status ExchangeOnHost(std::span<const ExchangeChunk> chunks, Communicator& comm,
                      std::span<const float> grads, std::vector<float>& send,
                      std::vector<float>& recv, std::span<float> out) {
  const auto ranks = static_cast<size_t>(comm.size());
  std::vector<int64_t> recv_counts(ranks);
  for (const ExchangeChunk& c : chunks) {
    if (c.recv_n > 0 && c.begin + c.recv_n > static_cast<int64_t>(out.size())) {
      return InvalidArgumentError("exchange: a chunk ends at " +
                                  std::to_string(c.begin + c.recv_n) + ", past the " +
                                  std::to_string(out.size()) + " floats of its result");
    }
    // (A rank whose part of a bucket is shorter than another's takes part with nothing.)
    const std::span<float> mine =
        c.recv_n > 0 ? out.subspan(static_cast<size_t>(c.begin), static_cast<size_t>(c.recv_n))
                     : std::span<float>();
    const bool all_reduce = c.send_counts.empty();
    const int64_t packed = c.packed();
    if (!all_reduce && send.size() < static_cast<size_t>(packed)) {
      send.resize(static_cast<size_t>(packed));
    }
    float* to = all_reduce ? mine.data() : send.data();
    int64_t copied = 0;
    for (const GradCopy& cp : c.copies) copied += cp.n;
    if (copied < packed) std::fill(to, to + packed, 0.0f);  // a flat view's padding
    for (const GradCopy& cp : c.copies) {
      // memmove: an all-reduce in place copies a range onto itself.
      std::memmove(to + cp.to, grads.data() + cp.from, static_cast<size_t>(cp.n) * 4);
    }
    if (all_reduce) {
      UCP_RETURN_IF_ERROR(comm.AllReduceDeterministic(mine, SumOrder::kRankOrder));
      continue;
    }
    const size_t received = static_cast<size_t>(c.recv_n) * ranks;
    if (recv.size() < received) recv.resize(received);
    std::fill(recv_counts.begin(), recv_counts.end(), c.recv_n);
    const std::span<float> in = std::span<float>(recv).first(received);
    const auto sent = std::span<const float>(send).first(static_cast<size_t>(packed));
    UCP_RETURN_IF_ERROR(comm.AllToAllV(sent, c.send_counts, in, recv_counts));
    UCP_RETURN_IF_ERROR(OrderedSum(in, comm.size(), mine, SumOrder::kRankOrder));
  }
  return Status::Ok();
}

Result<std::vector<std::vector<ExchangeChunk>>> PlanDeviceBuckets(const TrainDeviceSpec& spec,
                                                                   int64_t numel, int64_t chunk,
                                                                   const char* who) {
  std::vector<std::vector<ExchangeChunk>> out;
  if (spec.reduce.comm == nullptr || spec.reduce.buckets.empty()) return out;
  for (size_t k = 0; k < spec.reduce.buckets.size(); ++k) {
    const BucketExchange& ex = spec.reduce.buckets[k];
    for (const BucketExchange::Range& r : ex.pack) {
      if (r.n < 0 || r.model_offset < 0 || r.model_offset > numel - r.n) {
        return InvalidArgumentError(std::string(who) + ": grad group " + std::to_string(k) +
                                    "'s exchange reads [" + std::to_string(r.model_offset) +
                                    ", +" + std::to_string(r.n) + "), outside the model's " +
                                    std::to_string(numel) + " elements");
      }
    }
    UCP_ASSIGN_OR_RETURN(auto chunks, PlanBucketChunks(ex, spec.reduce.comm->size(), chunk),
                         std::string(who) + ": grad group " + std::to_string(k));
    out.push_back(std::move(chunks));
  }
  return out;
}

Status CheckReduceOutput(std::span<const float> out, int64_t want, const char* who,
                         const char* what) {
  if (static_cast<int64_t>(out.size()) == want) return Status::Ok();
  return InvalidArgumentError(std::string(who) + ": " + what + " holds " +
                              std::to_string(out.size()) + " floats, not " + std::to_string(want));
}

Result<std::vector<ExchangeChunk>> PlanDeviceReduce(const TrainDeviceSpec& spec, int64_t numel,
                                                    int64_t chunk, const char* who) {
  if (spec.reduce.comm == nullptr) return std::vector<ExchangeChunk>{};
  if (spec.stream_weights || spec.host_window != 0 || !spec.device_pieces.empty()) {
    return InvalidArgumentError(std::string(who) +
                                ": the reduction on the devices needs "
                                "resident weights and whole host buffers, without device pieces");
  }
  if (!spec.reduce.buckets.empty()) {
    if (spec.reduce.all_reduce || spec.reduce.block != 0 || !spec.reduce.pieces.empty()) {
      return InvalidArgumentError(std::string(who) + ": the buckets' exchanges take no flat "
                                  "view and no all-reduce of their own");
    }
    return std::vector<ExchangeChunk>{};  // (PlanDeviceBuckets plans them)
  }
  if (spec.reduce.all_reduce) {
    if (spec.reduce.block != 0 || !spec.reduce.pieces.empty()) {
      return InvalidArgumentError(std::string(who) + ": an all-reduce of the gradients takes no "
                                  "flat view (block and pieces)");
    }
    BucketExchange whole;  // the model's gradient, all-reduced into the host's
    whole.pack = {{0, numel}};
    whole.sum_n = numel;
    return PlanBucketChunks(whole, spec.reduce.comm->size(), chunk);
  }
  return PlanReduceChunks(spec.reduce, spec.reduce.comm->size(), numel, chunk);
}

Result<std::unique_ptr<TrainDevice>> MakeCpuTwinDevice(const TrainDeviceSpec& spec) {
  UCP_ASSIGN_OR_RETURN(Model model, Model::Create(spec.model, spec.max_batch, spec.seq_len,
                                                  spec.threads, spec.sp_comm, spec.recompute));
  const int64_t n = model.num_params();
  // As the CUDA device: bf16 training needs no host fp32 weights (may be empty); staged host
  // buffers are windows (and neither streamed nor with device pieces).
  const auto w32 = static_cast<int64_t>(spec.h_weights32.size());
  if (spec.host_window != 0) {
    UCP_RETURN_IF_ERROR(CheckStagedSpec(spec, n, "twin device"));
  } else if (static_cast<int64_t>(spec.h_grads.size()) != n ||
      (w32 != n && !(w32 == 0 && spec.weights == LowpDType::kBf16)) ||
      (spec.weights != LowpDType::kFp32 && static_cast<int64_t>(spec.h_weights16.size()) != n)) {
    return InvalidArgumentError("twin device: host buffers do not hold the model's " +
                                std::to_string(n) + " parameters");
  }
  UCP_ASSIGN_OR_RETURN(auto ranges, GradGroupRanges(spec.model));
  const int64_t chunk = spec.reduce.chunk > 0 ? spec.reduce.chunk : kTwinReduceChunk;
  UCP_ASSIGN_OR_RETURN(auto chunks, PlanDeviceReduce(spec, n, chunk, "twin device"));
  if (spec.stream_weights) {
    if (!spec.device_pieces.empty()) {
      return InvalidArgumentError("twin device: streamed weights hold no device pieces "
                                  "(--gpu-tail-buckets needs resident weights)");
    }
    return std::unique_ptr<TrainDevice>(
        std::make_unique<CpuTwinStreamedDevice>(spec, std::move(model), std::move(ranges)));
  }
  UCP_ASSIGN_OR_RETURN(auto buckets, PlanDeviceBuckets(spec, n, chunk, "twin device"));
  return std::unique_ptr<TrainDevice>(std::make_unique<CpuTwinDevice>(
      spec, std::move(model), std::move(ranges), std::move(chunks), std::move(buckets)));
}

}  // namespace ucp::offload
