// `ucp convert`: distributed (ucp or DeepSpeed) checkpoint -> ucp distributed at another layout,
// streaming (no universal copy).
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunConvert(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "convert"));
  UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(vm["layout"].as<std::string>()),
                       "--layout");
  const std::string src_path = vm["src"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>()));
  const std::string format = vm["format"].as<std::string>();
  if (format == "deepspeed") return RunDeepSpeedOutput(vm, io, *setup, *src, l);
  if (format != "ucp") {
    return InvalidArgumentError("--format must be ucp or deepspeed, got \"" + format + "\"");
  }
  if (src->meta().format == api::Format::kUniversal) {
    return InvalidArgumentError("SRC " + src_path + " is " +
                                std::string(api::FormatName(src->meta().format)) +
                                "; convert needs a distributed checkpoint (reshard reads universal "
                                "ones)");
  }
  const std::string dst = vm["dst"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, api::ToLayout(*src, l, dst, setup->options));
  io.out << "wrote " << dst << " at " << layout::ToString(l) << ": " << stats.targets_written
         << " tensors, " << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

Command MakeConvertCommand() {
  return {
      .name = "convert",
      .summary =
          "distributed (ucp or DeepSpeed) checkpoint -> distributed at another layout, "
          "streaming (no universal copy); any checkpoint -> DeepSpeed with --format deepspeed",
      .usage = "SRC DST --layout L [--model M] [--format ucp|deepspeed]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
                "dst", po::value<std::string>()->required(), "output folder (must not exist)")(
                "layout", po::value<std::string>()->required(), "target layout, tp=4,pp=1,dp=2")(
                "format", po::value<std::string>()->default_value("ucp"),
                "ucp (the per-rank format) or deepspeed (DeepSpeed ZeRO files at the layout, "
                "from any source)");
            AddDeepSpeedOutputOptions(o, /*with_model_states_from=*/true);
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
