// The byte tokenizer: UTF-8 in, bytes plus kEndOfText out; NUL and invalid UTF-8 refused by offset.
#include "offload/data/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/testutil/status_matchers.h"

namespace ucp::offload {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(TokenizerTest, MultiByteUtf8IsItsBytes) {
  // "é" (2 bytes), "€" (3 bytes), "𝄞" (4 bytes, U+1D11E).
  const std::string text = "a\xC3\xA9\xE2\x82\xAC\xF0\x9D\x84\x9E";
  std::vector<uint16_t> out = {42};  // appends
  UCP_ASSERT_OK(TokenizeDocument(text, "doc", out));
  EXPECT_THAT(
      out, ElementsAre(42, 'a', 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9D, 0x84, 0x9E, kEndOfText));
}

TEST(TokenizerTest, EmptyDocumentIsJustTheEnd) {
  std::vector<uint16_t> out;
  UCP_ASSERT_OK(TokenizeDocument("", "doc", out));
  EXPECT_THAT(out, ElementsAre(kEndOfText));
}

TEST(TokenizerTest, RefusesNulWithOffset) {
  std::vector<uint16_t> out = {5};
  EXPECT_THAT(
      TokenizeDocument(std::string("ab\0c", 4), "fortunes/x", out),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("fortunes/x: NUL byte at byte offset 2")));
  EXPECT_THAT(out, ElementsAre(5));  // untouched on error
}

TEST(TokenizerTest, RefusesInvalidUtf8WithOffset) {
  struct Case {
    std::string text;
    const char* fragment;
  };
  const std::vector<Case> cases = {
      {"abc\xE9z", "invalid UTF-8 at byte offset 3 (byte 0xE9)"},          // latin-1 é
      {"\x80", "invalid UTF-8 at byte offset 0 (byte 0x80)"},              // lone continuation
      {"ab\xC3", "invalid UTF-8 at byte offset 2 (byte 0xC3)"},            // truncated
      {"\xC0\xAF", "invalid UTF-8 at byte offset 0 (byte 0xC0)"},          // overlong '/'
      {"x\xE0\x80\xAF", "invalid UTF-8 at byte offset 1 (byte 0xE0)"},     // overlong 3-byte
      {"\xED\xA0\x80", "invalid UTF-8 at byte offset 0 (byte 0xED)"},      // surrogate U+D800
      {"\xF4\x90\x80\x80", "invalid UTF-8 at byte offset 0 (byte 0xF4)"},  // above U+10FFFF
      {"\xF5\x80\x80\x80", "invalid UTF-8 at byte offset 0 (byte 0xF5)"},
      {"\xC3\xA9\xFF", "invalid UTF-8 at byte offset 2 (byte 0xFF)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fragment);
    std::vector<uint16_t> out;
    EXPECT_THAT(
        TokenizeDocument(c.text, "doc 7", out),
        StatusIs(StatusCode::kInvalidArgument, HasSubstr(std::string("doc 7: ") + c.fragment)));
    EXPECT_TRUE(out.empty());
  }
}

TEST(TokenizerTest, AcceptsTheEdgesOfUtf8) {
  for (const std::string& text :
       {std::string("\x7F"), std::string("\xC2\x80"), std::string("\xDF\xBF"),
        std::string("\xE0\xA0\x80"), std::string("\xED\x9F\xBF"), std::string("\xEE\x80\x80"),
        std::string("\xF0\x90\x80\x80"), std::string("\xF4\x8F\xBF\xBF")}) {
    std::vector<uint16_t> out;
    UCP_EXPECT_OK(TokenizeDocument(text, "edge", out));
    for (uint16_t t : out) EXPECT_LT(t, 245);  // the vocabulary bound tokenizer.h promises
  }
}

TEST(TokenizerTest, DetokenizeRoundTrip) {
  const std::string a = "Hello, w\xC3\xB6rld!\n";
  const std::string b = "\xE2\x82\xAC 5\n";
  std::vector<uint16_t> tokens;
  UCP_ASSERT_OK(TokenizeDocument(a, "a", tokens));
  UCP_ASSERT_OK(TokenizeDocument(b, "b", tokens));
  EXPECT_EQ(Detokenize(tokens), a + "\n<|end|>\n" + b + "\n<|end|>\n");
  const std::vector<uint16_t> big = {'x', 256, 'y', 65535};
  EXPECT_EQ(Detokenize(big), "x<|256|>y<|65535|>");
}

}  // namespace
}  // namespace ucp::offload
