// `ucp generate`: a deterministic random checkpoint of a model at a layout.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunGenerate(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "generate"));
  UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(vm["layout"].as<std::string>()),
                       "--layout");
  UCP_ASSIGN_OR_RETURN(auto model,
                       api::LoadResolvedModel(api::UcpDataDir(), vm["model"].as<std::string>(),
                                              vm["dtype"].as<std::string>()));
  const std::string out = vm["out"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(
      exec::ExecStats stats,
      api::Generate(model.first, model.second, l, vm["seed"].as<uint64_t>(), out, setup->options));
  io.out << "generated " << out << ": " << model.first.name << " at " << layout::ToString(l) << ", "
         << stats.targets_written << " tensors, " << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

Command MakeGenerateCommand() {
  return {
      .name = "generate",
      .summary = "write a deterministic random checkpoint of a model at a layout",
      .usage = "--model PRESET_OR_FILE --layout L [--dtype bf16] [--seed N] --out DIR",
      .add_options =
          [](po::options_description& o, po::positional_options_description&) {
            o.add_options()("model", po::value<std::string>()->required(),
                            "preset (gpt-tiny, llama-tiny, mixtral-tiny, gpt2-small) or .json")(
                "layout", po::value<std::string>()->required(),
                "tp=2,pp=2,dp=2,zero=1 or universal")(
                "dtype", po::value<std::string>()->default_value(""),
                "training dtype of the model slices (default: the preset's)")(
                "seed", po::value<uint64_t>()->default_value(0), "random seed")(
                "out", po::value<std::string>()->required(), "output folder (must not exist)");
            AddRunOptions(o);
          },
      .run = RunGenerate,
  };
}
UCP_REGISTER_COMMAND(MakeGenerateCommand);

}  // namespace
}  // namespace ucp::cli
