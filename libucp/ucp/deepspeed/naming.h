// Parameter names of DeepSpeed / Megatron-DeepSpeed engines <-> ucp canonical names (the
// templates of patterns/<family>.json), in both directions, so a reader maps what it finds and a
// writer produces the names an engine loads. Pure string arithmetic: no files, no rule sets.
//
// With L transformer layers (shared/reference/deepspeed_ucp.md 2.2 and 5):
//   canonical                      GPTModelPipe                        GPTModel
//   embedding.<rest>               tied_modules.embed.<rest> (tied) language_model.embedding.<rest>
//                                  1.<rest> (untied EmbeddingPipe)
//   layers.<i>.<rest>              <i+2>.<rest> language_model.encoder.layers.<i>.<rest>
//   final_layernorm.<w|b>          <L+2>.<w|b> language_model.encoder.final_layernorm.<w|b>
//   output_layer.<rest>            <L+3>.lm_head.<rest> (untied) language_model.output_layer.<rest>
// Plain DeepSpeed: the engine's names are the canonical names.
// DeepSpeed-MoE (deepspeed.moe.layer.MoE at module path P, any flavour above):
//   P.router.weight                P.deepspeed_moe.gate.wg.weight
//   P.experts.<e>.<rest>           P.deepspeed_moe.experts.deepspeed_experts.<e>.<rest>
// with <e> the global expert index (the engine numbers its local experts from 0 in
// named_parameters; its expert files and ucp use the global index).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ucp/base/result.h"

namespace ucp::deepspeed {

/// Whose parameter names the engine saved.
enum class Naming : uint8_t {
  kMegatronPipe,  ///< Megatron-DeepSpeed GPTModelPipe: "tied_modules.embed.…", "{i+2}.…"
  kMegatronGpt,   ///< Megatron-DeepSpeed GPTModel: "language_model.encoder.layers.{i}.…"
  kPlain,         ///< plain DeepSpeed: the engine's names are ucp's canonical names
};

/// "megatron-deepspeed GPTModelPipe", "megatron-deepspeed GPTModel", "plain deepspeed".
std::string_view NamingName(Naming naming);

/// The inverse of NamingName. Errors: kInvalidArgument for any other text.
Result<Naming> NamingFromName(std::string_view name);

/// The flavour one engine name belongs to: GPTModelPipe for "tied_modules.*" and "<digits>.*",
/// GPTModel for "language_model.*", plain otherwise.
Naming DetectNaming(std::string_view engine_name);

/// Engine name -> canonical name; DeepSpeed-MoE names (".deepspeed_moe.") are mapped in any
/// flavour (IsDeepSpeedMoeName). Layer positions are not checked here (the number of layers is
/// not known yet); EngineName(CanonicalName(n)) == n is the check once it is.
/// Errors: kInvalidArgument naming the parameter when it is no name of that flavour.
Result<std::string> CanonicalName(std::string_view engine_name, Naming naming);

/// What the engine names depend on besides the canonical name.
struct EngineNameContext {
  int64_t num_layers = 0;       ///< L: GPTModelPipe's final norm is spec L+2, its head L+3
  bool tied_embeddings = true;  ///< GPTModelPipe: a TiedLayerSpec "embed" or EmbeddingPipe at 1
  /// The model's MoE layers are DeepSpeed's (deepspeed.moe.layer.MoE): routers and experts get
  /// its names ("P.deepspeed_moe.gate.wg.weight",
  /// "P.deepspeed_moe.experts.deepspeed_experts.e.…").
  bool deepspeed_moe = false;
};

/// Whether `engine_name` is a parameter of a DeepSpeed-MoE layer: its gate or an expert.
bool IsDeepSpeedMoeName(std::string_view engine_name);
/// Whether `engine_name` is an expert parameter of a DeepSpeed-MoE layer (saved in the
/// layer_L_expert_E files, partitioned over the expert data-parallel group).
bool IsDeepSpeedExpertName(std::string_view engine_name);
/// An expert parameter's expert index (the number after "deepspeed_experts."), and the name with
/// it replaced by `index`. Errors: kInvalidArgument when it is no expert parameter name.
Result<int64_t> DeepSpeedExpertIndex(std::string_view engine_name);
Result<std::string> WithDeepSpeedExpertIndex(std::string_view engine_name, int64_t index);

/// Canonical name -> engine name.
/// Errors: kInvalidArgument for a canonical name outside the four groups above (Megatron
/// flavours only; plain names pass through).
Result<std::string> EngineName(std::string_view canonical, Naming naming,
                               const EngineNameContext& context);

/// Where GPTModelPipe keeps a parameter's low-precision weight: in
/// layer_<layer_index>-model_<tp>-model_states.pt under `key` (the name relative to the layer).
/// A tied module's weight is in the file of its first spec (the embedding, index 1); the copy
/// the last stage holds has no file (its spec is a function).
struct PipeLayerKey {
  int64_t layer_index = 0;
  std::string key;
};
/// Errors: kInvalidArgument when `engine_name` is not a GPTModelPipe name.
Result<PipeLayerKey> PipeLayerOf(std::string_view engine_name);

}  // namespace ucp::deepspeed
