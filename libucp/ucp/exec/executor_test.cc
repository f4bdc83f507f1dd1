// The file executor against the in-memory reference (convert/apply.h): same bytes for every
// target over several models and layout pairs, under a tiny memory budget and many threads;
// failed checks, bad plans and byte sizes.
#include "ucp/exec/executor.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "tests/testutil/status_matchers.h"
#include "ucp/convert/apply.h"
#include "ucp/patterns/model.h"
#include "ucp/tensor/cast.h"

namespace ucp::exec {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

class MapSource final : public TensorSource {
 public:
  explicit MapSource(const convert::TensorMap& m) : m_(m) {}
  Status ReadFlatRange(const convert::TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    auto it = m_.find(t.name);
    if (it == m_.end()) return NotFoundError("no tensor " + t.name);
    const int64_t size = DTypeSizeBytes(t.dtype);
    if (end > it->second.num_elements() ||
        static_cast<int64_t>(out.size()) != (end - begin) * size) {
      return OutOfRangeError("range outside " + t.name);
    }
    std::memcpy(out.data(), it->second.data() + begin * size, out.size());
    return Status::Ok();
  }

 private:
  const convert::TensorMap& m_;
};

// Collects targets, checking the sink contract: Begin, then consecutive ranges covering the
// tensor in order, then Finish.
class MapSink final : public TensorSink {
 public:
  Status Begin(const convert::TensorInfo& t) override {
    std::lock_guard<std::mutex> lock(mu_);
    Result<Tensor> z = Tensor::Zeros(t.dtype, t.shape);
    if (!z.ok()) return z.status();
    if (!pending_.emplace(t.name, Pending{std::move(*z), 0}).second || out.count(t.name)) {
      return AlreadyExistsError(t.name);
    }
    return Status::Ok();
  }
  Status WriteRange(const convert::TensorInfo& t, int64_t begin, int64_t end,
                    std::span<const std::byte> data) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(t.name);
    if (it == pending_.end()) return FailedPreconditionError("range before Begin: " + t.name);
    Pending& p = it->second;
    const int64_t size = DTypeSizeBytes(t.dtype);
    if (begin != p.next || end <= begin ||
        static_cast<int64_t>(data.size()) != (end - begin) * size) {
      return InvalidArgumentError("range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                  ") out of order for " + t.name);
    }
    std::memcpy(p.tensor.data() + begin * size, data.data(), data.size());
    p.next = end;
    ++ranges;
    return Status::Ok();
  }
  Status Finish(const convert::TensorInfo& t) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(t.name);
    if (it == pending_.end()) return FailedPreconditionError("Finish before Begin: " + t.name);
    if (it->second.next != it->second.tensor.num_elements()) {
      return FailedPreconditionError("Finish of incomplete " + t.name);
    }
    out.emplace(t.name, std::move(it->second.tensor));
    pending_.erase(it);
    return Status::Ok();
  }
  convert::TensorMap out;
  int64_t ranges = 0;

 private:
  struct Pending {
    Tensor tensor;
    int64_t next = 0;
  };
  std::mutex mu_;
  std::map<std::string, Pending> pending_;
};

patterns::ResolvedModel Load(const std::string& name) {
  const char* src = std::getenv("UCP_SOURCE_DIR");
  const std::string dir = std::string(src ? src : ".") + "/patterns";
  auto spec = patterns::LoadModel(dir, name);
  EXPECT_TRUE(spec.ok()) << spec.status();
  auto rules = patterns::LoadRuleSet(dir, spec->family);
  EXPECT_TRUE(rules.ok()) << rules.status();
  auto model = patterns::Resolve(*spec, *rules);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

// Random universal tensors, sharded to `from` by the reference executor.
convert::TensorMap SourceAt(const patterns::ResolvedModel& model, const layout::Layout& from) {
  auto plan = convert::PlanConversion(model, layout::UniversalLayout(), from);
  EXPECT_TRUE(plan.ok()) << plan.status();
  convert::TensorMap universal;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const auto& t : plan->sources) {
    Tensor f = *Tensor::Zeros(DType::kFp32, t.shape);
    for (float& x : f.as<float>()) x = u(rng);
    Tensor c = *Tensor::Zeros(t.dtype, t.shape);
    EXPECT_TRUE(
        CastElements(DType::kFp32, f.view().bytes, t.dtype, c.view().bytes, f.num_elements()).ok());
    universal.emplace(t.name, std::move(c));
  }
  auto sharded = convert::ApplyPlan(*plan, universal);
  EXPECT_TRUE(sharded.ok()) << sharded.status();
  return std::move(*sharded);
}

struct Case {
  std::string model, from, to;
  int64_t window_bytes = 0;  // 0: the default; small values cut every tensor into many windows
};

class ExecutorMatchesReference : public ::testing::TestWithParam<Case> {};

TEST_P(ExecutorMatchesReference, SameBytes) {
  const Case& c = GetParam();
  patterns::ResolvedModel model = Load(c.model);
  layout::Layout from = *layout::ParseLayout(c.from), to = *layout::ParseLayout(c.to);
  convert::TensorMap src = SourceAt(model, from);
  UCP_ASSERT_OK_AND_ASSIGN(convert::Plan plan, convert::PlanConversion(model, from, to));
  UCP_ASSERT_OK_AND_ASSIGN(convert::TensorMap expected, convert::ApplyPlan(plan, src));
  MapSource source(src);
  MapSink sink;
  ExecOptions opts;
  opts.memory_limit_bytes = 4096;  // forces one target at a time most of the time
  opts.window_bytes = c.window_bytes;
  int64_t last = 0;
  std::mutex mu;
  opts.progress = [&](int64_t done, int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    last = std::max(last, done);
  };
  UCP_ASSERT_OK_AND_ASSIGN(ExecStats stats, ExecutePlan(plan, source, sink, opts));
  EXPECT_EQ(stats.targets_written, static_cast<int64_t>(plan.targets.size()));
  EXPECT_GT(last, 0);
  ASSERT_EQ(sink.out.size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(sink.out.count(name)) << name;
    EXPECT_TRUE(BitwiseEqual(sink.out.at(name).view(), t.view())) << name;
  }
  if (c.window_bytes > 0) {
    EXPECT_GT(sink.ranges, static_cast<int64_t>(plan.targets.size()));
  }
  // One target alone gives the same bytes.
  UCP_ASSERT_OK_AND_ASSIGN(Tensor one, MaterializeTarget(plan, 0, source));
  EXPECT_TRUE(BitwiseEqual(one.view(), expected.at(plan.targets[0].name).view()));
  // So does any range of any target.
  const PlanIndex index(plan);
  std::mt19937_64 rng(11);
  for (int k = 0; k < 50; ++k) {
    const int32_t i = static_cast<int32_t>(rng() % plan.targets.size());
    const Tensor& want = expected.at(plan.targets[i].name);
    const int64_t n = want.num_elements();
    if (n == 0) continue;
    const int64_t b = static_cast<int64_t>(rng() % n);
    const int64_t e = b + 1 + static_cast<int64_t>(rng() % (n - b));
    const int64_t size = DTypeSizeBytes(want.dtype());
    std::vector<std::byte> got(static_cast<size_t>((e - b) * size));
    UCP_ASSERT_OK(BuildTargetRange(index, i, source, b, e, got));
    EXPECT_EQ(std::memcmp(got.data(), want.data() + b * size, got.size()), 0)
        << plan.targets[i].name << " [" << b << ", " << e << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ExecutorMatchesReference,
    ::testing::Values(Case{"gpt-tiny", "tp=2,pp=2,dp=2,zero=1", "tp=4,pp=1,dp=2,zero=1"},
                      Case{"gpt-tiny", "tp=4,pp=1,dp=2,zero=1", "tp=1,pp=4,dp=1,zero=2"},
                      Case{"gpt-tiny", "tp=2,pp=2,dp=2,zero=1", "universal"},
                      Case{"llama-tiny", "tp=2,pp=1,dp=2,zero=3", "tp=1,pp=2,dp=1,zero=0"},
                      Case{"mixtral-tiny", "tp=1,pp=1,dp=2,ep=2,zero=1", "tp=2,pp=1,dp=1"},
                      // Windows of a few elements: every op is clipped, rows are cut.
                      Case{"gpt-tiny", "tp=2,pp=2,dp=2,zero=1", "tp=4,pp=1,dp=2,zero=1", 100},
                      Case{"gpt-tiny", "tp=4,pp=1,dp=2,zero=1", "universal", 36},
                      Case{"llama-tiny", "universal", "tp=4,pp=2,dp=1,zero=1", 4096},
                      Case{"llama-tiny", "tp=2,pp=1,dp=2,zero=3", "tp=1,pp=2,dp=1,zero=0", 100},
                      Case{"mixtral-tiny", "tp=1,pp=1,dp=2,ep=2,zero=1", "tp=2,pp=1,dp=1", 52}));

TEST(ExecutorTest, ReplicasThatDifferFailTheCheck) {
  patterns::ResolvedModel model = Load("gpt-tiny");
  layout::Layout from = *layout::ParseLayout("tp=2,pp=1,dp=1");
  convert::TensorMap src = SourceAt(model, from);
  UCP_ASSERT_OK_AND_ASSIGN(convert::Plan plan,
                           convert::PlanConversion(model, from, layout::UniversalLayout()));
  const convert::Op* check = nullptr;
  for (const auto& op : plan.ops) {
    if (op.kind == convert::OpKind::kCheckEqual) check = &op;
  }
  ASSERT_NE(check, nullptr);
  Tensor& t = src.at(plan.sources[check->srcs[1].tensor].name);
  t.data()[check->srcs[1].offset * DTypeSizeBytes(t.dtype())] ^= std::byte{1};
  MapSource source(src);
  MapSink sink;
  EXPECT_THAT(ExecutePlan(plan, source, sink).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("replicated copies differ at element 0")));
}

TEST(ExecutorTest, BadPlanAndSourceErrors) {
  convert::Plan plan;
  convert::TensorInfo t{.name = "t", .dtype = DType::kFp32, .shape = {4}};
  plan.sources = {t};
  plan.targets = {t};
  convert::Op op{.kind = convert::OpKind::kCopy, .param = "p", .state = "fp32", .counts = {4}};
  op.dst = {0, 1, {1}};
  op.srcs = {{0, 0, {1}}};
  plan.ops = {op};
  convert::TensorMap src;
  src.emplace("t", *Tensor::Zeros(DType::kFp32, {4}));
  MapSource source(src);
  MapSink sink;
  EXPECT_THAT(ExecutePlan(plan, source, sink).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("box outside tensor \"t\"")));
  plan.ops[0].dst.offset = 0;
  convert::TensorMap empty;
  MapSource none(empty);
  MapSink fresh;
  EXPECT_THAT(ExecutePlan(plan, none, fresh).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("while reading \"t\"")));
}

// Issue 16 #8: a source whose files changed during the run fails it (before the caller commits).
TEST(ExecutorTest, ASourceThatChangedDuringTheRunFailsIt) {
  class ChangedSource final : public TensorSource {
   public:
    explicit ChangedSource(const convert::TensorMap& m) : inner_(m) {}
    Status ReadFlatRange(const convert::TensorInfo& t, int64_t begin, int64_t end,
                         std::span<std::byte> out) const override {
      return inner_.ReadFlatRange(t, begin, end, out);
    }
    Status CheckUnchanged() const override {
      return DataLossError("source file a.h5 changed while ucp was reading it");
    }

   private:
    MapSource inner_;
  };
  convert::Plan plan;
  convert::TensorInfo t{.name = "t", .dtype = DType::kFp32, .shape = {4}};
  plan.sources = {t};
  plan.targets = {t};
  convert::Op op{.kind = convert::OpKind::kCopy, .param = "p", .state = "fp32", .counts = {4}};
  op.dst = {0, 0, {1}};
  op.srcs = {{0, 0, {1}}};
  plan.ops = {op};
  convert::TensorMap src;
  src.emplace("t", *Tensor::Zeros(DType::kFp32, {4}));
  MapSource same(src);
  MapSink ok_sink;
  UCP_EXPECT_OK(ExecutePlan(plan, same, ok_sink).status());
  ChangedSource changed(src);
  MapSink sink;
  EXPECT_THAT(ExecutePlan(plan, changed, sink).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("a.h5 changed while ucp was reading")));
}

// A check over a box larger than one block (256 Ki elements) runs block by block and still
// names the first differing element of the whole box.
TEST(ExecutorTest, LargeCheckBoxesAreComparedInBlocks) {
  convert::Plan plan;
  const int64_t rows = 700, cols = 1000;
  convert::TensorInfo a{.name = "a", .dtype = DType::kFp32, .shape = {rows, cols}};
  convert::TensorInfo b{.name = "b", .dtype = DType::kFp32, .shape = {rows, cols}};
  plan.sources = {a, b};
  convert::Op op{
      .kind = convert::OpKind::kCheckEqual, .param = "p", .state = "fp32", .counts = {rows, cols}};
  op.srcs = {{0, 0, {cols, 1}}, {1, 0, {cols, 1}}};
  plan.ops = {op};
  convert::TensorMap src;
  src.emplace("a", *Tensor::Zeros(DType::kFp32, {rows, cols}));
  src.emplace("b", *Tensor::Zeros(DType::kFp32, {rows, cols}));
  MapSource source(src);
  MapSink sink;
  UCP_EXPECT_OK(ExecutePlan(plan, source, sink).status());
  const int64_t bad = 600 * cols + 17;
  src.at("b").as<float>()[bad] = 1.0f;
  EXPECT_THAT(ExecutePlan(plan, source, sink).status(),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("differ at element " + std::to_string(bad) + " of the box")));
}

// Transposed copies (HF's Conv1D weights, [in, out] <-> [out, in] in column parts, as the hf
// import and export plan them) go through the tiled transpose: rows not a multiple of the tile,
// a dense source span (3 parts) and a sparse one read row by row (5 parts), to the same dtype and
// cast to bf16, both directions; the bytes are the reference executor's.
TEST(ExecutorTest, TransposedCopiesMatchTheReference) {
  const int64_t in = 37, part = 29;
  for (int64_t parts : {3, 5}) {
    for (DType to : {DType::kFp32, DType::kBf16}) {
      for (bool import : {true, false}) {
        SCOPED_TRACE(std::to_string(parts) + " parts to " + std::string(DTypeName(to)) +
                     (import ? " import" : " export"));
        const int64_t out = parts * part;
        convert::Plan plan;
        // import: HF s [in, out] -> param t [out, in]; export: param s [out, in] -> HF t [in, out]
        const Shape src_shape = import ? Shape{in, out} : Shape{out, in};
        const Shape dst_shape = import ? Shape{out, in} : Shape{in, out};
        plan.sources = {{.name = "s", .dtype = DType::kFp32, .shape = src_shape}};
        plan.targets = {{.name = "t", .dtype = to, .shape = dst_shape}};
        for (int64_t k = 0; k < parts; ++k) {
          convert::Op op{.kind = convert::OpKind::kCopy, .param = "p", .state = "model"};
          if (import) {  // source rows (in) of `part` elements -> destination columns
            op.counts = {in, part};
            op.srcs = {{0, k * part, {out, 1}}};
            op.dst = {0, k * part * in, {1, in}};
          } else {  // parameter rows of `in` elements -> HF columns
            op.counts = {part, in};
            op.srcs = {{0, k * part * in, {in, 1}}};
            op.dst = {0, k * part, {1, out}};
          }
          plan.ops.push_back(op);
        }
        convert::TensorMap src;
        Tensor x = *Tensor::Zeros(DType::kFp32, src_shape);
        std::mt19937 rng(static_cast<unsigned>(parts));
        std::uniform_real_distribution<float> u(-1, 1);
        for (float& v : x.as<float>()) v = u(rng);
        src.emplace("s", std::move(x));
        auto want = convert::ApplyPlan(plan, src);
        ASSERT_TRUE(want.ok()) << want.status();
        MapSource source(src);
        // Whole-tensor windows, and windows that cut the transposed boxes into column runs
        // with a partial column at each end (92 bytes: not a multiple of any column).
        for (int64_t window : {int64_t{0}, int64_t{92}}) {
          SCOPED_TRACE("window " + std::to_string(window));
          MapSink sink;
          ExecOptions opts;
          opts.window_bytes = window;
          UCP_ASSERT_OK(ExecutePlan(plan, source, sink, opts).status());
          const Tensor& got = sink.out.at("t");
          const Tensor& ref = want->at("t");
          ASSERT_EQ(got.num_bytes(), ref.num_bytes());
          EXPECT_EQ(std::memcmp(got.data(), ref.data(), static_cast<size_t>(got.num_bytes())), 0);
        }
      }
    }
  }
}

TEST(ExecutorTest, PlanThatLeavesAHoleIsAnInternalError) {
  convert::Plan plan;
  convert::TensorInfo t{.name = "t", .dtype = DType::kFp32, .shape = {4}};
  plan.sources = {t};
  plan.targets = {t};
  convert::Op op{.kind = convert::OpKind::kCopy, .param = "p", .state = "fp32", .counts = {3}};
  op.dst = {0, 0, {1}};
  op.srcs = {{0, 0, {1}}};
  plan.ops = {op};
  convert::TensorMap src;
  src.emplace("t", *Tensor::Zeros(DType::kFp32, {4}));
  MapSource source(src);
  MapSink sink;
  EXPECT_THAT(
      ExecutePlan(plan, source, sink).status(),
      StatusIs(StatusCode::kInternal, HasSubstr("writes 3 of elements [0, 4) of target \"t\"")));
}

TEST(ExecutorTest, ParseByteSize) {
  EXPECT_EQ(*ParseByteSize("512M"), int64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("2G"), int64_t{2} << 30);
  EXPECT_EQ(*ParseByteSize("64k"), 65536);
  EXPECT_EQ(*ParseByteSize("100"), 100);
  EXPECT_THAT(ParseByteSize("12X3").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"12X3\" is not N[K|M|G]")));
  EXPECT_THAT(ParseByteSize("").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("empty")));
}

}  // namespace
}  // namespace ucp::exec
