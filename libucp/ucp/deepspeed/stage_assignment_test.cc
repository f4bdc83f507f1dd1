// The stage split read from a DeepSpeed checkpoint's per-stage param_shapes: uneven splits as the
// files hold them, and each way the files can contradict a pipeline of contiguous stages.
#include "ucp/deepspeed/stage_assignment.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testutil/status_matchers.h"

namespace ucp::deepspeed {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

patterns::ResolvedModel GptTiny() {  // 4 layers
  const std::filesystem::path dir = std::filesystem::path(UCP_SOURCE_ROOT_DIR) / "patterns";
  patterns::ModelSpec spec = *patterns::LoadModel(dir, "gpt-tiny");
  patterns::RuleSet rules = *patterns::LoadRuleSet(dir, spec.family);
  return *patterns::Resolve(spec, rules);
}

// One checkpoint parameter per model parameter (ds_index the identity), layer L's parameters on
// stage stage_of_layer[L], the others where the rules put them.
struct Files {
  std::vector<DeepSpeedParam> params;
  std::vector<int> ds_index;
};
Files Place(const patterns::ResolvedModel& m, int pp, const std::vector<int>& stage_of_layer) {
  Files f;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const patterns::ResolvedParam& p = m.params[i];
    DeepSpeedParam d;
    d.name = p.name;
    d.engine_name = "engine." + p.name;
    switch (p.stage) {
      case patterns::StagePlacement::kLayer:
        d.stages = {stage_of_layer[static_cast<size_t>(p.layer)]};
        break;
      case patterns::StagePlacement::kFirst:
        d.stages = {0};
        break;
      case patterns::StagePlacement::kLast:
        d.stages = {pp - 1};
        break;
      case patterns::StagePlacement::kFirstAndLast:
        d.stages = {0, pp - 1};
        break;
    }
    f.params.push_back(d);
    f.ds_index.push_back(static_cast<int>(i));
  }
  return f;
}

TEST(StagesOfCheckpoint, ReadsUnevenAndEvenSplits) {
  const patterns::ResolvedModel m = GptTiny();
  Files f = Place(m, 3, {0, 0, 1, 2});
  UCP_ASSERT_OK_AND_ASSIGN(layout::StageAssignment a,
                           StagesOfCheckpoint(m, f.params, f.ds_index, 3, "ck"));
  EXPECT_EQ(layout::StageCounts(a), (std::vector<int64_t>{2, 1, 1}));
  f = Place(m, 2, {0, 1, 1, 1});
  UCP_ASSERT_OK_AND_ASSIGN(a, StagesOfCheckpoint(m, f.params, f.ds_index, 2, "ck"));
  EXPECT_EQ(layout::StageCounts(a), (std::vector<int64_t>{1, 3}));
  f = Place(m, 2, {0, 0, 1, 1});
  UCP_ASSERT_OK_AND_ASSIGN(a, StagesOfCheckpoint(m, f.params, f.ds_index, 2, "ck"));
  EXPECT_TRUE(layout::IsEvenSplit(layout::StageCounts(a)));
}

TEST(StagesOfCheckpoint, RefusesWhatNoPipelineWrites) {
  const patterns::ResolvedModel m = GptTiny();
  Files f = Place(m, 2, {0, 1, 0, 1});
  EXPECT_THAT(StagesOfCheckpoint(m, f.params, f.ds_index, 2, "ck/mp_rank_00"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("ck/mp_rank_00: parameter \"engine.layers.2.")));
  EXPECT_THAT(StagesOfCheckpoint(m, f.params, f.ds_index, 2, "ck"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("of layer 2 is on pipeline stage 0 after a layer on stage 1")));
  f = Place(m, 3, {0, 0, 2, 2});
  EXPECT_THAT(StagesOfCheckpoint(m, f.params, f.ds_index, 3, "ck"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("pipeline stage 1 of 3 holds no transformer layer "
                                 "(stages=2+0+2)")));
  // One parameter of layer 1 listed by another stage than the rest of its layer.
  f = Place(m, 2, {0, 0, 1, 1});
  for (DeepSpeedParam& p : f.params) {
    if (p.name == "layers.1.mlp.dense_4h_to_h.weight") p.stages = {1};
  }
  EXPECT_THAT(StagesOfCheckpoint(m, f.params, f.ds_index, 2, "ck"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("\"engine.layers.1.mlp.dense_4h_to_h.weight\" of layer 1 is on "
                                 "pipeline stage 1 but")));
  f = Place(m, 2, {0, 0, 1, 1});
  f.params[f.ds_index[5]].stages = {0, 1};
  EXPECT_THAT(StagesOfCheckpoint(m, f.params, f.ds_index, 2, "ck"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("listed by the param_shapes of 2 pipeline stages")));
}

}  // namespace
}  // namespace ucp::deepspeed
