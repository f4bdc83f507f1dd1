// libFuzzer target for the checkpoint manifests a file reaches: the universal manifest.json and
// the distributed ucp_layout.json. The bytes are tried as both; what parses must serialize, and
// its serialization must parse back to the same bytes (the writers are deterministic).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ucp/dist/dist_manifest.h"
#include "ucp/io/manifest/universal_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto m = ucp::io::ParseUniversalManifest(text, "manifest.json"); m.ok()) {
    auto once = ucp::io::SerializeUniversalManifest(*m);
    if (once.ok()) {
      auto back = ucp::io::ParseUniversalManifest(*once, "manifest.json");
      if (!back.ok()) __builtin_trap();
      auto twice = ucp::io::SerializeUniversalManifest(*back);
      if (!twice.ok() || *twice != *once) __builtin_trap();
    }
  }
  if (auto m = ucp::dist::ParseDistManifest(text, "ucp_layout.json"); m.ok()) {
    auto once = ucp::dist::SerializeDistManifest(*m);
    if (once.ok()) {
      auto back = ucp::dist::ParseDistManifest(*once, "ucp_layout.json");
      if (!back.ok()) __builtin_trap();
      auto twice = ucp::dist::SerializeDistManifest(*back);
      if (!twice.ok() || *twice != *once) __builtin_trap();
    }
  }
  return 0;
}
