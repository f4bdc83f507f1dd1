// The output folder of the writing commands (convert, extract, reshard): what DST may be, where
// the format's writer actually writes, and what the commit does after it (docs/cli.md, "Output
// folder"):
//   * DST must not be SRC or inside it (invalid_argument, exit 3);
//   * a missing DST is written as always (the writer's DST.tmp-XXXXXX, renamed into place);
//   * an existing empty folder is accepted: the checkpoint is built inside a DST.tmp-XXXXXX
//     staging folder and renamed over the empty folder (rename(2) replaces an empty directory
//     atomically and refuses one that meanwhile got content);
//   * --into-root: DST is an existing DeepSpeed root; the checkpoint becomes a new tag folder
//     inside it and the root's pointer file (`latest`, or `latest_universal` for
//     deepspeed-universal) is updated atomically to name it, so Megatron's --load finds it.
// It also finds the unfinished outputs an interrupted earlier run left next to DST
// (DST.tmp-XXXXXX) for the warning line and `ucp clean`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::api {
class ProcessGroup;
}  // namespace ucp::api

namespace ucp::cli {

struct OutputTarget {
  enum class Mode { kNew, kEmptyFolder, kIntoRoot };
  Mode mode = Mode::kNew;
  std::filesystem::path dst;       ///< the folder the user named (without trailing slash)
  std::filesystem::path write_to;  ///< where the format's writer writes
  std::filesystem::path staging;   ///< the DST.tmp-XXXXXX holding write_to (not kNew)
  std::string format;              ///< --format
  std::string tag;                 ///< kIntoRoot, deepspeed-universal: the new tag folder's name
};

/// Checks DST against SRC and prepares where the writer writes. Under an MPI group the root
/// creates the staging folder and the others learn its name. `universal_step` names a
/// deepspeed-universal tag (global_step<N>_universal, as DeepSpeed's ds_to_universal does).
/// Errors: kInvalidArgument (DST is SRC or inside it; --into-root with a format without a root
/// or with a DST that is not a folder), kAlreadyExists (DST is a non-empty folder or a file),
/// kNotFound (--into-root and DST does not exist), kIoError.
Result<OutputTarget> PrepareOutput(const std::filesystem::path& src, const std::filesystem::path& dst,
                                   const std::string& format, bool into_root, int64_t universal_step,
                                   api::ProcessGroup* group);

/// Moves what the writer wrote into place (root only; a no-op for kNew) and removes the staging
/// folder. Returns the sentence for the summary ("" for kNew): what was replaced or added and
/// which pointer file now names it.
/// Errors: kAlreadyExists (DST got content meanwhile; the tag exists in the root), kIoError.
Result<std::string> FinishOutput(const OutputTarget& target);

/// Removes the staging folder after a failed write (best effort; root only).
void AbandonOutput(const OutputTarget& target);

/// An unfinished output next to `dst`: DST.tmp-XXXXXX (a folder an interrupted or killed run
/// left), with its size. `removing_pid` > 0 for DST.tmp-XXXXXX.removing-PID: a temporary that
/// process PID had renamed to remove it (io/interrupt.h) and that it did not finish removing,
/// as when mpirun SIGKILLs its ranks about a second after forwarding a SIGTERM. Such a folder is
/// garbage by construction (its owner only ever removes it).
struct StaleTemporary {
  std::filesystem::path path;
  int64_t bytes = 0;
  int64_t removing_pid = 0;
};

/// The unfinished outputs next to `dst` (`dst`'s siblings named `<name of dst>.tmp-*`) and, when
/// `dst` is a folder, the --into-root staging folders inside it (`ucp.tmp-*`). A `.removing-PID`
/// folder whose process is still alive is being removed by it, and is not listed.
std::vector<StaleTemporary> FindStaleTemporaries(const std::filesystem::path& dst);

/// What a writing command does about FindStaleTemporaries(dst) before it writes: removes the
/// abandoned removals (removing_pid > 0, their process gone; only when `remove`: the root of an
/// MPI job) and says so in one line on `err`, and warns in one line about the other unfinished
/// outputs, which it keeps (`ucp clean` removes them). `speak` false (--quiet, or not the root):
/// nothing is printed. Returns the removed folders.
std::vector<StaleTemporary> TidyBeforeWrite(const std::filesystem::path& dst,
                                            const std::string& command, std::ostream& err,
                                            bool remove, bool speak);

/// "19.1 MiB"
std::string HumanBytes(int64_t bytes);

}  // namespace ucp::cli
