// `ucp-bench model`: forward + backward of one micro-batch of the engine's model, tokens/s and
// model TFLOP/s, on the CPU (the fast ops) and — where CUDA was built and a device exists — on
// the GPU (offload/cuda/cuda_model.h), in the same run, with the GPU's loss checked against the
// CPU's. MFU = model FLOPs (offload::ModelStepFlops) / --peak-tflops (989: H100/H200 dense bf16,
// the yardstick).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "offload/model/model.h"
#include "ucp-cli/bench/cpu_info.h"
#include "ucp-cli/command.h"
#include "ucp/api/checkpoint.h"
#include "ucp/base/status_macros.h"
#if defined(UCP_BENCH_HAVE_CUDA_MODEL)
#include <cuda_runtime.h>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_model.h"
#endif

namespace ucp::cli {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Timing {
  double loss = 0, median_s = 0;
};

template <typename Step>
Result<Timing> Time(int steps, Step&& step) {
  Timing t;
  UCP_ASSIGN_OR_RETURN(t.loss, step());  // warm-up (allocation, first-touch, cuBLAS heuristics)
  std::vector<double> s;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    UCP_ASSIGN_OR_RETURN(double l, step());
    s.push_back(Seconds(t0));
    (void)l;
  }
  std::sort(s.begin(), s.end());
  t.median_s = s[s.size() / 2];
  return t;
}

Status Run(const po::variables_map& vm, CommandIo& io) {
  const std::string model = vm["model"].as<std::string>();
  const int64_t seq = vm["seq-len"].as<int64_t>();
  const int64_t batch = vm["batch"].as<int64_t>();
  const int threads = vm["threads"].as<int>();
  const int steps = vm["steps"].as<int>();
  const std::string device = vm["device"].as<std::string>();
  const double peak = vm["peak-tflops"].as<double>();
  if (seq < 1 || batch < 1 || threads < 1 || steps < 1 || !(peak > 0)) {
    return InvalidArgumentError("--seq-len, --batch, --threads, --steps and --peak-tflops must "
                                "be positive");
  }
  if (device != "cpu" && device != "cuda" && device != "both") {
    return InvalidArgumentError("--device " + device + ": cpu, cuda or both");
  }
  UCP_ASSIGN_OR_RETURN(auto resolved, api::LoadResolvedModel(api::UcpDataDir(), model, "fp32"),
                       "--model");
  UCP_ASSIGN_OR_RETURN(offload::ModelConfig c, offload::ModelConfig::FromSpec(resolved.first),
                       "--model");
  UCP_ASSIGN_OR_RETURN(offload::ParamTable table, offload::ModelParamTable(c));
  const double tokens = static_cast<double>(batch * seq);
  const double flops = offload::ModelStepFlops(c, table, batch, seq);
  io.out << "model " << model << ": " << table.total << " parameters, " << batch << " x " << seq
         << " tokens, " << flops / 1e12 << " TFLOP per forward + backward\n";
  io.out << "cpu: " << CpuDescription() << ", " << threads << " threads\n";

  std::vector<float> w(static_cast<size_t>(table.total));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (float& x : w) x = nd(rng);
  std::vector<int32_t> in(static_cast<size_t>(batch * seq)), tg(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
    tg[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  }
  const offload::Batch b{in, tg, batch, seq, 0};
  const float scale = static_cast<float>(1.0 / tokens);
  auto report = [&](const char* name, const Timing& t) {
    const double tflops = flops / t.median_s / 1e12;
    char line[256];
    std::snprintf(line, sizeof line,
                  "%-5s loss %.6f | %.1f ms | %.0f tokens/s | %.3f TFLOP/s | MFU %.2f%% of %.0f\n",
                  name, t.loss / tokens, t.median_s * 1e3, tokens / t.median_s, tflops,
                  100.0 * tflops / peak, peak);
    io.out << line;
  };
  double cpu_loss = std::nan("");
  if (device != "cuda") {
    UCP_ASSIGN_OR_RETURN(offload::Model m, offload::Model::Create(c, batch, seq, threads));
    std::vector<float> g(w.size(), 0.0f);
    UCP_ASSIGN_OR_RETURN(Timing t, Time(steps, [&] { return m.ForwardBackward(w, g, b, scale); }));
    cpu_loss = t.loss;
    report("cpu", t);
  }
  if (device != "cpu") {
#if defined(UCP_BENCH_HAVE_CUDA_MODEL)
    if (offload::cuda::DeviceCount() == 0) {
      return FailedPreconditionError("--device " + device + ": no CUDA device");
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    io.out << "gpu: " << prop.name << ", " << prop.totalGlobalMem / (1 << 20) << " MiB\n";
    UCP_ASSIGN_OR_RETURN(offload::cuda::CudaModel m, offload::cuda::CudaModel::Create(c, batch, seq));
    float *dw = nullptr, *dg = nullptr;
    if (cudaMalloc(&dw, w.size() * 4) != cudaSuccess || cudaMalloc(&dg, w.size() * 4) != cudaSuccess) {
      return ResourceExhaustedError("weights and gradients do not fit on the device");
    }
    cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
    cudaMemset(dg, 0, w.size() * 4);
    auto t = Time(steps, [&] { return m.ForwardBackward(dw, dg, b, scale); });
    cudaFree(dw);
    cudaFree(dg);
    UCP_RETURN_IF_ERROR(t.status());
    report("cuda", *t);
    if (!std::isnan(cpu_loss)) {
      const double rel = std::abs(t->loss - cpu_loss) / std::max(1e-30, std::abs(cpu_loss));
      io.out << "cuda vs cpu loss: relative difference " << rel << (rel <= 1e-5 ? " (ok)\n" : " (TOO LARGE)\n");
      if (rel > 1e-5) return InternalError("the GPU's loss differs from the CPU's by " + std::to_string(rel));
    }
#else
    (void)cpu_loss;  // compared with the GPU's only where CUDA is built
    return UnimplementedError("--device " + device + ": this ucp-bench was built without CUDA");
#endif
  }
  return Status::Ok();
}

Command MakeModelBench() {
  return {
      .name = "model",
      .summary = "forward + backward tokens/s, TFLOP/s and MFU on the CPU and the GPU, same run",
      .usage = "[--model gpt2-small] [--seq-len 256] [--batch 4] [--device cpu|cuda|both]",
      .examples = {"ucp-bench model --model llama-tiny --device cpu  # the CPU ops alone",
                   "ucp-bench model --model gpt2-small --seq-len 1024 --batch 8 --device both  # "
                   "GPU against CPU, loss checked"},
      .add_options =
          [](po::options_description& o, po::positional_options_description&) {
            o.add_options()("model", po::value<std::string>()->default_value("gpt2-small"),
                            "model preset")(
                "seq-len", po::value<int64_t>()->default_value(256), "tokens per sample")(
                "batch", po::value<int64_t>()->default_value(4), "samples per step")(
                "threads", po::value<int>()->default_value(2), "CPU threads")(
                "steps", po::value<int>()->default_value(3), "timed steps (median, after a warm-up)")(
                "device", po::value<std::string>()->default_value("cpu"), "cpu, cuda or both")(
                "peak-tflops", po::value<double>()->default_value(989.0),
                "the MFU denominator (989: H100/H200 dense bf16)");
          },
      .run = Run,
  };
}

UCP_REGISTER_COMMAND(MakeModelBench);

}  // namespace
}  // namespace ucp::cli
