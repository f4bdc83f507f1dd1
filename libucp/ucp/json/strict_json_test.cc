// ParseStrict: valid documents parse, each refusal carries its code, the JSON pointer and the
// caller's name for the text.
#include "ucp/json/strict_json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
