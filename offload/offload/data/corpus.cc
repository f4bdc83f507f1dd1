// Corpus building: fortune files -> documents -> a by-document train/val split -> two token files.
#include "offload/data/corpus.h"

#include <algorithm>
#include <string_view>
#include <system_error>

#include "offload/data/token_file.h"
#include "offload/data/tokenizer.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"

namespace ucp::offload {
namespace fs = std::filesystem;

namespace {

// Text files are read whole; the token count must fit an int32 anyway.
constexpr int64_t kMaxTextFileBytes = int64_t{1} << 30;

bool IsRegularFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);  // follows symlinks
}

bool HasSuffix(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool IsBlank(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; });
}

// The records of a strfile source: the text between lines that hold only "%", newlines included,
// blank records dropped (a file that starts with "%" or has "%\n%" would otherwise give some).
std::vector<std::string_view> FortuneRecords(std::string_view text) {
  std::vector<std::string_view> records;
  size_t record_start = 0;
  size_t line_start = 0;
  while (line_start < text.size()) {
    size_t line_end = text.find('\n', line_start);
    if (line_end == std::string_view::npos) line_end = text.size();
    if (text.substr(line_start, line_end - line_start) == "%") {
      std::string_view record = text.substr(record_start, line_start - record_start);
      if (!IsBlank(record)) records.push_back(record);
      record_start = std::min(line_end + 1, text.size());
    }
    line_start = line_end + 1;
  }
  std::string_view last = text.substr(record_start);
  if (!IsBlank(last)) records.push_back(last);
  return records;
}

// Reuses `path` when it holds exactly `tokens`, writes it when it is absent.
Status WriteOrReuse(const fs::path& path, const std::vector<uint16_t>& tokens) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return WriteTokenFile(path, tokens);
  UCP_ASSIGN_OR_RETURN(TokenFile existing, TokenFile::Open(path),
                       "while checking the existing corpus file");
  std::span<const uint16_t> have = existing.tokens();
  const auto [have_it, want_it] =
      std::mismatch(have.begin(), have.end(), tokens.begin(), tokens.end());
  if (have_it == have.end() && want_it == tokens.end()) return Status::Ok();
  const size_t at = static_cast<size_t>(have_it - have.begin());
  std::string detail = have.size() != tokens.size()
                           ? "it holds " + std::to_string(have.size()) + " tokens, these " +
                                 "inputs give " + std::to_string(tokens.size())
                           : "same count (" + std::to_string(tokens.size()) + " tokens)";
  return FailedPreconditionError("corpus file " + path.string() +
                                 " exists with other tokens than these inputs give (" + detail +
                                 "; first difference at token " + std::to_string(at) +
                                 "); remove it or choose another output folder");
}

}  // namespace

Result<std::vector<fs::path>> FortuneFiles(const fs::path& dir, std::vector<std::string>* skipped) {
  const std::string install_hint =
      "; install the Debian package `fortunes` (tools/setup.sh does) or give text files";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError("fortune folder " + dir.string() + " does not exist" + install_hint);
  }
  std::vector<std::string> names;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // X.dat is the index and X.u8 Debian's UTF-8 alias of X: neither is a source of its own.
    if (HasSuffix(name, ".dat") || HasSuffix(name, ".u8")) continue;
    if (IsRegularFile(it->path()) && IsRegularFile(dir / (name + ".dat"))) names.push_back(name);
  }
  if (ec) return ErrnoError("list fortune folder " + dir.string(), ec.value());
  std::sort(names.begin(), names.end());

  std::vector<fs::path> files;
  for (const std::string& name : names) {
    fs::path source = dir / name;
    // Prefer a separate UTF-8 copy where the distribution ships one (Debian's is a symlink to X).
    const fs::path u8 = dir / (name + ".u8");
    if (IsRegularFile(u8) && !fs::equivalent(source, u8, ec) && !ec) source = u8;
    UCP_ASSIGN_OR_RETURN(std::string text, io::ReadFileToString(source, kMaxTextFileBytes),
                         "while listing fortune files");
    Status valid = ValidateDocumentText(text, source.string());
    if (!valid.ok()) {
      if (skipped != nullptr) skipped->push_back(valid.message() + "; skipped");
      continue;
    }
    files.push_back(source);
  }
  if (files.empty()) {
    return NotFoundError("no fortune file (a text file X with its index X.dat beside it) in " +
                         dir.string() + install_hint);
  }
  return files;
}

Result<CorpusFiles> BuildCorpus(const std::vector<fs::path>& text_files, const fs::path& out_dir,
                                int64_t val_every, bool fortune_records) {
  if (val_every < 2) {
    return InvalidArgumentError("val_every is " + std::to_string(val_every) +
                                ", must be at least 2 (every val_every-th document is held out)");
  }
  CorpusFiles out;
  out.train = out_dir / "train.bin";
  out.val = out_dir / "val.bin";
  std::vector<uint16_t> train, val;
  for (const fs::path& file : text_files) {
    UCP_ASSIGN_OR_RETURN(std::string text, io::ReadFileToString(file, kMaxTextFileBytes),
                         "while building the corpus");
    // The whole file first, so an error names an offset in the file, not in a record.
    UCP_RETURN_IF_ERROR(ValidateDocumentText(text, file.string()));
    std::vector<std::string_view> docs;
    if (fortune_records) {
      docs = FortuneRecords(text);
    } else if (!text.empty()) {
      docs.push_back(text);
    }
    for (std::string_view doc : docs) {
      ++out.documents;
      std::vector<uint16_t>& dst = out.documents % val_every == 0 ? val : train;
      UCP_RETURN_IF_ERROR(TokenizeDocument(doc, file.string(), dst));
    }
  }
  if (out.documents == 0) {
    return InvalidArgumentError("no document in the " + std::to_string(text_files.size()) +
                                " text files given to the corpus");
  }
  if (val.empty()) {
    return InvalidArgumentError(std::to_string(out.documents) + " documents with val_every=" +
                                std::to_string(val_every) + " leave the held-out set empty");
  }
  out.train_tokens = static_cast<int64_t>(train.size());
  out.val_tokens = static_cast<int64_t>(val.size());

  std::error_code ec;
  if (!fs::is_directory(out_dir, ec)) {
    fs::create_directories(out_dir, ec);
    if (ec) return ErrnoError("create corpus folder " + out_dir.string(), ec.value());
  }
  UCP_RETURN_IF_ERROR(WriteOrReuse(out.train, train));
  UCP_RETURN_IF_ERROR(WriteOrReuse(out.val, val));
  return out;
}

}  // namespace ucp::offload
