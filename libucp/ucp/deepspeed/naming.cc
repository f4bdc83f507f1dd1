// Engine <-> canonical parameter names (see naming.h).
#include "ucp/deepspeed/naming.h"

#include <algorithm>
#include <charconv>

#include "ucp/base/status_macros.h"

namespace ucp::deepspeed {
namespace {

constexpr std::string_view kTiedEmbed = "tied_modules.embed.";
constexpr std::string_view kLanguageModel = "language_model.";
constexpr std::string_view kEncoder = "language_model.encoder.";
constexpr std::string_view kLmHead = "lm_head.";
// deepspeed/moe/layer.py: MoE.deepspeed_moe = MOELayer(gate=TopKGate (wg: Linear), experts=
// Experts (deepspeed_experts: ModuleList of the expert module's copies)).
constexpr std::string_view kMoeGate = ".deepspeed_moe.gate.wg.weight";
constexpr std::string_view kMoeExperts = ".deepspeed_moe.experts.deepspeed_experts.";
constexpr std::string_view kRouter = ".router.weight";
constexpr std::string_view kExperts = ".experts.";

bool AllDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "<digits>.<rest>" -> (digits, rest); false when `n` has another form or the index overflows.
bool SplitIndex(std::string_view n, int64_t* index, std::string_view* rest) {
  const size_t dot = n.find('.');
  if (dot == std::string_view::npos || !AllDigits(n.substr(0, dot)) || dot > 12) return false;
  std::from_chars(n.data(), n.data() + dot, *index);
  *rest = n.substr(dot + 1);
  return !rest->empty();
}

Status NotAName(std::string_view n, Naming naming) {
  return InvalidArgumentError("parameter \"" + std::string(n) + "\" is not a " +
                              std::string(NamingName(naming)) + " parameter name");
}

bool IsEmbedding(std::string_view rest) {
  return rest.starts_with("word_embeddings.") || rest.starts_with("position_embeddings.");
}

// DeepSpeed-MoE names -> the canonical router / experts form; other names unchanged.
std::string FromDeepSpeedMoe(std::string_view n) {
  if (n.ends_with(kMoeGate)) {
    return std::string(n.substr(0, n.size() - kMoeGate.size())) + std::string(kRouter);
  }
  if (const size_t at = n.find(kMoeExperts); at != std::string_view::npos) {
    return std::string(n.substr(0, at)) + std::string(kExperts) +
           std::string(n.substr(at + kMoeExperts.size()));
  }
  return std::string(n);
}

// The inverse, for a canonical name of a MoE layer: "P.router.weight" and "P.experts.<e>.<rest>"
// (the last ".experts.<digits>." of the name); other names unchanged.
std::string ToDeepSpeedMoe(std::string_view c) {
  if (c.ends_with(kRouter)) {
    return std::string(c.substr(0, c.size() - kRouter.size())) + std::string(kMoeGate);
  }
  for (size_t at = c.rfind(kExperts); at != std::string_view::npos;
       at = at == 0 ? std::string_view::npos : c.rfind(kExperts, at - 1)) {
    const std::string_view rest = c.substr(at + kExperts.size());
    const size_t dot = rest.find('.');
    if (dot != std::string_view::npos && AllDigits(rest.substr(0, dot))) {
      return std::string(c.substr(0, at)) + std::string(kMoeExperts) + std::string(rest);
    }
  }
  return std::string(c);
}

}  // namespace

bool IsDeepSpeedMoeName(std::string_view n) {
  return n.ends_with(kMoeGate) || n.find(kMoeExperts) != std::string_view::npos;
}

bool IsDeepSpeedExpertName(std::string_view n) {
  return n.find(kMoeExperts) != std::string_view::npos;
}

Result<int64_t> DeepSpeedExpertIndex(std::string_view n) {
  const size_t at = n.find(kMoeExperts);
  if (at != std::string_view::npos) {
    const std::string_view rest = n.substr(at + kMoeExperts.size());
    const size_t dot = rest.find('.');
    if (dot != std::string_view::npos && AllDigits(rest.substr(0, dot)) && dot <= 12) {
      int64_t index = 0;
      std::from_chars(rest.data(), rest.data() + dot, index);
      return index;
    }
  }
  return InvalidArgumentError("parameter \"" + std::string(n) +
                              "\" is not an expert of a DeepSpeed-MoE layer");
}

Result<std::string> WithDeepSpeedExpertIndex(std::string_view n, int64_t index) {
  UCP_RETURN_IF_ERROR(DeepSpeedExpertIndex(n).status());
  const size_t at = n.find(kMoeExperts) + kMoeExperts.size();
  const size_t dot = n.find('.', at);
  return std::string(n.substr(0, at)) + std::to_string(index) + std::string(n.substr(dot));
}

std::string_view NamingName(Naming naming) {
  switch (naming) {
    case Naming::kMegatronPipe:
      return "megatron-deepspeed GPTModelPipe";
    case Naming::kMegatronGpt:
      return "megatron-deepspeed GPTModel";
    case Naming::kPlain:
      return "plain deepspeed";
  }
  return "?";
}

Result<Naming> NamingFromName(std::string_view name) {
  for (Naming n : {Naming::kMegatronPipe, Naming::kMegatronGpt, Naming::kPlain}) {
    if (name == NamingName(n)) return n;
  }
  return InvalidArgumentError("unknown DeepSpeed naming \"" + std::string(name) + "\"");
}

Naming DetectNaming(std::string_view n) {
  int64_t index = 0;
  std::string_view rest;
  if (n.starts_with("tied_modules.") || SplitIndex(n, &index, &rest)) {
    return Naming::kMegatronPipe;
  }
  if (n.starts_with(kLanguageModel)) return Naming::kMegatronGpt;
  return Naming::kPlain;
}

Result<std::string> CanonicalName(std::string_view engine_name, Naming naming) {
  const std::string unmoe = FromDeepSpeedMoe(engine_name);
  const std::string_view n = unmoe;
  switch (naming) {
    case Naming::kPlain:
      return std::string(n);
    case Naming::kMegatronGpt: {
      if (n.starts_with(kEncoder)) {
        const std::string_view rest = n.substr(kEncoder.size());
        if (rest.starts_with("layers.") || rest.starts_with("final_layernorm.")) {
          return std::string(rest);
        }
      } else if (n.starts_with(kLanguageModel)) {
        const std::string_view rest = n.substr(kLanguageModel.size());
        if (rest.starts_with("embedding.") || rest.starts_with("output_layer.")) {
          return std::string(rest);
        }
      }
      return NotAName(n, naming);
    }
    case Naming::kMegatronPipe: {
      if (n.starts_with(kTiedEmbed) && IsEmbedding(n.substr(kTiedEmbed.size()))) {
        return "embedding." + std::string(n.substr(kTiedEmbed.size()));
      }
      int64_t index = 0;
      std::string_view rest;
      if (!SplitIndex(n, &index, &rest)) return NotAName(n, naming);
      // Spec 1 is the (untied) EmbeddingPipe, 2..L+1 the transformer layers, L+2 the final
      // norm (a bare weight / bias), L+3 the untied LMHeadPipe.
      if (index == 1 && IsEmbedding(rest)) return "embedding." + std::string(rest);
      if (rest.starts_with(kLmHead)) {
        return "output_layer." + std::string(rest.substr(kLmHead.size()));
      }
      if (rest.find('.') == std::string_view::npos && index >= 2) {
        return "final_layernorm." + std::string(rest);
      }
      if (index >= 2 && !IsEmbedding(rest)) {
        return "layers." + std::to_string(index - 2) + "." + std::string(rest);
      }
      return NotAName(n, naming);
    }
  }
  return NotAName(n, naming);
}

Result<std::string> EngineName(std::string_view c, Naming naming,
                               const EngineNameContext& context) {
  if (context.deepspeed_moe) {
    EngineNameContext plain_moe = context;
    plain_moe.deepspeed_moe = false;
    UCP_ASSIGN_OR_RETURN(std::string engine, EngineName(c, naming, plain_moe));
    return ToDeepSpeedMoe(engine);
  }
  if (naming == Naming::kPlain) return std::string(c);
  auto after = [&](std::string_view prefix) { return std::string(c.substr(prefix.size())); };
  const bool embedding = c.starts_with("embedding.") && IsEmbedding(c.substr(10));
  const bool layer = c.starts_with("layers.");
  const bool final_norm = c.starts_with("final_layernorm.");
  const bool head = c.starts_with("output_layer.");
  if (naming == Naming::kMegatronGpt) {
    if (embedding || head) return std::string(kLanguageModel) + std::string(c);
    if (layer || final_norm) return std::string(kEncoder) + std::string(c);
  } else {
    if (embedding) {
      return (context.tied_embeddings ? std::string(kTiedEmbed) : std::string("1.")) +
             after("embedding.");
    }
    if (layer) {
      const size_t dot = c.find('.', 7);
      int64_t i = 0;
      if (dot != std::string_view::npos && AllDigits(c.substr(7, dot - 7)) && dot - 7 <= 12) {
        std::from_chars(c.data() + 7, c.data() + dot, i);
        return std::to_string(i + 2) + std::string(c.substr(dot));
      }
    }
    if (final_norm) return std::to_string(context.num_layers + 2) + "." + after("final_layernorm.");
    if (head) {
      return std::to_string(context.num_layers + 3) + "." + std::string(kLmHead) +
             after("output_layer.");
    }
  }
  return InvalidArgumentError("canonical parameter \"" + std::string(c) + "\" has no " +
                              std::string(NamingName(naming)) + " name");
}

Result<PipeLayerKey> PipeLayerOf(std::string_view n) {
  if (n.starts_with(kTiedEmbed)) return PipeLayerKey{1, std::string(n.substr(kTiedEmbed.size()))};
  int64_t index = 0;
  std::string_view rest;
  if (!SplitIndex(n, &index, &rest)) return NotAName(n, Naming::kMegatronPipe);
  return PipeLayerKey{index, std::string(rest)};
}

}  // namespace ucp::deepspeed
