// StreamedDataset and HashFileRange.
#include "ucp/io/streamed_dataset.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"

namespace ucp::io {

StreamedDataset::StreamedDataset(std::string what, int64_t offset, int64_t num_elems,
                                 int64_t elem_bytes)
    : what_(std::move(what)), offset_(offset), num_elems_(num_elems), elem_bytes_(elem_bytes) {}

Status StreamedDataset::Append(RawFile& file, int64_t begin_elem, std::span<const std::byte> data) {
  std::lock_guard<std::mutex> lock(mu_);
  if (next_ == num_elems_ && num_elems_ > 0) {
    return AlreadyExistsError(what_ + " is already complete");
  }
  if (static_cast<int64_t>(data.size()) % elem_bytes_ != 0) {
    return InvalidArgumentError(what_ + ": " + std::to_string(data.size()) +
                                " bytes are not whole elements of " + std::to_string(elem_bytes_) +
                                " bytes");
  }
  const int64_t n = static_cast<int64_t>(data.size()) / elem_bytes_;
  if (begin_elem != next_) {
    return InvalidArgumentError(what_ + ": range starts at element " + std::to_string(begin_elem) +
                                " but " + std::to_string(next_) + " were written so far");
  }
  if (n > num_elems_ - next_) {
    return InvalidArgumentError(what_ + ": elements [" + std::to_string(begin_elem) + ", " +
                                std::to_string(begin_elem + n) + ") reach past its " +
                                std::to_string(num_elems_));
  }
  if (n > 0) UCP_RETURN_IF_ERROR(file.WriteAt(offset_ + next_ * elem_bytes_, data), what_);
  hasher_.Update(data);
  next_ += n;
  return Status::Ok();
}

bool StreamedDataset::complete() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ == num_elems_;
}

int64_t StreamedDataset::elements_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_;
}

std::string StreamedDataset::checksum() const {
  std::lock_guard<std::mutex> lock(mu_);
  return FormatXxh3(hasher_.Digest());
}

Result<uint64_t> HashFileRange(const RawFile& file, int64_t offset, int64_t num_bytes,
                               int64_t piece_bytes) {
  Xxh3Hasher h;
  std::vector<std::byte> buf(static_cast<size_t>(std::min(num_bytes, piece_bytes)));
  for (int64_t done = 0; done < num_bytes;) {
    const int64_t n = std::min(piece_bytes, num_bytes - done);
    std::span<std::byte> piece(buf.data(), static_cast<size_t>(n));
    UCP_RETURN_IF_ERROR(file.ReadAt(offset + done, piece));
    h.Update(piece);
    progress::AddBytes(n);  // the checksum pass's progress (base/progress.h)
    done += n;
  }
  return h.Digest();
}

}  // namespace ucp::io
