// A pickle machine that executes nothing (formats.md 1.3-1.6): it decodes the opcode subset that
// torch.save and DeepSpeed files use into PyValues, calls no Python, and resolves globals only
// from an allowlist. Tensor rebuilds become TensorRefs; allowlisted non-torch classes
// (argparse.Namespace, numpy arrays and dtypes, DeepSpeed and Megatron classes) become inert
// objects that record their constructor arguments and BUILD state.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "ucp/base/result.h"
#include "ucp/io/torch/byte_source.h"
#include "ucp/io/torch/py_value.h"

namespace ucp::torch {

struct PickleOptions {
  /// Only the torch allowlist (tensor and storage rebuilds, OrderedDict, torch.Size, dtypes,
  /// torch.device, sets, bytes). Off: also inert argparse, numpy, deepspeed.* and megatron.*.
  bool strict_globals = false;
  int64_t max_memo_entries = int64_t{1} << 22;
  int64_t max_stack_depth = int64_t{1} << 20;  ///< values plus marks on the stack
  /// Nesting of containers (list, tuple, dict, set, object arguments and state).
  int64_t max_nesting_depth = 200;
  /// Items of one list, tuple, set or dict, and of all of them together.
  int64_t max_items = int64_t{1} << 24;
  /// Memory the machine may account for its values (nodes, strings, container slots); 0 means
  /// kMemoryBaseBytes + kMemoryPerPickleByte x the pickle's size.
  int64_t max_memory_bytes = 0;

  static constexpr int64_t kMemoryBaseBytes = int64_t{256} << 20;
  static constexpr int64_t kMemoryPerPickleByte = 32;
};

/// Called for each BINPERSID with the persistent id (a tuple); returns the storage node that
/// stands for it. The torch file reader checks the key against its records here.
using PersistentLoader = std::function<Result<const PyValue*>(const PyValue& pid)>;

struct UnpickleResult {
  const PyValue* value = nullptr;
  int64_t end_offset = 0;  ///< the file offset just after STOP
};

/// Runs the pickle that starts at `begin` in `source` and must end (STOP) at or before `end`.
/// `what` names the stream in messages ("data.pkl of /ckpt/x.pt").
/// Errors: kDataLoss for every structural fault (unknown opcode byte, truncation, a stack or
/// mark underflow, wrong argument types, a bad memo index, a size past the stream, a tensor view
/// outside its storage) and for a global outside the allowlist, each naming the opcode and its
/// byte offset from `begin`; kUnimplemented for real opcodes outside the subset (INST, OBJ, EXT*,
/// out-of-band buffers, text STRING/UNICODE), protocols above 5 and torch dtypes ucp lacks;
/// kResourceExhausted past the memo, stack, nesting, item or memory limits (naming `what`, the
/// opcode and its offset); errors of `load`. None, True and False are shared nodes and memo gets
/// are references (never copies), so a pickle's values cost memory in proportion to its size.
Result<UnpickleResult> Unpickle(const ByteSource& source, int64_t begin, int64_t end,
                                PyArena& arena, const PickleOptions& options,
                                const PersistentLoader& load, std::string_view what);

/// The element type of a `torch.<X>Storage` class name such as "torch.HalfStorage"; nullopt
/// for "torch.UntypedStorage" (bytes).
/// Errors: kDataLoss for a name that is no storage class; kUnimplemented for storage classes
/// ucp has no dtype for (complex, quantized).
Result<std::optional<DType>> StorageDTypeFromClass(std::string_view class_name);
/// "torch.FloatStorage" for DType::kFp32, ...; empty for dtypes without a legacy class (fp8).
std::string_view StorageClassForDType(DType dtype);

/// True when `module_dot_name` may appear as a GLOBAL under `options` (builtins already mapped
/// from __builtin__).
bool IsAllowedGlobal(std::string_view module_dot_name, const PickleOptions& options);

/// True when a value copied from a read file into a written one may hold the global
/// `module_dot_name` (TorchWriter::CopyFrom): the strict torch allowlist, argparse.Namespace and
/// numpy's array and RNG reconstructors, and the DeepSpeed / Megatron classes their own loaders
/// need (loss scalers, fragment_address, ZeroStageEnum, Megatron's enums). Reading accepts any
/// deepspeed.* or megatron.* name as an inert object because ucp never calls it; a written file
/// is loaded by torch.load, which would import and call it, so only these are carried.
bool IsCarriedGlobal(std::string_view module_dot_name);

}  // namespace ucp::torch
