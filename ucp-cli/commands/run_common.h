// Shared pieces of the checkpoint subcommands: --threads / --memory-limit, the progress bar
// (stderr, terminals only), --data-dir and --model, opening a checkpoint, `--format F` with the
// options each writing format declares (api/format.h), and the one conversion path that
// convert, extract and reshard share: no command knows a format by name.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "ucp-cli/command.h"
#include "ucp-cli/output_folder.h"
#include "ucp-cli/progress.h"
#include "ucp/api/checkpoint.h"
#include "ucp/api/format.h"
#include "ucp/base/status_macros.h"
#include "ucp/convert/plan.h"
#include "ucp/exec/executor.h"
#include "ucp/json/strict_json.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {

/// `memory`: the command's run is bounded by --memory-limit; `checksums`: it reads a source whose
/// checksums it can skip (--skip-checksums). Options that would do nothing are not offered, so
/// boost refuses them.
inline void AddRunOptions(po::options_description& opts, bool checksums = true,
                          bool memory = true) {
  opts.add_options()("threads", po::value<int>()->default_value(0),
                     "worker threads (0: every core)")(
      "quiet,q", "print nothing but errors: no progress, warnings or summary");
  if (memory) {
    opts.add_options()(
        "memory-limit", po::value<std::string>()->default_value("512M"),
        "bound on buffers in flight: N, NK, NM, NG (also KB/KiB, MB/MiB, GB/GiB; all powers of "
        "1024); one tensor larger than it still runs alone");
  }
  if (checksums) {
    opts.add_options()("skip-checksums", "do not verify the source's checksums before converting");
  }
}

/// --memory-limit: "1G", "1GB" and "1GiB" are all 2^30 bytes (a memory bound, so binary).
inline Result<int64_t> ParseMemoryLimit(std::string text) {
  if (text.size() > 3 && (text.ends_with("iB") || text.ends_with("ib"))) {
    text.erase(text.size() - 2);
  } else if (text.size() > 2 && (text.ends_with("B") || text.ends_with("b")) &&
             std::string("KkMmGg").find(text[text.size() - 2]) != std::string::npos) {
    text.pop_back();
  }
  return exec::ParseByteSize(text);
}

/// What a checkpoint subcommand holds while it runs.
struct RunSetup {
  std::unique_ptr<exec::ScopedThreadLimit> threads;
  api::RunOptions options;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  bool quiet = false;                        // --quiet
  std::unique_ptr<ProgressDisplay> display;  // stderr progress (progress.h); null when quiet
  std::unique_ptr<ProgressReporter> reporter;  // an MPI job's other processes: counts to the root
  /// Ends the progress display before the command prints its result.
  void Done() {
    reporter.reset();
    display.reset();
  }
};

/// `shared_job`: the command's processes share one job under MPI (generate, convert, extract,
/// reshard), so the root shows the whole job's progress; the others run it each on their own.
inline Result<std::unique_ptr<RunSetup>> SetupRun(const po::variables_map& vm, CommandIo& io,
                                                  const std::string& what,
                                                  bool shared_job = false) {
  auto setup = std::make_unique<RunSetup>();
  const int threads = vm["threads"].as<int>();
  if (threads < 0) {
    return InvalidArgumentError("--threads must be >= 0, got " + std::to_string(threads));
  }
  setup->threads = std::make_unique<exec::ScopedThreadLimit>(threads);
  if (vm.count("memory-limit")) {
    UCP_ASSIGN_OR_RETURN(setup->options.memory_limit_bytes,
                         ParseMemoryLimit(vm["memory-limit"].as<std::string>()), "--memory-limit");
  }
  setup->options.verify_source_checksums = vm.count("skip-checksums") == 0;
  setup->options.group = io.group;
  setup->quiet = vm.count("quiet") > 0;
  // Bytes, rate, ETA and phase on stderr (progress.h); only the root of an MPI job draws, and
  // for a shared job it adds the other processes' counts, which they report to it.
  api::ProcessGroup* job = shared_job && io.group != nullptr && io.group->CarriesProgressReports()
                               ? io.group
                               : nullptr;
  if (!setup->quiet && (io.group == nullptr || io.group->is_root())) {
    setup->display = std::make_unique<ProgressDisplay>(io.err, "ucp " + what, io.is_terminal,
                                                       PlainLineInterval(), job);
  } else if (!setup->quiet && job != nullptr) {
    setup->reporter = std::make_unique<ProgressReporter>(*job);
  }
  return setup;
}

/// --data-dir: the folder of rule sets and models/ (default $UCP_DATA_DIR/patterns, else the
/// source tree the binary was built from).
inline void AddDataDirOption(po::options_description& opts) {
  opts.add_options()("data-dir", po::value<std::string>(),
                     "folder of the rule sets (<family>.json) and model presets (models/); "
                     "default $UCP_DATA_DIR/patterns, else the built-in one");
}

inline std::filesystem::path DataDir(const po::variables_map& vm) {
  return vm.count("data-dir") ? std::filesystem::path(vm["data-dir"].as<std::string>())
                              : api::UcpDataDir();
}

/// The model presets of a data folder: models/<name>.json, sorted.
inline std::vector<std::string> PresetNames(const std::filesystem::path& data_dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(data_dir / "models", ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().extension() == ".json") names.push_back(it->path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

inline std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

/// A --model that names no preset (a name, not a .json file) gets the list of presets.
inline Status WithPresetHint(Status s, const std::string& model,
                             const std::filesystem::path& data_dir) {
  if (s.ok() || model.empty() || model.ends_with(".json") || s.code() != StatusCode::kNotFound) {
    return s;
  }
  std::error_code ec;
  if (std::filesystem::exists(data_dir / "models" / (model + ".json"), ec)) return s;
  return Status(s.code(), s.message() + " (presets in " + (data_dir / "models").string() + ": " +
                              JoinNames(PresetNames(data_dir)) + "; or a model .json file)");
}

/// --model for the commands that read checkpoints: DeepSpeed folders do not record their ucp model.
inline void AddModelOption(po::options_description& opts) {
  static const std::string help =
      "DeepSpeed sources: a model preset (" + JoinNames(PresetNames(api::UcpDataDir())) +
      "), a model .json file or a rule-set family (default: the family from the parameter "
      "names, hyper-parameters from the Megatron args and the shapes)";
  opts.add_options()("model", po::value<std::string>()->default_value(""), help.c_str())(
      "qkv-layout", po::value<std::string>()->default_value(""),
      "DeepSpeed sources: the fused QKV's row order where the files do not record it: "
      "per-group (Megatron-DeepSpeed before PR #441) or per-rank-blocks (since PR #441); "
      "default per-group")(
      "rotary-layout", po::value<std::string>()->default_value(""),
      "the rotary pairing of the q/k rows, recorded with the model (docs/hf.md): interleaved "
      "(Megatron --rotary-interleaved, GPT-J, Meta's LLaMA) or half-split (HF, Megatron's "
      "default). DeepSpeed sources: the files' pairing where the args do not record it; Hugging "
      "Face sources (half-split files): the pairing to convert to. Default: recorded, else "
      "half-split");
}

/// --json: one JSON object on stdout (errors too, with their exit code).
inline void AddJsonOption(po::options_description& opts) {
  opts.add_options()("json", "print one JSON object on stdout (an error too, with its exit code)");
}

/// Opens a checkpoint of any format; `model` (--model) is for formats that do not record their
/// model (DeepSpeed), and is an error for another format unless `model_may_not_apply` (diff: it
/// names one side's model).
inline Result<std::unique_ptr<api::CheckpointSource>> OpenCheckpoint(
    const std::string& path, const std::string& what, const std::string& model,
    const std::filesystem::path& data_dir, bool model_may_not_apply = false,
    const std::string& qkv_layout = "", const std::string& rotary_layout = "") {
  api::SourceOptions options;
  options.model = model;
  options.qkv_layout = qkv_layout;
  options.rotary_layout = rotary_layout;
  Result<std::unique_ptr<api::CheckpointSource>> opened =
      api::CheckpointSource::Open(path, data_dir, options);
  if (!opened.ok()) {
    Status s = opened.status();
    // The messages name the folder; "SRC" says which argument it was, once.
    return WithPresetHint(Status(s.code(), what + ": " + s.message()), model, data_dir);
  }
  std::unique_ptr<api::CheckpointSource> src = std::move(*opened);
  if (!qkv_layout.empty() && !model_may_not_apply && !src->meta().model_from_options) {
    return InvalidArgumentError("--qkv-layout applies to DeepSpeed checkpoints; " + what + " " +
                                path + " is " + src->meta().format);
  }
  if (!rotary_layout.empty() && !model_may_not_apply && !src->meta().rotary_layout_from_options) {
    return InvalidArgumentError("--rotary-layout applies to DeepSpeed and Hugging Face sources; " +
                                what + " " + path + " is " + src->meta().format +
                                " and records its model's (" +
                                std::string(patterns::RotaryLayoutName(src->meta().spec.hyper)) +
                                ")");
  }
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

/// The values of `axis` ("tp", "pp", "ep") at which `meta`'s model fits a layout (the others
/// at 1), up to a bound: what decides them is the model (heads, KV heads, layers, experts,
/// vocab), so each candidate is asked of the planner rather than derived here.
inline std::vector<int> FittingValues(const api::CheckpointMeta& meta, const std::string& axis) {
  std::vector<int> out;
  int limit = 64;
  if (axis == "pp" && meta.spec.hyper.contains("layers")) {
    limit = static_cast<int>(std::min<int64_t>(meta.spec.hyper.at("layers"), 256));
  }
  for (int v = 1; v <= limit; ++v) {
    layout::Layout l;
    if (axis == "tp") l.tp = v;
    if (axis == "pp") l.pp = v;
    if (axis == "ep") l.dp = l.ep = v;
    if (convert::DescribeLayout(meta.model, l, meta.plan_options()).ok()) out.push_back(v);
  }
  return out;
}

inline std::string IntList(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
  return out;
}

/// A layout the model cannot take (kFailedPrecondition) gets the values of the offending axes
/// that fit ("tp values that fit: 1, 2, 4").
/// Planner errors name the layouts the planner saw. A source read through a view of its own
/// layout (a DeepSpeed folder, dp=2,zero=1, is planned as dp=1,zero=0) and a format that plans
/// into such a view are stated in the user's terms instead (issue 15 #8): the source's own
/// layout (CheckpointMeta::own_layout) and the layout that was asked for (`target`, unless
/// universal).
inline Status InOwnLayouts(Status s, const api::CheckpointMeta& meta,
                           const layout::Layout* target) {
  if (s.ok()) return s;
  std::string m = s.message();
  auto restate = [&m](const std::string& key, const std::string& wanted,
                      const std::string* only_if) {
    for (size_t pos = m.find(key); pos != std::string::npos; pos = m.find(key, pos)) {
      const size_t begin = pos + key.size();
      size_t end = m.find_first_of("; )", begin);
      if (end == std::string::npos) end = m.size();
      const std::string said = m.substr(begin, end - begin);
      // (A universal step of the run, an extraction first, is what it says.)
      if (said != wanted && said != "universal" && (only_if == nullptr || said == *only_if)) {
        m.replace(begin, end - begin, wanted);
      }
      pos = begin;
    }
  };
  if (meta.native_layout) {
    const std::string view = layout::ToString(meta.layout);
    restate("source layout ", layout::ToString(*meta.native_layout), &view);
  }
  if (target != nullptr && !target->universal) {
    restate("target layout ", layout::ToString(*target), nullptr);
  }
  return Status(s.code(), m);
}

inline Status WithFitHint(Status s, const api::CheckpointMeta& meta, const layout::Layout& l) {
  if (s.ok() || s.code() != StatusCode::kFailedPrecondition || l.universal) return s;
  std::string hint;
  const std::pair<const char*, int> axes[] = {{"tp", l.tp}, {"pp", l.pp}, {"ep", l.ep}};
  for (const auto& [axis, value] : axes) {
    std::vector<int> fit = FittingValues(meta, axis);
    if (std::find(fit.begin(), fit.end(), value) != fit.end()) continue;
    hint += std::string(hint.empty() ? "" : "; ") + axis + " values that fit " + meta.spec.name +
            ": " + IntList(fit);
  }
  if (hint.empty()) return s;
  return Status(s.code(), s.message() + " (" + hint + ")");
}

/// `--format` and the options of every writing format, each once. `default_note` says what an
/// omitted --format means for this command.
inline void AddFormatOptions(po::options_description& opts, const std::string& default_note) {
  const api::FormatRegistry& formats = api::Formats();
  std::string help = "output format (" + default_note + "):";
  for (const api::CheckpointFormat* f : formats.formats()) {
    if (f->writes()) help += " " + std::string(f->name()) + " (" + std::string(f->summary()) + ");";
  }
  help.back() = '.';
  opts.add_options()("format", po::value<std::string>(), help.c_str());  // boost copies it
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

/// What a conversion command fixes of the shared path (convert, extract, reshard).
struct ConversionKind {
  std::string command;
  /// The --format when none is given; "" is the source's family
  /// (CheckpointFormat::default_output_format of the format that reads it).
  std::string default_format;
  bool full_tensors = false;  ///< extract: the universal layout, no --layout
  bool needs_layout = false;  ///< reshard: --layout is what it is for
};

/// The output of a conversion as decided from the command line and the source.
struct ConversionTarget {
  std::string command;  ///< the command that converts (for --json)
  const api::CheckpointFormat* format = nullptr;
  std::string format_origin;  ///< "--format", "the source's family", "extract's default"
  layout::Layout layout;
  bool layout_given = false;
  std::string layout_given_keys;  ///< "tp" (the keys --layout named)
  std::string layout_kept_keys;   ///< "pp, dp, sp, ep, zero" (kept from the source)
};

inline Result<ConversionTarget> DecideTarget(const po::variables_map& vm,
                                             const api::CheckpointSource& src,
                                             const std::string& src_path,
                                             const ConversionKind& kind) {
  ConversionTarget t;
  t.command = kind.command;
  std::string name;
  if (vm.count("format")) {
    name = vm["format"].as<std::string>();
    t.format_origin = "--format";
  } else if (!kind.default_format.empty()) {
    name = kind.default_format;
    t.format_origin = kind.command + "'s default";
  } else {
    UCP_ASSIGN_OR_RETURN(const api::CheckpointFormat* in, api::Formats().Detect(src_path), "SRC");
    name = std::string(in->default_output_format());
    t.format_origin = "the source's family; --format changes it";
  }
  UCP_ASSIGN_OR_RETURN(t.format, api::Formats().Find(name, /*for_writing=*/true));
  const layout::Layout& own = src.meta().own_layout();
  t.layout_given = vm.count("layout") > 0;
  if (kind.needs_layout && !t.layout_given) {
    return InvalidArgumentError(kind.command +
                                " needs --layout (to change only the format: ucp convert SRC DST "
                                "--format F)");
  }
  if (kind.full_tensors) {
    t.layout = layout::UniversalLayout();
    t.layout_given = true;
    return t;
  }
  layout::PartialLayout partial;
  partial.universal = own.universal;
  if (t.layout_given) {
    UCP_ASSIGN_OR_RETURN(partial, layout::ParsePartialLayout(vm["layout"].as<std::string>()),
                         "--layout");
  }
  if (!t.format->takes_layout()) {
    if (t.layout_given && !partial.universal && t.format_origin != "--format") {
      // The layout was meant for another format than the one the defaults chose.
      std::vector<std::string> with_layout;
      for (const api::CheckpointFormat* f : api::Formats().formats()) {
        if (f->writes() && f->takes_layout()) with_layout.emplace_back(f->name());
      }
      return InvalidArgumentError("--layout " + vm["layout"].as<std::string>() +
                                  ": the output format " + name + " (" + t.format_origin +
                                  ") holds full tensors; give --format ucp (formats with a "
                                  "layout: " + JoinNames(with_layout) + ")");
    }
    // Full tensors: any layout but universal is the user's mistake (WriteCheckpoint says so).
    t.layout = t.layout_given ? (partial.universal ? layout::UniversalLayout() : partial.values)
                              : layout::UniversalLayout();
    return t;
  }
  if (t.layout_given) {
    UCP_ASSIGN_OR_RETURN(t.layout, layout::MergeLayout(own, partial), "--layout");
    t.layout_given_keys = partial.Keys();
    if (!own.universal && !partial.universal) {
      static constexpr const char* kKeys[6] = {"tp", "pp", "dp", "sp", "ep", "zero"};
      for (int k = 0; k < 6; ++k) {
        if (!partial.given[k]) {
          t.layout_kept_keys += std::string(t.layout_kept_keys.empty() ? "" : ",") + kKeys[k];
        }
      }
    }
  } else {
    t.layout = own;
    t.layout_given = true;  // the source's own layout, asked of the format like a given one
    t.layout_kept_keys = own.universal ? "universal" : "all";
  }
  return t;
}

inline json::OrderedJson SourceJson(const std::string& path, const api::CheckpointSource& src) {
  const api::CheckpointMeta& m = src.meta();
  json::OrderedJson j;
  j["path"] = path;
  j["format"] = m.format;
  j["layout"] = layout::ToString(m.own_layout());
  j["model"] = m.spec.name;
  j["family"] = m.spec.family;
  j["step"] = m.step;
  int64_t bytes = 0;
  const auto stored = src.StoredTensors();
  for (const auto& t : stored) bytes += NumElementsOrDie(t.shape) * DTypeSizeBytes(t.dtype);
  j["stored_tensors"] = static_cast<int64_t>(stored.size());
  j["stored_bytes"] = bytes;
  return j;
}

/// Writes `src` (opened from `src_path`) to vm["dst"] as `target` decides, with the format's own
/// options (another format's option given explicitly is an error), and reports it.
inline Status RunWrite(const po::variables_map& vm, CommandIo& io, RunSetup& setup,
                       const api::CheckpointSource& src, const std::string& src_path,
                       const ConversionTarget& target) {
  const api::CheckpointFormat* f = target.format;
  const std::string format(f->name());
  api::WriteRequest request;
  request.layout = target.layout;
  request.layout_given = target.layout_given;
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
  const std::string dst = vm["dst"].as<std::string>();
  // DST's rules (not SRC, empty folder, --into-root) and the stale-temporaries warning:
  // output_folder.h.
  // An interrupted run's abandoned removals (DST.tmp-X.removing-PID) go; other leftovers draw
  // a warning (output_folder.h). The root removes; every process would find the same.
  const bool root = io.group == nullptr || io.group->is_root();
  const std::vector<StaleTemporary> tidied =
      TidyBeforeWrite(dst, "ucp " + target.command, io.err, root, !setup.quiet);
  UCP_ASSIGN_OR_RETURN(OutputTarget placement,
                       PrepareOutput(src_path, dst, format, vm.count("into-root") > 0,
                                     src.meta().step, io.group));
  // A format the processes cannot share is written by the root alone (api::WriteCheckpoint):
  // the others end their reports now, so the root's progress shows its own bytes as the job's.
  if (io.group != nullptr && io.group->size() > 1 && !f->writes_in_parallel()) {
    setup.reporter.reset();
  }
  Result<exec::ExecStats> written =
      api::WriteCheckpoint(src, format, placement.write_to.string(), request);
  if (!written.ok()) {
    if (io.group == nullptr || io.group->is_root()) AbandonOutput(placement);
    return WithFitHint(
        InOwnLayouts(written.status(), src.meta(), f->takes_layout() ? &target.layout : nullptr),
        src.meta(), target.layout);
  }
  std::string placed;
  {
    Status finished;
    if (io.group == nullptr || io.group->is_root()) {
      Result<std::string> f_placed = FinishOutput(placement);
      finished = f_placed.status();
      if (f_placed.ok()) placed = *f_placed;
    }
    if (io.group != nullptr) finished = io.group->Agree(finished);
    UCP_RETURN_IF_ERROR(finished);
  }
  const exec::ExecStats& stats = *written;
  const double seconds = setup.Seconds();
  setup.Done();
  RunSummary summary;
  summary.format = format;
  summary.layout = f->takes_layout() ? layout::ToString(target.layout) : "universal";
  summary.elapsed_s = seconds;
  summary.peak_rss_bytes = PeakRssBytes();
  CountTree(dst, summary.files, summary.bytes);
  const std::string shown_layout = layout::ToString(target.layout);
  if (io.json) {
    json::OrderedJson j;
    j["command"] = target.command;
    j["ok"] = true;
    j["exit_code"] = 0;
    j["source"] = SourceJson(src_path, src);
    json::OrderedJson out;
    out["path"] = dst;
    out["format"] = format;
    out["format_origin"] = target.format_origin;
    out["layout"] = f->takes_layout() ? shown_layout : "universal";
    out["layout_given_keys"] = target.layout_given_keys;
    out["layout_kept_keys"] = target.layout_kept_keys;
    out["tensors"] = stats.targets_written;
    out["bytes_written"] = stats.bytes_written;
    if (!placed.empty()) out["placed"] = placed;
    j["output"] = out;
    json::OrderedJson gone = json::OrderedJson::array();
    for (const StaleTemporary& t : tidied) {
      gone.push_back({{"path", t.path.string()}, {"bytes", t.bytes}, {"pid", t.removing_pid}});
    }
    j["removed_leftovers"] = gone;
    j["bytes_read"] = stats.bytes_read;
    j["peak_buffer_bytes"] = stats.peak_in_flight_bytes;
    j["elapsed_s"] = seconds;
    j["output_files"] = summary.files;
    j["output_bytes"] = summary.bytes;
    j["peak_rss_bytes"] = summary.peak_rss_bytes;
    io.out << j.dump(2) << "\n";
    return Status::Ok();
  }
  if (setup.quiet) return Status::Ok();
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.1f s", seconds);
  io.out << "wrote "
         << (f->written_noun() == "checkpoint" ? "" : std::string(f->written_noun()) + " ") << dst;
  if (f->takes_layout()) io.out << " at " << shown_layout;
  io.out << ": " << stats.targets_written << " tensors, " << Gib(stats.bytes_written) << ", "
         << secs << "\n";
  io.out << "  from:   " << src.meta().format << " " << src_path << " at "
         << layout::ToString(src.meta().own_layout()) << "\n";
  if (!src.meta().qkv_layout_origin.empty()) {
    io.out << "  QKV:    " << src.meta().qkv_layout << " (" << src.meta().qkv_layout_origin << ")\n";
  }
  io.out << "  format: " << format << " (" << target.format_origin << ")\n";
  if (!placed.empty()) io.out << "  placed: " << placed << "\n";
  io.out << "  output: " << summary.files << " files, " << HumanBytes(summary.bytes)
         << "; peak memory " << HumanBytes(summary.peak_rss_bytes) << " (this process)\n";
  if (f->takes_layout() && !target.layout_kept_keys.empty()) {
    io.out << "  layout: "
           << (target.layout_kept_keys == "all"
                   ? std::string("the source's (no --layout)")
                   : (target.layout_given_keys.empty()
                          ? std::string()
                          : target.layout_given_keys + " from --layout, ") +
                         target.layout_kept_keys + " kept from the source")
           << "\n";
  }
  return Status::Ok();
}

/// convert / extract / reshard: open SRC, decide the output, write it.
inline Status RunConversion(const po::variables_map& vm, CommandIo& io,
                            const ConversionKind& kind) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, kind.command, true));
  const std::string src_path = vm["src"].as<std::string>();
  const std::filesystem::path data_dir = DataDir(vm);
  UCP_ASSIGN_OR_RETURN(auto src,
                       OpenCheckpoint(src_path, "SRC", vm["model"].as<std::string>(), data_dir,
                                      false, vm["qkv-layout"].as<std::string>(),
                                      vm["rotary-layout"].as<std::string>()));
  UCP_ASSIGN_OR_RETURN(ConversionTarget target, DecideTarget(vm, *src, src_path, kind));
  return RunWrite(vm, io, *setup, *src, src_path, target);
}

/// The options every conversion command (convert, reshard, extract) declares besides --layout.
inline void AddConversionOptions(po::options_description& o, po::positional_options_description& p,
                                 const std::string& format_note) {
  o.add_options()("src", po::value<std::string>()->required(), "source checkpoint")(
      "dst", po::value<std::string>()->required(),
      "output folder: new, or an empty folder (never SRC or inside it)")(
      "into-root",
      "DST is an existing DeepSpeed root: write the checkpoint as a new tag folder in it and "
      "update its latest (latest_universal) file atomically (--format deepspeed, "
      "deepspeed-universal)");
  AddFormatOptions(o, format_note);
  AddModelOption(o);
  AddDataDirOption(o);
  AddRunOptions(o);
  AddJsonOption(o);
  p.add("src", 1).add("dst", 1);
}

}  // namespace ucp::cli
