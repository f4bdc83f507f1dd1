// `ucp verify`: checksums, tensor set, coverage and replica equality of a checkpoint.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"
#include "ucp/layout/layout.h"

namespace ucp::cli {
namespace {

Status RunVerify(const po::variables_map& vm, CommandIo& io) {
  UCP_ASSIGN_OR_RETURN(auto setup, SetupRun(vm, io, "verify"));
  const std::string path = vm["path"].as<std::string>();
  UCP_ASSIGN_OR_RETURN(auto src, OpenCheckpoint(path, "PATH", vm["model"].as<std::string>()));
  UCP_RETURN_IF_ERROR(api::Verify(*src), "verifying " + path);
  io.out << "ok: " << path << " (" << src->meta().format << ", "
         << layout::ToString(src->meta().layout) << ", " << src->meta().model.params.size()
         << " parameters)\n";
  return Status::Ok();
}

Command MakeVerifyCommand() {
  return {
      .name = "verify",
      .summary = "check checksums, coverage and metadata; exit 0 only when sound",
      .usage = "PATH [--model M]",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("path", po::value<std::string>()->required(), "checkpoint folder");
            AddModelOption(o);
            AddRunOptions(o);
            p.add("path", 1);
          },
      .run = RunVerify,
  };
}
UCP_REGISTER_COMMAND(MakeVerifyCommand);

}  // namespace
}  // namespace ucp::cli
