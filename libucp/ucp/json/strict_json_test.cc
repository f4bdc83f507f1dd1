// ParseStrict: valid documents parse, each refusal carries its code, the JSON pointer and the
// caller's name for the text.
#include "ucp/json/strict_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "tests/testutil/status_matchers.h"

namespace ucp::json {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(StrictJson, ParsesValidDocuments) {
  UCP_ASSERT_OK_AND_ASSIGN(
      Json j, ParseStrict(R"({"a": [1, {"b": 2}], "c": "x"})", "f.json", StatusCode::kDataLoss));
  EXPECT_EQ(j["a"][1]["b"], 2);
  EXPECT_EQ(j["c"], "x");
  // The same key in two different objects is fine.
  UCP_EXPECT_OK(ParseStrict(R"([{"k": 1}, {"k": 2}])", "f.json", StatusCode::kDataLoss).status());
}

TEST(StrictJson, RefusesDuplicateKeysAtAnyDepthNamingThePointer) {
  EXPECT_THAT(ParseStrict(R"({"step": 1, "step": 2})", "m.json", StatusCode::kDataLoss).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("m.json: duplicate key \"step\" at /")));
  EXPECT_THAT(
      ParseStrict(R"({"params": [{"n": 1}, {"n": 2, "n": 3}]})", "m.json", StatusCode::kDataLoss)
          .status(),
      StatusIs(StatusCode::kDataLoss, HasSubstr("duplicate key \"n\" at /params/1")));
}

TEST(StrictJson, RefusesBadSyntaxAndDeepNestingWithTheCallersCode) {
  EXPECT_THAT(ParseStrict("{\"a\": ", "r.json", StatusCode::kInvalidArgument).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("r.json is not valid json")));
  EXPECT_THAT(ParseStrict("[[[[1]]]]", "r.json", StatusCode::kDataLoss, 2).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("nesting deeper than 2 levels at /0/0")));
}

}  // namespace
}  // namespace ucp::json

namespace ucp::json {
namespace {

// Issue 16 #9: nlohmann's lexer stops at a NUL; what follows must not be ignored.
TEST(StrictJson, RefusesNulAndTrailingBytes) {
  EXPECT_THAT(ParseStrict(std::string_view("{\"a\":1}\0garbage", 15), "m.json",
                          StatusCode::kDataLoss)
                  .status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("NUL byte at offset 7")));
  EXPECT_THAT(ParseStrict(std::string_view("{\"a\":\"x\0y\"}", 11), "m.json",
                          StatusCode::kDataLoss)
                  .status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("NUL byte at offset 7")));
  EXPECT_THAT(ParseStrict("{\"a\":1} {}", "m.json", StatusCode::kDataLoss).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("m.json is not valid json")));
  UCP_EXPECT_OK(ParseStrict("{\"a\":1}\n \t", "m.json", StatusCode::kDataLoss).status());
}

// Issue 16 #9: depth is checked while parsing, so a huge deeply nested document fails fast with
// bounded memory. Parsed in a child under RLIMIT_AS so a regression fails instead of thrashing.
TEST(StrictJson, DeepNestingFailsFastWithBoundedMemory) {
  const size_t kLevels = 50'000'000;  // 100 MB of "[[[..." / "]]]..."
  std::string text(kLevels, '[');
  text.append(kLevels, ']');
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct rlimit lim;
    getrlimit(RLIMIT_AS, &lim);
    // The text is already mapped; allow it plus 256 MiB.
    rlim_t cap = static_cast<rlim_t>(text.size()) + (rlim_t{256} << 20) + (rlim_t{256} << 20);
    lim.rlim_cur = cap;
    setrlimit(RLIMIT_AS, &lim);
    auto start = std::chrono::steady_clock::now();
    Result<Json> r = ParseStrict(text, "deep.json", StatusCode::kDataLoss);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool ok = !r.ok() && r.status().code() == StatusCode::kDataLoss &&
                    r.status().message().find("nesting deeper than 64 levels") !=
                        std::string::npos &&
                    s < 1.0;
    _exit(ok ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st)) << "child killed by signal " << WTERMSIG(st);
  EXPECT_EQ(WEXITSTATUS(st), 0);
}

}  // namespace
}  // namespace ucp::json
