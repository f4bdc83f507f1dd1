// The pipeline stage assignment of a DeepSpeed checkpoint, read from its files: which stage's
// param_shapes list each transformer layer's parameters (docs/deepspeed.md, "The model", Checks).
// DeepSpeed's PipelineModule cuts its whole layer list (embedding, lambdas, norm included) with
// partition_method 'uniform', 'parameters' or 'type:...', so the transformer layers per stage
// depend on the model code and cannot be recomputed from the layer count: the files are the
// record.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"

namespace ucp::deepspeed {

/// The stages holding model `model`'s transformer layers, where `params[ds_index[i]]` is the
/// checkpoint parameter of model parameter i. Layer L is on the one stage whose param_shapes
/// list its parameters; layers must run in stage order, every stage holding at least one.
/// A model without layer parameters, or pp=1, gets the even split.
/// Errors (`where` names the file): kFailedPrecondition naming the parameter when a layer's
/// parameters are on several stages or on none, or layers are out of stage order;
/// kFailedPrecondition naming the stage when a stage holds no transformer layer (ucp's layouts
/// give each stage >= 1).
Result<layout::StageAssignment> StagesOfCheckpoint(const patterns::ResolvedModel& model,
                                                   std::span<const DeepSpeedParam> params,
                                                   std::span<const int> ds_index, int pp,
                                                   std::string_view where);

}  // namespace ucp::deepspeed
