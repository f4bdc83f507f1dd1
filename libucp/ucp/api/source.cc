// The parts of api/source.h that are code.
#include "ucp/api/source.h"

#include <cstdlib>

#ifndef UCP_DATA_DIR
#define UCP_DATA_DIR "."
#endif

namespace ucp::api {

namespace fs = std::filesystem;

convert::PlanOptions CheckpointMeta::plan_options() const {
  convert::PlanOptions o;
  o.optimizer_states = optimizer_states;
  o.model_slices = true;
  return o;
}

fs::path UcpDataDir() {
  const char* env = std::getenv("UCP_DATA_DIR");
  return fs::path(env != nullptr && *env != '\0' ? env : UCP_DATA_DIR) / "patterns";
}

exec::ExecOptions ExecOptionsOf(const RunOptions& o) {
  exec::ExecOptions e;
  e.memory_limit_bytes = o.memory_limit_bytes;
  e.progress = o.progress;
  return e;
}

}  // namespace ucp::api
