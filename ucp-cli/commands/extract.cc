// `ucp extract`: any supported checkpoint (distributed, universal, DeepSpeed) -> universal.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"

namespace ucp::cli {
namespace {

Status RunExtract(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "extract"));
  const std::string src_path = vm["src"].as<std::string>();
  const std::string dst = vm["dst"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>()));
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, api::Extract(*src, dst, setup->options));
  io.out << "extracted " << dst << ": " << stats.targets_written << " tensors, "
         << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

Command MakeExtractCommand() {
  return {
      .name = "extract",
      .summary = "convert a checkpoint to the universal format",
      .usage = "SRC DST [--model M]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
                "dst", po::value<std::string>()->required(), "output folder (must not exist)");
            AddModelOption(o);
            AddRunOptions(o);
            p.add("src", 1).add("dst", 1);
          },
      .run = RunExtract,
  };
}
UCP_REGISTER_COMMAND(MakeExtractCommand);

}  // namespace
}  // namespace ucp::cli
