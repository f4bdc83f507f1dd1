// The trainer: one process training one model at a layout, saving and restoring only through
// libucp's public API (api::RankSaver, api::RestoreRank). llm.c's train loop in shape: sample a
// global batch as a pure function of (seed, step), forward/backward per micro-batch, clip, step
// the CPU Adam on the fp32 master weights, copy out the training-dtype weights.
//
// Memory is what ucp's layout says a rank holds: the model in its training dtype (bf16, fp16 or
// fp32; `model/<name>` tensors), and the fp32 master, exp_avg and exp_avg_sq as ZeRO flat group
// buffers (optimizer group 0: matrices; 1: biases and norms), so a save hands views and a
// restore fills them, at any ZeRO stage the layout names. The fp32 compute copy of the weights
// and the fp32 gradients are the model's (offload/model). With a device (RunOptions::device,
// device.h) forward and backward run there and everything else stays here, the same code path.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/engine/pipeline.h"
#include "offload/train/device.h"
#include "offload/train/memory_plan.h"
#include "offload/train/schedule.h"
#include "ucp/base/result.h"

namespace ucp::offload {

class Communicator;

/// Everything that defines a run. Recorded in every checkpoint (client state "ucp_train.config")
/// and taken back from it on resume.
struct TrainConfig {
  std::string model = "llama-tiny";  ///< preset name or model .json (patterns/models)
  std::string dtype;                 ///< training dtype: "" (the preset's), bf16, fp16, fp32
  std::string data = "fortunes";     ///< "fortunes", a token file (llm.c format) or a text file
  int64_t seq_len = 0;               ///< 0: the model's max_positions, at most 256
  int64_t global_batch = 16;         ///< samples per optimizer step, at any layout
  int64_t micro_batch = 0;           ///< samples per forward/backward; 0: global_batch / dp
  int64_t steps = 200;               ///< train until this many steps are done
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_samples = -1;  ///< -1: 5% of steps * global_batch
  int64_t decay_samples = -1;   ///< -1: steps * global_batch
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double clip_grad = 1.0;  ///< global L2 norm bound; 0: no clipping
  double init_std = 0.02;
  double initial_loss_scale = 65536.0;  ///< fp16 only
  int64_t loss_scale_window = 1000;
  uint64_t seed = 1234;
  int64_t val_every = 25;    ///< validation loss every N steps (0: only at the end)
  int64_t val_samples = 64;  ///< held-out samples per validation
  int64_t save_every = 0;    ///< checkpoint every N steps (the caller saves; 0: at the end only)
  int64_t keep = 0;          ///< the newest K checkpoints are kept, older ones removed; 0: all
  /// Threads per process the run used (recorded; RunOptions::threads = 0 takes it on resume).
  /// The model's sums are deterministic for a given thread count, so a resume at the same
  /// layout repeats the same bits when it also runs with the same count.
  int threads = 0;
  std::string layout = "tp=1,pp=1,dp=1,zero=1";  ///< the run's layout: dp x sp processes
  /// Bitwise the same training at any dp that is a power of two dividing the global batch: every
  /// sample's gradient is computed alone and the global batch's are added in one fixed binary
  /// tree over the sample index (each rank's contiguous share is a subtree), the loss alike, and
  /// the gradient norm over the whole gradient in canonical order. Costs a gradient buffer per
  /// tree level and a micro-batch of 1.
  bool deterministic = false;
};

/// RunOptions::gpu_tail_buckets: "auto".
inline constexpr int kGpuTailAuto = -1;
/// --gpu-tail-buckets: "auto" (kGpuTailAuto) or a count >= 0. Errors: kInvalidArgument.
Result<int> ParseGpuTailBuckets(const std::string& text);

/// What one run's options add to a config: where to write and how to start.
struct RunOptions {
  std::filesystem::path out;     ///< run folder: step_NNNNNNNN/ checkpoints, latest, log.jsonl
  std::filesystem::path resume;  ///< a run folder or checkpoint to continue (its config wins)
  std::filesystem::path init;    ///< any checkpoint ucp reads: weights to start from (step 0)
  bool async_save = true;
  int threads = 0;  ///< 0: the config's (a resumed run's recorded count), else DefaultThreads()
  std::filesystem::path data_dir;
  std::filesystem::path corpus_dir;  ///< where fortune text is read (tests point elsewhere)
  /// The processes training together, one per rank of the layout (dp x sp); null: this process
  /// alone. Every process calls Create, Step, Validate, Save and Wait in the same order.
  Communicator* comm = nullptr;
  /// The optimizer pipeline (offload/engine, docs/offload.md): "sync" (Adam after backward) or
  /// "overlap" (buckets stepped speculatively during backward, then committed, corrected for
  /// clipping or undone; bitwise the same training, so it is not recorded and a resume may
  /// change it). With several processes each bucket is reduced over the ranks as backward
  /// completes it (forward and backward then run on a worker thread; this thread makes every
  /// communicator call). Not with --deterministic.
  std::string pipeline = "sync";
  /// One process: the last N grad groups' masters and Adam states on the device, stepped by the
  /// device Adam (on the CPU engine, by the pipeline after validation), or kGpuTailAuto: the most
  /// that fit beside everything else on a device of `device_memory` bytes
  /// (memory_plan.h ChooseTailBuckets; 0 where it is unknown, or the run cannot keep any).
  int gpu_tail_buckets = 0;
  /// --pipeline overlap: the CPU Adam's threads, of `threads` (0: DefaultAdamThreads). With
  /// --pipeline sync the Adam runs after backward on all `threads`. The same bits either way.
  int adam_threads = 0;
  /// Pins the CPU Adam's threads one to a CPU (CpuAdam's `cpus`, Linux): the last of this
  /// process's own CPUs (cpu_affinity.h AdamCpus), so the first stay for the threads that
  /// launch, copy and communicate. With several processes on a host each must be bound to
  /// CPUs of its own (mpirun --bind-to, taskset): overlapping pins are refused at start-up.
  /// Not recorded.
  bool pin_threads = false;
  /// --pipeline overlap on a device, one process, bf16: validation's per-bucket work (the clip
  /// corrections) and the weights' trip device-ward run under the next step's forward, which
  /// waits for each grad group's weights just before it reads them (pipeline.h StartFinish);
  /// the same bits either way. false: all of it before Step returns.
  bool finish_under_forward = true;
  /// --pipeline overlap: whether each bucket's Adam is stepped speculatively during backward.
  /// "auto": on every step but those after a clipped step (a step that is clipped again would
  /// take the speculative pass and then its correction: twice the host's Adam traffic for one
  /// step); "always": every step; "off": never (every bucket's Adam waits for validation; no
  /// speculation snapshots, 12 B per state element less host memory; the gradients still cross
  /// and the norm still sums during backward, and on a device the Adam runs under the next
  /// step's forward). The same bits every way, so not recorded.
  std::string speculation = "auto";
  std::filesystem::path trace;   ///< overlap: a Chrome trace of the first 3 steps (root writes)
  /// Where forward and backward run (device.h): "cpu" (the CPU model on host buffers), "cuda"
  /// (device_factory's device; the CLI sets it where the CUDA engine is built) or "twin" (the
  /// CPU twin of a device, for tests). Not recorded: the training state is the same host state
  /// either way, so a resume may change it. With a device: no --deterministic, no sequence
  /// parallelism; --gpu-tail-buckets N keeps the masters and Adam states of the last N grad
  /// groups on the device (one process).
  std::string device = "cpu";
  TrainDeviceFactory device_factory;
  /// What the device's matrix products read (TrainDeviceSpec::gemm_bf16): "auto" (the bf16
  /// weights, activations rounded to bf16, fp32 accumulation, where the training dtype is bf16;
  /// fp32 otherwise) or "fp32" (the fp32 compute copy: within 1e-5 of the CPU engine). The CPU
  /// twin's model is the CPU's, fp32, either way.
  std::string gpu_gemm = "auto";
  /// How the device's bf16 GEMMs run attention (TrainDeviceSpec::flash_attention): "gemm"
  /// (batched tensor-core GEMMs over T x T score buffers) or "flash" (the tiled kernels of
  /// cuda_flash.cu: causal FLOPs only, no T x T buffers; head_dim 64, 80, 96 or 128). Only with bf16
  /// training and gpu_gemm "auto"; the twin's model is the CPU's either way.
  std::string gpu_attention = "gemm";
  /// Where a device keeps the weights (memory_plan.h; docs/offload.md, "Weight streaming"):
  /// "resident" (all of them), "streamed" (the embeddings and the head, and two layer windows
  /// through which each layer crosses as forward and backward reach it; its gradients leave as
  /// backward completes it), or "auto": the memory plan's choice for `device_memory` bytes of
  /// device memory, resident when that is 0 (unknown). The same bits either way; not recorded.
  std::string weights = "auto";
  int64_t device_memory = 0;
  /// Activation checkpointing (model.h Recompute), on the CPU model or the device's: "none";
  /// "all" (every layer keeps only its output and one layer's other activations are shared,
  /// each layer's forward rerun before its backward); a layer count N (the first N layers
  /// recomputed, the others keeping everything); or "auto" (the fewest layers for the run to
  /// fit: on a device, `device_memory` with the placement `weights` picks, none when that is 0;
  /// on the CPU engine, `host_memory`, by default this machine's MemAvailable). Up to about a
  /// third more compute for a fraction of the activations; the same bits either way, so not
  /// recorded (a resume may change it).
  std::string recompute = "none";
  /// What the host keeps of a device's weights and gradients (TrainDeviceSpec::host_window;
  /// docs/offload.md, "Staged host buffers"): "whole" (a pinned copy of each, 6 B/parameter in
  /// bf16) or "staged" (only pinned windows of host_window elements: after backward the
  /// gradients cross window by window twice, once for the norm and once for Adam, whose bf16
  /// copy-out crosses back from its window; the host then holds the optimizer state alone).
  /// The same bits either way; not recorded. "staged": --device cuda|twin, bf16, one process
  /// or several at ZeRO 1-3 (the gradients reduce-scattered and the masters gathered a window
  /// of every block at a time), --pipeline sync, resident weights, no --gpu-tail-buckets.
  /// "auto": staged where it runs in one process and the memory plan's host side fits
  /// `host_memory` staged but not whole; else whole.
  std::string host_buffers = "auto";
  /// Host memory for host_buffers "auto", bytes; 0: this machine's MemAvailable at start-up.
  int64_t host_memory = 0;
  /// The staged window in elements, a multiple of the norm's 64 Ki-element chunks (0: 32 Mi
  /// elements; two windows of each buffer, 384 MiB in all).
  int64_t host_window = 0;
};

/// The overlapped CPU Adam's threads when RunOptions::adam_threads is 0: half of `threads`
/// where the model computes on this host (the CPU engine, the twin: backward needs the other
/// half), else all but the threads a GPU run keeps busy beside it (the one launching the
/// model's kernels, the copy stream's, and with several processes the communicator's); at
/// least 1.
int DefaultAdamThreads(int threads, bool model_on_host, int processes);

/// One optimizer step's record (also a line of log.jsonl).
struct StepRecord {
  int64_t step = 0;  ///< 1-based: the number of steps done after it
  double loss = 0;   ///< mean per-token loss of the global batch
  double lr = 0;
  double grad_norm = 0;  ///< before clipping
  double loss_scale = 1;
  bool skipped = false;  ///< non-finite gradients: nothing was updated
  int64_t tokens = 0;    ///< target tokens in the global batch
  double seconds = 0;    ///< wall time of the step
  double save_block_seconds = 0;  ///< time this step waited for a save (staging copy included)
  double val_loss = -1;            ///< when a validation ran after this step
  /// Where the step's wall time went (not logged; ucp-bench train prints it). Each phase runs
  /// to the next mark, so they sum to `seconds` less the save poll at the step's start.
  struct Phases {
    /// Forward and backward of every micro-batch, and the gradients on the host (with
    /// --pipeline overlap: until the last bucket has crossed; its CPU Adam runs meanwhile).
    double backward = 0;
    double reduce = 0;     ///< the loss and gradients over the ranks, and the gradient norm
    double optimizer = 0;  ///< clip and AdamW (overlap: the validation), the weights widened
    double weights = 0;    ///< the new weights onto the device (--device)
    /// Part of `backward`: the first forward waiting for the previous step's finish
    /// (RunOptions::finish_under_forward), what of that finish forward did not hide.
    double finish_wait = 0;
  } phases;
  /// --pipeline overlap: what validation did with this process's buckets (not logged).
  PipelineStats overlap;
};

class Trainer {
 public:
  /// Reads the config a ucp-train checkpoint recorded (client state ucp_train.config).
  /// Errors: kNotFound, kFailedPrecondition (not a ucp-train checkpoint), kDataLoss.
  static Result<TrainConfig> RecordedConfig(const std::filesystem::path& ckpt,
                                            const std::filesystem::path& data_dir);
  /// Builds the model, data, optimizer and memory; restores from opts.resume / opts.init.
  /// Errors: kInvalidArgument (a config value, naming the option), kNotFound (data, model,
  /// checkpoint), kFailedPrecondition (a checkpoint of another model, a layout this engine does
  /// not run), and the restore's errors.
  static Result<Trainer> Create(const TrainConfig& config, const RunOptions& opts);
  /// The memory plan of one process of this run (memory_plan.h), allocating nothing: the model,
  /// dtype, sequence length, micro-batch and layout resolved as Create resolves them (from the
  /// checkpoint with opts.resume / opts.init). opts.out is not needed.
  /// Errors: as Create's resolution, and PlanMemory's.
  static Result<MemoryPlan> Plan(const TrainConfig& config, const RunOptions& opts,
                                 const PlanMachine& machine);
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;
  ~Trainer();

  const TrainConfig& config() const;
  int64_t step() const;  ///< steps done
  int rank() const;      ///< this process's rank in the layout (0 alone)
  bool is_root() const { return rank() == 0; }
  int64_t num_params() const;
  /// The layers the model recomputes in backward (RunOptions::recompute, resolved).
  Recompute recompute() const;
  std::string Describe() const;  ///< one paragraph: model, params, layout, data, schedule
  /// The bytes this process's buffers hold now, by the plan's tensor classes (what Plan's
  /// cpu_bytes predicts, or with a device its host_bytes; save staging once a save has run).
  /// Tokens and the data are not counted.
  std::vector<int64_t> MemoryInUse() const;
  /// With a device, its weights, compute copy, gradients and device-piece state (bytes; what
  /// the plan's device column predicts for the first three); 0 without one.
  int64_t DeviceBytesInUse() const;
  /// With a device streaming its weights (RunOptions::weights), the bytes its windows have moved
  /// between host and device since it was made; 0 otherwise.
  int64_t DeviceBytesStreamed() const;
  /// With staged host buffers (RunOptions::host_buffers), the bytes through the device's windows
  /// since it was made (TrainDevice::staged_bytes); 0 otherwise.
  int64_t DeviceBytesStaged() const;

  /// One optimizer step on the global batch of step() + 1.
  Result<StepRecord> Step();
  /// Whether validation is asked for (val_samples > 0) and the held-out set holds at least one
  /// sample of seq_len + 1 tokens.
  bool can_validate() const;
  /// Mean per-token loss over the first val_samples held-out samples.
  /// Errors: kFailedPrecondition when !can_validate().
  Result<double> Validate();
  /// Starts saving the state after step() (waits for a save in flight first). With async_save
  /// the disk work runs in the background; Wait() collects its outcome.
  Status Save();
  /// Waits for the save in flight, if any. Errors: that save's.
  Status Wait();
  /// Appends a step's record to the run's log.jsonl (one JSON object a line).
  /// Errors: kIoError.
  Status Log(const StepRecord& record);

  /// For tests and tools: the model's weights in training dtype bytes, the master weights and
  /// Adam states as the layout's tensors (name -> bytes), in a deterministic order.
  std::vector<std::pair<std::string, std::vector<std::byte>>> StateForTest() const;

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The checkpoint to resume from: a complete checkpoint folder itself, else the run folder's
/// highest complete step_NNNNNNNN (which `latest` names unless a crash came between a commit and
/// its update), else the folder as it is (another format's, for CheckpointSource to open).
/// Errors: kNotFound (no folder; a run folder with a log but no complete checkpoint).
Result<std::filesystem::path> FindResumeCheckpoint(const std::filesystem::path& run_or_ckpt);

}  // namespace ucp::offload
