// `ucp generate`: a deterministic random checkpoint of a model at a layout.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunGenerate(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "generate", true));
  // DST is positional like every other command's; --out is the older spelling.
  if (vm.count("dst") && vm.count("out")) {
    return InvalidArgumentError("DST given twice (positional and --out); give it once");
  }
  if (!vm.count("dst") && !vm.count("out")) {
    // What main reports for a missing positional of the other commands (a usage error, exit 2);
    // boost cannot require "DST or --out".
    io.err << "ucp generate: usage error: missing DST (see ucp help generate)\n";
    io.exit_code = 2;
    return Status::Ok();
  }
  const std::string out =
      vm.count("dst") ? vm["dst"].as<std::string>() : vm["out"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(layout::Layout l, layout::ParseLayout(vm["layout"].as<std::string>()),
                       "--layout");
  const std::filesystem::path data_dir = DataDir(vm);
  const std::string model_name = vm["model"].as<std::string>();
  Result<std::pair<patterns::ModelSpec, patterns::ResolvedModel>> model =
      api::LoadResolvedModel(data_dir, model_name, vm["dtype"].as<std::string>());
  if (!model.ok()) return WithPresetHint(model.status(), model_name, data_dir);
  api::CheckpointMeta meta;
  meta.model = model->second;
  meta.spec = model->first;
  Result<exec::ExecStats> stats =
      api::Generate(model->first, model->second, l, vm["seed"].as<uint64_t>(), out, setup->options);
  if (!stats.ok()) return WithFitHint(stats.status(), meta, l);
  if (io.json) {
    json::OrderedJson j;
    j["command"] = "generate";
    j["ok"] = true;
    j["exit_code"] = 0;
    j["output"] = {{"path", out},
                   {"format", "ucp"},
                   {"layout", layout::ToString(l)},
                   {"model", model->first.name},
                   {"family", model->first.family},
                   {"tensors", stats->targets_written},
                   {"bytes_written", stats->bytes_written}};
    j["elapsed_s"] = setup->Seconds();
    io.out << j.dump(2) << "\n";
    return Status::Ok();
  }
  if (setup->quiet) return Status::Ok();  // --quiet: errors only, as for the conversions
  io.out << "generated " << out << ": " << model->first.name << " at " << layout::ToString(l)
         << ", " << stats->targets_written << " tensors, " << Gib(stats->bytes_written) << "\n";
  return Status::Ok();
}

Command MakeGenerateCommand() {
  return {
      .name = "generate",
      .summary = "write a deterministic random checkpoint of a model at a layout",
      .usage = "DST --model M --layout L [--dtype bf16] [--seed N] [options]",
      .examples = {"ucp generate ckpt --model gpt-tiny --layout tp=2,pp=2,dp=2,zero=1 --seed 1",
                   "ucp generate universal --model llama-tiny --layout universal",
                   "ucp generate big --model my_model.json --layout tp=8 --dtype bf16"},
      .description =
          "Each element of each full parameter state is a pure function of (seed, parameter,\n"
          "state, index); the model slice is the fp32 master rounded to the training dtype.",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            static const std::string model_help = "model preset (" +
                                                  JoinNames(PresetNames(api::UcpDataDir())) +
                                                  ") or a model .json file";
            o.add_options()("dst", po::value<std::string>(), "output folder (must not exist)")(
                "model", po::value<std::string>()->required(), model_help.c_str())(
                "layout", po::value<std::string>()->required(),
                "tp=2,pp=2,dp=2,zero=1 or universal")(
                "dtype", po::value<std::string>()->default_value(""),
                "training dtype of the model slices (default: the preset's)")(
                "seed", po::value<uint64_t>()->default_value(0), "random seed")(
                "out", po::value<std::string>(), "DST, as an option (older spelling)");
            AddDataDirOption(o);
            AddRunOptions(o, /*checksums=*/false);
            AddJsonOption(o);
            p.add("dst", 1);
          },
      .run = RunGenerate,
  };
}
UCP_REGISTER_COMMAND(MakeGenerateCommand);

}  // namespace
}  // namespace ucp::cli
