// ZipReader: end-of-central-directory (classic and zip64), central directory, local headers.
#include "ucp/io/torch/zip_reader.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"

namespace ucp::torch {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr int64_t kEocdSize = 22;
constexpr int64_t kZip64LocatorSize = 20;
constexpr int64_t kZip64EocdSize = 56;
constexpr int64_t kCentralSize = 46;
constexpr int64_t kLocalSize = 30;
constexpr int64_t kMaxComment = 0xFFFF;

uint16_t U16(const std::string& b, size_t at) {
  return static_cast<uint16_t>(static_cast<uint8_t>(b[at]) |
                               (static_cast<uint8_t>(b[at + 1]) << 8));
}
uint32_t U32(const std::string& b, size_t at) {
  return static_cast<uint32_t>(U16(b, at)) | (static_cast<uint32_t>(U16(b, at + 2)) << 16);
}
uint64_t U64(const std::string& b, size_t at) {
  return static_cast<uint64_t>(U32(b, at)) | (static_cast<uint64_t>(U32(b, at + 4)) << 32);
}

std::string Num(int64_t v) { return std::to_string(v); }

// An offset or size parsed from the file, as int64; values >= 2^63 are corrupt on their face.
Result<int64_t> AsOffset(uint64_t v, const std::string& what, const std::string& file) {
  if (v > static_cast<uint64_t>(INT64_MAX)) {
    return DataLossError("zip " + what + " " + std::to_string(v) + " in " + file +
                         " is beyond any file size");
  }
  return static_cast<int64_t>(v);
}

Status ValidateEntryName(const std::string& name, const std::string& file) {
  auto bad = [&](const std::string& why) {
    return DataLossError("zip entry name '" + name + "' in " + file + " " + why);
  };
  if (name.empty()) return bad("is empty");
  if (name.front() == '/') return bad("is an absolute path");
  if (name.find('\\') != std::string::npos) return bad("contains a backslash");
  if (name.find('\0') != std::string::npos) return bad("contains a NUL byte");
  if (name.size() >= 2 && name[1] == ':') return bad("starts with a drive letter");
  size_t start = 0;
  while (true) {
    size_t slash = name.find('/', start);
    std::string_view comp(name.data() + start,
                          (slash == std::string::npos ? name.size() : slash) - start);
    if (comp.empty()) return bad("has an empty path component");
    if (comp == "." || comp == "..") return bad("has a '" + std::string(comp) + "' component");
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return Status::Ok();
}

struct EndRecords {
  int64_t num_entries = 0;
  int64_t cd_offset = 0;
  int64_t cd_size = 0;
  int64_t cd_end_limit = 0;  // where the central directory must end (the first end record)
};

Result<EndRecords> ParseEndRecords(const ByteSource& src) {
  const std::string& file = src.name();
  const int64_t size = src.size();
  if (size < kEocdSize) {
    return DataLossError("zip file " + file + " is " + Num(size) +
                         " bytes, too short for an end-of-central-directory record (22 bytes)");
  }
  const int64_t tail_len = std::min<int64_t>(size, kEocdSize + kMaxComment);
  UCP_ASSIGN_OR_RETURN(std::string tail, src.ReadString(size - tail_len, tail_len));
  // The EOCD's comment must run exactly to the end of the file: nothing may trail it.
  int64_t eocd_in_tail = -1;
  for (int64_t p = tail_len - kEocdSize; p >= 0; --p) {
    if (U32(tail, p) == kEocdSig && U16(tail, p + 20) == tail_len - p - kEocdSize) {
      eocd_in_tail = p;
      break;
    }
  }
  if (eocd_in_tail < 0) {
    return DataLossError("no end-of-central-directory record in the last " + Num(tail_len) +
                         " bytes of zip file " + file);
  }
  const int64_t eocd_pos = size - tail_len + eocd_in_tail;
  const size_t e = static_cast<size_t>(eocd_in_tail);
  const uint16_t disk = U16(tail, e + 4), cd_disk = U16(tail, e + 6);
  const uint16_t n_disk = U16(tail, e + 8), n_total = U16(tail, e + 10);
  const uint32_t cd_size32 = U32(tail, e + 12), cd_off32 = U32(tail, e + 16);
  if ((disk != 0 && disk != 0xFFFF) || (cd_disk != 0 && cd_disk != 0xFFFF) || n_disk != n_total) {
    return UnimplementedError("zip file " + file + " spans several disks (disk " + Num(disk) +
                              ", central directory disk " + Num(cd_disk) + ")");
  }
  EndRecords r;
  r.num_entries = n_total;
  r.cd_size = cd_size32;
  r.cd_offset = cd_off32;
  r.cd_end_limit = eocd_pos;

  const int64_t loc_pos = eocd_pos - kZip64LocatorSize;
  bool has_loc = false;
  std::string loc;
  if (loc_pos >= 0) {
    UCP_ASSIGN_OR_RETURN(loc, src.ReadString(loc_pos, kZip64LocatorSize));
    has_loc = U32(loc, 0) == kZip64LocatorSig;
  }
  const bool saturated = n_total == 0xFFFF || cd_size32 == 0xFFFFFFFF || cd_off32 == 0xFFFFFFFF;
  if (!has_loc) {
    if (saturated) {
      return DataLossError("zip file " + file +
                           " has saturated end-of-central-directory fields but no zip64 locator");
    }
    return r;
  }
  if (U32(loc, 4) != 0 || U32(loc, 16) > 1) {
    return UnimplementedError("zip file " + file + " has a multi-disk zip64 locator");
  }
  UCP_ASSIGN_OR_RETURN(int64_t z64_pos, AsOffset(U64(loc, 8), "zip64 end record offset", file));
  if (z64_pos > loc_pos - kZip64EocdSize) {
    return DataLossError("zip64 end record offset " + Num(z64_pos) + " in " + file +
                         " leaves no room for its 56 bytes before the locator at " + Num(loc_pos));
  }
  UCP_ASSIGN_OR_RETURN(std::string z, src.ReadString(z64_pos, kZip64EocdSize));
  if (U32(z, 0) != kZip64EocdSig) {
    return DataLossError("no zip64 end-of-central-directory signature at offset " + Num(z64_pos) +
                         " of " + file + " (the locator points there)");
  }
  const uint64_t rec_size = U64(z, 4);
  if (rec_size != static_cast<uint64_t>(loc_pos - z64_pos - 12)) {
    return DataLossError("zip64 end record at offset " + Num(z64_pos) + " of " + file +
                         " says it is " + std::to_string(rec_size) +
                         " bytes, but the locator is at " + Num(loc_pos));
  }
  if (U32(z, 16) != 0 || U32(z, 20) != 0 || U64(z, 24) != U64(z, 32)) {
    return UnimplementedError("zip file " + file + " spans several disks (zip64 end record)");
  }
  UCP_ASSIGN_OR_RETURN(int64_t n64, AsOffset(U64(z, 32), "zip64 entry count", file));
  UCP_ASSIGN_OR_RETURN(int64_t size64, AsOffset(U64(z, 40), "zip64 directory size", file));
  UCP_ASSIGN_OR_RETURN(int64_t off64, AsOffset(U64(z, 48), "zip64 directory offset", file));
  // Where the classic fields are not saturated they must agree with the zip64 ones.
  if ((n_total != 0xFFFF && n_total != n64) || (cd_size32 != 0xFFFFFFFF && cd_size32 != size64) ||
      (cd_off32 != 0xFFFFFFFF && cd_off32 != off64)) {
    return DataLossError("zip file " + file + " has end records that disagree: entries " +
                         Num(n_total) + " vs " + Num(n64) + ", directory size " + Num(cd_size32) +
                         " vs " + Num(size64) + ", directory offset " + Num(cd_off32) + " vs " +
                         Num(off64));
  }
  r.num_entries = n64;
  r.cd_size = size64;
  r.cd_offset = off64;
  r.cd_end_limit = z64_pos;
  return r;
}

struct Zip64Fields {
  uint64_t size = 0, comp = 0, lho = 0;
};

// The zip64 extra field (ID 0x0001) carries the saturated values, in a fixed order.
Status ParseZip64Extra(const std::string& extra, bool need_size, bool need_comp, bool need_lho,
                       Zip64Fields& out, const std::string& name, const std::string& file) {
  size_t p = 0;
  bool found = false;
  while (p + 4 <= extra.size()) {
    uint16_t id = U16(extra, p), len = U16(extra, p + 2);
    if (p + 4 + len > extra.size()) {
      return DataLossError("extra field of zip entry '" + name + "' in " + file +
                           " overruns its length (" + Num(extra.size()) + " bytes)");
    }
    if (id == 0x0001) {
      found = true;
      size_t q = p + 4, end = p + 4 + len;
      auto take = [&](uint64_t& v) -> bool {
        if (q + 8 > end) return false;
        v = U64(extra, q);
        q += 8;
        return true;
      };
      if ((need_size && !take(out.size)) || (need_comp && !take(out.comp)) ||
          (need_lho && !take(out.lho))) {
        return DataLossError("zip64 extra field of entry '" + name + "' in " + file + " is " +
                             Num(len) + " bytes, too short for its saturated fields");
      }
    }
    p += 4 + len;
  }
  if (!found && (need_size || need_comp || need_lho)) {
    return DataLossError("zip entry '" + name + "' in " + file +
                         " has saturated sizes or offset but no zip64 extra field");
  }
  return Status::Ok();
}

}  // namespace

Result<ZipReader> ZipReader::Open(std::shared_ptr<const ByteSource> source) {
  const ByteSource& src = *source;
  const std::string& file = src.name();
  UCP_ASSIGN_OR_RETURN(EndRecords end, ParseEndRecords(src), "while reading zip " + file);

  if (end.cd_offset > end.cd_end_limit || end.cd_size != end.cd_end_limit - end.cd_offset) {
    return DataLossError("central directory of " + file + " at offset " + Num(end.cd_offset) +
                         " with " + Num(end.cd_size) + " bytes does not end at the end record (" +
                         Num(end.cd_end_limit) + ")");
  }
  if (end.num_entries == 0) return DataLossError("zip file " + file + " has no entries");
  if (end.num_entries > end.cd_size / kCentralSize) {
    return DataLossError("zip file " + file + " claims " + Num(end.num_entries) +
                         " entries, but its central directory has room for at most " +
                         Num(end.cd_size / kCentralSize) + " (" + Num(end.cd_size) + " bytes)");
  }
  UCP_ASSIGN_OR_RETURN(std::string cd, src.ReadString(end.cd_offset, end.cd_size));

  ZipReader r;
  r.source_ = std::move(source);
  size_t p = 0;
  for (int64_t i = 0; i < end.num_entries; ++i) {
    const std::string at = " (central directory entry " + Num(i) + " of " + file + ")";
    if (p + kCentralSize > cd.size() || U32(cd, p) != kCentralSig) {
      return DataLossError("bad central directory signature at offset " +
                           Num(end.cd_offset + static_cast<int64_t>(p)) + at);
    }
    const uint16_t flags = U16(cd, p + 8), method = U16(cd, p + 10);
    const uint32_t crc = U32(cd, p + 16), comp32 = U32(cd, p + 20), size32 = U32(cd, p + 24);
    const uint16_t name_len = U16(cd, p + 28), extra_len = U16(cd, p + 30);
    const uint16_t comment_len = U16(cd, p + 32), disk = U16(cd, p + 34);
    const uint32_t lho32 = U32(cd, p + 42);
    const size_t var = static_cast<size_t>(name_len) + extra_len + comment_len;
    if (p + kCentralSize + var > cd.size()) {
      return DataLossError("central directory entry runs past the directory's " + Num(end.cd_size) +
                           " bytes" + at);
    }
    ZipEntry e;
    e.name = cd.substr(p + kCentralSize, name_len);
    const std::string extra = cd.substr(p + kCentralSize + name_len, extra_len);
    p += kCentralSize + var;
    if (disk != 0 && disk != 0xFFFF) {
      return UnimplementedError("zip entry '" + e.name + "' is on disk " + Num(disk) + at);
    }
    UCP_RETURN_IF_ERROR(ValidateEntryName(e.name, file));
    if (flags & 0x0001) {
      return UnimplementedError("zip entry '" + e.name + "' is encrypted" + at);
    }
    if (method != 0) {
      return UnimplementedError("zip entry '" + e.name + "' uses compression method " +
                                Num(method) + "; only stored (method 0) records are supported" +
                                at);
    }
    Zip64Fields z;
    UCP_RETURN_IF_ERROR(ParseZip64Extra(extra, size32 == 0xFFFFFFFF, comp32 == 0xFFFFFFFF,
                                        lho32 == 0xFFFFFFFF, z, e.name, file));
    UCP_ASSIGN_OR_RETURN(e.size,
                         AsOffset(size32 == 0xFFFFFFFF ? z.size : size32, "entry size", file));
    UCP_ASSIGN_OR_RETURN(int64_t comp, AsOffset(comp32 == 0xFFFFFFFF ? z.comp : comp32,
                                                "entry compressed size", file));
    UCP_ASSIGN_OR_RETURN(e.local_header_offset, AsOffset(lho32 == 0xFFFFFFFF ? z.lho : lho32,
                                                         "local header offset", file));
    if (comp != e.size) {
      return DataLossError("stored zip entry '" + e.name + "' has compressed size " + Num(comp) +
                           " but size " + Num(e.size) + at);
    }
    e.crc32 = crc;

    if (i == 0) {
      size_t slash = e.name.find('/');
      if (slash == std::string::npos) {
        return DataLossError("first zip entry '" + e.name + "' of " + file +
                             " is not inside a folder, so the archive has no prefix");
      }
      r.prefix_ = e.name.substr(0, slash);
    } else if (!e.name.starts_with(r.prefix_ + "/")) {
      return DataLossError("zip entry '" + e.name + "' of " + file +
                           " is outside the archive prefix '" + r.prefix_ + "/'");
    }
    if (!r.by_name_.emplace(e.name, r.entries_.size()).second) {
      return DataLossError("duplicate zip entry '" + e.name + "' in " + file);
    }
    r.entries_.push_back(std::move(e));
  }
  if (p != cd.size()) {
    return DataLossError("central directory of " + file + " has " + Num(cd.size() - p) +
                         " unexplained bytes after its " + Num(end.num_entries) + " entries");
  }

  // Local headers: same name as the directory, data inside the file and before the directory.
  for (ZipEntry& e : r.entries_) {
    if (e.local_header_offset > end.cd_offset - kLocalSize) {
      return DataLossError("local header of zip entry '" + e.name + "' at offset " +
                           Num(e.local_header_offset) + " is not before the central directory (" +
                           Num(end.cd_offset) + ") of " + file);
    }
    UCP_ASSIGN_OR_RETURN(std::string lh, src.ReadString(e.local_header_offset, kLocalSize));
    if (U32(lh, 0) != kLocalSig) {
      return DataLossError("no local header signature at offset " + Num(e.local_header_offset) +
                           " for zip entry '" + e.name + "' of " + file);
    }
    if (U16(lh, 8) != 0) {
      return DataLossError("local header of zip entry '" + e.name + "' of " + file +
                           " says method " + Num(U16(lh, 8)) + ", the directory says 0");
    }
    const int64_t lname = U16(lh, 26), lextra = U16(lh, 28);
    const int64_t name_at = e.local_header_offset + kLocalSize;
    if (lname != static_cast<int64_t>(e.name.size()) || name_at + lname > end.cd_offset) {
      return DataLossError("local header of zip entry '" + e.name + "' of " + file +
                           " has a name of " + Num(lname) + " bytes, the directory's has " +
                           Num(e.name.size()));
    }
    UCP_ASSIGN_OR_RETURN(std::string lname_bytes, src.ReadString(name_at, lname));
    if (lname_bytes != e.name) {
      return DataLossError("local header at offset " + Num(e.local_header_offset) + " of " + file +
                           " names '" + lname_bytes + "', the directory says '" + e.name + "'");
    }
    e.data_offset = name_at + lname + lextra;
    if (e.data_offset > end.cd_offset || e.size > end.cd_offset - e.data_offset) {
      return DataLossError("data of zip entry '" + e.name + "' (" + Num(e.size) +
                           " bytes at offset " + Num(e.data_offset) + ") of " + file +
                           " runs into the central directory at " + Num(end.cd_offset));
    }
  }
  // Records may not overlap: sorted by local header, each one's data ends before the next header.
  std::vector<const ZipEntry*> order;
  for (const ZipEntry& e : r.entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const ZipEntry* a, const ZipEntry* b) {
    return a->local_header_offset < b->local_header_offset;
  });
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    if (order[i]->data_offset + order[i]->size > order[i + 1]->local_header_offset) {
      return DataLossError("zip entries '" + order[i]->name + "' (data ends at " +
                           Num(order[i]->data_offset + order[i]->size) + ") and '" +
                           order[i + 1]->name + "' (header at " +
                           Num(order[i + 1]->local_header_offset) + ") overlap in " + file);
    }
  }
  return r;
}

const ZipEntry* ZipReader::Find(std::string_view record) const {
  std::string full = prefix_ + "/";
  full.append(record);
  auto it = by_name_.find(full);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

Result<std::string> ZipReader::ReadRecord(const ZipEntry& entry, int64_t max_bytes,
                                          bool verify_crc) const {
  if (entry.size > max_bytes) {
    return ResourceExhaustedError("zip record '" + entry.name + "' of " + source_->name() + " is " +
                                  Num(entry.size) + " bytes, over the limit of " + Num(max_bytes));
  }
  UCP_ASSIGN_OR_RETURN(std::string data, source_->ReadString(entry.data_offset, entry.size));
  // Every record is checked: a zeroed CRC field is not "not recorded" (issue 16 #7).
  if (verify_crc) {
    uint32_t got = Crc32(std::as_bytes(std::span<const char>(data.data(), data.size())));
    if (got != entry.crc32) {
      return DataLossError("crc32 mismatch in zip record '" + entry.name + "' of " +
                           source_->name() + ": directory says " + std::to_string(entry.crc32) +
                           ", data has " + std::to_string(got));
    }
  }
  return data;
}

}  // namespace ucp::torch
