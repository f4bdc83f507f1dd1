// `ucp extract`: any supported checkpoint (distributed, universal, DeepSpeed, HF) -> universal, or
// full tensors in another format (--format hf).
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunExtract(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "extract"));
  const std::string src_path = vm["src"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>()));
  // Full tensors: the universal layout (ucp universal, or hf).
  return RunWrite(vm, io, *setup, *src, layout::UniversalLayout(), /*layout_given=*/true);
}

Command MakeExtractCommand() {
  return {
      .name = "extract",
      .summary =
          "convert a checkpoint to the universal format (full tensors; --format hf: a "
          "Hugging Face folder)",
      .usage = "SRC DST [--model M] [--format ucp|hf]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
                "dst", po::value<std::string>()->required(), "output folder (must not exist)");
            AddFormatOptions(o, "ucp");
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
