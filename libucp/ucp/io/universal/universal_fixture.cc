// Test tool: writes a universal checkpoint holding every dtype to DIR/ckpt, plus each stored
// dataset's expected raw little-endian bytes to DIR/expected/N.bin and an index
// DIR/expected/index.tsv (file, dataset, dtype, shape, bin), so that Python (h5py, h5dump) can
// compare what it reads with what ucp wrote. Usage: universal_fixture DIR [LEVEL]
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "tests/testutil/gen.h"
#include "ucp/io/safe_name.h"
#include "ucp/io/universal/universal_checkpoint.h"

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  using namespace ucp;
  if (argc < 2) {
    std::cerr << "usage: universal_fixture DIR [LEVEL]\n";
    return 2;
  }
  const fs::path dir = argv[1];
  const int level = argc > 2 ? std::atoi(argv[2]) : 0;
  fs::create_directories(dir / "expected");
  auto w = io::UniversalWriter::Create(
      dir / "ckpt", {.step = 12, .compression_level = level, .chunk_bytes = 4096});
  if (!w.ok()) {
    std::cerr << w.status() << "\n";
    return 1;
  }
  ucp::testing::Gen gen(2024);
  std::ofstream index(dir / "expected" / "index.tsv");
  int n = 0;
  for (DType d : kAllDTypes) {
    const Shape shape = {gen.Int(1, 50), gen.Int(1, 70)};
    Tensor fp32 = gen.RandomTensor(DType::kFp32, shape);
    Tensor raw = gen.RandomTensor(d, shape);
    const std::string name = "model.layer/" + std::string(DTypeName(d));
    std::vector<io::NamedState> states = {{"fp32", fp32.view()}, {"exp_avg", raw.view()}};
    Status st = w->WriteParameter({.name = name, .shape = shape, .dtype = d}, states);
    if (!st.ok()) {
      std::cerr << st << "\n";
      return 1;
    }
    auto file = io::ParamFileName(name);
    for (const auto& [sname, view] : states) {
      const std::string bin = std::to_string(n++) + ".bin";
      std::ofstream(dir / "expected" / bin, std::ios::binary)
          .write(reinterpret_cast<const char*>(view.bytes.data()), view.bytes.size());
      index << *file << "\t" << sname << "\t" << DTypeName(view.dtype) << "\t" << shape[0] << ","
            << shape[1] << "\t" << bin << "\n";
    }
  }
  io::UniversalManifest h;
  h.step = 12;
  h.optimizer_kind = "adam";
  h.hyper = {{"lr", 1e-3}, {"beta1", 0.9}};
  h.optimizer_states = {"exp_avg"};
  h.source_layout = "tp=1,pp=1,dp=1,zero=0";
  h.source_model = "gpt2";
  h.source_framework = "ucp-test";
  h.client_state_json = R"({"iteration": 12})";
  Status st = w->Commit(h);
  if (!st.ok()) {
    std::cerr << st << "\n";
    return 1;
  }
  return 0;
}
