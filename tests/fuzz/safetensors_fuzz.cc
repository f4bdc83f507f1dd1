// libFuzzer target for the safetensors reader: the bytes are tried as a whole file (header size,
// header JSON, every validation rule), then every tensor the header accepts is read back, whole
// and by sub-range. The header parser alone is also run with the bytes as the JSON text. Any
// crash, hang, leak or sanitizer report is a bug; error Statuses are the expected outcome.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ucp/io/safetensors/safetensors_file.h"
#include "ucp/io/safetensors/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span<const uint8_t>(data, size));
  auto f = ucp::safetensors::SafetensorsFile::OpenBuffer(bytes, "fuzz.safetensors");
  if (f.ok()) {
    // An accepted header describes only bytes inside the buffer, so every read must succeed.
    std::vector<std::byte> piece(8);
    for (const auto& e : f->entries()) {
      auto t = f->ReadTensor(e);
      if (!t.ok()) __builtin_trap();
      const int64_t n = std::min<int64_t>(e.num_bytes(), 8);
      if (!f->ReadRange(e, e.num_bytes() - n, e.num_bytes(), std::span(piece).first(n)).ok()) {
        __builtin_trap();
      }
    }
  }
  (void)ucp::safetensors::ParseHeader(bytes, static_cast<int64_t>(size) + 8, "fuzz.json").ok();
  return 0;
}
