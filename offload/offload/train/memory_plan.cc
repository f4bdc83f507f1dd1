#include "offload/train/memory_plan.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "offload/train/device.h"
#include "ucp/base/status.h"
#include "ucp/base/status_macros.h"
#include "ucp/layout/layout.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

std::string FormatBytes(int64_t b) {
  char buf[32];
  const double d = static_cast<double>(b);
  if (b >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", d / static_cast<double>(int64_t{1} << 30));
  } else if (b >= (int64_t{1} << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", d / static_cast<double>(int64_t{1} << 20));
  } else if (b >= 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", d / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%" PRId64 " B", b);
  }
  return buf;
}

namespace {

std::string Bytes(int64_t b) { return FormatBytes(b); }

// This rank's optimizer-state elements: the trainer's ZeRO block (Trainer::Impl::SetUpLayout
// cuts the same partitions; memory_plan_test compares the two).
Result<int64_t> BlockElements(const ParamTable& table, const std::vector<int>& groups,
                              const layout::Layout& lay) {
  if (lay.zero_stage == 0) return table.total;
  const int blocks = layout::NumZeroFragments(lay, false);
  if (lay.zero_stage <= 2) {
    std::vector<int64_t> numels[2];
    for (size_t i = 0; i < table.params.size(); ++i) {
      numels[groups[i] == 0 ? 0 : 1].push_back(table.params[i].numel);
    }
    int64_t block = 0;
    for (const auto& n : numels) {
      UCP_ASSIGN_OR_RETURN(layout::ZeroPartition p, layout::PartitionFlat(n, blocks));
      block += p.fragment_size;
    }
    return block;
  }
  int64_t block = 0;
  for (const ParamInfo& p : table.params) {
    UCP_ASSIGN_OR_RETURN(layout::ZeroPartition z, layout::PartitionParam(p.numel, blocks));
    block += z.fragment_size;
  }
  return block;
}

}  // namespace

int64_t MeasureHostMemory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

CastChoice ChooseCastSide(const PlanMachine& m, int64_t elements) {
  CastChoice c;
  c.elements = elements;
  c.side = CastSide::kHost;
  if (!(m.link_bytes_per_s > 0) || !(m.host_cast_per_s > 0) || !(m.device_cast_per_s > 0)) {
    return c;
  }
  const double e = static_cast<double>(elements);
  c.measured = true;
  c.device_seconds = 4.0 * e / m.link_bytes_per_s + e / m.device_cast_per_s;
  c.host_seconds = 2.0 * e / m.link_bytes_per_s + e / m.host_cast_per_s;
  c.side = c.device_seconds < c.host_seconds ? CastSide::kDevice : CastSide::kHost;
  return c;
}

std::string RecomputeNote(Recompute recompute, int64_t layers) {
  const int64_t r = recompute.Of(layers);
  if (r == 0) return "";
  return (r == layers ? "all " + Str(layers) : "the first " + Str(r) + " of " + Str(layers)) +
         " layers recomputed in backward";
}

namespace {

// The option that asks for `r` recomputed layers of `layers`.
std::string RecomputeOption(Recompute r, int64_t layers) {
  return "--recompute " + (r.Of(layers) == layers ? std::string("all") : Str(r.Of(layers)));
}

// PlanMemory; `hints`: the verdict also says what would make a side fit that does not (the
// searches for those plan without hints).
Result<MemoryPlan> Plan(const PlanInput& in, const PlanMachine& machine, bool hints);

}  // namespace

Result<Recompute> ChooseRecompute(PlanInput in, const PlanMachine& machine, bool device) {
  if ((device ? machine.device_bytes : machine.host_bytes) <= 0) return Recompute::None();
  auto fits = [&](int64_t r) -> Result<bool> {
    in.recompute = Recompute{r};
    UCP_ASSIGN_OR_RETURN(const MemoryPlan p, Plan(in, machine, false));
    return device ? p.device_fits : p.cpu_fits;
  };
  const int64_t L = in.config.layers;
  // With --weights auto, the count that fits with the weights resident where any count does: a
  // rerun forward costs the GPU compute, streaming costs host-link bandwidth that the offloaded
  // optimizer's gradients and weights already need. Else (even all do not fit resident) the
  // placement --weights auto picks, streamed.
  if (device && in.weights == WeightChoice::kAuto) {
    in.weights = WeightChoice::kResident;
    UCP_ASSIGN_OR_RETURN(const bool all_fit_resident, fits(L));
    if (!all_fit_resident) in.weights = WeightChoice::kAuto;
  }
  UCP_ASSIGN_OR_RETURN(const bool none_fits, fits(0));
  if (none_fits) return Recompute::None();
  UCP_ASSIGN_OR_RETURN(const bool all_fit, fits(L));
  if (!all_fit) return Recompute::All();
  // Memory falls as r grows (r layers share one slot), so the smallest r that fits is found by
  // bisection: fits(lo) is false, fits(hi) true.
  int64_t lo = 0, hi = L;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    UCP_ASSIGN_OR_RETURN(const bool f, fits(mid));
    (f ? hi : lo) = mid;
  }
  return hi == L ? Recompute::All() : Recompute{hi};
}

Result<MemoryPlan> PlanMemory(const PlanInput& in, const PlanMachine& machine) {
  return Plan(in, machine, true);
}

namespace {

// tail[n]: the elements of the last n grad groups, n in [0, groups].
Result<std::vector<int64_t>> TailElements(const ModelConfig& config) {
  UCP_ASSIGN_OR_RETURN(const ParamTable table, ModelParamTable(config));
  std::vector<int64_t> tail(table.groups.size() + 1, 0);
  for (size_t n = 1; n < tail.size(); ++n) {
    const GradGroup& g = table.groups[table.groups.size() - n];
    tail[n] = tail[n - 1];
    for (int64_t p = g.first_param; p < g.end_param; ++p) {
      tail[n] += table.params[static_cast<size_t>(p)].numel;
    }
  }
  return tail;
}

}  // namespace

Result<int64_t> TailBucketElements(const ModelConfig& config, int n) {
  UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> tail, TailElements(config));
  if (n < 0 || n >= static_cast<int>(tail.size())) {
    return InvalidArgumentError("--gpu-tail-buckets " + Str(n) + ": must be in [0, " +
                                Str(static_cast<int64_t>(tail.size()) - 1) +
                                "] (the model's grad groups)");
  }
  return tail[static_cast<size_t>(n)];
}

Result<int> ChooseTailBuckets(PlanInput in, const PlanMachine& machine) {
  if (machine.device_bytes <= 0 || in.host_window > 0 || in.weights == WeightChoice::kStreamed) {
    return 0;
  }
  in.device_optimizer_elements = 0;
  if (in.weights == WeightChoice::kAuto) {
    // Where --weights auto streams, the weights are not resident: no tail.
    UCP_ASSIGN_OR_RETURN(const MemoryPlan p, Plan(in, machine, false));
    if (p.placement == WeightPlacement::kStreamed) return 0;
    in.weights = WeightChoice::kResident;
  }
  UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> tail, TailElements(in.config));
  PlanMachine m = machine;
  m.device_reserve_bytes +=
      static_cast<int64_t>(kTailHeadroom * static_cast<double>(machine.device_bytes));
  auto fits = [&](size_t n) -> Result<bool> {
    in.device_optimizer_elements = tail[n];
    UCP_ASSIGN_OR_RETURN(const MemoryPlan p, Plan(in, m, false));
    return p.device_fits;
  };
  // Device memory grows with n: bisection for the largest n that fits (fits(lo) is true,
  // fits(hi) false).
  UCP_ASSIGN_OR_RETURN(const bool none_fits, fits(0));
  if (!none_fits) return 0;
  const size_t groups = tail.size() - 1;
  UCP_ASSIGN_OR_RETURN(const bool all_fit, fits(groups));
  if (all_fit) return static_cast<int>(groups);
  size_t lo = 0, hi = groups;
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    UCP_ASSIGN_OR_RETURN(const bool f, fits(mid));
    (f ? lo : hi) = mid;
  }
  return static_cast<int>(lo);
}

namespace {

Result<MemoryPlan> Plan(const PlanInput& in, const PlanMachine& machine, bool hints) {
  if (in.micro_batch < 1 || in.seq_len < 1 || in.threads < 1) {
    return InvalidArgumentError("memory plan: micro_batch=" + Str(in.micro_batch) +
                                ", seq_len=" + Str(in.seq_len) + ", threads=" + Str(in.threads) +
                                " must be >= 1");
  }
  if (in.dp < 1 || in.sp < 1 || in.zero_stage < 0 || in.zero_stage > 3) {
    return InvalidArgumentError("memory plan: dp=" + Str(in.dp) + ", sp=" + Str(in.sp) +
                                ", zero=" + Str(in.zero_stage) + " out of range");
  }
  UCP_ASSIGN_OR_RETURN(ParamTable table, ModelParamTable(in.config));
  if (in.optimizer_group.size() != table.params.size()) {
    return InvalidArgumentError("memory plan: " + Str(static_cast<int64_t>(in.optimizer_group.size())) +
                                " optimizer groups for " +
                                Str(static_cast<int64_t>(table.params.size())) + " parameters");
  }
  if (in.seq_len % in.sp != 0) {
    return InvalidArgumentError("memory plan: seq_len=" + Str(in.seq_len) +
                                " does not divide by sp=" + Str(in.sp));
  }
  UCP_ASSIGN_OR_RETURN(int64_t act, ActivationBytes(in.config, in.micro_batch, in.seq_len,
                                                    in.threads, in.sp, in.recompute));
  // With a device the host's model is only the parameter table (a micro-batch of one token),
  // and the device holds the CUDA model's buffers (under SP its shard of the positions and
  // Ulysses' buffers).
  UCP_ASSIGN_OR_RETURN(int64_t host_act, ActivationBytes(in.config, 1, 1, in.threads, 1));
  // At sp > 1 a GPU whose sp exchanges go through the host pins their two staging buffers (with
  // NCCL it does not: an upper bound).
  UCP_ASSIGN_OR_RETURN(const int64_t staged_exchange,
                       UlyssesExchangeFloats(in.config, in.micro_batch, in.seq_len, in.sp));
  host_act += 2 * staged_exchange * 4;
  UCP_ASSIGN_OR_RETURN(int64_t device_act,
                       DeviceActivationBytes(in.config, in.micro_batch, in.seq_len,
                                             in.gpu_gemm_bf16 && in.dtype == LowpDType::kBf16,
                                             in.gpu_flash_attention, in.sp, in.recompute));
  layout::Layout lay;
  lay.dp = in.dp;
  lay.sp = in.sp;
  lay.zero_stage = in.zero_stage;
  UCP_ASSIGN_OR_RETURN(int64_t block, BlockElements(table, in.optimizer_group, lay));
  const int blocks = in.zero_stage == 0 ? 1 : layout::NumZeroFragments(lay, false);
  const int world = in.dp * in.sp;

  const int64_t n = table.total;
  const bool lowp = in.dtype != LowpDType::kFp32;
  const int64_t wb = lowp ? 2 : 4;  // training-dtype bytes per element
  // Streaming (device.h TrainDeviceSpec::stream_weights) keeps the head's and the embeddings'
  // groups (the first and last of table.groups) and two windows of the largest layer.
  int64_t window = 0, head = 0, embeddings = 0;
  for (size_t k = 0; k < table.groups.size(); ++k) {
    const GradGroup& g = table.groups[k];
    int64_t e = 0;
    for (int64_t i = g.first_param; i < g.end_param; ++i) e += table.params[i].numel;
    if (k == 0) {
      head = e;
    } else if (k + 1 == table.groups.size()) {
      embeddings = e;
    } else {
      window = std::max(window, e);
    }
  }
  const int64_t streamed_elems = WeightWindowBook::ArenaElements(head, embeddings, window);

  MemoryPlan plan;
  plan.machine = machine;
  plan.params = n;
  plan.block = block;
  // Rows with the RESIDENT placement's device/host figures; streaming adjusts three of them.
  auto& rows = plan.rows;
  // The GPU columns are what --device cuda allocates today: the device holds the training-dtype
  // weights, an fp32 compute copy (norms and embeddings read it; the fp32 GEMMs too) and the
  // gradients; the host keeps its own weights and gradients (uploads, the norm, checkpoints) and,
  // except in bf16 (the device widens its own), the compute copy fp16/fp32 uploads.
  rows.push_back({MemClass::kWeights, "weights (" + std::string(LowpDTypeName(in.dtype)) + ")",
                  lowp ? n * 2 : 0, lowp ? n * 2 : 0, lowp ? n * 2 : 0,
                  lowp ? "the training copy the optimizer writes (the bf16 GEMMs read it)"
                       : "fp32 training: the compute copy below is the weights"});
  const bool bf16 = in.dtype == LowpDType::kBf16;
  // Beside the bf16 GEMMs the device packs its copy to what they do not read (cuda_model.h
  // Fp32Layout::kPacked): the norms, biases and embeddings.
  int64_t packed = n;
  if (bf16 && in.gpu_gemm_bf16) {
    UCP_ASSIGN_OR_RETURN(auto ranges, Fp32ReadRanges(in.config));
    packed = 0;
    for (const auto& [b, e] : ranges) packed += e - b;
  }
  rows.push_back({MemClass::kComputeCopy, "weights, fp32 compute copy", n * 4, packed * 4,
                  bf16 ? 0 : n * 4,
                  !lowp ? "the weights"
                  : packed < n ? "widened from the weights (GPU: on the device only, packed to the "
                                 "norms, biases and embeddings the bf16 GEMMs do not read)"
                  : bf16 ? "widened from the weights (GPU: on the device only)"
                         : "widened from the weights (GPU: and on the host, which uploads it)"});
  rows.push_back({MemClass::kGradients, "gradients (fp32)", n * 4, n * 4, n * 4,
                  "accumulated over micro-batches (GPU: and their host copy)"});
  // Staged host buffers keep windows instead of the host's copies (bf16: no host compute copy).
  const int64_t hw = std::min(in.host_window, n);
  plan.host_window = hw;
  if (hw > 0) {
    rows[0].host_bytes = kStagedSlots * hw * 2;
    rows[0].note = "the training copy (GPU: on the device; the host stages a window of it)";
    rows[2].host_bytes = kStagedSlots * hw * 4;
    rows[2].note = "accumulated over micro-batches (GPU: on the device, which sums their "
                   "norm; the host stages a window of them for Adam)";
  }
  rows.push_back({MemClass::kOptimizer, "master + exp_avg + exp_avg_sq (fp32)", 3 * block * 4,
                  3 * in.device_optimizer_elements * 4, 3 * block * 4,
                  "this rank's ZeRO block of " + Str(block) + " elements" +
                      (blocks > 1 ? " (1/" + Str(blocks) + ")" : "") +
                      (in.device_optimizer_elements > 0
                           ? " (GPU: and the device Adam's " + Str(in.device_optimizer_elements) +
                                 (in.device_optimizer_groups > 0
                                      ? ", the last " + Str(in.device_optimizer_groups) +
                                            " grad groups,"
                                      : std::string()) +
                                 " on the device)"
                           : "")});
  const int64_t zero_scratch = blocks > 1 ? (1 + static_cast<int64_t>(blocks)) * block * 4 : 0;
  // Staged (trainer.cc StagedReduceScatter): the exchange runs in a gradient window, so only
  // the reduced block is left.
  const int64_t gpu_zero_scratch = blocks > 1 && hw > 0 ? block * 4 : zero_scratch;
  rows.push_back({MemClass::kZeroScratch, "ZeRO reduce-scatter buffers", zero_scratch, 0,
                  gpu_zero_scratch,
                  blocks > 1 ? (hw > 0 ? "the reduced block (host; the exchange runs in a "
                                         "gradient window)"
                                       : "the reduced block and the exchange scratch (host)")
                             : "none at one fragment"});
  rows.push_back({MemClass::kActivations, "activations + scratch", act, device_act, host_act,
                  "micro-batch " + Str(in.micro_batch) + " x " + Str(in.seq_len) + " tokens" +
                      (in.sp > 1 ? " (1/" + Str(in.sp) + " of the positions)" : "") +
                      (in.recompute.Of(in.config.layers) > 0
                           ? ", " + RecomputeNote(in.recompute, in.config.layers)
                           : "") +
                      ", fp32 (GPU: the CUDA model's, its GEMM and attention scratch included" +
                      (in.sp > 1 ? "; host: the sp exchanges' pinned staging, unused over NCCL"
                                 : "") +
                      ")"});
  // The speculation snapshots: master, exp_avg and exp_avg_sq of the block.
  const int64_t snapshots = in.overlap && in.speculate ? 3 * block * 4 : 0;
  int64_t staging = 0;
  if (in.overlap) {
    staging = snapshots + (world == 1 ? block * 4 : 0) + (lowp ? block * 2 : 0);
  }
  // On a GPU the gradients cross into the trainer's own pinned buffer (one process) or are
  // reduced into its ZeRO buffers (several), and one process's weights leave from its own
  // buffer: the pipeline adds its snapshots, and with several processes at one fragment the
  // weights out.
  const int64_t gpu_staging =
      in.overlap ? snapshots + (world > 1 && blocks == 1 && lowp ? block * 2 : 0) : 0;
  rows.push_back({MemClass::kPipelineStaging, "optimizer pipeline staging", staging, 0,
                  gpu_staging,
                  !in.overlap    ? "none with --pipeline sync"
                  : in.speculate ? "snapshots for speculation, gradients as they cross, weights "
                                   "out (GPU: the snapshots)"
                                 : "gradients as they cross, weights out (no speculation: no "
                                   "snapshots)"});
  const int64_t save = in.async_save ? n * wb + 3 * block * 4 : 0;
  rows.push_back({MemClass::kSaveStaging, "checkpoint staging (during a save)", save, 0, save,
                  in.async_save ? "a copy of what the checkpoint holds, so training goes on"
                                : "none with --sync-save: the live state is written"});

  auto sum = [&](int64_t MemoryRow::*field) {
    int64_t s = 0;
    for (const MemoryRow& r : rows) s += r.*field;
    return s;
  };
  const int64_t usable = machine.device_bytes > 0
                             ? std::max<int64_t>(0, machine.device_bytes -
                                                        machine.device_reserve_bytes)
                             : 0;
  // The device's need with the weights resident (the rows so far).
  const int64_t resident_total = sum(&MemoryRow::device_bytes);
  // Streaming helps only where the windows hold less than all the layers (a model of two
  // layers, say, would hold them all and the slack besides).
  const int64_t streamed_total = resident_total - rows[0].device_bytes - rows[1].device_bytes -
                                 rows[2].device_bytes + streamed_elems * ((bf16 ? 2 : 0) + 8);
  const bool stream = in.weights == WeightChoice::kStreamed ||
                      (in.weights == WeightChoice::kAuto && hw == 0 && machine.device_bytes > 0 &&
                       resident_total > usable && streamed_total < resident_total);
  if (stream) {
    // Streamed: the embeddings, the head and two layer windows of weights, compute copy and
    // gradients on the device, all weights pinned on the host (each layer's gradients leave as
    // backward completes them).
    plan.placement = WeightPlacement::kStreamed;
    rows[0].device_bytes = bf16 ? streamed_elems * 2 : 0;  // fp16 crosses as the fp32 copy
    rows[0].note = "streamed: embeddings, head and 2 layer windows on the device, all pinned on "
                   "the host";
    rows[1].device_bytes = streamed_elems * 4;
    rows[1].note = "streamed: embeddings, head and 2 layer windows on the device";
    rows[2].device_bytes = streamed_elems * 4;
    rows[2].note = "streamed: embeddings, head and 2 layer windows; each layer's leave as "
                   "backward ends it";
  }
  plan.cpu_total = sum(&MemoryRow::cpu_bytes);
  plan.device_total = sum(&MemoryRow::device_bytes);
  plan.host_total = sum(&MemoryRow::host_bytes);
  plan.device_fits = machine.device_bytes <= 0 || plan.device_total <= usable;
  plan.host_fits = machine.host_bytes <= 0 || plan.host_total <= machine.host_bytes;
  plan.cpu_fits = machine.host_bytes <= 0 || plan.cpu_total <= machine.host_bytes;
  plan.cast = ChooseCastSide(machine, block);

  std::string v;
  const bool resident = plan.placement == WeightPlacement::kResident;
  const std::string chosen = in.weights == WeightChoice::kAuto ? "what --weights auto picks"
                                                               : "as --weights asks";
  if (machine.device_bytes <= 0) {
    v = std::string("GPU: no device capacity given (--device-memory), weights ") +
        (resident ? "resident" : "streamed per layer (" + chosen + ")");
  } else if (!plan.device_fits) {
    v = std::string("GPU: does not fit: ") + (resident ? "resident" : "streamed") + " it needs " +
        Bytes(plan.device_total) + " of the " +
        Bytes(usable) + " usable (" + Bytes(machine.device_bytes) + " less a " +
        Bytes(machine.device_reserve_bytes) +
        " reserve); lower --micro-batch or --seq-len, or shard the sequence (sp)";
    // Recomputing layers is the one switch that keeps the run's shape: say how many fit.
    if (hints && in.recompute.Of(in.config.layers) < in.config.layers) {
      PlanInput with = in;
      UCP_ASSIGN_OR_RETURN(with.recompute, ChooseRecompute(in, machine, true));
      UCP_ASSIGN_OR_RETURN(const MemoryPlan rc, Plan(with, machine, false));
      const std::string option = RecomputeOption(with.recompute, in.config.layers);
      v += rc.device_fits ? ", or recompute layers (" + option + ": it fits, " +
                                Bytes(rc.device_total) + " with weights " +
                                (rc.placement == WeightPlacement::kResident ? "resident" :
                                                                              "streamed") + ")"
                          : " (not even with " + option + ": " + Bytes(rc.device_total) + ")";
    }
  } else {
    v = std::string("GPU: fits with weights ") +
        (plan.placement == WeightPlacement::kResident ? "resident" : "streamed per layer") +
        " (" + Bytes(plan.device_total) + " of " + Bytes(usable) + " usable)";
    if (!resident) v += " (" + chosen + "; resident it needs " + Bytes(resident_total) + ")";
  }
  if (machine.host_bytes > 0) {
    const std::string staged_note =
        hw == 0                ? ""
        : in.host_window_auto ? ", buffers staged: what --host-buffers auto picks"
                              : ", buffers staged as --host-buffers asks";
    v += plan.host_fits ? "; host side fits (" + Bytes(plan.host_total) + " of " +
                              Bytes(machine.host_bytes) + staged_note + ")"
                        : "; host side does NOT fit (" + Bytes(plan.host_total) + " of " +
                              Bytes(machine.host_bytes) + staged_note + ")";
    // Where the host side does not fit: what would make it, cheapest first. Foreground saves
    // drop the save's staging copy (the step waits for the write); an overlapped run without
    // speculation drops the snapshots (12 B per state element; its Adam then runs after the
    // norm, under the next forward); staged host buffers drop the host's copies of the weights
    // and gradients (bf16 on a device: 6 B/parameter; they cross window by window; --pipeline
    // sync only).
    if (!plan.host_fits) {
      const int64_t save_row = rows[static_cast<size_t>(MemClass::kSaveStaging)].host_bytes;
      const bool can_stage = hw == 0 && bf16 && (world == 1 || blocks > 1) &&
                             !in.overlap;
      const int64_t dw = std::min(kDefaultHostWindow, n);
      // (Several blocks: the exchange scratch goes too; the reduced block stays.)
      const int64_t staged_saving =
          can_stage ? rows[0].host_bytes + rows[2].host_bytes - kStagedSlots * dw * 6 +
                          (blocks > 1 ? static_cast<int64_t>(blocks) * block * 4 : 0)
                    : 0;
      struct Option {
        bool possible;
        int64_t total;
        const char* what;
      };
      const Option options[] = {
          {save_row > 0, plan.host_total - save_row, "--sync-save"},
          {snapshots > 0, plan.host_total - snapshots, "--speculation off"},
          {save_row > 0 && snapshots > 0, plan.host_total - save_row - snapshots,
           "--sync-save --speculation off"},
          {can_stage, plan.host_total - staged_saving, "--host-buffers staged"},
          {save_row > 0 && can_stage, plan.host_total - save_row - staged_saving,
           "--sync-save --host-buffers staged"}};
      const Option* best = nullptr;  // the first that fits, else the smallest
      for (const Option& o : options) {
        if (!o.possible) continue;
        if (o.total <= machine.host_bytes) {
          best = &o;
          break;
        }
        if (best == nullptr || o.total < best->total) best = &o;
      }
      if (best != nullptr) {
        v += std::string(best->total <= machine.host_bytes ? " (it fits with " : " (not even with ") +
             best->what + ": " + Bytes(best->total) + ")";
      }
    }
    v += plan.cpu_fits ? "; the CPU engine fits (" + Bytes(plan.cpu_total) + ")"
                       : "; the CPU engine does NOT fit (" + Bytes(plan.cpu_total) + ")";
    if (!plan.cpu_fits && hints && in.recompute.Of(in.config.layers) < in.config.layers) {
      PlanInput with = in;
      UCP_ASSIGN_OR_RETURN(with.recompute, ChooseRecompute(in, machine, false));
      UCP_ASSIGN_OR_RETURN(const MemoryPlan rc, Plan(with, machine, false));
      v += std::string(rc.cpu_fits ? " (it fits with " : " (not even with ") +
           RecomputeOption(with.recompute, in.config.layers) + ": " + Bytes(rc.cpu_total) + ")";
    }
  }
  plan.verdict = v;
  return plan;
}

}  // namespace

Result<WeightChoice> ParseWeightChoice(const std::string& text) {
  if (text == "auto") return WeightChoice::kAuto;
  if (text == "resident") return WeightChoice::kResident;
  if (text == "streamed") return WeightChoice::kStreamed;
  return InvalidArgumentError("--weights " + text + ": must be auto, resident or streamed");
}

PlanMachine MeasureHost() {
  PlanMachine m;
  m.host_bytes = MeasureHostMemory();
  m.device_bytes = 0;
  m.device_reserve_bytes = 0;
  constexpr size_t kN = size_t{8} << 20;  // 32 MiB of fp32: beyond the caches
  std::vector<float> a(kN), b(kN);
  std::vector<uint16_t> h(kN);
  for (size_t i = 0; i < kN; ++i) a[i] = static_cast<float>(i) * 1e-3f;
  using Clock = std::chrono::steady_clock;
  auto best = [](auto&& fn) {
    double t = std::numeric_limits<double>::infinity();
    for (int k = 0; k < 3; ++k) {
      const auto t0 = Clock::now();
      fn();
      t = std::min(t, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return t;
  };
  const double copy = best([&] { std::memcpy(b.data(), a.data(), kN * sizeof(float)); });
  const double cast = best([&] {
    for (size_t i = 0; i < kN; ++i) h[i] = Bf16FromFloat(a[i]);
  });
  // Keep the results observable so the loops are not optimised away.
  volatile uint16_t sink = static_cast<uint16_t>(h[kN / 2] ^ static_cast<uint16_t>(b[kN / 3]));
  (void)sink;
  m.link_bytes_per_s = static_cast<double>(kN * sizeof(float)) / std::max(copy, 1e-9);
  m.host_cast_per_s = static_cast<double>(kN) / std::max(cast, 1e-9);
  m.device_cast_per_s = m.host_cast_per_s;
  return m;
}

std::string FormatPlan(const MemoryPlan& p) {
  std::ostringstream o;
  char line[256];
  std::snprintf(line, sizeof(line), "%-38s %12s %12s %12s  %s\n", "tensor class", "CPU engine",
                "GPU device", "GPU host", "");
  o << line;
  for (const MemoryRow& r : p.rows) {
    std::snprintf(line, sizeof(line), "%-38s %12s %12s %12s  %s\n", r.name.c_str(),
                  Bytes(r.cpu_bytes).c_str(), Bytes(r.device_bytes).c_str(),
                  Bytes(r.host_bytes).c_str(), r.note.c_str());
    o << line;
  }
  std::snprintf(line, sizeof(line), "%-38s %12s %12s %12s\n", "total",
                Bytes(p.cpu_total).c_str(), Bytes(p.device_total).c_str(),
                Bytes(p.host_total).c_str());
  o << line;
  o << p.verdict << "\n";
  if (p.cast.measured) {
    std::snprintf(line, sizeof(line),
                  "cast: %s (%" PRId64 " weights per step: fp32 over the link + device cast "
                  "%.3f ms, host cast + bf16 over the link %.3f ms)\n",
                  p.cast.side == CastSide::kDevice ? "on the device" : "on the host",
                  p.cast.elements, p.cast.device_seconds * 1e3, p.cast.host_seconds * 1e3);
  } else {
    std::snprintf(line, sizeof(line),
                  "cast: on the host (no link or cast rates: bf16 crosses, half the bytes)\n");
  }
  o << line;
  return o.str();
}

}  // namespace ucp::offload
