// Test helper for safetensors_interop_test.py: lets the Python side drive ucp's reader and writer.
//   safetensors_interop_tool dump IN OUT   one line per tensor in file order:
//                                          "t <hex name> <DTYPE> <d0,d1,...> <hex bytes>", and
//                                          "m <hex key> <hex value>" per metadata entry
//   safetensors_interop_tool copy IN OUT   reads every tensor of IN with ucp and writes them, with
//                                          IN's metadata (or none), to OUT with ucp
// Exits 1 with the Status on stderr when ucp refuses a file.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/io/safetensors/safetensors_file.h"
#include "ucp/io/safetensors/safetensors_writer.h"

namespace {

using namespace ucp::safetensors;  // NOLINT: a test tool

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    out += kDigits[u >> 4];
    out += kDigits[u & 0xf];
  }
  return out.empty() ? "-" : out;
}

int Fail(const ucp::Status& s) {
  std::cerr << s.ToString() << "\n";
  return 1;
}

int Dump(const std::string& in, const std::string& out_path) {
  auto f = SafetensorsFile::Open(in);
  if (!f.ok()) return Fail(f.status());
  std::ofstream out(out_path);
  if (f->metadata()) {
    for (const auto& [k, v] : *f->metadata()) out << "m " << Hex(k) << " " << Hex(v) << "\n";
  }
  for (const SafetensorsEntry& e : f->entries()) {
    auto t = f->ReadTensor(e);
    if (!t.ok()) return Fail(t.status());
    std::string shape;
    for (size_t i = 0; i < e.shape.size(); ++i)
      shape += (i ? "," : "") + std::to_string(e.shape[i]);
    const auto bytes = t->view().bytes;
    out << "t " << Hex(e.name) << " " << SafetensorsDTypeName(e.dtype) << " "
        << (shape.empty() ? "-" : shape) << " "
        << Hex(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())) << "\n";
  }
  return out.good() ? 0 : 1;
}

int Copy(const std::string& in, const std::string& out) {
  auto f = SafetensorsFile::Open(in);
  if (!f.ok()) return Fail(f.status());
  std::vector<ucp::Tensor> tensors;
  for (const SafetensorsEntry& e : f->entries()) {
    auto t = f->ReadTensor(e);
    if (!t.ok()) return Fail(t.status());
    tensors.push_back(std::move(*t));
  }
  std::vector<NamedTensorView> views;
  for (size_t i = 0; i < tensors.size(); ++i) {
    views.push_back({f->entries()[i].name, tensors[i].view()});
  }
  SafetensorsWriteOptions options;
  options.metadata = f->metadata();
  ucp::Status s = WriteSafetensorsFile(out, views, options);
  return s.ok() ? 0 : Fail(s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: safetensors_interop_tool dump|copy IN OUT\n";
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "dump") return Dump(argv[2], argv[3]);
  if (cmd == "copy") return Copy(argv[2], argv[3]);
  std::cerr << "unknown command " << cmd << "\n";
  return 2;
}
