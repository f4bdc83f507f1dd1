// An in-memory executor of a Plan over named tensors: the reference semantics of every op, for
// tests and small models. The file-based executor must produce the same bytes.
#pragma once

#include <map>
#include <string>

#include "ucp/base/status.h"
#include "ucp/convert/plan.h"
#include "ucp/tensor/tensor.h"

namespace ucp::convert {

/// Named tensors, keyed by TensorInfo::name.
using TensorMap = std::map<std::string, Tensor>;

/// Runs `plan`: reads plan.sources from `sources`, creates every plan.targets tensor (zeroed,
/// then written by the ops in order) and returns them. Op semantics (plan.h): copy casts with
/// CastElements (a byte copy for equal dtypes); fill writes zero bytes; check_equal compares the
/// bytes of every source box with the first; average sums in fp64 in source order, divides by
/// the count and rounds once to the target dtype.
/// Errors: kNotFound (a source tensor is missing), kInvalidArgument (a source's dtype or shape
/// differs from the plan), kDataLoss ("parameter \"X\" state \"fp32\": replicated copies
/// differ at element E of box ..." for a failed check_equal), kUnimplemented (average of a
/// non-floating dtype), cast errors.
Result<TensorMap> ApplyPlan(const Plan& plan, const TensorMap& sources);

}  // namespace ucp::convert
