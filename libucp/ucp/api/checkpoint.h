// The facade the CLI and trainers call: open any checkpoint as a CheckpointSource (through the
// format registry, api/format.h), and the whole-checkpoint operations (generate, extract,
// reshard, convert, verify, diff) built from a plan (convert/) run by the executor (exec/)
// between readers and writers. Extract and ToLayout are the sink of ucp's own format ("ucp").
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ucp/api/format.h"
#include "ucp/api/process_group.h"
#include "ucp/api/source.h"
#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"

namespace ucp::api {

/// Loads a preset / model file and resolves it against its family's rules; `dtype` (when not
/// empty) replaces the training dtype.
/// Errors: those of patterns::LoadModel / LoadRuleSet / Resolve; kInvalidArgument (dtype name).
Result<std::pair<patterns::ModelSpec, patterns::ResolvedModel>> LoadResolvedModel(
    const std::filesystem::path& data_dir, const std::string& model, const std::string& dtype);

/// A deterministic random checkpoint: full tensors drawn from `seed` (a pure function of seed,
/// parameter, state and element index), then sharded to `layout` (distributed) or written
/// universal when layout.universal.
/// Errors: kAlreadyExists (dst exists), kFailedPrecondition (layout cannot hold the model), I/O.
Result<exec::ExecStats> Generate(const patterns::ModelSpec& spec,
                                 const patterns::ResolvedModel& model, const layout::Layout& layout,
                                 uint64_t seed, const std::filesystem::path& dst,
                                 const RunOptions& options);

/// Writes `src` into the new folder `dst` in the format `format` (a registry name, api/format.h)
/// at request.layout: what `ucp extract|convert|reshard --format F` run.
/// Errors: kInvalidArgument (no such writing format, a layout the format does not take), and
/// the format's Write errors.
Result<exec::ExecStats> WriteCheckpoint(const CheckpointSource& src, std::string_view format,
                                        const std::filesystem::path& dst,
                                        const WriteRequest& request);

/// Any source -> universal at dst. Errors: as Open, the plan, the executor and the writer.
Result<exec::ExecStats> Extract(const CheckpointSource& src, const std::filesystem::path& dst,
                                const RunOptions& options);

/// Any source -> distributed at `layout`, without a universal copy on disk (reshard from a
/// universal source, convert from a distributed one).
/// Errors: kFailedPrecondition (the model does not fit the layout), as Extract.
Result<exec::ExecStats> ToLayout(const CheckpointSource& src, const layout::Layout& layout,
                                 const std::filesystem::path& dst, const RunOptions& options);

/// Checksums, the stored tensor set against the layout's (names, dtypes, shapes), and coverage
/// (every element of every parameter state written exactly once by the plan to universal), and
/// replicated copies equal.
/// Errors: kDataLoss naming the problem; kInternal for a coverage failure.
Status Verify(const CheckpointSource& src);

/// The first difference between two checkpoints' logical content, if any.
struct DiffResult {
  bool equal = true;
  std::string first_difference;  ///< "parameter \"X\" state \"fp32\": element 17: 0.5 vs 0.25"
  int64_t tensors_compared = 0;
};
/// Compares logical (universal) content, whatever the layouts or formats: the same parameters,
/// states, dtypes and shapes, and elements equal bitwise (atol 0) or within atol.
/// Errors: as Extract (reading either side).
Result<DiffResult> Diff(const CheckpointSource& a, const CheckpointSource& b, double atol,
                        const RunOptions& options);

}  // namespace ucp::api
