// `ucp extract`: `ucp convert` to full tensors: a ucp universal checkpoint by default, or another
// format of full tensors (--format hf, deepspeed-universal).
#include <ostream>

#include "ucp-cli/command.h"
#include "ucp-cli/commands/run_common.h"

namespace ucp::cli {
namespace {

Command MakeExtractCommand() {
  return {
      .name = "extract",
      .summary = "convert to full tensors: a universal checkpoint (convert --layout universal)",
      .usage = "SRC DST [--format ucp|hf|deepspeed-universal] [--model M] [options]",
      .examples = {"ucp extract ckpt universal                 # ucp universal checkpoint",
                   "ucp extract ds/global_step100 universal    # from DeepSpeed",
                   "ucp extract ckpt hf_out --format hf         # a Hugging Face folder"},
      .description =
          "Shorthand for `ucp convert SRC DST --layout universal --format ucp`: every\n"
          "parameter's full tensors and optimizer states, from any checkpoint ucp reads.",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            AddConversionOptions(o, p, "default: ucp");
          },
      .run = [](const po::variables_map& vm, CommandIo& io) -> Status {
        return RunConversion(vm, io,
                             {.command = "extract", .default_format = "ucp", .full_tensors = true});
      },
  };
}
UCP_REGISTER_COMMAND(MakeExtractCommand);

}  // namespace
}  // namespace ucp::cli
