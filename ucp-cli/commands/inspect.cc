// `ucp inspect`: format, layout (the checkpoint's own), step, model, what decides the layouts it
// can take and the values that fit, parameters, dtypes and sizes of a checkpoint.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

// The hyper-parameters that decide which tp / pp / ep a model takes (a model's hyper map may hold
// others: hidden sizes, tied embeddings, ...).
constexpr const char* kDecisive[] = {"layers",      "heads", "kv_heads",
                                     "num_experts", "vocab", "make_vocab_size_divisible_by"};

Status RunInspect(const po::variables_map& vm, CommandIo& io) {
  const std::string path = vm["path"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src,
                       OpenCheckpoint(path, "PATH", vm["model"].as<std::string>(), DataDir(vm),
                                      false, vm["qkv-layout"].as<std::string>(),
                                      vm["rotary-layout"].as<std::string>()));
  const api::CheckpointMeta& m = src->meta();
  int64_t stored_bytes = 0, numel = 0;
  const auto stored = src->StoredTensors();
  for (const auto& t : stored) stored_bytes += NumElementsOrDie(t.shape) * DTypeSizeBytes(t.dtype);
  for (const auto& p : m.model.params) numel += NumElementsOrDie(p.shape);
  const bool has_experts =
      m.spec.hyper.contains("num_experts") && m.spec.hyper.at("num_experts") > 0;
  std::vector<std::pair<std::string, std::vector<int>>> fits = {{"tp", FittingValues(m, "tp")},
                                                                {"pp", FittingValues(m, "pp")}};
  if (has_experts) fits.push_back({"ep", FittingValues(m, "ep")});
  if (io.json) {
    json::OrderedJson j;
    j["command"] = "inspect";
    j["ok"] = true;
    j["exit_code"] = 0;
    j["path"] = path;
    j["format"] = m.format;
    j["layout"] = layout::ToString(m.own_layout());
    if (m.native_layout) j["view_layout"] = layout::ToString(m.layout);
    if (!m.framework.empty()) {
      j["source_framework"] = m.framework;
      j["source_layout"] = m.source_layout;
      j["source_notes"] = m.source_notes;
    }
    j["step"] = m.step;
    j["model"] = m.spec.name;
    j["family"] = m.spec.family;
    j["dtype"] = std::string(DTypeName(m.spec.dtype));
    j["rotary_layout"] = std::string(patterns::RotaryLayoutName(m.spec.hyper));
    json::OrderedJson decisive = json::OrderedJson::object();
    for (const char* k : kDecisive) {
      if (m.spec.hyper.contains(k)) decisive[k] = m.spec.hyper.at(k);
    }
    j["decides_layouts"] = decisive;
    json::OrderedJson f = json::OrderedJson::object();
    for (const auto& [axis, values] : fits) f[axis] = values;
    j["fitting"] = f;
    j["optimizer"] = m.optimizer_kind;
    j["states"] = m.optimizer_states;
    j["num_parameters"] = numel;
    j["stored_tensors"] = static_cast<int64_t>(stored.size());
    j["stored_bytes"] = stored_bytes;
    json::OrderedJson params = json::OrderedJson::array();
    for (const auto& p : m.model.params) {
      params.push_back(
          {{"name", p.name}, {"shape", p.shape}, {"dtype", std::string(DTypeName(p.dtype))}});
    }
    j["params"] = params;
    io.out << j.dump(2) << "\n";
    return Status::Ok();
  }
  io.out << "format:     " << m.format << "\n";
  io.out << "layout:     " << layout::ToString(m.own_layout()) << "\n";
  if (!m.framework.empty()) {
    io.out << "source:     " << m.framework << " " << m.source_layout << " (" << m.source_notes
           << ")\n";
  }
  if (m.native_layout) {
    // How ucp's planner reads it (docs/adr/0005); what conversions keep is the line above.
    io.out << "read as:    " << layout::ToString(m.layout) << " (the ucp view of it)\n";
  }
  io.out << "step:       " << m.step << "\n"
         << "model:      " << m.spec.name << " (rule set " << m.spec.family << ", "
         << DTypeName(m.spec.dtype) << ")\n";
  // The rotary pairing of the q/k rows, where recorded (docs/hf.md).
  if (m.spec.hyper.contains(std::string(patterns::kRotaryInterleavedHyper))) {
    io.out << "rotary:     " << patterns::RotaryLayoutName(m.spec.hyper) << " q/k pairs\n";
  }
  io.out << "decisive:  ";
  for (const char* k : kDecisive) {
    if (m.spec.hyper.contains(k)) io.out << " " << k << "=" << m.spec.hyper.at(k);
  }
  io.out << "\nfits:      ";
  for (size_t i = 0; i < fits.size(); ++i) {
    io.out << (i ? "; " : " ") << fits[i].first << " " << IntList(fits[i].second);
    // Those are the even splits; an uneven one fits any pp up to the layers (docs/patterns.md).
    if (fits[i].first == "pp" && m.spec.hyper.contains("layers")) {
      io.out << " (even stages; with stages= any pp up to " << m.spec.hyper.at("layers") << ")";
    }
  }
  io.out << "\noptimizer:  " << m.optimizer_kind << ", states";
  for (const auto& s : m.optimizer_states) io.out << " " << s;
  io.out << "\nparameters: " << m.model.params.size() << " (" << numel << " elements)\n"
         << "stored:     " << stored.size() << " tensors, " << Gib(stored_bytes) << "\n\n";
  for (const auto& p : m.model.params) {
    io.out << "  " << p.name << "  " << DTypeName(p.dtype) << ShapeToString(p.shape) << "\n";
  }
  return Status::Ok();
}

Command MakeInspectCommand() {
  return {
      .name = "inspect",
      .summary = "print a checkpoint's format, layout, model, the layouts it fits, and its tensors",
      .usage = "PATH [--json] [--model M] [--data-dir DIR]",
      .examples = {"ucp inspect ckpt", "ucp inspect ds/global_step100   # DeepSpeed: dp, zero too",
                   "ucp inspect ckpt --json | jq .fitting"},
      .description =
          "`decisive` lists the hyper-parameters that decide the layouts the model can take\n"
          "(layers, heads, KV heads, experts, vocabulary); `fits` the tp, pp (and ep) values\n"
          "that divide them (others at 1).",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("path", po::value<std::string>()->required(), "checkpoint folder");
            AddModelOption(o);
            AddDataDirOption(o);
            AddJsonOption(o);
            p.add("path", 1);
          },
      .run = RunInspect,
  };
}
UCP_REGISTER_COMMAND(MakeInspectCommand);

}  // namespace
}  // namespace ucp::cli
