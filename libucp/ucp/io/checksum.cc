// XXH3-64 through libxxhash; the only file that includes xxhash.h.
#include "ucp/io/checksum.h"

#include <xxhash.h>

#include <cstdio>

#include "ucp/base/check.h"

namespace ucp::io {

uint64_t Xxh3_64(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string FormatXxh3(uint64_t digest) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(digest));
  return std::string(kXxh3Prefix) + hex;
}

Result<uint64_t> ParseXxh3(std::string_view text, const std::string& what) {
  auto bad = [&] {
    return DataLossError(what + " '" + std::string(text) +
                         "' is not a checksum of the form xxh3-64:<16 lowercase hex digits>");
  };
  if (text.size() != kXxh3Prefix.size() + 16 || text.substr(0, kXxh3Prefix.size()) != kXxh3Prefix) {
    return bad();
  }
  uint64_t v = 0;
  for (char c : text.substr(kXxh3Prefix.size())) {
    int d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (c >= 'a' && c <= 'f')
      d = c - 'a' + 10;
    else
      return bad();
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

struct Xxh3Hasher::State {
  XXH3_state_t* s = nullptr;
};

Xxh3Hasher::Xxh3Hasher() : state_(std::make_unique<State>()) {
  state_->s = XXH3_createState();
  UCP_CHECK(state_->s != nullptr) << "XXH3_createState failed";
  XXH3_64bits_reset(state_->s);
}
Xxh3Hasher::~Xxh3Hasher() {
  if (state_ && state_->s) XXH3_freeState(state_->s);
}
Xxh3Hasher::Xxh3Hasher(Xxh3Hasher&&) noexcept = default;
Xxh3Hasher& Xxh3Hasher::operator=(Xxh3Hasher&& o) noexcept {
  if (this != &o) {
    if (state_ && state_->s) XXH3_freeState(state_->s);
    state_ = std::move(o.state_);
  }
  return *this;
}
void Xxh3Hasher::Update(std::span<const std::byte> bytes) {
  XXH3_64bits_update(state_->s, bytes.data(), bytes.size());
}
uint64_t Xxh3Hasher::Digest() const { return XXH3_64bits_digest(state_->s); }

}  // namespace ucp::io
