// Shared pieces of the checkpoint subcommands: --threads / --memory-limit, the progress bar
// (stderr, terminals only) and opening a checkpoint with the data folder.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>

#include "ucp-cli/command.h"
#include "ucp/api/checkpoint.h"
#include "ucp/api/deepspeed_writer.h"
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

/// Opens a checkpoint of any format; `model` (--model) is for DeepSpeed folders only, and is an
/// error for another format unless `model_may_not_apply` (diff: it names one side's model).
inline Result<std::unique_ptr<api::CheckpointSource>> OpenCheckpoint(
    const std::string& path, const std::string& what, const std::string& model = "",
    bool model_may_not_apply = false) {
  api::SourceOptions options;
  options.model = model;
  UCP_ASSIGN_OR_RETURN(auto src, api::CheckpointSource::Open(path, api::UcpDataDir(), options),
                       what);
  if (!model.empty() && !model_may_not_apply && src->meta().format != api::Format::kDeepSpeed) {
    return InvalidArgumentError("--model applies to DeepSpeed checkpoints; " + what + " " + path +
                                " is " + std::string(api::FormatName(src->meta().format)) +
                                " and records its model");
  }
  return src;
}

inline std::string Gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

/// The options of `--format deepspeed` (reshard and convert).
inline void AddDeepSpeedOutputOptions(po::options_description& opts, bool with_model_states_from) {
  opts.add_options()("optimizer", po::value<std::string>()->default_value(""),
                     "--format deepspeed: zero (DeepSpeedZeroOptimizer files) or bf16 "
                     "(BF16_Optimizer: bf16 at zero=1); default: the source's, else zero")(
      "naming", po::value<std::string>()->default_value(""),
      "--format deepspeed: megatron-pipe (GPTModelPipe), megatron-gpt (GPTModel) or plain; "
      "default: the source's recorded naming, else megatron-pipe")(
      "tag", po::value<std::string>()->default_value(""),
      "--format deepspeed: the tag folder (default: the source's, else global_step<iteration>)");
  if (with_model_states_from) {
    opts.add_options()("model-states-from", po::value<std::string>()->default_value(""),
                       "a DeepSpeed tag folder whose client state (args, scheduler, RNG, "
                       "optimizer hyper-parameters) is carried over");
  }
}

/// Runs `--format deepspeed` for reshard and convert.
inline Status RunDeepSpeedOutput(const po::variables_map& vm, CommandIo& io, RunSetup& setup,
                                 const api::CheckpointSource& src, const layout::Layout& l) {
  api::DeepSpeedOutputOptions ds;
  ds.optimizer = vm["optimizer"].as<std::string>();
  ds.naming = vm["naming"].as<std::string>();
  ds.tag = vm["tag"].as<std::string>();
  ds.model_states_from = vm["model-states-from"].as<std::string>();
  const std::string dst = vm["dst"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, api::ToDeepSpeed(src, l, dst, setup.options, ds));
  io.out << "wrote DeepSpeed checkpoint " << dst << " at " << layout::ToString(l) << ": "
         << stats.targets_written << " tensors, " << Gib(stats.bytes_written) << "\n";
  return Status::Ok();
}

}  // namespace ucp::cli
