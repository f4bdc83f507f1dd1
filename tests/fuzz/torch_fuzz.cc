// libFuzzer target for the torch.save readers: the bytes are tried as a whole torch file (zip or
// legacy, then every tensor read back), as a bare zip archive, and as a bare pickle stream.
// Any crash, hang, leak or sanitizer report is a bug; error Statuses are the expected outcome.
#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_set>
#include <vector>

#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/unpickler.h"
#include "ucp/io/torch/zip_reader.h"

namespace {

// Tensors the fuzzer reads back are capped: a stride-0 view of a tiny storage can legally
// describe terabytes, and asking for those is the caller's choice, not a reader bug.
constexpr int64_t kMaxReadBytes = int64_t{64} << 20;
constexpr size_t kMaxNodes = 1 << 16;

void ReadAllTensors(const ucp::torch::TorchFile& f) {
  using ucp::torch::PyKind;
  using ucp::torch::PyValue;
  std::vector<const PyValue*> todo = {&f.root()};
  std::unordered_set<const PyValue*> seen;
  while (!todo.empty() && seen.size() < kMaxNodes) {
    const PyValue* v = todo.back();
    todo.pop_back();
    if (v == nullptr || !seen.insert(v).second) continue;
    if (v->kind() == PyKind::kTensor) {
      const auto& t = v->tensor();
      auto numel = ucp::NumElements(t.size);
      if (numel.ok() && *numel <= kMaxReadBytes / ucp::DTypeSizeBytes(t.dtype)) {
        (void)f.ReadTensor(t).ok();
        std::byte piece[16];
        (void)f.ReadTensorBytes(t, 0, std::span<std::byte>(piece, 4)).ok();
      }
      todo.push_back(t.state);
    }
    for (const PyValue* c : v->items()) todo.push_back(c);
    for (const auto& [k, val] : v->entries()) {
      todo.push_back(k);
      todo.push_back(val);
    }
    todo.push_back(v->state());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span<const uint8_t>(data, size));
  for (bool strict : {false, true}) {
    ucp::torch::TorchReadOptions opts;
    opts.pickle.strict_globals = strict;
    opts.pickle.max_stack_depth = 1 << 16;
    auto f = ucp::torch::TorchFile::OpenBuffer(bytes, opts, "fuzz.pt");
    if (f.ok()) ReadAllTensors(*f);
  }
  auto src = ucp::torch::ByteSource::FromBuffer(bytes, "fuzz.bin");
  (void)ucp::torch::ZipReader::Open(src).ok();

  ucp::torch::PyArena arena;
  ucp::torch::PersistentLoader load =
      [&](const ucp::torch::PyValue&) -> ucp::Result<const ucp::torch::PyValue*> {
    ucp::torch::StorageRef s;
    s.key = "0";
    s.dtype = ucp::DType::kFp32;
    s.numel = 64;
    s.num_bytes = 256;
    return static_cast<const ucp::torch::PyValue*>(arena.Storage(s));
  };
  ucp::torch::PickleOptions popts;
  popts.max_stack_depth = 1 << 16;
  (void)ucp::torch::Unpickle(*src, 0, src->size(), arena, popts, load, "fuzz.pkl").ok();
  return 0;
}
