// `ucp reshard`: universal checkpoint -> distributed at a layout.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/deepspeed/deepspeed_universal.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunReshard(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "reshard"));
  UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(vm["layout"].as<std::string>()),
                       "--layout");
  const std::string src_path = vm["src"].as<std::string>();
  const std::string format = vm["format"].as<std::string>();
  if (format == "deepspeed-universal") {
    // DeepSpeed's own universal layout, for `--universal-checkpoint` resumes; its loader cuts
    // the new layout itself, so only tp and pp (the model-state files) come from --layout.
    UCP_ASSIGN_OR_RETURN(io::UniversalReader reader, io::UniversalReader::Open(src_path), "SRC");
    deepspeed::DeepSpeedUniversalOptions ds;
    ds.tp = l.tp;
    ds.pp = l.pp;
    ds.model_states_from = vm["model-states-from"].as<std::string>();
    const std::string dst = vm["dst"].as<std::string>();
    UCP_RETURN_IF_ERROR(deepspeed::WriteDeepSpeedUniversal(reader, dst, ds),
                        "while writing DeepSpeed universal checkpoint " + dst);
    io.out << "wrote DeepSpeed universal checkpoint " << dst << "\n";
    return Status::Ok();
  }
  if (format == "deepspeed") {
    // A DeepSpeed ZeRO checkpoint at the layout, from any source.
    UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>()));
    return RunDeepSpeedOutput(vm, io, *setup, *src, l);
  }
  if (format != "ucp") {
    return InvalidArgumentError("--format must be ucp, deepspeed or deepspeed-universal, got \"" +
                                format + "\"");
  }
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>()));
  if (src->meta().format != api::Format::kUniversal) {
    return InvalidArgumentError("SRC " + src_path + " is " +
                                std::string(api::FormatName(src->meta().format)) +
                                "; reshard needs a universal checkpoint");
  }
  const std::string dst = vm["dst"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, api::ToLayout(*src, l, dst, setup->options));
  io.out << "wrote " << dst << " at " << layout::ToString(l) << ": " << stats.targets_written
         << " tensors, " << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

Command MakeReshardCommand() {
  return {
      .name = "reshard",
      .summary =
          "universal checkpoint -> distributed at a layout (any checkpoint -> DeepSpeed "
          "with --format deepspeed)",
      .usage = "SRC DST --layout L [--format ucp|deepspeed|deepspeed-universal]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
                "dst", po::value<std::string>()->required(), "output folder (must not exist)")(
                "layout", po::value<std::string>()->required(), "target layout, tp=4,pp=1,dp=2")(
                "format", po::value<std::string>()->default_value("ucp"),
                "ucp (the per-rank format), deepspeed (DeepSpeed ZeRO files at the layout, "
                "from any source) or deepspeed-universal (zero/<param>/fp32.pt ...)")(
                "model-states-from", po::value<std::string>()->default_value(""),
                "deepspeed, deepspeed-universal: a DeepSpeed tag folder whose client state "
                "(args, RNG, scheduler, optimizer hyper-parameters) is carried over");
            AddDeepSpeedOutputOptions(o, /*with_model_states_from=*/false);
            AddModelOption(o);
            AddRunOptions(o);
            p.add("src", 1).add("dst", 1);
          },
      .run = RunReshard,
  };
}
UCP_REGISTER_COMMAND(MakeReshardCommand);

}  // namespace
}  // namespace ucp::cli
