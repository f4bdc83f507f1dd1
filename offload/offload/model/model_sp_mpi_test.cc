// Ulysses sequence parallelism of the models, run by tests/engine/sp/model_sp_mpi_test.sh under
// mpirun -np 2 and -np 4. For GPT and LLaMA (GQA 8 heads / 4 and 2 KV heads, and 1 KV head, so
// that sp = 2 and 4 split the KV heads, replicate them, or both), every rank computes the loss
// and gradients of whole sequences alone (sp = 1), then the sp ranks of its group compute them
// from their shards with the all-to-alls; the shards' losses and gradients summed over the group
// must match the whole-sequence ones up to the order of the adds. sp = world size, and sp = 2 at
// -np 4 (two dp groups of 2 ranks, with different samples). Also: shards at a position_offset
// base other than 0, determinism, recomputed layers (Recompute::All(): the same bits), and
// refusals (head / sequence rules at Create; a batch refused on one rank is refused on every
// rank, with no rank left in a collective).
//
// All ranks run the same tests in the same order; checks that could differ between ranks use
// EXPECT, so no rank leaves a test early and strands the others in a collective.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/model/model.h"
#include "offload/model/model_sp_test_util.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/base/check.h"

namespace ucp::offload {
namespace {

using sp_testing::InitWeights;
using sp_testing::MakeTokens;
using sp_testing::Shard;
using sp_testing::Tiny;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// The tolerance: only the order of the adds differs (attention's key sums split over shards,
// weight gradients summed shard by shard, replicated KV gradients added across ranks), so the
// loss sum and every gradient tensor agree to a few fp32 ulps of their largest value.
constexpr double kLossTol = 2e-6;  // relative to |loss|
constexpr double kGradTol = 4e-6;  // relative to the tensor's max |g|

// The largest differences seen by this process, reported by main().
double g_worst_loss = 0, g_worst_grad = 0;

Communicator& World() {
  static std::unique_ptr<Communicator> world = [] {
    auto c = WorldCommunicator();
    UCP_CHECK(c.ok()) << c.status();
    return std::move(c).value();
  }();
  return *world;
}

// The sp group of `sp` ranks this process belongs to (consecutive world ranks), and its index.
// Collective over the world.
struct Group {
  std::unique_ptr<Communicator> comm;
  int index = 0;
};
Group SpGroup(int sp) {
  Group g;
  g.index = World().rank() / sp;
  auto c = World().Split(g.index, World().rank());
  UCP_CHECK(c.ok()) << c.status();
  g.comm = std::move(c).value();
  return g;
}

struct SpCase {
  const char* name;
  Family family;
  int64_t heads, kv_heads;
  bool tied;
  int threads;
};
const SpCase kCases[] = {
    {"Gpt", Family::kGpt, 4, 4, true, 1},         {"GptUntied", Family::kGpt, 8, 8, false, 2},
    {"LlamaKv4", Family::kLlama, 8, 4, false, 1},  // sp 2, 4: KV split
    {"LlamaKv2", Family::kLlama, 8, 2, false, 2},  // sp 2: split; sp 4: replicated twice
    {"LlamaKv1", Family::kLlama, 8, 1, true, 1},   // sp 2, 4: one KV head on every rank
};

// Loss and gradients (in double, summed over the group) of B sequences of T tokens at positions
// [base, base + T): whole on this rank, and sharded over `group`.
struct Outcome {
  double loss = 0;
  std::vector<double> grads;
};

void Compare(const Model& model, const Outcome& whole, const Outcome& sharded) {
  const double dl = std::abs(sharded.loss - whole.loss) / std::abs(whole.loss);
  g_worst_loss = std::max(g_worst_loss, dl);
  EXPECT_LE(dl, kLossTol) << "loss " << sharded.loss << " vs " << whole.loss;
  for (const ParamInfo& p : model.params()) {
    double gmax = 0, err = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      gmax = std::max(gmax, std::abs(whole.grads[i]));
      err = std::max(err, std::abs(whole.grads[i] - sharded.grads[i]));
    }
    if (gmax == 0) {
      EXPECT_EQ(err, 0) << p.name;
      continue;
    }
    g_worst_grad = std::max(g_worst_grad, err / gmax);
    EXPECT_LE(err, kGradTol * gmax) << p.name << ": max |g| " << gmax;
  }
}

// Runs the case on whole sequences (this rank alone) and on shards over `g`, and compares.
void RunCase(const SpCase& sc, Group& g, int64_t base) {
  const int P = g.comm->size(), r = g.comm->rank();
  const ModelConfig c = Tiny(sc.family, sc.heads, sc.kv_heads, sc.tied);
  const int64_t B = 2, T = 12, Tl = T / P;
  const float scale = 0.3f;
  // max_seq_len covers the positions and divides by P (2 T: base <= T).
  auto whole_model = Model::Create(c, B, base + T, sc.threads);
  auto sp_model = Model::Create(c, B, 2 * T, sc.threads, g.comm.get());
  UCP_CHECK(whole_model.ok() && sp_model.ok())
      << whole_model.status() << " / " << sp_model.status();  // the same on every rank
  EXPECT_EQ(sp_model->sp_size(), P);
  EXPECT_EQ(sp_model->sp_rank(), r);
  const std::vector<float> w = InitWeights(whole_model->params(), whole_model->num_params(), 100);
  const sp_testing::Tokens t = MakeTokens(c, B, T, 200 + g.index);

  Outcome whole, sharded;
  std::vector<float> gw(w.size(), 0.0f);
  auto lw = whole_model->ForwardBackward(w, gw, t.Whole(base), scale);
  UCP_CHECK(lw.ok()) << lw.status();
  whole.loss = *lw;
  whole.grads.assign(gw.begin(), gw.end());

  std::vector<int32_t> in, tg;
  Shard(t, P, r, in, tg);
  const Batch shard{in, tg, B, Tl, base + r * Tl};
  std::vector<float> gs(w.size(), 0.0f);
  auto ls = sp_model->ForwardBackward(w, gs, shard, scale);
  UCP_CHECK(ls.ok()) << ls.status();
  // The forward alone gives the same loss; a second call the same bits.
  auto lf = sp_model->Forward(w, shard);
  UCP_CHECK(lf.ok()) << lf.status();
  EXPECT_EQ(*lf, *ls);
  std::vector<float> gs2(w.size(), 0.0f);
  auto ls2 = sp_model->ForwardBackward(w, gs2, shard, scale);
  UCP_CHECK(ls2.ok()) << ls2.status();
  EXPECT_EQ(*ls2, *ls);
  EXPECT_EQ(gs2, gs);  // bitwise
  // Recomputing the layers in backward reruns the exchanges too (every rank alike): the same
  // bits as keeping the activations.
  auto rc_model = Model::Create(c, B, 2 * T, sc.threads, g.comm.get(), Recompute::All());
  UCP_CHECK(rc_model.ok()) << rc_model.status();
  std::vector<float> gr(w.size(), 0.0f);
  auto lr = rc_model->ForwardBackward(w, gr, shard, scale);
  UCP_CHECK(lr.ok()) << lr.status();
  EXPECT_EQ(*lr, *ls);
  EXPECT_EQ(gr, gs);  // bitwise

  std::vector<double> loss = {*ls};
  UCP_CHECK(g.comm->AllReduce(std::span<double>(loss), ReduceOp::kSum).ok());
  sharded.loss = loss[0];
  sharded.grads.assign(gs.begin(), gs.end());
  UCP_CHECK(g.comm->AllReduce(std::span<double>(sharded.grads), ReduceOp::kSum).ok());
  Compare(*whole_model, whole, sharded);
}

class ModelSpMpi : public ::testing::TestWithParam<std::tuple<SpCase, int>> {};

TEST_P(ModelSpMpi, ShardsSumToTheWholeSequence) {
  const auto& [sc, sp] = GetParam();
  if (World().size() % sp != 0) GTEST_SKIP() << "sp=" << sp << " needs a multiple of it";
  Group g = SpGroup(sp);
  RunCase(sc, g, 0);
}

// Shards of positions [3, 3 + T): the ranks' offsets are 3 + r T/P; GPT reads wpe rows from 3,
// LLaMA rotates by the absolute positions, and attention stays causal over the shards.
TEST_P(ModelSpMpi, ShardsAtAPositionOffset) {
  const auto& [sc, sp] = GetParam();
  if (World().size() % sp != 0) GTEST_SKIP() << "sp=" << sp << " needs a multiple of it";
  Group g = SpGroup(sp);
  RunCase(sc, g, 3);
}

INSTANTIATE_TEST_SUITE_P(Cases, ModelSpMpi,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Values(2, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<SpCase, int>>& p) {
                           return std::string(std::get<0>(p.param).name) + "Sp" +
                                  std::to_string(std::get<1>(p.param));
                         });

TEST(ModelSpMpiRules, CreateRefusesHeadsAndSequencesThatDoNotSplit) {
  const int P = World().size();
  if (P == 1) GTEST_SKIP() << "needs 2 or more ranks";
  const std::string sp = "sp=" + std::to_string(P);
  // heads % P != 0.
  EXPECT_THAT(Model::Create(Tiny(Family::kLlama, P + 1, 1, false), 1, 8, 1, &World()).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr(sp + " ranks: heads=" + std::to_string(P + 1))));
  EXPECT_THAT(Model::Create(Tiny(Family::kGpt, P + 1, P + 1, true), 1, 8, 1, &World()).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("heads=")));
  // 3 KV heads neither split over nor replicated on P = 2 or 4 ranks.
  EXPECT_THAT(Model::Create(Tiny(Family::kLlama, 3 * P, 3, false), 1, 8, 1, &World()).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("kv_heads=3 neither")));
  // The sequence does not split into P shards.
  EXPECT_THAT(
      Model::Create(Tiny(Family::kLlama, 8, 2, false), 1, 4 * P + 1, 1, &World()).status(),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("seq_len=" + std::to_string(4 * P + 1))));
}

// A batch refused on one rank is refused on all of them, before any all-to-all, and the group
// still works afterwards.
TEST(ModelSpMpiRules, RefusalsAreAgreedByEveryRank) {
  Communicator& world = World();
  const int P = world.size(), r = world.rank();
  if (P == 1) GTEST_SKIP() << "needs 2 or more ranks";
  const ModelConfig c = Tiny(Family::kLlama, 8, 2, false);
  const int64_t B = 2, T = 4 * P, Tl = 4;
  auto model = Model::Create(c, B, T, 1, &world);
  UCP_CHECK(model.ok()) << model.status();
  const std::vector<float> w = InitWeights(model->params(), model->num_params(), 300);
  std::vector<float> grads(w.size(), 0.0f);
  const sp_testing::Tokens t = MakeTokens(c, B, T, 301);
  std::vector<int32_t> in, tg;
  Shard(t, P, r, in, tg);
  const Batch good{in, tg, B, Tl, r * Tl};
  UCP_ASSERT_OK_AND_ASSIGN(const double loss, model->Forward(w, good));

  // Every rank at offset 0: not consecutive shards.
  EXPECT_THAT(model->Forward(w, Batch{in, tg, B, Tl, 0}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("are not consecutive")));
  // A bad token on rank 1: rank 1 says which, the others that a peer refused.
  std::vector<int32_t> bad_in = in;
  if (r == 1) bad_in[1] = static_cast<int32_t>(c.vocab);
  EXPECT_THAT(model->ForwardBackward(w, grads, Batch{bad_in, tg, B, Tl, r * Tl}, 1.0f).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr(r == 1 ? "input token 29" : "another rank of the sequence")));
  // Rank 0 with a shorter shard.
  const int64_t tl0 = r == 0 ? Tl - 1 : Tl;
  const Batch uneven{std::span(in).first(B * tl0), std::span(tg).first(B * tl0), B, tl0, r * Tl};
  EXPECT_THAT(model->Forward(w, uneven).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("disagree on the shard")));
  // Rank 0 calls Forward, the others ForwardBackward.
  const Status mixed = r == 0 ? model->Forward(w, good).status()
                              : model->ForwardBackward(w, grads, good, 1.0f).status();
  EXPECT_THAT(mixed, StatusIs(StatusCode::kInvalidArgument, HasSubstr("call Forward and others")));
  // Past max_seq_len on the last rank only (base 1): refused everywhere.
  EXPECT_THAT(model->Forward(w, Batch{in, tg, B, Tl, 1 + r * Tl}).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr(r == P - 1 ? "position_offset" : "another rank of the")));
  for (float v : grads) ASSERT_EQ(v, 0.0f);  // nothing ran
  UCP_ASSERT_OK_AND_ASSIGN(const double again, model->Forward(w, good));
  EXPECT_EQ(again, loss);
}

}  // namespace
}  // namespace ucp::offload

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  auto& world = ucp::offload::World();
  // Every rank's verdict, so mpirun's exit code fails when any rank failed.
  std::vector<int64_t> failed = {rc != 0};
  std::vector<double> worst = {ucp::offload::g_worst_loss, ucp::offload::g_worst_grad};
  if (!world.AllReduce(std::span<int64_t>(failed), ucp::offload::ReduceOp::kMax).ok() ||
      !world.AllReduce(std::span<double>(worst), ucp::offload::ReduceOp::kMax).ok()) {
    return 1;
  }
  if (world.rank() == 0) {
    std::printf("np %d: largest relative difference sp vs whole: loss %.3g, gradients %.3g\n",
                world.size(), worst[0], worst[1]);
    std::printf("np %d: %s\n", world.size(), failed[0] ? "FAILED" : "all ranks passed");
  }
  return failed[0] ? 1 : 0;
}
