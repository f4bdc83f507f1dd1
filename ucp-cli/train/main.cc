// ucp-train: trains a GPT or LLaMA model with the offload engine, saving and restoring through
// libucp (docs/train.md). One line per step on stdout, the same records as JSON lines in
// RUN/log.jsonl. Exit codes as ucp's (docs/errors.md): 2 usage, 3 invalid argument, 4 not found,
// 5 failed precondition, 6 data loss, 7 unimplemented, 8 i/o, 11 already exists.
#include <boost/program_options.hpp>
#include <chrono>
#include <csignal>
#include <cinttypes>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>

#include "offload/comm/communicator.h"
#include "offload/data/token_file.h"
#include "offload/data/tokenizer.h"
#include "offload/train/trainer.h"
#ifdef UCP_TRAIN_HAVE_CUDA
#include "offload/cuda/cuda_train_device.h"
#endif
#include "ucp/base/status.h"
#include "ucp/base/status_macros.h"
#include "ucp/exec/executor.h"
#include "ucp/io/interrupt.h"

namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;
using ucp::offload::RunOptions;
using ucp::offload::TrainConfig;
using ucp::offload::Trainer;

constexpr const char* kUsage = "usage: ucp-train [--model M] [--data D] [--steps N] --out RUN\n"
                               "       ucp-train --resume RUN [--steps N]\n"
                               "       ucp-train --init CKPT --out RUN [options]\n"
                               "       ucp-train --plan [--device-memory 141G] [options]";

// Options that define the run: recorded in every checkpoint, and on --resume taken from it (an
// explicit value must then equal the recorded one).
void AddRunOptions(po::options_description& o, TrainConfig& c) {
  o.add_options()
    ("model", po::value(&c.model)->default_value(c.model),
     "model preset (patterns/models: gpt-tiny, llama-tiny, llama-tiny-tied, gpt2-small, ...) or "
     "a model .json")
    ("dtype", po::value(&c.dtype), "training dtype: bf16, fp16 or fp32 (default: the preset's)")
    ("data", po::value(&c.data)->default_value(c.data),
     "'fortunes' (Debian's fortunes, split into train/held-out documents), a token file in "
     "llm.c's format, or a text file (bytes as tokens)")
    ("seq-len", po::value(&c.seq_len)->default_value(0),
     "tokens per sample (0: the model's max_positions, at most 256)")
    ("global-batch", po::value(&c.global_batch)->default_value(c.global_batch),
     "samples per optimizer step, whatever the layout")
    ("micro-batch", po::value(&c.micro_batch)->default_value(0),
     "samples per forward/backward (0: the whole batch); must divide the global batch")
    ("lr", po::value(&c.lr)->default_value(c.lr), "peak learning rate")
    ("min-lr", po::value(&c.min_lr)->default_value(c.min_lr), "learning rate at the end of decay")
    ("warmup-samples", po::value(&c.warmup_samples)->default_value(-1),
     "linear warm-up length in samples (-1: 5% of steps x global batch)")
    ("decay-samples", po::value(&c.decay_samples)->default_value(-1),
     "cosine decay ends here, in samples (-1: steps x global batch)")
    ("beta1", po::value(&c.beta1)->default_value(c.beta1), "AdamW beta1")
    ("beta2", po::value(&c.beta2)->default_value(c.beta2), "AdamW beta2")
    ("eps", po::value(&c.eps)->default_value(c.eps), "AdamW epsilon")
    ("weight-decay", po::value(&c.weight_decay)->default_value(c.weight_decay),
     "decoupled weight decay (all parameters)")
    ("clip-grad", po::value(&c.clip_grad)->default_value(c.clip_grad),
     "clip the global gradient L2 norm to this (0: off)")
    ("init-std", po::value(&c.init_std)->default_value(c.init_std),
     "std of the normal initialisation (output projections scaled by 1/sqrt(2 layers))")
    ("loss-scale", po::value(&c.initial_loss_scale)->default_value(c.initial_loss_scale),
     "fp16: initial dynamic loss scale")
    ("loss-scale-window", po::value(&c.loss_scale_window)->default_value(c.loss_scale_window),
     "fp16: clean steps before the scale doubles")
    ("seed", po::value(&c.seed)->default_value(c.seed),
     "seed of the initialisation and the sample order")
    ("deterministic", po::bool_switch(&c.deterministic),
     "bitwise the same training at any dp that is a power of two dividing the global batch "
     "(per-sample gradients added in one fixed tree; slower)")
    ("layout", po::value(&c.layout)->default_value(c.layout),
     "the layout of the run's checkpoints (one process: tp=1,pp=1,dp=1, zero 0, 1 or 2)");
}

// What a resumed run may change.
const char* const kResumeOverrides[] = {"steps",      "val-every", "val-samples",
                                        "save-every", "keep",      "layout"};

}  // namespace

int main(int argc, char** argv) {
  // Before any thread exists: SIGINT/SIGTERM remove an unfinished save's temporary folder and
  // exit 130/143 (io/interrupt.h); committed checkpoints stay.
  ucp::io::StartInterruptWatcher("ucp-train");
  TrainConfig c;
  RunOptions r;
  std::string out, resume, init, data_dir, corpus_dir, tokenize, tokens_out;
  std::string device_memory, host_memory, gpu_tail_buckets;
  bool quiet = false, sync_save = false, plan = false, sync_finish = false;
  int64_t kill_at = -1;
  int kill_rank = -1;
  po::options_description run("run definition (recorded in checkpoints)");
  AddRunOptions(run, c);
  run.add_options()
    ("steps", po::value(&c.steps)->default_value(c.steps), "train until this many steps are done")
    ("val-every", po::value(&c.val_every)->default_value(c.val_every),
     "held-out loss every N steps (0: at the end only)")
    ("val-samples", po::value(&c.val_samples)->default_value(c.val_samples),
     "held-out samples per validation (0: no validation)")
    ("save-every", po::value(&c.save_every)->default_value(0),
     "save every N steps (0: only at the end)")
    ("keep", po::value(&c.keep)->default_value(0), "keep the newest K checkpoints (0: all)");
  po::options_description io("where and how");
  io.add_options()
    ("help,h", "print this help")
    ("out", po::value(&out), "run folder: step_NNNNNNNN/ checkpoints, latest, log.jsonl, data/")
    ("resume", po::value(&resume),
     "continue a run (its folder or one checkpoint) with its recorded config; --out defaults to "
     "the run folder")
    ("init", po::value(&init),
     "start at step 0 from the weights of any checkpoint ucp reads (ucp, universal, DeepSpeed); "
     "the model is the checkpoint's")
    ("sync-save", po::bool_switch(&sync_save), "write checkpoints in the foreground")
    ("pipeline", po::value(&r.pipeline)->default_value("sync"),
     "optimizer pipeline: sync (Adam after backward) or overlap (buckets stepped speculatively "
     "during backward and, with several processes, reduced per bucket as backward produces "
     "them; validated after it; bitwise the same training as sync)")
    ("device", po::value(&r.device)->default_value("cpu"),
     "where forward and backward run: cpu, or cuda (bf16 weights on the GPU, gradients to the "
     "CPU Adam on fp32 masters in host memory, updated weights back; with --pipeline overlap "
     "bucket by bucket during backward, one process, bf16/fp16), or twin (the CPU standing in "
     "for a device, for tests). Not recorded: a checkpoint resumes on either")
    ("gpu-tail-buckets", po::value(&gpu_tail_buckets)->default_value("0"),
     "the last N buckets of backward (first layers, embeddings) stepped on the device: overlap "
     "on the CPU, or --device cuda|twin (a device Adam on device-resident fp32 masters; one "
     "process), or auto: as many as the device's memory leaves room for (the memory plan's)")
    ("adam-threads", po::value(&r.adam_threads)->default_value(0),
     "--pipeline overlap: the CPU Adam's threads of --threads (0: half where the model runs on "
     "this CPU, all but 2 beside a GPU, all but 3 with several processes)")
    ("pin-threads", po::bool_switch(&r.pin_threads),
     "pin the CPU Adam's threads one to a CPU: the last of this process's CPUs, leaving the first "
     "to the threads that launch, copy and communicate (Linux; with several processes on a host "
     "bind each to CPUs of its own, or it is refused). The same bits")
    ("speculation", po::value(&r.speculation)->default_value("auto"),
     "--pipeline overlap: auto (each bucket's Adam stepped speculatively during backward, except "
     "in a step after a clipped one, whose buckets wait for validation), always, or off (no "
     "speculative steps and no snapshots: 12 B/parameter less host memory; on a device the Adam "
     "runs under the next step's forward). The same bits")
    ("sync-finish", po::bool_switch(&sync_finish),
     "--pipeline overlap on a device (one process, bf16): finish each step (the clip "
     "corrections, the weights to the device) before the next begins, instead of under the next "
     "step's forward, which waits for each layer's weights as it reaches them (the same bits)")
    ("weights", po::value(&r.weights)->default_value("auto"),
     "with a device: where its weights live: resident, streamed (the embeddings and the head, "
     "and two layer windows through which each layer crosses when forward and backward reach "
     "it; checked on the CPU twin, not yet run on a GPU), or auto (the memory plan's choice "
     "for --device-memory, by default a --device cuda run's GPU; resident when unknown). The "
     "same bits")
    ("host-buffers", po::value(&r.host_buffers)->default_value("auto"),
     "with a device: what host memory keeps of its weights and gradients: whole (a pinned copy "
     "of each), staged (384 MiB of pinned windows: the host holds only the optimizer state, "
     "6 B/parameter less in bf16; the gradients cross twice, for the norm and for Adam; bf16, "
     "one process or several at ZeRO 1-3, --pipeline sync, resident weights), or auto (staged "
     "where it runs in one process and only staged fits --host-memory, by default this "
     "machine's available memory). The same bits")
    ("gpu-gemm", po::value(&r.gpu_gemm)->default_value("auto"),
     "--device cuda: what the matrix products read: auto (bf16 training: the bf16 weights and "
     "bf16-rounded activations, fp32 accumulation on the tensor cores; else fp32) or fp32 (the "
     "fp32 copy of the weights: within 1e-5 of the CPU engine)")
    ("gpu-attention", po::value(&r.gpu_attention)->default_value("gemm"),
     "--device cuda, bf16 GEMMs: attention through batched GEMMs over T x T scores (gemm) or "
     "the tiled flash kernels (flash: causal FLOPs only, no T x T buffers; head_dim 64, 80, 96 "
     "or 128)")
    ("recompute", po::value(&r.recompute)->default_value("none"),
     "activation checkpointing (CPU or device): none; all (each layer keeps only its output, "
     "one layer's other activations are shared, and backward reruns each layer's forward); N "
     "(the first N layers so, the others keep everything); or auto (the fewest layers that "
     "fit --device-memory, by default the GPU's, or on the CPU --host-memory). Up to a third "
     "more compute for a fraction of the activation memory; the same bits")
    ("trace", po::value(&r.trace), "overlap: write a Chrome trace (Perfetto) of the first 3 steps")
    ("threads", po::value(&r.threads)->default_value(0),
     "threads per process (0: the CPUs this process may run on, e.g. its share under mpirun "
     "--bind-to; on --resume, the run's recorded count, so that the "
     "resumed steps repeat the same bits)")
    ("data-dir", po::value(&data_dir), "rule sets and presets (default: $UCP_DATA_DIR or the "
                                       "source tree's patterns/)")
    ("corpus-dir", po::value(&corpus_dir), "fortune files for --data fortunes (default "
                                           "/usr/share/games/fortunes)")
    ("quiet,q", po::bool_switch(&quiet), "print errors only")
    ("plan", po::bool_switch(&plan),
     "print the memory plan (bytes per tensor class: the CPU engine's, and on a GPU with the "
     "optimizer offloaded) and exit, allocating nothing")
    ("device-memory", po::value(&device_memory),
     "the GPU's memory (e.g. 141G, 80GiB) for --plan and --weights auto: decides resident or "
     "streamed weights (a --device cuda run: the GPU's own by default)")
    ("host-memory", po::value(&host_memory),
     "host memory for --plan and --host-buffers auto (default: this machine's MemAvailable)")
    ("tokenize", po::value(&tokenize),
     "only turn this UTF-8 text file into a token file (bytes as tokens, llm.c's format) at "
     "--tokens-out, and exit")
    ("tokens-out", po::value(&tokens_out), "the token file --tokenize writes")
    ("kill-at", po::value(&kill_at)->default_value(-1),
     "fault injection for tests and demos: once step N is done and its checkpoint (if any) "
     "committed, one process kills itself with SIGKILL")
    ("kill-rank", po::value(&kill_rank)->default_value(-1),
     "the process --kill-at kills (default: the last rank)");
  po::options_description all;
  all.add(run).add(io);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(all).run(), vm);
    if (vm.count("help")) {
      std::cout << "ucp-train: train a GPT or LLaMA model on the CPU (or a CUDA GPU), saving and restoring "
                   "through libucp\n\n"
                << kUsage << "\n\n" << all
                << "\nexit codes: 0 ok, 2 usage, 3 invalid argument, 4 not found, 5 failed "
                   "precondition,\n6 data loss, 7 unimplemented, 8 i/o error, 11 already exists "
                   "(docs/errors.md)\n";
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "ucp-train: usage error: " << e.what() << " (see ucp-train --help)\n";
    return 2;
  }
  // One process per rank of the layout under mpirun; alone otherwise (no MPI touched).
  auto world = ucp::offload::WorldCommunicator();
  if (!world.ok()) {
    std::cerr << "ucp-train: error: " << world.status().message() << "\n";
    return ucp::ExitCodeFor(world.status().code());
  }
  ucp::offload::Communicator& comm = **world;
  const bool speaks = comm.rank() == 0;
  if (!speaks) quiet = true;
  // A failing process whose peers may wait in a collective ends the whole job (returning from
  // main would leave them waiting forever in MPI_Finalize).
  auto fail = [&](const ucp::Status& s) {
    std::cerr << "ucp-train: error" << (comm.size() > 1 ? " (rank " + std::to_string(comm.rank()) + ")" : "")
              << ": " << s.message() << " [" << ucp::StatusCodeName(s.code()) << "]\n";
    const int code = ucp::ExitCodeFor(s.code());
    if (comm.size() > 1) comm.Abort(code);
    return code;
  };
  if (!tokenize.empty()) {
    if (tokens_out.empty()) {
      std::cerr << "ucp-train: usage error: --tokenize needs --tokens-out FILE\n";
      return 2;
    }
    std::vector<uint16_t> tokens;
    ucp::Status s = ucp::offload::TokenizeTextFile(tokenize, tokens);
    if (s.ok()) s = ucp::offload::WriteTokenFile(tokens_out, tokens);
    if (!s.ok()) {
      std::cerr << "ucp-train: error: " << s.message() << " [" << ucp::StatusCodeName(s.code())
                << "]\n";
      return ucp::ExitCodeFor(s.code());
    }
    std::printf("%zu tokens written to %s\n", tokens.size(), tokens_out.c_str());
    return 0;
  }
  if (!resume.empty() && !init.empty()) {
    std::cerr << "ucp-train: usage error: --resume and --init exclude each other\n";
    return 2;
  }
  if (out.empty() && resume.empty() && !plan) {
    std::cerr << "ucp-train: usage error: --out RUN is required (see ucp-train --help)\n";
    return 2;
  }
  r.data_dir = data_dir;
  r.corpus_dir = corpus_dir;
  r.async_save = !sync_save;
  r.finish_under_forward = !sync_finish;
  r.init = init;
  if (!resume.empty()) {
    r.resume = resume;
    auto ckpt = ucp::offload::FindResumeCheckpoint(resume);
    if (!ckpt.ok()) return fail(ckpt.status());
    auto recorded = Trainer::RecordedConfig(*ckpt, data_dir);
    if (!recorded.ok()) return fail(recorded.status());
    // Explicit run options must agree with the record, except the few a resume may change.
    TrainConfig merged = *recorded;
    for (const auto& [name, value] : vm) {
      if (value.defaulted() || run.find_nothrow(name, false) == nullptr) continue;
      bool overridable = false;
      for (const char* o : kResumeOverrides) overridable |= name == o;
      if (overridable) continue;
      const std::string arg = "--" + name;
      std::ostringstream v;
      if (const auto* s = boost::any_cast<std::string>(&value.value())) v << *s;
      else if (const auto* i = boost::any_cast<int64_t>(&value.value())) v << *i;
      else if (const auto* u = boost::any_cast<uint64_t>(&value.value())) v << *u;
      else if (const auto* f = boost::any_cast<double>(&value.value())) v << *f;
      std::cerr << "ucp-train: error: " << arg << " " << v.str()
                << ": a resumed run keeps the configuration its checkpoint recorded (only "
                   "--steps, --val-every, --val-samples, --save-every, --keep and --layout may "
                   "change) [invalid_argument]\n";
      return ucp::ExitCodeFor(ucp::StatusCode::kInvalidArgument);
    }
    if (vm.count("steps") && !vm["steps"].defaulted()) merged.steps = c.steps;
    if (vm.count("val-every") && !vm["val-every"].defaulted()) merged.val_every = c.val_every;
    if (vm.count("val-samples") && !vm["val-samples"].defaulted()) merged.val_samples = c.val_samples;
    if (vm.count("layout") && !vm["layout"].defaulted()) merged.layout = c.layout;
    if (vm.count("save-every") && !vm["save-every"].defaulted()) merged.save_every = c.save_every;
    if (vm.count("keep") && !vm["keep"].defaulted()) merged.keep = c.keep;
    c = merged;
    if (out.empty()) {
      out = fs::is_regular_file(fs::path(resume) / "ucp_layout.json")
                ? fs::path(resume).parent_path().string()
                : resume;
    }
  }
  {
    auto tail = ucp::offload::ParseGpuTailBuckets(gpu_tail_buckets);
    if (!tail.ok()) return fail(tail.status());
    r.gpu_tail_buckets = *tail;
  }
  // Sizes for the plan and for a run's automatic choices (--weights, --host-buffers).
  for (const auto& [text, field, name] :
       {std::tuple{&device_memory, &r.device_memory, "--device-memory"},
        std::tuple{&host_memory, &r.host_memory, "--host-memory"}}) {
    if (text->empty()) continue;
    auto bytes = ucp::exec::ParseByteSize(*text);
    if (!bytes.ok()) return fail(ucp::Status(bytes.status().code(),
                                             std::string(name) + ": " +
                                                 std::string(bytes.status().message())));
    *field = *bytes;
  }
  if (plan) {
    // The plan of one process, from the same resolution as a run (a resumed run's recorded
    // config included), before anything is allocated.
    ucp::offload::PlanMachine machine = ucp::offload::MeasureHost();
    if (r.device_memory > 0) machine.device_bytes = r.device_memory;
    if (r.host_memory > 0) machine.host_bytes = r.host_memory;
    if (machine.device_bytes > 0) machine.device_reserve_bytes = int64_t{2} << 30;
    auto p = Trainer::Plan(c, r, machine);
    if (!p.ok()) return fail(p.status());
    if (speaks) {
      std::printf("memory plan of one process: %s, %" PRId64 " parameters, layout %s\n%s",
                  c.model.c_str(), p->params, c.layout.c_str(),
                  ucp::offload::FormatPlan(*p).c_str());
    }
    return 0;
  }
  r.out = out;
  r.comm = &comm;
#ifdef UCP_TRAIN_HAVE_CUDA
  if (r.device == "cuda") {
    if (ucp::Status s = ucp::offload::cuda::CheckCudaDevice(); !s.ok()) return fail(s);
    r.device_factory = ucp::offload::cuda::MakeCudaTrainDevice;
    if (r.device_memory == 0) {
      // --weights auto plans for this GPU's memory (resident or streamed).
      auto bytes = ucp::offload::cuda::CudaDeviceMemory(comm.rank());
      if (!bytes.ok()) return fail(bytes.status());
      r.device_memory = *bytes;
    }
  }
#endif
  auto trainer = Trainer::Create(c, r);
  if (!trainer.ok()) return fail(trainer.status());
  Trainer& t = *trainer;
  const TrainConfig& cfg = t.config();
  if (!quiet) {
    std::printf("%s\n", t.Describe().c_str());
    if (t.step() > 0) std::printf("resumed at step %" PRId64 "\n", t.step());
    std::fflush(stdout);
  }
  int64_t last_saved = t.step();
  while (t.step() < cfg.steps) {
    auto rec = t.Step();
    if (!rec.ok()) return fail(rec.status());
    const bool last = t.step() == cfg.steps;
    // Save first: a failure later in the step must not cost the checkpoint.
    if ((cfg.save_every > 0 && t.step() % cfg.save_every == 0) || last) {
      const auto s0 = std::chrono::steady_clock::now();
      if (auto s = t.Save(); !s.ok()) return fail(s);
      rec->save_block_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
      last_saved = t.step();
    }
    if (t.can_validate() && ((cfg.val_every > 0 && t.step() % cfg.val_every == 0) || last)) {
      auto v = t.Validate();
      if (!v.ok()) return fail(v.status());
      rec->val_loss = *v;
    }
    if (auto s = t.Log(*rec); !s.ok()) return fail(s);
    if (t.step() == kill_at) {
      if (auto s = t.Wait(); !s.ok()) return fail(s);  // the checkpoint is complete first
      std::fflush(stdout);
      if (comm.rank() == (kill_rank >= 0 ? kill_rank : comm.size() - 1)) std::raise(SIGKILL);
    }
    if (!quiet) {
      std::printf("step %5" PRId64 "/%" PRId64 " | loss %.6f | lr %.3e | grad norm %.4f | "
                  "%.0f tok/s | %.1f ms%s",
                  rec->step, cfg.steps, rec->loss, rec->lr, rec->grad_norm,
                  rec->tokens / rec->seconds, rec->seconds * 1e3,
                  rec->skipped ? " | skipped (non-finite gradients)" : "");
      if (rec->val_loss >= 0) std::printf(" | val loss %.6f", rec->val_loss);
      if (last_saved == t.step()) std::printf(" | saving step_%08" PRId64, t.step());
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (auto s = t.Wait(); !s.ok()) return fail(s);
  return 0;
}
