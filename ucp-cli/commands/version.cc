// `ucp version`: the version (also `ucp --version`, `ucp -V`).
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"

namespace ucp::cli {
namespace {

Command MakeVersionCommand() {
  return {
      .name = "version",
      .summary = "print the version of ucp",
      .usage = "[--json]",
      .examples = {"ucp version", "ucp --version", "ucp version --json"},
      .description = "",
      .add_options = [](po::options_description& o,
                        po::positional_options_description&) { AddJsonOption(o); },
      .run = [](const po::variables_map&, CommandIo& io) -> Status {
        if (io.json) {
          json::OrderedJson j;
          j["command"] = "version";
          j["ok"] = true;
          j["exit_code"] = 0;
          j["version"] = UCP_VERSION;
          io.out << j.dump(2) << "\n";
          return Status::Ok();
        }
        io.out << "ucp " << UCP_VERSION << "\n";
        return Status::Ok();
      },
  };
}
UCP_REGISTER_COMMAND(MakeVersionCommand);

}  // namespace
}  // namespace ucp::cli
