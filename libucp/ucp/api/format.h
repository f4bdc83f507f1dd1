// Checkpoint formats as plug-ins (ADR 0008). A format is a source (a folder of that format
// opened as a CheckpointSource, recognised by its content) and/or a sink (a target written from
// any source, `--format NAME` of extract / convert / reshard), behind one interface. The CLI and
// the facade ask the registry by name or by content and hold no branch per format; adding a
// format touches only its folder and one registration line (api/builtin_formats.cc).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/api/source.h"
#include "ucp/base/result.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"

namespace ucp::api {

/// A sink's own option (`--naming`, `--max-shard-size`, ...), declared by the format so that
/// the CLI offers it and refuses it with another --format.
struct FormatOption {
  std::string name;           ///< the long option without dashes: "max-shard-size"
  std::string help;           ///< one line for --help
  std::string default_value;  ///< shown in --help; "" means unset
};

/// What a sink is asked to write.
struct WriteRequest {
  /// The target layout; layout.universal when none was asked (for formats without a layout,
  /// FormatTraits::takes_layout false) or `--layout universal`.
  layout::Layout layout;
  bool layout_given = false;
  RunOptions run;
  /// The values of the format's declared options that were given (name -> text).
  std::map<std::string, std::string> options;
  /// The option's value, or `fallback` when it was not given.
  std::string Option(const std::string& name, const std::string& fallback = "") const {
    auto it = options.find(name);
    return it == options.end() ? fallback : it->second;
  }
};

class CheckpointFormat {
 public:
  virtual ~CheckpointFormat() = default;

  /// The registry name (`--format NAME`): "ucp", "deepspeed", "deepspeed-universal", "hf".
  virtual std::string_view name() const = 0;
  /// One line for `--help` and error messages.
  virtual std::string_view summary() const = 0;

  // --- source side ---
  /// Whether this format opens checkpoints.
  virtual bool reads() const { return false; }
  /// Whether `dir` holds a checkpoint of this format, judged by its content (file names, a cheap
  /// look at small files); never an error. Only called when reads().
  virtual bool Detect(const std::filesystem::path& dir) const {
    (void)dir;
    return false;
  }
  /// What Detect looks for, for the "no format recognises it" message ("config.json and
  /// model.safetensors").
  virtual std::string_view detect_hint() const { return ""; }
  /// Opens the checkpoint at `dir`. Rule sets and presets come from `data_dir`.
  /// Errors: the format's own; kUnimplemented when !reads().
  virtual Result<std::unique_ptr<CheckpointSource>> Open(const std::filesystem::path& dir,
                                                         const std::filesystem::path& data_dir,
                                                         const SourceOptions& options) const;

  // --- sink side ---
  /// Whether this format writes checkpoints.
  virtual bool writes() const { return false; }
  /// Whether the sink is placed at a `--layout` (a ucp or DeepSpeed layout). Formats that hold
  /// full tensors (hf) take none; `--layout universal` is then the same as none.
  virtual bool takes_layout() const { return true; }
  /// The sink's own options.
  virtual std::vector<FormatOption> write_options() const { return {}; }
  /// Writes `src` at request.layout into the new folder `dst` (it must not exist), streaming.
  /// Returns the executor's counts.
  /// Errors: the format's own; kUnimplemented when !writes(); kAlreadyExists (dst exists).
  virtual Result<exec::ExecStats> Write(const CheckpointSource& src,
                                        const std::filesystem::path& dst,
                                        const WriteRequest& request) const;
  /// What the written checkpoint is called in the CLI's report ("DeepSpeed checkpoint").
  virtual std::string_view written_noun() const { return "checkpoint"; }

  /// Whether Write shares its work among the processes of request.run.group (each writes its
  /// own ranks, the root commits). For a format that does not, api::WriteCheckpoint has the
  /// root write alone while the others wait for its outcome, so N processes never write one DST
  /// side by side.
  virtual bool writes_in_parallel() const { return false; }
  /// Whether Write reads its source as a ucp universal checkpoint on disk (deepspeed-universal).
  /// api::WriteCheckpoint then gives it one: any other source is first extracted into a
  /// temporary sibling of dst (DST.tmp-XXXXXX, removed afterwards), so every source converts.
  virtual bool needs_universal_source() const { return false; }

  /// The writing format a conversion of this format's checkpoints produces when no --format is
  /// given: the source's own family (DeepSpeed in, DeepSpeed out), so that a conversion changes
  /// what the user asked for and nothing else. Default: this format when it writes, else "ucp".
  virtual std::string_view default_output_format() const { return writes() ? name() : "ucp"; }

  /// Formats whose checkpoints are tag folders in a root that names the one to load: the
  /// pointer file's name (DeepSpeed: `latest`; its universal form: `latest_universal`), which
  /// `--into-root` rewrites atomically after adding a tag. Empty: the format has no root.
  virtual std::string_view root_pointer_file() const { return {}; }
  /// For such formats: whether Write makes a whole root (the pointer file and the tag folder it
  /// names, as DeepSpeed's writer does) rather than the tag folder itself.
  virtual bool writes_root() const { return false; }
};

/// The formats known to one program, in detection order.
class FormatRegistry {
 public:
  /// Adds a format. Errors: kAlreadyExists for a second format of the same name.
  Status Add(std::unique_ptr<CheckpointFormat> format);

  /// The format named `name`.
  /// Errors: kInvalidArgument "--format must be one of ucp, deepspeed, ... , got \"x\"" (only
  /// writing formats listed when `for_writing`), or naming a format that does not write.
  Result<const CheckpointFormat*> Find(std::string_view name, bool for_writing = false) const;

  /// The first format (in registration order) whose Detect recognises `dir`.
  /// Errors: kNotFound "DIR is no checkpoint: it has neither X (ucp) nor Y (hf) ...".
  Result<const CheckpointFormat*> Detect(const std::filesystem::path& dir) const;

  /// Every format, in registration order.
  std::vector<const CheckpointFormat*> formats() const;
  /// The names of the writing formats, "ucp, deepspeed, hf".
  std::string WriterNames() const;

 private:
  std::vector<std::unique_ptr<CheckpointFormat>> formats_;
};

/// The built-in formats: ucp, deepspeed, deepspeed-universal, hf (api/builtin_formats.cc).
/// Built once, on first use; thread-safe.
const FormatRegistry& Formats();

}  // namespace ucp::api
