// TorchWriter: files ucp writes read back in ucp bitwise, and load in real torch (python3 with
// torch 1.13) with the expected keys, dtypes, shapes and values; the torch-written fixtures copied
// through CopyFrom load in torch equal to the originals.
#include "ucp/io/torch/torch_writer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/torch/torch_file.h"

namespace ucp::torch {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using json = nlohmann::json;

std::string SourceRoot() { return UCP_SOURCE_ROOT_DIR; }

std::string Hex(std::span<const std::byte> b) {
  static const char* d = "0123456789abcdef";
  std::string h;
  for (std::byte x : b) {
    h.push_back(d[static_cast<uint8_t>(x) >> 4]);
    h.push_back(d[static_cast<uint8_t>(x) & 15]);
  }
  return h;
}
std::string Hex(const std::string& s) {
  return Hex(std::as_bytes(std::span<const char>(s.data(), s.size())));
}

// Runs the torch.load checker over `dir`; its output is attached to the failure message.
void ExpectTorchLoads(const std::filesystem::path& dir) {
  const std::string log = (dir / "check.log").string();
  const std::string cmd = "/usr/bin/python3 " + SourceRoot() +
                          "/libucp/ucp/io/torch/torch_load_check.py " + dir.string() + " " +
                          SourceRoot() + "/tools/make_torch_fixtures.py > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << cmd << "\n" << output;
  EXPECT_THAT(output, HasSubstr("files ok"));
}

void WriteJson(const std::filesystem::path& p, const json& j) {
  std::ofstream out(p);
  out << j.dump(1);
}

struct Built {
  std::vector<Tensor> data;  // keeps the viewed memory alive
  json expect;
  const PyValue* root = nullptr;
};

// Everything the writer can express, with the expectations the Python side checks.
Built BuildEverything(TorchWriter& w, uint64_t seed, bool include_fp8) {
  Built b;
  PyArena& a = w.arena();
  ucp::testing::Gen gen(seed);
  PyValue* root = a.Dict(true);
  b.root = root;
  json tensors = json::array(), values = json::array(), keys = json::array();
  std::vector<std::string> top_keys;
  auto add = [&](const std::string& k, const PyValue* v) {
    root->SetItem(a.Str(k), v);
    top_keys.push_back(k);
  };
  const Shape shapes[] = {{3, 4}, {}, {2, 0}, {5}, {2, 3, 2}};
  int i = 0;
  for (DType d : kAllDTypes) {
    const bool fp8 = d == DType::kFp8E4m3 || d == DType::kFp8E5m2;
    if (fp8 && !include_fp8) continue;
    const Shape& shape = shapes[i++ % 5];
    b.data.push_back(gen.RandomTensor(d, shape));
    const Tensor& t = b.data.back();
    const bool param = IsFloating(d) && i % 2 == 0;
    const std::string key = "t_" + std::string(DTypeName(d));
    add(key, *w.AddTensor(t.view(), param, param));
    tensors.push_back({{"path", {key}},
                       {"dtype", std::string(DTypeTorchName(d))},
                       {"shape", shape},
                       {"requires_grad", param},
                       {"is_parameter", param},
                       {"hex", Hex(std::span<const std::byte>(t.data(), t.num_bytes()))}});
  }
  // One tensor node under two keys loads as one object.
  b.data.push_back(gen.RandomTensor(DType::kFp32, {4}));
  const PyValue* shared = *w.AddTensor(b.data.back().view());
  add("shared_a", shared);
  add("shared_b", shared);

  PyValue* ints = a.List();
  const int64_t int_cases[] = {0,
                               1,
                               255,
                               256,
                               65535,
                               65536,
                               -1,
                               -129,
                               std::numeric_limits<int32_t>::min(),
                               int64_t{std::numeric_limits<int32_t>::max()} + 1,
                               std::numeric_limits<int64_t>::min(),
                               std::numeric_limits<int64_t>::max()};
  for (size_t k = 0; k < std::size(int_cases); ++k) {
    ints->Append(a.Int(int_cases[k]));
    values.push_back(
        {{"path", {"ints", k}}, {"kind", "int"}, {"value", std::to_string(int_cases[k])}});
  }
  add("ints", ints);
  // 2**70 + 5, little-endian two's complement.
  std::string big(9, '\0');
  big[0] = 5;
  big[8] = 0x40;
  add("big", a.BigInt(big));
  values.push_back({{"path", {"big"}}, {"kind", "int"}, {"value", "1180591620717411303429"}});
  add("neg_big", a.BigInt(std::string("\x01\x00\x00\x00\x00\x00\x00\x00\xff", 9)));
  values.push_back({{"path", {"neg_big"}}, {"kind", "int"}, {"value", "-18446744073709551615"}});

  PyValue* floats = a.List();
  const double float_cases[] = {0.0,
                                -0.0,
                                1.5,
                                -3.25e-300,
                                std::numeric_limits<double>::infinity(),
                                std::numeric_limits<double>::quiet_NaN()};
  for (size_t k = 0; k < std::size(float_cases); ++k) {
    floats->Append(a.Float(float_cases[k]));
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(std::bit_cast<uint64_t>(float_cases[k])));
    values.push_back({{"path", {"floats", k}}, {"kind", "float_bits"}, {"value", hex}});
  }
  add("floats", floats);
  add("text", a.Str("héllo → 世界"));
  values.push_back({{"path", {"text"}}, {"kind", "str"}, {"value", "héllo → 世界"}});
  std::string all_bytes;
  for (int c = 0; c < 256; ++c) all_bytes.push_back(static_cast<char>(c));
  add("blob", a.Bytes(all_bytes));
  values.push_back({{"path", {"blob"}}, {"kind", "bytes"}, {"value", Hex(all_bytes)}});
  add("nothing", a.None());
  values.push_back({{"path", {"nothing"}}, {"kind", "none"}});
  add("yes", a.Bool(true));
  values.push_back({{"path", {"yes"}}, {"kind", "bool"}, {"value", true}});
  add("no", a.Bool(false));
  values.push_back({{"path", {"no"}}, {"kind", "bool"}, {"value", false}});
  add("dtype", a.DTypeGlobal(DType::kBf16));
  values.push_back({{"path", {"dtype"}}, {"kind", "dtype"}, {"value", "bfloat16"}});
  const int64_t dims[] = {4, 1024};
  add("size", a.TorchSize(dims));
  values.push_back({{"path", {"size"}}, {"kind", "size"}, {"value", {4, 1024}}});
  PyValue* tuple = a.Tuple({a.Int(1), a.Str("two"), a.Float(3.0), a.None(), a.Bool(true)});
  add("tuple", tuple);
  values.push_back({{"path", {"tuple"}}, {"kind", "type"}, {"value", "builtins.tuple"}});
  values.push_back({{"path", {"tuple"}}, {"kind", "len"}, {"value", 5}});
  PyValue* set = a.Set();
  set->Append(a.Str("a"));
  set->Append(a.Int(2));
  add("set", set);
  values.push_back({{"path", {"set"}}, {"kind", "type"}, {"value", "builtins.set"}});
  values.push_back({{"path", {"set"}}, {"kind", "len"}, {"value", 2}});
  PyValue* by_int = a.Dict();
  for (int k = 0; k < 3; ++k) by_int->SetItem(a.Int(k), a.Str("v" + std::to_string(k)));
  add("by_int", by_int);
  values.push_back({{"path", {"by_int", 2}}, {"kind", "str"}, {"value", "v2"}});
  values.push_back({{"path", {"by_int"}}, {"kind", "type"}, {"value", "builtins.dict"}});
  // A list of 2500 items crosses the 1000-item APPENDS batches.
  PyValue* long_list = a.List();
  for (int k = 0; k < 2500; ++k) long_list->Append(a.Int(k * 7));
  add("long_list", long_list);
  values.push_back({{"path", {"long_list", 2499}}, {"kind", "int"}, {"value", "17493"}});
  // An inert object: argparse.Namespace(lr=0.5) via NEWOBJ + BUILD.
  PyValue* ns_state = a.Dict();
  ns_state->SetItem(a.Str("lr"), a.Float(0.5));
  ns_state->SetItem(a.Str("params_dtype"), a.DTypeGlobal(DType::kFp16));
  PyValue* ns = a.Object(a.Global("argparse.Namespace"), a.Tuple(), true);
  ns->SetState(ns_state);
  add("args", ns);
  values.push_back({{"path", {"args"}}, {"kind", "type"}, {"value", "argparse.Namespace"}});
  values.push_back(
      {{"path", {"args", "@attr:params_dtype"}}, {"kind", "dtype"}, {"value", "float16"}});
  values.push_back(
      {{"path", {"args", "@attr:lr"}}, {"kind", "float_bits"}, {"value", "3fe0000000000000"}});
  // Many memo entries: more than 256 distinct lists pushes BINPUT to LONG_BINPUT.
  PyValue* many = a.List();
  for (int k = 0; k < 300; ++k) {
    PyValue* l = a.List();
    l->Append(a.Int(k));
    many->Append(l);
  }
  add("many", many);
  values.push_back({{"path", {"many", 299, 0}}, {"kind", "int"}, {"value", "299"}});

  keys.push_back({{"path", json::array()}, {"keys", top_keys}});
  values.push_back(
      {{"path", json::array()}, {"kind", "type"}, {"value", "collections.OrderedDict"}});
  b.expect = {{"tensors", tensors},
              {"values", values},
              {"keys", keys},
              {"aliases", {{{"shared_a"}, {"shared_b"}}}}};
  return b;
}

TEST(TorchWriter, FilesReadBackInUcpBitwise) {
  for (bool zip64 : {false, true}) {
    SCOPED_TRACE(zip64);
    ucp::testing::TempDir dir;
    TorchWriteOptions opts;
    opts.zip.force_zip64 = zip64;
    TorchWriter w(opts);
    Built b = BuildEverything(w, 17, /*include_fp8=*/true);
    UCP_ASSERT_OK(w.Write(dir / "all.pt", *b.root));
    UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, TorchFile::Open(dir / "all.pt"));
    EXPECT_EQ(f.format(), TorchFormat::kZip);
    for (const json& t : b.expect["tensors"]) {
      const std::string key = t["path"][0];
      SCOPED_TRACE(key);
      const PyValue* v = f.root().Get(key);
      ASSERT_NE(v, nullptr);
      ASSERT_EQ(v->kind(), PyKind::kTensor);
      EXPECT_EQ(std::string(DTypeTorchName(v->tensor().dtype)), t["dtype"].get<std::string>());
      EXPECT_EQ(v->tensor().is_parameter, t["is_parameter"].get<bool>());
      UCP_ASSERT_OK_AND_ASSIGN(Tensor data, f.ReadTensor(v->tensor()));
      EXPECT_EQ(Hex(std::span<const std::byte>(data.data(), data.num_bytes())),
                t["hex"].get<std::string>());
    }
    EXPECT_EQ(f.root().Get("shared_a"), f.root().Get("shared_b"));  // memo aliasing survives
    EXPECT_EQ(f.root().Get("ints")->items()[10]->int_value(), std::numeric_limits<int64_t>::min());
    std::string all_bytes;
    for (int c = 0; c < 256; ++c) all_bytes.push_back(static_cast<char>(c));
    EXPECT_EQ(f.root().Get("blob")->str(), all_bytes);
    EXPECT_EQ(f.root().Get("text")->str(), "héllo → 世界");
    EXPECT_EQ(f.root().Get("args")->class_name(), "argparse.Namespace");
    EXPECT_EQ(f.root().Get("many")->items()[299]->items()[0]->int_value(), 299);
    EXPECT_TRUE(std::isnan(f.root().Get("floats")->items()[5]->float_value()));
    EXPECT_TRUE(std::signbit(f.root().Get("floats")->items()[1]->float_value()));
  }
}

TEST(TorchWriter, SameInputSameBytes) {
  ucp::testing::TempDir dir;
  for (const char* name : {"a.pt", "b.pt"}) {
    TorchWriter w;
    Built b = BuildEverything(w, 5, false);
    UCP_ASSERT_OK(w.Write(dir / name, *b.root));
  }
  std::ifstream a(dir / "a.pt", std::ios::binary), b(dir / "b.pt", std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}),
      sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_GT(sa.size(), 1000u);
  EXPECT_EQ(sa, sb);
}

TEST(TorchWriter, DataIs64ByteAligned) {
  ucp::testing::TempDir dir;
  TorchWriter w;
  Built b = BuildEverything(w, 9, false);
  UCP_ASSERT_OK(w.Write(dir / "x.pt", *b.root));
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile f, TorchFile::Open(dir / "x.pt"));
  ASSERT_FALSE(f.storages().empty());
  for (const StorageRecord& r : f.storages()) EXPECT_EQ(r.data_offset % 64, 0) << r.key;
}

TEST(TorchWriter, RefusesForeignTensorsAndLeavesNoFile) {
  ucp::testing::TempDir dir;
  UCP_ASSERT_OK_AND_ASSIGN(TorchFile f,
                           TorchFile::Open(SourceRoot() + "/tests/data/torch/model_state_dict.pt"));
  TorchWriter w;
  EXPECT_THAT(w.Write(dir / "x.pt", f.root()),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("was not added with this writer")));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(TorchWriter, RefusesBadViewsAndNames) {
  TorchWriter w;
  std::vector<std::byte> bytes(10);
  EXPECT_THAT(w.AddTensor({DType::kFp32, {3}, bytes}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tensor to write")));
  TorchWriteOptions bad;
  bad.archive_name = "a/b";
  TorchWriter w2(bad);
  ucp::testing::TempDir dir;
  EXPECT_THAT(w2.Write(dir / "x.pt", *w2.arena().None()),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("one path component")));
}

// A streamed file: deferred storages written in shuffled pieces from several threads, next to an
// eager tensor. `trimmed` views the first 1000 elements of a 1024-element storage, as DeepSpeed
// saves a padded partition without its padding.
struct Streamed {
  std::vector<Tensor> data;  // the bytes each deferred storage must hold (whole storage)
  std::vector<DeferredTensor> deferred;
  Tensor eager;
  json expect;
  const PyValue* root = nullptr;
};

Streamed BuildStreamed(TorchWriter& w, uint64_t seed) {
  Streamed s;
  PyArena& a = w.arena();
  ucp::testing::Gen gen(seed);
  PyValue* root = a.Dict(true);
  s.root = root;
  struct Spec {
    const char* key;
    DType dtype;
    Shape shape;
    int64_t storage;
  };
  const Spec specs[] = {{"trimmed", DType::kFp32, {1000}, 1024},
                        {"weight", DType::kBf16, {37, 5}, 185},
                        {"empty", DType::kFp32, {0}, 0}};
  json tensors = json::array();
  for (const Spec& spec : specs) {
    s.data.push_back(gen.RandomTensor(spec.dtype, {spec.storage}));
    s.deferred.push_back(*w.AddDeferredTensor(spec.dtype, spec.shape, spec.storage,
                                              /*requires_grad=*/spec.dtype == DType::kFp32));
    root->SetItem(a.Str(spec.key), s.deferred.back().node);
    const Tensor& t = s.data.back();
    const int64_t view_bytes = NumElementsOrDie(spec.shape) * DTypeSizeBytes(spec.dtype);
    tensors.push_back({{"path", {spec.key}},
                       {"dtype", std::string(DTypeTorchName(spec.dtype))},
                       {"shape", spec.shape},
                       {"requires_grad", spec.dtype == DType::kFp32},
                       {"is_parameter", false},
                       {"hex", Hex(std::span<const std::byte>(t.data(), view_bytes))}});
  }
  s.eager = gen.RandomTensor(DType::kFp32, {});
  root->SetItem(a.Str("step"), *w.AddTensor(s.eager.view()));
  tensors.push_back({{"path", {"step"}},
                     {"dtype", "float32"},
                     {"shape", json::array()},
                     {"requires_grad", false},
                     {"is_parameter", false},
                     {"hex", Hex(std::span<const std::byte>(s.eager.data(), 4))}});
  s.expect = {
      {"tensors", tensors},
      {"keys", {{{"path", json::array()}, {"keys", {"trimmed", "weight", "empty", "step"}}}}}};
  return s;
}

// Writes every deferred storage in pieces of 1..97 bytes, shuffled, from 4 threads.
void WritePieces(StreamedTorchFile& f, const Streamed& s, uint64_t seed) {
  struct Piece {
    int32_t id;
    int64_t offset, size;
  };
  std::vector<Piece> pieces;
  ucp::testing::Gen gen(seed);
  for (size_t k = 0; k < s.deferred.size(); ++k) {
    const int64_t n = s.data[k].num_bytes();
    for (int64_t at = 0; at < n;) {
      const int64_t len = std::min<int64_t>(gen.Int(1, 97), n - at);
      pieces.push_back({s.deferred[k].id, at, len});
      at += len;
    }
  }
  std::shuffle(pieces.begin(), pieces.end(), gen.rng());
  std::vector<std::thread> threads;
  std::vector<Status> status(4);
  for (size_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < pieces.size(); i += 4) {
        const Piece& p = pieces[i];
        const Tensor& data = s.data[static_cast<size_t>(p.id)];
        Status st =
            f.WriteStorage(p.id, p.offset, {data.data() + p.offset, static_cast<size_t>(p.size)});
        if (!st.ok() && status[t].ok()) status[t] = st;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& st : status) UCP_EXPECT_OK(st);
}

TEST(TorchWriter, StreamedFilesReadBackAndLoadInTorch) {
  ucp::testing::TempDir dir;
  std::vector<std::unique_ptr<TorchWriter>> writers;
  for (bool zip64 : {false, true}) {
    SCOPED_TRACE(zip64);
    TorchWriteOptions opts;
    opts.zip.force_zip64 = zip64;
    opts.zip.sync = false;
    writers.push_back(std::make_unique<TorchWriter>(opts));
    Streamed s = BuildStreamed(*writers.back(), 31);
    const std::string name = zip64 ? "streamed_zip64.pt" : "streamed.pt";
    UCP_ASSERT_OK_AND_ASSIGN(StreamedTorchFile f,
                             writers.back()->WriteStreamed(dir / name, *s.root));
    EXPECT_FALSE(std::filesystem::exists(dir / name));  // invisible until finished
    WritePieces(f, s, 5);
    UCP_ASSERT_OK(f.Finish());
    UCP_ASSERT_OK_AND_ASSIGN(TorchFile back, TorchFile::Open(dir / name));
    for (const StorageRecord& r : back.storages()) {
      UCP_EXPECT_OK(back.VerifyStorageCrc32(r));
      EXPECT_EQ(r.data_offset % 64, 0) << r.key;
    }
    for (const json& t : s.expect["tensors"]) {
      const PyValue* v = back.root().Get(t["path"][0].get<std::string>());
      ASSERT_NE(v, nullptr);
      UCP_ASSERT_OK_AND_ASSIGN(Tensor data, back.ReadTensor(v->tensor()));
      EXPECT_EQ(Hex(std::span<const std::byte>(data.data(), data.num_bytes())),
                t["hex"].get<std::string>());
    }
    // The trimmed view keeps its whole storage, padding included, as DeepSpeed's does.
    EXPECT_EQ(back.root().Get("trimmed")->tensor().storage.numel, 1024);
    json e = s.expect;
    e["file"] = name;
    WriteJson(dir / (name + ".expect.json"), e);
  }
  ExpectTorchLoads(dir.path());
}

TEST(TorchWriter, StreamedFileRefusesGapsOverlapsAndStrayWrites) {
  ucp::testing::TempDir dir;
  for (const char* fault : {"gap", "overlap", "outside"}) {
    SCOPED_TRACE(fault);
    TorchWriter w;
    Streamed s = BuildStreamed(w, 3);
    UCP_ASSERT_OK_AND_ASSIGN(StreamedTorchFile f, w.WriteStreamed(dir / "x.pt", *s.root));
    const Tensor& t = s.data[0];
    const auto bytes = std::span<const std::byte>(t.data(), t.num_bytes());
    for (size_t k = 1; k < s.deferred.size(); ++k) {
      UCP_ASSERT_OK(f.WriteStorage(s.deferred[k].id, 0,
                                   {s.data[k].data(), static_cast<size_t>(s.data[k].num_bytes())}));
    }
    if (std::string(fault) == "gap") {
      UCP_ASSERT_OK(f.WriteStorage(0, 0, bytes.first(100)));
      UCP_ASSERT_OK(f.WriteStorage(0, 104, bytes.subspan(104)));
      EXPECT_THAT(f.Finish(),
                  StatusIs(StatusCode::kInternal, HasSubstr("no bytes written at 100")));
    } else if (std::string(fault) == "overlap") {
      UCP_ASSERT_OK(f.WriteStorage(0, 0, bytes.first(100)));
      UCP_ASSERT_OK(f.WriteStorage(0, 96, bytes.subspan(96)));
      EXPECT_THAT(f.Finish(),
                  StatusIs(StatusCode::kInternal, HasSubstr("bytes written twice at 96")));
    } else {
      EXPECT_THAT(f.WriteStorage(0, 4090, bytes.first(10)),
                  StatusIs(StatusCode::kInvalidArgument, HasSubstr("outside record")));
      EXPECT_THAT(f.WriteStorage(7, 0, bytes.first(10)),
                  StatusIs(StatusCode::kInvalidArgument, HasSubstr("not in the file")));
    }
  }
  // Nothing is left behind: no file, no temporary sibling.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  // Deferred tensors need the streamed path.
  TorchWriter w;
  Streamed s = BuildStreamed(w, 4);
  EXPECT_THAT(w.Write(dir / "y.pt", *s.root),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("WriteStreamed")));
  EXPECT_THAT(w.AddDeferredTensor(DType::kFp32, {10}, 9),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("cannot view a storage")));
}

TEST(TorchWriter, RealTorchLoadsWhatUcpWrites) {
  ucp::testing::TempDir dir;
  // 1: every kind of value, plain and with zip64 records everywhere and another prefix.
  std::vector<std::unique_ptr<TorchWriter>> writers;
  std::vector<Built> built;
  for (bool zip64 : {false, true}) {
    TorchWriteOptions opts;
    opts.zip.force_zip64 = zip64;
    opts.archive_name = zip64 ? "model_z64" : "archive";
    writers.push_back(std::make_unique<TorchWriter>(opts));
    built.push_back(BuildEverything(*writers.back(), 23, /*include_fp8=*/false));
    const std::string name = zip64 ? "everything_zip64.pt" : "everything.pt";
    UCP_ASSERT_OK(writers.back()->Write(dir / name, *built.back().root));
    json e = built.back().expect;
    e["file"] = name;
    WriteJson(dir / (name + ".expect.json"), e);
  }
  // 2: each torch-written fixture copied through CopyFrom must load equal to the original.
  const std::string fixtures = SourceRoot() + "/tests/data/torch/";
  std::vector<TorchFile> sources;
  for (const char* name :
       {"model_state_dict.pt", "model_state_dict_legacy.pt", "protocol4.pt", "adamw_optimizer.pt",
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}) {
    SCOPED_TRACE(name);
    UCP_ASSERT_OK_AND_ASSIGN(TorchFile src, TorchFile::Open(fixtures + name));
    TorchWriter w;
    UCP_ASSERT_OK_AND_ASSIGN(const PyValue* copy, w.CopyFrom(src, src.root()));
    const std::string out = std::string("copy_") + name;
    UCP_ASSERT_OK(w.Write(dir / out, *copy));
    WriteJson(dir / (out + ".expect.json"), {{"file", out}, {"same_as", fixtures + name}});
  }
  ExpectTorchLoads(dir.path());
}

}  // namespace
}  // namespace ucp::torch
