// Conversion plans: pure data saying, for every tensor of a target layout, which element boxes of
// which source tensors it is made of. Built from a resolved model (patterns/) and two layouts;
// printed by `ucp plan`, executed in memory by apply.h and over files by the executor.
//
// Per-rank tensor naming (the executor and the file formats name datasets after it):
//   universal               <param>/<state>                     full, unpadded shape
//   model slice             pp<P>.tp<T>[.ep<E>]/model/<local>    the rank's slice, training dtype
//   ZeRO-0 optimizer state  pp<P>.tp<T>[.ep<E>]/optim/<local>/<state>   slice shape, fp32
//   ZeRO-1/2 fragment       pp<P>.tp<T>[.ep<E>]/zero/g<G>.f<F>/<state>  1-D fp32, flat group buffer
//   ZeRO-3 fragment         pp<P>.tp<T>[.ep<E>]/zero3/f<F>/<local>/<state>  1-D fp32
// <local> is the parameter's name with layer/expert indices renumbered local to the stage / ep
// rank; `.ep<E>` appears only on expert parameters' tensors; G is the optimizer group (0: weights
// with >= 2 dims that are not biases, 1: the rest), F the fragment index within the data-parallel
// group (layout::ZeroFragmentOfRank). The model state is called "model" in universal tensors.
// dp replicas are not separate tensors: a model slice or ZeRO-0 state is written once per
// (pp, tp[, ep]) group, as DeepSpeed's data-parallel rank 0 does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::convert {

enum class TensorKind : uint8_t {
  kUniversal,     ///< <param>/<state>
  kModelSlice,    ///< .../model/<local>
  kOptimSlice,    ///< ZeRO-0: .../optim/<local>/<state>
  kZeroFragment,  ///< ZeRO-1/2: .../zero/g<G>.f<F>/<state>
  kZero3Fragment  ///< ZeRO-3: .../zero3/f<F>/<local>/<state>
};
/// "universal", "model_slice", "optim_slice", "zero_fragment", "zero3_fragment".
std::string_view TensorKindName(TensorKind k);

/// One tensor of a checkpoint in some layout.
struct TensorInfo {
  std::string name;  ///< the dataset name, see the file comment
  TensorKind kind = TensorKind::kUniversal;
  DType dtype = DType::kFp32;
  Shape shape;
  std::string param;  ///< the (global) parameter, empty for a ZeRO-1/2 fragment (many params)
  std::string state;  ///< "model", "fp32", "exp_avg", ...
  int pp = 0, tp = 0, ep = -1;  ///< the (pp, tp[, ep]) group; ep = -1 for dense tensors
  int group = -1;               ///< optimizer group (ZeRO-1/2 only)
  int fragment = -1;            ///< ZeRO fragment index (ZeRO-1/2/3 only)
  int64_t rank = 0;             ///< the global rank that holds (writes) it
};

/// A strided window into a tensor's flat row-major storage, in elements: element i of the box
/// (a multi-index over Op::counts) is at offset + sum_k i_k * strides[k].
struct StridedRef {
  int32_t tensor = -1;  ///< index into Plan::sources or Plan::targets (see Op)
  int64_t offset = 0;
  std::vector<int64_t> strides;
};

enum class OpKind : uint8_t {
  kCopy,        ///< dst = cast(srcs[0]) elementwise (a byte copy when dtypes are equal)
  kFill,        ///< dst = 0 (vocabulary padding rows, ZeRO alignment tail); no srcs
  kCheckEqual,  ///< srcs[1..] must equal srcs[0] bitwise (replicate rule, tied copies); no dst
  kAverage,     ///< dst = cast(sum_i double(srcs[i]) / n), summed in srcs order (average rule)
};
std::string_view OpKindName(OpKind k);

/// One N-d box operation. srcs index Plan::sources, dst indexes Plan::targets.
struct Op {
  OpKind kind = OpKind::kCopy;
  std::string param;  ///< the global parameter this op serves ("" for a ZeRO alignment fill)
  std::string state;
  std::vector<int64_t> counts;  ///< box extents; the box has prod(counts) elements
  StridedRef dst;               ///< tensor = -1 for kCheckEqual
  std::vector<StridedRef> srcs;
};

/// What to plan for.
struct PlanOptions {
  /// Optimizer states held in fp32 next to each parameter (ZeRO fragments / universal).
  std::vector<std::string> optimizer_states = {"fp32", "exp_avg", "exp_avg_sq"};
  /// Plan the model slices (training dtype) as well.
  bool model_slices = true;
};

struct Plan {
  layout::Layout from;
  layout::Layout to;
  std::vector<TensorInfo> sources;  ///< every source tensor the ops read
  std::vector<TensorInfo> targets;  ///< every target tensor, all fully written by the ops
  std::vector<Op> ops;              ///< ordered by target tensor, then parameter
};

/// The tensors one layout holds for a model (what a writer creates / a reader must find).
/// Errors: as PlanConversion.
Result<std::vector<TensorInfo>> DescribeLayout(const patterns::ResolvedModel& model,
                                               const layout::Layout& layout,
                                               const PlanOptions& options = {});

/// Plans from -> to. Checks that the model fits both layouts first.
/// Errors: kFailedPrecondition naming the parameter and numbers when a layout cannot hold the
/// model ("parameter \"layers.0.self_attention.query_key_value.weight\": 8 query groups not
/// divisible by tp=3", layers % pp, experts % ep); kInvalidArgument for an invalid layout.
Result<Plan> PlanConversion(const patterns::ResolvedModel& model, const layout::Layout& from,
                            const layout::Layout& to, const PlanOptions& options = {});

/// Verifies that every element of every target tensor is written exactly once by a kCopy,
/// kFill or kAverage op, that every box is inside its tensor, and indices are valid.
/// Errors: kInternal naming the tensor, the element offset and its write count.
Status CheckCoverage(const Plan& plan);

/// Per target rank: tensors, op counts and bytes moved. kCheckEqual ops read only sources and are
/// counted in one extra row with rank = -1.
struct RankSummary {
  int64_t rank = 0;
  int64_t tensors = 0;
  int64_t copy_ops = 0, fill_ops = 0, check_ops = 0, average_ops = 0;
  int64_t bytes_written = 0;
};
std::vector<RankSummary> Summarize(const Plan& plan);

/// The whole plan as JSON (tensors and ops), deterministic.
std::string PlanToJson(const Plan& plan);

}  // namespace ucp::convert
