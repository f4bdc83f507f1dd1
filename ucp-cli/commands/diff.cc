// `ucp diff`: compares the logical content of two checkpoints of any layouts and formats.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"

namespace ucp::cli {
namespace {

Status RunDiff(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "diff"));
  const double atol = vm["atol"].as<double>();
  if (!(atol >= 0)) return InvalidArgumentError("--atol must be >= 0");
  // --model names the model of whichever side does not record one (a DeepSpeed folder).
  const std::string model = vm["model"].as<std::string>();
  const std::filesystem::path data_dir = DataDir(vm);
  const std::string pa = vm["a"].as<std::string>(), pb = vm["b"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto a, OpenCheckpoint(pa, "A", model, data_dir, true,
                                                vm["qkv-layout"].as<std::string>(),
                                                vm["rotary-layout"].as<std::string>()));
  UCP_ASSIGN_OR_RETURN(auto b, OpenCheckpoint(pb, "B", model, data_dir, true,
                                                vm["qkv-layout"].as<std::string>(),
                                                vm["rotary-layout"].as<std::string>()));
  if (!model.empty() && !a->meta().model_from_options && !b->meta().model_from_options) {
    return InvalidArgumentError(
        "--model applies to DeepSpeed checkpoints (formats that do not record their model); "
        "neither A nor B is one");
  }
  UCP_ASSIGN_OR_RETURN(api::DiffResult r, api::Diff(*a, *b, atol, setup->options));
  if (!r.equal) io.exit_code = 1;
  if (io.json) {
    json::OrderedJson j;
    j["command"] = "diff";
    j["ok"] = true;
    j["exit_code"] = io.exit_code;
    j["equal"] = r.equal;
    j["a"] = SourceJson(pa, *a);
    j["b"] = SourceJson(pb, *b);
    if (r.equal) {
      j["parameter_states_compared"] = r.tensors_compared;
    } else {
      j["first_difference"] = r.first_difference;
    }
    j["atol"] = atol;
    j["elapsed_s"] = setup->Seconds();
    io.out << j.dump(2) << "\n";
    return Status::Ok();
  }
  if (!r.equal) {
    io.out << "different: " << r.first_difference << "\n";
    return Status::Ok();
  }
  io.out << "equal: " << r.tensors_compared << " parameter states\n";
  return Status::Ok();
}

Command MakeDiffCommand() {
  return {
      .name = "diff",
      .summary = "compare two checkpoints' content whatever their layouts; exit 1 when different",
      .usage = "A B [--atol X] [--model M] [options]",
      .examples = {"ucp diff ckpt_tp4 ckpt_tp2              # bitwise, any layouts",
                   "ucp diff ds/global_step100 universal     # DeepSpeed against ucp",
                   "ucp diff a b --atol 1e-6 --json"},
      .description = "",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("a", po::value<std::string>()->required(), "first checkpoint")(
                "b", po::value<std::string>()->required(), "second checkpoint")(
                "atol", po::value<double>()->default_value(0.0), "absolute tolerance (0: bitwise)");
            AddModelOption(o);
            AddDataDirOption(o);
            AddRunOptions(o, /*checksums=*/false);
            AddJsonOption(o);
            p.add("a", 1).add("b", 1);
          },
      .run = RunDiff,
  };
}
UCP_REGISTER_COMMAND(MakeDiffCommand);

}  // namespace
}  // namespace ucp::cli
