// DeepSpeed checkpoints as a CheckpointSource (see deepspeed_source.h).
#include "ucp/api/deepspeed_source.h"

#include <tbb/parallel_for.h>

#include <atomic>
#include <mutex>

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/deepspeed_source.h"

namespace ucp::api {
namespace {

using convert::TensorInfo;

class DeepSpeedSource final : public CheckpointSource {
 public:
  DeepSpeedSource(std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors, CheckpointMeta meta)
      : tensors_(std::move(tensors)), meta_(std::move(meta)) {}
  const CheckpointMeta& meta() const override { return meta_; }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    return tensors_->ReadFlatRange(t, begin, end, out);
  }
  std::vector<TensorInfo> StoredTensors() const override { return tensors_->tensors(); }
  // The records are independent, so they are streamed in parallel (the executor's thread limit
  // applies); the first failure in record order is reported.
  Status VerifyChecksums() const override {
    const int64_t n = tensors_->num_records();
    std::vector<Status> status(static_cast<size_t>(n));
    std::atomic<bool> failed{false};
    tbb::parallel_for(
        int64_t{0}, n,
        [&](int64_t i) {
          if (failed.load(std::memory_order_relaxed)) return;
          status[static_cast<size_t>(i)] = tensors_->VerifyRecord(i);
          if (!status[static_cast<size_t>(i)].ok()) failed = true;
        },
        tbb::simple_partitioner());
    for (Status& s : status) UCP_RETURN_IF_ERROR(std::move(s));
    return Status::Ok();
  }

 private:
  std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors_;
  CheckpointMeta meta_;
};

}  // namespace

Result<std::unique_ptr<CheckpointSource>> OpenDeepSpeedSource(const std::filesystem::path& dir,
                                                              const std::filesystem::path& data_dir,
                                                              const std::string& model) {
  deepspeed::OpenOptions options;
  options.model = model;
  options.data_dir = data_dir;
  UCP_ASSIGN_OR_RETURN(deepspeed::DeepSpeedCheckpoint ck,
                       deepspeed::DeepSpeedCheckpoint::Open(dir, options));
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors,
                       deepspeed::DeepSpeedTensorSource::Open(ck));
  CheckpointMeta meta;
  meta.format = Format::kDeepSpeed;
  meta.layout = ck.view();
  meta.spec = ck.spec();
  meta.model = ck.model();
  meta.step = ck.step();
  const std::vector<double>& h = ck.hyper();
  meta.optimizer_kind = h[4] != 0 ? "adamw" : "adam";
  meta.optimizer_hyper = {
      {"lr", h[0]}, {"beta1", h[1]}, {"beta2", h[2]}, {"eps", h[3]}, {"weight_decay", h[4]}};
  meta.optimizer_states = {"fp32", "exp_avg", "exp_avg_sq"};
  meta.framework = ck.naming() == deepspeed::Naming::kPlain ? "deepspeed" : "megatron-deepspeed";
  meta.source_layout = ck.LayoutString();
  meta.source_notes = ck.dir().filename().string() + ", " + ck.optimizer() + ", " +
                      std::string(deepspeed::NamingName(ck.naming())) +
                      " names, hyper-parameters from " + ck.model_origin();
  meta.client_state_json = "{\"deepspeed\":" + ck.client_state_json() + "}";
  meta.deepspeed_dir = ck.dir();
  return std::unique_ptr<CheckpointSource>(
      new DeepSpeedSource(std::move(tensors), std::move(meta)));
}

}  // namespace ucp::api
