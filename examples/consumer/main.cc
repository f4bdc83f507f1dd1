// Links the installed libucp from an outside project: casts a few values and prints them.
#include <cstdio>
#include <vector>

#include "ucp/tensor/cast.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/tensor.h"

int main() {
  ucp::Result<ucp::DType> bf16 = ucp::DTypeFromName("bfloat16");
  if (!bf16.ok()) {
    std::fprintf(stderr, "%s\n", bf16.status().ToString().c_str());
    return 1;
  }
  std::vector<float> values = {1.0f, 3.14159f, -2.5f};
  ucp::Result<ucp::Tensor> t = ucp::Tensor::Zeros(*bf16, {3});
  if (!t.ok()) return 1;
  ucp::Status s = ucp::CastElements(
      ucp::DType::kFp32, std::as_bytes(std::span<const float>(values)), *bf16,
      t->view().bytes, 3);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  for (uint16_t bits : t->as<uint16_t>()) std::printf("0x%04x\n", bits);
  return 0;
}
