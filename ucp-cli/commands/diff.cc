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
  UCP_ASSIGN_OR_RETURN(auto a, OpenCheckpoint(vm["a"].as<std::string>(), "A", model, true));
  UCP_ASSIGN_OR_RETURN(auto b, OpenCheckpoint(vm["b"].as<std::string>(), "B", model, true));
  if (!model.empty() && !a->meta().model_from_options && !b->meta().model_from_options) {
    return InvalidArgumentError(
        "--model applies to DeepSpeed checkpoints (formats that do not record their model); "
        "neither A nor B is one");
  }
  UCP_ASSIGN_OR_RETURN(api::DiffResult r, api::Diff(*a, *b, atol, setup->options));
  if (!r.equal) {
    io.out << "different: " << r.first_difference << "\n";
    io.exit_code = 1;
    return Status::Ok();
  }
  io.out << "equal: " << r.tensors_compared << " parameter states\n";
  return Status::Ok();
}

Command MakeDiffCommand() {
  return {
      .name = "diff",
      .summary = "compare two checkpoints' content whatever their layouts; exit 1 when different",
      .usage = "A B [--atol X] [--model M]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("a", po::value<std::string>()->required(), "first checkpoint")(
                "b", po::value<std::string>()->required(), "second checkpoint")(
                "atol", po::value<double>()->default_value(0.0), "absolute tolerance (0: bitwise)");
            AddModelOption(o);
            AddRunOptions(o);
            p.add("a", 1).add("b", 1);
          },
      .run = RunDiff,
  };
}
UCP_REGISTER_COMMAND(MakeDiffCommand);

}  // namespace
}  // namespace ucp::cli
