// `ucp inspect`: format, layout, step, model, parameters, dtypes and sizes of a checkpoint.
#include <cstdio>
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

// Names here come from rule sets and presets (safe names), but escape anyway.
std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string ShapeJson(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Status RunInspect(const po::variables_map& vm, CommandIo& io) {
  const std::string path = vm["path"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(path, "PATH", vm["model"].as<std::string>()));
  const api::CheckpointMeta& m = src->meta();
  int64_t stored_bytes = 0, numel = 0;
  const auto stored = src->StoredTensors();
  for (const auto& t : stored) stored_bytes += NumElementsOrDie(t.shape) * DTypeSizeBytes(t.dtype);
  for (const auto& p : m.model.params) numel += NumElementsOrDie(p.shape);
  if (vm.count("json")) {
    io.out << "{\n  \"format\": " << Quote(m.format)
           << ",\n  \"layout\": " << Quote(layout::ToString(m.layout));
    if (!m.framework.empty()) {
      io.out << ",\n  \"source_framework\": " << Quote(m.framework)
             << ",\n  \"source_layout\": " << Quote(m.source_layout)
             << ",\n  \"source_notes\": " << Quote(m.source_notes);
    }
    io.out << ",\n  \"step\": " << m.step << ",\n  \"model\": " << Quote(m.spec.name)
           << ",\n  \"family\": " << Quote(m.spec.family)
           << ",\n  \"dtype\": " << Quote(std::string(DTypeName(m.spec.dtype)))
           << ",\n  \"optimizer\": " << Quote(m.optimizer_kind) << ",\n  \"states\": [";
    for (size_t i = 0; i < m.optimizer_states.size(); ++i) {
      io.out << (i ? ", " : "") << Quote(m.optimizer_states[i]);
    }
    io.out << "],\n  \"num_parameters\": " << numel << ",\n  \"stored_tensors\": " << stored.size()
           << ",\n  \"stored_bytes\": " << stored_bytes << ",\n  \"params\": [";
    for (size_t i = 0; i < m.model.params.size(); ++i) {
      const auto& p = m.model.params[i];
      io.out << (i ? "," : "") << "\n    {\"name\": " << Quote(p.name)
             << ", \"shape\": " << ShapeJson(p.shape)
             << ", \"dtype\": " << Quote(std::string(DTypeName(p.dtype))) << "}";
    }
    io.out << "\n  ]\n}\n";
    return Status::Ok();
  }
  io.out << "format:     " << m.format << "\n";
  if (!m.framework.empty()) {
    // A foreign checkpoint: its own layout, and the ucp layout the planner reads it as.
    io.out << "source:     " << m.framework << " " << m.source_layout << " (" << m.source_notes
           << ")\n"
           << "layout:     " << layout::ToString(m.layout) << " (the ucp view of it)\n";
  } else {
    io.out << "layout:     " << layout::ToString(m.layout) << "\n";
  }
  io.out << "step:       " << m.step << "\n"
         << "model:      " << m.spec.name << " (rule set " << m.spec.family << ", "
         << DTypeName(m.spec.dtype) << ")\n"
         << "optimizer:  " << m.optimizer_kind << ", states";
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
      .summary = "print a checkpoint's format, layout, step, parameters, dtypes and sizes",
      .usage = "PATH [--json] [--model M]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("path", po::value<std::string>()->required(), "checkpoint folder")(
                "json", "print JSON");
            AddModelOption(o);
            p.add("path", 1);
          },
      .run = RunInspect,
  };
}
UCP_REGISTER_COMMAND(MakeInspectCommand);

}  // namespace
}  // namespace ucp::cli
