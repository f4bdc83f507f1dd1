// `ucp-bench io`: write and read throughput of a universal checkpoint of GPT-2-like parameters
// (fp32 master + exp_avg + exp_avg_sq), against `cp -r` and `cat` of the same bytes in the same
// run. Figures go to docs/PERFORMANCE.md ("Universal checkpoint I/O").
#include <sys/types.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ucp-cli/command.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::cli {
namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Drops the page cache so reads come from disk; needs root, and may be refused in a container.
bool DropCaches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  f.flush();
  return static_cast<bool>(f);
}

struct Param {
  std::string name;
  Shape shape;
  Tensor fp32, exp_avg, exp_avg_sq;
};

// GPT-2 small shapes (d=768, vocab 50257), layers repeated until the states reach `bytes`.
std::vector<std::pair<std::string, Shape>> Shapes(int64_t bytes) {
  std::vector<std::pair<std::string, Shape>> out = {{"wte", {50257, 768}}, {"wpe", {1024, 768}}};
  int64_t total = (50257 + 1024) * 768 * 12;
  for (int l = 0; total < bytes; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    for (auto& [n, s] :
         std::vector<std::pair<std::string, Shape>>{{"ln_1.weight", {768}},
                                                    {"ln_1.bias", {768}},
                                                    {"attn.c_attn.weight", {768, 2304}},
                                                    {"attn.c_attn.bias", {2304}},
                                                    {"attn.c_proj.weight", {768, 768}},
                                                    {"attn.c_proj.bias", {768}},
                                                    {"ln_2.weight", {768}},
                                                    {"ln_2.bias", {768}},
                                                    {"mlp.c_fc.weight", {768, 3072}},
                                                    {"mlp.c_fc.bias", {3072}},
                                                    {"mlp.c_proj.weight", {3072, 768}},
                                                    {"mlp.c_proj.bias", {768}}}) {
      out.emplace_back(p + n, s);
      total += NumElementsOrDie(s) * 12;
    }
  }
  return out;
}

// Random normal data; `realistic` rounds master weights to bf16 (as after bf16 training) and
// gives exp_avg_sq the small positive magnitudes Adam produces.
Status Fill(Param& p, uint64_t seed, bool realistic) {
  UCP_ASSIGN_OR_RETURN(p.fp32, Tensor::Zeros(DType::kFp32, p.shape));
  UCP_ASSIGN_OR_RETURN(p.exp_avg, Tensor::Zeros(DType::kFp32, p.shape));
  UCP_ASSIGN_OR_RETURN(p.exp_avg_sq, Tensor::Zeros(DType::kFp32, p.shape));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto w = p.fp32.as<float>();
  auto m = p.exp_avg.as<float>();
  auto v = p.exp_avg_sq.as<float>();
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = 0.02f * normal(rng);
    m[i] = 1e-3f * normal(rng);
    v[i] = realistic ? m[i] * m[i] : 1e-6f * normal(rng);
    if (realistic) w[i] = FloatFromBf16(Bf16FromFloat(w[i]));
  }
  return Status::Ok();
}

int64_t TreeBytes(const fs::path& root) {
  int64_t n = 0;
  for (auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  }
  return n;
}

Status ReadTree(const fs::path& root) {
  std::vector<char> buf(8 << 20);
  for (auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    while (f.read(buf.data(), static_cast<std::streamsize>(buf.size())) || f.gcount() > 0) {
    }
  }
  return Status::Ok();
}

Status Run(const po::variables_map& vm, CommandIo& io) {
  const double gib = vm["size-gib"].as<double>();
  const int level = vm["compress"].as<int>();
  const int threads = vm["threads"].as<int>();
  const bool realistic = vm["data"].as<std::string>() == "bf16";
  if (vm["data"].as<std::string>() != "normal" && !realistic) {
    return InvalidArgumentError("--data must be normal or bf16");
  }
  const fs::path dir =
      fs::path(vm["dir"].as<std::string>()) / ("ucp-bench-io-" + std::to_string(::getpid()));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism,
                            static_cast<size_t>(threads > 0 ? threads : 2));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError("create " + dir.string(), ec.value());
  struct Cleanup {
    fs::path d;
    ~Cleanup() { io::RemoveTreeBestEffort(d); }
  } cleanup{dir};

  std::vector<Param> params;
  for (auto& [n, s] : Shapes(static_cast<int64_t>(gib * (1 << 30))))
    params.push_back({n, s, {}, {}, {}});
  io.err << "generating " << params.size() << " parameters...\n";
  std::vector<Status> fill(params.size());
  tbb::parallel_for(size_t{0}, params.size(),
                    [&](size_t i) { fill[i] = Fill(params[i], i, realistic); });
  for (auto& s : fill) UCP_RETURN_IF_ERROR(s);
  int64_t state_bytes = 0;
  for (auto& p : params) state_bytes += 3 * p.fp32.num_bytes();

  // Write: parameters in parallel, files fsynced, manifest, rename, parent fsynced.
  const fs::path ckpt = dir / "ckpt";
  auto t0 = Clock::now();
  UCP_ASSIGN_OR_RETURN(io::UniversalWriter w,
                       io::UniversalWriter::Create(ckpt, {.step = 1, .compression_level = level}));
  std::vector<Status> sts(params.size());
  tbb::parallel_for(size_t{0}, params.size(), [&](size_t i) {
    const Param& p = params[i];
    std::vector<io::NamedState> st = {{"fp32", p.fp32.view()},
                                      {"exp_avg", p.exp_avg.view()},
                                      {"exp_avg_sq", p.exp_avg_sq.view()}};
    sts[i] = w.WriteParameter({.name = p.name, .shape = p.shape}, st);
  });
  for (auto& s : sts) UCP_RETURN_IF_ERROR(s);
  io::UniversalManifest h;
  h.step = 1;
  h.optimizer_kind = "adam";
  h.optimizer_states = {"exp_avg", "exp_avg_sq"};
  UCP_RETURN_IF_ERROR(w.Commit(h));
  auto t1 = Clock::now();
  const int64_t disk_bytes = TreeBytes(ckpt);

  // Baseline write: cp -r of the same files, then fsync of every copied file and folder.
  const fs::path copy = dir / "copy";
  auto t2 = Clock::now();
  const std::string cmd = "cp -r '" + ckpt.string() + "' '" + copy.string() + "'";
  if (std::system(cmd.c_str()) != 0) return IoError("'" + cmd + "' failed");
  UCP_RETURN_IF_ERROR(io::FsyncTree(copy));
  auto t3 = Clock::now();

  // Read: open + Verify (every state read in full and checksummed).
  const bool dropped = DropCaches();
  auto t4 = Clock::now();
  UCP_ASSIGN_OR_RETURN(io::UniversalReader r, io::UniversalReader::Open(ckpt));
  UCP_RETURN_IF_ERROR(r.Verify());
  auto t5 = Clock::now();
  DropCaches();
  auto t6 = Clock::now();
  UCP_RETURN_IF_ERROR(ReadTree(copy));
  auto t7 = Clock::now();

  const double gb = static_cast<double>(state_bytes) / (1 << 30);
  auto line = [&](const char* what, double s, double base) {
    io.out << std::left << std::setw(28) << what << std::right << std::fixed << std::setprecision(3)
           << std::setw(8) << s << " s  " << std::setprecision(2) << std::setw(7) << gb / s
           << " GiB/s   x" << s / base << " of baseline\n";
  };
  io.out << "universal checkpoint: " << params.size() << " parameters, " << std::setprecision(3)
         << gb << " GiB of state, " << static_cast<double>(disk_bytes) / (1 << 30)
         << " GiB on disk (ratio " << static_cast<double>(state_bytes) / disk_bytes << "), data "
         << (realistic ? "bf16-rounded" : "random normal") << ", zstd level " << level << ", "
         << threads << " threads, page cache dropped: " << (dropped ? "yes" : "no") << "\n";
  line("write (ucp, fsync)", Seconds(t0, t1), Seconds(t2, t3));
  line("cp -r + fsync (baseline)", Seconds(t2, t3), Seconds(t2, t3));
  line("read+verify (ucp)", Seconds(t4, t5), Seconds(t6, t7));
  line("read files (baseline)", Seconds(t6, t7), Seconds(t6, t7));
  return Status::Ok();
}

Command MakeIoBench() {
  return {
      .name = "io",
      .summary =
          "universal checkpoint write/read throughput against cp -r and cat of the same bytes",
      .usage = "[--size-gib G] [--compress LEVEL] [--threads N] [--dir D] [--data normal|bf16]",
      .add_options =
          [](po::options_description& o, po::positional_options_description&) {
            o.add_options()("size-gib", po::value<double>()->default_value(1.0),
                            "GiB of state bytes")("compress", po::value<int>()->default_value(0),
                                                  "zstd level, 0 for none")(
                "threads", po::value<int>()->default_value(2), "worker threads")(
                "dir", po::value<std::string>()->default_value("/tmp"), "scratch folder")(
                "data", po::value<std::string>()->default_value("normal"),
                "normal (random normal) or bf16 (bf16-rounded master weights)");
          },
      .run = Run,
  };
}
UCP_REGISTER_COMMAND(MakeIoBench);

}  // namespace
}  // namespace ucp::cli
