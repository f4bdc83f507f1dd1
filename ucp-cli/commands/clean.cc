// `ucp clean DST`: removes the unfinished outputs (DST.tmp-XXXXXX) that an interrupted or killed
// run left next to DST, which the writing commands warn about. DST itself is never touched.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/output_folder.h"
#include "ucp/api/process_group.h"
#include "ucp/io/atomic_file.h"

namespace ucp::cli {
namespace {

Status RunClean(const po::variables_map& vm, CommandIo& io) {
  const std::string dst = vm["dst"].as<std::string>();
  const bool dry_run = vm.count("dry-run") > 0;
  const std::vector<StaleTemporary> stale = FindStaleTemporaries(dst);
  int64_t bytes = 0;
  for (const StaleTemporary& s : stale) {
    // Each process of an MPI launch sees the same folder; the root alone removes.
    if (!dry_run && (io.group == nullptr || io.group->is_root())) {
      io::RemoveTreeBestEffort(s.path);
    }
    io.out << (dry_run ? "would remove " : "removed ") << s.path.string() << " ("
           << HumanBytes(s.bytes) << ")\n";
    bytes += s.bytes;
  }
  if (stale.empty()) {
    io.out << "no unfinished output next to " << io::WithoutTrailingSlash(dst).string() << "\n";
  } else {
    io.out << (dry_run ? "would remove " : "removed ") << stale.size() << " unfinished output"
           << (stale.size() == 1 ? "" : "s") << ", " << HumanBytes(bytes) << "\n";
  }
  return Status::Ok();
}

Command MakeCleanCommand() {
  return {
      .name = "clean",
      .summary = "remove the unfinished outputs (DST.tmp-XXXXXX) an interrupted run left next to "
                 "DST; DST itself is not touched",
      .usage = "DST [--dry-run]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("dst", po::value<std::string>()->required(),
                            "the output folder an interrupted run was writing")(
                "dry-run", "list what would be removed, remove nothing");
            p.add("dst", 1);
          },
      .run = RunClean,
  };
}
UCP_REGISTER_COMMAND(MakeCleanCommand);

}  // namespace
}  // namespace ucp::cli
