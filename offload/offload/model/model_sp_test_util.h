// Helpers of the sequence-parallel model tests (model_sp_test.cc, one process;
// model_sp_mpi_test.cc, under mpirun): tiny configurations, weights and token batches.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "offload/model/model.h"

namespace ucp::offload::sp_testing {

/// A model small enough for 4 processes on 2 cores: `heads` query heads of 4 values, `kv_heads`
/// KV heads (GPT: kv_heads == heads), 2 layers, 29-token vocabulary padded to 32.
inline ModelConfig Tiny(Family family, int64_t heads, int64_t kv_heads, bool tied) {
  ModelConfig c;
  c.family = family;
  c.vocab = 29;
  c.padded_vocab = 32;
  c.hidden = 16;
  c.layers = 2;
  c.heads = heads;
  c.kv_heads = family == Family::kGpt ? heads : kv_heads;
  c.head_dim = 4;
  c.ffn_hidden = 20;
  c.max_positions = 32;
  c.tied_embeddings = tied;
  return c;
}

/// Weights like an initialised model (norm weights near 1), deterministic.
inline std::vector<float> InitWeights(const std::vector<ParamInfo>& params, int64_t total,
                                      uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 0.3);
  std::vector<float> w(static_cast<size_t>(total));
  for (const ParamInfo& p : params) {
    const bool norm_w = p.name.find("layernorm.weight") != std::string::npos;
    for (int64_t i = 0; i < p.numel; ++i) {
      w[p.offset + i] = static_cast<float>((norm_w ? 1.0 : 0.0) + nd(rng));
    }
  }
  return w;
}

/// B sequences of T tokens, every fifth target masked.
struct Tokens {
  std::vector<int32_t> in, tg;
  int64_t B = 0, T = 0;

  /// The whole sequences, at positions [offset, offset + T).
  Batch Whole(int64_t offset = 0) const { return Batch{in, tg, B, T, offset}; }
};
inline Tokens MakeTokens(const ModelConfig& c, int64_t B, int64_t T, uint64_t seed) {
  Tokens t;
  t.B = B;
  t.T = T;
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < B * T; ++i) {
    t.in.push_back(static_cast<int32_t>(rng() % c.vocab));
    t.tg.push_back(i % 5 == 2 ? -1 : static_cast<int32_t>(rng() % c.vocab));
  }
  return t;
}

/// Shard `rank` of `size` of every sequence: positions [rank T/size, (rank+1) T/size), copied
/// into `in` / `tg` ([B, T/size]).
inline void Shard(const Tokens& t, int size, int rank, std::vector<int32_t>& in,
                  std::vector<int32_t>& tg) {
  const int64_t Tl = t.T / size;
  in.clear();
  tg.clear();
  for (int64_t b = 0; b < t.B; ++b) {
    for (int64_t i = 0; i < Tl; ++i) {
      in.push_back(t.in[b * t.T + rank * Tl + i]);
      tg.push_back(t.tg[b * t.T + rank * Tl + i]);
    }
  }
}

}  // namespace ucp::offload::sp_testing
