// DeepSpeedTensorSource: the tensors of a DeepSpeed checkpoint's ucp layout view
// (DeepSpeedCheckpoint::view(), tp=T,pp=P,dp=1,zero=0) served from the DeepSpeed files, so the
// planner and the executor run on a DeepSpeed checkpoint as on any ucp checkpoint.
//
//   pp<P>.tp<T>/optim/<local>/<state>  fp32, the TP shard: its fragments, in dp order, in the
//       dp*sp optimizer files of (P, T), located by param_slice_mappings and read as byte ranges
//       of single_partition_of_fp32_groups[g] / base_optimizer_state.state[g].<state>, for each
//       optimizer state (DeepSpeedCheckpoint::optimizer_states: exp_avg, momentum_buffer, ...).
//   ZeRO-3: each sub-group's fp32_flat_groups[i] and optimizer_state_dict.state[i] hold this dp
//       rank's ceil(numel / (dp*sp))-element piece of every parameter of the sub-group, in
//       param_shapes order (zero_to_fp32.py's reconstruction); the fragments are derived from that.
//   pp<P>.tp<T>/model/<local>          the training-dtype weight: `module` of
//       mp_rank_XX_model_states.pt (GPTModel, plain) or layer_IDX-model_TT-model_states.pt
//       (GPTModelPipe). The tied embedding GPTModelPipe's last stage holds has no layer file; it is
//       read from the first stage's (DeepSpeed keeps the copies in sync, and the plan's check ops
//       still compare the fp32 / Adam copies of both stages). ZeRO-3 saves no weights: the fp32
//       fragments rounded to the training dtype, as the engine restores them.
//
// A fused QKV that the files hold per-rank-blocks (Megatron-DeepSpeed since PR #441,
// DeepSpeedCheckpoint::qkv_layout) is served in the view's per-group row order (qkv_layout.h).
//
// Every view tensor is resolved to its files, records and fragments once, at Open; a read is a
// hash lookup plus preads, safe from many threads at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/qkv_layout.h"
#include "ucp/exec/executor.h"
#include "ucp/io/torch/torch_file.h"

namespace ucp::deepspeed {

class DeepSpeedTensorSource final : public exec::TensorSource {
 public:
  /// Opens every optimizer file and every file holding module weights of `checkpoint` (pickles
  /// only) and resolves each tensor of convert::DescribeLayout(model, view) with states fp32 and
  /// the checkpoint's optimizer states, plus model. `checkpoint` must have been opened with
  /// bind_model.
  /// Errors: those of TorchFile::Open (kNotFound, kDataLoss for a truncated or corrupt file,
  /// naming it); kDataLoss naming file and parameter for a missing key or partition, a fragment
  /// outside its partition, fragments that do not tile their TP shard exactly, or a module
  /// weight whose dtype or shape is not the view's.
  static Result<std::unique_ptr<DeepSpeedTensorSource>> Open(const DeepSpeedCheckpoint& checkpoint);

  ~DeepSpeedTensorSource() override;

  /// Reads elements [begin, end) of the view tensor `tensor` (by name).
  /// Errors: kNotFound (not a tensor of the view), kInvalidArgument (dtype differs),
  /// kOutOfRange (range outside the tensor or `out` of the wrong size), and the file's read
  /// errors (kDataLoss, kIoError) naming the file.
  Status ReadFlatRange(const convert::TensorInfo& tensor, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override;

  /// The view's tensors as the files hold them (shapes and dtypes from the files).
  const std::vector<convert::TensorInfo>& tensors() const { return infos_; }

  /// Every tensor record of the files opened (those the view reads first), for VerifyRecord.
  int64_t num_records() const { return static_cast<int64_t>(records_.size()); }
  /// Streams record `i` (bounded memory) and compares its CRC-32 with the zip directory's.
  /// Records of legacy (non-zip) files and records whose directory CRC is 0 carry none and pass.
  /// Errors: kDataLoss naming the file and record on a mismatch; read errors.
  Status VerifyRecord(int64_t i) const;
  /// VerifyRecord for every record, in order. Errors: the first failure.
  Status VerifyChecksums() const;
  /// One read of the source (issue 14): every file checks its records' CRC-32 from the bytes
  /// the reads return (TorchFile::VerifyReads). Call before the reads start.
  void BeginVerifiedReads() const;
  /// After the last read: record `i`'s CRC-32 from what the reads covered plus the bytes they
  /// did not, read now (TorchFile::FinishVerifiedReads). Errors: as VerifyRecord.
  Status FinishVerifiedRecord(int64_t i) const;
  /// The first record found corrupt during the reads, or Ok.
  Status VerifiedReadsFailure() const;
  /// Bytes of record `i`; bytes the FinishVerifiedRecord calls read.
  int64_t record_bytes(int64_t i) const;
  int64_t verify_bytes_reread() const;
  /// Whether every file opened is still the one read (device, inode, size, mtime; issue 16 #8).
  /// Errors: kDataLoss naming the file and what changed.
  Status CheckUnchanged() const override;

 private:
  struct File;
  struct Fragment;
  struct Entry;
  struct MoeGroups;
  struct Record {
    int32_t file = 0;
    torch::StorageRecord storage;
  };
  DeepSpeedTensorSource() = default;
  Status ReadModel(const Entry& e, int64_t begin, int64_t end, std::span<std::byte> out) const;
  /// Elements [begin, end) of the shard as the files hold it (the fused QKV's stored order).
  Status ReadStored(const Entry& e, int64_t begin, int64_t end, std::span<std::byte> out) const;
  Status ReadFragments(const Entry& e, int64_t begin, int64_t end, std::span<std::byte> out) const;
  /// ZeRO-3: records file `fi` (data-parallel rank `dp_rank` of tp rank `tp_rank`) sub-group
  /// partitions in `file` and each parameter's piece in `frags` (engine name -> fragments).
  static Status AddZero3Partitions(const DeepSpeedCheckpoint& ck, int tp_rank, int dp_rank,
                                   int32_t fi, const torch::PyValue& osd, File& file,
                                   std::map<std::string, std::vector<Fragment>>& frags);

  std::vector<std::unique_ptr<File>> files_;
  std::vector<std::vector<Fragment>> fragment_lists_;  // per (param, stage, tp): the TP shard
  std::vector<Entry> entries_;                         // per view tensor
  std::unordered_map<std::string, int32_t> by_name_;
  std::vector<convert::TensorInfo> infos_;
  std::vector<Record> records_;
};

}  // namespace ucp::deepspeed
