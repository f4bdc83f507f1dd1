// Corpora: text files turned into a training and a held-out token file. The built-in default is
// the English of Debian's `fortunes` packages (/usr/share/games/fortunes, installed by
// tools/setup.sh): each fortune (strfile format, records separated by a line "%") is a document.
// Nothing is downloaded.
//
// Which files. FortuneFiles takes every file X of the folder that has a strfile index X.dat beside
// it (the index is how strfile marks a fortune source; README-like files have none). Debian also
// ships X.u8 as a symlink to X, so X.u8 is never counted as a file of its own; where X.u8 is a
// separate file (distributions that keep a legacy-encoded X and a UTF-8 copy), X.u8 is read
// instead of X, so each text is counted once and in UTF-8. A source that is still not valid
// UTF-8, or holds a NUL, is skipped with a reason rather than transcoded: guessing latin-1 would
// turn another encoding into wrong text silently. (Debian's fortunes 1:1.99.1 and fortunes-min
// are all UTF-8: nothing is skipped.) Subfolders (Debian's rot13 `off/`, other languages) are not
// searched.
//
// Documents and split. A fortune file splits at lines that hold only "%"; each record, newlines
// included and empty or whitespace-only records dropped, is one document, tokenized as its bytes
// then kEndOfText (tokenizer.h). Documents are numbered 1, 2, ... over all files in the given
// order; number k goes to the held-out set when k % val_every == 0 and to the training set
// otherwise, so the split is by document (no fortune is cut in two) and needs no random numbers.
//
// Determinism. The outputs are a function of the input bytes and val_every only: the same files
// give the same train.bin and val.bin, byte for byte, on every machine.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "ucp/base/result.h"

namespace ucp::offload {

/// What BuildCorpus wrote (or found already written).
struct CorpusFiles {
  std::filesystem::path train;  ///< token files (token_file.h): out_dir/train.bin
  std::filesystem::path val;    ///< out_dir/val.bin
  int64_t documents = 0;        ///< both sets together
  int64_t train_tokens = 0;     ///< kEndOfText included (one per document)
  int64_t val_tokens = 0;
};

/// The fortune text files of `dir` (strfile sources: files with a matching .dat beside them),
/// sorted by name, so the corpus is the same on every machine with the same packages. A file that
/// is not valid UTF-8 (or holds a NUL) is left out, and when `skipped` is given, one line per file
/// left out is appended to it ("<file>: invalid UTF-8 at byte offset N (byte 0xE9); skipped").
/// Errors: kNotFound (no such folder, or no fortune file in it; the message says to install the
/// `fortunes` package), kIoError (reading a file).
Result<std::vector<std::filesystem::path>> FortuneFiles(
    const std::filesystem::path& dir = "/usr/share/games/fortunes",
    std::vector<std::string>* skipped = nullptr);

/// Splits every file into documents (fortune records, or the whole file for plain text), puts
/// every `val_every`-th document (1-based count over all files in order) into the held-out set
/// and the rest into the training set, and writes `out_dir/train.bin` and `out_dir/val.bin`
/// (creating `out_dir` if needed). Deterministic. Files that exist already are reused when they
/// parse and hold exactly the tokens these inputs give (so a run can call it on every start); a
/// file that holds other tokens is an error, never silently trained on. The corpus is built in
/// memory either way: it is small (the fortunes are 2.7 MB).
/// Errors: kInvalidArgument (val_every < 2, no document at all, no document in the held-out set,
/// a file that is not UTF-8 or holds a NUL, naming the file and byte offset),
/// kFailedPrecondition (an existing train.bin / val.bin with other tokens, naming the file and
/// the first differing token), kNotFound (a text file), kResourceExhausted (a text file over
/// 1 GiB), kIoError (reading a text file, creating out_dir), as
/// WriteTokenFile / TokenFile::Open.
Result<CorpusFiles> BuildCorpus(const std::vector<std::filesystem::path>& text_files,
                                const std::filesystem::path& out_dir, int64_t val_every = 20,
                                bool fortune_records = true);

}  // namespace ucp::offload
