// Host buffers a GPU may pin. cudaHostRegister pins whole pages, and CUDA refuses a copy whose
// host range is partly pinned and partly not (cudaErrorInvalidValue): a heap buffer sharing a
// page with a pinned neighbour would fail its copies. So a buffer the device pins is its own
// run of pages: it starts on a page and its allocation is rounded up to whole pages.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

namespace ucp::offload {

/// The page size pinning works in (at least 4 KiB).
inline size_t HostPageBytes() {
  static const size_t page = std::max<size_t>(4096, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  return page;
}

/// Whether a buffer can be pinned in place: it starts on a page (a PageVector's also owns its
/// last page; the rule the CUDA device pins by, and the CPU twin reports).
inline bool StartsOnPage(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % HostPageBytes() == 0;
}

/// An allocator whose every allocation starts on a page and owns whole pages.
template <typename T>
struct PageAllocator {
  using value_type = T;
  PageAllocator() = default;
  template <typename U>
  PageAllocator(const PageAllocator<U>&) noexcept {}  // NOLINT: rebinding, as std::allocator

  T* allocate(size_t n) {
    const size_t page = HostPageBytes();
    if (n > (std::numeric_limits<size_t>::max() - page) / sizeof(T)) throw std::bad_alloc();
    const size_t bytes = std::max(page, (n * sizeof(T) + page - 1) / page * page);
    void* p = std::aligned_alloc(page, bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) noexcept { std::free(p); }

  template <typename U>
  bool operator==(const PageAllocator<U>&) const noexcept { return true; }
};

/// A vector the CUDA device can pin in place (TrainDeviceSpec's host buffers).
template <typename T>
using PageVector = std::vector<T, PageAllocator<T>>;

}  // namespace ucp::offload
