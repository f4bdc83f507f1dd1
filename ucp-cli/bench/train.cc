// `ucp-bench train`: tokens/s of one training step of the offload engine (forward, backward,
// clipping, CPU AdamW, copy-out) against, in the same run, (a) PyTorch 1.13 training the same
// model on the same threads (tools/bench_torch_train.py) and (b) the rate cblas_sgemm reaches on
// the model's largest GEMM shape; with peak memory explained per parameter. Figures go to
// docs/PERFORMANCE.md ("Training step").
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/data/token_file.h"
#include "offload/model/model.h"
#include "offload/model/ops.h"
#include "offload/train/trainer.h"
#ifdef UCP_BENCH_HAVE_CUDA_TRAIN
#include "offload/cuda/cuda_train_device.h"
#endif
#include "ucp-cli/bench/cpu_info.h"
#include "ucp-cli/command.h"
#include "ucp/api/checkpoint.h"
#include "ucp/exec/executor.h"
#include "ucp/io/atomic_file.h"
#include "ucp/json/strict_json.h"
#include "ucp/tensor/dtype.h"
#include "ucp/layout/layout.h"
#include "ucp/base/status_macros.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

// Where a step's time went (StepRecord::Phases), in ms.
std::string PhaseLine(const offload::StepRecord& r, bool on_device) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  const auto& p = r.phases;
  os << "  phases of the best step (ms): forward+backward" << (on_device ? "+gradients to the host" : "")
     << " " << p.backward * 1e3;
  if (p.finish_wait > 0) os << " (" << p.finish_wait * 1e3 << " waiting for the last step's finish)";
  os << " | reduce+norm " << p.reduce * 1e3 << " | clip+AdamW+widen " << p.optimizer * 1e3;
  if (on_device) os << " | weights to the device " << p.weights * 1e3;
  os << "\n";
  return os.str();
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double PeakRssMib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

std::string RunTorch(const std::string& preset, int64_t batch, int64_t seq, int threads,
                     int steps) {
  const fs::path script = fs::path(UCP_DATA_DIR) / "tools" / "bench_torch_train.py";
  const std::string python =
      fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const std::string cmd = python + " " + script.string() + " --preset " + preset + " --batch " +
                          std::to_string(batch) + " --seq " + std::to_string(seq) +
                          " --threads " + std::to_string(threads) + " --steps " +
                          std::to_string(steps) + " 2>/dev/null";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) out += buf;
  return ::pclose(pipe) == 0 ? out : "";
}

double Field(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + " ");
  return at == std::string::npos ? -1.0 : std::stod(text.substr(at + key.size() + 1));
}

// --largest: `base` with `layers` layers, as a model file in `dir` (the trainer takes a model by
// preset name or path); returns its path.
Result<std::string> WriteWithLayers(const patterns::ModelSpec& base, int64_t layers,
                                    const fs::path& dir) {
  json::Json hyper = json::Json::object();
  for (const auto& [k, v] : base.hyper) hyper[k] = v;
  hyper["layers"] = layers;
  const std::string name = base.name + "-" + std::to_string(layers) + "l";
  const json::Json j = {{"name", name},
                        {"family", base.family},
                        {"dtype", std::string(DTypeName(base.dtype))},
                        {"source", "ucp-bench train --largest: " + base.name + "'s layer, " +
                                       std::to_string(layers) + " layers"},
                        {"hyper", hyper}};
  const fs::path path = dir / (name + ".json");
  UCP_RETURN_IF_ERROR(io::WriteFileAtomic(path, j.dump()));
  return path.string();
}

// The most layers of `base`'s layer (its embeddings and head unchanged) whose plan fits the
// machine's device and host (doubling, then bisecting: the plan grows with the layers); the
// plans of that model and of one layer more.
struct Largest {
  int64_t layers = 0;
  std::string model;  // its file
  offload::MemoryPlan plan, next;
};
Result<Largest> FindLargest(const patterns::ModelSpec& base, offload::TrainConfig c,
                            const offload::RunOptions& r, const offload::PlanMachine& m,
                            const fs::path& dir) {
  auto plan = [&](int64_t layers) -> Result<std::pair<std::string, offload::MemoryPlan>> {
    UCP_ASSIGN_OR_RETURN(c.model, WriteWithLayers(base, layers, dir));
    UCP_ASSIGN_OR_RETURN(offload::MemoryPlan p, offload::Trainer::Plan(c, r, m),
                         "--largest at " + std::to_string(layers) + " layers");
    return std::make_pair(c.model, std::move(p));
  };
  auto fits = [](const offload::MemoryPlan& p) { return p.device_fits && p.host_fits; };
  UCP_ASSIGN_OR_RETURN(auto one, plan(1));
  if (!fits(one.second)) {
    return FailedPreconditionError("--largest: not even one layer of " + base.name +
                                   " fits: " + one.second.verdict);
  }
  constexpr int64_t kMaxLayers = int64_t{1} << 16;
  int64_t lo = 1, hi = 2;  // lo fits; hi is the next to try, then the first that does not fit
  Largest best{1, one.first, one.second, {}};
  for (;;) {
    UCP_ASSIGN_OR_RETURN(auto p, plan(hi));
    if (!fits(p.second)) break;
    lo = hi;
    best = {hi, p.first, p.second, {}};
    if (hi >= kMaxLayers) {
      return FailedPreconditionError("--largest: " + std::to_string(hi) + " layers of " +
                                     base.name + " still fit; give a smaller --device-memory or "
                                     "--host-memory");
    }
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    UCP_ASSIGN_OR_RETURN(auto p, plan(mid));
    if (fits(p.second)) {
      lo = mid;
      best = {mid, p.first, p.second, {}};
    } else {
      hi = mid;
    }
  }
  UCP_ASSIGN_OR_RETURN(auto next, plan(best.layers + 1));
  best.next = std::move(next.second);
  return best;
}

Status Run(const po::variables_map& vm, CommandIo& io) {
  const std::string model = vm["model"].as<std::string>();
  const int64_t seq = vm["seq-len"].as<int64_t>();
  const int64_t batch = vm["batch"].as<int64_t>();
  const int64_t micro_batch = vm["micro-batch"].as<int64_t>();
  const int threads = vm["threads"].as<int>();
  const int steps = vm["steps"].as<int>();
  const std::string dtype = vm["dtype"].as<std::string>();
  const std::string layout = vm["layout"].as<std::string>();
  const std::string resume_layout = vm["resume-layout"].as<std::string>();
  const bool checkpoint = vm["checkpoint"].as<bool>();
  const std::string device = vm["device"].as<std::string>();
  const double peak = vm["peak-tflops"].as<double>();
  const bool gpu_optimizer = vm["gpu-optimizer"].as<bool>();
  const std::string pipeline = vm["pipeline"].as<std::string>();
  const bool largest = vm["largest"].as<bool>();
  int64_t device_memory = 0, host_memory = 0;
  for (const auto& [name, field] : {std::pair{"device-memory", &device_memory},
                                    std::pair{"host-memory", &host_memory}}) {
    const std::string text = vm[name].as<std::string>();
    if (text.empty()) continue;
    UCP_ASSIGN_OR_RETURN(*field, exec::ParseByteSize(text), std::string("--") + name);
  }
  if (seq < 1 || batch < 1 || threads < 1 || steps < 1 || !(peak > 0) || micro_batch < 0) {
    return InvalidArgumentError("--seq-len, --batch, --threads and --steps must be >= 1, "
                                "--micro-batch >= 0, --peak-tflops > 0");
  }
  if (device != "cpu" && device != "cuda" && device != "twin") {
    return InvalidArgumentError("--device " + device + ": must be cpu, cuda or twin");
  }
  const bool cuda = device == "cuda";
  // twin: the device path on the CPU (the trainer's CPU twin device), so this benchmark's device
  // flow (--pipeline overlap, --gpu-optimizer) runs, and is tested, where no GPU is.
  const bool on_device = device != "cpu";
#ifndef UCP_BENCH_HAVE_CUDA_TRAIN
  if (cuda) {
    return FailedPreconditionError("--device cuda: this ucp-bench was built without the CUDA "
                                   "engine (no nvcc)");
  }
#else
  // Before the trainer builds its host state (22 B a parameter), which it does before the device.
  if (cuda) UCP_RETURN_IF_ERROR(offload::cuda::CheckCudaDevice());
#endif
  if (gpu_optimizer && !on_device) {
    return InvalidArgumentError("--gpu-optimizer needs --device cuda (or twin)");
  }
  if (largest && (!on_device || checkpoint || gpu_optimizer || vm["torch"].as<bool>())) {
    return InvalidArgumentError("--largest needs --device cuda (or twin), and times the training "
                                "step alone (no --checkpoint, --gpu-optimizer or --torch)");
  }
  if (largest && !cuda && device_memory == 0) {
    return InvalidArgumentError("--largest --device twin needs --device-memory (the twin has no "
                                "memory of its own to fill)");
  }
  // Under mpirun the processes train together (dp x sp = their count); alone otherwise.
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<offload::Communicator> comm,
                       offload::WorldCommunicator());
  const bool root = comm->rank() == 0;
  std::ostream quiet(nullptr);
  std::ostream& out = root ? io.out : quiet;
  out << "cpu: " << CpuDescription() << ", " << threads << " threads x " << comm->size()
      << " process(es)\n";

  // Random tokens in a scratch run folder shared by the processes (the root's pid names it).
  std::array<std::byte, 8> id{};
  const int64_t pid = getpid();
  std::memcpy(id.data(), &pid, 8);
  UCP_RETURN_IF_ERROR(comm->Broadcast(id, 0));
  int64_t root_pid = 0;
  std::memcpy(&root_pid, id.data(), 8);
  const fs::path work = fs::temp_directory_path() / ("ucp_bench_train_" + std::to_string(root_pid));
  if (root) {
    fs::remove_all(work);
    fs::create_directories(work);
  }
  std::string model_file = model;  // what the trainer builds (--largest: a file of more layers)
  UCP_ASSIGN_OR_RETURN(auto resolved, api::LoadResolvedModel(api::UcpDataDir(), model, dtype));
  const int64_t vocab = resolved.first.hyper.at("vocab");
  std::mt19937 rng(1);
  std::vector<uint16_t> tokens(static_cast<size_t>((steps + 3) * batch * seq * 12 / 10 + 1));
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % static_cast<uint32_t>(vocab));
  if (root) UCP_RETURN_IF_ERROR(offload::WriteTokenFile(work / "tokens.bin", tokens));
  UCP_RETURN_IF_ERROR(comm->Barrier());

  offload::TrainConfig c;
  c.model = model;
  c.dtype = dtype;
  c.data = (work / "tokens.bin").string();
  c.seq_len = seq;
  c.global_batch = batch;
  c.micro_batch = micro_batch;  // 0: the whole batch (per process) at once
  c.steps = steps + 1;
  c.val_every = 0;
  c.layout = layout;
  c.clip_grad = vm["clip"].as<double>();
  offload::RunOptions r;
  r.out = work / "run";
  r.threads = threads;
  r.comm = comm.get();
  r.pipeline = pipeline;
  r.gpu_gemm = vm["gpu-gemm"].as<std::string>();
  r.gpu_attention = vm["gpu-attention"].as<std::string>();
  r.recompute = vm["recompute"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(r.gpu_tail_buckets,
                       offload::ParseGpuTailBuckets(vm["gpu-tail-buckets"].as<std::string>()));
  r.adam_threads = vm["adam-threads"].as<int>();
  r.pin_threads = vm["pin-threads"].as<bool>();
  r.finish_under_forward = !vm["sync-finish"].as<bool>();
  r.speculation = vm["speculation"].as<std::string>();
  r.weights = vm["weights"].as<std::string>();
  r.host_buffers = vm["host-buffers"].as<std::string>();
  r.device_memory = device_memory;
  r.host_memory = host_memory;
  // The saves are timed only with --checkpoint; otherwise nothing is staged (nor planned).
  r.async_save = checkpoint;
#ifdef UCP_BENCH_HAVE_CUDA_TRAIN
  if (cuda) {
    r.device_factory = offload::cuda::MakeCudaTrainDevice;
    // --weights auto plans for this GPU's memory.
    if (r.device_memory == 0) {
      UCP_ASSIGN_OR_RETURN(r.device_memory, offload::cuda::CudaDeviceMemory(comm->rank()));
    }
  }
#endif
  r.device = device;
  if (largest) {
    // The plan's machine, which the run's automatic choices (--weights, --host-buffers) then
    // see too. Of the host's available memory 5% (at least 2 GiB) stays free for what the plan
    // does not count: code, the token data, the CUDA context's pinned staging.
    offload::PlanMachine m;
    m.device_bytes = r.device_memory;
    if (r.host_memory == 0) {
      const int64_t available = offload::MeasureHostMemory();
      r.host_memory = available - std::max<int64_t>(int64_t{2} << 30, available / 20);
      if (r.host_memory <= 0) {
        return FailedPreconditionError("--largest: this host has " +
                                       offload::FormatBytes(available) + " available");
      }
    }
    m.host_bytes = r.host_memory;
    UCP_ASSIGN_OR_RETURN(Largest big, FindLargest(resolved.first, c, r, m, work));
    using offload::FormatBytes;
    std::ostringstream ls;
    ls << "largest model for " << FormatBytes(m.device_bytes) << " of device memory ("
       << FormatBytes(m.device_bytes - m.device_reserve_bytes) << " usable) and "
       << FormatBytes(m.host_bytes) << " of host memory at "
       << (micro_batch > 0 ? micro_batch : batch) << " x " << seq << " tokens per micro-batch: " << big.layers << " layers of " << model
       << "'s layer (" << resolved.first.hyper.at("layers") << " in " << model << "), "
       << big.plan.params << " parameters; planned device " << FormatBytes(big.plan.device_total)
       << " ("
       << (big.plan.placement == offload::WeightPlacement::kResident ? "weights resident"
                                                                     : "weights streamed")
       << "), host " << FormatBytes(big.plan.host_total) << " ("
       << (big.plan.host_window > 0 ? "buffers staged" : "buffers whole")
       << ")\n  one layer more: " << big.next.verdict << "\n";
    out << ls.str();
    model_file = big.model;
    c.model = model_file;
    UCP_ASSIGN_OR_RETURN(resolved, api::LoadResolvedModel(api::UcpDataDir(), model_file, dtype));
  }
  UCP_ASSIGN_OR_RETURN(offload::Trainer t, offload::Trainer::Create(c, r));
  const int64_t n = t.num_params();
  if (on_device) out << t.Describe() << "\n";
  std::vector<double> times;
  offload::StepRecord best_rec;
  int clipped = 0;
  int64_t staged_before = 0;  // the staged windows' bytes before the timed steps
  for (int i = 0; i < steps + 1; ++i) {
    UCP_ASSIGN_OR_RETURN(offload::StepRecord rec, t.Step());
    if (i == 0) {  // the first step warms caches and page tables
      staged_before = t.DeviceBytesStaged();
      continue;
    }
    if (times.empty() || rec.seconds < best_rec.seconds) best_rec = rec;
    times.push_back(rec.seconds);
    if (c.clip_grad > 0 && rec.grad_norm > c.clip_grad) ++clipped;
  }
  const double rss = PeakRssMib();
  std::sort(times.begin(), times.end());
  const double best = times.front(), median = times[times.size() / 2];
  const double tok = static_cast<double>(batch * seq);

  // Model FLOPs per token: 6 per weight of every matrix product (forward 2, backward 4; the
  // classifier counted over the real vocabulary, position embeddings excluded), plus attention's
  // two causal T x T products, 6 * L * T * (heads * head_dim) (12 L T d halved by causality).
  UCP_ASSIGN_OR_RETURN(offload::ModelConfig mc, offload::ModelConfig::FromSpec(resolved.first));
  // An untied model's word embedding is a lookup, not a product (its output_layer is).
  double matmul_params = 0;
  for (const auto& p : resolved.second.params) {
    const bool lookup = p.name.find("position_embeddings") != std::string::npos ||
                        (!mc.tied_embeddings && p.name == "embedding.word_embeddings.weight");
    if (p.shape.size() == 2 && !lookup) {
      matmul_params += static_cast<double>(p.shape[0] * p.shape[1]);
    }
  }
  const double flops_token =
      6.0 * matmul_params +
      6.0 * static_cast<double>(mc.layers * seq * mc.heads * mc.head_dim);
  const double step_flops = flops_token * tok;

  // The largest GEMM of the step: the classifier, [B*T, hidden] x [hidden, vocab].
  // Every process measures at once, so the rate is what the whole job's cores reach together.
  UCP_RETURN_IF_ERROR(comm->Barrier());
  // (Not with --device cuda: the CPU's BLAS rate says nothing about the GPU's step.)
  const double sgemm_gflops =
      cuda ? 0.0
           : offload::MeasureSgemmGflops(batch * seq, mc.vocab, mc.hidden, threads, 3) *
                 comm->size();

  // Checkpoints: how long Save() holds the step up (the staging copy; the disk work runs in the
  // background), the step run while the save is written, and the time to restore the state at
  // the same layout and at another one (a resume at a new layout against one at the same).
  std::ostringstream ck;
  ck.setf(std::ios::fixed);
  ck.precision(2);
  if (checkpoint) {
    const auto s0 = std::chrono::steady_clock::now();
    UCP_RETURN_IF_ERROR(t.Save());
    const double block = Seconds(s0);
    UCP_ASSIGN_OR_RETURN(offload::StepRecord during, t.Step());
    const auto w0 = std::chrono::steady_clock::now();
    UCP_RETURN_IF_ERROR(t.Wait());
    const double rest = Seconds(w0);
    ck << "save: blocks the step for " << block * 1e3 << " ms (" << 100.0 * block / median
       << "% of a step; aim <= 100%), the step during the save took " << during.seconds * 1e3
       << " ms, then " << rest * 1e3 << " ms more until committed\n";
    auto restore = [&](const std::string& l) -> Result<double> {
      offload::TrainConfig rc = c;
      rc.layout = l;
      offload::RunOptions rr = r;
      rr.resume = r.out;
      UCP_RETURN_IF_ERROR(comm->Barrier());
      const auto r0 = std::chrono::steady_clock::now();
      UCP_ASSIGN_OR_RETURN(offload::Trainer x, offload::Trainer::Create(rc, rr));
      UCP_RETURN_IF_ERROR(comm->Barrier());
      return Seconds(r0);
    };
    // Alternated, the best of two each: the first read of the files pays for the page cache.
    double same = 1e30, other = 1e30;
    for (int i = 0; i < 2; ++i) {
      UCP_ASSIGN_OR_RETURN(double a, restore(layout));
      UCP_ASSIGN_OR_RETURN(double b, restore(resume_layout));
      same = std::min(same, a);
      other = std::min(other, b);
    }
    ck << "resume at " << layout << ": " << same * 1e3 << " ms; at " << resume_layout << ": "
       << other * 1e3 << " ms = " << other / same << "x (aim <= 1.2x)\n";
  }

  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << "model " << (largest ? fs::path(model_file).stem().string() : model) << ": " << n
     << " parameters (tp=1, vocabulary padded), " << batch
     << " x " << seq << " = " << static_cast<int64_t>(tok) << " tokens per step, training dtype "
     << dtype
     << (t.recompute().Of(mc.layers) > 0 ? "; " + offload::RecomputeNote(t.recompute(), mc.layers)
                                         : std::string())
     << "\n";
  os << "ucp step (forward+backward+clip+AdamW+copy-out): best " << best * 1e3 << " ms, median "
     << median * 1e3 << " ms over " << steps << " steps = " << tok / best << " tokens/s\n";
  os << PhaseLine(best_rec, on_device);
  std::ostringstream clip;  // as given (1, 0.5), not in the fixed format of the figures
  clip << c.clip_grad;
  os << "  clipped in " << clipped << " of " << steps << " timed steps (--clip " << clip.str()
     << (pipeline == "overlap" && r.speculation != "off"
             ? "; a clipped step corrects every speculative bucket" +
                   std::string(r.speculation == "auto"
                                   ? ", and the step after it holds its buckets for validation"
                                   : "") +
                   ")\n"
             : ")\n");
  if (pipeline == "overlap") {
    const auto& o = best_rec.overlap;
    os << "  overlap of the best step: " << o.speculated << " buckets stepped during backward, "
       << o.committed << " committed, " << o.corrected << " corrected, " << o.rolled_back
       << " undone, " << o.held << " held for validation (not speculated); "
       // The trainer decides where the finish runs; a step that waited for the last one's
       // finish shows it ran under forward.
       << (best_rec.phases.finish_wait > 0
               ? "validation's work and the weights' return run under the next step's forward "
                 "(each step's time holds the previous step's)\n"
               : "finished before the next step\n");
  }
  os.precision(2);
  os << "model FLOPs/token " << flops_token / 1e6 << " M -> " << step_flops / best / 1e9
     << " GFLOP/s\n";
  if (cuda) {
    os << "device cuda: " << step_flops / best / 1e12 << " TFLOP/s, MFU "
       << 100.0 * step_flops / best / 1e12 / peak << "% of " << peak
       << " TFLOPS (bf16 dense peak; the step includes gradients to the host, the CPU AdamW on "
          "fp32 masters and the weights back"
       << (pipeline == "overlap" ? ", overlapped with backward bucket by bucket" : ", after backward")
       << (r.recompute != "none" ? "; the recomputed layers' rerun forward is not counted" : "")
       << ")\n";
  } else {
    os << "cblas_sgemm " << batch * seq << "x" << mc.vocab << "x" << mc.hidden << " (the largest "
       << "GEMM" << (comm->size() > 1 ? ", on every process at once, summed" : "")
       << "): " << sgemm_gflops << " GFLOP/s -> the step reaches "
       << 100.0 * (step_flops / best / 1e9) / sgemm_gflops << "% of it (aim >= 60%)\n";
  }
  // Memory: the state this process's trainer holds (Trainer::MemoryInUse, its buffers' bytes:
  // the optimizer's ZeRO share, no host compute copy for bf16 on a device) per parameter; what
  // is left of the peak is activations, scratch, data and code.
  const std::vector<int64_t> in_use = t.MemoryInUse();
  auto per = [&](offload::MemClass cls) {
    return static_cast<double>(in_use[static_cast<size_t>(cls)]) / static_cast<double>(n);
  };
  const double per_param = per(offload::MemClass::kWeights) +
                           per(offload::MemClass::kComputeCopy) +
                           per(offload::MemClass::kGradients) + per(offload::MemClass::kOptimizer);
  const double state_mib = per_param * static_cast<double>(n) / 1048576.0;
  os.precision(1);
  os << "peak RSS (process 0) " << rss << " MiB = " << per_param << " B/parameter of state ("
     << "training-dtype weights " << per(offload::MemClass::kWeights) << " + fp32 compute copy "
     << per(offload::MemClass::kComputeCopy) << " + fp32 grads "
     << per(offload::MemClass::kGradients) << " + master, exp_avg, exp_avg_sq "
     << per(offload::MemClass::kOptimizer) << ") = " << state_mib
     << " MiB, plus " << rss - state_mib << " MiB of activations, scratch, data and code\n";
  if (vm["torch"].as<bool>() && root) {
    const fs::path preset = api::UcpDataDir() / "models" / (model + ".json");
    const std::string torch_out = RunTorch(preset.string(), batch, seq, threads, steps);
    const double torch_tps = Field(torch_out, "tokens_per_s");
    if (torch_tps <= 0) {
      os << "torch: not run (python3-torch missing or the script failed)\n";
    } else {
      os << "torch 1.13 (tools/bench_torch_train.py, fp32, same threads): " << torch_tps
         << " tokens/s, peak RSS " << Field(torch_out, "peak_rss_mib") << " MiB -> ucp is "
         << (tok / best) / torch_tps << "x torch (aim >= 1.5x)\n";
    }
  }
  if (const int64_t streamed = t.DeviceBytesStreamed(); streamed > 0) {
    // Every step's crossings (the warm-up's too): weights in, in forward and again in backward,
    // the gradients out (and back in between micro-batches).
    const double per_step = static_cast<double>(streamed) / static_cast<double>(steps + 1);
    os << "weights streamed: " << static_cast<double>(t.DeviceBytesInUse()) / 1048576.0
       << " MiB on the device, " << per_step / 1048576.0 << " MiB crossing per step ("
       << per_step / static_cast<double>(n) << " B/parameter)\n";
  }
  if (const int64_t staged = t.DeviceBytesStaged() - staged_before; staged > 0) {
    // The timed steps' crossings: the gradients host-ward (once where the device sums the
    // norm) and the updated weights device-ward.
    const double per_step = static_cast<double>(staged) / static_cast<double>(steps);
    os << "host buffers staged: " << per_step / 1048576.0 << " MiB through the windows per step ("
       << per_step / static_cast<double>(n) << " B/parameter)\n";
  }
  os << ck.str();
  out << os.str();
  if (gpu_optimizer) {
    // The same step with every bucket's optimizer on the GPU (the device Adam on device-resident
    // masters, --gpu-tail-buckets = all grad groups): the offload's cost is the ratio. The first
    // trainer goes first (its device memory), so the two never hold the GPU together.
    { offload::Trainer gone = std::move(t); }
    UCP_ASSIGN_OR_RETURN(offload::ParamTable table, offload::ModelParamTable(mc));
    offload::RunOptions rg = r;
    rg.out = work / "run_gpu_optimizer";
    rg.gpu_tail_buckets = static_cast<int>(table.groups.size());
    rg.pipeline = "sync";  // the device Adam runs after backward (tail buckets are sync-only)
    UCP_ASSIGN_OR_RETURN(offload::Trainer g, offload::Trainer::Create(c, rg));
    std::vector<double> gt;
    offload::StepRecord gbest;
    for (int i = 0; i < steps + 1; ++i) {
      UCP_ASSIGN_OR_RETURN(offload::StepRecord rec, g.Step());
      if (i == 0) continue;
      if (gt.empty() || rec.seconds < gbest.seconds) gbest = rec;
      gt.push_back(rec.seconds);
    }
    std::sort(gt.begin(), gt.end());
    std::ostringstream gs;
    gs.setf(std::ios::fixed);
    gs.precision(1);
    gs << "optimizer on the " << (cuda ? "GPU" : "twin device") << " (device Adam for all "
       << table.groups.size()
       << " grad groups; the gradients still go to the host for the norm): best "
       << gt.front() * 1e3 << " ms = " << tok / gt.front() << " tokens/s, MFU "
       << 100.0 * step_flops / gt.front() / 1e12 / peak << "%; offloaded step / GPU step = ";
    gs.precision(3);
    gs << best / gt.front() << "x (aim <= 1.15x)\n";
    gs << PhaseLine(gbest, on_device);
    out << gs.str();
  }
  UCP_RETURN_IF_ERROR(comm->Barrier());
  if (root) fs::remove_all(work);
  return Status::Ok();
}

Command MakeTrainBench() {
  return {
      .name = "train",
      .summary = "training-step tokens/s against PyTorch and the BLAS rate, same run",
      .usage = "[--model gpt2-small] [--seq-len 256] [--batch 4] [--threads T] [--steps 3] "
               "[--micro-batch 0] [--dtype bf16] [--torch] [--layout L] [--checkpoint [--resume-layout L2]] "
               "[--pipeline sync|overlap] [--device cpu|cuda|twin [--gpu-optimizer] "
               "[--gpu-gemm auto|fp32] [--gpu-attention gemm|flash] [--gpu-tail-buckets N|auto] [--peak-tflops 989] [--largest] [--device-memory SIZE] "
               "[--host-memory SIZE]] [--recompute none|all|auto|N] "
               "[--speculation auto|always|off] [--adam-threads N] [--pin-threads] [--clip 1]",
      .add_options =
          [](po::options_description& o, po::positional_options_description&) {
            o.add_options()("model", po::value<std::string>()->default_value("gpt2-small"),
                            "model preset")(
                "seq-len", po::value<int64_t>()->default_value(256), "tokens per sample")(
                "batch", po::value<int64_t>()->default_value(4), "samples per step")(
                "micro-batch", po::value<int64_t>()->default_value(0),
                "samples per forward/backward (gradients accumulate over the step's "
                "micro-batches: more tokens per step at the same activation memory); 0: all")(
                "threads", po::value<int>()->default_value(2), "threads")(
                "steps", po::value<int>()->default_value(3), "timed steps (after one warm-up)")(
                "dtype", po::value<std::string>()->default_value("bf16"),
                "training dtype: bf16, fp16 or fp32")(
                "torch", po::bool_switch()->default_value(false),
                "also time PyTorch (tools/bench_torch_train.py) on the same model and threads")(
                "layout", po::value<std::string>()->default_value("tp=1,pp=1,dp=1,zero=1"),
                "the run's layout (under mpirun: dp x sp processes)")(
                "checkpoint", po::bool_switch()->default_value(false),
                "also time a save (how long it blocks the step) and resumes at the same layout "
                "and at --resume-layout")(
                "resume-layout", po::value<std::string>()->default_value("tp=1,pp=1,dp=1,zero=3"),
                "the other layout of the resume timing (same process count)")(
                "pipeline", po::value<std::string>()->default_value("sync"),
                "the optimizer pipeline: sync (Adam after backward) or overlap (each bucket's "
                "Adam during backward, speculative, validated after it)")(
                "device", po::value<std::string>()->default_value("cpu"),
                "cpu; cuda: forward/backward on the GPU, the optimizer offloaded to the CPU "
                "(prints TFLOP/s and MFU); twin: that device path on the CPU (for tests)")(
                "peak-tflops", po::value<double>()->default_value(989.0),
                "the MFU denominator (989: H100/H200 dense bf16)")(
                "gpu-optimizer", po::bool_switch()->default_value(false),
                "--device cuda|twin: also time the same step with the whole optimizer on the "
                "device and print the ratio")(
                "gpu-gemm", po::value<std::string>()->default_value("auto"),
                "--device cuda: auto (bf16 GEMMs for bf16 training) or fp32 (the fp32 copy)")(
                "gpu-tail-buckets", po::value<std::string>()->default_value("0"),
                "--device cuda|twin: the last N grad groups (the ones backward finishes last) "
                "keep their masters and Adam states on the device, stepped by the device Adam "
                "(less CPU Adam after backward; 12 B/parameter of device memory), or auto: as "
                "many as the device's memory leaves room for")(
                "gpu-attention", po::value<std::string>()->default_value("gemm"),
                "--device cuda, bf16 GEMMs: gemm (batched GEMMs over T x T scores) or flash "
                "(the tiled flash kernels)")(
                "recompute", po::value<std::string>()->default_value("none"),
                "activation checkpointing (ucp-train --recompute): none, all, the first N "
                "layers, or auto (the fewest that fit); MFU still counts model FLOPs only, so "
                "the rerun forward lowers it")(
                "adam-threads", po::value<int>()->default_value(0),
                "--pipeline overlap: the CPU Adam's threads (ucp-train --adam-threads; 0: the "
                "default split)")(
                "pin-threads", po::bool_switch()->default_value(false),
                "pin the CPU Adam's threads one to a CPU (ucp-train --pin-threads)")(
                "speculation", po::value<std::string>()->default_value("auto"),
                "--pipeline overlap: auto (speculative steps except after a clipped step), "
                "always, or off (ucp-train --speculation)")(
                "weights", po::value<std::string>()->default_value("auto"),
                "--device cuda|twin: resident or streamed weights (auto: the memory plan's "
                "choice for the GPU's memory; resident on the twin); "
                "prints the bytes streamed per step")(
                "host-buffers", po::value<std::string>()->default_value("auto"),
                "--device cuda|twin: whole or staged host copies of the weights and gradients "
                "(staged: only windows; bf16, --pipeline sync), or auto (staged only where "
                "whole ones would not fit this host)")(
                "sync-finish", po::bool_switch()->default_value(false),
                "--pipeline overlap on a device: finish each step before the next begins "
                "(not under the next step's forward)")(
                "largest", po::bool_switch()->default_value(false),
                "--device cuda|twin: train the most layers of --model's layer that the memory "
                "plan fits in the device's and the host's memory (--device-memory, "
                "--host-memory) at --seq-len and --micro-batch; prints the plan of it and of "
                "one layer more")(
                "device-memory", po::value<std::string>()->default_value(""),
                "the device's bytes for the plan's choices (N[K|M|G]; default: the GPU's)")(
                "host-memory", po::value<std::string>()->default_value(""),
                "the host's bytes for the plan's choices (N[K|M|G]; default: MemAvailable, of "
                "which --largest keeps 5% free)")(
                "clip", po::value<double>()->default_value(offload::TrainConfig{}.clip_grad),
                "the gradient-norm bound (0: none); with --pipeline overlap a clipped step "
                "corrects every speculative bucket, so this sets which case is timed");
          },
      .run = Run,
  };
}

UCP_REGISTER_COMMAND(MakeTrainBench);

}  // namespace
}  // namespace ucp::cli
