// The DeepSpeed layout a checkpoint is written in: the engines' parameter orders, param groups,
// ZeRO partitions and fragments, file assignment, and the layouts and namings refused.
#include "ucp/deepspeed/deepspeed_target.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "tests/testutil/status_matchers.h"

namespace ucp::deepspeed {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

std::filesystem::path PatternDir() {
  return std::filesystem::path(UCP_SOURCE_ROOT_DIR) / "patterns";
}

patterns::ResolvedModel Model(const std::string& preset) {
  patterns::ModelSpec spec = *patterns::LoadModel(PatternDir(), preset);
  patterns::RuleSet rules = *patterns::LoadRuleSet(PatternDir(), spec.family);
  return *patterns::Resolve(spec, rules);
}

std::vector<std::string> EngineNames(const TargetRank& r) {
  std::vector<std::string> out;
  for (const TargetParam& p : r.params) out.push_back(p.engine_name);
  return out;
}

// The invariants of every rank: groups hold their parameters contiguously from offset 0 in
// flattening order; the partitions are DeepSpeed's (2 * dp * sp alignment, equal parts, padding
// at the end only); every parameter's fragments over the partitions tile it exactly once, in
// dp order; every parameter has the TP slice shape; records name rank parameters.
// A DeepSpeed-MoE expert group is partitioned over its expert data-parallel group (dp * sp / ep
// ranks) the same way.
void CheckInvariants(const patterns::ResolvedModel& model, const DeepSpeedTarget& t) {
  ASSERT_EQ(t.ranks.size(), static_cast<size_t>(t.layout.pp * t.layout.tp));
  for (const TargetRank& r : t.ranks) {
    SCOPED_TRACE("pp " + std::to_string(r.pp) + " tp " + std::to_string(r.tp));
    std::set<int32_t> seen;
    for (size_t g = 0; g < r.groups.size(); ++g) {
      const TargetGroup& group = r.groups[g];
      const int parts = t.layout.dp * t.layout.sp / (group.ep_rank >= 0 ? t.layout.ep : 1);
      ASSERT_EQ(group.partition.num_fragments, parts);
      ASSERT_FALSE(group.params.empty());
      int64_t offset = 0;
      for (int32_t i : group.params) {
        const TargetParam& p = r.params[static_cast<size_t>(i)];
        EXPECT_TRUE(seen.insert(i).second);
        EXPECT_EQ(p.group, static_cast<int>(g));
        EXPECT_EQ(p.offset, offset) << p.name;
        offset += p.numel;
        const patterns::ResolvedParam& mp = model.params[p.model_index];
        EXPECT_EQ(mp.name, p.name);
        EXPECT_EQ(p.local_shape, patterns::SliceParam(mp, t.layout.tp, r.tp, 1, 0)->local_shape);
        if (t.layout.grouping == ParamGrouping::kMegatron) {
          EXPECT_EQ(group.kind, mp.optimizer_group) << p.name;
        }
      }
      const layout::ZeroPartition& part = group.partition;
      EXPECT_EQ(part.total, offset);
      EXPECT_EQ(part.padded_total % (2 * parts), 0);
      EXPECT_LT(part.padded_total - part.total, 2 * parts);
      EXPECT_EQ(part.fragment_size * parts, part.padded_total);
      std::map<int32_t, int64_t> covered;
      for (int d = 0; d < parts; ++d) {
        int64_t last_end = -1;
        for (const TargetFragment& f : r.Fragments(static_cast<int>(g), d)) {
          const TargetParam& p = r.params[static_cast<size_t>(f.param)];
          EXPECT_GT(f.numel, 0);
          EXPECT_GE(f.start, 0);
          EXPECT_LE(f.start + f.numel, part.fragment_size);
          EXPECT_GT(f.start, last_end - 1);
          last_end = f.start + f.numel;
          // In dp order each fragment continues where the parameter's previous one ended.
          EXPECT_EQ(d * part.fragment_size + f.start, p.offset + covered[f.param]) << p.name;
          covered[f.param] += f.numel;
        }
        EXPECT_EQ(r.GroupPadding(static_cast<int>(g), d),
                  d == parts - 1 ? part.padded_total - part.total : 0);
      }
      for (int32_t i : group.params) {
        EXPECT_EQ(covered[i], r.params[static_cast<size_t>(i)].numel);
      }
    }
    EXPECT_EQ(seen.size(), r.params.size());
    for (const ModelRecord& m : r.model) {
      ASSERT_GE(m.param, 0);
      ASSERT_LT(static_cast<size_t>(m.param), r.params.size());
      EXPECT_EQ(r.params[static_cast<size_t>(m.param)].source_stage, r.pp);
    }
  }
}

TEST(DeepSpeedTarget, GptModelPipeTiedEmbeddingOnEveryStageThatUsesIt) {
  const patterns::ResolvedModel model = Model("gpt-tiny");  // 4 layers, tied
  DeepSpeedLayout l;
  l.tp = 2;
  l.pp = 2;
  l.dp = 3;
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedTarget t, DescribeDeepSpeedTarget(model, l));
  CheckInvariants(model, t);
  // Stage 0: the tied module first, then layers 0-1 (specs 2, 3).
  const TargetRank& first = t.rank(0, 1);
  const TargetRank& last = t.rank(1, 1);
  EXPECT_EQ(first.params.front().engine_name, "tied_modules.embed.word_embeddings.weight");
  EXPECT_EQ(first.params[1].engine_name, "tied_modules.embed.position_embeddings.weight");
  EXPECT_EQ(first.params[2].engine_name, "2.self_attention.query_key_value.weight");
  // Stage 1: the whole tied EmbeddingPipe again, first; its position embedding has stage 0's
  // values (ucp places only the word embedding on the last stage).
  EXPECT_EQ(last.params[0].engine_name, "tied_modules.embed.word_embeddings.weight");
  EXPECT_EQ(last.params[0].source_stage, 1);
  EXPECT_EQ(last.params[1].engine_name, "tied_modules.embed.position_embeddings.weight");
  EXPECT_EQ(last.params[1].source_stage, 0);
  EXPECT_EQ(last.params[2].engine_name, "4.self_attention.query_key_value.weight");
  // Group 1 (no weight decay) ends with the final norm, spec L+2 = 6.
  const TargetGroup& g1 = last.groups[1];
  EXPECT_EQ(last.params[static_cast<size_t>(g1.params.back())].engine_name, "6.bias");
  EXPECT_EQ(last.params[static_cast<size_t>(g1.params[g1.params.size() - 2])].engine_name,
            "6.weight");
  // The vocabulary is padded to a multiple of 16 * tp: 256 rows, 128 per tp rank.
  EXPECT_EQ(last.params[0].local_shape, (Shape{128, 64}));
  // Layer files: stage 0 saves the tied module (layer_01) and its layers; the last stage its
  // layers and the final norm, but no copy of the embedding (its spec there is a function).
  std::set<std::string> first_files, last_files;
  for (const ModelRecord& m : first.model) first_files.insert(m.file);
  for (const ModelRecord& m : last.model) last_files.insert(m.file);
  EXPECT_THAT(first_files,
              ElementsAre("layer_01-model_01-model_states.pt", "layer_02-model_01-model_states.pt",
                          "layer_03-model_01-model_states.pt"));
  EXPECT_THAT(last_files,
              ElementsAre("layer_04-model_01-model_states.pt", "layer_05-model_01-model_states.pt",
                          "layer_06-model_01-model_states.pt"));
  EXPECT_EQ(first.model[0].key, "word_embeddings.weight");
  EXPECT_EQ(first.model[1].key, "position_embeddings.weight");
  EXPECT_EQ(last.model.back().key, "bias");
  EXPECT_EQ(t.ModelStatesFile(1, 1), "mp_rank_03_model_states.pt");
  EXPECT_EQ(t.OptimStatesFile(1, 0, 2, "bf16_"), "bf16_zero_pp_rank_2_mp_rank_02_optim_states.pt");
  EXPECT_EQ(t.DpWorldSize(), 3);
  EXPECT_EQ(t.MpWorldSize(), 4);
}

TEST(DeepSpeedTarget, UntiedPipeAndGptModelOrders) {
  const patterns::ResolvedModel model = Model("llama-tiny");  // untied, no position embedding
  DeepSpeedLayout l;
  l.tp = 2;
  l.pp = 2;
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedTarget pipe, DescribeDeepSpeedTarget(model, l));
  CheckInvariants(model, pipe);
  EXPECT_EQ(pipe.rank(0, 0).params.front().engine_name, "1.word_embeddings.weight");
  EXPECT_EQ(pipe.rank(1, 0).params.front().engine_name, "4.self_attention.query_key_value.weight");
  EXPECT_EQ(pipe.rank(1, 0).groups[0].params.size(), 9u);  // 2 layers x 4 weights + the head
  EXPECT_EQ(pipe.rank(1, 0).params[8].engine_name, "7.lm_head.weight");
  for (const TargetParam& p : pipe.rank(1, 0).params) EXPECT_EQ(p.source_stage, 1);

  l.pp = 1;
  l.naming = Naming::kMegatronGpt;
  l.sp = 2;
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedTarget gpt, DescribeDeepSpeedTarget(model, l));
  CheckInvariants(model, gpt);
  const std::vector<std::string> names = EngineNames(gpt.rank(0, 1));
  EXPECT_EQ(names.front(), "language_model.embedding.word_embeddings.weight");
  EXPECT_EQ(names[static_cast<size_t>(gpt.rank(0, 1).groups[0].params.back())],
            "language_model.output_layer.weight");
  // GPTModel saves its weights in the mp_rank file's module dict.
  for (const ModelRecord& m : gpt.rank(0, 1).model) {
    EXPECT_EQ(m.file, "mp_rank_01_model_states.pt");
    EXPECT_EQ(m.key, gpt.rank(0, 1).params[static_cast<size_t>(m.param)].engine_name);
  }
  EXPECT_EQ(gpt.rank(0, 1).model.size(), gpt.rank(0, 1).params.size());
  EXPECT_EQ(gpt.DpWorldSize(), 2);
}

TEST(DeepSpeedTarget, SingleGroupAndPaddingAcrossPartitions) {
  const patterns::ResolvedModel model = Model("mixtral-tiny");
  DeepSpeedLayout l;
  l.naming = Naming::kPlain;
  l.grouping = ParamGrouping::kSingle;
  l.dp = 4;
  l.sp = 2;
  l.zero_stage = 2;
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedTarget t, DescribeDeepSpeedTarget(model, l));
  CheckInvariants(model, t);
  ASSERT_EQ(t.ranks[0].groups.size(), 1u);
  EXPECT_EQ(t.ranks[0].params.size(), model.params.size());
  EXPECT_EQ(t.ranks[0].params[0].engine_name, "embedding.word_embeddings.weight");
}

// DeepSpeed-MoE at dp=4, ep=2: the dense groups over all 4 ranks, then per ep rank its experts
// (2 of each layer's 4) in the engine's order, over 2 ranks; file d holds the dense groups and
// ep rank d % 2's experts, partition d / 2; expert weights in layer_L_expert_E files.
TEST(DeepSpeedTarget, DeepSpeedMoeExpertGroupsPerEpRank) {
  const patterns::ResolvedModel model = Model("mixtral-tiny");
  DeepSpeedLayout l;
  l.naming = Naming::kPlain;
  l.dp = 4;
  l.ep = 2;
  l.deepspeed_moe = true;
  Result<DeepSpeedTarget> t = DescribeDeepSpeedTarget(model, l);
  ASSERT_TRUE(t.ok()) << t.status();
  CheckInvariants(model, *t);
  EXPECT_THAT(t->num_experts, ElementsAre(4, 4));
  const TargetRank& r = t->ranks[0];
  // Megatron's two dense groups, then the weight-decay experts of ep ranks 0 and 1 (the experts
  // have no 1-dim parameters, so no second expert group kind).
  ASSERT_EQ(r.groups.size(), 4u);
  EXPECT_EQ(r.groups[0].ep_rank, -1);
  EXPECT_EQ(r.groups[1].ep_rank, -1);
  EXPECT_EQ(r.groups[2].ep_rank, 0);
  EXPECT_EQ(r.groups[3].ep_rank, 1);
  EXPECT_THAT(r.FileGroups(0, 2), ElementsAre(0, 1, 2));
  EXPECT_THAT(r.FileGroups(3, 2), ElementsAre(0, 1, 3));
  EXPECT_EQ(t->PartitionInFile(r.groups[3], 3), 1);
  EXPECT_EQ(t->FileOfPartition(r.groups[3], 1), 3);
  EXPECT_EQ(t->PartitionInFile(r.groups[0], 3), 3);
  std::vector<std::string> ep1;
  for (int32_t i : r.groups[3].params) ep1.push_back(r.params[static_cast<size_t>(i)].engine_name);
  EXPECT_THAT(ep1,
              ElementsAre("layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.2.linear_fc1.weight",
                          "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.2.linear_fc2.weight",
                          "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc1.weight",
                          "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc2.weight",
                          "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.2.linear_fc1.weight",
                          "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.2.linear_fc2.weight",
                          "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc1.weight",
                          "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc2.weight"));
  std::set<std::string> files;
  bool gate_in_module = false;
  for (const ModelRecord& m : r.model) {
    files.insert(m.file);
    if (m.key == "layers.1.mlp.deepspeed_moe.gate.wg.weight") {
      gate_in_module = m.file == "mp_rank_00_model_states.pt";
    }
  }
  EXPECT_TRUE(gate_in_module);
  EXPECT_EQ(files.size(), 1u + 8u);
  EXPECT_TRUE(files.contains("layer_1_expert_3_mp_rank_00_model_states.pt"));
  EXPECT_EQ(t->ExpertOptimFile(1, 0), "expp_rank_1_mp_rank_00_optim_states.pt");

  DeepSpeedLayout bad = l;
  bad.dp = 3;
  bad.ep = 2;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, bad).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("ep does not divide dp * sp")));
  bad = l;
  bad.zero_stage = 3;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, bad).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("without pipeline stages")));
  bad = l;
  bad.ep = 8;
  bad.dp = 8;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, bad).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("not a multiple of ep")));
  bad = l;
  bad.deepspeed_moe = false;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("written as DeepSpeed-MoE only")));
  EXPECT_THAT(DescribeDeepSpeedTarget(Model("gpt-tiny"), l).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no per-expert parameters")));
}

TEST(DeepSpeedTarget, RefusesWhatTheNamingOrLayoutCannotExpress) {
  const patterns::ResolvedModel model = Model("gpt-tiny");
  DeepSpeedLayout l;
  l.pp = 2;
  for (Naming n : {Naming::kPlain, Naming::kMegatronGpt}) {
    l.naming = n;
    EXPECT_THAT(DescribeDeepSpeedTarget(model, l).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("cannot express pp=2: only a GPTModelPipe")));
  }
  l.naming = Naming::kMegatronPipe;
  l.pp = 3;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, l).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("not divisible by pp=3")));
  l.pp = 1;
  l.tp = 3;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, l).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("tp=3")));
  // llama-tiny's 4 query groups at tp=8: the rule set takes it (Megatron-Core), Megatron-DeepSpeed
  // cannot; plain DeepSpeed names are ucp's own model and keep it.
  const patterns::ResolvedModel llama = Model("llama-tiny");
  l.tp = 8;
  for (Naming n : {Naming::kMegatronPipe, Naming::kMegatronGpt}) {
    l.naming = n;
    EXPECT_THAT(DescribeDeepSpeedTarget(llama, l).status(),
                StatusIs(StatusCode::kFailedPrecondition,
                         HasSubstr("4 query groups not divisible by tp=8: naming megatron")));
  }
  l.naming = Naming::kPlain;
  UCP_EXPECT_OK(DescribeDeepSpeedTarget(llama, l).status());
  l.naming = Naming::kMegatronPipe;
  l.tp = 1;
  l.zero_stage = 4;
  EXPECT_THAT(DescribeDeepSpeedTarget(model, l).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("ZeRO stage 1, 2 or 3")));
  l.zero_stage = 3;  // with GPTModelPipe naming
  EXPECT_THAT(DescribeDeepSpeedTarget(model, l).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("pipeline engine does not run ZeRO-3")));
  // ZeRO-3: each parameter cut by itself into ceil(numel / (dp * sp)) pieces, back to back.
  l.naming = Naming::kMegatronGpt;
  l.dp = 3;
  {
    UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedTarget t, DescribeDeepSpeedTarget(model, l));
    const TargetRank& r = t.rank(0, 0);
    EXPECT_TRUE(r.model.empty());  // ZeRO-3 saves no module weights
    for (const TargetGroup& g : r.groups) {
      int64_t offset = 0;
      for (int32_t i : g.params) {
        const TargetParam& p = r.params[static_cast<size_t>(i)];
        EXPECT_EQ(p.piece, (p.numel + 2) / 3) << p.name;
        EXPECT_EQ(p.offset, offset) << p.name;
        offset += p.piece;
      }
      EXPECT_EQ(g.partition.fragment_size, offset);
      EXPECT_EQ(g.partition.num_fragments, 3);
    }
    EXPECT_EQ(t.Zero3ModelStatesFile(0, 2), "zero_pp_rank_2_mp_rank_00_model_states.pt");
  }
  l.dp = 1;
  // A parameter outside Megatron's four groups has no GPTModelPipe / GPTModel name.
  const std::string rules_json = R"({
    "family": "toy",
    "parameters": [{"name": "encoder.proj.weight", "shape": ["hidden", "hidden"]}],
    "pipeline": {"layer_pattern": "layers\\.(\\d+)\\..*", "first_stage": ["encoder\\..*"],
                 "last_stage": [], "tied_to_last_stage": []},
    "rules": [{"match": "encoder\\.proj\\.weight", "kind": "replicate", "source": "test"}]})";
  patterns::RuleSet rules = *patterns::ParseRuleSet(rules_json, "toy.json");
  patterns::ModelSpec spec;
  spec.name = "toy";
  spec.family = "toy";
  spec.hyper = {{"hidden", 4}, {"layers", 0}};
  spec.templates = rules.templates;
  UCP_ASSERT_OK_AND_ASSIGN(patterns::ResolvedModel toy, patterns::Resolve(spec, rules));
  l.zero_stage = 1;
  l.naming = Naming::kMegatronGpt;
  EXPECT_THAT(
      DescribeDeepSpeedTarget(toy, l).status(),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("\"encoder.proj.weight\" has no megatron-deepspeed GPTModel name")));
  l.naming = Naming::kPlain;
  UCP_EXPECT_OK(DescribeDeepSpeedTarget(toy, l).status());
}

}  // namespace
}  // namespace ucp::deepspeed
