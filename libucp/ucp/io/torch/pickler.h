// The pickler: PyValue -> protocol-2 pickle bytes, the way torch.save writes data.pkl (tensors as
// `_rebuild_tensor_v2` over a BINPERSID storage id, OrderedDict by REDUCE, bytes through
// `_codecs.encode`). Inert objects from a read are re-emitted as GLOBAL + REDUCE/NEWOBJ + BUILD,
// so client state such as argparse.Namespace survives a round trip.
#pragma once

#include <functional>
#include <string>

#include "ucp/base/result.h"
#include "ucp/io/torch/py_value.h"

namespace ucp::torch {

/// Maps a tensor node to the storage it is written as (the writer assigns keys and checks the
/// node is one it owns). Called once per distinct tensor node.
using StorageAssigner = std::function<Result<StorageRef>(const PyValue& tensor)>;

/// Pickles `root` with protocol 2. Shared nodes are written once and then fetched from the memo;
/// a cycle through a list or dict is written as Python would, a cycle through a tuple is refused.
/// Errors: kInvalidArgument (nesting deeper than 1000, a cycle through a tuple, a global with no
/// module, an object whose callable is not a global, a str that is not UTF-8); errors of
/// `assign`.
Result<std::string> PickleValue(const PyValue& root, const StorageAssigner& assign);

}  // namespace ucp::torch
