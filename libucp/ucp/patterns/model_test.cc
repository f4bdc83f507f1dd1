// Tests for model presets, rule sets, rule resolution and slicing.
#include "ucp/patterns/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <string>

#include "tests/testutil/status_matchers.h"

namespace ucp::patterns {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

const std::filesystem::path kData = std::filesystem::path(UCP_TEST_SOURCE_DIR) / "patterns";

Result<ResolvedModel> LoadResolved(const std::string& name) {
  UCP_ASSIGN_OR_RETURN(ModelSpec spec, LoadModel(kData, name));
  UCP_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(kData, spec.family));
  return Resolve(spec, rules);
}

const ResolvedParam* Find(const ResolvedModel& m, const std::string& name) {
  for (const auto& p : m.params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

TEST(SizeExpr, EvaluatesAndRejects) {
  std::map<std::string, int64_t> h = {{"heads", 8}, {"kv_heads", 2}, {"head_dim", 16}};
  UCP_ASSERT_OK_AND_ASSIGN(int64_t v, EvalSizeExpr("(heads+2*kv_heads)*head_dim", h));
  EXPECT_EQ(v, 192);
  UCP_ASSERT_OK_AND_ASSIGN(int64_t w, EvalSizeExpr("heads/kv_heads*head_dim - 1", h));
  EXPECT_EQ(w, 63);
  EXPECT_THAT(EvalSizeExpr("hidden", h), StatusIs(StatusCode::kInvalidArgument,
                                                  HasSubstr("unknown hyper-parameter \"hidden\"")));
  EXPECT_THAT(EvalSizeExpr("heads/3", h),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("8 / 3 is not exact")));
  EXPECT_THAT(EvalSizeExpr("(heads", h),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\")\"")));
  std::map<std::string, int64_t> big = {{"a", int64_t{1} << 40}};
  EXPECT_THAT(EvalSizeExpr("a*a", big),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overflows int64")));
  EXPECT_THAT(EvalSizeExpr("0-a*4194304-a*4194304-a*4194304", big),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overflows int64")));
}

TEST(Presets, EveryPresetResolves) {
  for (const char* name :
       {"gpt-tiny", "llama-tiny", "llama-tiny-tied", "mixtral-tiny", "gpt2-small"}) {
    SCOPED_TRACE(name);
    UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved(name));
    EXPECT_FALSE(m.params.empty());
  }
}

TEST(Presets, Gpt2SmallHas124MParameters) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved("gpt2-small"));
  int64_t n = 0;
  for (const auto& p : m.params) n += NumElementsOrDie(p.shape);
  EXPECT_EQ(n, 124439808);  // GPT-2 small with tied embeddings, 1024 positions
  EXPECT_EQ(m.params.front().name, "embedding.word_embeddings.weight");
  EXPECT_EQ(m.params.front().stage, StagePlacement::kFirstAndLast);
}

TEST(Presets, LlamaGqaShapesAndOrder) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved("llama-tiny"));
  const ResolvedParam* qkv = Find(m, "layers.3.self_attention.query_key_value.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (Shape{(8 + 2 * 4) * 8, 64}));
  EXPECT_EQ(qkv->layer, 3);
  EXPECT_EQ(qkv->rule.groups, 4);
  EXPECT_EQ(qkv->rule.part_sizes, (std::vector<int64_t>{16, 8, 8}));
  EXPECT_EQ(m.params.back().name, "output_layer.weight");
  EXPECT_EQ(m.params.back().stage, StagePlacement::kLast);
  EXPECT_EQ(m.params[1].name, "layers.0.input_layernorm.weight");
}

TEST(Presets, MixtralExpertsAndLocalNames) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved("mixtral-tiny"));
  const ResolvedParam* fc1 = Find(m, "layers.1.mlp.experts.3.linear_fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(fc1->expert, 3);
  EXPECT_TRUE(fc1->is_expert());
  UCP_ASSERT_OK_AND_ASSIGN(layout::StageAssignment st, layout::AssignStages(2, 2));
  UCP_ASSERT_OK_AND_ASSIGN(layout::ExpertPlacement ex, layout::PlaceExperts(4, 2));
  EXPECT_EQ(LocalName(*fc1, st, &ex), "layers.0.mlp.experts.1.linear_fc1.weight");
  const ResolvedParam* router = Find(m, "layers.1.mlp.router.weight");
  ASSERT_NE(router, nullptr);
  EXPECT_FALSE(router->is_expert());
}

TEST(Slice, InterleavedQkvSplitsByGroupsAndNamesTheNumbers) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved("llama-tiny"));
  const ResolvedParam* qkv = Find(m, "layers.0.self_attention.query_key_value.weight");
  UCP_ASSERT_OK_AND_ASSIGN(Slice s, SliceParam(*qkv, 2, 1, 1, 0));
  EXPECT_EQ(s.local_shape, (Shape{64, 64}));
  ASSERT_EQ(s.pieces.size(), 1u);
  EXPECT_EQ(s.pieces[0].full_start, (Shape{64, 0}));
  EXPECT_THAT(SliceParam(*qkv, 3, 0, 1, 0),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("parameter \"layers.0.self_attention.query_key_value.weight\": "
                                 "4 query groups not divisible by tp=3")));
}

// llama-tiny's spec (hidden 64, 8 heads, head_dim 8) with other hyper-parameters, resolved
// against `family`'s rule set.
Result<ResolvedModel> LlamaVariant(std::map<std::string, int64_t> hyper,
                                   const std::string& family = "llama") {
  UCP_ASSIGN_OR_RETURN(ModelSpec spec, LoadModel(kData, "llama-tiny"));
  UCP_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(kData, family));
  spec.family = family;
  spec.templates = rules.templates;
  for (const auto& [k, v] : hyper) spec.hyper[k] = v;
  return Resolve(spec, rules);
}

// Megatron-Core with tp a multiple of the query groups (PR #2565): linear_qkv stays
// column-parallel, so rank r holds rows [r*R/tp, (r+1)*R/tp) of the per-group interleaved
// tensor. nh=8, nkv=2, head_dim 8: a group is [q0..q3 | k | v] = 48 rows, and tp=4 cuts each
// group in two: rank 0 = q0 q1 q2, rank 1 = q3 k0 v0, rank 2 = q4 q5 q6, rank 3 = q7 k1 v1.
TEST(Slice, TpAboveQueryGroupsSplitsTheRowsEvenly) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LlamaVariant({{"kv_heads", 2}}));
  const ResolvedParam* qkv = Find(m, "layers.0.self_attention.query_key_value.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->rule.split_groups_up_to, 8);
  for (int r = 0; r < 4; ++r) {
    UCP_ASSERT_OK_AND_ASSIGN(Slice s, SliceParam(*qkv, 4, r, 1, 0));
    EXPECT_EQ(s.local_shape, (Shape{24, 64}));
    ASSERT_EQ(s.pieces.size(), 1u);
    EXPECT_EQ(s.pieces[0].full_start, (Shape{24 * r, 0}));
    EXPECT_EQ(s.pieces[0].counts, (Shape{24, 64}));
    EXPECT_EQ(s.replica, 0);  // nothing is replicated: each row lives on one rank
  }
  UCP_ASSERT_OK_AND_ASSIGN(Slice s8, SliceParam(*qkv, 8, 7, 1, 0));
  EXPECT_EQ(s8.local_shape, (Shape{12, 64}));  // tp=8: 96 / 8 rows; rank 7 = half of k1, v1
  EXPECT_EQ(s8.pieces[0].full_start, (Shape{84, 0}));
  // tp must still divide the heads, and be a multiple (or divisor) of the groups.
  EXPECT_THAT(SliceParam(*qkv, 16, 0, 1, 0),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("heads=8 not divisible by tp=16 (tp above the 2 query groups "
                                 "splits each group over 8 ranks)")));
  EXPECT_THAT(SliceParam(*qkv, 3, 0, 1, 0),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("2 query groups not divisible by tp=3, nor is tp=3 a multiple")));
  // A group's rows must split evenly over the ranks that share it: (4 + 2) * 1 rows over 4.
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel odd,
                           LlamaVariant({{"heads", 4}, {"kv_heads", 1}, {"head_dim", 1}}));
  EXPECT_THAT(SliceParam(*Find(odd, "layers.0.self_attention.query_key_value.weight"), 4, 0, 1, 0),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("6 rows per group not divisible by the 4 ranks that share a "
                                 "group at tp=4")));
}

TEST(Slice, MqaAndQwen2BiasAboveTheQueryGroups) {
  // MQA (one group of [q0..q7 | k | v] = 80 rows) at tp=2: rank 1 = q5 q6 q7 k v.
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel mqa, LlamaVariant({{"kv_heads", 1}}));
  UCP_ASSERT_OK_AND_ASSIGN(
      Slice s,
      SliceParam(*Find(mqa, "layers.1.self_attention.query_key_value.weight"), 2, 1, 1, 0));
  EXPECT_EQ(s.local_shape, (Shape{40, 64}));
  EXPECT_EQ(s.pieces[0].full_start, (Shape{40, 0}));
  // Qwen2's fused bias is split as the weight rows.
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel qwen, LlamaVariant({{"kv_heads", 2}}, "qwen2"));
  const ResolvedParam* bias = Find(qwen, "layers.0.self_attention.query_key_value.bias");
  ASSERT_NE(bias, nullptr);
  UCP_ASSERT_OK_AND_ASSIGN(Slice b, SliceParam(*bias, 4, 3, 1, 0));
  EXPECT_EQ(b.local_shape, (Shape{24}));
  EXPECT_EQ(b.pieces[0].full_start, (Shape{72}));
}

TEST(RuleSet, SplitGroupsUpToOnlyForInterleavedGroups) {
  const std::string bad = R"({"family": "x", "parameters": [{"name": "w", "shape": ["4"]}],
    "pipeline": {"layer_pattern": "layers\\.(\\d+)\\..*", "first_stage": ["w"], "last_stage": []},
    "rules": [{"match": "w", "kind": "fuse", "dim": 0, "order": "concat",
               "parts": [{"name": "a", "size": "4"}], "split_groups_up_to": "heads", "source": "t"}]})";
  EXPECT_THAT(ParseRuleSet(bad, "x.json"),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("\"split_groups_up_to\" is only allowed for order "
                                 "\"interleaved_groups\"")));
}

TEST(Slice, SwigluConcatTakesEachPartsChunk) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved("llama-tiny"));
  const ResolvedParam* fc1 = Find(m, "layers.0.mlp.dense_h_to_4h.weight");
  UCP_ASSERT_OK_AND_ASSIGN(Slice s, SliceParam(*fc1, 4, 2, 1, 0));
  EXPECT_EQ(s.local_shape, (Shape{48, 64}));
  ASSERT_EQ(s.pieces.size(), 2u);
  EXPECT_EQ(s.pieces[0].full_start, (Shape{48, 0}));  // gate rows 48..71
  EXPECT_EQ(s.pieces[1].local_start, (Shape{24, 0}));
  EXPECT_EQ(s.pieces[1].full_start, (Shape{96 + 48, 0}));  // up rows 144..167
  EXPECT_THAT(SliceParam(*fc1, 5, 0, 1, 0),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("part \"gate\" has 96 rows, not divisible by tp=5")));
}

TEST(Slice, PadStripPadsTheLastRank) {
  UCP_ASSERT_OK_AND_ASSIGN(ResolvedModel m, LoadResolved("gpt-tiny"));
  const ResolvedParam* emb = Find(m, "embedding.word_embeddings.weight");
  // 250 rows, divisible_by 16 * tp 4 = 64: 256 rows padded, 64 per rank, last has 58 real rows.
  UCP_ASSERT_OK_AND_ASSIGN(Slice s, SliceParam(*emb, 4, 3, 1, 0));
  EXPECT_EQ(s.local_shape, (Shape{64, 64}));
  ASSERT_EQ(s.pieces.size(), 1u);
  EXPECT_EQ(s.pieces[0].counts, (Shape{58, 64}));
  ASSERT_EQ(s.pad.size(), 1u);
  EXPECT_EQ(s.pad[0].start, (Shape{58, 0}));
  EXPECT_EQ(s.pad[0].counts, (Shape{6, 64}));
}

constexpr const char* kMiniRules = R"({
  "family": "mini",
  "parameters": [{"name": "a.weight", "shape": ["hidden", "hidden"]},
                 {"name": "b.weight", "shape": ["hidden"]}],
  "pipeline": {"layer_pattern": "layers\\.(\\d+)\\..*", "first_stage": [".*"], "last_stage": []},
  "rules": [RULES]
})";

Result<ResolvedModel> ResolveMini(const std::string& rules) {
  std::string text = kMiniRules;
  text.replace(text.find("RULES"), 5, rules);
  UCP_ASSIGN_OR_RETURN(RuleSet rs, ParseRuleSet(text, "mini.json"));
  ModelSpec spec;
  spec.name = "mini";
  spec.family = "mini";
  spec.hyper = {{"hidden", 4}, {"layers", 0}};
  spec.templates = rs.templates;
  return Resolve(spec, rs);
}

TEST(Resolve, UnmatchedDoubleMatchedAndUnusedRulesAreErrors) {
  EXPECT_THAT(ResolveMini(R"({"match": "a\\.weight", "kind": "replicate", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("parameter \"b.weight\" is matched by no rule")));
  EXPECT_THAT(ResolveMini(R"({"match": ".*", "kind": "replicate", "source": "t"},
                             {"match": "b\\..*", "kind": "average", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("parameter \"b.weight\" is matched by two rules")));
  EXPECT_THAT(ResolveMini(R"({"match": ".*", "kind": "replicate", "source": "t"},
                             {"match": "c\\..*", "kind": "average", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("rule \"c\\..*\" of rule set \"mini\" matched no parameter")));
  // Full match: "a" alone does not match "a.weight".
  EXPECT_THAT(
      ResolveMini(R"({"match": "a", "kind": "replicate", "source": "t"},
                             {"match": "b\\.weight", "kind": "replicate", "source": "t"})"),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"a.weight\" is matched by no rule")));
  EXPECT_THAT(ResolveMini(R"({"match": "a\\.weight", "kind": "shard", "dim": 2, "source": "t"},
                             {"match": "b\\.weight", "kind": "replicate", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("dim 2 but the shape [4, 4]")));
  EXPECT_THAT(
      ResolveMini(R"({"match": "a\\.weight", "kind": "fuse", "dim": 0, "order": "concat",
                              "parts": [{"name": "x", "size": "hidden"}, {"name": "y", "size": "1"}],
                              "source": "t"},
                             {"match": "b\\.weight", "kind": "replicate", "source": "t"})"),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("parts add up to 5 rows, dim 0 has 4")));
}

TEST(ParseRuleSet, StructuralErrorsNameTheField) {
  auto parse = [](const std::string& rules) {
    std::string text = kMiniRules;
    text.replace(text.find("RULES"), 5, rules);
    return ParseRuleSet(text, "mini.json");
  };
  EXPECT_THAT(parse(R"({"match": "(", "kind": "replicate", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("bad regular expression \"(\"")));
  // Patterns whose backtracking could take exponential time are refused before any match (the
  // rules_fuzz input that hung: a literal star then a run of stars), as are backreferences and
  // more than 4 quantifiers; lazy quantifiers and classes with quantifier characters are fine.
  for (const char* bad : {R"(layers\\.\\*****d+)", R"((a+)+)", R"((\\d)\\1)", R"(a*b*c*d*e*)",
                          R"(x{2}*)", R"((ab)*)"}) {
    EXPECT_THAT(parse(std::string(R"({"match": ")") + bad + R"(", "kind": "replicate", "source": "t"})"),
                StatusIs(StatusCode::kInvalidArgument,
                         ::testing::AnyOf(HasSubstr("nested repetition"),
                                          HasSubstr("a backreference"),
                                          HasSubstr("more than 4 quantifiers"))))
        << bad;
  }
  EXPECT_THAT(parse(R"({"match": "a+?b", "kind": "replicate", "source": "t"})"),
              ::ucp::testing::IsOk());
  EXPECT_THAT(parse(R"j({"match": "[*+?]x{2}\\.(a|b)", "kind": "replicate", "source": "t"})j"),
              ::ucp::testing::IsOk());
  EXPECT_THAT(parse(R"({"match": "a", "kind": "split", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown kind \"split\"")));
  EXPECT_THAT(parse(R"({"match": "a", "kind": "shard", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("field \"dim\" is required")));
  EXPECT_THAT(parse(R"({"match": "a", "kind": "replicate", "source": "t", "colour": 1})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown field \"colour\"")));
  EXPECT_THAT(parse(R"({"match": "a", "kind": "replicate"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("missing field \"source\"")));
  EXPECT_THAT(parse(R"({"match": "a", "match": "b", "kind": "replicate", "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("duplicate key \"match\"")));
  EXPECT_THAT(parse(R"({"match": "a", "kind": "fuse", "dim": 0, "order": "interleaved_groups",
                        "parts": [{"name": "q", "size": "1"}], "source": "t"})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("field \"groups\" is required")));
}

TEST(LoadModel, MissingPresetIsNotFound) {
  EXPECT_THAT(LoadModel(kData, "gpt-huge"), StatusIs(StatusCode::kNotFound, HasSubstr("gpt-huge")));
  EXPECT_THAT(LoadModel(kData, "../gpt"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("a preset name has no")));
}

}  // namespace
}  // namespace ucp::patterns

namespace ucp::patterns {
namespace {

// Issue 16 #1: a family or preset name read from a file is a name, never a path.
TEST(Names, FamilyFromAFileCannotEscapeTheDataDir) {
  for (const std::string& bad : std::vector<std::string>{"../../etc/x", "../gpt", "/etc/passwd", "models/gpt-tiny", "gpt.json",
                          "..", ".", "", std::string("gpt\0x", 5), "a\\b",
                          std::string(65, 'a')}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(LoadRuleSet(kData, bad).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not a rule-set or preset name")));
    EXPECT_THAT(LoadModelPreset(kData, bad).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not a rule-set or preset name")));
  }
  // A NUL is shown escaped so the message stays one printable line.
  EXPECT_THAT(LoadRuleSet(kData, std::string("gpt\0x", 5)).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("gpt\\x00x")));
  UCP_EXPECT_OK(LoadRuleSet(kData, "gpt").status());
  UCP_EXPECT_OK(LoadModelPreset(kData, "llama-tiny-tied").status());
}

TEST(Names, ModelFileWithPathFamilyIsRefused) {
  // A user-given --model file.json is allowed, but the family it names is still a name.
  const std::filesystem::path tmp =
      std::filesystem::temp_directory_path() / ("ucp_names_" + std::to_string(::getpid()));
  std::filesystem::create_directories(tmp);
  {
    std::ofstream f(tmp / "m.json");
    f << R"({"name":"m","family":"../../../../../../tmp/evil","hyper":{"hidden":8,"layers":1,"heads":2,"vocab":4}})";
  }
  EXPECT_THAT(LoadModel(kData, (tmp / "m.json").string()).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("family")));
  std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace ucp::patterns
