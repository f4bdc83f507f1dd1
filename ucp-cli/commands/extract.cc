// `ucp extract`: any supported checkpoint -> universal. DeepSpeed / Megatron-DeepSpeed folders
// are recognised by their file names and go through the DeepSpeed reader (docs/deepspeed.md).
#include <algorithm>
#include <ostream>
#include <thread>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"

namespace ucp::cli {
namespace {

Status RunExtract(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "extract"));
  const std::string src_path = vm["src"].as<std::string>();
  const std::string dst = vm["dst"].as<std::string>();
  if (deepspeed::LooksLikeDeepSpeedCheckpoint(src_path)) {
    deepspeed::ExtractOptions ds;
    ds.model = vm["model"].as<std::string>();
    const int threads = vm["threads"].as<int>();
    ds.threads = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    UCP_RETURN_IF_ERROR(deepspeed::ExtractDeepSpeedToUniversal(src_path, dst, ds),
                        "while extracting DeepSpeed checkpoint " + src_path);
    io.out << "extracted " << dst << " from DeepSpeed checkpoint " << src_path << "\n";
    return Status::Ok();
  }
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC"));
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, api::Extract(*src, dst, setup->options));
  io.out << "extracted " << dst << ": " << stats.targets_written << " tensors, "
         << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

Command MakeExtractCommand() {
  return {
      .name = "extract",
      .summary = "convert a checkpoint to the universal format",
      .usage = "SRC DST",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
                "dst", po::value<std::string>()->required(), "output folder (must not exist)")(
                "model", po::value<std::string>()->default_value(""),
                "DeepSpeed sources: model preset or rule-set family whose merge rules apply "
                "(default: recognised from the parameter names)");
            AddRunOptions(o);
            p.add("src", 1).add("dst", 1);
          },
      .run = RunExtract,
  };
}
UCP_REGISTER_COMMAND(MakeExtractCommand);

}  // namespace
}  // namespace ucp::cli
