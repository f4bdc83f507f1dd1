// Shared pieces of the checkpoint subcommands: --threads / --memory-limit, the progress bar
// (stderr, terminals only), opening a checkpoint with the data folder, and `--format F` with the
// options each writing format declares (api/format.h): no command knows a format by name.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "ucp-cli/command.h"
#include "ucp/api/checkpoint.h"
#include "ucp/api/format.h"
#include "ucp/base/status_macros.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {

inline void AddRunOptions(po::options_description& opts) {
  opts.add_options()("threads", po::value<int>()->default_value(0),
                     "worker threads (0: every core)")(
      "memory-limit", po::value<std::string>()->default_value("512M"),
      "bound on buffers in flight, N[K|M|G]; one tensor larger than it still runs alone")(
      "skip-checksums", "do not verify the source's checksums before converting");
}

/// What a checkpoint subcommand holds while it runs.
struct RunSetup {
  std::unique_ptr<exec::ScopedThreadLimit> threads;
  api::RunOptions options;
};

inline Result<std::unique_ptr<RunSetup>> SetupRun(const po::variables_map& vm, CommandIo& io,
                                                  const std::string& what) {
  auto setup = std::make_unique<RunSetup>();
  const int threads = vm["threads"].as<int>();
  if (threads < 0) {
    return InvalidArgumentError("--threads must be >= 0, got " + std::to_string(threads));
  }
  setup->threads = std::make_unique<exec::ScopedThreadLimit>(threads);
  UCP_ASSIGN_OR_RETURN(setup->options.memory_limit_bytes,
                       exec::ParseByteSize(vm["memory-limit"].as<std::string>()), "--memory-limit");
  setup->options.verify_source_checksums = vm.count("skip-checksums") == 0;
  setup->options.group = io.group;
  if (io.is_terminal) {
    auto mu = std::make_shared<std::mutex>();
    std::ostream* err = &io.err;
    setup->options.progress = [mu, err, what](int64_t done, int64_t total) {
      std::lock_guard<std::mutex> lock(*mu);
      const int width = 30;
      const int filled = total > 0 ? static_cast<int>(width * done / total) : width;
      *err << "\r" << what << " [" << std::string(filled, '#') << std::string(width - filled, ' ')
           << "] " << done << "/" << total << (done == total ? "\n" : "") << std::flush;
    };
  }
  return setup;
}

/// --model for the commands that read checkpoints: DeepSpeed folders do not record their ucp model.
inline void AddModelOption(po::options_description& opts) {
  opts.add_options()("model", po::value<std::string>()->default_value(""),
                     "DeepSpeed sources: model preset, model .json file or rule-set family "
                     "(default: family from the parameter names, hyper-parameters from the "
                     "Megatron args and the shapes)");
}

/// Opens a checkpoint of any format; `model` (--model) is for formats that do not record their
/// model (DeepSpeed), and is an error for another format unless `model_may_not_apply` (diff: it
/// names one side's model).
inline Result<std::unique_ptr<api::CheckpointSource>> OpenCheckpoint(
    const std::string& path, const std::string& what, const std::string& model = "",
    bool model_may_not_apply = false) {
  api::SourceOptions options;
  options.model = model;
  UCP_ASSIGN_OR_RETURN(auto src, api::CheckpointSource::Open(path, api::UcpDataDir(), options),
                       what);
  if (!model.empty() && !model_may_not_apply && !src->meta().model_from_options) {
    return InvalidArgumentError(
        "--model applies to DeepSpeed checkpoints (formats that do not "
        "record their model); " +
        what + " " + path + " is " + src->meta().format + " and records its model");
  }
  return src;
}

inline std::string Gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

/// `--format` (default `default_format`) and the options of every writing format, each once.
inline void AddFormatOptions(po::options_description& opts, const std::string& default_format) {
  const api::FormatRegistry& formats = api::Formats();
  std::string help = "output format:";
  for (const api::CheckpointFormat* f : formats.formats()) {
    if (f->writes()) help += " " + std::string(f->name()) + " (" + std::string(f->summary()) + ");";
  }
  help.back() = '.';
  opts.add_options()("format", po::value<std::string>()->default_value(default_format),
                     help.c_str());
  std::vector<std::string> seen;
  for (const api::CheckpointFormat* f : formats.formats()) {
    for (const api::FormatOption& o : f->write_options()) {
      if (std::find(seen.begin(), seen.end(), o.name) != seen.end()) continue;
      seen.push_back(o.name);
      opts.add_options()(o.name.c_str(), po::value<std::string>()->default_value(o.default_value),
                         o.help.c_str());
    }
  }
}

/// Writes `src` to vm["dst"] in vm["format"] at `l` (`layout_given`: --layout was passed), with
/// the format's own options; another format's option given explicitly is an error.
inline Status RunWrite(const po::variables_map& vm, CommandIo& io, RunSetup& setup,
                       const api::CheckpointSource& src, const layout::Layout& l,
                       bool layout_given) {
  const std::string format = vm["format"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(const api::CheckpointFormat* f,
                       api::Formats().Find(format, /*for_writing=*/true));
  api::WriteRequest request;
  request.layout = l;
  request.layout_given = layout_given;
  request.run = setup.options;
  std::vector<std::string> mine;
  for (const api::FormatOption& o : f->write_options()) mine.push_back(o.name);
  for (const api::CheckpointFormat* other : api::Formats().formats()) {
    for (const api::FormatOption& o : other->write_options()) {
      if (vm.count(o.name) == 0 || vm[o.name].defaulted()) continue;
      if (std::find(mine.begin(), mine.end(), o.name) == mine.end()) {
        return InvalidArgumentError("--" + o.name + " does not apply to --format " + format);
      }
      request.options[o.name] = vm[o.name].as<std::string>();
    }
  }
  if (!layout_given && f->takes_layout()) {
    return InvalidArgumentError("--format " + format + " needs --layout");
  }
  const std::string dst = vm["dst"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, api::WriteCheckpoint(src, format, dst, request));
  io.out << "wrote "
         << (f->written_noun() == "checkpoint" ? "" : std::string(f->written_noun()) + " ") << dst;
  if (f->takes_layout()) io.out << " at " << layout::ToString(l);
  io.out << ": " << stats.targets_written << " tensors, " << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

}  // namespace ucp::cli
