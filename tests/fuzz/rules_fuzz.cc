// libFuzzer target for rule files (patterns/<family>.json): any text is refused with
// invalid_argument or parses into a rule set, which is then resolved against a model made from
// its own templates at small hyper-parameters (expressions, regexes, stage lists all exercised).
// Rule files come from the data folder, never from a checkpoint (names read from files are
// validated: ValidateRuleSetName), but a bad one must still fail with an error, not a crash.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ucp/patterns/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto rules = ucp::patterns::ParseRuleSet(text, "fuzz.json");
  if (!rules.ok()) {
    if (rules.status().code() != ucp::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  ucp::patterns::ModelSpec spec;
  spec.name = "fuzz";
  spec.family = rules->family;
  spec.templates = rules->templates;
  spec.hyper = {{"hidden", 8},       {"layers", 2},   {"heads", 2},        {"kv_heads", 1},
                {"head_dim", 4},     {"ffn_hidden", 16}, {"vocab", 10},    {"max_positions", 8},
                {"num_experts", 2},  {"make_vocab_size_divisible_by", 4},  {"tied_embeddings", 0}};
  auto params = spec.Parameters();
  if (!params.ok()) return 0;
  // Resolve refuses what does not fit with a status; it must not crash or hang.
  (void)ucp::patterns::Resolve(spec, *rules);
  return 0;
}
