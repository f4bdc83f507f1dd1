// `ucp version`: the version and the build's optional parts.
#include <ostream>

#include "ucp-cli/command.h"

namespace ucp::cli {
namespace {

Command MakeVersionCommand() {
  return {
      .name = "version",
      .summary = "print the version of ucp",
      .usage = "",
      .add_options = [](po::options_description&, po::positional_options_description&) {},
      .run = [](const po::variables_map&, CommandIo& io) -> Status {
        io.out << "ucp " << UCP_VERSION << "\n";
        return Status::Ok();
      },
  };
}
UCP_REGISTER_COMMAND(MakeVersionCommand);

}  // namespace
}  // namespace ucp::cli
