// The trainer (trainer.h). Order of one step, as llm.c's train loop:
//   zero grads -> per micro-batch: sample, widen nothing (weights are already fp32 for the
//   model), forward + backward (grads of loss_scale * mean loss) -> global grad norm (fixed
//   order) -> overflow check (skip + rescale) -> one pass scaling grads by clip / loss_scale ->
//   CPU Adam on the master weights of this rank's fragments, with the fused copy-out to the
//   training dtype -> widen the training-dtype weights into the model's fp32 compute copy.
// The compute copy is widened from the bf16/fp16 weights, never taken from the masters, so the
// forward sees exactly the weights the checkpoint's `model/` tensors hold (what a GPU would hold).
#include "offload/train/trainer.h"

#include <unistd.h>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <tbb/task_group.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <atomic>
#include <thread>

#include "offload/comm/communicator.h"
#include "offload/data/corpus.h"
#include "offload/data/sampler.h"
#include "offload/data/token_file.h"
#include "offload/data/tokenizer.h"
#include "offload/engine/comm_funnel.h"
#include "offload/engine/pipeline.h"
#include "offload/model/model.h"
#include "offload/optim/cpu_adam.h"
#include "offload/optim/cpu_affinity.h"
#include "offload/train/grad_norm.h"
#include "offload/train/page_vector.h"
#include "ucp/api/checkpoint.h"
#include "ucp/api/trainer.h"
#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/json/strict_json.h"
#include "ucp/layout/layout.h"
#include "ucp/mpi/mpi_group.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using json = ucp::json::Json;
using Clock = std::chrono::steady_clock;

constexpr int kClientStateVersion = 1;
// Fixed chunks for reductions, so the gradient norm is the same bits for any thread count.
constexpr int64_t kReduceChunk = kGradNormChunk;
constexpr float kFp16Max = 65504.0f;
// --trace records the first steps of the run (its file is written after the last of them).
constexpr int64_t kTraceSteps = 3;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string StepDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

// Parses "step_NNNNNNNN"; -1 for anything else.
int64_t StepOfDirName(const std::string& name) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

bool IsCompleteCheckpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "ucp_layout.json", ec) ||
         fs::is_regular_file(dir / "manifest.json", ec);
}

// The complete step_* checkpoints of a run folder, sorted by step.
std::vector<std::pair<int64_t, fs::path>> RunCheckpoints(const fs::path& run) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run, ec)) {
    const int64_t s = StepOfDirName(e.path().filename().string());
    if (s >= 0 && e.is_directory(ec) && IsCompleteCheckpoint(e.path())) out.emplace_back(s, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Counter-based randomness: a value depends on (seed, parameter name, element index) only, so
// initialisation is the same at any layout (shared/reference/engine.md §5).
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// A standard normal draw (Box-Muller on two 53-bit uniforms) for element `index` of a stream.
double NormalAt(uint64_t stream, uint64_t index) {
  const uint64_t a = SplitMix64(stream ^ SplitMix64(2 * index));
  const uint64_t b = SplitMix64(stream ^ SplitMix64(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

// RunOptions::host_buffers is one of three.
Status CheckHostBuffersOption(const std::string& text) {
  if (text == "auto" || text == "whole" || text == "staged") return Status::Ok();
  return InvalidArgumentError("--host-buffers " + text + ": must be auto, whole or staged");
}

// The staged window the options ask for (RunOptions::host_window; 0: the default).
int64_t RequestedHostWindow(const RunOptions& o) {
  return o.host_window == 0 ? kDefaultHostWindow : o.host_window;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

json ConfigToJson(const TrainConfig& c) {
  return json{{"model", c.model},
              {"dtype", c.dtype},
              {"data", c.data},
              {"seq_len", c.seq_len},
              {"global_batch", c.global_batch},
              {"micro_batch", c.micro_batch},
              {"steps", c.steps},
              {"lr", c.lr},
              {"min_lr", c.min_lr},
              {"warmup_samples", c.warmup_samples},
              {"decay_samples", c.decay_samples},
              {"beta1", c.beta1},
              {"beta2", c.beta2},
              {"eps", c.eps},
              {"weight_decay", c.weight_decay},
              {"clip_grad", c.clip_grad},
              {"init_std", c.init_std},
              {"initial_loss_scale", c.initial_loss_scale},
              {"loss_scale_window", c.loss_scale_window},
              {"seed", c.seed},
              {"val_every", c.val_every},
              {"val_samples", c.val_samples},
              {"save_every", c.save_every},
              {"keep", c.keep},
              {"threads", c.threads},
              {"deterministic", c.deterministic},
              {"layout", c.layout}};
}

template <typename T>
Status Take(const json& j, const char* key, T& out, const std::string& where) {
  if (!j.contains(key)) return DataLossError(where + ": ucp_train.config." + key + " is missing");
  try {
    out = j.at(key).get<T>();
  } catch (const std::exception&) {
    return DataLossError(where + ": ucp_train.config." + key + " has the wrong type");
  }
  return Status::Ok();
}

Result<TrainConfig> ConfigFromJson(const json& j, const std::string& where) {
  if (!j.is_object()) return DataLossError(where + ": ucp_train.config is not an object");
  TrainConfig c;
  UCP_RETURN_IF_ERROR(Take(j, "model", c.model, where));
  UCP_RETURN_IF_ERROR(Take(j, "dtype", c.dtype, where));
  UCP_RETURN_IF_ERROR(Take(j, "data", c.data, where));
  UCP_RETURN_IF_ERROR(Take(j, "seq_len", c.seq_len, where));
  UCP_RETURN_IF_ERROR(Take(j, "global_batch", c.global_batch, where));
  UCP_RETURN_IF_ERROR(Take(j, "micro_batch", c.micro_batch, where));
  UCP_RETURN_IF_ERROR(Take(j, "steps", c.steps, where));
  UCP_RETURN_IF_ERROR(Take(j, "lr", c.lr, where));
  UCP_RETURN_IF_ERROR(Take(j, "min_lr", c.min_lr, where));
  UCP_RETURN_IF_ERROR(Take(j, "warmup_samples", c.warmup_samples, where));
  UCP_RETURN_IF_ERROR(Take(j, "decay_samples", c.decay_samples, where));
  UCP_RETURN_IF_ERROR(Take(j, "beta1", c.beta1, where));
  UCP_RETURN_IF_ERROR(Take(j, "beta2", c.beta2, where));
  UCP_RETURN_IF_ERROR(Take(j, "eps", c.eps, where));
  UCP_RETURN_IF_ERROR(Take(j, "weight_decay", c.weight_decay, where));
  UCP_RETURN_IF_ERROR(Take(j, "clip_grad", c.clip_grad, where));
  UCP_RETURN_IF_ERROR(Take(j, "init_std", c.init_std, where));
  UCP_RETURN_IF_ERROR(Take(j, "initial_loss_scale", c.initial_loss_scale, where));
  UCP_RETURN_IF_ERROR(Take(j, "loss_scale_window", c.loss_scale_window, where));
  UCP_RETURN_IF_ERROR(Take(j, "seed", c.seed, where));
  UCP_RETURN_IF_ERROR(Take(j, "val_every", c.val_every, where));
  UCP_RETURN_IF_ERROR(Take(j, "val_samples", c.val_samples, where));
  UCP_RETURN_IF_ERROR(Take(j, "save_every", c.save_every, where));
  UCP_RETURN_IF_ERROR(Take(j, "keep", c.keep, where));
  UCP_RETURN_IF_ERROR(Take(j, "threads", c.threads, where));
  UCP_RETURN_IF_ERROR(Take(j, "deterministic", c.deterministic, where));
  UCP_RETURN_IF_ERROR(Take(j, "layout", c.layout, where));
  return c;
}

// The ZeRO flat view: the optimizer state of the whole model cut into `blocks` equal blocks, block
// r being what rank r holds (its fragments of optimizer groups 0 and 1 at stages 1-2; its
// fragment of every parameter at stage 3; at stage 0 one block, the canonical order, held by
// every rank). A piece is a run of one parameter: elements [coff, coff + n) of the canonical
// (model-order) buffers are elements [foff, foff + n) of a block.
struct Piece {
  int64_t param = 0;
  int64_t coff = 0;
  int64_t foff = 0;
  int64_t n = 0;
};

// --pipeline overlap at dp x sp > 1: how one bucket (a grad group) is reduced. Stages 1-3: every
// rank sends each owner the bucket's elements of the owner's block (its pieces in block order),
// the owner adds the world's copies in rank order (OrderedSum, as ReduceScatterDeterministic
// does) into its block. Stage 0: the bucket's elements packed and all-reduced deterministically.
struct BucketReduce {
  BucketExchange ex;       // what crosses and is added (device.h), from the model's gradient
  std::vector<Piece> mine;  // where the sum goes: this rank's pieces (stage 0: the bucket's)
  std::vector<ExchangeChunk> chunks;  // the host's exchange: one chunk
};

// What a save copies out of the training state so the steps after it can go on.
struct Staging {
  std::vector<std::byte> weights;  // the model tensors, training dtype, canonical order
  std::vector<float> master, exp_avg, exp_avg_sq;  // this rank's block
};

}  // namespace

Result<fs::path> FindResumeCheckpoint(const fs::path& run_or_ckpt) {
  std::error_code ec;
  if (!fs::is_directory(run_or_ckpt, ec)) {
    return NotFoundError("no run or checkpoint folder " + run_or_ckpt.string());
  }
  if (IsCompleteCheckpoint(run_or_ckpt)) return run_or_ckpt;
  // The newest complete step wins over `latest`: a crash between a save's commit and the
  // pointer's update leaves `latest` one behind (llm.c picks its highest DONE_ step alike).
  auto all = RunCheckpoints(run_or_ckpt);
  if (!all.empty()) return all.back().second;
  if (fs::exists(run_or_ckpt / "log.jsonl", ec)) {
    return NotFoundError(run_or_ckpt.string() +
                         " holds no complete step_NNNNNNNN checkpoint to resume from");
  }
  return run_or_ckpt;  // another format's folder (DeepSpeed): CheckpointSource decides
}

struct Trainer::Impl {
  TrainConfig cfg;
  RunOptions opts;
  int threads = 1;
  fs::path data_dir;
  patterns::ModelSpec spec;
  patterns::ResolvedModel model;
  layout::Layout layout;
  DType dtype = DType::kBf16;
  std::optional<Model> net;
  std::optional<tbb::task_arena> arena;

  // Data.
  std::optional<TokenFile> train_file, val_file;
  std::vector<uint16_t> text_tokens;  // --data of plain text
  std::span<const uint16_t> train_tokens, val_tokens;
  std::optional<Sampler> sampler;
  std::vector<int32_t> inputs, targets;
  int64_t seq_len = 0, micro_batch = 0;

  // Model memory (canonical order): the training-dtype weights (bf16/fp16 bits; fp32 uses w32
  // itself), the fp32 compute copy and the fp32 gradients.
  // Page-owning (page_vector.h): the CUDA device pins these three in place.
  // With staged host buffers (RunOptions::host_buffers) w_lp and grads are windows of
  // host_window elements that every range of the model crosses through; the device holds the
  // whole weights and gradients.
  PageVector<uint16_t> w_lp;
  PageVector<float> w32;  // empty when !host_compute_copy()
  PageVector<float> grads;
  int64_t n_params = 0;
  int64_t host_window = 0;  // 0: whole host buffers
  // The processes (dp x sp) and this one's place among them.
  Communicator* comm = nullptr;
  std::unique_ptr<Communicator> own_comm;           // when the caller gave none
  std::unique_ptr<api::ProcessGroup> save_group;    // RankSaver's, with several processes
  int rank = 0, world = 1, dp_rank = 0, sp_rank = 0, sp = 1;
  std::unique_ptr<Communicator> sp_comm;  // the sp ranks of this dp rank (Ulysses)
  std::vector<int32_t> full_inputs, full_targets;  // whole samples, before the sequence shard
  // Optimizer memory: this rank's block of the ZeRO flat view, one buffer per state.
  int blocks = 1;
  int64_t block_size = 0;
  std::vector<std::vector<Piece>> block_pieces;  // per block
  std::vector<float> master, exp_avg, exp_avg_sq, gblock;
  std::vector<float> flat;                        // blocks * block_size scratch (stages 1-3)
  std::map<std::string, int64_t> state_offset;    // rank tensor name -> offset in the block
  std::optional<CpuAdam> adam;
  // --pin-threads: this process's CPUs (ascending) at start-up; empty: nothing pinned.
  std::vector<int> own_cpus;
  Status SetUpAdamThreads();  // checks adam_threads; --pin-threads: own_cpus, the ranks' pins
  std::unique_ptr<TraceRecorder> trace;  // --trace (before the pipeline, which points at it)
  // --pipeline overlap of one process on a device: the gradient norm's chunk sums (the same
  // chunks and function as after backward, so the same bits) start as soon as a chunk's last
  // bucket has crossed, on the arena while backward goes on, instead of all after it.
  struct EarlyNorm {
    explicit EarlyNorm(tbb::task_arena* a) : arena(a) {}
    // Inside the arena: with one thread it has no workers, and the waiter runs the sums.
    ~EarlyNorm() { arena->execute([&] { tasks.wait(); }); }
    tbb::task_arena* arena;
    std::vector<std::atomic<int64_t>> left;  // per chunk: elements not landed yet this step
    std::vector<double> partial;
    std::vector<float> maxabs;
    tbb::task_group tasks;
  };
  // Declared before the pipeline, so destroyed after it has joined its threads.
  std::unique_ptr<EarlyNorm> early_norm;
  std::unique_ptr<Pipeline> pipeline;    // --pipeline overlap
  // RunOptions::finish_under_forward in effect, and a finish in flight (the next forward, or
  // CompleteFinish before anything else reads the weights, waits for it).
  bool finish_under_forward = false;
  bool finish_pending = false;
  // The last step was clipped: with --speculation auto the next one holds its buckets for
  // validation (clipping persists over steps, and a clipped speculative bucket costs a second
  // pass, its correction).
  bool last_clipped = false;
  bool SpeculateNow() const {
    return opts.speculation == "always" || (opts.speculation == "auto" && !last_clipped);
  }
  Status CompleteFinish() {
    if (!finish_pending) return Status::Ok();
    finish_pending = false;
    UCP_RETURN_IF_ERROR(pipeline->WaitFinished(), "step " + std::to_string(step));
    return device->WeightsWritten();
  }
  Status SetUpPipeline(const AdamConfig& ac);
  Status ResolveRun(const RunOptions& run, fs::path& start_ckpt,
                    std::unique_ptr<api::CheckpointSource>& start_src, ModelConfig& mc);
  // --pipeline overlap with several processes: the main thread serves the funnel (every
  // communicator call of the step) while a worker runs forward and backward.
  std::unique_ptr<CommFunnel> funnel;
  std::unique_ptr<Communicator> sp_funneled;  // the model's sp group, through the funnel
  std::vector<BucketReduce> bucket_reduce;
  std::vector<float> send_buf, recv_buf, sum_buf;
  Status ReduceBucket(int k);
  Status PlanBucketReduce();
  std::vector<int> GroupOfParams() const;
  bool device_exchanges = false;  // overlapped buckets exchanged by the device (SetUpDevice)
  Result<double> OverlappedBackward(int64_t first, int64_t end, float grad_scale);

  LrSchedule sched;
  LossScaler scaler;
  int64_t step = 0, consumed = 0, optimizer_steps = 0, skipped_steps = 0;
  double last_lr = 0;

  // Saving: the RankSaver of the save in flight, its writer thread and outcome.
  Staging staging;
  std::optional<api::RankSaver> pending;
  int64_t pending_step = 0;
  std::thread saver;
  std::atomic<bool> saver_done{false};
  Status save_status;
  fs::path log_path;

  ~Impl() {
    if (saver.joinable()) saver.join();
    // The finish in flight writes into the device through the pipeline: done before either goes.
    CompleteFinish().IgnoreError();
  }
  bool root() const { return rank == 0; }
  const std::vector<Piece>& my_pieces() const {
    return block_pieces[blocks == 1 ? 0 : rank];
  }

  bool lowp() const { return dtype != DType::kFp32; }
  int64_t numel() const { return n_params; }
  bool staged() const { return host_window > 0; }
  Status SetUpHostBuffers();
  // Why staged host buffers do not run for `processes` processes (OK: they do): a device,
  // bf16, one process or several at ZeRO 1-3, --pipeline sync, no device pieces, weights not
  // streamed. Both --host-buffers staged (the refusal) and auto (whether to pick it) ask.
  Status StagingRefusal(int processes) const;
  // --host-buffers auto: staging runs in one process and the plan's host side fits
  // `m.host_bytes` staged but not whole.
  Result<bool> AutoStages(PlanInput in, int processes, const PlanMachine& m) const;
  // Staged host buffers: `n` training-dtype weights to model offset `at` on the device, or
  // from it, through the window; `from` fp32 values rounded (nearest even) on the way.
  Status PushWeights(const uint16_t* bits, int64_t at, int64_t n);
  Status PullWeights(uint16_t* bits, int64_t at, int64_t n);
  Status PushRounded(const float* from, int64_t at, int64_t n);
  // The model slices of this rank's checkpoint tensors (staged: saved and restored from and to
  // the device through a host buffer, a batch of slices at a time: SliceBatches).
  struct SliceInfo {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    int64_t offset = 0, n = 0;
    bool written_here = true;  ///< this rank writes it (not a dp replica another rank writes)
  };
  std::vector<SliceInfo> ModelSlices() const;
  // Consecutive slices of `slices` in batches of at most host_window elements (a larger slice
  // alone): one libucp call per batch, since each plans the rank's tensors (a call per slice was
  // 6-11x a whole-buffer restore on a 200-layer model: docs/PERFORMANCE.md).
  std::vector<std::span<const SliceInfo>> SliceBatches(const std::vector<SliceInfo>& slices) const;
  // A batch's slices back to back in `buf` (resized to hold them), as views of its bytes
  // (TensorView to restore into, ConstTensorView to save from).
  template <typename View>
  static std::vector<std::pair<std::string, View>> BatchViews(std::span<const SliceInfo> batch,
                                                              std::vector<uint16_t>& buf) {
    int64_t n = 0;
    for (const SliceInfo& sl : batch) n += sl.n;
    buf.resize(static_cast<size_t>(n));
    std::vector<std::pair<std::string, View>> views;
    int64_t at = 0;
    for (const SliceInfo& sl : batch) {
      views.push_back({sl.name, View{sl.dtype, sl.shape,
                                     {reinterpret_cast<std::byte*>(buf.data() + at),
                                      static_cast<size_t>(sl.n) * 2}}});
      at += sl.n;
    }
    return views;
  }
  Status SaveSlicesFromDevice();
  // The staged step's Adam, window by window, and its gradient norm chunk sums where the
  // device does not sum them (TrainDevice::GradNormChunks).
  Status StagedNorm(std::vector<double>& partial, std::vector<float>& maxabs);
  Status StagedAdam(float multiplier);
  // The device's gradients window by window, window i in slot i % 2 while the host works on
  // window i - 1: `work(lo, m, slot)` once model elements [lo, lo + m) are in the slot.
  Status StagedGradWindows(const std::function<Status(int64_t, int64_t, int)>& work);
  // Several blocks (ZeRO 1-3 at dp > 1): a gradient slot holds a window of block_window
  // elements of every block; the gradients are reduce-scattered and the masters gathered in it.
  int64_t block_window = 0;
  Status StagedReduceScatter(SumOrder order);
  Status StagedRefresh();
  // Every block's pieces within block elements [a, a + wb): fn(block, piece, x, y) for the
  // piece's block elements [x, y).
  Status ForEachPieceInBlockWindow(
      int64_t a, int64_t wb, const std::function<Status(int, const Piece&, int64_t, int64_t)>& fn);
  // Whether the host keeps the fp32 compute copy (w32): not when a device trains in bf16, which
  // takes the bf16 weights and widens them itself (4 B/parameter less host memory).
  bool host_compute_copy() const { return !(opts.device != "cpu" && dtype == DType::kBf16); }
  // Rounds fp32 values into the training-dtype weights at canonical offset `at` (the copy-out's
  // rounding: nearest even).
  void RoundIntoWeights(const float* from, int64_t at, int64_t n);

  void EarlyNormBegin();                 // before backward: every chunk's count, tasks idle
  void EarlyNormLanded(int bucket);      // the copy stage's thread
  Status EarlyNormWait(int64_t chunks);  // after WaitGradients: every chunk summed

  Status SetUpLayout();
  Status SetUpData();
  Status InitWeights();
  Status Restore(const api::CheckpointSource& src, const fs::path& ckpt, bool full);
  void WidenWeights();
  std::vector<std::pair<std::string, TensorView>> Views(bool weights, bool master_only,
                                                        Staging* from);
  std::string ClientState() const;
  Status ApplyClientState(const std::string& client_state, const std::string& where);
  Status StartSave();
  Status FinishSave();
  Status RefreshWeights();
  Result<double> SumOverRanks(double local, SumOrder order = SumOrder::kRankOrder);
  Result<Batch> MicroBatch(int64_t first, int64_t nb);
  Status TreeGrad(int64_t lo, int64_t hi, int level, float* out, double* loss, float grad_scale);
  std::vector<std::vector<float>> tree_bufs;  // --deterministic: one gradient per tree level
  void AppendLog(const json& line);

  // --device (device.h): forward and backward on the device, everything else as above. Declared
  // last: destroyed first, while the host buffers it registered are still alive.
  std::unique_ptr<TrainDevice> device;
  std::vector<char> piece_on_device;  // per piece of block_pieces[0]: stepped by the device Adam
  bool device_reduces = false;        // the sync step's reduction is the device's (SetUpDevice)
  Status SetUpDevice(const AdamConfig& ac);
  // The memory plan's input for this run (Plan, and --weights auto).
  PlanInput MakePlanInput(const ModelConfig& mc, const layout::Layout& l) const;
  // --recompute (RunOptions::recompute) as a count; "auto" plans for `machine`'s capacity on
  // the side the run uses. Sets `recompute`, which MakePlanInput then reads.
  Status ResolveRecompute(const ModelConfig& mc, const layout::Layout& l,
                          const PlanMachine& machine);
  Recompute recompute;
  // --gpu-tail-buckets as a count: as asked, or with auto (decided last, after the placement,
  // the staging and the recomputed layers: the tail takes what room they leave) the plan's for
  // `machine`; `streamed`: the weights are streamed. Sets tail_buckets (MakePlanInput reads it)
  // and, for auto, tail_note: why the count is 0 where no room decided it.
  Status ResolveTailBuckets(const ModelConfig& mc, const layout::Layout& l,
                            const PlanMachine& machine, bool streamed);
  int tail_buckets = 0;
  std::string tail_note;
  // One micro-batch's forward + backward, on the device or the CPU model (the ops policy).
  Result<double> ForwardBackward(const Batch& b, float grad_scale,
                                 const BackwardHook* hook = nullptr) {
    if (device) return device->ForwardBackward(b, grad_scale, hook);
    return hook != nullptr ? net->ForwardBackward(w32, grads, b, grad_scale, *hook)
                           : net->ForwardBackward(w32, grads, b, grad_scale);
  }
};

// --- set-up ---------------------------------------------------------------------------------

Status Trainer::Impl::SetUpLayout() {
  UCP_ASSIGN_OR_RETURN(layout, layout::ParseLayout(cfg.layout), "--layout");
  if (layout.universal || layout.tp != 1 || layout.pp != 1 || layout.ep != 1) {
    return UnimplementedError("--layout " + cfg.layout +
                              ": the engine runs data parallelism with ZeRO 0-3 (tp=1,pp=1,ep=1); "
                              "tensor, pipeline and expert parallelism are not implemented");
  }
  if (layout.sp != 1 && cfg.deterministic) {
    return UnimplementedError("--layout " + cfg.layout +
                              ": --deterministic runs data parallelism only (sp=1)");
  }
  if (layout::WorldSize(layout) != world) {
    return FailedPreconditionError("--layout " + layout::ToString(layout) + " has " +
                                   std::to_string(layout::WorldSize(layout)) + " ranks but " +
                                   std::to_string(world) + " processes run it (mpirun -np " +
                                   std::to_string(layout::WorldSize(layout)) + ")");
  }
  if (cfg.global_batch % layout.dp != 0) {
    return InvalidArgumentError("--layout " + layout::ToString(layout) + ": the global batch of " +
                                std::to_string(cfg.global_batch) + " samples does not divide by dp=" +
                                std::to_string(layout.dp) + " (" + std::to_string(cfg.global_batch) +
                                " = " + std::to_string(layout.dp) + " x " +
                                std::to_string(cfg.global_batch / layout.dp) + " + " +
                                std::to_string(cfg.global_batch % layout.dp) + ")");
  }
  if (cfg.deterministic) {
    const int p = layout.dp;
    if ((p & (p - 1)) != 0) {
      return InvalidArgumentError("--deterministic: dp=" + std::to_string(p) +
                                  " is not a power of two (the sample tree splits in halves)");
    }
  }
  UCP_ASSIGN_OR_RETURN(layout::RankCoords coords, layout::CoordsOfRank(layout, rank));
  dp_rank = coords.dp;
  UCP_CHECK(coords.sp == sp_rank);
  const auto& params = net->params();
  const int64_t np = static_cast<int64_t>(params.size());
  blocks = layout.zero_stage == 0 ? 1 : layout::NumZeroFragments(layout, false);
  block_pieces.assign(static_cast<size_t>(blocks), {});
  std::vector<int64_t> zero3_offset(static_cast<size_t>(np), 0);
  int64_t group1_offset = 0;
  if (layout.zero_stage == 0) {
    block_size = net->num_params();
    for (int64_t i = 0; i < np; ++i) {
      block_pieces[0].push_back({i, params[i].offset, params[i].offset, params[i].numel});
    }
  } else if (layout.zero_stage <= 2) {
    // Each optimizer group is one flat buffer, padded and cut into `blocks` fragments; rank r's
    // block is its fragment of group 0, then its fragment of group 1.
    std::array<std::vector<int64_t>, 2> numels, members;
    for (int64_t i = 0; i < np; ++i) {
      const int g = model.params[i].optimizer_group;
      numels[g].push_back(params[i].numel);
      members[g].push_back(i);
    }
    std::array<layout::ZeroPartition, 2> part;
    for (int g = 0; g < 2; ++g) {
      UCP_ASSIGN_OR_RETURN(part[g], layout::PartitionFlat(numels[g], blocks));
    }
    group1_offset = part[0].fragment_size;
    block_size = part[0].fragment_size + part[1].fragment_size;
    for (int g = 0; g < 2; ++g) {
      for (size_t k = 0; k < members[g].size(); ++k) {
        const int64_t i = members[g][k];
        const int64_t goff = part[g].offsets[k];
        for (int r = 0; r < blocks; ++r) {
          const layout::IndexRange f = part[g].Fragment(r);
          const layout::IndexRange x = layout::Intersect({goff, goff + params[i].numel}, f);
          if (x.empty()) continue;
          block_pieces[r].push_back({i, params[i].offset + (x.inclusive_min - goff),
                                     (g == 0 ? 0 : group1_offset) + x.inclusive_min - f.inclusive_min,
                                     x.size()});
        }
      }
    }
  } else {
    // Stage 3: every parameter partitioned by itself; rank r's block is its fragment of each
    // parameter in canonical order.
    for (int64_t i = 0; i < np; ++i) {
      UCP_ASSIGN_OR_RETURN(layout::ZeroPartition p, layout::PartitionParam(params[i].numel, blocks));
      zero3_offset[i] = block_size;
      for (int r = 0; r < blocks; ++r) {
        const layout::IndexRange x =
            layout::Intersect(p.Fragment(r), {0, params[i].numel});
        if (x.empty()) continue;
        block_pieces[r].push_back({i, params[i].offset + x.inclusive_min, block_size + 0, x.size()});
      }
      block_size += p.fragment_size;
    }
  }
  master.assign(static_cast<size_t>(block_size), 0.0f);
  exp_avg.assign(master.size(), 0.0f);
  exp_avg_sq.assign(master.size(), 0.0f);
  if (blocks > 1) {
    gblock.assign(master.size(), 0.0f);
    // (Staged host buffers exchange a window of every block in a gradient slot instead.)
    if (opts.host_buffers != "staged") {
      flat.assign(static_cast<size_t>(blocks) * master.size(), 0.0f);
    }
  }
  // Where each state tensor of this rank lives in the block.
  UCP_ASSIGN_OR_RETURN(auto infos, api::RankTensors(model, layout, rank, convert::PlanOptions{}));
  std::map<std::string, int64_t> index;
  for (int64_t i = 0; i < np; ++i) index[params[i].name] = i;
  for (const convert::TensorInfo& t : infos) {
    const int64_t n = NumElementsOrDie(t.shape);
    int64_t off = -1;
    if (t.kind == convert::TensorKind::kModelSlice) continue;
    if (t.kind == convert::TensorKind::kOptimSlice) {
      off = params[index.at(t.param)].offset;
    } else if (t.kind == convert::TensorKind::kZeroFragment) {
      off = t.group == 0 ? 0 : group1_offset;
    } else if (t.kind == convert::TensorKind::kZero3Fragment) {
      off = zero3_offset[index.at(t.param)];
    }
    if (off < 0 || off + n > block_size) {
      return InternalError("rank tensor " + t.name + " does not fit the engine's block of " +
                           std::to_string(block_size) + " elements");
    }
    state_offset[t.name] = off;
  }
  return Status::Ok();
}

Status Trainer::Impl::SetUpData() {
  const fs::path data_root = opts.out / "data";
  std::error_code ec;
  fs::create_directories(data_root, ec);
  if (ec) return IoError("cannot create " + data_root.string() + ": " + ec.message());
  fs::path train_path, val_path;
  if (cfg.data == "fortunes") {
    const fs::path dir =
        opts.corpus_dir.empty() ? fs::path("/usr/share/games/fortunes") : opts.corpus_dir;
    UCP_ASSIGN_OR_RETURN(auto files, FortuneFiles(dir), "--data fortunes");
    UCP_ASSIGN_OR_RETURN(CorpusFiles c, BuildCorpus(files, data_root / "fortunes"),
                         "--data fortunes");
    train_path = c.train;
    val_path = c.val;
  } else {
    const fs::path p = cfg.data;
    if (!fs::exists(p, ec)) return NotFoundError("--data " + cfg.data + ": no such file");
    // A token file in llm.c's format is taken as it is; anything else is UTF-8 text whose
    // bytes are the tokens (held in memory: text corpora that fit a file read fit memory).
    // The held-out set is then the last 10% of the tokens.
    Result<TokenFile> tf = TokenFile::Open(p);
    if (tf.ok()) {
      train_path = p;
    } else {
      UCP_RETURN_IF_ERROR(TokenizeTextFile(p, text_tokens), "--data " + cfg.data);
    }
  }
  if (!train_path.empty()) {
    UCP_ASSIGN_OR_RETURN(TokenFile t, TokenFile::Open(train_path));
    train_file.emplace(std::move(t));
    train_tokens = train_file->tokens();
  } else {
    train_tokens = text_tokens;
  }
  if (!val_path.empty()) {
    UCP_ASSIGN_OR_RETURN(TokenFile v, TokenFile::Open(val_path));
    val_file.emplace(std::move(v));
    val_tokens = val_file->tokens();
  } else {
    const size_t hold = train_tokens.size() / 10;
    val_tokens = train_tokens.subspan(train_tokens.size() - hold);
    train_tokens = train_tokens.subspan(0, train_tokens.size() - hold);
  }
  const int64_t vocab = net->config().vocab;
  for (auto span : {train_tokens, val_tokens}) {
    for (size_t i = 0; i < span.size(); ++i) {
      if (span[i] >= vocab) {
        return InvalidArgumentError("--data " + cfg.data + ": token " + std::to_string(span[i]) +
                                    " at position " + std::to_string(i) +
                                    " is outside the model's vocabulary of " +
                                    std::to_string(vocab));
      }
    }
  }
  UCP_ASSIGN_OR_RETURN(Sampler s, Sampler::Create(static_cast<int64_t>(train_tokens.size()),
                                                  seq_len, cfg.seed),
                       "--data " + cfg.data);
  sampler.emplace(std::move(s));
  inputs.assign(static_cast<size_t>(micro_batch * seq_len / sp), 0);
  targets.assign(inputs.size(), 0);
  full_inputs.assign(static_cast<size_t>(micro_batch * seq_len), 0);
  full_targets.assign(full_inputs.size(), 0);
  return Status::Ok();
}

Status Trainer::Impl::InitWeights() {
  const auto& params = net->params();
  const ModelConfig& mc = net->config();
  const double out_std = cfg.init_std / std::sqrt(2.0 * static_cast<double>(mc.layers));
  std::vector<float> scratch;  // the largest parameter, when the host has no compute copy
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params[i];
    const bool norm = EndsWith(p.name, "layernorm.weight");
    const bool bias = EndsWith(p.name, ".bias");
    const bool scaled = EndsWith(p.name, "self_attention.dense.weight") ||
                        EndsWith(p.name, "mlp.dense_4h_to_h.weight");
    const double stdev = scaled ? out_std : cfg.init_std;
    const bool vocab_rows = p.name == "embedding.word_embeddings.weight" ||
                            p.name == "output_layer.weight";
    const int64_t valid = vocab_rows ? mc.vocab * p.shape[1] : p.numel;
    const uint64_t stream = SplitMix64(cfg.seed) ^ Fnv1a(p.name);
    // Into the compute copy, or (none on the host) a buffer of this parameter's size.
    if (!host_compute_copy()) scratch.resize(static_cast<size_t>(p.numel));
    float* dst = host_compute_copy() ? w32.data() + p.offset : scratch.data();
    // Each element is a pure function of (seed, name, index): any split over threads gives the
    // same bits (a billion-parameter model initialises in seconds rather than a minute).
    arena->execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, p.numel, kReduceChunk),
                        [&](const tbb::blocked_range<int64_t>& r) {
                          for (int64_t e = r.begin(); e < r.end(); ++e) {
                            float v = 0.0f;
                            if (e < valid) {
                              v = norm ? 1.0f
                                  : bias ? 0.0f
                                         : static_cast<float>(stdev * NormalAt(stream, e));
                            }
                            dst[e] = v;
                          }
                        });
    });
    // This rank's master pieces within the parameter.
    for (const Piece& pc : my_pieces()) {
      const int64_t lo = std::max(pc.coff, p.offset);
      const int64_t hi = std::min(pc.coff + pc.n, p.offset + p.numel);
      if (lo >= hi) continue;
      std::memcpy(master.data() + pc.foff + (lo - pc.coff), dst + (lo - p.offset),
                  static_cast<size_t>(hi - lo) * 4);
    }
    // The training-dtype weights are the master rounded to nearest even.
    if (staged()) {
      UCP_RETURN_IF_ERROR(PushRounded(dst, p.offset, p.numel), "initialising " + p.name);
    } else if (lowp()) {
      RoundIntoWeights(dst, p.offset, p.numel);
    }
  }
  // The compute copy is widened back from them.
  WidenWeights();
  return Status::Ok();
}

void Trainer::Impl::EarlyNormBegin() {
  EarlyNorm& en = *early_norm;
  arena->execute([&] { en.tasks.wait(); });  // a cancelled step's sums may still run
  const int64_t n = numel();
  for (size_t c = 0; c < en.left.size(); ++c) {
    const int64_t b = static_cast<int64_t>(c) * kReduceChunk;
    en.left[c].store(std::min(n, b + kReduceChunk) - b, std::memory_order_relaxed);
  }
}

void Trainer::Impl::EarlyNormLanded(int bucket) {
  EarlyNorm& en = *early_norm;
  const int64_t n = numel();
  for (const BucketPiece& pc : pipeline->buckets()[static_cast<size_t>(bucket)].pieces) {
    const int64_t lo = pc.grad_offset, hi = pc.grad_offset + pc.n;
    for (int64_t c = lo / kReduceChunk; c * kReduceChunk < hi; ++c) {
      const int64_t got = std::min(hi, (c + 1) * kReduceChunk) - std::max(lo, c * kReduceChunk);
      // The bucket that lands a chunk's last elements sums it (acq_rel: the other buckets'
      // copies into the chunk happen before).
      if (en.left[static_cast<size_t>(c)].fetch_sub(got, std::memory_order_acq_rel) != got) continue;
      arena->execute([&, c] {
        en.tasks.run([this, &en, c, n] {
          SumChunk(std::span<const float>(grads).first(static_cast<size_t>(n)), c,
                   &en.partial[static_cast<size_t>(c)], &en.maxabs[static_cast<size_t>(c)]);
        });
      });
    }
  }
}

Status Trainer::Impl::EarlyNormWait(int64_t chunks) {
  EarlyNorm& en = *early_norm;
  arena->execute([&] { en.tasks.wait(); });
  if (static_cast<int64_t>(en.left.size()) != chunks) {
    return InternalError("gradient norm: " + std::to_string(en.left.size()) + " chunks for " +
                         std::to_string(chunks));
  }
  for (size_t c = 0; c < en.left.size(); ++c) {
    if (en.left[c].load(std::memory_order_acquire) != 0) {
      return InternalError("gradient norm: chunk " + std::to_string(c) +
                           " is missing gradients after every bucket crossed");
    }
  }
  return Status::Ok();
}

void Trainer::Impl::RoundIntoWeights(const float* from, int64_t at, int64_t n) {
  const bool bf16 = dtype == DType::kBf16;
  uint16_t* out = w_lp.data() + at;
  arena->execute([&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kReduceChunk),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        for (int64_t e = r.begin(); e < r.end(); ++e) {
                          out[e] = bf16 ? Bf16FromFloat(from[e]) : HalfFromFloat(from[e]);
                        }
                      });
  });
}

void Trainer::Impl::WidenWeights() {
  // A device training in bf16 takes the bf16 weights and widens them itself (no host copy);
  // fp16 and fp32 go over as the host's fp32 compute copy.
  if (!lowp() || !host_compute_copy()) return;
  const int64_t n = numel();
  const bool bf16 = dtype == DType::kBf16;
  arena->execute([&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kReduceChunk),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        for (int64_t e = r.begin(); e < r.end(); ++e) {
                          w32[e] = bf16 ? FloatFromBf16(w_lp[e]) : FloatFromHalf(w_lp[e]);
                        }
                      });
  });
}

// The rank's tensors as views: into the live state, or into `from` (a staging copy). With
// master_only, just the fp32 master tensors (an --init from another run's weights).
std::vector<std::pair<std::string, TensorView>> Trainer::Impl::Views(bool weights,
                                                                     bool master_only,
                                                                     Staging* from) {
  std::vector<std::pair<std::string, TensorView>> views;
  auto infos = api::RankTensors(model, layout, rank, convert::PlanOptions{});
  UCP_CHECK(infos.ok());  // the layout was checked at set-up
  const auto& params = net->params();
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < params.size(); ++i) by_name[params[i].name] = i;
  std::byte* wbytes = from != nullptr ? from->weights.data()
                      : lowp()        ? reinterpret_cast<std::byte*>(w_lp.data())
                                      : reinterpret_cast<std::byte*>(w32.data());
  auto state_buf = [&](const std::string& state) -> float* {
    if (from != nullptr) {
      return state == "fp32" ? from->master.data()
             : state == "exp_avg" ? from->exp_avg.data() : from->exp_avg_sq.data();
    }
    return state == "fp32" ? master.data()
           : state == "exp_avg" ? exp_avg.data() : exp_avg_sq.data();
  };
  const size_t esize = DTypeSizeBytes(dtype);
  for (const convert::TensorInfo& t : *infos) {
    const int64_t n = NumElementsOrDie(t.shape);
    if (t.kind == convert::TensorKind::kModelSlice) {
      // (Staged host buffers: the live weights are on the device; ModelSlices.)
      if (!weights || master_only || (staged() && from == nullptr)) continue;
      const ParamInfo& p = params[by_name.at(t.param)];
      views.emplace_back(t.name, TensorView{t.dtype, t.shape,
                                            {wbytes + p.offset * esize, size_t(n) * esize}});
      continue;
    }
    if (master_only && t.state != "fp32") continue;
    float* base = state_buf(t.state) + state_offset.at(t.name);
    views.emplace_back(t.name, TensorView{DType::kFp32, t.shape,
                                          {reinterpret_cast<std::byte*>(base), size_t(n) * 4}});
  }
  return views;
}

// The model's weights from the masters of every block (after a step or an --init): the
// training-dtype copy is the masters rounded to nearest even, as Adam's fused copy-out writes
// it, and the compute copy is widened from that. With several blocks, the masters are gathered.
Status Trainer::Impl::RefreshWeights() {
  if (staged() && blocks > 1) return StagedRefresh();
  if (staged()) {
    // One block: its pieces cover the model.
    for (const Piece& pc : block_pieces[0]) {
      UCP_RETURN_IF_ERROR(PushRounded(master.data() + pc.foff, pc.coff, pc.n));
    }
    return Status::Ok();
  }
  const float* src = master.data();
  if (blocks > 1) {
    UCP_RETURN_IF_ERROR(comm->AllGather(master, flat), "gathering the updated weights");
    src = flat.data();
  }
  for (int r = 0; r < blocks; ++r) {
    const float* b = src + (blocks > 1 ? static_cast<int64_t>(r) * block_size : 0);
    for (const Piece& pc : block_pieces[r]) {
      if (lowp()) {
        RoundIntoWeights(b + pc.foff, pc.coff, pc.n);
      } else {
        std::memcpy(w32.data() + pc.coff, b + pc.foff, static_cast<size_t>(pc.n) * 4);
      }
    }
  }
  WidenWeights();
  return Status::Ok();
}

// --- staged host buffers (RunOptions::host_buffers) -----------------------------------------

Status Trainer::Impl::SetUpHostBuffers() {
  const int64_t n = numel();
  UCP_RETURN_IF_ERROR(CheckHostBuffersOption(opts.host_buffers));
  if (opts.host_buffers == "whole") return Status::Ok();
  if (opts.host_buffers == "auto") {
    // Staged where it runs and only where whole buffers would not fit the host: the
    // crossings then go window by window, under the host's work only as far as the double
    // buffering hides them (and twice for the gradients on a device without the norm).
    PlanMachine m;
    m.host_bytes = opts.host_memory > 0 ? opts.host_memory : MeasureHostMemory();
    UCP_ASSIGN_OR_RETURN(const bool pick,
                         AutoStages(MakePlanInput(net->config(), layout), world, m));
    if (!pick) return Status::Ok();
  }
  UCP_RETURN_IF_ERROR(StagingRefusal(world));
  const std::string what = "--host-buffers staged";
  const int64_t w = RequestedHostWindow(opts);
  if (w < 0 || w % kReduceChunk != 0) {
    return InvalidArgumentError(what + ": the window (" + std::to_string(w) + " elements) must "
                                "be a positive multiple of " + std::to_string(kReduceChunk) +
                                " (the gradient norm's chunk)");
  }
  // The pieces of the blocks (in the optimizer's order: ZeRO's groups) must tile the model:
  // each window's Adam (one block) or gather (several) writes every weight in it before the
  // window crosses back.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (const auto& pieces : block_pieces) {
    for (const Piece& pc : pieces) tiles.emplace_back(pc.coff, pc.n);
  }
  std::sort(tiles.begin(), tiles.end());
  int64_t next = 0;
  for (const auto& [coff, pn] : tiles) {
    if (coff != next) {
      return InternalError(what + ": the optimizer's pieces leave model elements [" +
                           std::to_string(next) + ", " + std::to_string(coff) + ") out");
    }
    next += pn;
  }
  if (next != n) {
    return InternalError(what + ": the optimizer's pieces cover " + std::to_string(next) + " of " +
                         std::to_string(n) + " model elements");
  }
  host_window = std::min(w, std::max<int64_t>(n, 1));
  if (blocks > 1) {
    // The blocks' window for the reduce-scatter and the gather: a window of each block, about
    // host_window elements in all, exchanged in a gradient slot (no other scratch).
    block_window = StagedBlockWindow(block_size, host_window, blocks);
    if (blocks * block_window > host_window) {
      return InvalidArgumentError("--host-buffers staged: a window of " +
                                  std::to_string(host_window) + " elements holds no window of " +
                                  "each of the " + std::to_string(blocks) + " ZeRO blocks");
    }
  }
  return Status::Ok();
}

// Staged, several blocks: the gradients reduce-scattered a window of every block at a time; the
// sums are elementwise in rank order, so the block is the whole-buffer reduce-scatter's, bit for
// bit.
Status Trainer::Impl::StagedReduceScatter(SumOrder order) {
  const int64_t B = block_window, W = host_window;
  // Window i of every block crosses into gradient slot i % 2, block r's part at r wb, the
  // exchange's layout (blocks B <= W: StagedBlockWindow), while the host reduces window i - 1.
  auto fetch = [&](int64_t a, int slot) -> Status {
    const int64_t wb = std::min(B, block_size - a);
    float* send = grads.data() + slot * W;
    std::fill(send, send + blocks * wb, 0.0f);  // (the padding of the last fragments)
    return ForEachPieceInBlockWindow(a, wb, [&](int r, const Piece& pc, int64_t x, int64_t y) {
      return device->GradsRangeToHostAsync(pc.coff + (x - pc.foff), y - x, slot, r * wb + (x - a));
    });
  };
  if (block_size > 0) UCP_RETURN_IF_ERROR(fetch(0, 0), "gradients to the host");
  for (int64_t a = 0, i = 0; a < block_size; a += B, ++i) {
    const int slot = static_cast<int>(i % 2);
    const int64_t wb = std::min(B, block_size - a);
    UCP_RETURN_IF_ERROR(device->WaitStaged(slot), "gradients to the host");
    // (The other slot's last exchange has returned: it is free.)
    if (a + B < block_size) UCP_RETURN_IF_ERROR(fetch(a + B, 1 - slot), "gradients to the host");
    UCP_RETURN_IF_ERROR(comm->ReduceScatterDeterministic(
                            std::span<float>(grads).subspan(static_cast<size_t>(slot * W),
                                                            static_cast<size_t>(blocks * wb)),
                            std::span<float>(gblock).subspan(static_cast<size_t>(a),
                                                             static_cast<size_t>(wb)),
                            order),
                        "reducing gradients");
  }
  return Status::Ok();
}

// Staged, several blocks: every block's updated masters gathered a window at a time, each
// piece rounded (the copy-out's rounding) on its way to the device.
Status Trainer::Impl::StagedRefresh() {
  const int64_t B = block_window;
  for (int64_t a = 0; a < block_size; a += B) {
    const int64_t wb = std::min(B, block_size - a);
    // Gathered into gradient slot 0 (free after the reduce-scatter), as the exchange's layout.
    std::span<float> gathered(grads.data(), static_cast<size_t>(blocks * wb));
    UCP_RETURN_IF_ERROR(
        comm->AllGather(std::span<const float>(master).subspan(static_cast<size_t>(a),
                                                               static_cast<size_t>(wb)),
                        gathered),
        "gathering the updated weights");
    UCP_RETURN_IF_ERROR(ForEachPieceInBlockWindow(
        a, wb, [&](int r, const Piece& pc, int64_t x, int64_t y) {
          return PushRounded(gathered.data() + r * wb + (x - a), pc.coff + (x - pc.foff), y - x);
        }));
  }
  return Status::Ok();
}

Status Trainer::Impl::ForEachPieceInBlockWindow(
    int64_t a, int64_t wb, const std::function<Status(int, const Piece&, int64_t, int64_t)>& fn) {
  for (int r = 0; r < blocks; ++r) {
    for (const Piece& pc : block_pieces[static_cast<size_t>(r)]) {
      const int64_t x = std::max(a, pc.foff), y = std::min(a + wb, pc.foff + pc.n);
      if (x < y) UCP_RETURN_IF_ERROR(fn(r, pc, x, y));
    }
  }
  return Status::Ok();
}

Status Trainer::Impl::StagingRefusal(int processes) const {
  const std::string what = "--host-buffers staged";
  if (opts.device == "cpu") {
    return InvalidArgumentError(what + ": the CPU engine's model reads the host buffers "
                                "(--device cuda or twin)");
  }
  if (dtype != DType::kBf16) {
    return UnimplementedError(what + ": bf16 training only (fp16 and fp32 upload the host's "
                              "fp32 compute copy)");
  }
  if (processes != 1 && blocks == 1) {
    return UnimplementedError(what + " with several processes at ZeRO-0: each would reduce "
                              "whole gradients (zero >= 1)");
  }
  if (opts.pipeline != "sync") {
    return UnimplementedError(what + " with --pipeline " + opts.pipeline +
                              ": the pipeline reads whole host buffers (--pipeline sync)");
  }
  if (opts.gpu_tail_buckets > 0) {
    return UnimplementedError(what + " with --gpu-tail-buckets: the device Adam's pieces "
                              "write the host's whole weights");
  }
  if (opts.weights == "streamed") {
    return UnimplementedError(what + " with --weights streamed: streaming reads the host's "
                              "whole weights (--weights resident)");
  }
  return Status::Ok();
}

Result<bool> Trainer::Impl::AutoStages(PlanInput in, int processes, const PlanMachine& m) const {
  // (One process: the processes of a node share its memory.)
  if (processes != 1 || m.host_bytes <= 0 || !StagingRefusal(processes).ok()) return false;
  in.host_window = 0;
  UCP_ASSIGN_OR_RETURN(MemoryPlan whole, PlanMemory(in, m), "--host-buffers auto");
  if (whole.host_fits) return false;
  in.host_window = RequestedHostWindow(opts);
  UCP_ASSIGN_OR_RETURN(MemoryPlan staged, PlanMemory(in, m), "--host-buffers auto");
  return staged.host_fits;  // neither fits: whole, the default's
}

Status Trainer::Impl::PushWeights(const uint16_t* bits, int64_t at, int64_t n) {
  for (int64_t d = 0; d < n; d += host_window) {
    const int64_t m = std::min(host_window, n - d);
    std::memcpy(w_lp.data(), bits + d, static_cast<size_t>(m) * 2);
    UCP_RETURN_IF_ERROR(device->WeightsRangeToDevice(at + d, m));
  }
  return Status::Ok();
}

Status Trainer::Impl::PullWeights(uint16_t* bits, int64_t at, int64_t n) {
  for (int64_t d = 0; d < n; d += host_window) {
    const int64_t m = std::min(host_window, n - d);
    UCP_RETURN_IF_ERROR(device->WeightsRangeToHost(at + d, m));
    std::memcpy(bits + d, w_lp.data(), static_cast<size_t>(m) * 2);
  }
  return Status::Ok();
}

Status Trainer::Impl::PushRounded(const float* from, int64_t at, int64_t n) {
  for (int64_t d = 0; d < n; d += host_window) {
    const int64_t m = std::min(host_window, n - d);
    uint16_t* out = w_lp.data();
    arena->execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, m, kReduceChunk),
                        [&](const tbb::blocked_range<int64_t>& r) {
                          for (int64_t e = r.begin(); e < r.end(); ++e) {
                            out[e] = Bf16FromFloat(from[d + e]);
                          }
                        });
    });
    UCP_RETURN_IF_ERROR(device->WeightsRangeToDevice(at + d, m));
  }
  return Status::Ok();
}

std::vector<Trainer::Impl::SliceInfo> Trainer::Impl::ModelSlices() const {
  std::vector<SliceInfo> out;
  auto infos = api::RankTensors(model, layout, rank, convert::PlanOptions{});
  UCP_CHECK(infos.ok());  // the layout was checked at set-up
  const auto& params = net->params();
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < params.size(); ++i) by_name[params[i].name] = i;
  for (const convert::TensorInfo& t : *infos) {
    if (t.kind != convert::TensorKind::kModelSlice) continue;
    out.push_back({t.name, t.dtype, t.shape, params[by_name.at(t.param)].offset,
                   NumElementsOrDie(t.shape), t.rank == rank});
  }
  return out;
}

std::vector<std::span<const Trainer::Impl::SliceInfo>> Trainer::Impl::SliceBatches(
    const std::vector<SliceInfo>& slices) const {
  std::vector<std::span<const SliceInfo>> out;
  for (size_t b = 0; b < slices.size();) {
    size_t e = b + 1;
    for (int64_t n = slices[b].n; e < slices.size() && n + slices[e].n <= host_window; ++e) {
      n += slices[e].n;
    }
    out.push_back(std::span<const SliceInfo>(slices).subspan(b, e - b));
    b = e;
  }
  return out;
}

Status Trainer::Impl::SaveSlicesFromDevice() {
  std::vector<SliceInfo> mine = ModelSlices();
  std::erase_if(mine, [](const SliceInfo& sl) { return !sl.written_here; });  // dp replicas
  std::vector<uint16_t> buf;
  for (std::span<const SliceInfo> batch : SliceBatches(mine)) {
    const auto views = BatchViews<ConstTensorView>(batch, buf);
    int64_t at = 0;
    for (const SliceInfo& sl : batch) {
      UCP_RETURN_IF_ERROR(PullWeights(buf.data() + at, sl.offset, sl.n), sl.name);
      at += sl.n;
    }
    UCP_RETURN_IF_ERROR(pending->SaveRank(rank, views));
  }
  return Status::Ok();
}

Status Trainer::Impl::StagedGradWindows(
    const std::function<Status(int64_t, int64_t, int)>& work) {
  const int64_t n = numel(), W = host_window;
  const int64_t windows = (n + W - 1) / W;
  auto fetch = [&](int64_t i) {
    return device->GradsRangeToHostAsync(i * W, std::min(W, n - i * W), static_cast<int>(i % 2),
                                         0);
  };
  if (windows > 0) UCP_RETURN_IF_ERROR(fetch(0), "gradients to the host");
  for (int64_t i = 0; i < windows; ++i) {
    const int slot = static_cast<int>(i % 2);
    // (The other slot held window i - 1, which `work` is done with.)
    if (i + 1 < windows) UCP_RETURN_IF_ERROR(fetch(i + 1), "gradients to the host");
    UCP_RETURN_IF_ERROR(device->WaitStaged(slot), "gradients to the host");
    UCP_RETURN_IF_ERROR(work(i * W, std::min(W, n - i * W), slot));
  }
  return Status::Ok();
}

// The chunks are the whole-buffer path's (a window is a whole number of them), summed by the
// same function, so the norm has the same bits.
Status Trainer::Impl::StagedNorm(std::vector<double>& partial, std::vector<float>& maxabs) {
  const int64_t chunks = NumGradNormChunks(numel());
  partial.assign(static_cast<size_t>(chunks), 0.0);
  maxabs.assign(static_cast<size_t>(chunks), 0.0f);
  return StagedGradWindows([&](int64_t lo, int64_t m, int slot) {
    const auto win = std::span<const float>(grads).subspan(static_cast<size_t>(slot * host_window),
                                                           static_cast<size_t>(m));
    const int64_t c0 = lo / kReduceChunk;
    arena->execute([&] {
      tbb::parallel_for(int64_t{0}, NumGradNormChunks(m), [&](int64_t j) {
        SumChunk(win, j, &partial[static_cast<size_t>(c0 + j)],
                 &maxabs[static_cast<size_t>(c0 + j)]);
      });
    });
    return Status::Ok();
  });
}

// Each window's gradients cross again; Adam steps the pieces in it (elementwise, so a piece cut
// at a window's edge has the same bits) and its bf16 copy-out fills the weights' window, which
// crosses back while Adam steps the next window (the slot's wait before window i + 2 also covers
// window i's weights, before Adam rewrites them).
Status Trainer::Impl::StagedAdam(float multiplier) {
  std::vector<AdamSpans> bucket;
  auto step_window = [&](int64_t lo, int64_t m, int slot) -> Status {
    const int64_t hi = lo + m, W = host_window;
    const auto g = std::span<const float>(grads).subspan(static_cast<size_t>(slot * W),
                                                         static_cast<size_t>(m));
    const auto out = std::span(w_lp).subspan(static_cast<size_t>(slot * W), static_cast<size_t>(m));
    bucket.clear();
    for (const Piece& pc : block_pieces[0]) {
      const int64_t a = std::max(lo, pc.coff), b = std::min(hi, pc.coff + pc.n);
      if (a >= b) continue;
      AdamSpans piece;
      piece.param = std::span(master).subspan(pc.foff + (a - pc.coff), b - a);
      piece.grad = GradSpan::Fp32(g.subspan(a - lo, b - a));
      piece.exp_avg = std::span(exp_avg).subspan(pc.foff + (a - pc.coff), b - a);
      piece.exp_avg_sq = std::span(exp_avg_sq).subspan(pc.foff + (a - pc.coff), b - a);
      piece.out = LowpOutSpan::Bf16(out.subspan(a - lo, b - a));
      bucket.push_back(piece);
    }
    UCP_RETURN_IF_ERROR(adam->StepBucketFused(optimizer_steps, bucket, {},
                                              CpuAdam::SnapshotUse::kNone, multiplier));
    return device->WeightsRangeToDeviceAsync(lo, m, slot).WithContext("weights to the device");
  };
  UCP_RETURN_IF_ERROR(StagedGradWindows(step_window));
  for (int s = 0; s < kStagedSlots; ++s) {
    UCP_RETURN_IF_ERROR(device->WaitStaged(s), "weights to the device");
  }
  return Status::Ok();
}

// --deterministic: the gradient (into `out`) and loss (into `loss`) of global samples [lo, hi)
// summed by the halving tree of offload/comm/ordered_sum.h: even count, the two halves' sums
// added; odd count, the samples folded in order. Each sample's gradient is computed alone (a
// micro-batch of 1, into a zeroed buffer), so no sum depends on how samples were batched.
Status Trainer::Impl::TreeGrad(int64_t lo, int64_t hi, int level, float* out, double* loss,
                               float grad_scale) {
  const int64_t n = hi - lo;
  const size_t numel = grads.size();
  if (n == 1) {
    std::fill(out, out + numel, 0.0f);
    const size_t len = static_cast<size_t>(seq_len);
    sampler->Fill(train_tokens, lo, 1, std::span(inputs).first(len), std::span(targets).first(len));
    Batch b{std::span<const int32_t>(inputs).first(len),
            std::span<const int32_t>(targets).first(len), 1, seq_len};
    UCP_ASSIGN_OR_RETURN(*loss, net->ForwardBackward(w32, std::span<float>(out, numel), b,
                                                     grad_scale));
    return Status::Ok();
  }
  // The outer vector is sized once (64 levels: the depth is about log2 of the sample count), so
  // a deeper call never moves the buffer a caller holds.
  if (tree_bufs.empty()) tree_bufs.resize(64);
  UCP_CHECK(static_cast<size_t>(level) < tree_bufs.size());
  std::vector<float>& tmp = tree_bufs[level];
  tmp.resize(numel);
  double other = 0;
  if (n % 2 == 0) {
    const int64_t mid = lo + n / 2;
    UCP_RETURN_IF_ERROR(TreeGrad(lo, mid, level + 1, out, loss, grad_scale));
    UCP_RETURN_IF_ERROR(TreeGrad(mid, hi, level + 1, tmp.data(), &other, grad_scale));
    for (size_t i = 0; i < numel; ++i) out[i] = out[i] + tmp[i];
    *loss = *loss + other;
    return Status::Ok();
  }
  UCP_RETURN_IF_ERROR(TreeGrad(lo, lo + 1, level + 1, out, loss, grad_scale));
  for (int64_t s = lo + 1; s < hi; ++s) {
    UCP_RETURN_IF_ERROR(TreeGrad(s, s + 1, level + 1, tmp.data(), &other, grad_scale));
    for (size_t i = 0; i < numel; ++i) out[i] = out[i] + tmp[i];
    *loss = *loss + other;
  }
  return Status::Ok();
}

// Global samples [first, first + nb) as this rank's micro-batch: whole samples, or with sp > 1
// this rank's contiguous shard of their positions (targets alike) at its position offset.
Result<Batch> Trainer::Impl::MicroBatch(int64_t first, int64_t nb) {
  const size_t len = static_cast<size_t>(nb * seq_len);
  if (sp == 1) {
    sampler->Fill(train_tokens, first, nb, std::span(inputs).first(len),
                  std::span(targets).first(len));
    return Batch{std::span<const int32_t>(inputs).first(len),
                 std::span<const int32_t>(targets).first(len), nb, seq_len};
  }
  sampler->Fill(train_tokens, first, nb, std::span(full_inputs).first(len),
                std::span(full_targets).first(len));
  const int64_t ts = seq_len / sp;
  for (int64_t b = 0; b < nb; ++b) {
    std::memcpy(inputs.data() + b * ts, full_inputs.data() + b * seq_len + sp_rank * ts, ts * 4);
    std::memcpy(targets.data() + b * ts, full_targets.data() + b * seq_len + sp_rank * ts, ts * 4);
  }
  const size_t slen = static_cast<size_t>(nb * ts);
  Batch batch{std::span<const int32_t>(inputs).first(slen),
              std::span<const int32_t>(targets).first(slen), nb, ts};
  batch.position_offset = sp_rank * ts;
  return batch;
}

// The sum over all processes of one double per process: each process fills its own slot of a
// zeroed vector, so the library's all-reduce only ever adds zeros (exact), and the order of the
// real adds is fixed here: rank order, or (--deterministic) the halving tree of ordered_sum.h.
Result<double> Trainer::Impl::SumOverRanks(double local, SumOrder order) {
  if (world == 1) return local;
  std::vector<double> slots(static_cast<size_t>(world), 0.0);
  slots[static_cast<size_t>(rank)] = local;
  UCP_RETURN_IF_ERROR(comm->AllReduce(std::span<double>(slots), ReduceOp::kSum));
  if (order == SumOrder::kRankOrder) {
    double sum = 0;
    for (double v : slots) sum += v;
    return sum;
  }
  std::function<double(size_t, size_t)> tree = [&](size_t lo, size_t hi) -> double {
    const size_t n = hi - lo;
    if (n == 1) return slots[lo];
    if (n % 2 == 0) return tree(lo, lo + n / 2) + tree(lo + n / 2, hi);
    double acc = slots[lo];
    for (size_t i = lo + 1; i < hi; ++i) acc += slots[i];
    return acc;
  };
  return tree(0, slots.size());
}

std::string Trainer::Impl::ClientState() const {
  json s{{"version", kClientStateVersion},
         {"step", step},
         {"consumed_samples", consumed},
         {"optimizer_steps", optimizer_steps},
         {"skipped_steps", skipped_steps},
         {"loss_scale", scaler.scale},
         {"loss_scale_good_steps", scaler.good_steps},
         {"train_tokens", static_cast<int64_t>(train_tokens.size())},
         {"config", ConfigToJson(cfg)}};
  return json{{"ucp_train", s}}.dump();
}

Status Trainer::Impl::ApplyClientState(const std::string& text, const std::string& where) {
  if (text.empty()) {
    return FailedPreconditionError(where + ": no ucp_train client state (not a ucp-train "
                                           "checkpoint; use --init to start from its weights)");
  }
  UCP_ASSIGN_OR_RETURN(json j, ucp::json::ParseStrict(text, where + ": client state",
                                                      StatusCode::kDataLoss));
  if (!j.contains("ucp_train") || !j["ucp_train"].is_object()) {
    return FailedPreconditionError(where + ": no ucp_train client state (not a ucp-train "
                                           "checkpoint; use --init to start from its weights)");
  }
  const json& s = j["ucp_train"];
  try {
    if (s.at("version").get<int>() != kClientStateVersion) {
      return UnimplementedError(where + ": ucp_train.version " +
                                std::to_string(s.at("version").get<int>()) + " is not supported");
    }
    step = s.at("step").get<int64_t>();
    consumed = s.at("consumed_samples").get<int64_t>();
    optimizer_steps = s.at("optimizer_steps").get<int64_t>();
    skipped_steps = s.at("skipped_steps").get<int64_t>();
    scaler.scale = s.at("loss_scale").get<double>();
    scaler.good_steps = s.at("loss_scale_good_steps").get<int64_t>();
    const int64_t recorded_tokens = s.at("train_tokens").get<int64_t>();
    if (recorded_tokens != static_cast<int64_t>(train_tokens.size())) {
      return FailedPreconditionError(
          where + ": the training data changed: the run trained on " +
          std::to_string(recorded_tokens) + " tokens, --data " + cfg.data + " now holds " +
          std::to_string(train_tokens.size()) + " (the sample order would differ)");
    }
  } catch (const std::exception&) {
    return DataLossError(where + ": ucp_train client state has a missing or mistyped field");
  }
  if (consumed != step * cfg.global_batch) {
    return DataLossError(where + ": ucp_train.consumed_samples " + std::to_string(consumed) +
                         " is not step " + std::to_string(step) + " x global batch " +
                         std::to_string(cfg.global_batch));
  }
  return Status::Ok();
}

Status Trainer::Impl::Restore(const api::CheckpointSource& src, const fs::path& ckpt,
                              bool full) {
  const api::CheckpointMeta& meta = src.meta();
  // The source must describe the same parameters (names and logical shapes).
  if (meta.model.params.size() != model.params.size()) {
    return FailedPreconditionError(ckpt.string() + " holds " +
                                   std::to_string(meta.model.params.size()) +
                                   " parameters; the model has " +
                                   std::to_string(model.params.size()));
  }
  for (size_t i = 0; i < model.params.size(); ++i) {
    if (meta.model.params[i].name != model.params[i].name ||
        meta.model.params[i].shape != model.params[i].shape) {
      return FailedPreconditionError(ckpt.string() + ": parameter \"" +
                                     meta.model.params[i].name + "\" differs from the model's \"" +
                                     model.params[i].name + "\" (name or shape)");
    }
  }
  const bool has_master = std::find(meta.optimizer_states.begin(), meta.optimizer_states.end(),
                                    "fp32") != meta.optimizer_states.end();
  if (full) {
    // Everything, bitwise: the training-dtype weights, masters and Adam states of this rank.
    auto views = Views(/*weights=*/true, /*master_only=*/false, nullptr);
    UCP_RETURN_IF_ERROR(api::RestoreRank(src, layout, rank, views),
                        "restoring " + ckpt.string());
    if (staged()) {
      // The weights to the device as the checkpoint holds them, a batch of parameters a read.
      const std::vector<SliceInfo> slices = ModelSlices();
      std::vector<uint16_t> buf;
      for (std::span<const SliceInfo> batch : SliceBatches(slices)) {
        UCP_RETURN_IF_ERROR(api::RestoreRank(src, layout, rank, BatchViews<TensorView>(batch, buf)),
                            "restoring " + ckpt.string());
        int64_t at = 0;
        for (const SliceInfo& sl : batch) {
          UCP_RETURN_IF_ERROR(PushWeights(buf.data() + at, sl.offset, sl.n),
                              "restoring " + ckpt.string() + ": " + sl.name);
          at += sl.n;
        }
      }
    }
    WidenWeights();  // fp32 training restored its weights into the compute copy itself
    return Status::Ok();
  }
  // --init: weights only; Adam starts from zero. The masters come from the source's fp32
  // state (never rebuilt from a low-precision copy); the weights are made from them.
  if (!has_master) {
    return UnimplementedError(ckpt.string() + " holds no fp32 master weights (state \"fp32\")");
  }
  auto views = Views(false, /*master_only=*/true, nullptr);
  UCP_RETURN_IF_ERROR(api::RestoreRank(src, layout, rank, views), "restoring " + ckpt.string());
  return RefreshWeights();
}

void Trainer::Impl::AppendLog(const json& line) {
  std::ofstream f(log_path, std::ios::app);
  f << line.dump() << "\n";
}

// Starts a save of the staged state: RankSaver::Create is collective (every process, this
// thread), the rank's tensors are written by a background thread, and FinishSave commits.
Status Trainer::Impl::StartSave() {
  api::CheckpointMeta meta;
  meta.format = api::Format::kDistributed;
  meta.layout = layout;
  meta.spec = spec;
  meta.model = model;
  meta.step = step;
  meta.optimizer_kind = "adamw";
  meta.optimizer_hyper = {{"lr", last_lr},
                          {"beta1", cfg.beta1},
                          {"beta2", cfg.beta2},
                          {"eps", cfg.eps},
                          {"weight_decay", cfg.weight_decay}};
  meta.client_state_json = ClientState();
  api::SaveOptions so;
  if (save_group != nullptr) {
    so.group = save_group.get();
    so.ranks = {rank};
  }
  UCP_ASSIGN_OR_RETURN(api::RankSaver s, api::RankSaver::Create(opts.out / StepDirName(step), meta, so));
  pending.emplace(std::move(s));
  pending_step = step;
  saver_done = false;
  save_status = Status::Ok();
  auto write = [this] {
    // A background save writes the staged copy (training goes on); a foreground one the live
    // state itself, which nothing changes until it returns, so it needs no copy.
    auto views = Views(true, false, opts.async_save ? &staging : nullptr);
    std::vector<std::pair<std::string, ConstTensorView>> cviews;
    cviews.reserve(views.size());
    for (auto& [n, v] : views) cviews.emplace_back(n, v);
    save_status = pending->SaveRank(rank, cviews);
    // Staged host buffers, a foreground save: the weights from the device, a parameter at a time.
    if (save_status.ok() && staged() && !opts.async_save) save_status = SaveSlicesFromDevice();
    saver_done = true;
  };
  if (opts.async_save) {
    saver = std::thread(write);
  } else {
    write();
  }
  return Status::Ok();
}

// Commits the save in flight (collective): every process has written its rank; the root then
// points `latest` at it (written last, so it always names a complete checkpoint) and applies
// --keep.
Status Trainer::Impl::FinishSave() {
  if (!pending.has_value()) return Status::Ok();
  if (saver.joinable()) saver.join();
  // Every process learns whether any rank failed before the collective commit.
  Status st = save_status;
  UCP_ASSIGN_OR_RETURN(double failures, SumOverRanks(st.ok() ? 0.0 : 1.0));
  if (failures == 0) st = pending->Commit();
  pending.reset();
  if (!st.ok()) return st;
  if (failures > 0) {
    return IoError("saving step " + std::to_string(pending_step) + " failed on " +
                   std::to_string(static_cast<int>(failures)) + " process(es)");
  }
  if (root()) {
    UCP_RETURN_IF_ERROR(
        io::WriteFileAtomic(opts.out / "latest", StepDirName(pending_step) + "\n"));
    if (cfg.keep > 0) {
      auto all = RunCheckpoints(opts.out);
      for (size_t i = 0; i + static_cast<size_t>(cfg.keep) < all.size(); ++i) {
        // Renamed out of the way first: a kill during the removal then leaves a `.tmp-` folder
        // (refused by readers, cleared by the resumed run), never a step_N missing files.
        const fs::path& old = all[i].second;
        fs::path doomed = old;
        doomed += std::string(io::kTempMarker) + "removing-" + std::to_string(::getpid());
        std::error_code ec;
        fs::rename(old, doomed, ec);
        if (!ec) io::RemoveTreeBestEffort(doomed);  // (a failed rename keeps the old one)
      }
    }
  }
  return Status::Ok();
}

// --device: checks what runs on a device, then makes it over the host buffers. With
// --gpu-tail-buckets N the pieces of the last N grad groups (the ones backward finishes last:
// the first layers and the embeddings) keep their master and Adam states on the device.
Status Trainer::Impl::SetUpDevice(const AdamConfig& ac) {
  if (opts.gpu_gemm != "auto" && opts.gpu_gemm != "fp32") {
    return InvalidArgumentError("--gpu-gemm " + opts.gpu_gemm + ": must be auto or fp32");
  }
  if (opts.gpu_attention != "gemm" && opts.gpu_attention != "flash") {
    return InvalidArgumentError("--gpu-attention " + opts.gpu_attention +
                                ": must be gemm or flash");
  }
  if (opts.gpu_attention == "flash" && (opts.gpu_gemm != "auto" || dtype != DType::kBf16)) {
    return InvalidArgumentError("--gpu-attention flash: only with bf16 training and --gpu-gemm "
                                "auto (the flash kernels are the bf16 GEMMs' attention)");
  }
  UCP_ASSIGN_OR_RETURN(const WeightChoice weights, ParseWeightChoice(opts.weights));
  if (opts.device == "cpu") {
    // The device's options do nothing here: refused rather than ignored, so that a command
    // line meant for a GPU does not quietly time something else.
    if (weights == WeightChoice::kStreamed) {
      return InvalidArgumentError("--weights streamed: the CPU engine has no device to stream "
                                  "to (--device cuda or twin)");
    }
    if (opts.gpu_gemm != "auto" || opts.gpu_attention != "gemm") {
      return InvalidArgumentError(
          std::string(opts.gpu_gemm != "auto" ? "--gpu-gemm " + opts.gpu_gemm
                                              : "--gpu-attention " + opts.gpu_attention) +
          ": the CPU engine runs its own kernels (a GPU's with --device cuda)");
    }
    if (opts.gpu_tail_buckets > 0 && opts.pipeline != "overlap") {
      return InvalidArgumentError("--gpu-tail-buckets " + std::to_string(opts.gpu_tail_buckets) +
                                  ": the CPU engine keeps tail buckets apart only in its "
                                  "pipeline (--pipeline overlap), or give --device cuda");
    }
    return ResolveTailBuckets(net->config(), layout, PlanMachine{}, false);
  }
  if (opts.device != "cuda" && opts.device != "twin") {
    return InvalidArgumentError("--device " + opts.device + ": must be cpu, cuda or twin");
  }
  if (opts.device == "cuda" && !opts.device_factory) {
    return FailedPreconditionError("--device cuda: this build has no CUDA engine (ucp was built "
                                   "without nvcc)");
  }
  if (opts.pipeline == "overlap") {
    // The pipeline on a device: one process trains bf16 or fp16 (fp32 training's device
    // weights would be the host masters), its tail buckets crossing for the norm and stepped by
    // the device Adam after validation. With several processes each bucket comes to the host to
    // be reduced (GroupGradsToHost) and the pipeline is the CPU one's (no tail buckets: below).
    const std::string what = "--device " + opts.device + " with --pipeline overlap";
    if (dtype == DType::kFp32 && world == 1) {
      return UnimplementedError(what + ": bf16 or fp16 training in one process (fp32 "
                                "training's device weights would be the host masters)");
    }
  }
  if (cfg.deterministic) {
    return UnimplementedError("--device " + opts.device + " does not run --deterministic");
  }
  TrainDeviceSpec ds;
  ds.model = net->config();
  ds.weights = dtype == DType::kBf16   ? LowpDType::kBf16
                 : dtype == DType::kFp16 ? LowpDType::kFp16 : LowpDType::kFp32;
  ds.max_batch = micro_batch;
  ds.seq_len = seq_len;
  ds.rank = rank;
  ds.threads = threads;
  ds.sp_comm = sp_funneled.get();  // null at sp = 1
  ds.h_grads = grads;
  ds.h_weights16 = w_lp;
  ds.h_weights32 = w32;
  ds.host_window = host_window;
  ds.adam = ac;
  ds.gemm_bf16 = opts.gpu_gemm == "auto" && dtype == DType::kBf16;
  ds.flash_attention = ds.gemm_bf16 && opts.gpu_attention == "flash";
  ds.recompute = recompute;
  // Weight placement (memory_plan.h): as asked, or with "auto" the plan's for the device's
  // memory when it is known.
  if (weights == WeightChoice::kStreamed) {
    ds.stream_weights = true;
  } else if (weights == WeightChoice::kAuto && opts.device_memory > 0 &&
             opts.gpu_tail_buckets <= 0 && !staged()) {
    // (The device Adam's pieces and staged host buffers need resident weights.)
    PlanMachine m;
    m.device_bytes = opts.device_memory;
    UCP_ASSIGN_OR_RETURN(MemoryPlan plan, PlanMemory(MakePlanInput(ds.model, layout), m),
                         "--weights auto");
    ds.stream_weights = plan.placement == WeightPlacement::kStreamed;
  }
  {
    PlanMachine m;
    m.device_bytes = opts.device_memory;
    UCP_RETURN_IF_ERROR(ResolveTailBuckets(ds.model, layout, m, ds.stream_weights));
  }
  const int tail = tail_buckets;
  if (ds.stream_weights && tail != 0) {
    return UnimplementedError("--gpu-tail-buckets " + std::to_string(tail) + " with streamed "
                              "weights: the device Adam's pieces need resident weights "
                              "(--weights resident)");
  }
  const auto& groups = net->grad_groups();  // (ResolveTailBuckets checked the count)
  piece_on_device.assign(block_pieces[0].size(), 0);
  if (tail > 0) {
    if (blocks != 1 || world != 1) {
      return UnimplementedError("--gpu-tail-buckets with --device: one process only");
    }
    if (dtype == DType::kFp32) {
      return UnimplementedError("--gpu-tail-buckets with --device: bf16 or fp16 training only "
                                "(fp32 training's weights are the masters)");
    }
    for (size_t k = groups.size() - static_cast<size_t>(tail); k < groups.size(); ++k) {
      for (size_t i = 0; i < block_pieces[0].size(); ++i) {
        const Piece& pc = block_pieces[0][i];
        if (pc.param >= groups[k].first_param && pc.param < groups[k].end_param) {
          piece_on_device[i] = 1;
          ds.device_pieces.push_back({pc.coff, pc.foff, pc.n});
        }
      }
    }
  }
  // Several processes, synchronous: the step's reduction runs on the devices, with the bits of
  // the host's reduction in Step. At ZeRO 1-3 a reduce-scatter, only each rank's block coming
  // to the host (TrainDevice::ReduceGradsToHost); at ZeRO-0 an all-reduce, the whole sum
  // crossing to every rank's host (AllReduceGradsToHost). (Streamed and staged buffers keep
  // the host's reductions.)
  if (world > 1 && opts.pipeline == "sync" && !staged() && !ds.stream_weights) {
    ds.reduce.comm = comm;
    ds.reduce.all_reduce = blocks == 1;
    if (blocks > 1) {
      ds.reduce.block = block_size;
      for (int r = 0; r < blocks; ++r) {
        for (const Piece& pc : block_pieces[static_cast<size_t>(r)]) {
          ds.reduce.pieces.push_back({r, pc.coff, pc.foff, pc.n});
        }
      }
    }
    device_reduces = true;
  }
  // Overlapped, several processes: each bucket's exchange (ReduceBucket) runs on the devices,
  // only this rank's sum of it crossing to the host (TrainDevice::ExchangeBucketToHost).
  if (world > 1 && opts.pipeline == "overlap" && !staged() && !ds.stream_weights) {
    UCP_RETURN_IF_ERROR(PlanBucketReduce());
    ds.reduce.comm = comm;
    for (const BucketReduce& br : bucket_reduce) ds.reduce.buckets.push_back(br.ex);
    device_exchanges = true;
  }
  Result<std::unique_ptr<TrainDevice>> made =
      opts.device == "twin" ? MakeCpuTwinDevice(ds) : opts.device_factory(ds);
  if (!made.ok() && made.status().code() == StatusCode::kResourceExhausted &&
      opts.device_memory > 0) {
    // Out of device memory: say what would fit (the plan's verdict names a count of layers to
    // recompute, or that the micro-batch or the sequence must shrink).
    PlanMachine m;
    m.device_bytes = opts.device_memory;
    if (Result<MemoryPlan> plan = PlanMemory(MakePlanInput(ds.model, layout), m); plan.ok()) {
      return made.status().WithContext("--device " + opts.device + "; the memory plan for its " +
                                       FormatBytes(opts.device_memory) + ": " + plan->verdict);
    }
  }
  UCP_ASSIGN_OR_RETURN(device, std::move(made), "--device " + opts.device);
  return Status::Ok();
}

// Each parameter's grad group (the model's grad_groups()), by parameter index.
std::vector<int> Trainer::Impl::GroupOfParams() const {
  const auto& groups = net->grad_groups();
  std::vector<int> group_of(net->params().size(), 0);
  for (size_t k = 0; k < groups.size(); ++k) {
    for (int64_t i = groups[k].first_param; i < groups[k].end_param; ++i) {
      group_of[static_cast<size_t>(i)] = static_cast<int>(k);
    }
  }
  return group_of;
}

// --pipeline overlap with several processes: each bucket's exchange (BucketReduce), and the
// host's scratch for the largest. Once (SetUpDevice may ask first, for the device's exchanges).
Status Trainer::Impl::PlanBucketReduce() {
  if (!bucket_reduce.empty()) return Status::Ok();
  const std::vector<int> group_of = GroupOfParams();
  bucket_reduce.assign(net->grad_groups().size(), {});
  if (blocks > 1) {
    UCP_CHECK(blocks == world);
    for (BucketReduce& br : bucket_reduce) br.ex.send_counts.assign(static_cast<size_t>(world), 0);
    for (int r = 0; r < blocks; ++r) {
      for (const Piece& pc : block_pieces[r]) {
        BucketReduce& br = bucket_reduce[static_cast<size_t>(group_of[pc.param])];
        br.ex.pack.push_back({pc.coff, pc.n});
        br.ex.send_counts[static_cast<size_t>(r)] += pc.n;
        if (r == rank) {
          br.mine.push_back(pc);
          br.ex.sum_n += pc.n;
        }
      }
    }
    for (BucketReduce& br : bucket_reduce) {
      br.ex.recv_counts.assign(static_cast<size_t>(world), br.ex.sum_n);
    }
  } else {
    for (const Piece& pc : block_pieces[0]) {
      BucketReduce& br = bucket_reduce[static_cast<size_t>(group_of[pc.param])];
      br.ex.pack.push_back({pc.coff, pc.n});
      br.mine.push_back(pc);
      br.ex.sum_n += pc.n;
    }
  }
  for (BucketReduce& br : bucket_reduce) {
    UCP_ASSIGN_OR_RETURN(br.chunks, PlanBucketChunks(br.ex, world, INT64_MAX));
  }
  size_t send = 0, recv = 0, sum = 0;
  for (const BucketReduce& br : bucket_reduce) {
    send = std::max(send, static_cast<size_t>(br.ex.packed()));
    recv = std::max(recv, static_cast<size_t>(br.ex.sum_n * world));
    sum = std::max(sum, static_cast<size_t>(br.ex.sum_n));
  }
  send_buf.assign(send, 0.0f);
  recv_buf.assign(recv, 0.0f);
  sum_buf.assign(sum, 0.0f);
  return Status::Ok();
}

// RunOptions::adam_threads and pin_threads (docs/adr/0015-the-cpu-adams-cores.md).
Status Trainer::Impl::SetUpAdamThreads() {
  if (opts.adam_threads < 0 || opts.adam_threads > threads) {
    return InvalidArgumentError("--adam-threads " + std::to_string(opts.adam_threads) +
                                ": must be in [1, " + std::to_string(threads) +
                                "] (the run's threads), or 0 for the default split");
  }
  if (opts.adam_threads > 0 && opts.pipeline != "overlap") {
    return InvalidArgumentError("--adam-threads " + std::to_string(opts.adam_threads) +
                                ": it sizes the overlapped pipeline's CPU Adam; --pipeline " +
                                opts.pipeline + " steps the optimizer after backward on all " +
                                std::to_string(threads) + " threads");
  }
  if (opts.pin_threads) {
    UCP_ASSIGN_OR_RETURN(own_cpus, ThisThreadCpus(), "--pin-threads");
  }
  if (world == 1) return Status::Ok();
  // Every process (pinning or not) shows the others its host and the CPUs it pins, so that two
  // processes of one host pinning the same CPUs fail together at start-up instead of sharing
  // cores for the whole run.
  constexpr int kWords = kMaxCpus / 64;
  std::vector<int64_t> table(static_cast<size_t>(world) * (1 + kWords), 0);
  int64_t* mine = table.data() + static_cast<size_t>(rank) * (1 + kWords);
  char host[256] = {};
  // A host without a name is its own (negative ids, one per process): nothing to compare.
  mine[0] = gethostname(host, sizeof(host) - 1) == 0
                ? static_cast<int64_t>(std::hash<std::string>{}(host) >> 2) + 1
                : -1 - rank;
  const std::vector<int> pins =
      own_cpus.empty() ? std::vector<int>() : AdamCpus(own_cpus, threads);
  for (const int c : pins) {
    mine[1 + c / 64] |= static_cast<int64_t>(uint64_t{1} << (c % 64));
  }
  UCP_RETURN_IF_ERROR(comm->AllReduce(std::span<int64_t>(table), ReduceOp::kSum),
                      "--pin-threads: the processes' CPUs");
  for (int a = 0; a < world; ++a) {
    for (int b = a + 1; b < world; ++b) {
      const int64_t* ra = table.data() + static_cast<size_t>(a) * (1 + kWords);
      const int64_t* rb = table.data() + static_cast<size_t>(b) * (1 + kWords);
      if (ra[0] != rb[0]) continue;
      std::vector<int> shared;
      for (int c = 0; c < kWords * 64; ++c) {
        const int64_t bit = static_cast<int64_t>(uint64_t{1} << (c % 64));
        if ((ra[1 + c / 64] & bit) != 0 && (rb[1 + c / 64] & bit) != 0) shared.push_back(c);
      }
      if (!shared.empty()) {
        return FailedPreconditionError(
            "--pin-threads: processes " + std::to_string(a) + " and " + std::to_string(b) +
            " share host " + host + " and would pin the CPU Adam to the same CPUs (" +
            CpuListString(shared) + "): bind each process to CPUs of its own (mpirun --bind-to "
            "core --map-by slot:PE=N, or taskset), or leave --pin-threads off");
      }
    }
  }
  return Status::Ok();
}

// --pipeline overlap: one bucket per grad group of the model (a layer, the head, the
// embeddings), in backward order, each the pieces of its parameters in this rank's block.
Status Trainer::Impl::SetUpPipeline(const AdamConfig& ac) {
  if (opts.speculation != "auto" && opts.speculation != "always" && opts.speculation != "off") {
    return InvalidArgumentError("--speculation " + opts.speculation +
                                ": must be auto, always or off");
  }
  if (opts.pipeline == "sync") {
    if (!opts.trace.empty()) return InvalidArgumentError("--trace needs --pipeline overlap");
    return Status::Ok();
  }
  if (opts.pipeline != "overlap") {
    return InvalidArgumentError("--pipeline " + opts.pipeline + ": must be sync or overlap");
  }
  if (cfg.deterministic) {
    return UnimplementedError("--pipeline overlap does not run with --deterministic (its "
                              "gradients are summed in one tree over the whole batch after "
                              "backward): use --pipeline sync");
  }
  if (world > 1 && opts.gpu_tail_buckets > 0) {
    return UnimplementedError("--gpu-tail-buckets " + std::to_string(opts.gpu_tail_buckets) +
                              ": tail buckets run one process only; this run has " +
                              std::to_string(world) + " processes (layout " +
                              layout::ToString(layout) + ")");
  }
  const auto& groups = net->grad_groups();
  const std::vector<int> group_of = GroupOfParams();
  std::vector<Bucket> buckets(groups.size());
  for (size_t k = 0; k < groups.size(); ++k) buckets[k].name = groups[k].name;
  for (const Piece& pc : my_pieces()) {
    buckets[static_cast<size_t>(group_of[static_cast<size_t>(pc.param)])].pieces.push_back(
        {pc.coff, pc.foff, pc.n});
  }
  if (world > 1) UCP_RETURN_IF_ERROR(PlanBucketReduce());
  PipelineOptions po;
  po.adam = ac;
  po.adam_threads = opts.adam_threads > 0
                        ? opts.adam_threads
                        : DefaultAdamThreads(threads, device == nullptr || device->ComputesOnHost(),
                                             world);
  if (!own_cpus.empty()) po.adam_cpus = AdamCpus(own_cpus, po.adam_threads);
  po.gpu_tail_buckets = tail_buckets;
  po.speculate = opts.speculation != "off";
  // On a device the tail buckets' state is the device's (TrainDevice::StepDevicePieces).
  po.tail_stepped_by_caller = device != nullptr;
  // fp16 keeps the synchronous finish: its device weights come from the host's fp32 copy,
  // widened after the whole step.
  finish_under_forward = opts.finish_under_forward && device != nullptr && world == 1 &&
                         dtype == DType::kBf16;
  // With several blocks the weights come from every rank's masters (RefreshWeights' all-gather),
  // so the pipeline writes no low-precision copy.
  po.weights = blocks > 1              ? LowpDType::kFp32
               : dtype == DType::kBf16 ? LowpDType::kBf16
               : dtype == DType::kFp16 ? LowpDType::kFp16 : LowpDType::kFp32;
  po.fp16_range_check = dtype == DType::kFp16;
  if (!opts.trace.empty()) {
    trace = std::make_unique<TraceRecorder>();
    po.trace = trace.get();
  }
  if (device != nullptr && world == 1 && !device->SumsGradNorm()) {
    // The gradient crosses into `grads` (model order) bucket by bucket: the norm's sums start
    // there (where the device does not sum them itself, after backward).
    const size_t chunks = static_cast<size_t>(NumGradNormChunks(numel()));
    early_norm = std::make_unique<EarlyNorm>(&*arena);
    early_norm->left = std::vector<std::atomic<int64_t>>(chunks);
    early_norm->partial.assign(chunks, 0.0);
    early_norm->maxabs.assign(chunks, 0.0f);
    po.on_grad_landed = [this](int k) { EarlyNormLanded(k); };
  }
  PipelineMemory mem{grads,
                     po.weights != LowpDType::kFp32 ? std::span<uint16_t>(w_lp)
                                                    : std::span<uint16_t>(),
                     master, exp_avg, exp_avg_sq};
  if (world > 1) {
    mem.h_reduced_grad = blocks > 1 ? std::span<const float>(gblock) : std::span<const float>(grads);
  }
  std::unique_ptr<PipelineBackend> backend = CpuPipelineBackend();
  if (device != nullptr && world == 1) {
    // The device's gradients and weights cross bucket by bucket; the host staging is the
    // trainer's own gradient and weight buffers (model order, pinned by a GPU device), so the
    // norm, the checkpoints and the host's compute copy read them as in the sync path.
    const DevicePipelineView view = device->PipelineView();
    mem.d_grad = view.grads;
    mem.d_weights = view.weights16;
    mem.h_grad = grads;
    mem.h_weights = w_lp;
    UCP_ASSIGN_OR_RETURN(backend, device->MakePipelineBackend(), "--pipeline overlap");
  }
  UCP_ASSIGN_OR_RETURN(pipeline, Pipeline::Create(po, std::move(buckets), mem, std::move(backend)),
                       "--pipeline overlap");
  return Status::Ok();
}

// Bucket k's gradient (complete in `grads`) reduced over the dp x sp ranks into this rank's
// share (gblock at stages 1-3, grads at stage 0), then handed to the pipeline's Adam. Runs on the
// communicator's thread while backward goes on with the buckets before k. Each element is the
// sum of the same contributions in the same order (rank order, OrderedSum) as the sync path's
// ReduceScatterDeterministic / AllReduceDeterministic of the whole gradient, so the same bits.
Status Trainer::Impl::ReduceBucket(int k) {
  const auto t0 = Clock::now();
  const BucketReduce& br = bucket_reduce[static_cast<size_t>(k)];
  const std::span<float> sum = std::span<float>(sum_buf).first(static_cast<size_t>(br.ex.sum_n));
  const std::string what = "reducing the gradients of " + pipeline->buckets()[k].name;
  if (device_exchanges) {
    // Where the gradients are: only this rank's sum crosses (the same bits as below).
    UCP_RETURN_IF_ERROR(device->ExchangeBucketToHost(k, sum), what);
  } else {
    if (device != nullptr) {
      // The bucket's gradient, complete on the device, to the host buffer the exchange reads.
      UCP_RETURN_IF_ERROR(device->GroupGradsToHost(k),
                          "gradients of " + pipeline->buckets()[k].name);
    }
    UCP_RETURN_IF_ERROR(ExchangeOnHost(br.chunks, *comm, grads, send_buf, recv_buf, sum), what);
  }
  // The sum to this rank's block (stage 0: back into the gradient).
  int64_t at = 0;
  for (const Piece& pc : br.mine) {
    float* to = blocks > 1 ? gblock.data() + pc.foff : grads.data() + pc.coff;
    std::memcpy(to, sum.data() + at, static_cast<size_t>(pc.n) * 4);
    at += pc.n;
  }
  // The speculation's check, on the reduced values (validation decides on the global norm).
  bool finite = true;
  float maxabs = 0.0f;
  for (const float v : sum) {
    finite = finite && std::isfinite(v);
    maxabs = std::max(maxabs, std::fabs(v));
  }
  const bool ok = finite && !(dtype == DType::kFp16 && maxabs > kFp16Max);
  if (trace != nullptr) {
    trace->Add("reduce " + pipeline->buckets()[k].name, "communication", TraceTrack::kReduce, t0,
               Clock::now());
  }
  pipeline->HostBucketReady(k, ok);
  return Status::Ok();
}

// --pipeline overlap with several processes: this rank's micro-batches of [first, end). A worker
// thread runs forward and backward; this (the MPI) thread serves the funnel: each bucket's
// reduction, posted by the backward hook, and the model's sp collectives, in the order they come.
// Returns the sum of the micro-batches' losses. On an error the pipeline's step is cancelled.
Result<double> Trainer::Impl::OverlappedBackward(int64_t first, int64_t end, float grad_scale) {
  Status worker_status, reduce_status;
  double loss_sum = 0;
  funnel->Open();
  std::thread worker([&] {
    const BackwardHook hook = pipeline->Hook([this, &reduce_status](int k) {
      funnel->Post([this, k, &reduce_status] {
        if (!reduce_status.ok()) return;  // the first failure is the one to report
        reduce_status = ReduceBucket(k);
      });
    });
    for (int64_t f = first; f < end && worker_status.ok(); f += micro_batch) {
      const int64_t nb = std::min(micro_batch, end - f);
      Result<Batch> b = MicroBatch(f, nb);
      if (!b.ok()) {
        worker_status = b.status();
        break;
      }
      Result<double> l = ForwardBackward(*b, grad_scale, f + nb < end ? nullptr : &hook);
      if (!l.ok()) {
        worker_status = l.status();
        break;
      }
      loss_sum += *l;
    }
    funnel->Close();
  });
  funnel->Serve();
  worker.join();
  Status st = !worker_status.ok() ? worker_status : reduce_status;
  if (!st.ok()) {
    pipeline->Cancel().IgnoreError();  // the step's own error is the one to report
    return st;
  }
  return loss_sum;
}

// --- the public class -------------------------------------------------------------------------

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;
Trainer::~Trainer() = default;

const TrainConfig& Trainer::config() const { return impl_->cfg; }
int64_t Trainer::step() const { return impl_->step; }
int Trainer::rank() const { return impl_->rank; }
int64_t Trainer::num_params() const { return impl_->net->num_params(); }
Recompute Trainer::recompute() const { return impl_->recompute; }

// The run's model, dtype, sequence length and micro-batch from the config (and the checkpoint it
// resumes or starts from, which `start_src` keeps open): what Create builds and Plan sizes.
Status Trainer::Impl::ResolveRun(const RunOptions& run, fs::path& start_ckpt,
                                 std::unique_ptr<api::CheckpointSource>& start_src,
                                 ModelConfig& mc) {
  Impl& t = *this;
  TrainConfig& c = t.cfg;
  // The model: from the checkpoint when resuming or initialising from one (it records its own
  // description), else from the preset.
  if (!run.resume.empty()) {
    UCP_ASSIGN_OR_RETURN(start_ckpt, FindResumeCheckpoint(run.resume));
  } else if (!run.init.empty()) {
    start_ckpt = run.init;
  }
  if (!start_ckpt.empty()) {
    UCP_ASSIGN_OR_RETURN(start_src, api::CheckpointSource::Open(start_ckpt, t.data_dir),
                         run.resume.empty() ? "--init" : "--resume");
    t.spec = start_src->meta().spec;
    t.model = start_src->meta().model;
    // The engine rotates q/k in half-split pairs (HF's rotate_half, Megatron's default). A model
    // recorded with interleaved pairs (docs/hf.md "Rotary pairing") would train as another model
    // without a word, so it is refused until the engine has that pairing.
    if (auto it = t.spec.hyper.find(std::string(patterns::kRotaryInterleavedHyper));
        it != t.spec.hyper.end() && it->second != 0) {
      return UnimplementedError(
          start_ckpt.string() + ": the model's q/k rows rotate in interleaved pairs (" +
          std::string(patterns::kRotaryInterleavedHyper) + " = " + std::to_string(it->second) +
          "); ucp-train's engine rotates half-split pairs only");
    }
    if (!c.dtype.empty()) {
      UCP_ASSIGN_OR_RETURN(DType d, DTypeFromName(c.dtype), "--dtype");
      t.spec.dtype = d;
      t.model.spec.dtype = d;
      for (auto& p : t.model.params) p.dtype = d;
    }
  } else {
    UCP_ASSIGN_OR_RETURN(auto m, api::LoadResolvedModel(t.data_dir, c.model, c.dtype), "--model");
    t.spec = std::move(m.first);
    t.model = std::move(m.second);
  }
  t.dtype = t.spec.dtype;
  if (t.dtype != DType::kBf16 && t.dtype != DType::kFp16 && t.dtype != DType::kFp32) {
    return InvalidArgumentError("--dtype " + std::string(DTypeName(t.dtype)) +
                                ": the engine trains in bf16, fp16 or fp32");
  }
  c.model = t.spec.name;
  c.dtype = std::string(DTypeName(t.dtype));
  UCP_ASSIGN_OR_RETURN(mc, ModelConfig::FromSpec(t.spec), "model " + t.spec.name);

  if (c.seq_len == 0) c.seq_len = std::min<int64_t>(mc.max_positions > 0 ? mc.max_positions : 256, 256);
  if (c.seq_len < 1) return InvalidArgumentError("--seq-len must be >= 1");
  // The micro-batch is a per-process choice: it is checked against this layout's share of the
  // global batch, and (0) defaults to that share.
  {
    UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(c.layout), "--layout");
    if (l.universal || l.dp < 1 || c.global_batch % l.dp != 0) {
      return InvalidArgumentError("--layout " + c.layout + ": the global batch of " +
                                  std::to_string(c.global_batch) +
                                  " samples does not divide by dp=" + std::to_string(l.dp) +
                                  " (" + std::to_string(c.global_batch) + " = " +
                                  std::to_string(l.dp) + " x " +
                                  std::to_string(c.global_batch / std::max(1, l.dp)) + " + " +
                                  std::to_string(c.global_batch % std::max(1, l.dp)) + ")");
    }
    // The recorded value stays the user's (0: the whole share); what runs is t.micro_batch.
    // A resume at another dp keeps the largest micro-batch up to the recorded one that divides
    // the new share: it changes memory use and summation order, never which samples a step sees.
    const int64_t share = c.global_batch / l.dp;
    int64_t mb = c.micro_batch == 0 ? share : std::min(c.micro_batch, share);
    if (mb < 1) return InvalidArgumentError("--micro-batch must be >= 0");
    if (share % mb != 0) {
      if (run.resume.empty()) {
        return InvalidArgumentError("--micro-batch " + std::to_string(mb) +
                                    " does not divide the global batch's share of " +
                                    std::to_string(share) + " samples per data-parallel rank");
      }
      while (share % mb != 0) --mb;
    }
    t.micro_batch = mb;
  }
  const int64_t total_samples = c.steps * c.global_batch;
  if (c.warmup_samples < 0) c.warmup_samples = total_samples / 20;
  if (c.decay_samples < 0) c.decay_samples = total_samples;
  t.seq_len = c.seq_len;
  return Status::Ok();
}

namespace {

// The run's threads per process: --threads, else the recorded count (a resume's), else the
// CPUs this process may run on.
Result<int> RunThreads(const TrainConfig& config, const RunOptions& opts) {
  if (opts.threads < 0) {
    return InvalidArgumentError("--threads must be >= 0 (0: the run's recorded count, or the "
                                "CPUs this process may run on), got " +
                                std::to_string(opts.threads));
  }
  if (config.threads < 0) {
    return InvalidArgumentError("the run's threads (config \"threads\") must be >= 0, got " +
                                std::to_string(config.threads));
  }
  return opts.threads > 0 ? opts.threads : config.threads > 0 ? config.threads : DefaultThreads();
}

// The run's numbers that no later check reads: each refused with its option's name (a recorded
// config's field is the option's). Nothing here would fail loudly later: a negative loss scale
// trains with negated gradients, eps 0 divides an unused vocabulary row's 0 by 0.
Status CheckNumbers(const TrainConfig& c) {
  const auto finite_at_least = [](double v, double lo) { return std::isfinite(v) && v >= lo; };
  if (c.global_batch < 1) return InvalidArgumentError("--global-batch must be >= 1");
  if (c.steps < 0) return InvalidArgumentError("--steps must be >= 0");
  if (!finite_at_least(c.lr, 0) || !finite_at_least(c.min_lr, 0)) {
    return InvalidArgumentError("--lr and --min-lr must be finite and >= 0");
  }
  if (c.warmup_samples < -1 || c.decay_samples < -1) {
    return InvalidArgumentError("--warmup-samples and --decay-samples must be >= 0, or -1 for "
                                "the default (got " + std::to_string(c.warmup_samples) + " and " +
                                std::to_string(c.decay_samples) + ")");
  }
  if (!finite_at_least(c.clip_grad, 0)) {
    return InvalidArgumentError("--clip-grad must be finite and >= 0");
  }
  if (!(std::isfinite(c.eps) && c.eps > 0)) {
    return InvalidArgumentError("--eps must be finite and > 0 (an element whose gradients have "
                                "all been 0, an unused vocabulary row, would step by 0 / 0)");
  }
  if (!(std::isfinite(c.init_std) && c.init_std > 0)) {
    return InvalidArgumentError("--init-std must be finite and > 0");
  }
  if (!(std::isfinite(c.initial_loss_scale) && c.initial_loss_scale > 0) ||
      c.loss_scale_window < 1) {
    return InvalidArgumentError("--loss-scale must be finite and > 0 and --loss-scale-window "
                                ">= 1 (fp16's dynamic scaler)");
  }
  if (c.val_every < 0 || c.val_samples < 0) {
    return InvalidArgumentError("--val-every and --val-samples must be >= 0");
  }
  if (c.keep < 0 || c.save_every < 0) {
    return InvalidArgumentError("--keep and --save-every must be >= 0");
  }
  return Status::Ok();
}

}  // namespace

Result<MemoryPlan> Trainer::Plan(const TrainConfig& config, const RunOptions& opts,
                                 const PlanMachine& machine) {
  Impl t;
  t.cfg = config;
  UCP_ASSIGN_OR_RETURN(t.threads, RunThreads(config, opts));
  t.cfg.threads = t.threads;
  t.data_dir = opts.data_dir.empty() ? api::UcpDataDir() : opts.data_dir;
  if (!opts.resume.empty() && !opts.init.empty()) {
    return InvalidArgumentError("--resume and --init exclude each other");
  }
  UCP_RETURN_IF_ERROR(CheckNumbers(t.cfg));
  fs::path start_ckpt;
  std::unique_ptr<api::CheckpointSource> start_src;
  ModelConfig mc;
  UCP_RETURN_IF_ERROR(t.ResolveRun(opts, start_ckpt, start_src, mc));
  UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(t.cfg.layout), "--layout");
  if (l.tp != 1 || l.pp != 1 || l.ep != 1) {
    return UnimplementedError("--layout " + layout::ToString(l) +
                              ": the engine runs dp x sp layouts (tp = pp = ep = 1)");
  }
  t.opts = opts;
  UCP_RETURN_IF_ERROR(ParseWeightChoice(opts.weights).status());
  UCP_RETURN_IF_ERROR(CheckHostBuffersOption(opts.host_buffers));
  t.tail_buckets = std::max(0, opts.gpu_tail_buckets);
  UCP_RETURN_IF_ERROR(t.ResolveRecompute(mc, l, machine));
  // As a run decides them: the staging (SetUpHostBuffers), then the tail (SetUpDevice).
  bool staged_auto = false;
  if (opts.host_buffers == "auto") {
    UCP_ASSIGN_OR_RETURN(staged_auto, t.AutoStages(t.MakePlanInput(mc, l), l.dp * l.sp, machine));
    if (staged_auto) t.host_window = RequestedHostWindow(opts);
  }
  UCP_RETURN_IF_ERROR(t.ResolveTailBuckets(mc, l, machine, opts.weights == "streamed"));
  PlanInput in = t.MakePlanInput(mc, l);
  in.host_window_auto = staged_auto;
  return PlanMemory(in, machine);
}

Status Trainer::Impl::ResolveRecompute(const ModelConfig& mc, const layout::Layout& l,
                                        const PlanMachine& machine) {
  const std::string& v = opts.recompute;
  const std::string what = "--recompute " + v;
  recompute = Recompute::None();
  if (v == "none") return Status::Ok();
  if (v == "all") {
    recompute = Recompute::All();
    return Status::Ok();
  }
  if (v == "auto") {
    UCP_ASSIGN_OR_RETURN(recompute,
                         ChooseRecompute(MakePlanInput(mc, l), machine, opts.device != "cpu"),
                         what);
    return Status::Ok();
  }
  int64_t n = -1;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size() || n < 0 || n > mc.layers) {
    return InvalidArgumentError(what + ": must be none, all, auto or a layer count in [0, " +
                                std::to_string(mc.layers) + "] (the model's layers)");
  }
  recompute = Recompute{n};
  return Status::Ok();
}

Status Trainer::Impl::ResolveTailBuckets(const ModelConfig& mc, const layout::Layout& l,
                                         const PlanMachine& machine, bool streamed) {
  const int asked = opts.gpu_tail_buckets;
  tail_note.clear();
  if (asked != kGpuTailAuto) {
    if (asked < 0) {
      return InvalidArgumentError("--gpu-tail-buckets " + std::to_string(asked) +
                                  ": must be auto or a count of grad groups >= 0");
    }
    UCP_RETURN_IF_ERROR(TailBucketElements(mc, asked).status());  // (its range)
    tail_buckets = asked;
    return Status::Ok();
  }
  tail_buckets = 0;
  // Where auto keeps none without asking the plan: what --gpu-tail-buckets N refuses, or no
  // capacity to plan for.
  tail_note = opts.device == "cpu"          ? "the CPU engine"
              : l.dp * l.sp > 1             ? "several processes"
              : dtype == DType::kFp32       ? "fp32 training"
              : streamed                    ? "the weights are streamed"
              : host_window > 0             ? "host buffers are staged"
              : machine.device_bytes <= 0   ? "the device's memory is unknown: --device-memory"
                                            : "";
  if (!tail_note.empty()) return Status::Ok();
  UCP_ASSIGN_OR_RETURN(tail_buckets, ChooseTailBuckets(MakePlanInput(mc, l), machine),
                       "--gpu-tail-buckets auto");
  if (tail_buckets == 0) tail_note = "no room on the device";
  return Status::Ok();
}

PlanInput Trainer::Impl::MakePlanInput(const ModelConfig& mc, const layout::Layout& l) const {
  PlanInput in;
  in.config = mc;
  in.recompute = recompute;
  for (const auto& p : model.params) in.optimizer_group.push_back(p.optimizer_group);
  in.dtype = lowp() ? (dtype == DType::kFp16 ? LowpDType::kFp16 : LowpDType::kBf16)
                    : LowpDType::kFp32;
  in.micro_batch = micro_batch;
  in.seq_len = seq_len;
  in.dp = l.dp;
  in.sp = l.sp;
  in.zero_stage = l.zero_stage;
  in.threads = threads;
  in.overlap = opts.pipeline == "overlap";
  in.speculate = opts.speculation != "off";
  in.async_save = opts.async_save;
  in.weights = ParseWeightChoice(opts.weights).value_or(WeightChoice::kAuto);  // (checked above)
  // The twin's model is the CPU's: its GEMMs read fp32, so its device holds the whole copy.
  in.gpu_gemm_bf16 = opts.gpu_gemm == "auto" && opts.device != "twin";
  in.gpu_flash_attention = opts.gpu_attention == "flash";
  // --gpu-tail-buckets: the last tail_buckets grad groups' elements also on the device
  // (SetUpDevice checks the count).
  if (tail_buckets > 0) {
    in.device_optimizer_elements = TailBucketElements(mc, tail_buckets).value_or(0);
    in.device_optimizer_groups = tail_buckets;
  }
  // A run's choice once made (auto may have staged), else what the options ask.
  in.host_window = host_window > 0                 ? host_window
                   : opts.host_buffers == "staged" ? RequestedHostWindow(opts)
                                                   : 0;
  return in;
}

std::vector<int64_t> Trainer::MemoryInUse() const {
  const Impl& t = *impl_;
  std::vector<int64_t> b(static_cast<size_t>(MemClass::kCount), 0);
  auto at = [&](MemClass c) -> int64_t& { return b[static_cast<size_t>(c)]; };
  auto f = [](const auto& v) { return static_cast<int64_t>(v.size() * 4); };
  at(MemClass::kWeights) = static_cast<int64_t>(t.w_lp.size() * 2);
  at(MemClass::kComputeCopy) = f(t.w32);
  at(MemClass::kGradients) = f(t.grads);
  at(MemClass::kOptimizer) = f(t.master) + f(t.exp_avg) + f(t.exp_avg_sq);
  at(MemClass::kZeroScratch) = f(t.gblock) + f(t.flat);
  at(MemClass::kActivations) = t.net->activation_bytes();
  at(MemClass::kPipelineStaging) = t.pipeline ? t.pipeline->host_staging_bytes() : 0;
  at(MemClass::kSaveStaging) = static_cast<int64_t>(t.staging.weights.size()) +
                               f(t.staging.master) + f(t.staging.exp_avg) +
                               f(t.staging.exp_avg_sq);
  return b;
}

int64_t Trainer::DeviceBytesInUse() const {
  return impl_->device != nullptr ? impl_->device->device_bytes() : 0;
}

int64_t Trainer::DeviceBytesStreamed() const {
  return impl_->device != nullptr ? impl_->device->streamed_bytes() : 0;
}

int64_t Trainer::DeviceBytesStaged() const {
  return impl_->device != nullptr ? impl_->device->staged_bytes() : 0;
}

Result<Trainer> Trainer::Create(const TrainConfig& config, const RunOptions& opts) {
  // A run refused after its --out folder was made (an option checked with the device, a corpus
  // that will not tokenize) leaves nothing behind: the folder goes if this call made it. One
  // process only: with several, a rank that fails early would remove the folder under a peer
  // still reading the data its root wrote there (the peer then fails for that instead).
  struct RemoveOnFailure {
    fs::path dir;
    bool armed = false;
    ~RemoveOnFailure() {
      if (armed) io::RemoveTreeBestEffort(dir);
    }
  } made_out;
  {
    std::error_code exists_ec;
    made_out.dir = opts.out;
    made_out.armed = !opts.out.empty() && !fs::exists(opts.out, exists_ec) && !exists_ec &&
                     (opts.comm == nullptr || opts.comm->size() == 1);
  }
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.cfg = config;
  t.opts = opts;
  t.tail_buckets = std::max(0, opts.gpu_tail_buckets);  // (auto: SetUpDevice)
  UCP_ASSIGN_OR_RETURN(t.threads, RunThreads(config, opts));
  t.cfg.threads = t.threads;
  t.data_dir = opts.data_dir.empty() ? api::UcpDataDir() : opts.data_dir;
  if (opts.out.empty()) return InvalidArgumentError("--out: a run folder is needed");
  if (!opts.resume.empty() && !opts.init.empty()) {
    return InvalidArgumentError("--resume and --init exclude each other");
  }
  if (opts.comm != nullptr) {
    t.comm = opts.comm;
  } else {
    t.own_comm = SelfCommunicator();
    t.comm = t.own_comm.get();
  }
  t.rank = t.comm->rank();
  t.world = t.comm->size();
  if (t.world > 1) {
    // RankSaver's process group (MPI_COMM_WORLD, as the communicator): each process saves its
    // own rank and the root commits.
    UCP_ASSIGN_OR_RETURN(t.save_group, mpi::WorldGroup(), "checkpoint process group");
  }
  TrainConfig& c = t.cfg;
  UCP_RETURN_IF_ERROR(CheckNumbers(c));

  fs::path start_ckpt;
  // Opened once: its model, then its tensors and client state (a DeepSpeed folder's open parses
  // every model-states pickle, so a second open would double the start-up cost).
  std::unique_ptr<api::CheckpointSource> start_src;
  ModelConfig mc;
  UCP_RETURN_IF_ERROR(t.ResolveRun(opts, start_ckpt, start_src, mc));

  // Ulysses: the sp ranks of one dp rank share its samples, each a contiguous shard of the
  // positions; the model swaps sequence shards for head shards around attention.
  {
    UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(c.layout), "--layout");
    t.sp = l.sp;
    if (l.sp > 1) {
      UCP_RETURN_IF_ERROR(ValidateSequenceParallel(mc, l.sp, t.seq_len),
                          "--layout " + layout::ToString(l));
      if (layout::WorldSize(l) != t.world) {
        return FailedPreconditionError("--layout " + layout::ToString(l) + " has " +
                                       std::to_string(layout::WorldSize(l)) + " ranks but " +
                                       std::to_string(t.world) + " processes run it (mpirun -np " +
                                       std::to_string(layout::WorldSize(l)) + ")");
      }
      UCP_ASSIGN_OR_RETURN(layout::RankCoords rc, layout::CoordsOfRank(l, t.rank));
      t.sp_rank = rc.sp;
      UCP_ASSIGN_OR_RETURN(t.sp_comm, t.comm->Split(rc.dp, rc.sp), "the sp group");
    }
    // --recompute auto plans for the device's memory (as --weights auto) or this host's.
    PlanMachine m;
    m.device_bytes = opts.device_memory;
    if (opts.device == "cpu" && opts.recompute == "auto") {
      m.host_bytes = opts.host_memory > 0 ? opts.host_memory : MeasureHostMemory();
    }
    UCP_RETURN_IF_ERROR(t.ResolveRecompute(mc, l, m));
    // Each process plans for its own memory, but under SP a rerun repeats the layer's
    // all-to-alls, so the ranks of an sp group must recompute the same layers: every process
    // takes the most any needs.
    if (opts.recompute == "auto" && t.world > 1) {
      std::array<int64_t, 1> most = {t.recompute.Of(mc.layers)};
      UCP_RETURN_IF_ERROR(t.comm->AllReduce(std::span<int64_t>(most), ReduceOp::kMax),
                          "--recompute auto: agreeing on the layers");
      t.recompute = most[0] == mc.layers ? Recompute::All() : Recompute{most[0]};
    }
  }
  t.funnel = std::make_unique<CommFunnel>();
  if (t.sp_comm != nullptr) t.sp_funneled = FunnelCommunicator(t.sp_comm.get(), t.funnel.get());
  // With a device the CPU model is only the parameter table and grad groups: no activations
  // (and no sequence sharding: the device's model holds the sp group).
  const bool on_device = opts.device != "cpu";
  UCP_ASSIGN_OR_RETURN(Model net,
                       Model::Create(mc, on_device ? 1 : t.micro_batch, on_device ? 1 : t.seq_len,
                                     t.threads, on_device ? nullptr : t.sp_funneled.get(),
                                     on_device ? Recompute::None() : t.recompute));
  t.net.emplace(std::move(net));
  // The model's parameter table must be the rule set's, in the same order (its flat buffer is
  // then the canonical order the optimizer groups are cut from).
  const auto& params = t.net->params();
  if (params.size() != t.model.params.size()) {
    return InternalError("the engine's model has " + std::to_string(params.size()) +
                         " parameters, the rule set " + std::to_string(t.model.params.size()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    UCP_ASSIGN_OR_RETURN(patterns::Slice s, patterns::SliceParam(t.model.params[i], 1, 0, 1, 0));
    if (params[i].name != t.model.params[i].name || params[i].shape != s.local_shape) {
      return InternalError("engine parameter " + params[i].name +
                           " does not match the rule set's " + t.model.params[i].name);
    }
  }
  t.arena.emplace(t.threads);
  UCP_RETURN_IF_ERROR(t.SetUpLayout());
  const size_t n = static_cast<size_t>(t.net->num_params());
  t.n_params = static_cast<int64_t>(n);
  UCP_RETURN_IF_ERROR(t.SetUpHostBuffers());
  const size_t hn = t.staged() ? static_cast<size_t>(kStagedSlots * t.host_window) : n;
  t.w32.assign(t.host_compute_copy() ? n : 0, 0.0f);
  t.grads.assign(hn, 0.0f);
  if (t.lowp()) t.w_lp.assign(hn, 0);

  std::error_code ec;
  fs::create_directories(opts.out, ec);
  if (ec) return IoError("cannot create " + opts.out.string() + ": " + ec.message());
  if (opts.resume.empty() && !RunCheckpoints(opts.out).empty()) {
    return AlreadyExistsError("--out " + opts.out.string() +
                              " already holds checkpoints: --resume it, or choose another folder");
  }
  // The root tokenizes the corpus first; the others then find (and check) its files.
  if (t.root()) UCP_RETURN_IF_ERROR(t.SetUpData());
  UCP_RETURN_IF_ERROR(t.comm->Barrier());
  if (!t.root()) UCP_RETURN_IF_ERROR(t.SetUpData());

  AdamConfig ac;
  ac.lr = static_cast<float>(c.lr);
  ac.beta1 = static_cast<float>(c.beta1);
  ac.beta2 = static_cast<float>(c.beta2);
  ac.eps = static_cast<float>(c.eps);
  ac.weight_decay = static_cast<float>(c.weight_decay);
  ac.decoupled = true;
  UCP_RETURN_IF_ERROR(t.SetUpAdamThreads());
  UCP_ASSIGN_OR_RETURN(CpuAdam adam,
                       CpuAdam::Create(ac, t.threads, BestSimdPath(),
                                       t.own_cpus.empty() ? std::vector<int>()
                                                          : AdamCpus(t.own_cpus, t.threads)),
                       "optimizer");
  t.adam.emplace(std::move(adam));
  UCP_RETURN_IF_ERROR(t.SetUpDevice(ac));
  UCP_RETURN_IF_ERROR(t.SetUpPipeline(ac));  // over the device's memory, when there is one
  t.sched = {c.lr, c.min_lr, c.warmup_samples, c.decay_samples};
  t.scaler.enabled = t.dtype == DType::kFp16;
  t.scaler.scale = t.scaler.enabled ? c.initial_loss_scale : 1.0;
  t.scaler.window = c.loss_scale_window;

  t.log_path = opts.out / "log.jsonl";
  if (!opts.resume.empty()) {
    // A save killed mid-write leaves its step_N.tmp-XXXXXX folder (never a checkpoint: readers
    // refuse .tmp- names); the resumed run owns the folder, so its root clears them.
    for (const auto& e : fs::directory_iterator(opts.out, ec)) {
      if (!t.root()) break;
      const std::string name = e.path().filename().string();
      const size_t at = name.find(io::kTempMarker);
      if (at != std::string::npos && StepOfDirName(name.substr(0, at)) >= 0) {
        io::RemoveTreeBestEffort(e.path());
      }
    }
    UCP_RETURN_IF_ERROR(t.Restore(*start_src, start_ckpt, /*full=*/true));
    UCP_RETURN_IF_ERROR(
        t.ApplyClientState(start_src->meta().client_state_json, start_ckpt.string()));
    // The log keeps what happened up to the checkpoint; the dead run's later lines go.
    std::vector<std::string> kept;
    {
      std::ifstream f(t.log_path);
      std::string line;
      while (std::getline(f, line)) {
        Result<json> j = ucp::json::ParseStrict(line, "log", StatusCode::kDataLoss);
        if (!j.ok() || !j->is_object()) continue;
        if (j->contains("step") && (*j)["step"].is_number_integer() &&
            (*j)["step"].get<int64_t>() > t.step) {
          continue;
        }
        kept.push_back(line);
      }
    }
    std::string text;
    for (const auto& l : kept) text += l + "\n";
    if (t.root()) {
      UCP_RETURN_IF_ERROR(io::WriteFileAtomic(t.log_path, text));
      t.AppendLog({{"event", "resume"},
                   {"step", t.step},
                   {"layout", layout::ToString(t.layout)},
                   {"processes", t.world},
                   {"from", start_ckpt.string()}});
    }
  } else {
    if (!opts.init.empty()) {
      UCP_RETURN_IF_ERROR(t.Restore(*start_src, start_ckpt, /*full=*/false), "--init");
    } else {
      UCP_RETURN_IF_ERROR(t.InitWeights());
    }
    if (t.root()) UCP_RETURN_IF_ERROR(io::WriteFileAtomic(t.log_path, ""));
    if (t.root()) t.AppendLog({{"event", "start"},
                 {"processes", t.world},
                 {"step", 0},
                 {"layout", layout::ToString(t.layout)},
                 {"init", opts.init.string()},
                 {"config", ConfigToJson(c)}});
  }
  if (t.device != nullptr) {
    // The initial or restored state goes to the device (the masters of its pieces, the weights).
    UCP_RETURN_IF_ERROR(t.device->PushState(t.master, t.exp_avg, t.exp_avg_sq),
                        "--device " + opts.device);
    // (Staged host buffers: the weights went window by window as they were made.)
    if (!t.staged()) UCP_RETURN_IF_ERROR(t.device->UploadWeights(), "--device " + opts.device);
  }
  made_out.armed = false;
  return Trainer(std::move(impl));
}

std::string Trainer::Describe() const {
  const Impl& t = *impl_;
  const ModelConfig& mc = t.net->config();
  const std::vector<int>& adam_cpus = t.pipeline != nullptr ? t.pipeline->adam_cpus()
                                                            : t.adam->cpus();
  std::ostringstream os;
  os << "model " << t.spec.name << " (" << t.spec.family << ", " << t.net->num_params()
     << " parameters, " << mc.layers << " layers, hidden " << mc.hidden << ", " << mc.heads
     << " heads / " << mc.kv_heads << " kv, vocab " << mc.vocab << " padded to "
     << mc.padded_vocab << "), training dtype " << DTypeName(t.dtype) << ", layout "
     << layout::ToString(t.layout) << ", " << t.threads << " threads"
     << (t.pipeline != nullptr
             ? " (the overlapped CPU Adam on " + std::to_string(t.pipeline->adam_threads()) + ")"
             : std::string())
     << (adam_cpus.empty() ? std::string()
                           : ", the CPU Adam pinned to CPUs " + CpuListString(adam_cpus))
     << "\n"
     << (t.device != nullptr ? "device " + t.device->Describe() + "\n" : std::string())
     << (t.opts.gpu_tail_buckets == kGpuTailAuto
             ? "--gpu-tail-buckets auto: " + std::to_string(t.tail_buckets) + " of " +
                   std::to_string(t.net->grad_groups().size()) + " grad groups on the device Adam" +
                   (t.tail_note.empty() ? std::string() : " (" + t.tail_note + ")") + "\n"
             : std::string())
     << (t.staged() ? "host buffers staged: windows of " + std::to_string(t.host_window) +
                          " elements (the host holds the optimizer state)\n"
                    : std::string())
     << "data " << t.cfg.data << ": " << t.train_tokens.size() << " training tokens ("
     << t.sampler->num_samples() << " samples of " << t.seq_len << "), " << t.val_tokens.size()
     << " held-out tokens"
     << (t.val_tokens.size() <= static_cast<size_t>(t.seq_len)
             ? " (fewer than a sample: no validation)"
         : t.cfg.val_samples == 0 ? " (--val-samples 0: no validation)"
                                  : "")
     << "\n"
     << "schedule: " << t.cfg.steps << " steps of " << t.cfg.global_batch << " samples ("
     << t.cfg.global_batch * t.seq_len << " tokens) in micro-batches of " << t.micro_batch
     << (t.recompute.Of(mc.layers) > 0 ? "; " + RecomputeNote(t.recompute, mc.layers) : "")
     << "; lr " << t.cfg.lr
     << " -> " << t.cfg.min_lr << ", warm-up " << t.cfg.warmup_samples
     << " samples, "
     << (t.cfg.decay_samples > t.cfg.warmup_samples
             ? "cosine to " + std::to_string(t.cfg.decay_samples) + " samples"
             : std::string("then constant"))
     << "; AdamW(" << t.cfg.beta1 << ", "
     << t.cfg.beta2 << ", eps " << t.cfg.eps << ", wd " << t.cfg.weight_decay << "), clip "
     << t.cfg.clip_grad;
  return os.str();
}

Result<StepRecord> Trainer::Step() {
  Impl& t = *impl_;
  const auto t0 = Clock::now();
  // A save in flight is committed as soon as every process has written its rank (a collective
  // poll, so all processes commit at the same step).
  if (t.pending.has_value()) {
    UCP_ASSIGN_OR_RETURN(double not_done, t.SumOverRanks(t.saver_done ? 0.0 : 1.0));
    if (not_done == 0) {
      UCP_RETURN_IF_ERROR(t.FinishSave(), "an earlier checkpoint save failed");
    }
  }
  StepRecord rec;
  rec.step = t.step + 1;
  auto mark = Clock::now();
  // Ends a phase of rec.phases at now.
  auto phase_end = [&mark](double* phase) {
    const auto now = Clock::now();
    *phase = Seconds(mark, now);
    mark = now;
  };
  const int64_t G = t.cfg.global_batch;
  UCP_ASSIGN_OR_RETURN(auto range, Sampler::RankRange(t.step, G, t.layout.dp, t.dp_rank));
  if (t.device != nullptr) {
    UCP_RETURN_IF_ERROR(t.device->ZeroGrads(), "step " + std::to_string(rec.step));
  } else {
    std::fill(t.grads.begin(), t.grads.end(), 0.0f);
  }
  const int64_t global_tokens = G * t.seq_len;
  const float grad_scale = static_cast<float>(t.scaler.scale / static_cast<double>(global_tokens));
  double loss_sum = 0;
  const bool det = t.cfg.deterministic;
  if (det) {
    UCP_RETURN_IF_ERROR(t.TreeGrad(range.first, range.second, 0, t.grads.data(), &loss_sum,
                                   grad_scale),
                        "step " + std::to_string(rec.step));
  } else if (t.pipeline != nullptr) {
    // --pipeline overlap: the last micro-batch's backward hands each completed bucket to the
    // pipeline, which steps it speculatively with 1/loss_scale (this step's lr and number are
    // known now); a failure undoes every speculative step.
    if (t.trace != nullptr) t.trace->set_enabled(rec.step <= kTraceSteps);
    const int64_t opt_step = t.optimizer_steps + 1;
    const float step_lr = static_cast<float>(t.sched.At(t.consumed + G));
    const float spec_scale = static_cast<float>(1.0 / t.scaler.scale);
    // With the last step's finish in flight the first forward waits for each grad group's
    // weights as it reaches them, and the pipeline begins once forward is done (Begin waits for
    // the whole finish, which forward has by then).
    // (finish_pending stays set until forward has caught up: a step that fails before then
    // leaves the catch-up, group by group, to the next step or CompleteFinish.)
    const bool pending = t.finish_pending;
    if (!pending) {
      if (t.early_norm != nullptr) t.EarlyNormBegin();
      UCP_RETURN_IF_ERROR(t.pipeline->Begin(opt_step, step_lr, spec_scale, t.SpeculateNow()));
    }
    if (t.world > 1) {
      // Buckets reduced over the ranks during backward (the worker/funnel split).
      UCP_ASSIGN_OR_RETURN(loss_sum, t.OverlappedBackward(range.first, range.second, grad_scale),
                           "step " + std::to_string(rec.step));
    }
    // One process: backward on this thread, the hook handing buckets to the copy stage.
    const int64_t begin = t.world > 1 ? range.second : range.first;
    for (int64_t first = begin; first < range.second; first += t.micro_batch) {
      const int64_t nb = std::min(t.micro_batch, range.second - first);
      Result<Batch> b = t.MicroBatch(first, nb);
      if (!b.ok()) {
        t.pipeline->Cancel().IgnoreError();  // the step's own error is the one to report
        return b.status();
      }
      const bool last = first + nb >= range.second;
      BackwardHook hook = last ? t.pipeline->Hook() : BackwardHook{};
      Status waited, begun;
      const bool catch_up = pending && first == begin;
      // Groups whose final weights the device has been told of (each once).
      std::vector<uint8_t> written(catch_up ? t.pipeline->buckets().size() : 0, 0);
      if (catch_up) {
        hook.on_group_needed = [&](int k) {
          if (!waited.ok()) return;
          if (!written[static_cast<size_t>(k)]) {
            const auto w0 = Clock::now();
            waited = t.pipeline->WaitFinished(k);
            rec.phases.finish_wait += Seconds(w0, Clock::now());
            if (waited.ok()) waited = t.device->GroupWeightsWritten(k);
            written[static_cast<size_t>(k)] = 1;
          }
          // The group forward reads next (forward goes down the group numbers), when its finish
          // is done already: told now, so a streamed device may prefetch it under this group.
          const int next = k - 1;
          if (waited.ok() && next >= 0 && !written[static_cast<size_t>(next)] &&
              t.pipeline->IsFinished(next)) {
            waited = t.device->GroupWeightsWritten(next);
            written[static_cast<size_t>(next)] = 1;
          }
        };
        // Begin before backward hands buckets over; after a failed wait or Begin no bucket is
        // handed over, and that error is the step's (below).
        auto on_begin = std::move(hook.on_backward_begin);
        auto on_done = std::move(hook.on_group_done);
        hook.on_backward_begin = [&, on_begin] {
          begun = waited.ok()
                      ? t.pipeline->Begin(opt_step, step_lr, spec_scale, t.SpeculateNow())
                      : waited;
          if (begun.ok()) t.finish_pending = false;  // every group waited for and widened
          if (begun.ok() && t.early_norm != nullptr) t.EarlyNormBegin();
          if (begun.ok() && on_begin) on_begin();
        };
        hook.on_group_done = [&, on_done](int k) {
          if (begun.ok() && on_done) on_done(k);
        };
      }
      const bool hooked = last || catch_up;
      Result<double> l = t.ForwardBackward(*b, grad_scale, hooked ? &hook : nullptr);
      if (catch_up && (!waited.ok() || !begun.ok())) {
        // The weights or the pipeline failed under forward: the state is partly updated, so the
        // run stops here, as after a failed Finish.
        t.pipeline->Cancel().IgnoreError();
        return (!waited.ok() ? waited : begun).WithContext("step " + std::to_string(rec.step));
      }
      if (!l.ok()) {
        t.pipeline->Cancel().IgnoreError();
        return l.status().WithContext("step " + std::to_string(rec.step));
      }
      loss_sum += *l;
    }
    if (t.device != nullptr && t.world == 1) {
      // The norm below reads the host gradient: every bucket must have crossed (the CPU Adam
      // goes on stepping them meanwhile).
      if (Status st = t.pipeline->WaitGradients(); !st.ok()) {
        t.pipeline->Cancel().IgnoreError();
        return st.WithContext("step " + std::to_string(rec.step));
      }
    }
  } else {
    for (int64_t first = range.first; first < range.second; first += t.micro_batch) {
      const int64_t nb = std::min(t.micro_batch, range.second - first);
      UCP_ASSIGN_OR_RETURN(Batch b, t.MicroBatch(first, nb));
      UCP_ASSIGN_OR_RETURN(double l, t.ForwardBackward(b, grad_scale),
                           "step " + std::to_string(rec.step));
      loss_sum += l;
    }
    // The device's gradients come to the host (pinned), where the rest of the step is the
    // CPU engine's (staged host buffers: window by window, below).
    if (t.device != nullptr && !t.staged() && !t.device_reduces) {
      UCP_RETURN_IF_ERROR(t.device->GradsToHost(), "step " + std::to_string(rec.step));
    }
  }
  phase_end(&rec.phases.backward);
  UCP_ASSIGN_OR_RETURN(double global_loss, t.SumOverRanks(loss_sum, det ? SumOrder::kHalvingTree : SumOrder::kRankOrder));
  rec.loss = global_loss / static_cast<double>(global_tokens);
  rec.tokens = global_tokens;

  // Gradients summed over the data-parallel ranks, added in rank order (the same bits on every
  // rank and in every run of this layout): whole at ZeRO-0, else reduce-scattered into each
  // rank's block of the flat view.
  // With --pipeline overlap the buckets were reduced during backward (ReduceBucket).
  std::span<float> g = t.grads;
  const bool reduced = t.pipeline != nullptr && t.world > 1;
  if (t.blocks > 1 && reduced) {
    g = t.gblock;
  } else if (t.device_reduces && t.blocks > 1) {
    // Where the gradients are: only this rank's block crosses (the same bits as below).
    UCP_RETURN_IF_ERROR(t.device->ReduceGradsToHost(t.gblock), "reducing gradients");
    g = t.gblock;
  } else if (t.device_reduces) {
    // ZeRO-0: summed where they are, then the whole sum crosses (the same bits as below).
    UCP_RETURN_IF_ERROR(t.device->AllReduceGradsToHost(), "reducing gradients");
  } else if (t.blocks > 1 && t.staged()) {
    // (No --deterministic on a device.)
    UCP_RETURN_IF_ERROR(t.StagedReduceScatter(SumOrder::kRankOrder),
                        "step " + std::to_string(rec.step));
    g = t.gblock;
  } else if (t.blocks > 1) {
    for (int r = 0; r < t.blocks; ++r) {
      float* blk = t.flat.data() + static_cast<int64_t>(r) * t.block_size;
      for (const Piece& pc : t.block_pieces[r]) {
        std::memcpy(blk + pc.foff, t.grads.data() + pc.coff, static_cast<size_t>(pc.n) * 4);
      }
    }
    const SumOrder order = det ? SumOrder::kHalvingTree : SumOrder::kRankOrder;
    UCP_RETURN_IF_ERROR(t.comm->ReduceScatterDeterministic(t.flat, t.gblock, order),
                        "reducing gradients");
    g = t.gblock;
    if (det) {
      // The norm over the whole reduced gradient in canonical order, as at any other dp.
      UCP_RETURN_IF_ERROR(t.comm->AllGather(t.gblock, t.flat), "gathering gradients");
      for (int r = 0; r < t.blocks; ++r) {
        const float* blk = t.flat.data() + static_cast<int64_t>(r) * t.block_size;
        for (const Piece& pc : t.block_pieces[r]) {
          std::memcpy(t.grads.data() + pc.coff, blk + pc.foff, static_cast<size_t>(pc.n) * 4);
        }
      }
    }
  } else if (t.world > 1 && !reduced) {
    UCP_RETURN_IF_ERROR(
        t.comm->AllReduceDeterministic(t.grads, det ? SumOrder::kHalvingTree : SumOrder::kRankOrder),
        "reducing gradients");
  }
  std::span<const float> norm_of = det ? std::span<const float>(t.grads) : std::span<const float>(g);

  // Global gradient norm, in double over fixed chunks summed in order (thread-count free), then
  // over the ranks' blocks in rank order; the largest magnitude for fp16's overflow test (a NaN
  // gradient makes the sum NaN, which the test below catches).
  // (Staged host buffers: the gradient is the device's, norm_of only its window.)
  const bool staged_one = t.staged() && t.blocks == 1;  // (several: the norm of gblock, below)
  const int64_t nn = staged_one ? t.numel() : static_cast<int64_t>(norm_of.size());
  const int64_t chunks = NumGradNormChunks(nn);
  std::vector<double> own_partial;
  std::vector<float> own_maxabs;
  std::span<const double> partial;
  std::span<const float> maxabs;
  // One process with a device: the gradients on the device are the step's, and it sums them
  // where they are (grad_norm.h's arithmetic, the same bits), so the host reads them only for
  // Adam (staged: they cross once, not twice; overlapped: the host's cores stay on Adam).
  if (t.device != nullptr && t.world == 1 && !det && t.device->SumsGradNorm()) {
    own_partial.assign(static_cast<size_t>(chunks), 0.0);
    own_maxabs.assign(static_cast<size_t>(chunks), 0.0f);
    UCP_RETURN_IF_ERROR(t.device->GradNormChunks(own_partial, own_maxabs),
                        "step " + std::to_string(rec.step) + ": the gradient norm");
    partial = own_partial;
    maxabs = own_maxabs;
  } else if (staged_one) {
    UCP_RETURN_IF_ERROR(t.StagedNorm(own_partial, own_maxabs), "step " + std::to_string(rec.step));
    partial = own_partial;
    maxabs = own_maxabs;
  } else if (t.early_norm != nullptr && !det && norm_of.data() == t.grads.data()) {
    // Summed while the buckets crossed.
    UCP_RETURN_IF_ERROR(t.EarlyNormWait(chunks), "step " + std::to_string(rec.step));
    partial = t.early_norm->partial;
    maxabs = t.early_norm->maxabs;
  } else {
    own_partial.assign(static_cast<size_t>(chunks), 0.0);
    own_maxabs.assign(static_cast<size_t>(chunks), 0.0f);
    t.arena->execute([&] {
      tbb::parallel_for(int64_t{0}, chunks, [&](int64_t c) {
        SumChunk(norm_of, c, &own_partial[c], &own_maxabs[c]);
      });
    });
    partial = own_partial;
    maxabs = own_maxabs;
  }
  double ss = 0;
  float gmax = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    ss += partial[c];
    gmax = std::max(gmax, maxabs[c]);
  }
  if (t.blocks > 1 && !det) {
    UCP_ASSIGN_OR_RETURN(ss, t.SumOverRanks(ss));
    std::array<float, 1> m{gmax};
    UCP_RETURN_IF_ERROR(t.comm->AllReduce(std::span<float>(m), ReduceOp::kMax));
    gmax = m[0];
  }
  rec.grad_norm = std::sqrt(ss) / t.scaler.scale;
  phase_end(&rec.phases.reduce);
  const bool overflow = !std::isfinite(ss) || !std::isfinite(gmax) ||
                        (t.dtype == DType::kFp16 && gmax > kFp16Max);
  rec.loss_scale = t.scaler.scale;
  t.step += 1;
  t.consumed += G;
  rec.lr = t.sched.At(t.consumed);
  t.last_lr = rec.lr;
  if (!t.scaler.Update(overflow)) {
    rec.skipped = true;
    t.skipped_steps += 1;
    if (t.pipeline != nullptr) UCP_RETURN_IF_ERROR(t.pipeline->Finish({true, 1.0f}));
    t.last_clipped = false;  // an overflow says nothing of the next step's norm
  } else if (t.pipeline != nullptr) {
    // Validation of the overlapped step: commit, or correct every speculative bucket in one fused
    // pass with the multiplier the synchronous path applies below (bitwise its step).
    double coef = 1.0 / rec.loss_scale;
    t.last_clipped = t.cfg.clip_grad > 0 && rec.grad_norm > t.cfg.clip_grad;
    if (t.last_clipped) coef *= t.cfg.clip_grad / (rec.grad_norm + 1e-6);
    t.optimizer_steps += 1;
    if (t.finish_under_forward) {
      UCP_RETURN_IF_ERROR(t.pipeline->StartFinish({false, static_cast<float>(coef)}),
                          "optimizer step");
      t.finish_pending = true;
      if (t.device != nullptr) t.device->WeightsInFlight();
    } else {
      UCP_RETURN_IF_ERROR(t.pipeline->Finish({false, static_cast<float>(coef)}), "optimizer step");
    }
    if (t.device != nullptr && t.tail_buckets > 0) {
      // The tail buckets on the device Adam, with the sync path's multiplier (their gradients
      // crossed for the norm; their weights are written on the device and into the host's copy).
      UCP_RETURN_IF_ERROR(t.device->StepDevicePieces(t.optimizer_steps, static_cast<float>(rec.lr),
                                                     static_cast<float>(coef)),
                          "optimizer step (device)");
    }
    if (t.blocks > 1) {
      UCP_RETURN_IF_ERROR(t.RefreshWeights());  // every rank's updated fragments, as sync
    } else if (t.lowp()) {
      t.WidenWeights();
    } else {
      for (const Piece& pc : t.block_pieces[0]) {
        std::memcpy(t.w32.data() + pc.coff, t.master.data() + pc.foff,
                    static_cast<size_t>(pc.n) * 4);
      }
    }
  } else {
    double coef = 1.0 / rec.loss_scale;
    if (t.cfg.clip_grad > 0 && rec.grad_norm > t.cfg.clip_grad) {
      coef *= t.cfg.clip_grad / (rec.grad_norm + 1e-6);
    }
    // The unscale and clip are one fp32 multiplier, applied by Adam as it reads each gradient
    // (AdamStepFused: fl(g * c), the bits of multiplying g in place first, without that pass
    // over the gradient).
    const float cf = static_cast<float>(coef);
    UCP_RETURN_IF_ERROR(t.adam->set_lr(static_cast<float>(rec.lr)));
    t.optimizer_steps += 1;
    if (t.staged() && t.blocks == 1) {
      UCP_RETURN_IF_ERROR(t.StagedAdam(cf), "optimizer step");
    } else if (t.blocks == 1) {
      // One block (every rank holds the whole state): Adam's fused copy-out writes the
      // training-dtype weights piece by piece.
      std::vector<AdamSpans> bucket;
      bucket.reserve(t.block_pieces[0].size());
      for (size_t i = 0; i < t.block_pieces[0].size(); ++i) {
        const Piece& pc = t.block_pieces[0][i];
        if (!t.piece_on_device.empty() && t.piece_on_device[i]) continue;  // the device's Adam
        AdamSpans a;
        a.param = std::span(t.master).subspan(pc.foff, pc.n);
        a.grad = GradSpan::Fp32(std::span<const float>(t.grads).subspan(pc.coff, pc.n));
        a.exp_avg = std::span(t.exp_avg).subspan(pc.foff, pc.n);
        a.exp_avg_sq = std::span(t.exp_avg_sq).subspan(pc.foff, pc.n);
        if (t.lowp()) {
          auto out = std::span(t.w_lp).subspan(pc.coff, pc.n);
          a.out = t.dtype == DType::kBf16 ? LowpOutSpan::Bf16(out) : LowpOutSpan::Fp16(out);
        }
        bucket.push_back(a);
      }
      UCP_RETURN_IF_ERROR(t.adam->StepBucketFused(t.optimizer_steps, bucket, {},
                                                  CpuAdam::SnapshotUse::kNone, cf),
                          "optimizer step");
      if (t.device != nullptr) {
        // The device pieces from the device's unscaled gradients times the same fp32
        // multiplier: the same bits as the host's step of them.
        UCP_RETURN_IF_ERROR(t.device->StepDevicePieces(t.optimizer_steps,
                                                       static_cast<float>(rec.lr),
                                                       static_cast<float>(coef)),
                            "optimizer step (device)");
      }
      if (t.lowp()) {
        t.WidenWeights();
      } else {
        for (const Piece& pc : t.block_pieces[0]) {
          std::memcpy(t.w32.data() + pc.coff, t.master.data() + pc.foff,
                      static_cast<size_t>(pc.n) * 4);
        }
      }
    } else {
      // This rank's block, then every block's masters gathered into the model's weights.
      AdamSpans a;
      a.param = t.master;
      a.grad = GradSpan::Fp32(t.gblock);
      a.exp_avg = t.exp_avg;
      a.exp_avg_sq = t.exp_avg_sq;
      const AdamSpans one[] = {a};
      UCP_RETURN_IF_ERROR(t.adam->StepBucketFused(t.optimizer_steps, one, {},
                                                  CpuAdam::SnapshotUse::kNone, cf),
                          "optimizer step");
      UCP_RETURN_IF_ERROR(t.RefreshWeights());
    }
  }
  phase_end(&rec.phases.optimizer);
  if (t.pipeline != nullptr) rec.overlap = t.pipeline->last_stats();
  if (t.device != nullptr && !rec.skipped) {
    // The overlapped pipeline of one process already moved the weights bucket by bucket (or
    // moves them under the next forward, which widens each group as it reaches it).
    if (!t.finish_pending && !t.staged()) {  // (staged: they crossed with Adam's windows)
      UCP_RETURN_IF_ERROR(t.pipeline != nullptr && t.world == 1 ? t.device->WeightsWritten()
                                                                : t.device->UploadWeights(),
                          "step " + std::to_string(rec.step));
    }
  }
  phase_end(&rec.phases.weights);
  rec.seconds = Seconds(t0, Clock::now());
  // One trace file: the root's (every rank's timeline has the same shape).
  if (t.trace != nullptr && rec.step == kTraceSteps && t.root()) {
    UCP_RETURN_IF_ERROR(t.trace->Write(t.opts.trace), "--trace");
  }
  return rec;
}

bool Trainer::can_validate() const {
  return impl_->cfg.val_samples > 0 &&
         static_cast<int64_t>(impl_->val_tokens.size()) > impl_->seq_len;
}

Result<double> Trainer::Validate() {
  Impl& t = *impl_;
  UCP_RETURN_IF_ERROR(t.CompleteFinish(), "validation");
  const int64_t avail = (static_cast<int64_t>(t.val_tokens.size()) - 1) / t.seq_len;
  const int64_t total = std::min(t.cfg.val_samples, avail);
  if (total < 1) return FailedPreconditionError("the held-out set holds no sample");
  // Data-parallel ranks share the held-out samples; with --deterministic every rank evaluates
  // all of them alone, one at a time, so the value does not depend on dp.
  const bool det = t.cfg.deterministic;
  const int64_t dp = det ? 1 : t.layout.dp;
  const int64_t lo = det ? 0 : total * t.dp_rank / dp;
  const int64_t hi = det ? total : total * (t.dp_rank + 1) / dp;
  const int64_t mb = det ? 1 : t.micro_batch;
  double sum = 0;
  for (int64_t first = lo; first < hi; first += mb) {
    const int64_t nb = std::min(mb, hi - first);
    // Held-out samples in order, unshuffled; with sp > 1 this rank's shard of positions.
    const int64_t ts = t.seq_len / t.sp, off = t.sp_rank * ts;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t i = 0; i < ts; ++i) {
        const size_t at = static_cast<size_t>((first + b) * t.seq_len + off + i);
        t.inputs[b * ts + i] = t.val_tokens[at];
        t.targets[b * ts + i] = t.val_tokens[at + 1];
      }
    }
    const size_t len = static_cast<size_t>(nb * ts);
    Batch batch{std::span<const int32_t>(t.inputs).first(len),
                std::span<const int32_t>(t.targets).first(len), nb, ts};
    batch.position_offset = off;
    UCP_ASSIGN_OR_RETURN(double l,
                         t.device != nullptr ? t.device->Forward(batch)
                                             : t.net->Forward(t.w32, batch),
                         "validation");
    sum += l;
  }
  double all = sum;
  if (!det) {
    UCP_ASSIGN_OR_RETURN(all, t.SumOverRanks(sum));
  }
  return all / static_cast<double>(total * t.seq_len);
}

Status Trainer::Save() {
  Impl& t = *impl_;
  UCP_RETURN_IF_ERROR(Wait());
  UCP_RETURN_IF_ERROR(t.CompleteFinish(), "saving step " + std::to_string(t.step));
  if (t.device != nullptr) {
    // The device pieces' masters and Adam states into the host state the checkpoint holds.
    UCP_RETURN_IF_ERROR(t.device->PullState(t.master, t.exp_avg, t.exp_avg_sq),
                        "saving step " + std::to_string(t.step));
  }
  if (t.opts.async_save) {
    // Stage: one copy of what the checkpoint holds, so training goes on while it is written.
    if (t.staged()) {
      // The weights are the device's: copied out through the window.
      t.staging.weights.resize(static_cast<size_t>(t.numel()) * 2);
      UCP_RETURN_IF_ERROR(t.PullWeights(reinterpret_cast<uint16_t*>(t.staging.weights.data()), 0,
                                        t.numel()),
                          "saving step " + std::to_string(t.step));
    } else {
      const size_t wbytes = t.lowp() ? t.w_lp.size() * 2 : t.w32.size() * 4;
      t.staging.weights.resize(wbytes);
      std::memcpy(t.staging.weights.data(),
                  t.lowp() ? static_cast<const void*>(t.w_lp.data()) : t.w32.data(), wbytes);
    }
    t.staging.master = t.master;
    t.staging.exp_avg = t.exp_avg;
    t.staging.exp_avg_sq = t.exp_avg_sq;
  }
  UCP_RETURN_IF_ERROR(t.StartSave(), "saving step " + std::to_string(t.step));
  if (!t.opts.async_save) return Wait();
  return Status::Ok();
}

Status Trainer::Log(const StepRecord& r) {
  json line{{"step", r.step},           {"loss", r.loss},
            {"lr", r.lr},               {"grad_norm", r.grad_norm},
            {"loss_scale", r.loss_scale}, {"skipped", r.skipped},
            {"tokens", r.tokens},       {"seconds", r.seconds},
            {"save_block_seconds", r.save_block_seconds}};
  if (r.val_loss >= 0) line["val_loss"] = r.val_loss;
  if (impl_->root()) impl_->AppendLog(line);
  return Status::Ok();
}

Result<TrainConfig> Trainer::RecordedConfig(const fs::path& ckpt, const fs::path& data_dir) {
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<api::CheckpointSource> src,
                       api::CheckpointSource::Open(ckpt, data_dir.empty() ? api::UcpDataDir()
                                                                          : data_dir));
  const std::string& text = src->meta().client_state_json;
  const std::string where = ckpt.string();
  Result<json> j = text.empty() ? Result<json>(json())
                                : ucp::json::ParseStrict(text, where + ": client state",
                                                         StatusCode::kDataLoss);
  UCP_RETURN_IF_ERROR(j.status());
  if (!j->is_object() || !j->contains("ucp_train") || !(*j)["ucp_train"].is_object() ||
      !(*j)["ucp_train"].contains("config")) {
    return FailedPreconditionError(where + ": no ucp_train client state (not a ucp-train "
                                           "checkpoint; use --init to start from its weights)");
  }
  return ConfigFromJson((*j)["ucp_train"]["config"], where);
}

Status Trainer::Wait() { return impl_->FinishSave(); }

std::vector<std::pair<std::string, std::vector<std::byte>>> Trainer::StateForTest() const {
  Impl& t = *impl_;
  UCP_CHECK(t.CompleteFinish().ok());
  if (t.device != nullptr) {
    UCP_CHECK(t.device->PullState(t.master, t.exp_avg, t.exp_avg_sq).ok());
  }
  std::vector<std::pair<std::string, std::vector<std::byte>>> out;
  for (auto& [name, v] : t.Views(true, false, nullptr)) {
    if (v.bytes.empty()) continue;
    out.emplace_back(name, std::vector<std::byte>(v.bytes.begin(), v.bytes.end()));
  }
  if (t.staged()) {
    for (const Impl::SliceInfo& sl : t.ModelSlices()) {
      std::vector<std::byte> bytes(static_cast<size_t>(sl.n) * 2);
      UCP_CHECK(t.PullWeights(reinterpret_cast<uint16_t*>(bytes.data()), sl.offset, sl.n).ok());
      out.emplace_back(sl.name, std::move(bytes));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

Result<int> ParseGpuTailBuckets(const std::string& text) {
  if (text == "auto") return kGpuTailAuto;
  int n = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n < 0) {
    return InvalidArgumentError("--gpu-tail-buckets " + text +
                                ": must be auto or a count of grad groups >= 0");
  }
  return n;
}

int DefaultAdamThreads(int threads, bool model_on_host, int processes) {
  if (model_on_host) return std::max(1, threads / 2);
  return std::max(1, threads - (processes > 1 ? 3 : 2));
}

}  // namespace ucp::offload
