// Reads the real torch 1.13 fixtures in tests/data/torch and compares every tensor and the listed
// values with expected.json (written by tools/make_torch_fixtures.py from the same objects).
#include "ucp/io/torch/torch_file.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "ucp/io/torch/byte_source.h"
#include "ucp/io/torch/testing/sha256.h"

namespace ucp::torch {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using json = nlohmann::json;

std::string FixtureDir() { return std::string(UCP_SOURCE_ROOT_DIR) + "/tests/data/torch"; }

json LoadExpected() {
  std::ifstream in(FixtureDir() + "/expected.json");
  EXPECT_TRUE(in.good()) << "missing " << FixtureDir() << "/expected.json";
  return json::parse(in);
}

// Tensors reachable through dicts, lists and tuples, in order, with their key paths.
void Walk(const PyValue& v, json path, std::vector<std::pair<json, const PyValue*>>& out,
          int depth = 0) {
  ASSERT_LT(depth, 100);
  switch (v.kind()) {
    case PyKind::kTensor:
      out.emplace_back(path, &v);
      break;
    case PyKind::kDict:
      for (const auto& [k, val] : v.entries()) {
        json p = path;
        if (k->kind() == PyKind::kStr)
          p.push_back(k->str());
        else if (k->kind() == PyKind::kInt)
          p.push_back(k->int_value());
        else
          continue;
        Walk(*val, p, out, depth + 1);
      }
      break;
    case PyKind::kList:
    case PyKind::kTuple:
      if (v.type_name() == "torch.Size") break;
      for (size_t i = 0; i < v.items().size(); ++i) {
        json p = path;
        p.push_back(i);
        Walk(*v.items()[i], p, out, depth + 1);
      }
      break;
    default:
      break;
  }
}

// Follows a path of dict keys, list indexes and "@state" (an object's BUILD state).
const PyValue* Resolve(const PyValue& root, const json& path) {
  const PyValue* v = &root;
  for (const json& step : path) {
    if (v == nullptr) return nullptr;
    if (step.is_string() && step.get<std::string>() == "@state") {
      v = v->state();
    } else if (step.is_string()) {
      v = v->Get(step.get<std::string>());
    } else if (v->kind() == PyKind::kDict) {
      v = v->Get(step.get<int64_t>());
    } else {
      size_t i = step.get<size_t>();
      v = i < v->items().size() ? v->items()[i] : nullptr;
    }
  }
  return v;
}

std::string Hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string h;
  for (unsigned char c : bytes) {
    h.push_back(d[c >> 4]);
    h.push_back(d[c & 15]);
  }
  return h;
}

void CheckValue(const PyValue& root, const json& e) {
  SCOPED_TRACE(e.dump());
  const PyValue* v = Resolve(root, e["path"]);
  ASSERT_NE(v, nullptr);
  const std::string kind = e["kind"];
  if (kind == "int") {
    ASSERT_EQ(v->kind(), PyKind::kInt);
    EXPECT_EQ(v->int_value(), e["value"].get<int64_t>());
  } else if (kind == "float") {
    ASSERT_EQ(v->kind(), PyKind::kFloat);
    EXPECT_EQ(v->float_value(), e["value"].get<double>());
  } else if (kind == "str") {
    ASSERT_EQ(v->kind(), PyKind::kStr);
    EXPECT_EQ(v->str(), e["value"].get<std::string>());
  } else if (kind == "none") {
    EXPECT_TRUE(v->is_none());
  } else if (kind == "global") {
    ASSERT_EQ(v->kind(), PyKind::kGlobal);
    EXPECT_EQ(v->str(), e["value"].get<std::string>());
  } else if (kind == "bigint") {
    ASSERT_EQ(v->kind(), PyKind::kBigInt);
    EXPECT_EQ(Hex(v->str()), e["value"].get<std::string>());
  } else if (kind == "bytes") {
    ASSERT_EQ(v->kind(), PyKind::kBytes);
    EXPECT_EQ(Hex(v->str()), e["value"].get<std::string>());
  } else if (kind == "set") {
    ASSERT_EQ(v->kind(), PyKind::kSet);
    EXPECT_EQ(v->items().size(), e["value"].get<size_t>());
  } else if (kind == "list") {
    ASSERT_EQ(v->kind(), PyKind::kList);
    EXPECT_EQ(v->items().size(), e["value"].get<size_t>());
  } else if (kind == "object") {
    ASSERT_EQ(v->kind(), PyKind::kObject);
    EXPECT_EQ(v->class_name(), e["value"].get<std::string>());
  } else if (kind == "torch.Size") {
    ASSERT_EQ(v->kind(), PyKind::kTuple);
    EXPECT_EQ(v->type_name(), "torch.Size");
    std::vector<int64_t> dims;
    for (const PyValue* d : v->items()) dims.push_back(d->int_value());
    EXPECT_EQ(dims, e["value"].get<std::vector<int64_t>>());
  } else {
    FAIL() << "unknown kind " << kind;
  }
}

TEST(TorchFileFixtures, EveryTensorAndValueMatchesExpectedJson) {
  json expected = LoadExpected();
  ASSERT_GE(expected["files"].size(), 6u);
  for (const auto& [name, spec] : expected["files"].items()) {
    SCOPED_TRACE(name);
    UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, TorchFile::Open(FixtureDir() + "/" + name));
    EXPECT_EQ(f.format(), spec["format"] == "legacy" ? TorchFormat::kLegacy : TorchFormat::kZip);
    std::vector<std::pair<json, const PyValue*>> found;
    Walk(f.root(), json::array(), found);
    const json& tensors = spec["tensors"];
    ASSERT_EQ(found.size(), tensors.size());
    for (size_t i = 0; i < found.size(); ++i) {
      const json& t = tensors[i];
      SCOPED_TRACE(t["path"].dump());
      EXPECT_EQ(found[i].first, t["path"]);
      const TensorRef& ref = found[i].second->tensor();
      EXPECT_EQ(DTypeName(ref.dtype), t["dtype"].get<std::string>());
      EXPECT_EQ(ref.size, t["shape"].get<std::vector<int64_t>>());
      EXPECT_EQ(ref.stride, t["stride"].get<std::vector<int64_t>>());
      EXPECT_EQ(ref.storage_offset, t["storage_offset"].get<int64_t>());
      EXPECT_EQ(ref.requires_grad, t["requires_grad"].get<bool>());
      EXPECT_EQ(ref.is_parameter, t["is_parameter"].get<bool>());
      UCP_ASSERT_OK_AND_ASSIGN(Tensor data, f.ReadTensor(ref));
      EXPECT_EQ(testing::Sha256Hex(std::span<const std::byte>(data.data(), data.num_bytes())),
                t["sha256"].get<std::string>());
    }
    for (const json& v : spec["values"]) CheckValue(f.root(), v);
  }
}

TEST(TorchFileFixtures, SharedStorageViewsPointAtOneRecord) {
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, TorchFile::Open(FixtureDir() + "/model_state_dict.pt"));
  const PyValue* w = f.root().Get("fc.weight");
  const PyValue* wt = f.root().Get("fc.weight_T");
  ASSERT_NE(w, nullptr);
  ASSERT_NE(wt, nullptr);
  EXPECT_EQ(w->tensor().storage.key, wt->tensor().storage.key);
  UCP_ASSERT_OK_AND_ASSIGN(Tensor a, f.ReadTensor(w->tensor()));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor b, f.ReadTensor(wt->tensor()));
  // b is the transpose of a: b[j][i] == a[i][j], bitwise.
  auto av = a.as<uint32_t>();
  auto bv = b.as<uint32_t>();
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 5; ++j) EXPECT_EQ(av[i * 5 + j], bv[j * 3 + i]);
  }
  // The OrderedDict's BUILD state is state_dict's _metadata.
  ASSERT_NE(f.root().state(), nullptr);
  EXPECT_NE(f.root().state()->Get("_metadata"), nullptr);
  EXPECT_EQ(f.root().type_name(), "collections.OrderedDict");
}

TEST(TorchFileFixtures, ReadTensorBytesReadsAPieceOfAFlatPartition) {
  UCP_ASSERT_OK_AND_ASSIGN(
      TorchFile f, TorchFile::Open(FixtureDir() + "/zero_pp_rank_0_mp_rank_00_optim_states.pt"));
  UCP_ASSERT_OK_AND_ASSIGN(const PyValue* osd, f.root().Find("optimizer_state_dict", "root"));
  UCP_ASSERT_OK_AND_ASSIGN(const PyValue* groups,
                           osd->Find("single_partition_of_fp32_groups", "optimizer_state_dict"));
  ASSERT_EQ(groups->items().size(), 1u);
  const TensorRef& flat = groups->items()[0]->tensor();
  EXPECT_EQ(flat.size, (Shape{52}));
  EXPECT_EQ(flat.storage.numel, 56);  // the view hides the padding its storage still holds
  UCP_ASSERT_OK_AND_ASSIGN(Tensor whole, f.ReadTensor(flat));
  std::vector<std::byte> piece(16 * 4);
  UCP_ASSERT_OK(f.ReadTensorBytes(flat, 32 * 4, piece));
  EXPECT_EQ(std::memcmp(piece.data(), whole.data() + 32 * 4, piece.size()), 0);
  EXPECT_THAT(f.ReadTensorBytes(flat, 40 * 4, piece),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("outside the 208 bytes")));
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile sd, TorchFile::Open(FixtureDir() + "/model_state_dict.pt"));
  const PyValue* col = sd.root().Get("big_col_1");
  ASSERT_NE(col, nullptr);
  EXPECT_THAT(sd.ReadTensorBytes(col->tensor(), 0, std::span<std::byte>(piece.data(), 4)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("not contiguous")));
}

TEST(TorchFileFixtures, StrictModeRefusesInertClassesButReadsStateDicts) {
  TorchReadOptions strict;
  strict.pickle.strict_globals = true;
  UCP_EXPECT_OK(TorchFile::Open(FixtureDir() + "/model_state_dict.pt", strict).status());
  UCP_EXPECT_OK(TorchFile::Open(FixtureDir() + "/model_state_dict_legacy.pt", strict).status());
  UCP_EXPECT_OK(TorchFile::Open(FixtureDir() + "/adamw_optimizer.pt", strict).status());
  EXPECT_THAT(TorchFile::Open(FixtureDir() + "/mp_rank_00_model_states.pt", strict),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("global 'argparse.Namespace' is not in the allowlist")));
  EXPECT_THAT(TorchFile::Open(FixtureDir() + "/zero_pp_rank_0_mp_rank_00_optim_states.pt", strict),
              StatusIs(StatusCode::kDataLoss, HasSubstr("deepspeed.runtime.fp16.loss_scaler")));
}

// Whole records of a real torch file pass; a record whose bytes changed fails, naming it, while
// a legacy file (no CRCs) has nothing to check.
TEST(TorchFileFixtures, VerifyStorageCrc32StreamsEachRecord) {
  const std::string path = FixtureDir() + "/zero_pp_rank_0_mp_rank_00_optim_states.pt";
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, TorchFile::Open(path));
  ASSERT_FALSE(f.storages().empty());
  for (const StorageRecord& r : f.storages()) UCP_EXPECT_OK(f.VerifyStorageCrc32(r));
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const StorageRecord& last = f.storages().back();
  bytes[static_cast<size_t>(last.data_offset)] ^= 0x01;
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile bad,
                           TorchFile::OpenBuffer(std::as_bytes(std::span(bytes)), {}, "bad.pt"));
  EXPECT_THAT(bad.VerifyStorageCrc32(bad.storages().back()),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("crc32 mismatch in record 'data/" + last.key + "' of bad.pt")));
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile legacy,
                           TorchFile::Open(FixtureDir() + "/model_state_dict_legacy.pt"));
  for (const StorageRecord& r : legacy.storages()) UCP_EXPECT_OK(legacy.VerifyStorageCrc32(r));
}

// The slicing-by-8 CRC equals the byte-at-a-time reference for every length and alignment, and
// both give the CRC-32/ISO-HDLC check value.
TEST(Crc32, SlicedEqualsReference) {
  const std::string check = "123456789";
  EXPECT_EQ(Crc32(std::as_bytes(std::span(check))), 0xCBF43926u);
  EXPECT_EQ(Crc32Reference(std::as_bytes(std::span(check))), 0xCBF43926u);
  std::vector<std::byte> buf(300);
  uint32_t x = 12345;
  for (std::byte& b : buf) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 24);
  }
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; start + n <= buf.size(); n += 13) {
      const auto piece = std::span<const std::byte>(buf).subspan(start, n);
      ASSERT_EQ(Crc32(piece, 0x1234u), Crc32Reference(piece, 0x1234u)) << start << " " << n;
    }
  }
  // Continuing a CRC over two pieces equals the CRC of the whole.
  const auto all = std::span<const std::byte>(buf);
  EXPECT_EQ(Crc32(all.subspan(100), Crc32(all.first(100))), Crc32(all));
}

// The carry-less multiplication path (x86-64 with PCLMULQDQ: 64 bytes and more, in 16-byte
// blocks) equals the reference across its block boundaries and on a large buffer.
TEST(Crc32, FoldedEqualsReference) {
  std::vector<std::byte> buf((1 << 20) + 77);
  uint32_t x = 777;
  for (std::byte& b : buf) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 24);
  }
  const auto all = std::span<const std::byte>(buf);
  for (size_t n : {63, 64, 65, 79, 80, 127, 128, 129, 143, 144, 191, 192, 255, 256, 1000, 4113}) {
    for (size_t start : {0, 1, 7, 15}) {
      const auto piece = all.subspan(start, n);
      ASSERT_EQ(Crc32(piece, 0xdeadbeefu), Crc32Reference(piece, 0xdeadbeefu)) << start << " " << n;
    }
  }
  EXPECT_EQ(Crc32(all), Crc32Reference(all));
}

// Combining the CRCs of two pieces equals the CRC of their concatenation, for every split of a
// buffer (including empty pieces), and over many pieces in order, as the streamed writers use it.
TEST(Crc32, CombineEqualsCrcOfConcatenation) {
  std::vector<std::byte> buf(1000);
  uint32_t x = 777;
  for (std::byte& b : buf) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 24);
  }
  const auto all = std::span<const std::byte>(buf);
  for (size_t split = 0; split <= all.size(); split += 7) {
    const auto a = all.first(split), b = all.subspan(split);
    ASSERT_EQ(Crc32Combine(Crc32(a), Crc32(b), static_cast<int64_t>(b.size())), Crc32(all))
        << "split at " << split;
  }
  uint32_t crc = 0;
  for (size_t at = 0; at < all.size(); at += 37) {
    const auto piece = all.subspan(at, std::min<size_t>(37, all.size() - at));
    crc = Crc32Combine(crc, Crc32(piece), static_cast<int64_t>(piece.size()));
  }
  EXPECT_EQ(crc, Crc32(all));
  // Long runs: the CRC of 2^k zero bytes by repeated doubling (a run combined with itself)
  // equals the direct CRC at 4 KiB, and two doubling chains that start at different lengths
  // agree at 1 TiB, where the large powers x^(2^k) of the combine are used.
  const std::vector<std::byte> zeros(4096, std::byte{0});
  auto doubled = [](uint32_t run, int64_t len, int64_t to) {
    for (; len < to; len *= 2) run = Crc32Combine(run, run, len);
    return run;
  };
  const uint32_t one_zero = Crc32(std::span<const std::byte>(zeros).first(1));
  EXPECT_EQ(doubled(one_zero, 1, 4096), Crc32(zeros));
  EXPECT_EQ(doubled(one_zero, 1, int64_t{1} << 40), doubled(Crc32(zeros), 4096, int64_t{1} << 40));
}

TEST(TorchFileFixtures, MissingFileIsNotFound) {
  EXPECT_THAT(TorchFile::Open(FixtureDir() + "/no_such.pt"),
              StatusIs(StatusCode::kNotFound, HasSubstr("no_such.pt")));
}

}  // namespace
}  // namespace ucp::torch
