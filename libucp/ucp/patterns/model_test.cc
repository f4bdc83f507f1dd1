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
