// Engine <-> canonical names for every flavour, both directions, and the names each refuses.
#include "ucp/deepspeed/naming.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testutil/status_matchers.h"

namespace ucp::deepspeed {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

struct NameCase {
  Naming naming;
  bool tied;
  const char* engine;
  const char* canonical;
};

// Two layers: GPTModelPipe's final norm is spec 4, its untied head spec 5.
const NameCase kNames[] = {
    {Naming::kMegatronPipe, true, "tied_modules.embed.word_embeddings.weight",
     "embedding.word_embeddings.weight"},
    {Naming::kMegatronPipe, true, "tied_modules.embed.position_embeddings.weight",
     "embedding.position_embeddings.weight"},
    {Naming::kMegatronPipe, false, "1.word_embeddings.weight", "embedding.word_embeddings.weight"},
    {Naming::kMegatronPipe, true, "2.input_layernorm.weight", "layers.0.input_layernorm.weight"},
    {Naming::kMegatronPipe, true, "3.mlp.dense_h_to_4h.weight",
     "layers.1.mlp.dense_h_to_4h.weight"},
    {Naming::kMegatronPipe, true, "4.weight", "final_layernorm.weight"},
    {Naming::kMegatronPipe, true, "4.bias", "final_layernorm.bias"},
    {Naming::kMegatronPipe, false, "5.lm_head.weight", "output_layer.weight"},
    {Naming::kMegatronGpt, true, "language_model.embedding.word_embeddings.weight",
     "embedding.word_embeddings.weight"},
    {Naming::kMegatronGpt, true, "language_model.encoder.layers.1.self_attention.dense.weight",
     "layers.1.self_attention.dense.weight"},
    {Naming::kMegatronGpt, true, "language_model.encoder.final_layernorm.weight",
     "final_layernorm.weight"},
    {Naming::kMegatronGpt, false, "language_model.output_layer.weight", "output_layer.weight"},
    {Naming::kPlain, false, "layers.1.mlp.experts.3.linear_fc1.weight",
     "layers.1.mlp.experts.3.linear_fc1.weight"},
};

TEST(Naming, BothDirections) {
  for (const NameCase& c : kNames) {
    SCOPED_TRACE(c.engine);
    EXPECT_EQ(DetectNaming(c.engine), c.naming);
    UCP_ASSERT_OK_AND_ASSIGN(std::string canonical, CanonicalName(c.engine, c.naming));
    EXPECT_EQ(canonical, c.canonical);
    UCP_ASSERT_OK_AND_ASSIGN(std::string engine,
                             EngineName(c.canonical, c.naming, EngineNameContext{2, c.tied}));
    EXPECT_EQ(engine, c.engine);
  }
}

TEST(Naming, FlavourNamesRoundTrip) {
  for (Naming n : {Naming::kMegatronPipe, Naming::kMegatronGpt, Naming::kPlain}) {
    UCP_ASSERT_OK_AND_ASSIGN(Naming back, NamingFromName(NamingName(n)));
    EXPECT_EQ(back, n);
  }
  EXPECT_THAT(NamingFromName("GPTModelPipe").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown DeepSpeed naming")));
}

TEST(Naming, RefusesNamesOfOtherFlavours) {
  EXPECT_THAT(CanonicalName("language_model.pooler.dense.weight", Naming::kMegatronGpt).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("\"language_model.pooler.dense.weight\" is not a "
                                 "megatron-deepspeed GPTModel parameter name")));
  EXPECT_THAT(CanonicalName("layers.0.x.weight", Naming::kMegatronPipe).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("GPTModelPipe")));
  // Spec 0 is the fp16 cast function and spec 1 the embedding: no layer lives there.
  EXPECT_FALSE(CanonicalName("1.input_layernorm.weight", Naming::kMegatronPipe).ok());
  EXPECT_FALSE(CanonicalName("2.word_embeddings.weight", Naming::kMegatronPipe).ok());
  EXPECT_THAT(EngineName("encoder.weird", Naming::kMegatronPipe, {}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("has no")));
}

TEST(Naming, DeepSpeedMoeLayers) {
  // deepspeed.moe.layer.MoE at layers.<i>.mlp: its gate is the router, its experts ucp's experts.
  const EngineNameContext moe{2, true, true};
  struct Case {
    Naming naming;
    const char* engine;
    const char* canonical;
  };
  for (const Case& c : {
           Case{Naming::kPlain, "layers.1.mlp.deepspeed_moe.gate.wg.weight",
                "layers.1.mlp.router.weight"},
           Case{Naming::kPlain,
                "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc1.weight",
                "layers.0.mlp.experts.3.linear_fc1.weight"},
           Case{Naming::kMegatronGpt,
                "language_model.encoder.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.12.w."
                "bias",
                "layers.1.mlp.experts.12.w.bias"},
           Case{Naming::kPlain, "layers.0.self_attention.dense.weight",
                "layers.0.self_attention.dense.weight"},
       }) {
    SCOPED_TRACE(c.engine);
    EXPECT_EQ(IsDeepSpeedMoeName(c.engine), std::string(c.engine) != c.canonical);
    UCP_ASSERT_OK_AND_ASSIGN(std::string canonical, CanonicalName(c.engine, c.naming));
    EXPECT_EQ(canonical, c.canonical);
    UCP_ASSERT_OK_AND_ASSIGN(std::string engine, EngineName(c.canonical, c.naming, moe));
    EXPECT_EQ(engine, c.engine);
  }
  // Without the flag the canonical names are the engine's (experts as ordinary parameters).
  UCP_ASSERT_OK_AND_ASSIGN(std::string plain,
                           EngineName("layers.1.mlp.router.weight", Naming::kPlain, {}));
  EXPECT_EQ(plain, "layers.1.mlp.router.weight");
  const char* expert = "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc2.weight";
  EXPECT_TRUE(IsDeepSpeedExpertName(expert));
  EXPECT_FALSE(IsDeepSpeedExpertName("layers.0.mlp.deepspeed_moe.gate.wg.weight"));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t index, DeepSpeedExpertIndex(expert));
  EXPECT_EQ(index, 3);
  UCP_ASSERT_OK_AND_ASSIGN(std::string local, WithDeepSpeedExpertIndex(expert, 1));
  EXPECT_EQ(local, "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.1.linear_fc2.weight");
  EXPECT_THAT(DeepSpeedExpertIndex("layers.0.mlp.router.weight").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not an expert")));
}

TEST(Naming, PipeLayerFiles) {
  UCP_ASSERT_OK_AND_ASSIGN(PipeLayerKey tied,
                           PipeLayerOf("tied_modules.embed.word_embeddings.weight"));
  EXPECT_EQ(tied.layer_index, 1);
  EXPECT_EQ(tied.key, "word_embeddings.weight");
  UCP_ASSERT_OK_AND_ASSIGN(PipeLayerKey head, PipeLayerOf("5.lm_head.weight"));
  EXPECT_EQ(head.layer_index, 5);
  EXPECT_EQ(head.key, "lm_head.weight");
  EXPECT_FALSE(PipeLayerOf("language_model.output_layer.weight").ok());
}

}  // namespace
}  // namespace ucp::deepspeed
