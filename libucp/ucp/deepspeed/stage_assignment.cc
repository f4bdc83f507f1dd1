// Stage assignment from a DeepSpeed checkpoint's per-stage param_shapes (see stage_assignment.h).
#include "ucp/deepspeed/stage_assignment.h"

#include <string>

#include "ucp/base/status_macros.h"

namespace ucp::deepspeed {
namespace {

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

}  // namespace

Result<layout::StageAssignment> StagesOfCheckpoint(const patterns::ResolvedModel& model,
                                                   std::span<const DeepSpeedParam> params,
                                                   std::span<const int> ds_index, int pp,
                                                   std::string_view where) {
  const std::string w(where);
  if (pp <= 1 || model.num_layers <= 0) {
    return layout::AssignStages(model.num_layers, pp);
  }
  // stage_of[L]: the stage of layer L, and the first parameter that said so (for the errors).
  std::vector<int> stage_of(static_cast<size_t>(model.num_layers), -1);
  std::vector<const DeepSpeedParam*> witness(static_cast<size_t>(model.num_layers), nullptr);
  for (size_t i = 0; i < model.params.size(); ++i) {
    const patterns::ResolvedParam& mp = model.params[i];
    if (mp.stage != patterns::StagePlacement::kLayer) continue;
    if (mp.layer < 0 || mp.layer >= model.num_layers || i >= ds_index.size() ||
        ds_index[i] < 0 || static_cast<size_t>(ds_index[i]) >= params.size()) {
      continue;  // BindModel's own checks name such a parameter
    }
    const DeepSpeedParam& p = params[static_cast<size_t>(ds_index[i])];
    if (p.stages.size() != 1) {
      return FailedPreconditionError(
          w + ": parameter " + Q(p.engine_name) + " of layer " + std::to_string(mp.layer) +
          " is listed by the param_shapes of " + std::to_string(p.stages.size()) +
          " pipeline stages; a transformer layer lives on exactly one");
    }
    const auto l = static_cast<size_t>(mp.layer);
    if (stage_of[l] < 0) {
      stage_of[l] = p.stages[0];
      witness[l] = &p;
    } else if (stage_of[l] != p.stages[0]) {
      return FailedPreconditionError(
          w + ": parameter " + Q(p.engine_name) + " of layer " + std::to_string(mp.layer) +
          " is on pipeline stage " + std::to_string(p.stages[0]) + " but " +
          Q(witness[l]->engine_name) + " of the same layer is on stage " +
          std::to_string(stage_of[l]));
    }
  }
  std::vector<int64_t> counts(static_cast<size_t>(pp), 0);
  int last = 0;
  for (size_t l = 0; l < stage_of.size(); ++l) {
    if (stage_of[l] < 0) {
      // A model whose layers have no parameters at all has nothing to place.
      if (witness[0] == nullptr) return layout::AssignStages(model.num_layers, pp);
      return FailedPreconditionError(w + ": layer " + std::to_string(l) +
                                     " has no parameter in any stage's param_shapes");
    }
    if (stage_of[l] < last || stage_of[l] >= pp) {
      return FailedPreconditionError(
          w + ": parameter " + Q(witness[l]->engine_name) + " of layer " + std::to_string(l) +
          " is on pipeline stage " + std::to_string(stage_of[l]) + " after a layer on stage " +
          std::to_string(last) + " (layers run in stage order, stages 0.." +
          std::to_string(pp - 1) + ")");
    }
    last = stage_of[l];
    ++counts[static_cast<size_t>(stage_of[l])];
  }
  for (int s = 0; s < pp; ++s) {
    if (counts[static_cast<size_t>(s)] == 0) {
      return FailedPreconditionError(
          w + ": pipeline stage " + std::to_string(s) + " of " + std::to_string(pp) +
          " holds no transformer layer (stages=" + layout::StagesToString(counts) +
          "); ucp's layouts give every stage at least one");
    }
  }
  UCP_ASSIGN_OR_RETURN(layout::StageAssignment a,
                       layout::AssignStages(model.num_layers, pp, counts), w);
  return a;
}

}  // namespace ucp::deepspeed
