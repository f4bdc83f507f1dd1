// `ucp reshard`: `ucp convert` with a --layout it requires: the same checkpoint (same format
// family unless --format) at another layout.
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"

namespace ucp::cli {
namespace {

Command MakeReshardCommand() {
  return {
      .name = "reshard",
      .summary = "convert to another layout, same format family (convert with --layout required)",
      .usage = "SRC DST --layout L [--format F] [options]",
      .examples =
          {"ucp reshard universal ckpt_tp2 --layout tp=2,pp=2,dp=2,zero=1",
           "ucp reshard ds/global_step100 ds_dp4 --layout dp=4   # DeepSpeed stays DeepSpeed",
           "ucp reshard universal dsu --layout tp=2 --format deepspeed-universal"},
      .description =
          "Shorthand for `ucp convert SRC DST --layout L`: keys --layout does not name keep the\n"
          "source's values, and the output is of the source's family (a ucp universal source\n"
          "gives a ucp distributed checkpoint) unless --format names another.",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("layout", po::value<std::string>()->required(),
                            "target layout keys, tp=4,pp=1,dp=2,sp=1,ep=1,zero=1; keys not given "
                            "keep the source's values");
            AddConversionOptions(o, p, "default: the source's family");
          },
      .run = [](const po::variables_map& vm, CommandIo& io) -> Status {
        return RunConversion(vm, io, {.command = "reshard", .needs_layout = true});
      },
  };
}
UCP_REGISTER_COMMAND(MakeReshardCommand);

}  // namespace
}  // namespace ucp::cli
