// Timing program (not a test): forward+backward of a model preset on B x T tokens, and
// cblas_sgemm alone on the model's largest GEMM shape, on `threads` threads.
//   offload_model_bench <patterns_dir> <preset> <B> <T> <threads> [steps]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "offload/model/model.h"

namespace {
double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s patterns_dir preset B T threads [steps]\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoll(argv[3]), T = std::atoll(argv[4]);
  const int threads = std::atoi(argv[5]);
  const int steps = argc > 6 ? std::atoi(argv[6]) : 3;
  auto spec = ucp::patterns::LoadModel(argv[1], argv[2]);
  if (!spec.ok()) return std::fprintf(stderr, "%s\n", spec.status().ToString().c_str()), 1;
  auto cfg = ucp::offload::ModelConfig::FromSpec(*spec);
  if (!cfg.ok()) return std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str()), 1;
  auto model = ucp::offload::Model::Create(*cfg, B, T, threads);
  if (!model.ok()) return std::fprintf(stderr, "%s\n", model.status().ToString().c_str()), 1;
  const int64_t P = model->num_params();
  std::vector<float> w(P), g(P, 0.0f);
  std::mt19937 rng(1);
  // Uniform in +-0.035 (std 0.02) from a cheap LCG: 124M normal draws would dominate the run.
  uint32_t state = 12345;
  for (auto& x : w) {
    state = state * 1664525u + 1013904223u;
    x = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 0.07f;
  }
  for (const auto& p : model->params()) {
    if (p.name.find("layernorm.weight") != std::string::npos) {
      for (int64_t i = 0; i < p.numel; ++i) w[p.offset + i] = 1.0f;
    }
  }
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    in[i] = static_cast<int32_t>(rng() % cfg->vocab);
    tg[i] = static_cast<int32_t>(rng() % cfg->vocab);
  }
  ucp::offload::Batch batch{in, tg, B, T};
  const auto& c = *cfg;
  // FLOPs: 6 * (matmul params touched per token) * tokens + attention (causal half).
  const double N = static_cast<double>(B * T);
  const double qkv = (c.heads + 2 * c.kv_heads) * c.head_dim, ah = c.heads * c.head_dim;
  const double f1 = c.family == ucp::offload::Family::kGpt ? c.ffn_hidden : 2 * c.ffn_hidden;
  const double per_layer = c.hidden * (qkv + f1) + (ah + c.ffn_hidden) * c.hidden;
  const double mm = c.layers * per_layer + static_cast<double>(c.vocab) * c.hidden;
  const double attn = c.layers * 2.0 * B * c.heads * T * (T + 1) / 2.0 * c.head_dim * 2;
  const double flops = 6 * mm * N + 3 * attn;
  double best = 1e30;
  for (int s = 0; s < steps + 1; ++s) {
    const double t0 = Now();
    auto loss = model->ForwardBackward(w, g, batch, 1.0f / (B * T));
    const double t1 = Now();
    if (!loss.ok()) return std::fprintf(stderr, "%s\n", loss.status().ToString().c_str()), 1;
    std::printf("step %d: loss/token %.4f  fwd+bwd %.3f s  %.1f GFLOP/s\n", s, *loss / (B * T),
                t1 - t0, flops / (t1 - t0) * 1e-9);
    if (s > 0) best = std::min(best, t1 - t0);
  }
  if (steps > 0) {
    std::printf("best fwd+bwd %.3f s  %.1f GFLOP/s  %.0f tokens/s\n", best, flops / best * 1e-9,
                N / best);
  }
  {
    const double t0 = Now();
    auto loss = model->Forward(w, batch);
    std::printf("forward only: %.3f s (loss ok %d)\n", Now() - t0, loss.ok());
  }
  // sgemm alone on the step's shapes: forward (NT), input gradient (NN), weight gradient (TN).
  openblas_set_num_threads(threads);
  struct Shape {
    const char* what;
    CBLAS_TRANSPOSE ta, tb;
    int64_t m, n, k;
  };
  const int64_t M = B * T, H = c.hidden, F = static_cast<int64_t>(f1);
  const int64_t Q = static_cast<int64_t>(qkv), R = std::min<int64_t>(M, 256);
  const Shape shapes[] = {
      {"fwd  x W^T  [N,F,H]", CblasNoTrans, CblasTrans, M, F, H},
      {"dinp dy W   [N,H,F]", CblasNoTrans, CblasNoTrans, M, H, F},
      {"dW   dy^T x [F,H,N]", CblasTrans, CblasNoTrans, F, H, M},
      {"fwd  qkv    [N,Q,H]", CblasNoTrans, CblasTrans, M, Q, H},
      {"logits      [R,V,H]", CblasNoTrans, CblasTrans, R, c.vocab, H},
      {"dx classif. [R,H,V]", CblasNoTrans, CblasNoTrans, R, H, c.vocab},
      {"dW classif. [V,H,R]", CblasTrans, CblasNoTrans, c.vocab, H, R},
  };
  for (const Shape& sh : shapes) {
    const int64_t lda = sh.ta == CblasNoTrans ? sh.k : sh.m;
    const int64_t ldb = sh.tb == CblasNoTrans ? sh.n : sh.k;
    std::vector<float> a(sh.m * sh.k, 0.01f), bm(sh.n * sh.k, 0.02f), cm(sh.m * sh.n);
    auto run = [&] {
      cblas_sgemm(CblasRowMajor, sh.ta, sh.tb, sh.m, sh.n, sh.k, 1.0f, a.data(), lda, bm.data(),
                  ldb, 1.0f, cm.data(), sh.n);
    };
    run();
    const int reps = 3;
    const double t0 = Now();
    for (int r = 0; r < reps; ++r) run();
    const double dt = (Now() - t0) / reps;
    std::printf("sgemm %s %ldx%ldx%ld: %.1f GFLOP/s\n", sh.what, static_cast<long>(sh.m),
                static_cast<long>(sh.n), static_cast<long>(sh.k),
                2.0 * sh.m * sh.n * sh.k / dt * 1e-9);
  }
  std::printf("openblas: %s\n", openblas_get_config());
  return 0;
}
