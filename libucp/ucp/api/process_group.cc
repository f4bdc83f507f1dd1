// ProcessGroup::Agree over Gather and Broadcast; the one-process group.
#include "ucp/api/process_group.h"

#include <cstdlib>
#include <string_view>

namespace ucp::api {
namespace {

class Single final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Result<std::string> Broadcast(const std::string& text) override { return text; }
  Result<std::vector<std::string>> Gather(const std::string& text) override {
    return std::vector<std::string>{text};
  }
};

// A status as "<code number> <message>" and back; the code list is ucp's own, so only a
// corrupted transport could give an unknown number.
std::string Encode(const Status& s) {
  return std::to_string(static_cast<int>(s.code())) + " " + s.message();
}

Status Decode(const std::string& text) {
  const size_t sp = text.find(' ');
  int code = -1;
  if (sp != std::string::npos && sp > 0 && sp < 4) code = std::atoi(text.substr(0, sp).c_str());
  if (code < 0 || code > static_cast<int>(StatusCode::kInternal)) {
    return InternalError("malformed status from another process: \"" + text.substr(0, 40) + "\"");
  }
  return Status(static_cast<StatusCode>(code), text.substr(sp + 1));
}

}  // namespace

Status ProcessGroup::Agree(const Status& mine) {
  if (size() == 1) return mine;
  Result<std::vector<std::string>> all = Gather(Encode(mine));
  if (!all.ok()) return all.status();
  std::string verdict = Encode(Status::Ok());
  if (is_root()) {
    for (size_t r = 0; r < all->size(); ++r) {
      Status s = Decode((*all)[r]);
      if (!s.ok()) {
        verdict = Encode(Status(s.code(), "process " + std::to_string(r) + ": " + s.message()));
        break;
      }
    }
  }
  Result<std::string> agreed = Broadcast(verdict);
  if (!agreed.ok()) return agreed.status();
  return Decode(*agreed);
}

ProcessGroup& SingleProcess() {
  static Single single;
  return single;
}

}  // namespace ucp::api
