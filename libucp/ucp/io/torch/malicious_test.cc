// The malicious and corrupt input catalogue: pickles built byte by byte that ask for forbidden
// globals or break the machine's bounds, zip archives with escaping, duplicate, overlapping or
// out-of-file records, and every truncation of real files. Each must fail with its code and a
// message naming the fault; none may crash.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/unpickler.h"
#include "ucp/io/torch/zip_writer.h"

namespace ucp::torch {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using namespace std::string_literals;  // "..."s keeps embedded NUL bytes

// --- pickle bytes ---------------------------------------------------------------------------

std::string LE32(uint32_t v) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}
std::string PStr(const std::string& s) { return "X" + LE32(static_cast<uint32_t>(s.size())) + s; }
std::string PInt(int64_t v) {
  if (v >= 0 && v < 256) return std::string("K") + static_cast<char>(v);
  if (v >= INT32_MIN && v <= INT32_MAX) return "J" + LE32(static_cast<uint32_t>(v));
  std::string s = "\x8a\x08";
  for (int i = 0; i < 8; ++i)
    s.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xFF));
  return s;
}
std::string PTuple(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (int64_t x : v) s += PInt(x);
  return s + "t";
}
const std::string kProto2 = "\x80\x02";

// _rebuild_tensor_v2 over ('storage', torch.FloatStorage, '0', 'cpu', numel).
std::string TensorPickle(int64_t numel, int64_t offset, const std::vector<int64_t>& size,
                         const std::vector<int64_t>& stride) {
  return kProto2 + "ctorch._utils\n_rebuild_tensor_v2\n(" + "(" + PStr("storage") +
         "ctorch\nFloatStorage\n" + PStr("0") + PStr("cpu") + PInt(numel) + "tQ" + PInt(offset) +
         PTuple(size) + PTuple(stride) + "\x89" + "ccollections\nOrderedDict\n)R" + "tR.";
}

Result<UnpickleResult> RunPickle(const std::string& bytes, PyArena& arena,
                                 PickleOptions opts = {}) {
  auto src = ByteSource::FromBuffer(
      std::as_bytes(std::span<const char>(bytes.data(), bytes.size())), "test.pkl");
  return Unpickle(*src, 0, src->size(), arena, opts, nullptr, "test.pkl");
}
Result<UnpickleResult> RunPickle(const std::string& bytes, PickleOptions opts = {}) {
  static PyArena arena;
  return RunPickle(bytes, arena, opts);
}

// --- zip bytes --------------------------------------------------------------------------------

struct RawEntry {
  std::string name;
  std::string data;
  int64_t cd_size = -1;  // size the central directory claims (default: the real size)
  int64_t lho = -1;      // local header offset the central directory claims
};

// Every record's CRC is checked, so the handcrafted archives carry real ones.
uint32_t RawCrc(const std::string& data) {
  return Crc32(std::as_bytes(std::span<const char>(data.data(), data.size())));
}
void Put16(std::string& s, uint16_t v) {
  s.push_back(static_cast<char>(v & 0xFF));
  s.push_back(static_cast<char>(v >> 8));
}
void Put32(std::string& s, uint32_t v) { s += LE32(v); }

// A plain (non-zip64) archive with stored entries and CRC 0 ("not recorded").
std::string RawZip(const std::vector<RawEntry>& entries, int64_t cd_offset = -1,
                   int64_t count = -1) {
  std::string z;
  std::vector<uint32_t> offsets;
  for (const RawEntry& e : entries) {
    offsets.push_back(static_cast<uint32_t>(z.size()));
    Put32(z, 0x04034b50);
    Put16(z, 20);
    Put16(z, 0);
    Put16(z, 0);
    Put32(z, 0);
    Put32(z, RawCrc(e.data));
    Put32(z, static_cast<uint32_t>(e.data.size()));
    Put32(z, static_cast<uint32_t>(e.data.size()));
    Put16(z, static_cast<uint16_t>(e.name.size()));
    Put16(z, 0);
    z += e.name + e.data;
  }
  const uint32_t cd_start = static_cast<uint32_t>(z.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const RawEntry& e = entries[i];
    const uint32_t size = static_cast<uint32_t>(e.cd_size >= 0 ? e.cd_size : e.data.size());
    Put32(z, 0x02014b50);
    Put16(z, 20);
    Put16(z, 20);
    Put16(z, 0);
    Put16(z, 0);
    Put32(z, 0);
    Put32(z, RawCrc(e.data));
    Put32(z, size);
    Put32(z, size);
    Put16(z, static_cast<uint16_t>(e.name.size()));
    Put16(z, 0);
    Put16(z, 0);
    Put16(z, 0);
    Put16(z, 0);
    Put32(z, 0);
    Put32(z, e.lho >= 0 ? static_cast<uint32_t>(e.lho) : offsets[i]);
    z += e.name;
  }
  const uint32_t cd_size = static_cast<uint32_t>(z.size()) - cd_start;
  Put32(z, 0x06054b50);
  Put16(z, 0);
  Put16(z, 0);
  const uint16_t n = static_cast<uint16_t>(count >= 0 ? count : entries.size());
  Put16(z, n);
  Put16(z, n);
  Put32(z, cd_size);
  Put32(z, cd_offset >= 0 ? static_cast<uint32_t>(cd_offset) : cd_start);
  Put16(z, 0);
  return z;
}

Result<TorchFile> OpenBytes(const std::string& bytes, TorchReadOptions opts = {}) {
  return TorchFile::OpenBuffer(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())),
                               opts, "evil.pt");
}

std::string TorchZip(const std::string& pickle, const std::string& storage0) {
  return RawZip(
      {{"archive/data.pkl", pickle}, {"archive/data/0", storage0}, {"archive/version", "3\n"}});
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
std::string Fixture(const std::string& name) {
  return ReadFile(std::string(UCP_SOURCE_ROOT_DIR) + "/tests/data/torch/" + name);
}

// --- forbidden globals --------------------------------------------------------------------

TEST(MaliciousPickle, OsSystemThroughGlobal) {
  EXPECT_THAT(
      RunPickle(kProto2 + "cos\nsystem\n" + PStr("touch /tmp/pwned") + "\x85R."),
      StatusIs(StatusCode::kDataLoss, AllOf(HasSubstr("global 'os.system' is not in the allowlist"),
                                            HasSubstr("opcode GLOBAL at offset 2"))));
}

TEST(MaliciousPickle, OsSystemThroughStackGlobal) {
  const std::string p = "\x80\x04\x8c\x02os\x8c\x06system\x93" + PStr("id") + "\x85R.";
  EXPECT_THAT(RunPickle(p), StatusIs(StatusCode::kDataLoss,
                                     AllOf(HasSubstr("'os.system'"), HasSubstr("STACK_GLOBAL"))));
}

TEST(MaliciousPickle, EveryDangerousCallableIsRefusedByName) {
  for (const auto& [module, name, shown] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"__builtin__", "eval", "builtins.eval"},
           {"builtins", "exec", "builtins.exec"},
           {"__builtin__", "__import__", "builtins.__import__"},
           {"posix", "system", "posix.system"},
           {"nt", "system", "nt.system"},
           {"subprocess", "Popen", "subprocess.Popen"},
           {"sys", "modules", "sys.modules"},
           {"torch", "load", "torch.load"},
           {"torch.serialization", "load", "torch.serialization.load"},
           {"pickle", "loads", "pickle.loads"},
           {"collections", "namedtuple", "collections.namedtuple"},
           {"numpy", "load", "numpy.load"}}) {
    SCOPED_TRACE(shown);
    for (bool strict : {false, true}) {
      PickleOptions o;
      o.strict_globals = strict;
      EXPECT_THAT(RunPickle(kProto2 + "c" + module + "\n" + name + "\n" + PStr("x") + "\x85R.", o),
                  StatusIs(StatusCode::kDataLoss, HasSubstr("'" + shown + "'")));
    }
  }
}

TEST(MaliciousPickle, GetattrOnlyOnInertClasses) {
  EXPECT_THAT(
      RunPickle(kProto2 + "c__builtin__\ngetattr\nctorch\nSize\n" + PStr("__new__") + "\x86R."),
      StatusIs(StatusCode::kDataLoss,
               HasSubstr("getattr on 'torch.Size' is not allowed (not an inert class)")));
  EXPECT_THAT(RunPickle(kProto2 + "c__builtin__\ngetattr\nccollections\nOrderedDict\n" +
                        PStr("fromkeys") + "\x86R."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("getattr on 'collections.OrderedDict'")));
  // The allowed case makes an inert object naming the enum class, and runs nothing.
  PyArena arena;
  UCP_ASSERT_OK_AND_ASSIGN(
      UnpickleResult r,
      RunPickle(kProto2 + "c__builtin__\ngetattr\ncmegatron.core.enums\nModelType\n" +
                    PStr("encoder_or_decoder") + "\x86R.",
                arena));
  EXPECT_EQ(r.value->kind(), PyKind::kObject);
  EXPECT_EQ(r.value->class_name(), "megatron.core.enums.ModelType");
  EXPECT_EQ(r.value->items()[1]->str(), "encoder_or_decoder");
}

TEST(MaliciousPickle, StrictModeRefusesInertClasses) {
  PickleOptions strict;
  strict.strict_globals = true;
  const std::string p = kProto2 + "cargparse\nNamespace\n)\x81}b.";
  EXPECT_THAT(
      RunPickle(p, strict),
      StatusIs(StatusCode::kDataLoss, HasSubstr("'argparse.Namespace' is not in the allowlist "
                                                "(strict mode)")));
  PyArena arena;
  UCP_ASSERT_OK_AND_ASSIGN(UnpickleResult r, RunPickle(p, arena));
  EXPECT_EQ(r.value->class_name(), "argparse.Namespace");
  EXPECT_TRUE(r.value->is_newobj());
}

TEST(MaliciousPickle, CallingNonCallablesIsRefused) {
  EXPECT_THAT(RunPickle(kProto2 + "ctorch\nfloat16\n)R."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("calling 'torch.float16' is not allowed")));
  EXPECT_THAT(RunPickle(kProto2 + "c__builtin__\nset\n)\x81."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("cannot construct 'builtins.set'")));
  EXPECT_THAT(RunPickle(kProto2 + "]" + PStr("x") + "\x85R."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("cannot call a list")));
  EXPECT_THAT(
      RunPickle(kProto2 + "c_codecs\nencode\n" + PStr("\xe4\xb8\x96") + PStr("latin1") + "\x86R."),
      StatusIs(StatusCode::kDataLoss, HasSubstr("code point above 255")));
  EXPECT_THAT(RunPickle(kProto2 + "c_codecs\nencode\n" + PStr("x") + PStr("rot13") + "\x86R."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("encode(str, 'latin1')")));
}

// --- structural faults ----------------------------------------------------------------------

TEST(MaliciousPickle, StructuralFaultsNameOpcodeAndOffset) {
  EXPECT_THAT(RunPickle(kProto2 + "R."),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("REDUCE at offset 2"), HasSubstr("stack underflow"))));
  EXPECT_THAT(RunPickle(kProto2 + "\xff."),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("0xff at offset 2"), HasSubstr("not a pickle opcode"))));
  EXPECT_THAT(RunPickle(kProto2 + "NN."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("STOP with 2 values")));
  EXPECT_THAT(RunPickle(kProto2 + "N"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("without a STOP")));
  EXPECT_THAT(RunPickle(kProto2 + "Nt."), StatusIs(StatusCode::kDataLoss, HasSubstr("no MARK")));
  EXPECT_THAT(RunPickle(kProto2 + "]}b."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("BUILD on a list is not allowed")));
  EXPECT_THAT(RunPickle(kProto2 + "}Na."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("cannot append to a dict")));
  EXPECT_THAT(RunPickle(kProto2 + "](NNNu."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("cannot set items on a list")));
  EXPECT_THAT(RunPickle(kProto2 + "}(Nu."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("odd number of items")));
  EXPECT_THAT(RunPickle(kProto2 + "X\x02\x00\x00\x00\xc3\x28."s),
              StatusIs(StatusCode::kDataLoss, HasSubstr("not valid UTF-8")));
}

TEST(MaliciousPickle, UnsupportedOpcodesAreUnimplemented) {
  EXPECT_THAT(RunPickle("\x80\x06N."),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("protocol 6")));
  EXPECT_THAT(RunPickle(kProto2 + "(ios\nsystem\n."),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("INST")));
  EXPECT_THAT(RunPickle(kProto2 + "\x82\x01."),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("EXT1")));
  EXPECT_THAT(RunPickle(kProto2 + "S'x'\n."),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("quoted strings")));
}

TEST(MaliciousPickle, AbsurdSizesAndIndexes) {
  EXPECT_THAT(RunPickle(kProto2 + "j\xff\xff\xff\xff."),
              StatusIs(StatusCode::kDataLoss, HasSubstr("memo index 4294967295 was never set")));
  EXPECT_THAT(RunPickle(kProto2 + "X\xff\xff\xff\x7f" + "ab"),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("BINUNICODE at offset 2"),
                             HasSubstr("needs 2147483647 bytes but only 2 remain"))));
  EXPECT_THAT(RunPickle(kProto2 + "\x8d\xff\xff\xff\xff\xff\xff\xff\xff" + "ab"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("BINUNICODE8")));
  EXPECT_THAT(RunPickle(kProto2 + "\x95\x00\x00\x00\x00\x00\x00\x01\x00N."s),
              StatusIs(StatusCode::kDataLoss, HasSubstr("frame of")));
  EXPECT_THAT(RunPickle(kProto2 + "\x8b\xff\xff\xff\xff"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("negative LONG4 length")));
  PickleOptions small;
  small.max_memo_entries = 2;
  EXPECT_THAT(RunPickle(kProto2 + "Nq\x00q\x01q\x02."s, small),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("memo")));
  small.max_stack_depth = 100;
  EXPECT_THAT(RunPickle(kProto2 + std::string(200, '(') + ".", small),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("exceeds 100 entries")));
  EXPECT_THAT(RunPickle(kProto2 + std::string(200, 'N') + ".", small),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("exceeds 100 entries")));
}

TEST(MaliciousTensor, ViewsMustFitTheirStorage) {
  const std::string four_floats(16, '\0');
  UCP_EXPECT_OK(OpenBytes(TorchZip(TensorPickle(4, 0, {2, 2}, {2, 1}), four_floats)).status());
  // Storage numel larger than its record.
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(1000, 0, {4}, {1}), four_floats)),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("needs 4000 bytes, but its record in evil.pt has 16")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 1, {4}, {1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("reaches past its 16 bytes")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 0, {2, 2}, {1, 3}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("reaches past its 16 bytes")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 0, {-1}, {1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("size entries must be non-negative")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 0, {2}, {-1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("stride entries must be non-negative")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, -3, {2}, {1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("storage offset must be a non-negative")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 0, {3, int64_t{1} << 62}, {1, 1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("element count overflows int64")));
  EXPECT_THAT(
      OpenBytes(TorchZip(TensorPickle(4, 0, {1 << 20, 1 << 20, 1 << 20, 1 << 20}, {0, 0, 0, 0}),
                         four_floats)),
      StatusIs(StatusCode::kDataLoss, HasSubstr("tensor size")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 0, {4, 2}, {int64_t{1} << 62, 1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("overflow")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(4, 0, {2, 2}, {1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("size has 2 dims but stride has 1")));
  EXPECT_THAT(OpenBytes(TorchZip(TensorPickle(int64_t{1} << 62, 0, {1}, {1}), four_floats)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("overflows")));
}

TEST(MaliciousTensor, PersistentIdsMustNameRecords) {
  const std::string pkl = kProto2 + "(" + PStr("storage") + "ctorch\nFloatStorage\n" + PStr("7") +
                          PStr("cpu") + PInt(4) + "tQ.";
  EXPECT_THAT(OpenBytes(TorchZip(pkl, std::string(16, '\0'))),
              StatusIs(StatusCode::kDataLoss, HasSubstr("storage '7' has no record 'data/7'")));
  const std::string module_pid = kProto2 + "(" + PStr("module") + "NNNtQ.";
  EXPECT_THAT(OpenBytes(TorchZip(module_pid, "")),
              StatusIs(StatusCode::kDataLoss, HasSubstr("persistent id is not a 5-tuple")));
  const std::string bad_class = kProto2 + "(" + PStr("storage") + "ctorch\nSize\n" + PStr("0") +
                                PStr("cpu") + PInt(4) + "tQ.";
  EXPECT_THAT(
      OpenBytes(TorchZip(bad_class, std::string(16, '\0'))),
      StatusIs(StatusCode::kDataLoss, HasSubstr("'torch.Size' is not a torch storage class")));
  const std::string complex = kProto2 + "(" + PStr("storage") + "ctorch\nComplexFloatStorage\n" +
                              PStr("0") + PStr("cpu") + PInt(2) + "tQ.";
  EXPECT_THAT(
      OpenBytes(TorchZip(complex, std::string(16, '\0'))),
      StatusIs(StatusCode::kUnimplemented, HasSubstr("ComplexFloatStorage has no ucp dtype")));
}

// --- zip faults -------------------------------------------------------------------------------

TEST(MaliciousZip, EntryNamesThatEscapeAreRefused) {
  const std::string pkl = kProto2 + "N.";
  for (const auto& [name, why] : std::vector<std::pair<std::string, std::string>>{
           {"archive/../../etc/x", "has a '..' component"},
           {"/etc/passwd", "is an absolute path"},
           {"archive\\..\\x", "contains a backslash"},
           {"archive//x", "has an empty path component"},
           {"archive/./x", "has a '.' component"},
           {"C:/x", "starts with a drive letter"},
           {std::string("archive/x\0y", 11), "contains a NUL byte"}}) {
    SCOPED_TRACE(name);
    EXPECT_THAT(
        OpenBytes(RawZip({{"archive/data.pkl", pkl}, {name, "x"}, {"archive/version", "3\n"}})),
        StatusIs(StatusCode::kDataLoss, HasSubstr(why)));
  }
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"other/version", "3\n"}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("outside the archive prefix 'archive/'")));
  EXPECT_THAT(OpenBytes(RawZip({{"data.pkl", pkl}, {"archive/version", "3\n"}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("is not inside a folder")));
}

TEST(MaliciousZip, DuplicatesOverlapsAndOutOfFileRecords) {
  const std::string pkl = kProto2 + "N.";
  UCP_EXPECT_OK(
      OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n"}})).status());
  EXPECT_THAT(
      OpenBytes(RawZip(
          {{"archive/data.pkl", pkl}, {"archive/version", "3\n"}, {"archive/data.pkl", pkl}})),
      StatusIs(StatusCode::kDataLoss, HasSubstr("duplicate zip entry 'archive/data.pkl'")));
  // data.pkl claims more bytes than it has, running over the next local header.
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl, 40}, {"archive/version", "3\n"}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("overlap")));
  // Two directory entries pointing at one local header.
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n", -1, 0}})),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("local header of zip entry 'archive/version' of evil.pt has a "
                                 "name of 16 bytes")));
  // A record whose data runs into the central directory.
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n", 5000}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("runs into the central directory")));
  EXPECT_THAT(
      OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n", -1, 1 << 30}})),
      StatusIs(StatusCode::kDataLoss, HasSubstr("is not before the central directory")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n"}}, 1 << 30)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("does not end at the end record")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n"}}, -1, 65000)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("claims 65000 entries")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n"}}, -1, 0)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("has no entries")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "3\n"}}) + "junk"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("no end-of-central-directory record")));
}

TEST(MaliciousZip, MissingAndBadRecords) {
  const std::string pkl = kProto2 + "N.";
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("has no 'version' record")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/version", "3\n"}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("has no data.pkl record")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "99\n"}})),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("version 99")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl}, {"archive/version", "x"}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("is not a number")));
  EXPECT_THAT(
      OpenBytes(RawZip(
          {{"archive/data.pkl", pkl}, {"archive/byteorder", "big"}, {"archive/version", "3\n"}})),
      StatusIs(StatusCode::kUnimplemented, HasSubstr("big-endian")));
  EXPECT_THAT(
      OpenBytes(RawZip(
          {{"archive/data.pkl", pkl}, {"archive/constants.pkl", pkl}, {"archive/version", "3\n"}})),
      StatusIs(StatusCode::kUnimplemented, HasSubstr("TorchScript")));
  EXPECT_THAT(OpenBytes(RawZip({{"archive/data.pkl", pkl + "N"}, {"archive/version", "3\n"}})),
              StatusIs(StatusCode::kDataLoss, HasSubstr("1 bytes after its STOP")));
  EXPECT_THAT(OpenBytes("hello, not a torch file"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("is not a torch.save file")));
}

// Issue 16 #7: a stored CRC of 0 is checked like any other (it is not "not recorded").
std::string ZeroCrcOf(std::string zip, const std::string& suffix) {
  for (size_t at = zip.find("PK\x01\x02"); at != std::string::npos;
       at = zip.find("PK\x01\x02", at + 4)) {
    const size_t name_len = static_cast<uint8_t>(zip[at + 28]) |
                            (static_cast<size_t>(static_cast<uint8_t>(zip[at + 29])) << 8);
    if (zip.substr(at + 46, name_len).ends_with(suffix)) {
      for (int i = 0; i < 4; ++i) zip[at + 16 + i] = '\0';
    }
  }
  return zip;
}

TEST(MaliciousZip, ZeroedCrcIsStillChecked) {
  std::string good = Fixture("model_state_dict.pt");
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, OpenBytes(good));
  ASSERT_FALSE(f.storages().empty());
  const StorageRecord rec = f.storages()[0];
  ASSERT_GT(rec.num_bytes, 0);
  std::string bad = good;
  bad[static_cast<size_t>(rec.data_offset)] ^= 0x01;
  bad = ZeroCrcOf(bad, "/data/" + rec.key);
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile g, OpenBytes(bad));
  const StorageRecord* zeroed = nullptr;
  for (const StorageRecord& r : g.storages()) {
    if (r.key == rec.key) zeroed = &r;
  }
  ASSERT_NE(zeroed, nullptr);
  EXPECT_EQ(zeroed->crc32, 0u);
  EXPECT_THAT(g.VerifyStorageCrc32(*zeroed),
              StatusIs(StatusCode::kDataLoss, HasSubstr("crc32")));
  // data.pkl is read whole at open: a zeroed CRC no longer matches its bytes.
  EXPECT_THAT(OpenBytes(ZeroCrcOf(good, "/data.pkl")).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("crc32 mismatch in zip record")));
  TorchReadOptions no_crc;
  no_crc.verify_crc32 = false;
  UCP_EXPECT_OK(OpenBytes(ZeroCrcOf(good, "/data.pkl"), no_crc).status());
}

TEST(MaliciousZip, CrcMismatchIsDataLossUnlessDisabled) {
  std::string good = Fixture("model_state_dict.pt");
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, OpenBytes(good));
  ASSERT_FALSE(f.storages().empty());
  const StorageRecord rec = f.storages()[0];
  ASSERT_GT(rec.num_bytes, 0);
  std::string bad = good;
  bad[static_cast<size_t>(rec.data_offset)] ^= 0x01;
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile g, OpenBytes(bad));
  const PyValue* t = nullptr;
  for (const auto& [k, v] : g.root().entries()) {
    if (v->kind() == PyKind::kTensor && v->tensor().storage.key == rec.key &&
        v->tensor().storage_offset == 0 &&
        v->tensor().num_elements() * DTypeSizeBytes(v->tensor().dtype) == rec.num_bytes) {
      t = v;
      break;
    }
  }
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(g.ReadTensor(t->tensor()),
              StatusIs(StatusCode::kDataLoss, HasSubstr("crc32 mismatch in storage")));
  TorchReadOptions no_crc;
  no_crc.verify_crc32 = false;
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile h, OpenBytes(bad, no_crc));
  UCP_EXPECT_OK(h.ReadTensor(t->tensor()).status());
}

// --- truncation ---------------------------------------------------------------------------

TEST(MaliciousTruncation, EveryPrefixOfRealFilesFailsCleanly) {
  for (const char* name : {"model_state_dict.pt", "model_state_dict_legacy.pt", "protocol4.pt"}) {
    SCOPED_TRACE(name);
    const std::string whole = Fixture(name);
    UCP_ASSERT_OK(OpenBytes(whole).status());
    for (size_t n = 0; n < whole.size(); ++n) {
      auto r = OpenBytes(whole.substr(0, n));
      ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes opened";
      ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << n << ": " << r.status().ToString();
    }
  }
}

TEST(MaliciousTruncation, EveryPrefixOfAPickleFailsCleanly) {
  // data.pkl is the first record of a torch-written zip: cut the pickle, not the container.
  const std::string zip = Fixture("mp_rank_00_model_states.pt");
  auto src =
      ByteSource::FromBuffer(std::as_bytes(std::span<const char>(zip.data(), zip.size())), "z");
  const size_t name_len = static_cast<uint8_t>(zip[26]) | (static_cast<uint8_t>(zip[27]) << 8);
  const size_t extra_len = static_cast<uint8_t>(zip[28]) | (static_cast<uint8_t>(zip[29]) << 8);
  ASSERT_EQ(zip.substr(30, name_len), "mp_rank_00_model_states/data.pkl");
  const size_t data_at = 30 + name_len + extra_len;
  // Storages resolve to one huge byte storage so that only truncation can fail.
  PyArena full_arena;
  PersistentLoader loader = [&](const PyValue&) -> Result<const PyValue*> {
    StorageRef s;
    s.key = "0";
    s.dtype = DType::kUint8;
    s.numel = s.num_bytes = int64_t{1} << 40;
    return static_cast<const PyValue*>(full_arena.Storage(s));
  };
  UCP_ASSERT_OK_AND_ASSIGN(UnpickleResult full,
                           Unpickle(*src, static_cast<int64_t>(data_at), src->size(), full_arena,
                                    {}, loader, "data.pkl"));
  const int64_t end = full.end_offset;
  for (int64_t cut = static_cast<int64_t>(data_at); cut < end; ++cut) {
    PyArena arena;
    auto r = Unpickle(*src, static_cast<int64_t>(data_at), cut, arena, {}, loader, "data.pkl");
    ASSERT_FALSE(r.ok()) << cut;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << cut << ": " << r.status().ToString();
  }
}

}  // namespace
}  // namespace ucp::torch

// --- resource budgets (issue 16 #2) ---------------------------------------------------------

namespace ucp::torch {
namespace {

// Runs `body` in a forked child whose address space may grow by `headroom_bytes` only, so a
// regression that expands memory fails (bad_alloc, a signal) instead of thrashing the machine.
// Returns "" when the child exited 0, else what went wrong.
std::string RunUnderMemoryLimit(int64_t headroom_bytes, const std::function<bool()>& body) {
  pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    struct rlimit lim;
    getrlimit(RLIMIT_AS, &lim);
    lim.rlim_cur = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + headroom_bytes;
    setrlimit(RLIMIT_AS, &lim);
    _exit(body() ? 0 : 1);
  }
  int st = 0;
  if (waitpid(pid, &st, 0) != pid) return "waitpid failed";
  if (WIFSIGNALED(st)) return "child killed by signal " + std::to_string(WTERMSIG(st));
  return WEXITSTATUS(st) == 0 ? "" : "child failed its checks";
}

std::string BinGet(int i) { return std::string("h") + static_cast<char>(i); }
std::string BinPut(int i) { return std::string("q") + static_cast<char>(i); }

TEST(PickleBudgets, BillionLaughsThroughTheMemoStaysShared) {
  // Level i+1 is a list of ten references to level i: 10^30 leaves if expanded.
  std::string p = kProto2 + "]" + BinPut(0) + "0";
  for (int i = 0; i < 30; ++i) {
    p += "(";
    for (int k = 0; k < 10; ++k) p += BinGet(i);
    p += "l" + BinPut(i + 1) + (i < 29 ? "0" : "");
  }
  p += ".";
  {
    PyArena arena;
    Result<UnpickleResult> r = RunPickle(p, arena);
    UCP_ASSERT_OK(r.status());
    EXPECT_LT(arena.size(), 64u);
    EXPECT_EQ(r->value->nesting(), 30u);
  }
  EXPECT_EQ(RunUnderMemoryLimit(int64_t{64} << 20, [&] {
              PyArena arena;
              Result<UnpickleResult> r = RunPickle(p, arena);
              return r.ok() && arena.size() < 64 && r->value->nesting() == 30 &&
                     r->value->items().size() == 10 && r->value->items()[0] == r->value->items()[9];
            }),
            "");
}

TEST(PickleBudgets, DeeplyNestedTuplesFailFastNamingOpcodeAndOffset) {
  // 50 MB of TUPLE1: one level per byte.
  std::string p = kProto2 + ")" + std::string(50'000'000, '\x85') + ".";
  PyArena arena;
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(RunPickle(p, arena).status(),
              StatusIs(StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("pickle opcode TUPLE1 at offset 203 of test.pkl"),
                             HasSubstr("nested deeper than 200 levels"))));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
  EXPECT_LT(arena.size(), 1000u);
  // Through lists and APPEND too, and through an object's arguments.
  std::string q = kProto2 + "]";
  for (int i = 0; i < 300; ++i) q += "]";
  for (int i = 0; i < 300; ++i) q += "a";
  q += ".";
  EXPECT_THAT(RunPickle(q).status(),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("nested deeper than 200")));
}

TEST(PickleBudgets, FlatListOf16MNonesIsBounded) {
  std::string chunk = "(" + std::string(1000, 'N') + "e";
  std::string p = kProto2 + "]";
  p.reserve(16'000 * chunk.size() + 8);
  for (int i = 0; i < 16'000; ++i) p += chunk;
  p += ".";
  // 16M Nones are 16M pointers to one shared node: well under 1 GiB (they were 16M nodes).
  EXPECT_EQ(RunUnderMemoryLimit(int64_t{1} << 30, [&] {
              PyArena arena;
              Result<UnpickleResult> r = RunPickle(p, arena);
              return r.ok() && r->value->items().size() == 16'000'000u && arena.size() < 8;
            }),
            "");
  // The memory budget and the item bound name the opcode and offset.
  PickleOptions small;
  small.max_memory_bytes = 1 << 20;
  EXPECT_THAT(RunPickle(p, small).status(),
              StatusIs(StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("pickle opcode APPENDS at offset"), HasSubstr("of test.pkl"),
                             HasSubstr("memory budget"))));
  PickleOptions few;
  few.max_items = 5000;
  EXPECT_THAT(RunPickle(p, few).status(),
              StatusIs(StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("pickle opcode APPENDS at offset 6014 of test.pkl"),
                             HasSubstr("more than 5000 items"))));
  // Many distinct nodes (ints) are charged per node against the budget.
  std::string ints = kProto2 + "]";
  for (int i = 0; i < 200'000; ++i) ints += "(" + PInt(i % 250) + "e";
  ints += ".";
  EXPECT_THAT(RunPickle(ints, small).status(),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("memory budget")));
  UCP_EXPECT_OK(RunPickle(ints).status());
}

}  // namespace
}  // namespace ucp::torch
