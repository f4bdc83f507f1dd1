// `ucp convert`: distributed (ucp, DeepSpeed, HF) checkpoint -> ucp distributed at another layout,
// streaming (no universal copy); any checkpoint -> any writing format with --format.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunConvert(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "convert"));
  const bool layout_given = vm.count("layout") > 0;
  layout::Layout l = layout::UniversalLayout();
  if (layout_given) {
    UCP_ASSIGN_OR_RETURN(l, layout::ParseLayout(vm["layout"].as<std::string>()), "--layout");
  }
  const std::string src_path = vm["src"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>()));
  // ucp's own output keeps the command's contract: distributed -> distributed (reshard reads
  // universal checkpoints); any other format is written from any source.
  if (vm["format"].as<std::string>() == "ucp" && src->meta().format == api::Format::kUniversal) {
    return InvalidArgumentError("SRC " + src_path + " is " + src->meta().format +
                                "; convert needs a distributed checkpoint (reshard reads universal "
                                "ones)");
  }
  return RunWrite(vm, io, *setup, *src, l, layout_given);
}

Command MakeConvertCommand() {
  return {
      .name = "convert",
      .summary =
          "distributed (ucp, DeepSpeed, Hugging Face) checkpoint -> distributed at another "
          "layout, streaming (no universal copy); any checkpoint -> another format with --format",
      .usage = "SRC DST [--layout L] [--model M] [--format ucp|deepspeed|hf|...]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
                "dst", po::value<std::string>()->required(), "output folder (must not exist)")(
                "layout", po::value<std::string>(),
                "target layout, tp=4,pp=1,dp=2 (formats of full tensors, hf, take none)");
            AddFormatOptions(o, "ucp");
            AddModelOption(o);
            AddRunOptions(o);
            p.add("src", 1).add("dst", 1);
          },
      .run = RunConvert,
  };
}
UCP_REGISTER_COMMAND(MakeConvertCommand);

}  // namespace
}  // namespace ucp::cli
