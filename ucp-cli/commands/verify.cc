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
  UCP_ASSIGN_OR_RETURN(auto src,
                       OpenCheckpoint(path, "PATH", vm["model"].as<std::string>(), DataDir(vm),
                                      false, vm["qkv-layout"].as<std::string>(),
                                      vm["rotary-layout"].as<std::string>()));
  const api::CheckpointMeta& m = src->meta();
  // The checkpoint's own layout (a DeepSpeed folder's dp and ZeRO stage), as inspect shows it.
  const std::string shown = layout::ToString(m.own_layout());
  UCP_RETURN_IF_ERROR(api::Verify(*src), "verifying " + m.format + " " + path + " at " + shown);
  setup->Done();  // the progress line ends before the result
  if (io.json) {
    json::OrderedJson j;
    j["command"] = "verify";
    j["ok"] = true;
    j["exit_code"] = 0;
    j["source"] = SourceJson(path, *src);
    j["parameters"] = static_cast<int64_t>(m.model.params.size());
    j["elapsed_s"] = setup->Seconds();
    io.out << j.dump(2) << "\n";
    return Status::Ok();
  }
  if (setup->quiet) return Status::Ok();
  io.out << "ok: " << path << " (" << m.format << ", " << shown << ", " << m.model.params.size()
         << " parameters)\n";
  return Status::Ok();
}

Command MakeVerifyCommand() {
  return {
      .name = "verify",
      .summary = "check checksums, coverage and metadata; exit 0 only when sound",
      .usage = "PATH [--model M] [options]",
      .examples = {"ucp verify ckpt", "ucp verify ds/global_step100",
                   "ucp verify ckpt --json | jq .source.layout"},
      .description = "",
      .add_options =
          [](po::options_description& o, po::positional_options_description& p) {
            o.add_options()("path", po::value<std::string>()->required(), "checkpoint folder");
            AddModelOption(o);
            AddDataDirOption(o);
            AddRunOptions(o, /*checksums=*/false, /*memory=*/false);
            AddJsonOption(o);
            p.add("path", 1);
          },
      .run = RunVerify,
  };
}
UCP_REGISTER_COMMAND(MakeVerifyCommand);

}  // namespace
}  // namespace ucp::cli
