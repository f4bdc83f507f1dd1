// `ucp-bench adam`: CPU Adam throughput of each SIMD path, beside a memory-bandwidth probe with
// Adam's streams (read p, g, m, v; write p, m, v in place) on the same buffers and threads, the
// cost of a speculative step (snapshot) and of its rollback, and torch's AdamW from
// tools/bench_torch_adam.py on the same sizes and thread count when python3-torch is installed.
// Figures go to docs/PERFORMANCE.md ("CPU Adam").
#include "offload/optim/adam.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "offload/optim/cpu_adam.h"
#include "offload/optim/cpu_affinity.h"
#include "ucp-cli/bench/cpu_info.h"
#include "ucp-cli/command.h"
#include "ucp/base/status_macros.h"

namespace ucp::cli {
namespace {

using offload::AdamConfig;
using offload::AdamSnapshot;
using offload::AdamSpans;
using offload::CpuAdam;
using offload::GradSpan;
using offload::LowpDType;
using offload::LowpOutSpan;
using offload::SimdPath;
using Clock = std::chrono::steady_clock;

// "64M" -> 64 * 2^20; K, M, G are binary multiples.
Result<size_t> ParseCount(const std::string& s) {
  size_t pos = 0;
  unsigned long long v = 0;
  try {  // std::stoull is the only thrower here; caught at this adapter
    v = std::stoull(s, &pos);
  } catch (...) {
    return InvalidArgumentError("--params '" + s + "' is not a count like 64M");
  }
  const std::string suffix = s.substr(pos);
  const int shift = suffix.empty()  ? 0
                    : suffix == "K" ? 10
                    : suffix == "M" ? 20
                    : suffix == "G" ? 30
                                    : -1;
  if (shift < 0 || v == 0)
    return InvalidArgumentError("--params '" + s + "' is not a count like 64M");
  return static_cast<size_t>(v) << shift;
}

// Uninitialised storage, so that the first touch happens in the benchmark's threads (pages land
// on the NUMA node of the thread that streams them).
struct Buffers {
  size_t n = 0;
  std::unique_ptr<float[]> p, g, m, v, sp, sm, sv;
  std::unique_ptr<uint16_t[]> g16, out;
};

double BestSeconds(int repeat, const std::function<Status()>& f, Status* status) {
  // One untimed run first: the first pass over fresh buffers pays for TLB and cache warm-up.
  Status warm = f();
  if (!warm.ok()) {
    *status = std::move(warm);
    return 0;
  }
  double best = 1e300;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    Status s = f();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!s.ok()) {
      *status = std::move(s);
      return 0;
    }
    best = std::min(best, dt);
  }
  return best;
}

// Runs tools/bench_torch_adam.py; returns its stdout, or an empty string when python3 or torch
// is missing (the script exits 3 then).
std::string RunTorch(size_t n, int threads, int repeat, const std::string& grad) {
  const std::filesystem::path script =
      std::filesystem::path(UCP_DATA_DIR) / "tools" / "bench_torch_adam.py";
  if (!std::filesystem::exists(script)) return "";
  // Debian's interpreter, where python3-torch lives (a PATH python3 may be a different one).
  const std::string python =
      std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const std::string cmd = python + " " + script.string() + " --params " + std::to_string(n) +
                          " --threads " + std::to_string(threads) + " --repeat " +
                          std::to_string(repeat) + " --grad " + grad + " 2>/dev/null";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) out += buf;
  const int rc = ::pclose(pipe);
  return rc == 0 ? out : "";
}

Status Run(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(const size_t n, ParseCount(vm["params"].as<std::string>()));
  const int threads = vm["threads"].as<int>();
  const int repeat = vm["repeat"].as<int>();
  const std::string path_arg = vm["path"].as<std::string>();
  const std::string grad_arg = vm["grad"].as<std::string>();
  const std::string out_arg = vm["out"].as<std::string>();
  if (threads < 1) return InvalidArgumentError("--threads must be >= 1");
  if (repeat < 1) return InvalidArgumentError("--repeat must be >= 1");
  if (grad_arg != "fp32" && grad_arg != "bf16" && grad_arg != "fp16") {
    return InvalidArgumentError("--grad must be fp32, bf16 or fp16, not '" + grad_arg + "'");
  }
  if (out_arg != "none" && out_arg != "bf16" && out_arg != "fp16") {
    return InvalidArgumentError("--out must be none, bf16 or fp16, not '" + out_arg + "'");
  }
  std::vector<SimdPath> paths;
  if (path_arg == "all") {
    for (SimdPath p : {SimdPath::kAvx512, SimdPath::kAvx2, SimdPath::kSve, SimdPath::kNeon,
                       SimdPath::kPortable}) {
      if (offload::SimdPathAvailable(p)) paths.push_back(p);
    }
  } else {
    UCP_ASSIGN_OR_RETURN(SimdPath p, offload::ParseSimdPath(path_arg), "in --path");
    paths.push_back(p);
  }
  const LowpDType grad_dtype = grad_arg == "fp32"   ? LowpDType::kFp32
                               : grad_arg == "bf16" ? LowpDType::kBf16
                                                    : LowpDType::kFp16;
  const bool has_out = out_arg != "none";
  const LowpDType out_dtype = out_arg == "fp16" ? LowpDType::kFp16 : LowpDType::kBf16;

  Buffers b;
  b.n = n;
  b.p.reset(new float[n]);
  b.g.reset(new float[n]);
  b.m.reset(new float[n]);
  b.v.reset(new float[n]);
  b.sp.reset(new float[n]);
  b.sm.reset(new float[n]);
  b.sv.reset(new float[n]);
  b.g16.reset(new uint16_t[n]);
  b.out.reset(new uint16_t[n]);
  tbb::task_arena arena(threads);
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n, CpuAdam::kBlockElems),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t i = r.begin(); i < r.end(); ++i) {
            const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
            b.p[i] = x;
            b.g[i] = 1e-2f * x;
            b.m[i] = 1e-3f * x;
            b.v[i] = 1e-6f * (x * x + 1e-3f);
            b.sp[i] = b.sm[i] = b.sv[i] = 0.f;
            b.g16[i] = grad_dtype == LowpDType::kBf16 ? 0x3c23 : 0x2000;  // ~0.01 in each
            b.out[i] = 0;
          }
        },
        tbb::static_partitioner());
  });

  AdamSpans spans;
  spans.param = {b.p.get(), n};
  spans.exp_avg = {b.m.get(), n};
  spans.exp_avg_sq = {b.v.get(), n};
  spans.grad = grad_dtype == LowpDType::kFp32 ? GradSpan::Fp32({b.g.get(), n})
                                              : GradSpan{grad_dtype, b.g16.get(), n};
  if (has_out) spans.out = {out_dtype, {b.out.get(), n}};
  const AdamSnapshot snap{{b.sp.get(), n}, {b.sm.get(), n}, {b.sv.get(), n}, {}};
  const double bytes_per_param =
      4 + (grad_dtype == LowpDType::kFp32 ? 4 : 2) + 4 + 4 + 12 + (has_out ? 2 : 0);
  AdamConfig config;
  config.weight_decay = 0.01f;

  io.out << std::fixed;
  io.out << "cpu: " << CpuDescription() << "\n";
  io.out << "adam: " << n << " params, " << threads << " threads, grad " << grad_arg << ", out "
         << out_arg << ", " << static_cast<int>(bytes_per_param) << " B/param moved, best of "
         << repeat << "\n";

  Status status;
  // The probe uses the vector width of the first path measured (the best one for --path all).
  const SimdPath best = paths.front() == SimdPath::kScalarRef ? SimdPath::kPortable : paths.front();
  UCP_ASSIGN_OR_RETURN(CpuAdam probe_adam, CpuAdam::Create(config, threads, best));
  auto probe = [&] {
    return probe_adam.BandwidthProbe(spans.param, {b.g.get(), n}, spans.exp_avg, spans.exp_avg_sq);
  };
  // The probe runs before and after the paths; the faster of the two is the reference, so that a
  // burst of noise during one of them cannot inflate the percentages.
  const double probe_before_s = BestSeconds(repeat, probe, &status);
  UCP_RETURN_IF_ERROR(status);
  double probe_s = probe_before_s;
  // Rows are collected first and printed after the second probe, as percentages of the best.
  struct Row {
    std::string name;
    double seconds, bytes;
  };
  std::vector<Row> rows;
  std::ostringstream notes;
  notes << std::fixed;
  auto row = [&](const std::string& name, double seconds, double bytes) {
    rows.push_back({name, seconds, bytes});
  };
  int64_t step = 0;
  for (SimdPath path : paths) {
    UCP_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::Create(config, threads, path), "in --path");
    // The portable path on x86-64 calls libm's fmaf: one timed run is enough to see its rate.
    const int reps = path == SimdPath::kPortable || path == SimdPath::kScalarRef ? 1 : repeat;
    const double s = BestSeconds(
        reps, [&] { return adam.StepBucket(++step, std::span<const AdamSpans>(&spans, 1)); },
        &status);
    UCP_RETURN_IF_ERROR(status);
    row(std::string(offload::SimdPathName(path)), s, bytes_per_param);
    if (path != paths.front()) continue;
    // Speculation costs: the same step writing a snapshot (+12 B/param), and the rollback copy
    // (read 3, write 3 arrays: 24 B/param).
    const double spec_s = BestSeconds(
        repeat,
        [&] {
          return adam.StepBucketSpeculative(++step, std::span<const AdamSpans>(&spans, 1),
                                            std::span<const AdamSnapshot>(&snap, 1));
        },
        &status);
    UCP_RETURN_IF_ERROR(status);
    row(std::string(offload::SimdPathName(path)) + " speculative", spec_s, bytes_per_param + 12);
    const double rb_s = BestSeconds(
        repeat,
        [&] {
          return adam.RollbackBucket(std::span<const AdamSpans>(&spans, 1),
                                     std::span<const AdamSnapshot>(&snap, 1));
        },
        &status);
    UCP_RETURN_IF_ERROR(status);
    row("rollback (copy back)", rb_s, 24);
    // The fused step with a gradient multiplier (the trainer's clipped step, the overlapped
    // pipeline's speculative and correction steps): the same streams as the plain step.
    const double fused_s = BestSeconds(
        repeat,
        [&] {
          return adam.StepBucketFused(++step, std::span<const AdamSpans>(&spans, 1), {},
                                      CpuAdam::SnapshotUse::kNone, 0.5f);
        },
        &status);
    UCP_RETURN_IF_ERROR(status);
    row("fused (x multiplier)", fused_s, bytes_per_param);
    if (vm["pin"].as<bool>()) {
      // The same step on a pool pinned as ucp-train --pin-threads pins it.
      UCP_ASSIGN_OR_RETURN(const std::vector<int> own, offload::ThisThreadCpus(), "--pin");
      const std::vector<int> cpus = offload::AdamCpus(own, threads);
      UCP_ASSIGN_OR_RETURN(CpuAdam pinned, CpuAdam::Create(config, threads, path, cpus),
                           "--pin");
      const double pin_s = BestSeconds(
          repeat,
          [&] { return pinned.StepBucket(++step, std::span<const AdamSpans>(&spans, 1)); },
          &status);
      UCP_RETURN_IF_ERROR(status);
      row(std::string(offload::SimdPathName(path)) + " pinned", pin_s, bytes_per_param);
      notes << std::setprecision(2) << "  pinned to CPUs " << offload::CpuListString(cpus)
            << ": plain step time unpinned / pinned: " << s / pin_s << "x\n"
            << std::setprecision(1);
    }
    notes << std::setprecision(2) << "  speculative step / plain step time: " << spec_s / s
          << "x; rollback / plain step time: " << rb_s / s << "x; fused (x multiplier) / plain "
          << "step time: " << fused_s / s << "x\n"
          << std::setprecision(1);
    if (vm["torch"].as<bool>()) {
      // Free nothing: torch allocates its own arrays of the same size in its own process.
      const std::string torch = RunTorch(n, threads, repeat, grad_arg);
      if (torch.empty()) {
        notes << "  torch: not run (python3 with torch not found, or it failed)\n";
      } else {
        std::istringstream lines(torch);
        std::string line;
        while (std::getline(lines, line)) {
          // Lines "NAME MPARAM_PER_S"; print beside the path's own rate.
          std::istringstream f(line);
          std::string name;
          double mps = 0;
          if (!(f >> name >> mps) || mps <= 0) continue;
          const double ours = static_cast<double>(n) / s / 1e6;
          notes << "  " << std::left << std::setw(22) << name << std::right << std::setw(12) << mps
                << "   (" << offload::SimdPathName(path) << " is " << std::setprecision(2)
                << ours / mps << "x faster, same run)\n"
                << std::setprecision(1);
        }
      }
    }
  }
  probe_s = std::min(probe_s, BestSeconds(repeat, probe, &status));
  UCP_RETURN_IF_ERROR(status);
  const double probe_gbs = 28.0 * static_cast<double>(n) / probe_s / 1e9;
  io.out << std::setprecision(1) << "  probe (read p,g,m,v fp32; write p,m,v; "
         << offload::SimdPathName(best) << ", best of before and after): " << probe_gbs
         << " GB/s = " << static_cast<double>(n) / probe_s / 1e6 << " Mparam/s at 28 B/param\n";
  io.out << "  " << std::left << std::setw(22) << "path" << std::right << std::setw(12)
         << "Mparam/s" << std::setw(10) << "GB/s" << std::setw(12) << "% of probe"
         << "\n";
  for (const Row& r : rows) {
    const double gbs = r.bytes * static_cast<double>(n) / r.seconds / 1e9;
    io.out << "  " << std::left << std::setw(22) << r.name << std::right << std::setw(12)
           << static_cast<double>(n) / r.seconds / 1e6 << std::setw(10) << gbs << std::setw(11)
           << 100.0 * gbs / probe_gbs << "%\n";
  }
  io.out << notes.str();
  return Status::Ok();
}

Command MakeAdamBench() {
  return {
      .name = "adam",
      .summary = "CPU Adam Mparam/s and GB/s per SIMD path against a same-run bandwidth probe",
      .usage =
          "[--params 64M] [--threads T] [--path all|avx512|avx2|portable|...] "
          "[--grad fp32|bf16|fp16] [--out none|bf16|fp16] [--repeat R] [--pin] [--torch]",
      .add_options =
          [](po::options_description& o, po::positional_options_description&) {
            o.add_options()("params", po::value<std::string>()->default_value("64M"),
                            "parameter count (K, M, G are binary multiples)")(
                "threads", po::value<int>()->default_value(2), "optimizer threads")(
                "path", po::value<std::string>()->default_value("all"), "SIMD path or all")(
                "grad", po::value<std::string>()->default_value("fp32"), "gradient dtype")(
                "out", po::value<std::string>()->default_value("none"),
                "fused low-precision weight copy")("repeat", po::value<int>()->default_value(5),
                                                   "runs per figure; the best is printed")(
                "pin", po::bool_switch()->default_value(false),
                "also time the first path's step with its threads pinned one to a CPU (the "
                "last --threads of this process's CPUs, as ucp-train --pin-threads)")(
                "torch", po::bool_switch()->default_value(false),
                "also run tools/bench_torch_adam.py (torch AdamW) on the same sizes");
          },
      .run = Run,
  };
}

UCP_REGISTER_COMMAND(MakeAdamBench);

}  // namespace
}  // namespace ucp::cli
