// How the processes of a trainer save one checkpoint together, each writing only its own ranks:
// started by `mpirun -np N` (N dividing 4), or alone as one process holding every rank. The
// layout is tp=2,dp=2 (ZeRO-1); process p holds the ranks r with r % N == p. Every rank
// restores its slices and fragments from a "pretrained" universal checkpoint, saves them
// through one RankSaver shared by all processes (SaveOptions::group), and the root commits.
// Then every process resumes at tp=1,dp=2 from that checkpoint and must get exactly what a
// restore straight from the universal checkpoint gives. The saved checkpoint is left in
// WORK/step1000: the same bytes whatever N (tests/mpi compares them). Exit 0 when all match.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ucp/api/checkpoint.h"
#include "ucp/api/trainer.h"
#include "ucp/layout/layout.h"
#include "ucp/mpi/mpi_group.h"

namespace {

using RankMemory = std::map<std::string, ucp::Tensor>;

int Fail(const ucp::Status& s, const char* what) {
  std::fprintf(stderr, "mpi_save_restore: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

// Allocates a rank's buffers and restores them from `src`.
ucp::Result<RankMemory> Restore(const ucp::api::CheckpointSource& src, const ucp::layout::Layout& l,
                                int64_t rank) {
  auto infos = ucp::api::RankTensors(src.meta().model, l, rank, src.meta().plan_options());
  if (!infos.ok()) return infos.status();
  RankMemory mem;
  for (const auto& t : *infos) {
    auto buf = ucp::Tensor::Zeros(t.dtype, t.shape);
    if (!buf.ok()) return buf.status();
    mem[t.name] = std::move(*buf);
  }
  std::vector<std::pair<std::string, ucp::TensorView>> views;
  for (auto& [name, tensor] : mem) views.emplace_back(name, tensor.view());
  if (ucp::Status s = ucp::api::RestoreRank(src, l, rank, views); !s.ok()) return s;
  return mem;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const fs::path work =
      argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "ucp_mpi_example";
  const fs::path data = ucp::api::UcpDataDir();
  std::unique_ptr<ucp::api::ProcessGroup> world;
  if (ucp::mpi::LaunchedByMpi()) {
    auto g = ucp::mpi::WorldGroup();
    if (!g.ok()) return Fail(g.status(), "mpi");
    world = std::move(*g);
  }
  ucp::api::ProcessGroup& group = world ? *world : ucp::api::SingleProcess();

  // The root makes the pretrained model; the others wait for it (Agree is also a barrier).
  auto model = ucp::api::LoadResolvedModel(data, "gpt-tiny", "bf16");
  if (!model.ok()) return Fail(model.status(), "load model");
  ucp::Status made;
  if (group.is_root()) {
    fs::remove_all(work);
    fs::create_directories(work);
    made = ucp::api::Generate(model->first, model->second, ucp::layout::UniversalLayout(), 42,
                              work / "pretrained", {})
               .status();
  }
  if (ucp::Status s = group.Agree(made); !s.ok()) return Fail(s, "generate");
  auto universal = ucp::api::CheckpointSource::Open(work / "pretrained", data);
  if (!universal.ok()) return Fail(universal.status(), "open universal");

  auto train = ucp::layout::ParseLayout("tp=2,pp=1,dp=2,zero=1");
  if (!train.ok()) return Fail(train.status(), "layout");
  const int64_t ranks = ucp::layout::WorldSize(*train);
  if (ranks % group.size() != 0) {
    return Fail(ucp::InvalidArgumentError("run with 1, 2 or 4 processes"), "process count");
  }
  ucp::api::SaveOptions save;
  save.group = &group;
  for (int64_t r = group.rank(); r < ranks; r += group.size()) save.ranks.push_back(r);

  ucp::api::CheckpointMeta meta = (*universal)->meta();
  meta.layout = *train;
  meta.step = 1000;
  auto saver = ucp::api::RankSaver::Create(work / "step1000", meta, save);
  if (!saver.ok()) return Fail(saver.status(), "saver");
  for (int64_t rank : save.ranks) {
    auto mem = Restore(**universal, *train, rank);
    if (!mem.ok()) return Fail(mem.status(), "restore at tp=2,dp=2");
    std::vector<std::pair<std::string, ucp::ConstTensorView>> views;
    for (const auto& [name, tensor] : *mem) views.emplace_back(name, tensor.view());
    if (ucp::Status s = saver->SaveRank(rank, views); !s.ok()) return Fail(s, "save rank");
  }
  if (ucp::Status s = saver->Commit(); !s.ok()) return Fail(s, "commit");

  // Resume at tp=1,dp=2: each process restores the ranks it would hold there.
  auto dist = ucp::api::CheckpointSource::Open(work / "step1000", data);
  if (!dist.ok()) return Fail(dist.status(), "open distributed");
  auto resume = ucp::layout::ParseLayout("tp=1,pp=1,dp=2,zero=1");
  int64_t tensors = 0;
  for (int64_t rank = group.rank(); rank < ucp::layout::WorldSize(*resume); rank += group.size()) {
    auto from_dist = Restore(**dist, *resume, rank);
    if (!from_dist.ok()) return Fail(from_dist.status(), "restore from distributed");
    auto from_universal = Restore(**universal, *resume, rank);
    if (!from_universal.ok()) return Fail(from_universal.status(), "restore from universal");
    for (const auto& [name, tensor] : *from_dist) {
      if (!ucp::BitwiseEqual(tensor.view(), from_universal->at(name).view())) {
        std::fprintf(stderr, "mpi_save_restore: rank %lld tensor %s differs\n",
                     static_cast<long long>(rank), name.c_str());
        return 1;
      }
      ++tensors;
    }
  }
  if (ucp::Status s = group.Agree(ucp::Status::Ok()); !s.ok()) return Fail(s, "finish");
  std::printf(
      "process %d of %d: saved ranks of tp=2,dp=2, resumed %lld tensors at tp=1,dp=2: "
      "identical\n",
      group.rank(), group.size(), static_cast<long long>(tensors));
  return 0;
}
