// Issue 14, "one read of the source": a verified conversion checks the source's checksums from
// the bytes it reads anyway. ReadVerifier's bookkeeping (pieces in any order, overlaps, the
// final pass over only the unread ranges), and the count of bytes an extraction of a DeepSpeed
// checkpoint reads from its files: about the files' size, not twice the tensor bytes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/api/checkpoint.h"
#include "ucp/io/checksum.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/read_verifier.h"
#include "ucp/io/torch/byte_source.h"
#include "ucp/io/torch/torch_file.h"

namespace ucp {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

uint64_t CrcPiece(std::span<const std::byte> b, uint64_t seed) {
  return torch::Crc32(b, static_cast<uint32_t>(seed));
}
uint64_t CrcCombine(uint64_t a, uint64_t b, int64_t n) {
  return torch::Crc32Combine(static_cast<uint32_t>(a), static_cast<uint32_t>(b), n);
}
constexpr io::ReadVerifier::Combinable kCrc{&CrcPiece, &CrcCombine};

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

// A record over `data` whose Reader counts what it is asked for.
struct Backing {
  std::vector<std::byte> data;
  int64_t asked = 0;
  io::ReadVerifier::Reader Reader() {
    return [this](int64_t offset, std::span<std::byte> out) {
      std::memcpy(out.data(), data.data() + offset, out.size());
      asked += static_cast<int64_t>(out.size());
      return Status::Ok();
    };
  }
};

std::span<const std::byte> Piece(const std::vector<std::byte>& v, int64_t a, int64_t b) {
  return std::span<const std::byte>(v).subspan(static_cast<size_t>(a), static_cast<size_t>(b - a));
}

TEST(ReadVerifier, CrcPiecesInAnyOrderFromThreadsCompleteTheRecord) {
  Backing b{RandomBytes(1 << 20, 1)};
  const uint32_t crc = torch::Crc32(b.data);
  io::ReadVerifier v;
  const int32_t r =
      v.AddCombinable(static_cast<int64_t>(b.data.size()), crc, kCrc, "bad", b.Reader());
  // 256 pieces of 4 KiB, shuffled, from 4 threads.
  std::vector<int64_t> order(256);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  std::vector<std::thread> threads;
  std::vector<Status> status(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t k = static_cast<size_t>(t); k < order.size(); k += 4) {
        const int64_t a = order[k] * 4096;
        Status s = v.Observe(r, a, Piece(b.data, a, a + 4096));
        if (!s.ok()) status[static_cast<size_t>(t)] = s;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const Status& s : status) UCP_EXPECT_OK(s);
  EXPECT_EQ(v.bytes_pending(), 0);
  UCP_EXPECT_OK(v.Finish(r));
  EXPECT_EQ(b.asked, 0) << "every byte was observed: the final pass reads nothing";
  EXPECT_EQ(v.bytes_observed(), static_cast<int64_t>(b.data.size()));
}

TEST(ReadVerifier, OverlapsAreHashedOnceAndGapsAreReadAtFinish) {
  Backing b{RandomBytes(10000, 2)};
  io::ReadVerifier v;
  const int32_t r = v.AddCombinable(10000, torch::Crc32(b.data), kCrc, "bad", b.Reader());
  UCP_ASSERT_OK(v.Observe(r, 1000, Piece(b.data, 1000, 3000)));
  UCP_ASSERT_OK(v.Observe(r, 2000, Piece(b.data, 2000, 5000)));  // overlaps [2000, 3000)
  UCP_ASSERT_OK(v.Observe(r, 1000, Piece(b.data, 1000, 3000)));  // read twice
  UCP_ASSERT_OK(v.Observe(r, 7000, Piece(b.data, 7000, 8000)));
  EXPECT_EQ(v.bytes_observed(), 5000);
  EXPECT_EQ(v.bytes_pending(), 5000);  // [0, 1000), [5000, 7000), [8000, 10000)
  UCP_EXPECT_OK(v.Finish(r));
  EXPECT_EQ(b.asked, 5000);
  EXPECT_EQ(v.bytes_reread(), 5000);
}

TEST(ReadVerifier, TheReadThatCompletesACorruptRecordFails) {
  Backing b{RandomBytes(8192, 3)};
  const uint32_t crc = torch::Crc32(b.data);
  b.data[5000] ^= std::byte{0x01};
  io::ReadVerifier v;
  const int32_t r =
      v.AddCombinable(8192, crc, kCrc, "crc32 mismatch in record 'data/3' of f.pt", b.Reader());
  UCP_ASSERT_OK(v.Observe(r, 4096, Piece(b.data, 4096, 8192)));
  EXPECT_THAT(v.Observe(r, 0, Piece(b.data, 0, 4096)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("record 'data/3' of f.pt")));
  EXPECT_THAT(v.FirstFailure(), StatusIs(StatusCode::kDataLoss, HasSubstr("data/3")));
  EXPECT_THAT(v.Finish(r), StatusIs(StatusCode::kDataLoss, HasSubstr("data/3")));
  EXPECT_EQ(b.asked, 0);
}

TEST(ReadVerifier, AnUnreadCorruptByteFailsAtFinish) {
  Backing b{RandomBytes(8192, 4)};
  const uint32_t crc = torch::Crc32(b.data);
  b.data[8191] ^= std::byte{0x80};  // "padding": never read by the conversion
  io::ReadVerifier v;
  const int32_t r = v.AddCombinable(8192, crc, kCrc, "crc32 mismatch", b.Reader());
  UCP_ASSERT_OK(v.Observe(r, 0, Piece(b.data, 0, 8000)));
  EXPECT_THAT(v.Finish(r), StatusIs(StatusCode::kDataLoss, HasSubstr("crc32 mismatch")));
  EXPECT_EQ(b.asked, 192);
}

TEST(ReadVerifier, Xxh3HashesInOrderAndRereadsWhatCameOutOfOrder) {
  Backing b{RandomBytes(9000, 5)};
  const uint64_t h = io::Xxh3_64(b.data);
  io::ReadVerifier v;
  const int32_t r = v.AddXxh3(9000, h, "checksum mismatch", b.Reader());
  UCP_ASSERT_OK(v.Observe(r, 0, Piece(b.data, 0, 3000)));
  UCP_ASSERT_OK(v.Observe(r, 2000, Piece(b.data, 2000, 4000)));  // continues from 3000
  UCP_ASSERT_OK(v.Observe(r, 6000, Piece(b.data, 6000, 7000)));  // ahead: left for Finish
  EXPECT_EQ(v.bytes_observed(), 4000);
  UCP_EXPECT_OK(v.Finish(r));
  EXPECT_EQ(b.asked, 5000);
  // In order to the end: compared at the last byte, nothing left for Finish.
  io::ReadVerifier w;
  b.data[10] ^= std::byte{1};
  const int32_t q = w.AddXxh3(9000, h, "checksum mismatch in dataset x", b.Reader());
  UCP_ASSERT_OK(w.Observe(q, 0, Piece(b.data, 0, 4500)));
  EXPECT_THAT(w.Observe(q, 4500, Piece(b.data, 4500, 9000)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("dataset x")));
}

TEST(ReadVerifier, EmptyRecordsAndRangesOutsideTheRecord) {
  Backing b;
  io::ReadVerifier v;
  const int32_t r = v.AddCombinable(0, 0, kCrc, "bad", b.Reader());
  UCP_EXPECT_OK(v.Finish(r));
  const int32_t q = v.AddCombinable(0, 1, kCrc, "bad empty", b.Reader());
  EXPECT_THAT(v.Finish(q), StatusIs(StatusCode::kDataLoss, HasSubstr("bad empty")));
  std::vector<std::byte> two(2);
  EXPECT_THAT(v.Observe(r, 0, two), StatusIs(StatusCode::kOutOfRange, HasSubstr("outside")));
}

// The instrumentation of issue 14: an extraction with checksums verified reads each tensor
// byte of the source once. Before, a checksum pass over every tensor record (what
// VerifyChecksums reads, R bytes) came first and the conversion then read the tensors again:
// checksums cost R extra bytes. Now they cost only the bytes no read of the plan returned
// (padding, records the view does not read), and every checksummed byte is still read.
// (The plan itself reads a few ranges twice: a tied embedding shared by two pipeline stages,
// ZeRO-3's fp32 partitions for both the fp32 and the rounded model state.)
TEST(OneRead, DeepSpeedExtractReadsTheSourceOnce) {
  for (const char* name :
       {"megatron_tp2_pp1_dp2_bf16", "megatron_tp2_pp2_sp2_fp16_zero1",
        "megatron_llama_tp2_pp2_dp2_bf16", "megatron_llama_zero3_tp2_dp3_bf16"}) {
    ucp::testing::TempDir tmp;
    const fs::path src_dir = fs::path(UCP_SOURCE_ROOT_DIR) / "tests/data/deepspeed" / name;
    UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(src_dir, api::UcpDataDir()));
    int64_t before = io::SourceBytesRead();
    UCP_ASSERT_OK(src->VerifyChecksums());
    const int64_t records = io::SourceBytesRead() - before;
    api::RunOptions skip;
    skip.verify_source_checksums = false;
    before = io::SourceBytesRead();
    UCP_ASSERT_OK_AND_ASSIGN(exec::ExecStats unverified, api::Extract(*src, tmp / "plain", skip));
    const int64_t plan = io::SourceBytesRead() - before;
    before = io::SourceBytesRead();
    UCP_ASSERT_OK_AND_ASSIGN(exec::ExecStats verified, api::Extract(*src, tmp / "out", {}));
    const int64_t read = io::SourceBytesRead() - before;
    const int64_t extra = read - plan;
    std::printf(
        "%s: checksum pass %lld bytes; extract %lld unverified, %lld verified: "
        "checksums cost %lld bytes (%.1f%% of the pass)\n",
        name, static_cast<long long>(records), static_cast<long long>(plan),
        static_cast<long long>(read), static_cast<long long>(extra),
        100.0 * static_cast<double>(extra) / static_cast<double>(records));
    EXPECT_GE(read, records) << name << ": every checksummed byte is read";
    EXPECT_EQ(extra, src->verify_bytes_reread()) << name;
    EXPECT_LT(extra, records / 4) << name << ": the tensors were read twice";
    // The run's count (`--json` "bytes_read") includes the bytes read for checksums only.
    EXPECT_EQ(verified.bytes_read - unverified.bytes_read, extra) << name;
  }
}

// The same for a ucp universal source, whose datasets' XXH3 is hashed in element order from
// the conversion's reads (a reshard reads each state's rows in order, window by window).
TEST(OneRead, UniversalReshardReadsTheSourceOnce) {
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto m, api::LoadResolvedModel(api::UcpDataDir(), "gpt-tiny", ""));
  UCP_ASSERT_OK(
      api::Generate(m.first, m.second, layout::UniversalLayout(), 1, tmp / "u", {}).status());
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout to, layout::ParseLayout("tp=2,pp=2,dp=1"));
  for (const char* order : {"skip first", "verify first"}) {
    UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(tmp / "u", api::UcpDataDir()));
    int64_t before = io::SourceBytesRead();
    UCP_ASSERT_OK(src->VerifyChecksums());
    const int64_t records = io::SourceBytesRead() - before;
    api::RunOptions skip;
    skip.verify_source_checksums = false;
    int64_t plan = 0, read = 0;
    for (bool verify : {order[0] == 'v', order[0] != 'v'}) {
      const fs::path dst = tmp / (std::string(order) + (verify ? " v" : " s"));
      before = io::SourceBytesRead();
      UCP_ASSERT_OK(api::ToLayout(*src, to, dst, verify ? api::RunOptions{} : skip).status());
      (verify ? read : plan) = io::SourceBytesRead() - before;
    }
    std::printf("universal (%s): checksum pass %lld bytes; reshard %lld unverified, %lld "
                "verified\n",
                order, static_cast<long long>(records), static_cast<long long>(plan),
                static_cast<long long>(read));
    EXPECT_GE(read, plan);
    EXPECT_LT(read - plan, records / 4) << "the states were read twice";
  }
}

// A ucp distributed source at ZeRO-1: tensors hashed in element order too; the ZeRO partitions
// are read partly out of order (several targets' pieces of one flat partition), and only those
// bytes are read again, so checksums cost less than the pass they replace.
TEST(OneRead, DistributedExtractReadsLessThanTwice) {
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto m, api::LoadResolvedModel(api::UcpDataDir(), "gpt-tiny", ""));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout from, layout::ParseLayout("tp=2,pp=2,dp=2,zero=1"));
  UCP_ASSERT_OK(api::Generate(m.first, m.second, from, 1, tmp / "d", {}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(tmp / "d", api::UcpDataDir()));
  int64_t before = io::SourceBytesRead();
  UCP_ASSERT_OK(src->VerifyChecksums());
  const int64_t records = io::SourceBytesRead() - before;
  api::RunOptions skip;
  skip.verify_source_checksums = false;
  before = io::SourceBytesRead();
  UCP_ASSERT_OK(api::Extract(*src, tmp / "a", skip).status());
  const int64_t plan = io::SourceBytesRead() - before;
  before = io::SourceBytesRead();
  UCP_ASSERT_OK(api::Extract(*src, tmp / "b", {}).status());
  const int64_t read = io::SourceBytesRead() - before;
  std::printf("distributed: checksum pass %lld bytes; extract %lld unverified, %lld verified\n",
              static_cast<long long>(records), static_cast<long long>(plan),
              static_cast<long long>(read));
  EXPECT_EQ(read - plan, src->verify_bytes_reread());
  EXPECT_LT(read - plan, records * 3 / 4);
}

}  // namespace
}  // namespace ucp
