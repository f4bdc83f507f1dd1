// ucp and ucp-bench: the command-line tools (one main, two command sets). Picks the subcommand,
// parses its options, runs it, and maps its Status to an exit code (docs/errors.md). Usage errors
// exit 2; `--help` exits 0.
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>

#include "ucp-cli/command.h"
#include "ucp/api/process_group.h"
#include "ucp/mpi/mpi_group.h"

namespace ucp::cli {
namespace {

std::vector<Command>& Registry() {
  static std::vector<Command> commands;
  return commands;
}

void PrintTopHelp(std::ostream& os) {
  os << UCP_PROGRAM ": " UCP_PROGRAM_SUMMARY
                    "\n\n"
                    "usage: " UCP_PROGRAM " COMMAND [options]   (" UCP_PROGRAM
                    " COMMAND --help for its options)\n\ncommands:\n";
  for (const Command* c : AllCommands()) {
    os << "  " << c->name << std::string(12 - std::min<size_t>(11, c->name.size()), ' ')
       << c->summary << "\n";
  }
  os << "\nexit codes: 0 ok, 2 usage, 3 invalid argument, 4 not found, 5 failed precondition,\n"
        "6 data loss (corrupt input), 7 unimplemented, 8 i/o error, 9 resource exhausted,\n"
        "11 already exists, 1 difference found (diff); see docs/errors.md\n";
}

int Run(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    PrintTopHelp(argc < 2 ? std::cerr : std::cout);
    return argc < 2 ? 2 : 0;
  }
  if (std::string(argv[1]) == "--version") {
    std::cout << UCP_PROGRAM " " << UCP_VERSION << "\n";
    return 0;
  }
  std::string name = argv[1];
  const Command* cmd = nullptr;
  for (const Command* c : AllCommands()) {
    if (c->name == name) cmd = c;
  }
  if (cmd == nullptr) {
    std::cerr << UCP_PROGRAM ": error: unknown command \"" << name
              << "\" (see " UCP_PROGRAM " --help)\n";
    return 2;
  }
  po::options_description opts(std::string(UCP_PROGRAM " ") + cmd->name + " " + cmd->usage +
                               "\n\n" + cmd->summary + "\n\noptions");
  opts.add_options()("help,h", "print this help");
  po::positional_options_description pos;
  cmd->add_options(opts, pos);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc - 1, argv + 1).options(opts).positional(pos).run(), vm);
    if (vm.count("help")) {
      std::cout << opts << "\n";
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << UCP_PROGRAM " " << cmd->name << ": usage error: " << e.what()
              << " (see " UCP_PROGRAM " " << cmd->name << " --help)\n";
    return 2;
  }
  // Under an MPI launcher the processes run the command together (api::ProcessGroup); they agree
  // on the outcome, so the root alone speaks for all of them.
  std::unique_ptr<api::ProcessGroup> group;
  if (mpi::LaunchedByMpi()) {
    Result<std::unique_ptr<api::ProcessGroup>> g = mpi::WorldGroup();
    if (!g.ok()) {
      std::cerr << UCP_PROGRAM ": error: " << g.status().message() << "\n";
      return ExitCodeFor(g.status().code());
    }
    group = std::move(*g);
  }
  const bool speaks = group == nullptr || group->is_root();
  std::ostream quiet(nullptr);
  CommandIo io{speaks ? std::cout : quiet, speaks ? std::cerr : quiet,
               speaks && isatty(STDERR_FILENO) != 0};
  io.group = group.get();
  Status s = cmd->run(vm, io);
  std::cout.flush();
  if (!s.ok()) {
    if (speaks) {
      std::cerr << UCP_PROGRAM " " << cmd->name << ": error: " << s.message() << " ["
                << StatusCodeName(s.code()) << "]\n";
    }
    return ExitCodeFor(s.code());
  }
  return io.exit_code;
}

}  // namespace

std::vector<const Command*> AllCommands() {
  std::vector<const Command*> out;
  for (const Command& c : Registry()) out.push_back(&c);
  std::sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->name < b->name; });
  return out;
}

bool internal::RegisterCommand(Command (*factory)()) {
  Registry().push_back(factory());
  return true;
}

}  // namespace ucp::cli

int main(int argc, char** argv) { return ucp::cli::Run(argc, argv); }
