// `ucp convert`: any checkpoint ucp reads -> any format it writes, at any layout, streaming (no
// universal copy). Omitted --layout keys and --format keep the source's (run_common.h).
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"

namespace ucp::cli {
namespace {

Command MakeConvertCommand() {
  return {
      .name = "convert",
      .summary = "convert any checkpoint ucp reads into any format it writes, at any layout",
      .usage = "SRC DST [--layout L] [--format F] [--model M] [options]",
      .examples =
          {"ucp convert ds/global_step100 ds_tp1 --layout tp=1   # DeepSpeed at tp=1; dp, zero "
           "kept",
           "ucp convert ckpt ckpt_tp4 --layout tp=4,dp=2       # ucp at another layout",
           "ucp convert hf_dir ckpt --format ucp --layout tp=2   # Hugging Face -> ucp at tp=2"},
      .description =
          "SRC is a ucp (distributed or universal), DeepSpeed or Hugging Face checkpoint. The\n"
          "output keeps the source's format family (DeepSpeed in, DeepSpeed out) unless --format\n"
          "says otherwise, and the source's layout for every key --layout does not name\n"
          "(`--layout tp=1` from dp=2,zero=1 gives tp=1,dp=2,zero=1). Formats of full tensors\n"
          "(hf) take no --layout.",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("layout", po::value<std::string>(),
                            "target layout keys, tp=4,pp=1,dp=2,sp=1,ep=1,zero=1 or universal; "
                            "keys not given keep the source's values");
            AddConversionOptions(o, p, "default: the source's family");
          },
      .run = [](const po::variables_map& vm, CommandIo& io) -> Status {
        return RunConversion(vm, io, {.command = "convert"});
      },
  };
}
UCP_REGISTER_COMMAND(MakeConvertCommand);

}  // namespace
}  // namespace ucp::cli
