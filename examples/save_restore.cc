// How a trainer uses libucp to save and restore: all ranks of tp=2,dp=2 (ZeRO-1) are played in
// one process. Each rank's state is first restored from a "pretrained" universal checkpoint
// into the trainer's own buffers, then saved through RankSaver as a distributed checkpoint; a
// tp=1 trainer then restores from that distributed checkpoint and must get exactly the values a
// restore straight from the universal checkpoint gives. Exit 0 when the values match.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ucp/api/checkpoint.h"
#include "ucp/api/trainer.h"
#include "ucp/layout/layout.h"

namespace {

// What a trainer rank owns: its buffers, by the plan's tensor names.
using RankMemory = std::map<std::string, ucp::Tensor>;

int Fail(const ucp::Status& s, const char* what) {
  std::fprintf(stderr, "save_restore: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

// Allocates the rank's buffers and restores them from `src`.
ucp::Result<RankMemory> Restore(const ucp::api::CheckpointSource& src, const ucp::layout::Layout& l,
                                int64_t rank) {
  auto infos = ucp::api::RankTensors(src.meta().model, l, rank, src.meta().plan_options());
  if (!infos.ok()) return infos.status();
  RankMemory mem;
  std::vector<std::pair<std::string, ucp::TensorView>> views;
  for (const auto& t : *infos) {
    auto buf = ucp::Tensor::Zeros(t.dtype, t.shape);
    if (!buf.ok()) return buf.status();
    mem[t.name] = std::move(*buf);
  }
  for (auto& [name, tensor] : mem) views.emplace_back(name, tensor.view());
  ucp::Status s = ucp::api::RestoreRank(src, l, rank, views);
  if (!s.ok()) return s;
  return mem;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const fs::path work = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "ucp_example";
  fs::remove_all(work);
  fs::create_directories(work);
  const fs::path data = ucp::api::UcpDataDir();

  // A pretrained model as a universal checkpoint (in a real job: `ucp extract` of a past run).
  auto model = ucp::api::LoadResolvedModel(data, "gpt-tiny", "bf16");
  if (!model.ok()) return Fail(model.status(), "load model");
  auto gen = ucp::api::Generate(model->first, model->second, ucp::layout::UniversalLayout(), 42,
                                work / "pretrained", {});
  if (!gen.ok()) return Fail(gen.status(), "generate");
  auto universal = ucp::api::CheckpointSource::Open(work / "pretrained", data);
  if (!universal.ok()) return Fail(universal.status(), "open universal");

  // Training at tp=2,dp=2: every rank restores its slices and fragments, then saves them.
  auto train = ucp::layout::ParseLayout("tp=2,pp=1,dp=2,zero=1");
  if (!train.ok()) return Fail(train.status(), "layout");
  ucp::api::CheckpointMeta meta = (*universal)->meta();
  meta.layout = *train;
  meta.step = 1000;
  auto saver = ucp::api::RankSaver::Create(work / "step1000", meta);
  if (!saver.ok()) return Fail(saver.status(), "saver");
  for (int64_t rank = 0; rank < ucp::layout::WorldSize(*train); ++rank) {
    auto mem = Restore(**universal, *train, rank);
    if (!mem.ok()) return Fail(mem.status(), "restore at tp=2,dp=2");
    std::vector<std::pair<std::string, ucp::ConstTensorView>> views;
    for (const auto& [name, tensor] : *mem) views.emplace_back(name, tensor.view());
    ucp::Status s = saver->SaveRank(rank, views);
    if (!s.ok()) return Fail(s, "save rank");
  }
  if (ucp::Status s = saver->Commit(); !s.ok()) return Fail(s, "commit");

  // Resuming at tp=1,dp=1 from the distributed checkpoint: the same values as from universal.
  auto dist = ucp::api::CheckpointSource::Open(work / "step1000", data);
  if (!dist.ok()) return Fail(dist.status(), "open distributed");
  auto single = ucp::layout::ParseLayout("tp=1,pp=1,dp=1");
  auto from_dist = Restore(**dist, *single, 0);
  if (!from_dist.ok()) return Fail(from_dist.status(), "restore at tp=1 from distributed");
  auto from_universal = Restore(**universal, *single, 0);
  if (!from_universal.ok()) return Fail(from_universal.status(), "restore at tp=1 from universal");
  int64_t bytes = 0;
  for (const auto& [name, tensor] : *from_dist) {
    if (!ucp::BitwiseEqual(tensor.view(), from_universal->at(name).view())) {
      std::fprintf(stderr, "save_restore: tensor %s differs\n", name.c_str());
      return 1;
    }
    bytes += tensor.num_bytes();
  }
  std::printf("restored %zu tensors (%lld bytes) at tp=1 from a tp=2,dp=2 save: identical\n",
              from_dist->size(), static_cast<long long>(bytes));
  fs::remove_all(work);
  return 0;
}
