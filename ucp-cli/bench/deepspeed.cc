// `ucp-bench deepspeed SRC DST [--threads N]`: times the extraction of a DeepSpeed checkpoint
// folder (make one with tools/make_deepspeed_fixtures.py --big) into a universal checkpoint, as
// `ucp extract` runs it (open the DeepSpeed source, verify its record checksums, plan, execute),
// and reports wall time, CPU time and peak RSS of this process, for the figure beside DeepSpeed's
// ds_to_universal.py in docs/PERFORMANCE.md.
#include <sys/resource.h>

#include <chrono>
#include <filesystem>
#include <iomanip>
#include <ostream>
#include <string>

#include "ucp-cli/command.h"
#include "ucp/api/checkpoint.h"
#include "ucp/base/status_macros.h"
#include "ucp/exec/executor.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

int64_t FolderBytes(const fs::path& dir) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  }
  return n;
}

Status RunDeepSpeedBench(const po::variables_map& vm, CommandIo& io) {
  const fs::path src = vm["src"].as<std::string>();
  const fs::path dst = vm["dst"].as<std::string>();
  const int threads = vm["threads"].as<int>();
  exec::ScopedThreadLimit limit(threads);
  const auto t0 = std::chrono::steady_clock::now();
  UCP_ASSIGN_OR_RETURN(auto source, api::CheckpointSource::Open(src, api::UcpDataDir()), "SRC");
  UCP_RETURN_IF_ERROR(api::Extract(*source, dst, api::RunOptions{}).status());
  const double wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double user_s = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6;
  const double sys_s = ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
  io.out << std::fixed << std::setprecision(2) << "deepspeed extract: " << wall_s << " s wall, "
         << user_s << " s user, " << sys_s << " s system, peak RSS "
         << static_cast<double>(ru.ru_maxrss) / (1 << 20) << " GiB, threads " << threads
         << ", output " << static_cast<double>(FolderBytes(dst)) / (1 << 30) << " GiB\n";
  return Status::Ok();
}

Command MakeDeepSpeedBench() {
  Command c;
  c.name = "deepspeed";
  c.summary = "time DeepSpeed checkpoint extraction into a universal checkpoint";
  c.usage = "SRC DST [--threads N]";
  c.add_options = [](po::options_description& o, po::positional_options_description& p) {
    o.add_options()("src", po::value<std::string>()->required(), "DeepSpeed checkpoint folder")(
        "dst", po::value<std::string>()->required(), "new universal checkpoint folder")(
        "threads", po::value<int>()->default_value(2), "worker threads (0: every core)");
    p.add("src", 1).add("dst", 1);
  };
  c.run = RunDeepSpeedBench;
  return c;
}

UCP_REGISTER_COMMAND(MakeDeepSpeedBench);

}  // namespace
}  // namespace ucp::cli
