// ucp and ucp-bench: the command-line tools (one main, two command sets). Picks the subcommand,
// parses its options, runs it, and maps its Status to an exit code (docs/errors.md). Usage errors
// exit 2; help (`ucp help CMD`, `ucp CMD -h`, `ucp CMD help`) exits 0. With --json, an error is
// one JSON object on stdout as well as the usual line on stderr.
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "ucp-cli/command.h"
#include "ucp/api/format.h"
#include "ucp/api/process_group.h"
#include "ucp/io/interrupt.h"
#include "ucp/json/strict_json.h"
#include "ucp/mpi/mpi_group.h"

namespace ucp::cli {
namespace {

std::vector<Command>& Registry() {
  static std::vector<Command> commands;
  return commands;
}

// Edit distance (insertions, deletions, substitutions), for "did you mean".
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The closest of `candidates` to `word` when it is close enough to be a typo (or `word` is a
// prefix of exactly one), else "".
std::string Closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  std::vector<std::string> prefixed;
  for (const std::string& c : candidates) {
    if (!word.empty() && c.starts_with(word)) prefixed.push_back(c);
    const size_t d = EditDistance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  if (best.empty() && prefixed.size() == 1) return prefixed[0];
  return best;
}

std::vector<std::string> CommandNames() {
  std::vector<std::string> names;
  for (const Command* c : AllCommands()) names.push_back(c->name);
  return names;
}

const Command* FindCommand(const std::string& name) {
  for (const Command* c : AllCommands()) {
    if (c->name == name) return c;
  }
  return nullptr;
}

void PrintTopHelp(std::ostream& os) {
  os << "usage: " UCP_PROGRAM
        " COMMAND [ARGS] [options]\n"
        "       " UCP_PROGRAM " help COMMAND | " UCP_PROGRAM " COMMAND --help | " UCP_PROGRAM
        " --version\n\n" UCP_PROGRAM ": " UCP_PROGRAM_SUMMARY "\n\ncommands:\n";
  for (const Command* c : AllCommands()) {
    os << "  " << c->name << std::string(12 - std::min<size_t>(11, c->name.size()), ' ')
       << c->summary << "\n";
  }
  os << "\nexit codes: 0 ok, 2 usage, 3 invalid argument, 4 not found, 5 failed precondition,\n"
        "6 data loss (corrupt input), 7 unimplemented, 8 i/o error, 9 resource exhausted,\n"
        "11 already exists, 1 difference found (diff), 130 / 143 interrupted by SIGINT /\n"
        "SIGTERM (temporary output removed); see docs/errors.md\n";
}

// One command's declared options, and which of them are positional (in order).
struct Declared {
  po::options_description all;
  po::positional_options_description pos;
  std::vector<std::string> positionals;
  explicit Declared(const Command& cmd) : all("options") {
    all.add_options()("help,h", "print this help");
    cmd.add_options(all, pos);
    for (unsigned i = 0; i < pos.max_total_count() && pos.max_total_count() < 100; ++i) {
      positionals.push_back(pos.name_for_position(i));
    }
  }
  bool IsPositional(const std::string& name) const {
    return std::find(positionals.begin(), positionals.end(), name) != positionals.end();
  }
  std::vector<std::string> OptionNames() const {
    std::vector<std::string> out;
    for (const auto& o : all.options()) {
      if (!IsPositional(o->long_name())) out.push_back("--" + o->long_name());
    }
    return out;
  }
};

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

void PrintCommandHelp(const Command& cmd, std::ostream& os) {
  Declared d(cmd);
  os << "usage: " UCP_PROGRAM " " << cmd.name << (cmd.usage.empty() ? "" : " " + cmd.usage)
     << "\n\n"
     << cmd.summary << "\n";
  if (!cmd.description.empty()) os << "\n" << cmd.description << "\n";
  if (!cmd.examples.empty()) {
    os << "\nexamples:\n";
    for (const std::string& e : cmd.examples) os << "  " << e << "\n";
  }
  // The positionals are in the usage line; the options table lists the others.
  po::options_description visible("options");
  for (const auto& o : d.all.options()) {
    if (!d.IsPositional(o->long_name())) visible.add(o);
  }
  os << "\n" << visible << "\n";
}

bool WantsJson(int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    if (std::string(argv[i]) == "--json") return true;
  }
  return false;
}

// The error as the one JSON object --json prints on stdout.
void PrintJsonError(const std::string& command, int exit_code, const std::string& code,
                    const std::string& message) {
  json::OrderedJson j;
  j["command"] = command;
  j["ok"] = false;
  j["exit_code"] = exit_code;
  j["error"] = {{"code", code}, {"message", message}};
  std::cout << j.dump(2) << "\n";
}

int UsageError(const std::string& command, const std::string& message, bool as_json) {
  std::cerr << UCP_PROGRAM << (command.empty() ? "" : " " + command) << ": usage error: " << message
            << " (see " UCP_PROGRAM " " << (command.empty() ? "--help" : "help " + command)
            << ")\n";
  if (as_json) PrintJsonError(command, 2, "usage", message);
  return 2;
}

// A boost parse error in the terms of this command: positionals by their upper-case name
// ("missing SRC"), unknown options with the closest known one.
std::string DescribeParseError(const po::error& e, const Declared& d, const po::variables_map& vm) {
  if (const auto* r = dynamic_cast<const po::required_option*>(&e)) {
    // boost names the first missing option alphabetically; the user thinks of the positionals
    // in order, then the options.
    for (const std::string& p : d.positionals) {
      if (vm.count(p) == 0 && d.all.find_nothrow(p, false) != nullptr &&
          d.all.find(p, false).semantic()->is_required()) {
        return "missing " + Upper(p);
      }
    }
    std::string name = r->get_option_name();
    while (name.starts_with("-")) name.erase(0, 1);
    if (d.IsPositional(name)) return "missing " + Upper(name);
    return "missing --" + name;
  }
  if (const auto* u = dynamic_cast<const po::unknown_option*>(&e)) {
    const std::string opt = u->get_option_name();
    std::string msg = "unknown option " + opt;
    const std::string near = Closest(opt, d.OptionNames());
    if (!near.empty()) msg += "; did you mean " + near + "?";
    return msg;
  }
  if (dynamic_cast<const po::too_many_positional_options_error*>(&e) != nullptr) {
    std::string names;
    for (const std::string& p : d.positionals) names += (names.empty() ? "" : " ") + Upper(p);
    return "too many arguments (expected " + (names.empty() ? std::string("none") : names) + ")";
  }
  return e.what();
}

int Run(int argc, char** argv) {
  const std::string first = argc < 2 ? "" : argv[1];
  // Before any thread exists: SIGINT/SIGTERM remove this run's temporary outputs (io/interrupt.h).
  // The line a signal prints names the command the user typed from this moment on: a signal
  // that lands while the arguments are still being read must not say only "ucp".
  const Command* typed = FindCommand(first);
  io::StartInterruptWatcher(typed == nullptr ? std::string(UCP_PROGRAM)
                                             : std::string(UCP_PROGRAM " ") + typed->name);
  if (argc < 2 || first == "--help" || first == "-h" || (first == "help" && argc == 2)) {
    PrintTopHelp(argc < 2 ? std::cerr : std::cout);
    return argc < 2 ? 2 : 0;
  }
  if (first == "--version" || first == "-V") {
    std::cout << UCP_PROGRAM " " << UCP_VERSION << "\n";
    return 0;
  }
  if (first == "completion") {  // hidden: not in the table it is built from
    if (argc != 3 || std::string(argv[2]) != "bash") {
      return UsageError("", "expected `" UCP_PROGRAM " completion bash`", false);
    }
    std::cout << BashCompletion();
    return 0;
  }
  std::string name = first == "help" ? argv[2] : first;
  const Command* cmd = FindCommand(name);
  if (cmd == nullptr) {
    std::string msg = "unknown command \"" + name + "\"";
    const std::string near = Closest(name, CommandNames());
    if (!near.empty()) msg += "; did you mean \"" + near + "\"?";
    return UsageError("", msg, false);
  }
  if (first == "help" || (argc == 3 && std::string(argv[2]) == "help")) {
    PrintCommandHelp(*cmd, std::cout);
    return 0;
  }
  // Under MPI every process speaks until the group is known; then only the root does, below.
  io::SetInterruptContext(std::string(UCP_PROGRAM " ") + cmd->name, true,
                          isatty(STDERR_FILENO) != 0);
  const bool as_json = WantsJson(argc, argv);
  Declared d(*cmd);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc - 1, argv + 1).options(d.all).positional(d.pos).run(),
              vm);
    if (vm.count("help")) {
      PrintCommandHelp(*cmd, std::cout);
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    return UsageError(cmd->name, DescribeParseError(e, d, vm), as_json);
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
  io::SetInterruptContext(std::string(UCP_PROGRAM " ") + cmd->name, speaks, io.is_terminal);
  io.json = vm.count("json") > 0;
  Status s = cmd->run(vm, io);
  std::cout.flush();
  if (!s.ok()) {
    if (speaks) {
      std::cerr << UCP_PROGRAM " " << cmd->name << ": error: " << s.message() << " ["
                << StatusCodeName(s.code()) << "]\n";
      if (io.json) {
        PrintJsonError(cmd->name, ExitCodeFor(s.code()), std::string(StatusCodeName(s.code())),
                       s.message());
      }
    }
    return ExitCodeFor(s.code());
  }
  return io.exit_code;
}

std::vector<std::string> WriterNames() {
  std::vector<std::string> out;
  for (const api::CheckpointFormat* f : api::Formats().formats()) {
    if (f->writes()) out.emplace_back(f->name());
  }
  return out;
}

// A bash word list (names of commands, options and formats: no quoting needed).
std::string Words(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

}  // namespace

std::vector<const Command*> AllCommands() {
  std::vector<const Command*> out;
  for (const Command& c : Registry()) out.push_back(&c);
  std::sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->name < b->name; });
  return out;
}

std::string BashCompletion() {
  std::string fn = "_" UCP_PROGRAM;
  std::replace(fn.begin(), fn.end(), '-', '_');
  std::ostringstream os;
  os << "# bash completion for " UCP_PROGRAM ", generated by `" UCP_PROGRAM
        " completion bash` from its command table\n"
     << fn << "() {\n"
     << "  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} opts=\n"
     << "  if [ \"$COMP_CWORD\" -eq 1 ]; then\n"
     << "    COMPREPLY=($(compgen -W \"" << Words(CommandNames())
     << " help --help --version\" -- \"$cur\"))\n"
     << "    return\n  fi\n"
     << "  case \"${COMP_WORDS[1]}\" in\n"
     << "    help) COMPREPLY=($(compgen -W \"" << Words(CommandNames())
     << "\" -- \"$cur\")); return ;;\n";
  for (const Command* c : AllCommands()) {
    Declared d(*c);
    std::vector<std::string> names = d.OptionNames();
    os << "    " << c->name << ") opts=\"" << Words(names) << "\" ;;\n";
  }
  os << "  esac\n"
     << "  case \"$prev\" in\n"
     << "    --format) COMPREPLY=($(compgen -W \"" << Words(WriterNames())
     << "\" -- \"$cur\")); return ;;\n"
     << "  esac\n"
     << "  if [[ $cur == -* ]]; then\n"
     << "    COMPREPLY=($(compgen -W \"$opts\" -- \"$cur\"))\n"
     << "  else\n"
     << "    COMPREPLY=($(compgen -f -- \"$cur\"))\n"
     << "  fi\n"
     << "}\n"
     << "complete -o filenames -F " << fn << " " UCP_PROGRAM "\n";
  return os.str();
}

bool internal::RegisterCommand(Command (*factory)()) {
  Registry().push_back(factory());
  return true;
}

}  // namespace ucp::cli

int main(int argc, char** argv) { return ucp::cli::Run(argc, argv); }
