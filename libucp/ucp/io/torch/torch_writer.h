// TorchWriter: builds a Python value (dicts, lists, tuples, scalars, tensors, OrderedDict,
// torch.Size, dtype globals, inert objects carried over from a read) and writes it as a zip-format
// torch.save file that real torch.load reads. Tensor bytes are streamed from the caller's memory.
#pragma once

#include <deque>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/io/torch/py_value.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/zip_writer.h"
#include "ucp/tensor/tensor.h"

namespace ucp::torch {

struct TorchWriteOptions {
  /// The record prefix ("archive/" is what torch.save uses for a buffer).
  std::string archive_name = "archive";
  ZipWriteOptions zip;
};

class TorchWriter {
 public:
  explicit TorchWriter(TorchWriteOptions options = {});

  /// Where to build the value to write. Values from other arenas (a TorchFile's root, say) may
  /// be mixed in; they must outlive Write.
  PyArena& arena() { return arena_; }

  /// A tensor node for `view`, which must stay valid until Write returns: its bytes are written
  /// from there. fp8 dtypes are written with `_rebuild_tensor_v3` and an UntypedStorage, which
  /// torch 2.1+ reads (torch 1.13 has no fp8).
  /// Errors: kInvalidArgument when the view's byte count does not match its dtype and shape.
  Result<const PyValue*> AddTensor(ConstTensorView view, bool requires_grad = false,
                                   bool is_parameter = false);

  /// The same for a tensor the writer keeps (moved in) until it is destroyed.
  /// Errors: as AddTensor.
  Result<const PyValue*> AddOwnedTensor(Tensor tensor, bool requires_grad = false,
                                        bool is_parameter = false);

  /// Copies `value`, read from `file`, into this writer's arena: containers are copied (shared
  /// nodes stay shared), each tensor is read from `file` (contiguous now; views of one storage
  /// become separate storages) and owned by the writer, scalars, globals and inert objects are
  /// carried over with their arguments and BUILD state. This is how client state such as
  /// argparse.Namespace or a DeepSpeed loss scaler passes through a conversion.
  /// Errors: kInvalidArgument (nesting deeper than 1000); errors of TorchFile::ReadTensor.
  Result<const PyValue*> CopyFrom(const TorchFile& file, const PyValue& value);

  /// Pickles `root` and writes the file atomically: data.pkl, byteorder, data/<k> per tensor in
  /// the order the pickle meets them, version. Storage keys are "0", "1", ... in that order.
  /// Errors: kInvalidArgument (a tensor not made by this writer's AddTensor, a value the
  /// pickler refuses, an archive name with '/'); kIoError.
  Status Write(const std::filesystem::path& path, const PyValue& root);

 private:
  TorchWriteOptions options_;
  PyArena arena_;
  Result<const PyValue*> Copy(const TorchFile& file, const PyValue& v, int depth,
                              std::unordered_map<const PyValue*, const PyValue*>& done);

  std::unordered_map<const PyValue*, ConstTensorView> views_;
  std::deque<Tensor> owned_;
};

}  // namespace ucp::torch
