// GPU check (label gpu): the CUDA model (the CPU model's graph over the CUDA ops) against the
// CPU model on the same weights and batch: loss and every gradient, GPT and LLaMA with GQA and
// an untied head. Skips where no CUDA device exists; tests/gpu/run_gpu_checks.sh runs it on one.
// Tolerance (fp32 GEMMs): loss within 1e-5 relative; max |gradient difference| <= 1e-4 x
// max(1, max |grad|) (different summation orders and the GPU's expf/tanhf over a few layers).
// bf16 GEMMs: see Bf16GemmsStayWithinBf16OfTheCpuModel. Ulysses sequence parallelism: P ranks
// as threads on the one GPU (SequenceParallelShardsSumToTheWholeSequence).
#include "offload/cuda/cuda_model.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/comm/rank_only_communicator.h"
#include "offload/cuda/cuda_cast.h"
#include "offload/model/model.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload::cuda {
namespace {

ModelConfig Config(Family family) {
  ModelConfig c;
  c.family = family;
  c.vocab = 301;
  c.padded_vocab = 320;
  c.hidden = 96;
  c.layers = 2;
  c.heads = 6;
  c.kv_heads = family == Family::kGpt ? 6 : 2;
  c.head_dim = 16;
  c.ffn_hidden = family == Family::kGpt ? 384 : 160;
  c.max_positions = 64;
  c.tied_embeddings = family == Family::kGpt;
  return c;
}

// Random weights (norm weights 1) and a batch with some ignored targets, from `seed`.
struct Inputs {
  std::vector<float> w;
  std::vector<int32_t> in, tg;
};
Inputs MakeInputs(const Model& cpu, const ModelConfig& c, int64_t rows, uint32_t seed) {
  Inputs x;
  x.w.resize(static_cast<size_t>(cpu.num_params()));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (float& v : x.w) v = nd(rng);
  for (const ParamInfo& p : cpu.params()) {
    if (p.name.find("layernorm.weight") != std::string::npos) {
      std::fill(x.w.begin() + p.offset, x.w.begin() + p.offset + p.numel, 1.0f);
    }
  }
  x.in.resize(static_cast<size_t>(rows));
  x.tg.resize(static_cast<size_t>(rows));
  for (size_t i = 0; i < x.in.size(); ++i) {
    x.in[i] = static_cast<int32_t>(rng() % c.vocab);
    x.tg[i] = i % 13 == 5 ? -1 : static_cast<int32_t>(rng() % c.vocab);
  }
  return x;
}

// The fp32 GEMMs' gradient bound (the file comment): each tensor's max |difference| <= 1e-4 x
// max(1, max |grad|).
void ExpectWithinFp32(const Model& cpu, const std::vector<float>& g_cpu,
                      const std::vector<float>& g_gpu) {
  for (const ParamInfo& p : cpu.params()) {
    double scale = 1.0, err = 0.0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      scale = std::max(scale, static_cast<double>(std::abs(g_cpu[i])));
      err = std::max(err, static_cast<double>(std::abs(g_cpu[i] - g_gpu[i])));
    }
    EXPECT_LE(err, 1e-4 * scale) << p.name;
  }
}

class CudaModelTest : public ::testing::TestWithParam<Family> {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaModelTest, MatchesTheCpuModel) {
  const ModelConfig c = Config(GetParam());
  const int64_t B = 3, T = 37;
  UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
  UCP_ASSERT_OK_AND_ASSIGN(CudaModel gpu, CudaModel::Create(c, B, T));
  ASSERT_EQ(cpu.num_params(), gpu.num_params());
  const size_t n = static_cast<size_t>(cpu.num_params());
  const Inputs x = MakeInputs(cpu, c, B * T, 7);
  const std::vector<float>& w = x.w;
  std::vector<float> g_cpu(n, 0.0f), g_gpu(n);
  const Batch batch{x.in, x.tg, B, T, 0};
  UCP_ASSERT_OK_AND_ASSIGN(double loss_cpu, cpu.ForwardBackward(w, g_cpu, batch, 1e-2f));

  float *d_w = nullptr, *d_g = nullptr;
  ASSERT_EQ(cudaMalloc(&d_w, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_g, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_w, w.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_g, 0, n * 4), cudaSuccess);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_gpu, gpu.ForwardBackward(d_w, d_g, batch, 1e-2f));
  UCP_ASSERT_OK_AND_ASSIGN(double fwd_gpu, gpu.Forward(d_w, batch));
  ASSERT_EQ(cudaMemcpy(g_gpu.data(), d_g, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);

  // Profiled (ProfileOps): the same bits, and every op of the graph timed: per layer four matrix
  // products forward and four backward, the classifier once.
  gpu.ProfileOps(true);
  ASSERT_EQ(cudaMemset(d_g, 0, n * 4), cudaSuccess);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_prof, gpu.ForwardBackward(d_w, d_g, batch, 1e-2f));
  std::vector<float> g_prof(n);
  ASSERT_EQ(cudaMemcpy(g_prof.data(), d_g, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(loss_prof, loss_gpu);
  EXPECT_TRUE(g_prof == g_gpu);
  int64_t fwd = 0, bwd = 0, cls = 0;
  double ms = 0;
  for (const CudaModel::OpTime& o : gpu.TakeOpTimes()) {
    if (o.op.rfind("matmul fwd", 0) == 0) fwd += o.calls;
    if (o.op.rfind("matmul bwd", 0) == 0) bwd += o.calls;
    if (o.op == "classifier fwd+bwd") cls += o.calls;
    EXPECT_GE(o.ms, 0.0) << o.op;
    ms += o.ms;
  }
  EXPECT_EQ(fwd, 4 * c.layers);
  EXPECT_EQ(bwd, 4 * c.layers);
  EXPECT_EQ(cls, 1);
  EXPECT_GT(ms, 0.0);
  EXPECT_TRUE(gpu.TakeOpTimes().empty());  // taken
  gpu.ProfileOps(false);
  cudaFree(d_w);
  cudaFree(d_g);

  EXPECT_NEAR(loss_gpu, loss_cpu, 1e-5 * std::abs(loss_cpu));
  EXPECT_EQ(loss_gpu, fwd_gpu);  // the forward alone computes the same loss
  ExpectWithinFp32(cpu, g_cpu, g_gpu);
}

// The bf16 GEMMs' case: weights that are bf16 values (w rounded, w16 their bits; the fp32 copy
// their widening, as in training), a batch, and the CPU model's loss and gradients on them; the
// weights on the device (d_g zeroed).
struct Bf16Case {
  Inputs x;
  std::vector<uint16_t> w16;
  std::vector<float> g_cpu;
  double loss_cpu = 0;
  float *d_w = nullptr, *d_g = nullptr;
  uint16_t* d_w16 = nullptr;
  Bf16Case(Model& cpu, const ModelConfig& c, int64_t B, int64_t T, uint32_t seed)
      : x(MakeInputs(cpu, c, B * T, seed)) {
    const size_t n = x.w.size();
    w16.resize(n);
    g_cpu.assign(n, 0.0f);
    for (size_t i = 0; i < n; ++i) x.w[i] = FloatFromBf16(w16[i] = Bf16FromFloat(x.w[i]));
    auto l = cpu.ForwardBackward(x.w, g_cpu, batch(B, T), 1e-2f);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    loss_cpu = l.value_or(0.0);
    EXPECT_EQ(cudaMalloc(&d_w, n * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&d_g, n * 4), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&d_w16, n * 2), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d_w, x.w.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d_w16, w16.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemset(d_g, 0, n * 4), cudaSuccess);
  }
  ~Bf16Case() {
    cudaFree(d_w);
    cudaFree(d_g);
    cudaFree(d_w16);
  }
  Batch batch(int64_t B, int64_t T) const { return Batch{x.in, x.tg, B, T, 0}; }
  std::vector<float> DeviceGrads() const {
    std::vector<float> g(x.w.size());
    EXPECT_EQ(cudaMemcpy(g.data(), d_g, g.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return g;
  }
};

// Bounds of the bf16 GEMMs against the CPU model: loss within 1e-2 relative; each gradient
// tensor within 3e-2 in relative L2 norm (bf16 keeps about 3 digits; a wrong operand, transpose
// or offset is off by order 1).
void ExpectWithinBf16(const Model& cpu, const Bf16Case& k, double loss_gpu,
                      const std::vector<float>& g_gpu) {
  EXPECT_NEAR(loss_gpu, k.loss_cpu, 1e-2 * std::abs(k.loss_cpu));
  for (const ParamInfo& p : cpu.params()) {
    double diff = 0.0, norm = 0.0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      const double d = static_cast<double>(g_gpu[i]) - k.g_cpu[i];
      diff += d * d;
      norm += static_cast<double>(k.g_cpu[i]) * k.g_cpu[i];
    }
    ASSERT_GT(norm, 0.0) << p.name;
    std::printf("  %-40s relative L2 error %.3g\n", p.name.c_str(), std::sqrt(diff / norm));
    EXPECT_LE(std::sqrt(diff / norm), 3e-2) << p.name;
  }
}

// bf16 GEMMs (GemmInputs::kBf16, what bf16 training runs): the only difference from the CPU model
// is the activations and gradients rounded to bf16 before each GEMM (ExpectWithinBf16's bounds).
TEST_P(CudaModelTest, Bf16GemmsStayWithinBf16OfTheCpuModel) {
  const ModelConfig c = Config(GetParam());
  const int64_t B = 3, T = 37;
  UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
  UCP_ASSERT_OK_AND_ASSIGN(CudaModel gpu, CudaModel::Create(c, B, T, GemmInputs::kBf16));
  EXPECT_EQ(gpu.gemm(), GemmInputs::kBf16);
  const size_t n = static_cast<size_t>(cpu.num_params());
  Bf16Case k(cpu, c, B, T, 11);
  const Batch batch = k.batch(B, T);
  // The bf16 weights are required, and refused by a model of fp32 GEMMs.
  EXPECT_EQ(gpu.Forward(k.d_w, batch).status().code(), StatusCode::kInvalidArgument);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_gpu,
                           gpu.ForwardBackward(k.d_w, k.d_g, batch, 1e-2f, nullptr, k.d_w16));
  UCP_ASSERT_OK_AND_ASSIGN(double fwd_gpu, gpu.Forward(k.d_w, batch, k.d_w16));
  const std::vector<float> g_gpu = k.DeviceGrads();
  UCP_ASSERT_OK_AND_ASSIGN(CudaModel fp32, CudaModel::Create(c, B, T));
  EXPECT_EQ(fp32.Forward(k.d_w, batch, k.d_w16).status().code(), StatusCode::kInvalidArgument);

  // Fp32Layout::kPacked (what the trainer's device holds): the fp32 copy packed to
  // Fp32ReadRanges gives the whole copy's loss and gradients bit for bit.
  UCP_ASSERT_OK_AND_ASSIGN(auto ranges, Fp32ReadRanges(c));
  std::vector<float> packed;
  for (const auto& [b, e] : ranges) packed.insert(packed.end(), k.x.w.begin() + b, k.x.w.begin() + e);
  ASSERT_EQ(static_cast<int64_t>(packed.size()), gpu.packed_fp32_elements());
  EXPECT_LT(packed.size(), n);
  float* d_wp = nullptr;
  ASSERT_EQ(cudaMalloc(&d_wp, packed.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_wp, packed.data(), packed.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(k.d_g, 0, n * 4), cudaSuccess);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_packed,
                           gpu.ForwardBackward(d_wp, k.d_g, batch, 1e-2f, nullptr, k.d_w16,
                                               Fp32Layout::kPacked));
  EXPECT_EQ(loss_packed, loss_gpu);
  EXPECT_TRUE(k.DeviceGrads() == g_gpu) << "packed gradients differ from the whole copy's";
  EXPECT_EQ(fp32.Forward(k.d_w, batch, nullptr, Fp32Layout::kPacked).status().code(),
            StatusCode::kInvalidArgument);
  cudaFree(d_wp);

  std::printf("loss: cpu %.9g, cuda bf16 GEMMs %.9g\n", k.loss_cpu, loss_gpu);
  EXPECT_EQ(loss_gpu, fwd_gpu);
  ExpectWithinBf16(cpu, k, loss_gpu, g_gpu);
}

// AttentionKernel::kFlash: the flash kernels in place of the GEMM attention, on heads of 64
// (what they take) and 100 tokens (two tiles, the second partial): within the same bounds of
// the CPU model as the GEMM attention.
TEST_P(CudaModelTest, FlashAttentionStaysWithinBf16OfTheCpuModel) {
  ModelConfig c = Config(GetParam());
  c.hidden = 128, c.heads = 2, c.head_dim = 64, c.max_positions = 128;
  c.kv_heads = GetParam() == Family::kGpt ? 2 : 1;
  const int64_t B = 2, T = 100;
  UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
  UCP_ASSERT_OK_AND_ASSIGN(CudaModel gpu, CudaModel::Create(c, B, T, GemmInputs::kBf16,
                                                            AttentionKernel::kFlash));
  EXPECT_EQ(gpu.attention(), AttentionKernel::kFlash);
  Bf16Case k(cpu, c, B, T, 12);
  const Batch batch = k.batch(B, T);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_gpu,
                           gpu.ForwardBackward(k.d_w, k.d_g, batch, 1e-2f, nullptr, k.d_w16));
  UCP_ASSERT_OK_AND_ASSIGN(double fwd_gpu, gpu.Forward(k.d_w, batch, k.d_w16));
  std::printf("loss: cpu %.9g, cuda bf16 GEMMs + flash attention %.9g\n", k.loss_cpu, loss_gpu);
  EXPECT_EQ(loss_gpu, fwd_gpu);
  ExpectWithinBf16(cpu, k, loss_gpu, k.DeviceGrads());
}

// Recomputed layers on the device (the first 2 of 3, and all 3: one and two of them rerun) give
// the bits of the model that keeps every activation, with the fp32 GEMMs, the bf16 GEMMs and
// GEMM attention, and the flash kernels (whose backward reads the recomputed output), in less
// memory (DeviceActivationBytes). Every size a multiple of 64, so the layers' slices and the
// shared slot have the same alignment for cuBLAS.
TEST_P(CudaModelTest, RecomputedLayersGiveTheKeptBits) {
  ModelConfig c = Config(GetParam());
  c.hidden = 128, c.heads = 2, c.head_dim = 64, c.max_positions = 128, c.layers = 3;
  c.kv_heads = GetParam() == Family::kGpt ? 2 : 1;
  c.ffn_hidden = 256;
  const int64_t B = 2, T = 64;
  UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
  Bf16Case k(cpu, c, B, T, 13);
  const Batch batch = k.batch(B, T);
  const size_t n = k.x.w.size();
  struct Mode {
    GemmInputs gemm;
    AttentionKernel attention;
  };
  for (const Mode m : {Mode{GemmInputs::kFp32, AttentionKernel::kGemm},
                       Mode{GemmInputs::kBf16, AttentionKernel::kGemm},
                       Mode{GemmInputs::kBf16, AttentionKernel::kFlash}}) {
    const bool bf16 = m.gemm == GemmInputs::kBf16;
    SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") +
                 (m.attention == AttentionKernel::kFlash ? " flash" : ""));
    const Recompute modes[] = {Recompute::None(), Recompute{2}, Recompute::All()};
    std::vector<float> g[3];
    double loss[3] = {0, 0, 0};
    for (int i = 0; i < 3; ++i) {
      UCP_ASSERT_OK_AND_ASSIGN(CudaModel gpu,
                               CudaModel::Create(c, B, T, m.gemm, m.attention, {}, modes[i]));
      EXPECT_EQ(gpu.recompute(), modes[i]);
      ASSERT_EQ(cudaMemset(k.d_g, 0, n * 4), cudaSuccess);
      UCP_ASSERT_OK_AND_ASSIGN(
          loss[i], gpu.ForwardBackward(k.d_w, k.d_g, batch, 1e-2f, nullptr,
                                       bf16 ? k.d_w16 : nullptr));
      g[i] = k.DeviceGrads();
    }
    for (int i = 1; i < 3; ++i) {
      EXPECT_EQ(loss[0], loss[i]) << "recomputing " << modes[i].layers << " layers";
      EXPECT_TRUE(g[0] == g[i]) << "recomputing " << modes[i].layers
                                << " layers: the gradients differ from the kept ones'";
    }
  }
  UCP_ASSERT_OK_AND_ASSIGN(int64_t kept, DeviceActivationBytes(c, B, T, true, true));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t two, DeviceActivationBytes(c, B, T, true, true, 1,
                                                              Recompute{2}));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t all, DeviceActivationBytes(c, B, T, true, true, 1,
                                                              Recompute::All()));
  EXPECT_LT(two, kept);
  EXPECT_LT(all, two);
  EXPECT_EQ(CudaModel::Create(c, B, T, GemmInputs::kFp32, AttentionKernel::kGemm, {},
                              Recompute{-1})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

// P ranks as threads of this process: what Ulysses asks of its communicator (the batch's
// agreement, an int64 all-reduce; the staged exchanges, an all-to-all), over shared memory. The
// GPU test runs on one GPU, where NCCL cannot take two ranks and no mpirun is at hand.
class ThreadRanks final : public RankOnlyCommunicator {
 public:
  struct Shared {
    explicit Shared(int p) : P(p), bar(p), ptr(static_cast<size_t>(p)) {}
    int P;
    std::barrier<> bar;
    std::vector<const void*> ptr;
  };
  ThreadRanks(Shared* s, int r) : RankOnlyCommunicator(r, s->P), s_(s) {}
  using RankOnlyCommunicator::AllReduce;
  Status AllReduce(std::span<int64_t> data, ReduceOp op) override {
    s_->ptr[static_cast<size_t>(rank())] = data.data();
    s_->bar.arrive_and_wait();
    std::vector<int64_t> out(data.begin(), data.end());
    for (int j = 0; j < s_->P; ++j) {
      const auto* v = static_cast<const int64_t*>(s_->ptr[static_cast<size_t>(j)]);
      for (size_t i = 0; i < out.size(); ++i) {
        if (j == 0) out[i] = v[i];
        else out[i] = op == ReduceOp::kMax ? std::max(out[i], v[i]) : out[i] + v[i];
      }
    }
    s_->bar.arrive_and_wait();  // every rank has read every rank's values
    std::copy(out.begin(), out.end(), data.begin());
    return Status::Ok();
  }
  Status AllToAll(std::span<const float> in, std::span<float> out) override {
    s_->ptr[static_cast<size_t>(rank())] = in.data();
    s_->bar.arrive_and_wait();
    const size_t n = in.size() / static_cast<size_t>(s_->P);
    for (int j = 0; j < s_->P; ++j) {
      std::memcpy(out.data() + static_cast<size_t>(j) * n,
                  static_cast<const float*>(s_->ptr[static_cast<size_t>(j)]) +
                      static_cast<size_t>(rank()) * n,
                  n * 4);
    }
    s_->bar.arrive_and_wait();
    return Status::Ok();
  }

 private:
  Shared* s_;
};

// Each rank's result of one ForwardBackward on its shard.
struct ShardRun {
  Status status;
  double loss = 0;
  std::vector<float> grads;
};

// P ranks (threads), each a CudaModel over the sp group with its shard of batch (B x T), the
// weights d_w (and d_w16 for bf16 GEMMs) shared, its own gradients. `bad_rank` >= 0: that rank
// passes a token outside the vocabulary.
std::vector<ShardRun> RunShards(const ModelConfig& c, int P, int64_t B, int64_t T,
                                const Inputs& x, const float* d_w, const uint16_t* d_w16,
                                GemmInputs gemm, AttentionKernel attention, int bad_rank = -1) {
  ThreadRanks::Shared shared(P);
  std::vector<ShardRun> runs(static_cast<size_t>(P));
  const int64_t Tl = T / P;
  const size_t n = x.w.size();
  auto rank = [&](int r) {
    ShardRun& out = runs[static_cast<size_t>(r)];
    ThreadRanks comm(&shared, r);
    Result<CudaModel> m =
        CudaModel::Create(c, B, T, gemm, attention, SequenceParallel{&comm, {}, {}});
    if (!m.ok()) {
      out.status = m.status();
      return;
    }
    std::vector<int32_t> in, tg;
    for (int64_t b = 0; b < B; ++b) {
      const auto at = static_cast<size_t>(b * T + r * Tl);
      in.insert(in.end(), x.in.begin() + at, x.in.begin() + at + Tl);
      tg.insert(tg.end(), x.tg.begin() + at, x.tg.begin() + at + Tl);
    }
    if (r == bad_rank) in[1] = static_cast<int32_t>(c.vocab);
    float* d_g = nullptr;
    if (cudaMalloc(&d_g, n * 4) != cudaSuccess || cudaMemset(d_g, 0, n * 4) != cudaSuccess) {
      out.status = DeviceError("test gradients");
      return;
    }
    Result<double> l = m->ForwardBackward(d_w, d_g, Batch{in, tg, B, Tl, r * Tl}, 1e-2f,
                                          nullptr, d_w16);
    out.status = l.status();
    out.loss = l.value_or(0.0);
    out.grads.resize(n);
    if (cudaMemcpy(out.grads.data(), d_g, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
      out.status = DeviceError("test gradients back");
    }
    cudaFree(d_g);
  };
  std::vector<std::thread> ts;
  for (int r = 0; r < P; ++r) ts.emplace_back(rank, r);
  for (std::thread& t : ts) t.join();
  return runs;
}

// The shards' sums, in rank order: the whole sequence's loss and gradients.
void SumShards(const std::vector<ShardRun>& runs, double& loss, std::vector<float>& g) {
  loss = 0;
  g.assign(runs[0].grads.size(), 0.0f);
  for (const ShardRun& s : runs) {
    loss += s.loss;
    for (size_t i = 0; i < g.size(); ++i) g[i] += s.grads[i];
  }
}

// Ulysses on the GPU (SequenceParallel, exchanges staged through the host): P = 2 ranks each
// run their half of every sequence; the shards' losses and gradients, summed, are the CPU
// model's on the whole sequences within the bounds above: fp32 GEMMs (1e-5, 1e-4), the bf16
// GEMMs with the GEMM attention, and the flash kernels, whose backward reads the output brought
// back by heads, on one KV head replicated on both ranks (LLaMA) or split (GPT). Then a batch
// one rank refuses is refused on every rank, none left waiting in an exchange.
TEST_P(CudaModelTest, SequenceParallelShardsSumToTheWholeSequence) {
  const int P = 2;
  {
    SCOPED_TRACE("fp32 GEMMs");
    const ModelConfig c = Config(GetParam());
    const int64_t B = 3, T = 36;
    UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
    const Inputs x = MakeInputs(cpu, c, B * T, 21);
    const size_t n = x.w.size();
    std::vector<float> g_cpu(n, 0.0f);
    UCP_ASSERT_OK_AND_ASSIGN(double loss_cpu,
                             cpu.ForwardBackward(x.w, g_cpu, Batch{x.in, x.tg, B, T, 0}, 1e-2f));
    float* d_w = nullptr;
    ASSERT_EQ(cudaMalloc(&d_w, n * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_w, x.w.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    const auto runs =
        RunShards(c, P, B, T, x, d_w, nullptr, GemmInputs::kFp32, AttentionKernel::kGemm);
    for (const ShardRun& s : runs) UCP_ASSERT_OK(s.status);
    double loss = 0;
    std::vector<float> g;
    SumShards(runs, loss, g);
    EXPECT_NEAR(loss, loss_cpu, 1e-5 * std::abs(loss_cpu));
    ExpectWithinFp32(cpu, g_cpu, g);
    // Rank 1 refuses its batch: both ranks return the refusal.
    const auto bad =
        RunShards(c, P, B, T, x, d_w, nullptr, GemmInputs::kFp32, AttentionKernel::kGemm, 1);
    EXPECT_THAT(bad[0].status, ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                                       ::testing::HasSubstr("another rank")));
    EXPECT_THAT(bad[1].status, ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                                       ::testing::HasSubstr("vocabulary")));
    cudaFree(d_w);
  }
  for (const AttentionKernel attention : {AttentionKernel::kGemm, AttentionKernel::kFlash}) {
    const bool flash = attention == AttentionKernel::kFlash;
    SCOPED_TRACE(flash ? "bf16 GEMMs, flash attention" : "bf16 GEMMs, GEMM attention");
    ModelConfig c = Config(GetParam());
    int64_t B = 3, T = 36;
    if (flash) {
      c.hidden = 128, c.heads = 2, c.head_dim = 64, c.max_positions = 128;
      c.kv_heads = GetParam() == Family::kGpt ? 2 : 1;
      B = 2, T = 100;
    }
    UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
    Bf16Case k(cpu, c, B, T, 22);
    const auto runs =
        RunShards(c, P, B, T, k.x, k.d_w, k.d_w16, GemmInputs::kBf16, attention);
    for (const ShardRun& s : runs) UCP_ASSERT_OK(s.status);
    double loss = 0;
    std::vector<float> g;
    SumShards(runs, loss, g);
    std::printf("loss: cpu %.9g, cuda over %d ranks %.9g\n", k.loss_cpu, P, loss);
    ExpectWithinBf16(cpu, k, loss, g);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModelTest, ::testing::Values(Family::kGpt, Family::kLlama));

TEST(CudaModelArgs, RefusedWithoutADeviceOrWithBadSizes) {
  // The flash kernels: only beside the bf16 GEMMs, and only for heads of 64, 80, 96 or 128 (checked
  // before any device is touched).
  ModelConfig f = Config(Family::kLlama);
  EXPECT_THAT(CudaModel::Create(f, 1, 8, GemmInputs::kBf16, AttentionKernel::kFlash).status(),
              ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                       ::testing::HasSubstr("head_dim 64, 80, 96 or 128, not 16")));
  f.hidden = 128, f.heads = 2, f.kv_heads = 1, f.head_dim = 64;
  EXPECT_THAT(CudaModel::Create(f, 1, 8, GemmInputs::kFp32, AttentionKernel::kFlash).status(),
              ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                       ::testing::HasSubstr("bf16 GEMMs")));
  if (DeviceCount() == 0) {
    EXPECT_EQ(CudaModel::Create(Config(Family::kGpt), 1, 8).status().code(),
              StatusCode::kDeviceError);
    return;
  }
  EXPECT_EQ(CudaModel::Create(Config(Family::kGpt), 1, 65).status().code(),
            StatusCode::kInvalidArgument);  // beyond GPT's position table
}

}  // namespace
}  // namespace ucp::offload::cuda
