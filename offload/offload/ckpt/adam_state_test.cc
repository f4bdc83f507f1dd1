// Tests of the Adam state <-> universal checkpoint bridge: bitwise round trips (with and without
// amsgrad), the element-wise property across any fragmenting of a restored state on every path
// this machine runs, and one error per rule.
#include "offload/ckpt/adam_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/universal/universal_checkpoint.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// Owns the buffers behind one AdamParamState.
struct Owned {
  std::string name;
  Shape shape;
  std::vector<float> p, m, v, vmax;

  AdamParamState State() {
    return {name, shape, p, m, v, vmax};
  }
};

Owned Random(std::string name, Shape shape, uint64_t seed, bool amsgrad) {
  Owned o{std::move(name), std::move(shape), {}, {}, {}, {}};
  const int64_t n = *NumElements(o.shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < n; ++i) {
    o.p.push_back(0.02f * normal(rng));
    o.m.push_back(1e-3f * normal(rng));
    const float v = 1e-3f * normal(rng);
    o.v.push_back(v * v);
    if (amsgrad) o.vmax.push_back(o.v.back() * 1.5f);
  }
  return o;
}

Owned ZerosLike(const Owned& o) {
  const size_t n = o.p.size();
  return {o.name, o.shape, std::vector<float>(n, -1.f), std::vector<float>(n, -1.f),
          std::vector<float>(n, -1.f), std::vector<float>(o.vmax.size(), -1.f)};
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<SimdPath> Paths() {
  std::vector<SimdPath> out;
  for (SimdPath p : {SimdPath::kScalarRef, SimdPath::kPortable, SimdPath::kAvx2,
                     SimdPath::kAvx512, SimdPath::kNeon, SimdPath::kSve}) {
    if (SimdPathAvailable(p)) out.push_back(p);
  }
  return out;
}

class RoundTrip : public ::testing::TestWithParam<bool> {};

TEST_P(RoundTrip, IsBitwise) {
  const bool amsgrad = GetParam();
  AdamConfig config;
  config.lr = 3e-4f;
  config.beta1 = 0.85f;
  config.beta2 = 0.995f;
  config.eps = 1e-6f;
  config.weight_decay = 0.1f;
  config.decoupled = !amsgrad;  // both kinds, adam and adamw
  config.amsgrad = amsgrad;
  config.bias_correction = amsgrad;
  std::vector<Owned> src = {Random("h.0.attn.c_attn.weight", {16, 48}, 1, amsgrad),
                            Random("h.0.ln_1.bias", {16}, 2, amsgrad),
                            Random("scale", {}, 3, amsgrad), Random("empty", {0, 4}, 4, amsgrad)};
  std::vector<AdamParamState> states;
  for (auto& o : src) states.push_back(o.State());
  testing::TempDir tmp;
  const auto dir = tmp.path() / "ckpt";
  UCP_ASSERT_OK(SaveAdamCheckpoint(dir, config, 41, states));

  std::vector<Owned> dst;
  for (auto& o : src) dst.push_back(ZerosLike(o));
  std::vector<AdamParamState> into;
  for (auto& o : dst) into.push_back(o.State());
  UCP_ASSERT_OK_AND_ASSIGN(AdamCheckpointInfo info, LoadAdamCheckpoint(dir, into));
  EXPECT_EQ(info.step, 41);
  EXPECT_EQ(info.config.lr, config.lr);
  EXPECT_EQ(info.config.beta1, config.beta1);
  EXPECT_EQ(info.config.beta2, config.beta2);
  EXPECT_EQ(info.config.eps, config.eps);
  EXPECT_EQ(info.config.weight_decay, config.weight_decay);
  EXPECT_EQ(info.config.decoupled, config.decoupled);
  EXPECT_EQ(info.config.amsgrad, config.amsgrad);
  EXPECT_EQ(info.config.bias_correction, config.bias_correction);
  for (size_t i = 0; i < src.size(); ++i) {
    SCOPED_TRACE(src[i].name);
    EXPECT_TRUE(BitwiseEqual(src[i].p, dst[i].p));
    EXPECT_TRUE(BitwiseEqual(src[i].m, dst[i].m));
    EXPECT_TRUE(BitwiseEqual(src[i].v, dst[i].v));
    EXPECT_TRUE(BitwiseEqual(src[i].vmax, dst[i].vmax));
  }
  UCP_ASSERT_OK_AND_ASSIGN(AdamCheckpointInfo only, ReadAdamCheckpointInfo(dir));
  EXPECT_EQ(only.step, 41);
  EXPECT_EQ(only.config.decoupled, config.decoupled);
}

INSTANTIATE_TEST_SUITE_P(Amsgrad, RoundTrip, ::testing::Bool());

// Steps a restored state as one span and as k seeded contiguous fragments (like a ZeRO shard of
// any layout): the concatenation equals the whole, bitwise, on every path.
TEST(AdamCheckpoint, FragmentsOfRestoredStateStepLikeTheWhole) {
  AdamConfig config;
  config.lr = 1e-3f;
  config.weight_decay = 0.01f;
  const int64_t n = 10007;
  Owned saved = Random("w", {n}, 7, false);
  testing::TempDir tmp;
  std::vector<AdamParamState> st = {saved.State()};
  UCP_ASSERT_OK(SaveAdamCheckpoint(tmp.path() / "ckpt", config, 9, st));
  std::vector<float> grad(n);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 1e-2f);
  for (float& g : grad) g = normal(rng);

  for (SimdPath path : Paths()) {
    SCOPED_TRACE(std::string(SimdPathName(path)));
    Owned whole = ZerosLike(saved);
    std::vector<AdamParamState> into = {whole.State()};
    UCP_ASSERT_OK_AND_ASSIGN(AdamCheckpointInfo info,
                             LoadAdamCheckpoint(tmp.path() / "ckpt", into));
    Owned parts = whole;
    AdamSpans all{whole.p, GradSpan::Fp32(grad), whole.m, whole.v, {}, {}};
    UCP_ASSERT_OK(AdamStep(info.config, info.step + 1, all, path));
    for (int seed = 0; seed < testing::NumSeeds(5); ++seed) {
      Owned frag = parts;
      testing::Gen gen(static_cast<uint64_t>(seed));
      const int64_t k = gen.Int(1, 9);
      std::vector<int64_t> cuts = {0, n};
      for (int64_t j = 1; j < k; ++j) cuts.push_back(gen.Int(0, n));
      std::sort(cuts.begin(), cuts.end());
      for (size_t j = 0; j + 1 < cuts.size(); ++j) {
        const auto b = static_cast<size_t>(cuts[j]);
        const auto len = static_cast<size_t>(cuts[j + 1] - cuts[j]);
        AdamSpans s{std::span<float>(frag.p).subspan(b, len),
                    GradSpan::Fp32(std::span<const float>(grad).subspan(b, len)),
                    std::span<float>(frag.m).subspan(b, len),
                    std::span<float>(frag.v).subspan(b, len),
                    {},
                    {}};
        UCP_ASSERT_OK(AdamStep(info.config, info.step + 1, s, path));
      }
      EXPECT_TRUE(BitwiseEqual(frag.p, whole.p)) << "seed " << seed << ", " << k << " fragments";
      EXPECT_TRUE(BitwiseEqual(frag.m, whole.m)) << "seed " << seed;
      EXPECT_TRUE(BitwiseEqual(frag.v, whole.v)) << "seed " << seed;
    }
    // The step did something: the state is not the restored one.
    EXPECT_FALSE(BitwiseEqual(whole.p, saved.p));
  }
}

TEST(AdamCheckpoint, SaveRejectsASpanOfTheWrongSize) {
  Owned o = Random("w", {4, 4}, 1, false);
  o.m.resize(15);
  std::vector<AdamParamState> st = {o.State()};
  testing::TempDir tmp;
  EXPECT_THAT(SaveAdamCheckpoint(tmp.path() / "c", AdamConfig{}, 1, st),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("parameter 'w' state 'exp_avg' has 15 elements, its shape has 16")));
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "c"));
}

TEST(AdamCheckpoint, SaveRequiresMaxExpAvgSqWithAmsgrad) {
  Owned o = Random("w", {3}, 1, false);
  std::vector<AdamParamState> st = {o.State()};
  AdamConfig c;
  c.amsgrad = true;
  testing::TempDir tmp;
  EXPECT_THAT(SaveAdamCheckpoint(tmp.path() / "c", c, 1, st),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("state 'max_exp_avg_sq' has 0 elements, its shape has 3")));
}

TEST(AdamCheckpoint, SaveRejectsNegativeStepAndBadConfigAndExistingDst) {
  Owned o = Random("w", {3}, 1, false);
  std::vector<AdamParamState> st = {o.State()};
  testing::TempDir tmp;
  EXPECT_THAT(SaveAdamCheckpoint(tmp.path() / "c", AdamConfig{}, -1, st),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("step is -1")));
  AdamConfig bad;
  bad.beta2 = 1.0f;
  EXPECT_THAT(SaveAdamCheckpoint(tmp.path() / "c", bad, 1, st),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("beta2")));
  UCP_ASSERT_OK(SaveAdamCheckpoint(tmp.path() / "c", AdamConfig{}, 1, st));
  EXPECT_THAT(SaveAdamCheckpoint(tmp.path() / "c", AdamConfig{}, 1, st),
              StatusIs(StatusCode::kAlreadyExists, ::testing::_));
}

TEST(AdamCheckpoint, LoadRejectsShapeMismatchAndMissingParameter) {
  Owned o = Random("w", {2, 3}, 1, false);
  std::vector<AdamParamState> st = {o.State()};
  testing::TempDir tmp;
  UCP_ASSERT_OK(SaveAdamCheckpoint(tmp.path() / "c", AdamConfig{}, 5, st));
  Owned other = ZerosLike(o);
  other.shape = {3, 2};
  std::vector<AdamParamState> into = {other.State()};
  EXPECT_THAT(LoadAdamCheckpoint(tmp.path() / "c", into),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("parameter 'w' has shape [2, 3]")));
  Owned missing = ZerosLike(o);
  missing.name = "nope";
  into = {missing.State()};
  EXPECT_THAT(LoadAdamCheckpoint(tmp.path() / "c", into),
              StatusIs(StatusCode::kNotFound, HasSubstr("nope")));
}

// A checkpoint written by another optimizer, or missing a hyper-parameter, is refused.
Status WriteWithHeader(const std::filesystem::path& dir, io::UniversalManifest h) {
  std::vector<float> x(2, 0.5f);
  const ConstTensorView view{DType::kFp32, {2},
                             {reinterpret_cast<const std::byte*>(x.data()), 8}};
  UCP_ASSIGN_OR_RETURN(io::UniversalWriter w, io::UniversalWriter::Create(dir, {.step = h.step}));
  std::vector<io::NamedState> states = {{"fp32", view}, {"exp_avg", view}, {"exp_avg_sq", view}};
  UCP_RETURN_IF_ERROR(w.WriteParameter({.name = "w", .shape = {2}}, states));
  return w.Commit(h);
}

TEST(AdamCheckpoint, InfoRejectsOtherOptimizersMissingHyperAndBadFlags) {
  testing::TempDir tmp;
  io::UniversalManifest h;
  h.step = 3;
  h.optimizer_kind = "sgd";
  h.optimizer_states = {"exp_avg", "exp_avg_sq"};
  UCP_ASSERT_OK(WriteWithHeader(tmp.path() / "sgd", h));
  EXPECT_THAT(ReadAdamCheckpointInfo(tmp.path() / "sgd"),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("optimizer kind is 'sgd'")));

  h.optimizer_kind = "adamw";
  h.hyper = {{"lr", 1e-3}, {"beta1", 0.9}, {"beta2", 0.999}, {"weight_decay", 0.0}};
  UCP_ASSERT_OK(WriteWithHeader(tmp.path() / "noeps", h));
  EXPECT_THAT(ReadAdamCheckpointInfo(tmp.path() / "noeps"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("optimizer.hyper has no 'eps'")));

  h.hyper["eps"] = 1e-8;
  h.hyper["amsgrad"] = 0.5;
  UCP_ASSERT_OK(WriteWithHeader(tmp.path() / "flag", h));
  EXPECT_THAT(ReadAdamCheckpointInfo(tmp.path() / "flag"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("'amsgrad' is 0.500000, must be 0 or 1")));

  // Absent flags take torch's defaults.
  h.hyper.erase("amsgrad");
  UCP_ASSERT_OK(WriteWithHeader(tmp.path() / "defaults", h));
  UCP_ASSERT_OK_AND_ASSIGN(AdamCheckpointInfo info,
                           ReadAdamCheckpointInfo(tmp.path() / "defaults"));
  EXPECT_FALSE(info.config.amsgrad);
  EXPECT_TRUE(info.config.bias_correction);
  EXPECT_TRUE(info.config.decoupled);
  EXPECT_EQ(info.step, 3);
}

}  // namespace
}  // namespace ucp::offload
