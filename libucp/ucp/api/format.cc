// The format interface's defaults and the registry (see format.h).
#include "ucp/api/format.h"

#include <algorithm>

namespace ucp::api {

namespace fs = std::filesystem;

Result<std::unique_ptr<CheckpointSource>> CheckpointFormat::Open(const fs::path& dir,
                                                                 const fs::path&,
                                                                 const SourceOptions&) const {
  return UnimplementedError("format " + std::string(name()) + " does not read checkpoints (" +
                            dir.string() + ")");
}

Result<exec::ExecStats> CheckpointFormat::Write(const CheckpointSource&, const fs::path& dst,
                                                const WriteRequest&) const {
  return UnimplementedError("format " + std::string(name()) + " does not write checkpoints (" +
                            dst.string() + ")");
}

Status FormatRegistry::Add(std::unique_ptr<CheckpointFormat> format) {
  for (const auto& f : formats_) {
    if (f->name() == format->name()) {
      return AlreadyExistsError("format \"" + std::string(format->name()) +
                                "\" is registered twice");
    }
  }
  formats_.push_back(std::move(format));
  return Status::Ok();
}

std::string FormatRegistry::WriterNames() const {
  std::string names;
  for (const auto& f : formats_) {
    if (f->writes()) names += (names.empty() ? "" : ", ") + std::string(f->name());
  }
  return names;
}

Result<const CheckpointFormat*> FormatRegistry::Find(std::string_view name,
                                                     bool for_writing) const {
  for (const auto& f : formats_) {
    if (f->name() != name) continue;
    if (for_writing && !f->writes()) {
      return InvalidArgumentError("--format " + std::string(name) +
                                  " is read, not written; --format must be one of " +
                                  WriterNames());
    }
    return f.get();
  }
  std::string names;
  for (const auto& f : formats_) {
    if (!for_writing || f->writes()) names += (names.empty() ? "" : ", ") + std::string(f->name());
  }
  return InvalidArgumentError("--format must be one of " + names + ", got \"" + std::string(name) +
                              "\"");
}

Result<const CheckpointFormat*> FormatRegistry::Detect(const fs::path& dir) const {
  std::string needs;
  for (const auto& f : formats_) {
    if (!f->reads()) continue;
    if (f->Detect(dir)) return f.get();
    if (!f->detect_hint().empty()) {
      needs += (needs.empty() ? "" : " nor ") + std::string(f->detect_hint());
    }
  }
  return NotFoundError(dir.string() + " has neither " + needs + ": not a complete checkpoint");
}

std::vector<const CheckpointFormat*> FormatRegistry::formats() const {
  std::vector<const CheckpointFormat*> out;
  for (const auto& f : formats_) out.push_back(f.get());
  return out;
}

}  // namespace ucp::api
