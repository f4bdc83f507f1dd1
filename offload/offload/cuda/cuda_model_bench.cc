// Timing program for the device run (not a test; tests/gpu/run_gpu_checks.sh runs it): one
// forward + backward of the CUDA model on a model given by its sizes (no preset files, so the
// program carries to a bare GPU machine with few libraries), median of --steps after a warm-up,
// tokens/s, model TFLOP/s and MFU against 989 TFLOP/s (dense bf16 on H100/H200), with the fp32
// GEMMs and with the bf16 ones (--gemm both, the default; the weights are bf16 values, as in
// bf16 training, so both read the same model). With --cpu-check the CPU model runs the same
// step on the same weights first, and the GPU's loss must match it within 1e-5 with fp32 GEMMs
// and 1e-2 with bf16 ones (exit 1 otherwise). With --profile the timed steps also record an
// event per op (CudaModel::ProfileOps) and the program prints where a step's device time goes,
// op by op (each matrix product by its sizes, with its TFLOP/s); the median stays unprofiled.
// --attention picks the bf16 GEMMs' attention: gemm (the default), flash, or both (then the
// flash step is also printed as a ratio of the GEMM attention's, same process). --recompute
// all reruns every layer's forward in backward (Recompute::All()); both runs each step without
// and with it, prints the ratio, and requires the same gradient bits (exit 1 otherwise).
// Usage:
//   offload_cuda_model_bench [--family llama|gpt] [--hidden 2048] [--layers 16] [--heads 16]
//     [--kv-heads 4] [--ffn 5632] [--vocab 32000] [--batch 4] [--seq 1024] [--steps 3]
//     [--gemm fp32|bf16|both] [--attention gemm|flash|both] [--recompute none|all|both]
//     [--cpu-check] [--profile] [--threads N]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_model.h"
#include "offload/model/model.h"
#include "offload/optim/cpu_affinity.h"
#include "ucp/tensor/float_bits.h"

namespace {

using namespace ucp::offload;  // NOLINT: a short program

std::string CpuName() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "offload_cuda_model_bench: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  ModelConfig c;
  c.family = Family::kLlama;
  c.hidden = 2048, c.layers = 16, c.heads = 16, c.kv_heads = 4, c.head_dim = 0;
  c.ffn_hidden = 5632, c.vocab = 32000;
  c.tied_embeddings = false;
  int64_t batch = 4, seq = 1024;
  int steps = 3, threads = DefaultThreads();
  bool cpu_check = false, profile = false;
  std::string gemm = "both", attention = "gemm", recompute = "none";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) std::exit(Fail(a + " needs a value"));
      return std::atoll(argv[++i]);
    };
    if (a == "--family") {
      if (i + 1 >= argc) return Fail("--family needs a value");
      const std::string f = argv[++i];
      c.family = f == "gpt" ? Family::kGpt : Family::kLlama;
    } else if (a == "--hidden") c.hidden = next();
    else if (a == "--layers") c.layers = next();
    else if (a == "--heads") c.heads = next();
    else if (a == "--kv-heads") c.kv_heads = next();
    else if (a == "--ffn") c.ffn_hidden = next();
    else if (a == "--vocab") c.vocab = next();
    else if (a == "--batch") batch = next();
    else if (a == "--seq") seq = next();
    else if (a == "--steps") steps = static_cast<int>(next());
    else if (a == "--threads") threads = static_cast<int>(next());
    else if (a == "--cpu-check") cpu_check = true;
    else if (a == "--profile") profile = true;
    else if (a == "--gemm" && i + 1 < argc) gemm = argv[++i];
    else if (a == "--attention" && i + 1 < argc) attention = argv[++i];
    else if (a == "--recompute" && i + 1 < argc) recompute = argv[++i];
    else return Fail("unknown option " + a);
  }
  if (c.family == Family::kGpt) {
    c.kv_heads = c.heads;
    c.tied_embeddings = true;
  }
  c.head_dim = c.hidden / c.heads;
  c.padded_vocab = (c.vocab + 127) / 128 * 128;
  c.max_positions = seq;
  if (steps < 1 || batch < 1 || seq < 1 || threads < 1) return Fail("sizes must be >= 1");
  if (gemm != "fp32" && gemm != "bf16" && gemm != "both") return Fail("--gemm fp32|bf16|both");
  if (attention != "gemm" && attention != "flash" && attention != "both") {
    return Fail("--attention gemm|flash|both");
  }
  if (recompute != "none" && recompute != "all" && recompute != "both") {
    return Fail("--recompute none|all|both");
  }
  auto table = ModelParamTable(c);
  if (!table.ok()) return Fail(table.status().ToString());
  const double flops = ModelStepFlops(c, *table, batch, seq);
  const double tokens = static_cast<double>(batch * seq);
  cudaDeviceProp prop{};
  if (ucp::offload::cuda::DeviceCount() == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    return Fail("no CUDA device");
  }
  std::printf("cpu: %s, %d threads\ngpu: %s, %zu MiB\n", CpuName().c_str(), threads, prop.name,
              static_cast<size_t>(prop.totalGlobalMem >> 20));
  std::printf("model: %s, %lld parameters (hidden %lld, layers %lld, heads %lld/%lld kv, ffn "
              "%lld, vocab %lld), %lld x %lld tokens, %.3f TFLOP per forward + backward\n",
              c.family == Family::kGpt ? "gpt" : "llama", static_cast<long long>(table->total),
              static_cast<long long>(c.hidden), static_cast<long long>(c.layers),
              static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
              static_cast<long long>(c.ffn_hidden), static_cast<long long>(c.vocab),
              static_cast<long long>(batch), static_cast<long long>(seq), flops / 1e12);

  const size_t n = static_cast<size_t>(table->total);
  std::vector<float> w(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<uint16_t> w16(n);
  for (size_t i = 0; i < n; ++i) {  // bf16 values, as the weights of bf16 training
    w[i] = ucp::FloatFromBf16(w16[i] = ucp::Bf16FromFloat(nd(rng)));
  }
  std::vector<int32_t> in(static_cast<size_t>(batch * seq)), tg(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
    tg[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  }
  const Batch b{in, tg, batch, seq, 0};
  const float scale = static_cast<float>(1.0 / tokens);
  using Clock = std::chrono::steady_clock;

  double cpu_loss = std::nan("");
  if (cpu_check) {
    auto m = Model::Create(c, batch, seq, threads);
    if (!m.ok()) return Fail(m.status().ToString());
    std::vector<float> g(n, 0.0f);
    const auto t0 = Clock::now();
    auto l = m->ForwardBackward(w, g, b, scale);
    if (!l.ok()) return Fail(l.status().ToString());
    cpu_loss = *l;
    std::printf("cpu   loss %.6f | %.1f ms (one step)\n", cpu_loss / tokens,
                std::chrono::duration<double>(Clock::now() - t0).count() * 1e3);
  }
  float *dw = nullptr, *dg = nullptr;
  uint16_t* dw16 = nullptr;
  if (cudaMalloc(&dw, n * 4) != cudaSuccess || cudaMalloc(&dg, n * 4) != cudaSuccess ||
      cudaMalloc(&dw16, n * 2) != cudaSuccess) {
    return Fail("weights and gradients do not fit on the device");
  }
  cudaMemcpy(dw, w.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dw16, w16.data(), n * 2, cudaMemcpyHostToDevice);
  int status = 0;
  double fp32_time = 0, gemm_attention_time = 0;
  // (GEMMs, attention): fp32 GEMMs run the fused fp32 attention kernels.
  const std::pair<const char*, const char*> runs[] = {
      {"fp32", "fused fp32"}, {"bf16", "gemm"}, {"bf16", "flash"}};
  std::vector<std::pair<const char*, const char*>> plan;
  for (const auto& run : runs) {
    const std::string mode = run.first, attn = run.second;
    if (gemm != "both" && gemm != mode) continue;
    if (mode == "bf16" && attention != "both" && attention != attn) continue;
    plan.push_back(run);
  }
  const bool rc_none = recompute != "all", rc_all = recompute != "none";
  double kept_time = 0;
  std::vector<float> kept_grads, grads;  // --recompute both: the gradients the runs summed
  for (size_t r = 0; r < plan.size() * 2; ++r) {
    const bool recomputing = r % 2 == 1;
    if ((recomputing && !rc_all) || (!recomputing && !rc_none)) continue;
    const std::string mode = plan[r / 2].first, attn = plan[r / 2].second;
    const bool bf16 = mode == "bf16", flash = attn == "flash";
    // One model at a time: the activations are the largest thing on the device.
    auto gm = cuda::CudaModel::Create(
        c, batch, seq, bf16 ? cuda::GemmInputs::kBf16 : cuda::GemmInputs::kFp32,
        flash ? cuda::AttentionKernel::kFlash : cuda::AttentionKernel::kGemm, {},
        recomputing ? Recompute::All() : Recompute::None());
    if (!gm.ok()) return Fail(gm.status().ToString());
    cudaMemset(dg, 0, n * 4);
    double loss = 0;
    std::vector<double> times;
    for (int s = 0; s <= steps; ++s) {  // step 0 warms up
      const auto t0 = Clock::now();
      auto l = gm->ForwardBackward(dw, dg, b, scale, nullptr, bf16 ? dw16 : nullptr);
      if (!l.ok()) return Fail(l.status().ToString());
      if (s > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      loss = *l;
    }
    std::sort(times.begin(), times.end());
    const double t = times[times.size() / 2], tflops = flops / t / 1e12;
    std::printf("cuda %s GEMMs, %s attention%s: loss %.6f | %.1f ms | %.0f tokens/s | %.2f "
                "TFLOP/s | MFU %.2f%% of 989",
                mode.c_str(), attn.c_str(), recomputing ? ", layers recomputed" : "",
                loss / tokens, t * 1e3, tokens / t, tflops, 100.0 * tflops / 989.0);
    if (rc_none && rc_all) {
      // Both runs add steps + 1 backward passes into dg from zero: the same bits if the reruns
      // wrote what the first forward wrote.
      grads.resize(n);
      if (cudaMemcpy(grads.data(), dg, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
        return Fail("gradients to the host");
      }
    }
    if (recomputing && rc_none) {
      // The same run without recomputation came just before: its time, and its gradients.
      const bool same = grads == kept_grads;
      std::printf(" | %.2fx the kept activations' step, gradients %s", t / kept_time,
                  same ? "bitwise the same" : "DIFFERENT");
      if (!same) status = 1;
    } else {
      if (bf16 && fp32_time > 0) std::printf(" | %.2fx the fp32 GEMMs' step", fp32_time / t);
      if (flash && gemm_attention_time > 0) {
        std::printf(" | %.2fx the GEMM attention's speed", gemm_attention_time / t);
      }
    }
    std::printf("\n");
    if (!recomputing) {
      kept_time = t;
      kept_grads.swap(grads);
      if (!bf16) fp32_time = t;
      if (bf16 && !flash) gemm_attention_time = t;
    }
    if (profile) {
      // Profiled steps after the timed ones, so the median above carries no event.
      gm->ProfileOps(true);
      for (int s = 0; s < steps; ++s) {
        auto l = gm->ForwardBackward(dw, dg, b, scale, nullptr, bf16 ? dw16 : nullptr);
        if (!l.ok()) return Fail(l.status().ToString());
      }
      const std::vector<cuda::CudaModel::OpTime> ops = gm->TakeOpTimes();
      gm->ProfileOps(false);
      double total = 0;
      for (const auto& o : ops) total += o.ms;
      std::printf("  where a step's device time goes (%s GEMMs, %s attention, mean of %d profiled "
                  "steps: %.1f ms):\n", mode.c_str(), attn.c_str(), steps, total / steps);
      for (const auto& o : ops) {
        std::printf("  %-28s %6lld calls %9.2f ms %5.1f%%", o.op.c_str(),
                    static_cast<long long>(o.calls / steps), o.ms / steps, 100.0 * o.ms / total);
        if (o.flops > 0) std::printf(" %7.1f TFLOP/s", o.flops / (o.ms * 1e-3) / 1e12);
        std::printf("\n");
      }
    }
    if (cpu_check) {
      const double rel = std::abs(loss - cpu_loss) / std::max(1e-30, std::abs(cpu_loss));
      const double tol = bf16 ? 1e-2 : 1e-5;
      std::printf("cuda (%s GEMMs, %s attention) vs cpu loss: relative difference %.3g %s\n",
                  mode.c_str(), attn.c_str(), rel, rel <= tol ? "(ok)" : "(TOO LARGE)");
      if (rel > tol) status = 1;
    }
  }
  cudaFree(dw);
  cudaFree(dg);
  cudaFree(dw16);
  return status;
}
