// The output folder rules of the writing commands (output_folder.h).
#include "ucp-cli/output_folder.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <ostream>
#include <system_error>

#include "ucp/api/format.h"
#include "ucp/api/process_group.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"

namespace ucp::cli {
namespace fs = std::filesystem;

namespace {

// The name inside a root under which --into-root stages its output: ROOT/ucp.tmp-XXXXXX.
constexpr char kIntoRootStem[] = "ucp";

// `inner` is `outer` or below it, compared on absolute, symlink-resolved paths (weakly: DST may
// not exist yet).
bool IsSameOrInside(const fs::path& inner, const fs::path& outer) {
  std::error_code ec;
  const fs::path a = fs::weakly_canonical(fs::absolute(inner, ec), ec);
  const fs::path b = fs::weakly_canonical(fs::absolute(outer, ec), ec);
  if (ec) return false;
  auto ia = a.begin();
  for (auto ib = b.begin(); ib != b.end(); ++ib, ++ia) {
    if (ib->empty()) continue;  // a trailing separator
    if (ia == a.end() || *ia != *ib) return false;
  }
  return true;
}

int64_t TreeBytes(const fs::path& root) {
  std::error_code ec;
  int64_t total = 0;
  if (fs::is_regular_file(fs::symlink_status(root, ec))) {
    return static_cast<int64_t>(fs::file_size(root, ec));
  }
  for (auto it = fs::recursive_directory_iterator(root, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code e2;
    if (it->is_regular_file(e2)) total += static_cast<int64_t>(it->file_size(e2));
  }
  return total;
}

// The writing format's declarations about roots (api/format.h); formats without a pointer file
// take no --into-root.
const api::CheckpointFormat* FormatOf(const std::string& format) {
  Result<const api::CheckpointFormat*> f = api::Formats().Find(format, /*for_writing=*/true);
  return f.ok() ? *f : nullptr;
}
std::string PointerFileOf(const std::string& format) {
  const api::CheckpointFormat* f = FormatOf(format);
  return f != nullptr ? std::string(f->root_pointer_file()) : std::string();
}

std::string ReadSmall(const fs::path& path) {
  Result<std::string> text = io::ReadFileToString(path, 4096);
  if (!text.ok()) return "";
  std::string s = *text;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

bool IsFolderName(const std::string& tag) {
  return !tag.empty() && tag != "." && tag != ".." && tag.find('/') == std::string::npos &&
         !io::IsTempName(tag);
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
}

Result<OutputTarget> PrepareOutput(const fs::path& src, const fs::path& dst_in,
                                   const std::string& format, bool into_root,
                                   int64_t universal_step, api::ProcessGroup* group_in) {
  api::ProcessGroup& group = group_in != nullptr ? *group_in : api::SingleProcess();
  OutputTarget t;
  t.dst = io::WithoutTrailingSlash(dst_in);
  t.write_to = t.dst;
  t.format = format;
  if (!src.empty() && IsSameOrInside(t.dst, src)) {
    return InvalidArgumentError("DST " + t.dst.string() +
                                (IsSameOrInside(src, t.dst) ? " is SRC " : " is inside SRC ") +
                                src.string() +
                                ": ucp does not write into the checkpoint it reads; choose a "
                                "folder outside it");
  }
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(t.dst, ec);
  if (into_root) {
    const std::string pointer = PointerFileOf(format);
    if (pointer.empty()) {
      std::string with_roots;
      for (const api::CheckpointFormat* f : api::Formats().formats()) {
        if (f->writes() && !f->root_pointer_file().empty()) {
          with_roots += (with_roots.empty() ? "" : ", ") + std::string(f->name());
        }
      }
      return InvalidArgumentError("--into-root adds a tag to a checkpoint root: it applies to "
                                  "--format " + with_roots + ", not " + format);
    }
    if (!fs::exists(st)) {
      return NotFoundError("--into-root: DeepSpeed root " + t.dst.string() + " does not exist");
    }
    if (!fs::is_directory(fs::status(t.dst, ec))) {
      return InvalidArgumentError("--into-root: " + t.dst.string() + " is not a folder");
    }
    t.mode = OutputTarget::Mode::kIntoRoot;
    if (!FormatOf(format)->writes_root()) {
      // The writer makes the tag folder itself; it is named as DeepSpeed's ds_to_universal
      // names its output (the only such format so far).
      t.tag = "global_step" + std::to_string(universal_step) + "_universal";
      if (fs::exists(fs::symlink_status(t.dst / t.tag, ec))) {
        return AlreadyExistsError("--into-root: " + (t.dst / t.tag).string() +
                                  " already exists; ucp never overwrites");
      }
    }
  } else if (fs::exists(st)) {
    const bool empty_dir = fs::is_directory(st) && fs::is_empty(t.dst, ec) && !ec;
    if (!empty_dir) {
      return AlreadyExistsError("output " + t.dst.string() +
                                " exists and is not an empty folder; ucp never overwrites");
    }
    t.mode = OutputTarget::Mode::kEmptyFolder;
  }
  if (t.mode == OutputTarget::Mode::kNew) return t;
  // The staging folder: made by the root, its name shared with the other processes.
  Status made;
  if (group.is_root()) {
    Result<fs::path> s = io::MakeTempSiblingDir(
        t.mode == OutputTarget::Mode::kIntoRoot ? t.dst / kIntoRootStem : t.dst);
    made = s.status();
    if (s.ok()) t.staging = *s;
  }
  UCP_RETURN_IF_ERROR(group.Agree(made));
  if (group.size() > 1) {
    UCP_ASSIGN_OR_RETURN(std::string name, group.Broadcast(t.staging.string()));
    t.staging = name;
  }
  t.write_to = t.staging / (t.mode == OutputTarget::Mode::kEmptyFolder ? t.dst.filename().string()
                            : !t.tag.empty()                           ? t.tag
                                                                       : std::string("root"));
  return t;
}

Result<std::string> FinishOutput(const OutputTarget& t) {
  if (t.mode == OutputTarget::Mode::kNew) return std::string();
  std::string said;
  Status st;
  if (t.mode == OutputTarget::Mode::kEmptyFolder) {
    // rename(2) onto an empty directory replaces it in one step; a folder that got content
    // since PrepareOutput is refused by the kernel (ENOTEMPTY / EEXIST).
    if (::rename(t.write_to.c_str(), t.dst.c_str()) != 0) {
      const int err = errno;
      st = err == ENOTEMPTY || err == EEXIST
               ? AlreadyExistsError("output " + t.dst.string() +
                                    " is no longer empty; ucp never overwrites")
               : ErrnoError("rename " + t.write_to.string() + " to " + t.dst.string(), err);
    }
    if (st.ok()) st = io::FsyncPath(t.dst.parent_path().empty() ? fs::path(".") : t.dst.parent_path());
    if (st.ok()) said = "the empty folder " + t.dst.string() + " now holds it";
  } else {
    const std::string pointer = PointerFileOf(t.format);
    std::string tag = t.tag;
    fs::path made = t.write_to;
    if (tag.empty()) {
      // The writer made a root (its pointer file + the tag folder); the tag moves.
      tag = ReadSmall(t.write_to / pointer);
      if (!IsFolderName(tag)) {
        st = InternalError("the " + t.format + " writer's " + pointer +
                           " file names no tag folder: \"" + tag + "\"");
      }
      made = t.write_to / tag;
    }
    const std::string before = ReadSmall(t.dst / pointer);
    if (st.ok()) st = io::RenameNoReplace(made, t.dst / tag);
    // Megatron's tracker file moves with `latest`, when the writer made one.
    const fs::path tracker = t.write_to / "latest_checkpointed_iteration.txt";
    std::error_code ec;
    if (st.ok() && t.tag.empty() && fs::exists(tracker, ec)) {
      st = io::WriteFileAtomic(t.dst / tracker.filename(), ReadSmall(tracker));
    }
    if (st.ok()) st = io::WriteFileAtomic(t.dst / pointer, tag);
    if (st.ok()) {
      said = "added tag " + tag + " to DeepSpeed root " + t.dst.string() + "; " +
             (t.dst / pointer).string() + " now names it" +
             (before.empty() ? "" : " (was " + before + ")");
    }
  }
  io::RemoveTreeBestEffort(t.staging);
  UCP_RETURN_IF_ERROR(st);
  return said;
}

void AbandonOutput(const OutputTarget& t) {
  if (!t.staging.empty()) io::RemoveTreeBestEffort(t.staging);
}

namespace {

// The PID of a "<temporary>.removing-PID" name (interrupt.cc's claimed name), or 0.
int64_t RemovingPid(const std::string& name) {
  constexpr std::string_view kMark = ".removing-";
  const size_t at = name.rfind(kMark);
  if (at == std::string::npos) return 0;
  const std::string digits = name.substr(at + kMark.size());
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return 0;
  }
  return std::stoll(digits);
}

// Whether process `pid` exists on this machine (signal 0 checks without sending; EPERM: it
// exists under another user).
bool ProcessAlive(int64_t pid) {
  return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

}  // namespace

std::vector<StaleTemporary> FindStaleTemporaries(const fs::path& dst_in) {
  const fs::path dst = io::WithoutTrailingSlash(dst_in);
  std::vector<StaleTemporary> out;
  const fs::path named_parent = dst.parent_path();  // "" for a bare name: shown as given
  const fs::path parent = named_parent.empty() ? fs::path(".") : named_parent;
  const std::string prefix = dst.filename().string() + std::string(io::kTempMarker);
  std::error_code ec;
  auto scan = [&](const fs::path& dir, const fs::path& shown, const std::string& start) {
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() > start.size() && name.starts_with(start)) {
        const int64_t pid = RemovingPid(name);
        if (pid > 0 && ProcessAlive(pid)) continue;  // its owner is removing it right now
        out.push_back({shown / name, TreeBytes(it->path()), pid});
      }
    }
    ec.clear();
  };
  scan(parent, named_parent, prefix);
  if (fs::is_directory(dst, ec)) {
    scan(dst, dst, std::string(kIntoRootStem) + std::string(io::kTempMarker));
  }
  std::sort(out.begin(), out.end(),
            [](const StaleTemporary& a, const StaleTemporary& b) { return a.path < b.path; });
  return out;
}

std::vector<StaleTemporary> TidyBeforeWrite(const fs::path& dst, const std::string& command,
                                            std::ostream& err, bool remove, bool speak) {
  std::vector<StaleTemporary> removed, kept;
  for (StaleTemporary& s : FindStaleTemporaries(dst)) {
    if (s.removing_pid > 0 && remove) {
      io::RemoveTreeBestEffort(s.path);
      std::error_code ec;
      if (!fs::exists(fs::symlink_status(s.path, ec))) {
        removed.push_back(std::move(s));
        continue;
      }
    }
    if (s.removing_pid == 0) kept.push_back(std::move(s));
  }
  const std::string shown_dst = io::WithoutTrailingSlash(dst).string();
  if (speak && !removed.empty()) {
    err << command << ": removed " << removed.size() << " leftover"
        << (removed.size() == 1 ? "" : "s") << " of an interrupted run's cleanup next to "
        << shown_dst << ":";
    for (size_t i = 0; i < removed.size(); ++i) {
      err << (i == 0 ? " " : ", ") << removed[i].path.string() << " ("
          << HumanBytes(removed[i].bytes) << ", its process " << removed[i].removing_pid
          << " is gone)";
    }
    err << "\n";
  }
  if (speak && !kept.empty()) {
    err << command << ": warning: " << kept.size() << " unfinished output"
        << (kept.size() == 1 ? "" : "s") << " of an earlier, interrupted run next to "
        << shown_dst << ":";
    for (size_t i = 0; i < kept.size(); ++i) {
      err << (i == 0 ? " " : ", ") << kept[i].path.string() << " (" << HumanBytes(kept[i].bytes)
          << ")";
    }
    err << "; `ucp clean " << shown_dst << "` removes them\n";
  }
  return removed;
}

}  // namespace ucp::cli
