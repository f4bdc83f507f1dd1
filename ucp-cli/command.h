// The shape of one `ucp` subcommand. Each file in commands/ defines one and registers it with
// UCP_REGISTER_COMMAND, so adding a subcommand touches no shared file.
#pragma once

#include <boost/program_options.hpp>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "ucp/base/status.h"

namespace ucp::api {
class ProcessGroup;
}  // namespace ucp::api

namespace ucp::cli {

namespace po = boost::program_options;

struct CommandIo {
  std::ostream& out;  // results (what --json prints, tables)
  std::ostream& err;  // progress and warnings; the final error line is main's job
  bool is_terminal;   // stderr is a terminal: progress bars allowed
  int exit_code = 0;  // set by a command that succeeds but reports a finding (diff: 1)
  /// --json: the command prints one JSON object on `out` (and main prints errors as one).
  bool json = false;
  /// The processes running this command together when an MPI launcher started them (null
  /// otherwise). Only the root's `out` and `err` reach the terminal.
  api::ProcessGroup* group = nullptr;
};

struct Command {
  std::string name;
  std::string summary;  // one line for `ucp --help`
  std::string usage;    // "SRC DST [--layout L]": what follows `ucp NAME` in the usage line
  /// Two or three command lines for `ucp NAME --help`, each "COMMAND LINE  # what it does".
  std::vector<std::string> examples;
  /// A longer description for --help (a few lines); may be empty.
  std::string description;
  /// Declares the options and positional arguments. A positional argument is declared as an
  /// option named in lower case (`src`) and shown as its upper-case name (SRC) in usage and in
  /// "missing SRC" errors; --help lists the others.
  std::function<void(po::options_description&, po::positional_options_description&)> add_options;
  /// Runs with the parsed options. A non-ok Status becomes one line on stderr and its exit code.
  std::function<Status(const po::variables_map&, CommandIo&)> run;
};

/// All registered commands, sorted by name.
std::vector<const Command*> AllCommands();

/// `ucp completion bash`: a bash completion script built from the command table (commands,
/// each command's options). Defined in main.cc.
std::string BashCompletion();

namespace internal {
bool RegisterCommand(Command (*factory)());
}  // namespace internal

}  // namespace ucp::cli

#define UCP_REGISTER_COMMAND(factory)                           \
  [[maybe_unused]] static const bool ucp_registered_##factory = \
      ::ucp::cli::internal::RegisterCommand(&factory)
