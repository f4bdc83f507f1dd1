// Property tests of plans and the in-memory executor: shard-then-extract is the identity,
// A->B->C equals A->C, every target element is written exactly once, Adam commutes with ZeRO
// sharding, and impossible layouts fail naming the parameter and the numbers.
#include "ucp/convert/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/convert/apply.h"

namespace ucp::convert {
namespace {

using layout::Layout;
using patterns::ResolvedModel;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

const std::filesystem::path kData = std::filesystem::path(UCP_TEST_SOURCE_DIR) / "patterns";

ResolvedModel Load(const std::string& name, DType dtype) {
  auto spec = patterns::LoadModel(kData, name);
  UCP_CHECK(spec.ok()) << spec.status();
  auto rules = patterns::LoadRuleSet(kData, spec->family);
  UCP_CHECK(rules.ok()) << rules.status();
  auto m = patterns::Resolve(*spec, *rules);
  UCP_CHECK(m.ok()) << m.status();
  for (auto& p : m->params) p.dtype = dtype;
  return *m;
}

Layout L(int tp, int pp, int dp, int zero, int sp = 1, int ep = 1) {
  return Layout{.tp = tp, .pp = pp, .dp = dp, .sp = sp, .ep = ep, .zero_stage = zero};
}

TensorMap RandomUniversal(const ResolvedModel& m, const PlanOptions& o, uint64_t seed) {
  ucp::testing::Gen g(seed);
  TensorMap out;
  auto infos = DescribeLayout(m, layout::UniversalLayout(), o);
  UCP_CHECK(infos.ok()) << infos.status();
  for (const TensorInfo& t : *infos) out.emplace(t.name, g.RandomTensor(t.dtype, t.shape));
  return out;
}

::testing::AssertionResult SameTensors(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " tensors";
  }
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) return ::testing::AssertionFailure() << "missing " << name;
    if (!BitwiseEqual(t.view(), it->second.view())) {
      return ::testing::AssertionFailure() << "tensor " << name << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

Result<TensorMap> Convert(const ResolvedModel& m, const Layout& from, const Layout& to,
                          const TensorMap& in, const PlanOptions& o = {}) {
  UCP_ASSIGN_OR_RETURN(Plan plan, PlanConversion(m, from, to, o));
  UCP_RETURN_IF_ERROR(CheckCoverage(plan));
  return ApplyPlan(plan, in);
}

// Whether the model can take the layout; when it cannot, the error must name the numbers.
bool Fits(const ResolvedModel& m, const Layout& l) {
  auto d = DescribeLayout(m, l);
  if (!d.ok()) {
    EXPECT_THAT(d, StatusIs(StatusCode::kFailedPrecondition, HasSubstr("not divisible by")))
        << layout::ToString(l);
  }
  return d.ok();
}

void ExpectRoundTrip(const ResolvedModel& m, const Layout& l, uint64_t seed) {
  SCOPED_TRACE(m.spec.name + " " + layout::ToString(l) + " " +
               std::string(DTypeName(m.params[0].dtype)) + " seed " + std::to_string(seed));
  TensorMap u = RandomUniversal(m, {}, seed);
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap sharded, Convert(m, layout::UniversalLayout(), l, u));
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap back, Convert(m, l, layout::UniversalLayout(), sharded));
  EXPECT_TRUE(SameTensors(u, back));
}

const char* const kPresets[] = {"gpt-tiny", "llama-tiny", "llama-tiny-tied", "mixtral-tiny"};

std::vector<Layout> Matrix() {
  std::vector<Layout> out;
  for (int tp : {1, 2, 4, 8}) {
    for (int pp : {1, 2, 4}) {
      for (int dp : {1, 2, 3, 4}) {
        for (int zero : {0, 1, 2, 3}) out.push_back(L(tp, pp, dp, zero));
      }
    }
  }
  // sp and ep cases.
  out.push_back(L(2, 1, 2, 1, 2));
  out.push_back(L(1, 2, 3, 3, 2));
  out.push_back(L(2, 2, 4, 1, 1, 2));
  out.push_back(L(1, 1, 4, 2, 2, 4));
  out.push_back(L(2, 1, 2, 3, 1, 2));
  out.push_back(L(4, 2, 4, 0, 1, 4));
  return out;
}

// The default suite runs a seeded sample of the matrix (every preset, a dtype per layout from the
// X-list); UCP_FULL_MATRIX=1 or the slow-labelled plan_matrix_test run all of it.
TEST(RoundTrip, SampledLayoutMatrixEveryPresetAndDType) {
  const bool full = std::getenv("UCP_FULL_MATRIX") != nullptr;
  const std::vector<Layout> matrix = Matrix();
  int ran = 0, refused = 0;
  for (size_t pi = 0; pi < std::size(kPresets); ++pi) {
    std::mt19937_64 rng(pi);
    for (size_t i = 0; i < matrix.size(); ++i) {
      if (!full && i < matrix.size() - 6 && rng() % 8 != 0) continue;
      const DType dt = kAllDTypes[(i + pi) % kAllDTypes.size()];
      ResolvedModel m = Load(kPresets[pi], dt);
      if (!Fits(m, matrix[i])) {
        ++refused;
        continue;
      }
      ExpectRoundTrip(m, matrix[i], i * 31 + pi);
      ++ran;
    }
  }
  EXPECT_GT(ran, 40);
  EXPECT_GT(refused, 0);
}

TEST(RoundTrip, EveryDTypeOnAShardedZeroLayout) {
  for (DType dt : kAllDTypes) {
    ExpectRoundTrip(Load("llama-tiny", dt), L(2, 2, 3, 1), 7);
    ExpectRoundTrip(Load("mixtral-tiny", dt), L(2, 1, 2, 3, 1, 2), 8);
  }
}

TEST(Compose, RemapAThenBThenCEqualsAThenC) {
  const Layout layouts[][3] = {
      {L(2, 2, 2, 1), L(4, 1, 3, 3), L(1, 4, 2, 0)},
      {L(4, 1, 1, 0), L(2, 2, 4, 2), L(8, 1, 3, 1)},
      {L(1, 1, 4, 3, 2), L(2, 4, 1, 1), L(4, 2, 2, 2, 2)},
  };
  for (const char* preset : {"gpt-tiny", "mixtral-tiny"}) {
    ResolvedModel m = Load(preset, DType::kBf16);
    int seed = 0;
    for (const auto& abc : layouts) {
      if (!Fits(m, abc[0]) || !Fits(m, abc[1]) || !Fits(m, abc[2])) continue;
      SCOPED_TRACE(std::string(preset) + " " + layout::ToString(abc[0]) + " -> " +
                   layout::ToString(abc[1]) + " -> " + layout::ToString(abc[2]));
      TensorMap u = RandomUniversal(m, {}, ++seed);
      UCP_ASSERT_OK_AND_ASSIGN(TensorMap a, Convert(m, layout::UniversalLayout(), abc[0], u));
      UCP_ASSERT_OK_AND_ASSIGN(TensorMap b, Convert(m, abc[0], abc[1], a));
      UCP_ASSERT_OK_AND_ASSIGN(TensorMap c1, Convert(m, abc[1], abc[2], b));
      UCP_ASSERT_OK_AND_ASSIGN(TensorMap c2, Convert(m, abc[0], abc[2], a));
      EXPECT_TRUE(SameTensors(c1, c2));
    }
  }
}

TEST(Errors, ImpossibleLayoutsNameTheParameterAndNumbers) {
  ResolvedModel llama = Load("llama-tiny", DType::kBf16);
  EXPECT_THAT(PlanConversion(llama, layout::UniversalLayout(), L(3, 1, 1, 0)),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("parameter \"layers.0.self_attention.query_key_value.weight\": "
                                 "4 query groups not divisible by tp=3")));
  // tp=8 fits (a multiple of the 4 query groups that divides the 8 heads); tp=16 does not.
  EXPECT_THAT(PlanConversion(llama, L(16, 1, 1, 0), layout::UniversalLayout()),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("heads=8 not divisible by tp=16 (tp above the 4 query groups")));
  EXPECT_THAT(PlanConversion(llama, layout::UniversalLayout(), L(6, 1, 1, 0)),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("4 query groups not divisible by tp=6, nor is tp=6 a multiple")));
  EXPECT_THAT(
      PlanConversion(llama, layout::UniversalLayout(), L(1, 3, 1, 0)),
      StatusIs(StatusCode::kFailedPrecondition, HasSubstr("4 layers not divisible by pp=3")));
  ResolvedModel mix = Load("mixtral-tiny", DType::kBf16);
  EXPECT_THAT(
      PlanConversion(mix, layout::UniversalLayout(), L(1, 1, 3, 1, 1, 3)),
      StatusIs(StatusCode::kFailedPrecondition, HasSubstr("4 experts not divisible by ep=3")));
  EXPECT_THAT(PlanConversion(mix, layout::UniversalLayout(), L(1, 1, 3, 1, 1, 3)),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("parameter \"layers.0.mlp.experts.0.linear_fc1.weight\"")));
}

TEST(Replicate, DivergedCopiesAreAnErrorNamingTheParameter) {
  ResolvedModel m = Load("gpt-tiny", DType::kBf16);
  TensorMap u = RandomUniversal(m, {}, 3);
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap s, Convert(m, layout::UniversalLayout(), L(2, 1, 1, 0), u));
  auto it = s.find("pp0.tp1/model/layers.2.input_layernorm.weight");
  ASSERT_NE(it, s.end());
  it->second.as<uint16_t>()[5] ^= 1;
  EXPECT_THAT(Convert(m, L(2, 1, 1, 0), layout::UniversalLayout(), s),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("parameter \"layers.2.input_layernorm.weight\" state \"model\": "
                                 "replicated copies differ")));
  // Tied embeddings: the last stage's copy is checked against the first stage's.
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap p, Convert(m, layout::UniversalLayout(), L(1, 2, 1, 1), u));
  auto emb = p.find("pp1.tp0/model/embedding.word_embeddings.weight");
  ASSERT_NE(emb, p.end());
  emb->second.as<uint16_t>()[0] ^= 0x8000;
  EXPECT_THAT(
      Convert(m, L(1, 2, 1, 1), layout::UniversalLayout(), p),
      StatusIs(StatusCode::kDataLoss, HasSubstr("parameter \"embedding.word_embeddings.weight\"")));
}

TEST(PadStrip, PaddedRowsAreZeroInModelAndOptimizerStates) {
  ResolvedModel m = Load("gpt-tiny", DType::kFp32);
  TensorMap u = RandomUniversal(m, {}, 4);
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap s, Convert(m, layout::UniversalLayout(), L(4, 1, 1, 0), u));
  const Tensor& slice = s.at("pp0.tp3/model/embedding.word_embeddings.weight");
  ASSERT_EQ(slice.shape(), (Shape{64, 64}));  // 250 -> 256 rows, 64 per rank
  const Tensor& full = u.at("embedding.word_embeddings.weight/model");
  EXPECT_EQ(std::memcmp(slice.data(), full.data() + 192 * 64 * 4, 58 * 64 * 4), 0);
  const Tensor& adam = s.at("pp0.tp3/optim/embedding.word_embeddings.weight/exp_avg");
  for (int64_t e = 58 * 64; e < 64 * 64; ++e) {
    ASSERT_EQ(slice.as<uint32_t>()[e], 0u);
    ASSERT_EQ(adam.as<uint32_t>()[e], 0u);
  }
}

TEST(Fuse, MegatronInterleavedQkvTakesWholeGroups) {
  ResolvedModel m = Load("llama-tiny", DType::kFp32);
  TensorMap u = RandomUniversal(m, {}, 5);
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap s, Convert(m, layout::UniversalLayout(), L(2, 1, 1, 0), u));
  // 4 groups of (2 q heads + k + v) * head_dim 8 = 32 rows; tp rank 1 holds groups 2 and 3.
  const Tensor& full = u.at("layers.1.self_attention.query_key_value.weight/model");
  const Tensor& r1 = s.at("pp0.tp1/model/layers.1.self_attention.query_key_value.weight");
  ASSERT_EQ(r1.shape(), (Shape{64, 64}));
  EXPECT_EQ(std::memcmp(r1.data(), full.data() + 64 * 64 * 4, 64 * 64 * 4), 0);
  // SwiGLU: rank 1 holds [gate rows 48..95 | up rows 144..191].
  const Tensor& fc1 = u.at("layers.1.mlp.dense_h_to_4h.weight/model");
  const Tensor& f1 = s.at("pp0.tp1/model/layers.1.mlp.dense_h_to_4h.weight");
  EXPECT_EQ(std::memcmp(f1.data(), fc1.data() + 48 * 64 * 4, 48 * 64 * 4), 0);
  EXPECT_EQ(std::memcmp(f1.data() + 48 * 64 * 4, fc1.data() + 144 * 64 * 4, 48 * 64 * 4), 0);
}

// llama-tiny (hidden 64, 8 heads, head_dim 8) with `kv_heads` query groups, under `family`.
ResolvedModel LlamaWithKvHeads(int64_t kv_heads, DType dtype, const std::string& family) {
  auto spec = patterns::LoadModel(kData, "llama-tiny");
  UCP_CHECK(spec.ok()) << spec.status();
  auto rules = patterns::LoadRuleSet(kData, family);
  UCP_CHECK(rules.ok()) << rules.status();
  spec->family = family;
  spec->templates = rules->templates;
  spec->hyper["kv_heads"] = kv_heads;
  auto m = patterns::Resolve(*spec, *rules);
  UCP_CHECK(m.ok()) << m.status();
  for (auto& p : m->params) p.dtype = dtype;
  return *m;
}

// tp above the query groups (Megatron-Core, PR #2565): linear_qkv (and its bias) stays a plain
// column-parallel split of the per-group interleaved rows, KV heads are not replicated. Round
// trips through it are exact, and rank r's rows of every state are rows [r*R/tp, (r+1)*R/tp).
void ExpectTpAboveGroups(const ResolvedModel& m, const std::string& param, int tp,
                         int64_t rows_per_rank, const Layout& via, uint64_t seed) {
  SCOPED_TRACE(m.spec.family + " kv_heads=" + std::to_string(m.spec.hyper.at("kv_heads")) +
               " tp=" + std::to_string(tp) + " via " + layout::ToString(via));
  TensorMap u = RandomUniversal(m, {}, seed);
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap t1, Convert(m, layout::UniversalLayout(), L(1, 1, 1, 0), u));
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap mid, Convert(m, L(1, 1, 1, 0), via, t1));
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap t1_back, Convert(m, via, L(1, 1, 1, 0), mid));
  EXPECT_TRUE(SameTensors(t1, t1_back));
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap back,
                           Convert(m, L(1, 1, 1, 0), layout::UniversalLayout(), t1_back));
  EXPECT_TRUE(SameTensors(u, back));
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap s, Convert(m, layout::UniversalLayout(), L(tp, 1, 1, 0), u));
  for (const char* state : {"model", "fp32", "exp_avg", "exp_avg_sq"}) {
    const Tensor& full = u.at(param + "/" + state);
    const int64_t row_bytes = full.num_bytes() / full.shape()[0];
    for (int r = 0; r < tp; ++r) {
      const std::string prefix = "pp0.tp" + std::to_string(r);
      const std::string name = std::string(state) == "model"
                                   ? prefix + "/model/" + param
                                   : prefix + "/optim/" + param + "/" + state;
      const Tensor& slice = s.at(name);
      ASSERT_EQ(slice.shape()[0], rows_per_rank) << name;
      EXPECT_EQ(std::memcmp(slice.data(), full.data() + r * rows_per_rank * row_bytes,
                            rows_per_rank * row_bytes),
                0)
          << name;
    }
  }
}

TEST(Fuse, TpAboveQueryGroupsSplitsRowsEvenlyAndRoundTrips) {
  // GQA nh=8, nkv=2: a group is [q0..q3 | k | v] = 48 rows; tp=4 gives 24 rows per rank
  // (rank 1 = q3 | k0 | v0), tp=1 -> tp=4 (pp=2, ZeRO-1 over dp=2) -> tp=1 is exact.
  ExpectTpAboveGroups(LlamaWithKvHeads(2, DType::kBf16, "llama"),
                      "layers.1.self_attention.query_key_value.weight", 4, 24, L(4, 2, 2, 1), 21);
  // MQA: one group of 80 rows, tp=2 gives 40 per rank (rank 1 = q5 q6 q7 | k | v).
  ExpectTpAboveGroups(LlamaWithKvHeads(1, DType::kFp32, "llama"),
                      "layers.2.self_attention.query_key_value.weight", 2, 40, L(2, 2, 1, 0), 22);
  // Qwen2: the fused bias follows its weight rows.
  const ResolvedModel qwen = LlamaWithKvHeads(2, DType::kBf16, "qwen2");
  ExpectTpAboveGroups(qwen, "layers.0.self_attention.query_key_value.bias", 4, 24, L(4, 2, 1, 3),
                      23);
  ExpectTpAboveGroups(qwen, "layers.0.self_attention.query_key_value.weight", 8, 12, L(8, 1, 2, 2),
                      24);
}

// A synthetic family exercising plain [q|k|v] fusion with GQA (uneven parts), average, a
// row-parallel shard, an ep-sharded stacked expert tensor and a scalar.
constexpr const char* kSynthetic = R"({
  "family": "synthetic",
  "parameters": [
    {"name": "qkv.weight", "shape": ["(heads+2*kv_heads)*head_dim", "hidden"]},
    {"name": "avg.weight", "shape": ["hidden"]},
    {"name": "row.weight", "shape": ["hidden", "hidden"]},
    {"name": "stacked.weight", "shape": ["num_experts", "hidden", "2"]},
    {"name": "scale", "shape": []}
  ],
  "pipeline": {"layer_pattern": "layers\\.(\\d+)\\..*", "first_stage": [".*"], "last_stage": []},
  "rules": [
    {"match": "qkv\\.weight", "kind": "fuse", "dim": 0, "order": "concat",
     "parts": [{"name": "q", "size": "heads*head_dim"}, {"name": "k", "size": "kv_heads*head_dim"},
               {"name": "v", "size": "kv_heads*head_dim"}], "source": "test"},
    {"match": "avg\\.weight", "kind": "average", "source": "test"},
    {"match": "row\\.weight", "kind": "shard", "dim": 1, "axis": "tp", "source": "test"},
    {"match": "stacked\\.weight", "kind": "shard", "dim": 0, "axis": "ep", "source": "test"},
    {"match": "scale", "kind": "replicate", "source": "test"}
  ]
})";

ResolvedModel Synthetic() {
  auto rs = patterns::ParseRuleSet(kSynthetic, "synthetic.json");
  UCP_CHECK(rs.ok()) << rs.status();
  patterns::ModelSpec spec;
  spec.name = "synthetic";
  spec.family = "synthetic";
  spec.dtype = DType::kFp32;
  spec.hyper = {{"hidden", 8},   {"heads", 4},  {"kv_heads", 2},
                {"head_dim", 2}, {"layers", 0}, {"num_experts", 4}};
  spec.templates = rs->templates;
  auto m = patterns::Resolve(spec, *rs);
  UCP_CHECK(m.ok()) << m.status();
  return *m;
}

TEST(Synthetic, RoundTripsOverLayouts) {
  ResolvedModel m = Synthetic();
  for (const Layout& l :
       {L(1, 1, 1, 0), L(2, 1, 2, 1), L(2, 1, 4, 3, 1, 4), L(2, 1, 4, 2, 2, 2), L(1, 1, 3, 1)}) {
    ExpectRoundTrip(m, l, 9);
  }
}

TEST(Synthetic, PlainQkvOrderShardsEachPartSeparately) {
  ResolvedModel m = Synthetic();
  TensorMap u = RandomUniversal(m, {}, 10);
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap s, Convert(m, layout::UniversalLayout(), L(2, 1, 1, 0), u));
  // q 8 rows, k 4, v 4 (x 8 cols); rank 1 = [q rows 4..7 | k rows 10..11 | v rows 14..15].
  const Tensor& full = u.at("qkv.weight/model");
  const Tensor& r1 = s.at("pp0.tp1/model/qkv.weight");
  ASSERT_EQ(r1.shape(), (Shape{8, 8}));
  const auto f = full.as<uint32_t>();
  const auto r = r1.as<uint32_t>();
  const int rows[] = {4, 5, 6, 7, 10, 11, 14, 15};
  for (int i = 0; i < 8; ++i) {
    for (int c = 0; c < 8; ++c) ASSERT_EQ(r[i * 8 + c], f[rows[i] * 8 + c]) << i << "," << c;
  }
}

TEST(Synthetic, AverageRuleAveragesDivergedCopies) {
  ResolvedModel m = Synthetic();
  TensorMap u = RandomUniversal(m, {}, 11);
  for (auto& [name, t] : u) {
    for (float& x : t.as<float>()) x = 1.0f;  // finite values: the average is arithmetic here
  }
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap s, Convert(m, layout::UniversalLayout(), L(4, 1, 1, 0), u));
  for (int t = 0; t < 4; ++t) {
    auto x = s.at("pp0.tp" + std::to_string(t) + "/model/avg.weight").as<float>();
    for (int e = 0; e < 8; ++e) x[e] = static_cast<float>(t * 8 + e);
  }
  UCP_ASSERT_OK_AND_ASSIGN(TensorMap back, Convert(m, L(4, 1, 1, 0), layout::UniversalLayout(), s));
  auto avg = back.at("avg.weight/model").as<float>();
  for (int e = 0; e < 8; ++e) EXPECT_EQ(avg[e], static_cast<float>((0 + 8 + 16 + 24) / 4 + e));
}

// AdamW, scalar reference (no clipping): the same element-wise arithmetic on any partition.
void AdamStep(std::span<float> w, std::span<float> m, std::span<float> v, std::span<const float> g,
              int step) {
  const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  const float bc1 = 1.0f - std::pow(b1, static_cast<float>(step));
  const float bc2 = 1.0f - std::pow(b2, static_cast<float>(step));
  for (size_t i = 0; i < w.size(); ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    const float mhat = m[i] / bc1;
    const float vhat = v[i] / bc2;
    w[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * w[i]);
  }
}

TEST(Adam, StepThenShardEqualsShardThenStep) {
  PlanOptions o;
  o.model_slices = false;
  o.optimizer_states = {"fp32", "exp_avg", "exp_avg_sq", "grad"};
  for (const char* preset : {"llama-tiny", "mixtral-tiny"}) {
    ResolvedModel m = Load(preset, DType::kBf16);
    for (const Layout& l : {L(2, 2, 3, 1), L(2, 1, 4, 3, 1, 2), L(1, 1, 2, 0), L(2, 2, 2, 2, 2)}) {
      SCOPED_TRACE(std::string(preset) + " " + layout::ToString(l));
      ucp::testing::Gen g(42);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      TensorMap u;
      UCP_ASSERT_OK_AND_ASSIGN(auto infos, DescribeLayout(m, layout::UniversalLayout(), o));
      for (const TensorInfo& t : infos) {
        Tensor x = std::move(Tensor::Zeros(t.dtype, t.shape)).value();
        for (float& f : x.as<float>())
          f = t.state == "exp_avg_sq" ? std::abs(nd(g.rng())) : nd(g.rng());
        u.emplace(t.name, std::move(x));
      }
      UCP_ASSERT_OK_AND_ASSIGN(TensorMap sharded, Convert(m, layout::UniversalLayout(), l, u, o));
      // Step the full tensors.
      for (const auto& p : m.params) {
        AdamStep(u.at(p.name + "/fp32").as<float>(), u.at(p.name + "/exp_avg").as<float>(),
                 u.at(p.name + "/exp_avg_sq").as<float>(), u.at(p.name + "/grad").as<float>(), 3);
      }
      // Step each rank's tensors (fragments, or slices for ZeRO-0), padding included.
      for (auto& [name, t] : sharded) {
        if (!name.ends_with("/fp32")) continue;
        const std::string stem = name.substr(0, name.size() - 4);
        AdamStep(t.as<float>(), sharded.at(stem + "exp_avg").as<float>(),
                 sharded.at(stem + "exp_avg_sq").as<float>(), sharded.at(stem + "grad").as<float>(),
                 3);
      }
      UCP_ASSERT_OK_AND_ASSIGN(TensorMap expected, Convert(m, layout::UniversalLayout(), l, u, o));
      EXPECT_TRUE(SameTensors(expected, sharded));
    }
  }
}

TEST(Plan, CoverageCatchesDoubleAndMissingWrites) {
  ResolvedModel m = Load("gpt-tiny", DType::kBf16);
  UCP_ASSERT_OK_AND_ASSIGN(Plan plan, PlanConversion(m, layout::UniversalLayout(), L(2, 1, 2, 1)));
  UCP_ASSERT_OK(CheckCoverage(plan));
  Plan doubled = plan;
  doubled.ops.push_back(doubled.ops.front());
  EXPECT_THAT(CheckCoverage(doubled),
              StatusIs(StatusCode::kInternal, HasSubstr("is written at least 2 times")));
  Plan missing = plan;
  missing.ops.erase(missing.ops.begin());
  EXPECT_THAT(CheckCoverage(missing),
              StatusIs(StatusCode::kInternal, HasSubstr("is written 0 times")));
  Plan outside = plan;
  outside.ops.front().dst.offset = 1 << 30;
  EXPECT_THAT(CheckCoverage(outside), StatusIs(StatusCode::kInternal, HasSubstr("outside")));
}

TEST(Plan, NamesSummaryAndJson) {
  ResolvedModel m = Load("mixtral-tiny", DType::kBf16);
  UCP_ASSERT_OK_AND_ASSIGN(Plan plan,
                           PlanConversion(m, layout::UniversalLayout(), L(2, 2, 2, 1, 1, 2)));
  std::set<std::string> names;
  for (const auto& t : plan.targets) names.insert(t.name);
  EXPECT_TRUE(names.contains("pp0.tp1/model/embedding.word_embeddings.weight"));
  EXPECT_TRUE(names.contains("pp1.tp0.ep1/model/layers.0.mlp.experts.1.linear_fc1.weight"));
  EXPECT_TRUE(names.contains("pp1.tp1.ep0/zero/g0.f0/exp_avg"));
  EXPECT_TRUE(names.contains("pp0.tp0/zero/g1.f1/fp32"));
  int64_t bytes = 0, expect = 0;
  for (const RankSummary& r : Summarize(plan)) bytes += r.bytes_written;
  for (const auto& t : plan.targets) expect += NumElementsOrDie(t.shape) * DTypeSizeBytes(t.dtype);
  EXPECT_EQ(bytes, expect);
  const std::string json = PlanToJson(plan);
  EXPECT_THAT(json, HasSubstr("\"from\":\"universal\""));
  EXPECT_THAT(json, HasSubstr("\"kind\":\"fill\""));
  EXPECT_THAT(json, HasSubstr("\"name\":\"pp1.tp1.ep0/zero/g0.f0/exp_avg\""));
}

}  // namespace
}  // namespace ucp::convert
