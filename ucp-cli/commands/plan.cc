// `ucp plan`: prints the conversion plan between two layouts of a model, touching no file.
#include "ucp/convert/plan.h"

#include <iomanip>
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/base/status_macros.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"

namespace ucp::cli {
namespace {

Status RunPlan(const po::variables_map& vm, CommandIo& io) {
  const std::filesystem::path data_dir = DataDir(vm);
  const std::string model_name = vm["model"].as<std::string>();
  Result<patterns::ModelSpec> loaded = patterns::LoadModel(data_dir, model_name);
  if (!loaded.ok()) {
    return WithPresetHint(loaded.status().WithContext("--model"), model_name, data_dir);
  }
  patterns::ModelSpec spec = std::move(*loaded);
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(data_dir, spec.family),
                       "--model");
  UCP_ASSIGN_OR_RETURN(patterns::ResolvedModel model, patterns::Resolve(spec, rules), "--model");
  UCP_ASSIGN_OR_RETURN(layout::Layout from, layout::ParseLayout(vm["from"].as<std::string>()),
                       "--from");
  UCP_ASSIGN_OR_RETURN(layout::Layout to, layout::ParseLayout(vm["to"].as<std::string>()), "--to");
  Result<convert::Plan> planned = convert::PlanConversion(model, from, to);
  if (!planned.ok()) {
    api::CheckpointMeta meta;
    meta.model = model;
    meta.spec = spec;
    return WithFitHint(WithFitHint(planned.status(), meta, from), meta, to);
  }
  convert::Plan plan = std::move(*planned);
  const int64_t only_rank = vm.count("rank") ? vm["rank"].as<int64_t>() : -1;
  if (only_rank >= 0 && only_rank >= layout::WorldSize(to)) {
    return InvalidArgumentError("--rank " + std::to_string(only_rank) + " outside [0, " +
                                std::to_string(layout::WorldSize(to)) + ") of --to " +
                                layout::ToString(to));
  }
  if (vm.count("json")) {
    if (only_rank >= 0) {
      // Keep the rank's target tensors (indices stay those of the full plan) and their ops.
      std::vector<convert::Op> ops;
      for (const convert::Op& op : plan.ops) {
        if (op.dst.tensor >= 0 && plan.targets[op.dst.tensor].rank == only_rank) ops.push_back(op);
      }
      plan.ops = std::move(ops);
    }
    io.out << convert::PlanToJson(plan);
    return Status::Ok();
  }
  io.out << "model " << spec.name << " (" << spec.family << ", " << model.params.size()
         << " parameters)\nfrom " << layout::ToString(from) << "\nto   " << layout::ToString(to)
         << "\n"
         << plan.sources.size() << " source tensors, " << plan.targets.size() << " target tensors, "
         << plan.ops.size() << " ops\n\n";
  io.out << std::setw(6) << "rank" << std::setw(9) << "tensors" << std::setw(9) << "copy"
         << std::setw(9) << "fill" << std::setw(9) << "average" << std::setw(9) << "check"
         << std::setw(14) << "bytes"
         << "\n";
  for (const convert::RankSummary& r : convert::Summarize(plan)) {
    if (only_rank >= 0 && r.rank != only_rank && r.rank != -1) continue;
    io.out << std::setw(6) << (r.rank < 0 ? std::string("checks") : std::to_string(r.rank))
           << std::setw(9) << r.tensors << std::setw(9) << r.copy_ops << std::setw(9) << r.fill_ops
           << std::setw(9) << r.average_ops << std::setw(9) << r.check_ops << std::setw(14)
           << r.bytes_written << "\n";
  }
  if (only_rank >= 0) {
    io.out << "\n";
    for (const convert::TensorInfo& t : plan.targets) {
      if (t.rank != only_rank) continue;
      io.out << "  " << t.name << " " << DTypeName(t.dtype) << " " << ShapeToString(t.shape)
             << "\n";
    }
  }
  return Status::Ok();
}

Command MakePlanCommand() {
  return {
      .name = "plan",
      .summary = "print the conversion plan between two layouts of a model (touches no file)",
      .usage = "--model M --from LAYOUT --to LAYOUT [--json] [--rank R] [--data-dir DIR]",
      .examples = {"ucp plan --model gpt-tiny --from tp=2,pp=2,dp=2,zero=1 --to tp=4,dp=2",
                   "ucp plan --model llama-tiny --from universal --to tp=2 --rank 1",
                   "ucp plan --model mixtral-tiny --from tp=1,dp=4,ep=4 --to universal --json"},
      .description = "",
      .add_options =
          [](po::options_description& o, po::positional_options_description&) {
            static const std::string model_help = "model preset (" +
                                                  JoinNames(PresetNames(api::UcpDataDir())) +
                                                  ") or a model .json file";
            o.add_options()("model", po::value<std::string>()->required(), model_help.c_str())(
                "from", po::value<std::string>()->required(),
                "source layout: tp=2,pp=2,dp=4[,sp=1,ep=1][,zero=1] or universal")(
                "to", po::value<std::string>()->required(), "target layout, same form")(
                "json", "print the full plan as JSON")("rank", po::value<int64_t>(),
                                                       "only this target rank");
            AddDataDirOption(o);
          },
      .run = RunPlan,
  };
}
UCP_REGISTER_COMMAND(MakePlanCommand);

}  // namespace
}  // namespace ucp::cli
