// The model's sequence-parallel surface in one process: a size-1 communicator is no sequence
// parallelism (bitwise), the head / sequence rules of ValidateSequenceParallel, and
// Batch::position_offset (GPT's position-embedding rows, LLaMA's RoPE against the double oracle,
// refused positions). The all-to-all path itself runs under mpirun: model_sp_mpi_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/model/model.h"
#include "offload/model/model_ref.h"
#include "offload/model/model_sp_test_util.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload {
namespace {

using sp_testing::InitWeights;
using sp_testing::MakeTokens;
using sp_testing::Tiny;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

const ParamInfo& Param(const Model& m, const std::string& name) {
  for (const ParamInfo& p : m.params()) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "no parameter " << name;
  return m.params().front();
}

TEST(ModelSp, SizeOneCommunicatorIsNoSequenceParallelism) {
  for (Family family : {Family::kGpt, Family::kLlama}) {
    SCOPED_TRACE(family == Family::kGpt ? "gpt" : "llama");
    const ModelConfig c = Tiny(family, 4, 2, false);
    std::unique_ptr<Communicator> self = SelfCommunicator();
    UCP_ASSERT_OK_AND_ASSIGN(Model plain, Model::Create(c, 2, 16, 2));
    UCP_ASSERT_OK_AND_ASSIGN(Model with_self, Model::Create(c, 2, 16, 2, self.get()));
    EXPECT_EQ(plain.sp_size(), 1);
    EXPECT_EQ(with_self.sp_size(), 1);
    EXPECT_EQ(with_self.sp_rank(), 0);
    const std::vector<float> w = InitWeights(plain.params(), plain.num_params(), 1);
    const sp_testing::Tokens t = MakeTokens(c, 2, 6, 2);
    for (int64_t offset : {0, 3, 10}) {
      std::vector<float> g1(w.size(), 0.0f), g2(w.size(), 0.0f);
      UCP_ASSERT_OK_AND_ASSIGN(double l1, plain.ForwardBackward(w, g1, t.Whole(offset), 0.5f));
      UCP_ASSERT_OK_AND_ASSIGN(double l2, with_self.ForwardBackward(w, g2, t.Whole(offset), 0.5f));
      EXPECT_EQ(l1, l2) << "offset " << offset;
      EXPECT_EQ(g1, g2) << "offset " << offset;  // bitwise
    }
  }
}

TEST(ModelSp, ValidateSequenceParallelFollowsDeepSpeedsHeadRules) {
  struct Ok {
    int64_t heads, kv, sp, seq;
  };
  // kv % sp == 0 (split), sp % kv == 0 (replicated), MQA, sp == heads, sp == 1 whatever the heads.
  for (const Ok& o : {Ok{8, 4, 2, 8}, Ok{8, 4, 4, 8}, Ok{8, 2, 4, 8}, Ok{8, 1, 4, 8},
                      Ok{8, 4, 8, 16}, Ok{6, 3, 1, 7}, Ok{12, 12, 4, 4}}) {
    const ModelConfig c = Tiny(Family::kLlama, o.heads, o.kv, false);
    UCP_EXPECT_OK(ValidateSequenceParallel(c, o.sp, o.seq))
        << o.heads << "/" << o.kv << " sp " << o.sp << " seq " << o.seq;
  }
  auto refused = [](int64_t heads, int64_t kv, int64_t sp, int64_t seq) {
    return ValidateSequenceParallel(Tiny(Family::kLlama, heads, kv, false), sp, seq);
  };
  EXPECT_THAT(refused(6, 3, 4, 8),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("heads=6 not divisible by sp")));
  EXPECT_THAT(refused(12, 3, 4, 8), StatusIs(StatusCode::kInvalidArgument,
                                             HasSubstr("kv_heads=3 neither divisible by sp")));
  EXPECT_THAT(refused(8, 4, 2, 7),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("seq_len=7 tokens")));
  EXPECT_THAT(refused(8, 4, 0, 8), StatusIs(StatusCode::kInvalidArgument, HasSubstr("sp=0")));
  EXPECT_THAT(refused(8, 4, 4, 6), StatusIs(StatusCode::kInvalidArgument, HasSubstr("sp=4")));
}

// Token t of a batch at position_offset p reads wpe row p + t and writes its gradient there: the
// same as position 0 with those rows moved to the top, bit for bit.
TEST(ModelSp, GptPositionOffsetShiftsThePositionEmbeddingRows) {
  const ModelConfig c = Tiny(Family::kGpt, 4, 4, true);
  UCP_ASSERT_OK_AND_ASSIGN(Model model, Model::Create(c, 2, 16, 2));
  const ParamInfo& wpe = Param(model, "embedding.position_embeddings.weight");
  const std::vector<float> w = InitWeights(model.params(), model.num_params(), 3);
  const sp_testing::Tokens t = MakeTokens(c, 2, 5, 4);
  const int64_t offset = 7, C = c.hidden, rows = t.T * C;
  std::vector<float> shifted = w;
  std::copy_n(w.begin() + wpe.offset + offset * C, rows, shifted.begin() + wpe.offset);
  std::vector<float> g_off(w.size(), 0.0f), g_top(w.size(), 0.0f);
  UCP_ASSERT_OK_AND_ASSIGN(double l_off, model.ForwardBackward(w, g_off, t.Whole(offset), 1.0f));
  UCP_ASSERT_OK_AND_ASSIGN(double l_top, model.ForwardBackward(shifted, g_top, t.Whole(0), 1.0f));
  EXPECT_EQ(l_off, l_top);
  for (int64_t i = 0; i < model.num_params(); ++i) {
    const int64_t k = i - wpe.offset;
    if (k < 0 || k >= wpe.numel) {
      ASSERT_EQ(g_off[i], g_top[i]) << "element " << i;
    } else if (k >= offset * C && k < offset * C + rows) {
      ASSERT_EQ(g_off[i], g_top[i - offset * C]) << "wpe element " << k;
      ASSERT_NE(g_off[i], 0.0f) << "wpe element " << k;
    } else {
      ASSERT_EQ(g_off[i], 0.0f) << "wpe element " << k;  // rows the batch does not reach
    }
  }
  EXPECT_EQ(*model.Forward(w, t.Whole(offset)), l_off);
}

// LLaMA at position_offset p against the double oracle at p, and against position 0: RoPE scores
// depend only on position differences, so a whole sequence gives the same loss up to the rounding
// of other angles. (That absolute positions are right is what the sharded runs of
// model_sp_mpi_test check: there the shards' keys meet other shards' queries.)
TEST(ModelSp, LlamaPositionOffsetRotatesByAbsolutePosition) {
  const ModelConfig c = Tiny(Family::kLlama, 8, 2, false);
  UCP_ASSERT_OK_AND_ASSIGN(Model model, Model::Create(c, 2, 16, 2));
  const std::vector<float> w = InitWeights(model.params(), model.num_params(), 5);
  const std::vector<double> wd(w.begin(), w.end());
  const sp_testing::Tokens t = MakeTokens(c, 2, 6, 6);
  const int64_t offset = 9;
  std::vector<float> g(w.size(), 0.0f);
  UCP_ASSERT_OK_AND_ASSIGN(double loss, model.ForwardBackward(w, g, t.Whole(offset), 1.0f));
  std::vector<double> gd(w.size(), 0.0);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_ref, RefForwardBackward(c, wd, gd, t.Whole(offset), 1.0));
  EXPECT_NEAR(loss, loss_ref, 1e-5 * std::abs(loss_ref));
  for (const ParamInfo& p : model.params()) {
    double gmax = 0, err = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      gmax = std::max(gmax, std::abs(gd[i]));
      err = std::max(err, std::abs(gd[i] - g[i]));
    }
    EXPECT_LE(err, 1e-4 * std::max(gmax, 1e-2)) << p.name;
  }
  UCP_ASSERT_OK_AND_ASSIGN(double loss0, model.Forward(w, t.Whole(0)));
  EXPECT_NEAR(loss0, loss, 1e-5 * std::abs(loss));
}

TEST(ModelSp, RefusesPositionsPastMaxSeqLen) {
  for (Family family : {Family::kGpt, Family::kLlama}) {
    const ModelConfig c = Tiny(family, 4, 2, true);
    UCP_ASSERT_OK_AND_ASSIGN(Model model, Model::Create(c, 2, 8, 1));
    const std::vector<float> w(model.num_params(), 0.01f);
    const sp_testing::Tokens t = MakeTokens(c, 2, 5, 7);
    UCP_EXPECT_OK(model.Forward(w, t.Whole(3)).status());
    EXPECT_THAT(model.Forward(w, t.Whole(4)).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("position_offset=4 with seq_len=5 reaches past max_seq_len=8")));
    EXPECT_THAT(model.Forward(w, t.Whole(-1)).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("position_offset=-1")));
  }
  // The oracle has no max_seq_len, but GPT's position embedding has max_positions rows.
  const ModelConfig c = Tiny(Family::kGpt, 4, 4, true);
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<ParamInfo> params, ModelParams(c));
  const std::vector<double> w(static_cast<size_t>(params.back().offset + params.back().numel),
                              0.01);
  const sp_testing::Tokens t = MakeTokens(c, 1, 5, 8);
  EXPECT_THAT(RefForwardBackward(c, w, {}, t.Whole(28), 1.0).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("max_positions=32")));
  UCP_EXPECT_OK(RefForwardBackward(c, w, {}, t.Whole(27), 1.0).status());
}

}  // namespace
}  // namespace ucp::offload
