// The memory plan (issue 12, "adaptive weight placement" and "casting where it is cheapest";
// docs/offload.md, "The memory plan"): what one process of a run holds, by tensor class, and
// where each class lives on a GPU with the optimizer offloaded. `ucp-train --plan` prints it
// before anything is allocated, so a user learns whether a model fits, and how, without trying.
//
// Two columns:
//   * "CPU engine": the bytes the CPU engine allocates for the run (its "device" is host memory).
//     Every figure is computed by the same functions that size the buffers (ActivationBytes, the
//     ZeRO partition of libucp's layout), and memory_plan_test checks each row against a live
//     Trainer's buffers.
//   * "GPU" device / host: what `--device cuda` allocates (one process per GPU, optimizer
//     offloaded): on the device the training-dtype weights, their fp32 compute copy, fp32
//     gradients, and the CUDA model's activations and scratch (the bf16 GEMMs' rounding
//     scratch and the GEMM attention's pass buffers included: DeviceActivationBytes, sized by
//     the functions the CUDA model allocates with; not counted: the CUDA context and the
//     libraries' workspaces, the reserve below); on the host the trainer's own copies of the
//     weights and gradients (and, but in bf16, of the compute copy: the device widens bf16
//     weights itself), the fp32 masters, exp_avg and exp_avg_sq, the ZeRO
//     buffers, the pipeline's staging and a save's staging. memory_plan_test checks the host
//     column, and the device's weights, copy and gradients, against a trainer on the CPU twin
//     device. The weights are RESIDENT when everything fits in the device's capacity (less a
//     reserve for the CUDA context and library workspaces); otherwise the plan shows them
//     STREAMED per layer (the embeddings and the head, and two layer windows of weights,
//     compute copy and gradients, one in use and one in flight: TrainDeviceSpec::stream_weights,
//     which --weights auto picks from this plan). If even that does not fit, the plan says by
//     how much.
// The cast placement compares moving the updated weights device-ward as fp32 and casting on the
// device, with casting on the host (fused into Adam's copy-out) and moving bf16: both give the
// same bits (round to nearest even either side), so the choice is only about time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "offload/model/model.h"
#include "offload/optim/adam.h"
#include "ucp/base/result.h"

namespace ucp::offload {

/// Where a device keeps the weights (RunOptions::weights): the plan's choice for the device's
/// capacity, or as asked.
enum class WeightChoice : uint8_t { kAuto, kResident, kStreamed };
/// "auto", "resident" or "streamed". Errors: kInvalidArgument naming --weights.
Result<WeightChoice> ParseWeightChoice(const std::string& text);

/// The staged host buffers' window when RunOptions::host_window is 0: 32 Mi elements, a
/// multiple of the gradient norm's 64 Ki chunks. Two of each buffer (one crossing while the host
/// works on the other): 256 MiB of gradients and 128 MiB of bf16 weights.
inline constexpr int64_t kDefaultHostWindow = int64_t{1} << 25;

/// Staged host buffers with several ZeRO blocks: the window of every block the reduce-scatter
/// and the gather go through, in block elements (about host_window elements in all).
inline int64_t StagedBlockWindow(int64_t block, int64_t host_window, int blocks) {
  return std::max<int64_t>(1, std::min(block, host_window / std::max(1, blocks)));
}

/// What decides the memory of one process.
struct PlanInput {
  ModelConfig config;
  /// Per parameter, in canonical order: 0 for matrices, 1 for biases and norms (the rule set's
  /// optimizer groups, which ZeRO-1/2 partition as two flat buffers).
  std::vector<int> optimizer_group;
  LowpDType dtype = LowpDType::kBf16;  ///< training dtype
  int64_t micro_batch = 1;
  int64_t seq_len = 1;  ///< whole sample (sequence parallelism shards it)
  int dp = 1, sp = 1, zero_stage = 1;
  int threads = 1;       ///< the model's thread count (its scratch grows with it)
  bool overlap = false;  ///< --pipeline overlap: the pipeline's host staging
  bool speculate = true; ///< overlap: speculative steps, so snapshots (RunOptions::speculate)
  /// Background saves stage a copy of the checkpoint's tensors; --sync-save writes the live
  /// state and stages nothing.
  bool async_save = true;
  WeightChoice weights = WeightChoice::kAuto;  ///< --weights
  /// On a GPU the matrix products read the bf16 weights (bf16 training with --gpu-gemm auto):
  /// the device then also holds the bf16 GEMMs' and the GEMM attention's scratch.
  bool gpu_gemm_bf16 = true;
  /// With those bf16 GEMMs, attention through the flash kernels (--gpu-attention flash): no
  /// GEMM attention scratch on the device.
  bool gpu_flash_attention = false;
  /// --recompute: the layers the model (the CPU's, or the device's) recomputes in backward
  /// rather than keeps (model.h Recompute).
  Recompute recompute;
  /// --gpu-tail-buckets: the elements whose masters and Adam states the device Adam keeps on the
  /// device too (the last grad groups' parameters; the host block still holds every element).
  int64_t device_optimizer_elements = 0;
  int device_optimizer_groups = 0;  ///< how many grad groups those are (for the plan's note)
  /// Staged host buffers (RunOptions::host_buffers): the host's weights and gradients are two
  /// windows each of this many elements (at most the model); 0: whole copies. The weights then stay
  /// resident (the streamed placement reads the host's whole weights).
  int64_t host_window = 0;
  bool host_window_auto = false;  ///< host_window is --host-buffers auto's choice (the verdict)
};

/// The machine the plan is for. Zero capacities: unknown (no fit verdict for that side).
struct PlanMachine {
  int64_t device_bytes = 0;
  int64_t host_bytes = 0;
  /// Device memory kept free for the CUDA context, cuBLASLt / cuDNN workspaces and NCCL.
  int64_t device_reserve_bytes = int64_t{2} << 30;
  double link_bytes_per_s = 0;    ///< host <-> device copy bandwidth
  double host_cast_per_s = 0;     ///< fp32 -> bf16 elements per second on the host
  double device_cast_per_s = 0;   ///< fp32 -> bf16 elements per second on the device
};

/// The tensor classes of a plan, in the order of MemoryPlan::rows.
enum class MemClass : uint8_t {
  kWeights,          ///< the training-dtype weights
  kComputeCopy,      ///< the CPU engine's fp32 compute copy of the weights
  kGradients,        ///< fp32 gradients
  kOptimizer,        ///< fp32 master, exp_avg, exp_avg_sq: this rank's ZeRO block
  kZeroScratch,      ///< the reduced block and the reduce-scatter scratch (ZeRO >= 1, > 1 rank)
  kActivations,      ///< activations, backward and ops scratch (ActivationBytes)
  kPipelineStaging,  ///< --pipeline overlap: snapshots, gradients crossing, weights out
  kSaveStaging,      ///< a save's copy of the checkpoint's tensors
  kCount
};

struct MemoryRow {
  MemClass cls = MemClass::kWeights;
  std::string name;          ///< tensor class, for people
  int64_t cpu_bytes = 0;     ///< the CPU engine's allocation
  int64_t device_bytes = 0;  ///< on the GPU, under the plan's placement
  int64_t host_bytes = 0;    ///< in host memory, under the plan's placement
  std::string note;
};

enum class WeightPlacement : uint8_t { kResident, kStreamed };
enum class CastSide : uint8_t { kDevice, kHost };

struct CastChoice {
  CastSide side = CastSide::kHost;
  int64_t elements = 0;         ///< weights moved device-ward per step (this rank's block)
  double device_seconds = 0;    ///< fp32 over the link, cast on the device
  double host_seconds = 0;      ///< cast on the host, bf16 over the link
  bool measured = false;        ///< false: no link or cast rates were given
};

struct MemoryPlan {
  std::vector<MemoryRow> rows;
  int64_t cpu_total = 0, device_total = 0, host_total = 0;
  WeightPlacement placement = WeightPlacement::kResident;
  bool device_fits = true;  ///< with the placement chosen (true when the capacity is unknown)
  bool host_fits = true;    ///< the GPU plan's host side (true when unknown)
  bool cpu_fits = true;     ///< the CPU engine in host memory (true when unknown)
  std::string verdict;      ///< one sentence: what fits and how
  CastChoice cast;
  PlanMachine machine;
  int64_t params = 0;       ///< parameters of the model
  int64_t block = 0;        ///< this rank's optimizer-state elements (its ZeRO block)
  int64_t host_window = 0;  ///< staged host buffers' window (elements); 0: whole buffers
};

/// Errors: kInvalidArgument (config, sizes, a layout the engine does not run: the
/// sequence-parallel rules, dp or zero out of range, optimizer_group of the wrong length).
Result<MemoryPlan> PlanMemory(const PlanInput& input, const PlanMachine& machine);

/// --recompute auto: the fewest layers to recompute (the first ones; input.recompute is
/// ignored) for the run to fit `machine`: the device (`device`: machine.device_bytes) or the CPU
/// engine (machine.host_bytes), with the placement input.weights asks. None where it fits
/// without or the capacity is unknown (0); all the layers, the least memory, where nothing fits.
/// With input.weights kAuto: the fewest that fit with the weights resident where some count does
/// (recomputing costs GPU compute; streaming, host-link bandwidth the optimizer offload needs),
/// else with them streamed.
Result<Recompute> ChooseRecompute(PlanInput input, const PlanMachine& machine, bool device);
/// How a run recomputes, for people: "" for none, else "the first R of L layers recomputed in
/// backward" or "all L layers recomputed in backward".
std::string RecomputeNote(Recompute recompute, int64_t layers);

/// The elements of the last `n` grad groups of `config`'s model (the groups backward completes
/// last: the first layers and the embeddings), whose masters and Adam states
/// `--gpu-tail-buckets n` keeps on the device. Errors: kInvalidArgument (config; n outside
/// [0, the model's grad groups]).
Result<int64_t> TailBucketElements(const ModelConfig& config, int n);

/// The share of the device's capacity `--gpu-tail-buckets auto` leaves free beyond the plan
/// (and its reserve): the tail is an optimisation, and a run it pushed out of memory would not
/// start.
inline constexpr double kTailHeadroom = 0.05;

/// --gpu-tail-buckets auto: the most grad groups, counted from the last, whose masters and Adam
/// states (12 B per element) fit on the device beside everything else the plan keeps there
/// (with input.recompute as chosen), the weights resident and kTailHeadroom of the capacity
/// free. On a GPU the device Adam steps them in milliseconds after validation, where the CPU
/// Adam would step them after the last backward, exposed: SuperOffload's n' (issue 12), here as
/// many as memory allows. 0 where the capacity is unknown, the weights are streamed (as asked,
/// or as --weights auto places them) or host buffers staged (input.host_window > 0): the device
/// Adam's pieces need resident weights and the host's whole copies. Ignores
/// input.device_optimizer_elements.
Result<int> ChooseTailBuckets(PlanInput input, const PlanMachine& machine);

/// The faster side to cast the updated weights (see the file comment). Without rates, kHost
/// (the CPU Adam writes bf16 in the same pass, and half the bytes cross the link).
CastChoice ChooseCastSide(const PlanMachine& machine, int64_t elements);

/// This host's figures for the CPU engine, measured now (about 0.2 s): the link is a host
/// memcpy (the CPU twin's copy stream), the host cast fp32 -> bf16 on one thread, the "device"
/// cast the same (the CPU twin's device is the host). Capacity: MemAvailable of /proc/meminfo.
PlanMachine MeasureHost();

/// This host's available memory (MemAvailable of /proc/meminfo), bytes; 0 when unknown.
int64_t MeasureHostMemory();
/// The plan as an aligned table with totals, the verdict and the cast choice.
std::string FormatPlan(const MemoryPlan& plan);
/// Bytes as the plan prints them: "115.45 GiB", "12.0 MiB", "848.9 KiB", "12 B".
std::string FormatBytes(int64_t bytes);

}  // namespace ucp::offload
