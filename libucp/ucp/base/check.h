// UCP_CHECK: broken invariants (bugs) abort in every build; they are never a Status.
#pragma once

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace ucp::internal_check {

// Collects the streamed message, prints it and aborts when destroyed.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* cond) {
    stream_ << file << ":" << line << ": check failed: " << cond << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::cerr << stream_.str() << std::endl;
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Lets `UCP_CHECK(c) << "..."` be an expression of type void in both branches.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace ucp::internal_check

#define UCP_CHECK(cond)                  \
  (cond) ? (void)0                       \
         : ::ucp::internal_check::Voidify() & \
               ::ucp::internal_check::CheckFailure(__FILE__, __LINE__, #cond).stream()

#ifdef NDEBUG
#define UCP_DCHECK(cond) \
  while (false) UCP_CHECK(cond)
#else
#define UCP_DCHECK(cond) UCP_CHECK(cond)
#endif
