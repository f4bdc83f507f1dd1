// The model on the GPU; see cuda_model.h. RunGraph (model_graph.h) drives the ops policy below,
// whose calls launch the kernels of cuda_ops.h on one stream, over buffers in device memory.
#include "offload/cuda/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_move_rows.h"
#include "offload/cuda/cuda_ops.h"
#include "offload/model/gpu_sizes.h"
#include "offload/model/model_graph.h"
#include "offload/model/ulysses.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::cuda {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// Device memory for RunGraph's buffers (plain cudaMalloc: the device's guidance is to avoid
// managed memory for anything large). assign() takes only a zero fill; Upload copies a host
// vector in. Allocation failures throw std::bad_alloc, caught once in Create.
template <typename T>
class DeviceVec {
 public:
  DeviceVec() = default;
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  DeviceVec(DeviceVec&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceVec& operator=(DeviceVec&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceVec() { cudaFree(p_); }
  void assign(size_t n, T /*zero*/) {
    cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
    if (cudaMalloc(&p_, std::max<size_t>(1, n) * sizeof(T)) != cudaSuccess ||
        cudaMemset(p_, 0, std::max<size_t>(1, n) * sizeof(T)) != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    n_ = n;
  }
  void Upload(const std::vector<T>& h) {
    assign(h.size(), T());
    if (cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
  }
  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

using DeviceActs = graph::Acts<float, DeviceVec<float>>;

// CudaModel::ProfileOps: an event on the model's stream where each op begins, so an op's time is
// up to the next one's start (the last, to the event after the graph); names and events of one
// run, summed into `totals` once the run has synchronised.
struct OpProfile {
  std::vector<cudaEvent_t> events;  // a pool, reused run after run
  std::vector<std::string> names;   // this run's ops, in order
  std::vector<double> flops;        // their matrix products' FLOPs (0 for the rest)
  std::map<std::string, CudaModel::OpTime> totals;

  ~OpProfile() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
  Status Mark(std::string name, double f, cudaStream_t stream) {
    if (names.size() == events.size()) {
      events.push_back(nullptr);
      if (cudaEventCreate(&events.back()) != cudaSuccess) {
        events.pop_back();
        return DeviceError(std::string("profiling event: ") + cudaGetErrorName(cudaGetLastError()));
      }
    }
    if (cudaEventRecord(events[names.size()], stream) != cudaSuccess) {
      return DeviceError(std::string("profiling event: ") + cudaGetErrorName(cudaGetLastError()));
    }
    names.push_back(std::move(name));
    flops.push_back(f);
    return Status::Ok();
  }
  // A run begins (one that failed left its marks unsummed).
  void Begin() {
    names.clear();
    flops.clear();
  }
  // After the run's last Mark ("end") and the stream's synchronisation.
  Status Sum() {
    for (size_t i = 0; i + 1 < names.size(); ++i) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, events[i], events[i + 1]) != cudaSuccess) {
        return DeviceError(std::string("profiling: ") + cudaGetErrorName(cudaGetLastError()));
      }
      CudaModel::OpTime& t = totals[names[i]];
      t.op = names[i];
      t.calls += 1;
      t.ms += ms;
      t.flops += flops[i];
    }
    Begin();
    return Status::Ok();
  }
};

// Pinned host floats (cudaMallocHost): the staging of Ulysses' all-to-alls without NCCL, so the
// copies each way run at the link's speed. Allocation failures throw std::bad_alloc.
class PinnedFloats {
 public:
  explicit PinnedFloats(size_t n) : n_(n) {
    void* p = nullptr;
    if (cudaMallocHost(&p, std::max<size_t>(1, n) * 4) != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    p_ = static_cast<float*>(p);
  }
  PinnedFloats(const PinnedFloats&) = delete;
  PinnedFloats& operator=(const PinnedFloats&) = delete;
  ~PinnedFloats() { cudaFreeHost(p_); }
  float* data() { return p_; }
  size_t size() const { return n_; }

 private:
  float* p_ = nullptr;
  size_t n_ = 0;
};

// Ulysses' backend on the GPU (graph::Ulysses, ulysses.h): its strided moves as MoveRowsKernel
// launches on the model's stream, its all-to-alls the SequenceParallel's (NCCL's) or, without
// one, staged: the send blocks to pinned host memory, the host communicator's AllToAll, the
// received blocks back (the stream waits for the first copy; the next exchange's wait covers
// the second, so the host buffer is free again before it is reused).
struct DeviceUlyssesBackend {
  using Vec = DeviceVec<float>;
  cudaStream_t stream = nullptr;
  SequenceParallel sp;
  std::shared_ptr<PinnedFloats> host_send, host_recv;  // staged only
  // The model's profile (CudaModel::ProfileOps; null when off): the moves and the exchanges are
  // ops of their own there, not time of the op before them.
  const std::unique_ptr<OpProfile>* prof = nullptr;

  Status Mark(const char* op) {
    return prof != nullptr && *prof ? (*prof)->Mark(op, 0, stream) : Status::Ok();
  }
  Status Move(std::span<const graph::Strided<float>> list, int64_t rows, bool add) {
    UCP_RETURN_IF_ERROR(Mark(add ? "ulysses adds" : "ulysses moves"));
    return MoveRowsOnDevice(list.data(), static_cast<int64_t>(list.size()), rows, add, stream);
  }
  Status AllToAll(const float* send, float* recv, int64_t n) {
    UCP_RETURN_IF_ERROR(Mark("ulysses all-to-all"));
    if (sp.all_to_all) return sp.all_to_all(send, recv, n, stream);
    const size_t count = static_cast<size_t>(sp.comm->size() * n);
    if (host_send == nullptr || count > host_send->size()) {
      return InternalError("ulysses: " + std::to_string(count) + " floats past the host staging");
    }
    if (const cudaError_t e = cudaMemcpyAsync(host_send->data(), send, count * 4,
                                              cudaMemcpyDeviceToHost, stream);
        e != cudaSuccess) {
      cudaGetLastError();
      return DeviceError(std::string("ulysses: blocks to the host: ") + cudaGetErrorName(e));
    }
    if (const cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
      return DeviceError(std::string("ulysses: blocks to the host: ") + cudaGetErrorName(e));
    }
    UCP_RETURN_IF_ERROR(sp.comm->AllToAll(std::span<const float>(host_send->data(), count),
                                          std::span<float>(host_recv->data(), count)));
    if (const cudaError_t e = cudaMemcpyAsync(recv, host_recv->data(), count * 4,
                                              cudaMemcpyHostToDevice, stream);
        e != cudaSuccess) {
      cudaGetLastError();
      return DeviceError(std::string("ulysses: blocks to the device: ") + cudaGetErrorName(e));
    }
    return Status::Ok();
  }
};
using DeviceUlysses = graph::Ulysses<float, DeviceUlyssesBackend>;

// The ops policy of RunGraph: each call launches; the first failure is kept and returned after
// the graph (RunGraph's ops calls return nothing).
struct CudaOps {
  Blas* blas = nullptr;
  void* stream = nullptr;
  float* attn_scratch = nullptr;
  float* cls_scratch = nullptr;
  Status status;
  // The fp32 weights' base and, for GemmInputs::kBf16, their bf16 twin (the flat layout, or
  // the streamed arena's) and the GEMMs' bf16 scratch; w16 null: the fp32 GEMMs.
  const float* w32 = nullptr;
  const uint16_t* w16 = nullptr;
  uint16_t* scratch16 = nullptr;
  void* attn_gemm = nullptr;
  int64_t attn_gemm_bytes = 0;
  void* flash = nullptr;  // AttentionKernel::kFlash (with w16): FlashAttentionScratchBytes
  int64_t flash_bytes = 0;
  // The batch's tokens grouped by token (GroupTokens, on the device) for the embedding gradient.
  const int32_t* run_order = nullptr;
  const int32_t* run_starts = nullptr;
  int64_t runs = 0;
  // Set: w32 is packed to model.h Fp32ReadRanges (resident kBf16 weights; the GEMMs read only
  // w16, so the fp32 copy holds no matrix).
  const graph::PackedIndex* packed = nullptr;
  OpProfile* prof = nullptr;  // CudaModel::ProfileOps
  // Ulysses over NCCL: the sp group's wait, which polls NCCL for a peer's failure (null: none).
  const std::function<Status(void*)>* sp_wait = nullptr;

  // RunGraph's weights (model_graph.h OwnsWeights): a GEMM takes its bf16 matrix (w16 set) or
  // its fp32 one; in a streamed window the bf16 twin is at the same offset in its arena.
  struct GemmW {
    const float* w32;
    const uint16_t* w16;
  };
  GemmW GemmWeight(int64_t off, const float* windowed) const {
    if (windowed != nullptr) return {windowed, w16 ? w16 + (windowed - w32) : nullptr};
    return {packed ? nullptr : w32 + off, w16 ? w16 + off : nullptr};
  }
  const float* Fp32Weight(int64_t off) const {
    if (packed == nullptr) return w32 + off;
    const int64_t at = packed->At(off);
    UCP_CHECK(at >= 0);  // RunGraph reads the matrices through GemmWeight only
    return w32 + at;
  }

  void Keep(Status s) {
    if (status.ok() && !s.ok()) status = std::move(s);
  }
  // Profiling: `op` begins here (its name built only when profiling).
  template <typename Name>
  void Mark(Name&& op, double flops = 0) {
    if (prof != nullptr) Keep(prof->Mark(op(), flops, static_cast<cudaStream_t>(stream)));
  }
  static auto Named(const char* op) {
    return [op] { return std::string(op); };
  }
  void Zero(float* p, int64_t n) {
    Mark(Named("zero"));
    if (cudaMemsetAsync(p, 0, static_cast<size_t>(n) * 4, static_cast<cudaStream_t>(stream)) !=
        cudaSuccess) {
      Keep(DeviceError(std::string("memset: ") + cudaGetErrorName(cudaGetLastError())));
    }
  }
  // clang-format off
  template <typename... A> void EncoderForward(A... a) { Mark(Named("encoder fwd")); Keep(cuda::EncoderForward(a..., stream)); }
  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       int64_t B, int64_t T, int64_t C) {
    Mark(Named("encoder bwd"));
    Keep(cuda::EncoderBackward(dwte, dwpe, dout, tokens, run_order, run_starts, runs, B, T, C,
                               stream));
  }
  template <typename... A> void LayerNormForward(A... a) { Mark(Named("layernorm fwd")); Keep(cuda::LayerNormForward(a..., stream)); }
  template <typename... A> void LayerNormBackward(A... a) { Mark(Named("layernorm bwd")); Keep(cuda::LayerNormBackward(a..., stream)); }
  template <typename... A> void RmsNormForward(A... a) { Mark(Named("rmsnorm fwd")); Keep(cuda::RmsNormForward(a..., stream)); }
  template <typename... A> void RmsNormBackward(A... a) { Mark(Named("rmsnorm bwd")); Keep(cuda::RmsNormBackward(a..., stream)); }
  template <typename... A> void RopeForward(A... a) { Mark(Named("rope fwd")); Keep(cuda::RopeForward(a..., stream)); }
  template <typename... A> void RopeBackward(A... a) { Mark(Named("rope bwd")); Keep(cuda::RopeBackward(a..., stream)); }
  template <typename... A> void GeluForward(A... a) { Mark(Named("gelu fwd")); Keep(cuda::GeluForward(a..., stream)); }
  template <typename... A> void GeluBackward(A... a) { Mark(Named("gelu bwd")); Keep(cuda::GeluBackward(a..., stream)); }
  template <typename... A> void SwigluForward(A... a) { Mark(Named("swiglu fwd")); Keep(cuda::SwigluForward(a..., stream)); }
  template <typename... A> void SwigluBackward(A... a) { Mark(Named("swiglu bwd")); Keep(cuda::SwigluBackward(a..., stream)); }
  template <typename... A> void ResidualForward(A... a) { Mark(Named("residual fwd")); Keep(cuda::ResidualForward(a..., stream)); }
  // clang-format on
  void MatmulForward(float* out, const float* inp, GemmW w, const float* bias, int64_t N,
                     int64_t C, int64_t OC) {
    Mark([&] { return "matmul fwd " + Str(C) + "->" + Str(OC); }, 2.0 * N * C * OC);
    Keep(w.w16 ? cuda::MatmulForwardMixed(*blas, out, inp, w.w16, bias, N, C, OC, scratch16)
               : cuda::MatmulForward(*blas, out, inp, w.w32, bias, N, C, OC));
  }
  void MatmulBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                      GemmW w, int64_t N, int64_t C, int64_t OC) {
    Mark([&] { return "matmul bwd " + Str(C) + "->" + Str(OC); }, 4.0 * N * C * OC);
    Keep(w.w16 ? cuda::MatmulBackwardMixed(*blas, dinp, dw, dbias, dout, inp, w.w16, N, C, OC,
                                           scratch16)
               : cuda::MatmulBackward(*blas, dinp, dw, dbias, dout, inp, w.w32, N, C, OC));
  }
  // kBf16: attention through the flash kernels (flash) or the tensor-core GEMMs (attn_gemm:
  // their scratch); else the fused fp32 kernels. The causal FLOPs are profiled (the GEMM
  // attention computes twice as many).
  void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                        int64_t NH, int64_t KV, int64_t hd) {
    Mark(Named("attention fwd"), 2.0 * B * NH * T * T * hd);
    Keep(flash       ? cuda::AttentionForwardFlash(out, lse, qkv, B, T, NH, KV, hd, flash,
                                                   flash_bytes, stream)
         : attn_gemm ? cuda::AttentionForwardGemm(*blas, out, lse, qkv, B, T, NH, KV, hd,
                                                  attn_gemm, attn_gemm_bytes)
                     : cuda::AttentionForward(out, lse, qkv, B, T, NH, KV, hd, stream));
  }
  // graph::TakesAttentionOutput: the flash kernels' backward reads the forward's output (out).
  void AttentionBackwardWithOutput(float* dqkv, const float* dout, const float* qkv,
                                   const float* out, const float* lse, int64_t B, int64_t T,
                                   int64_t NH, int64_t KV, int64_t hd) {
    Mark(Named("attention bwd"), 4.0 * B * NH * T * T * hd);
    Keep(flash       ? cuda::AttentionBackwardFlash(dqkv, dout, qkv, out, lse, B, T, NH, KV, hd,
                                                    flash, flash_bytes, stream)
         : attn_gemm ? cuda::AttentionBackwardGemm(*blas, dqkv, dout, qkv, lse, B, T, NH, KV, hd,
                                                   attn_gemm, attn_gemm_bytes)
                     : cuda::AttentionBackward(dqkv, dout, qkv, lse, attn_scratch, B, T, NH, KV,
                                               hd, stream));
  }
  // Whether AttentionBackwardWithOutput reads `out` (the flash kernels'; under sequence
  // parallelism the graph then brings the output back by heads).
  bool AttentionReadsOutput() const { return flash != nullptr; }
  void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
    AttentionBackwardWithOutput(dqkv, dout, qkv, nullptr, lse, B, T, NH, KV, hd);
  }
  double Classifier(float* dx, float* dw, const float* x, GemmW w, const int32_t* targets,
                    int64_t N, int64_t C, int64_t V, float grad_scale) {
    Mark(Named(dx ? "classifier fwd+bwd" : "classifier fwd"), (dx ? 6.0 : 2.0) * N * C * V);
    // The classifier waits for the stream (its loss goes to the host): behind the forward's
    // NCCL all-to-alls that plain wait would hang if a peer died, so the polling one goes first.
    if (sp_wait != nullptr) Keep((*sp_wait)(stream));
    if (!status.ok()) return std::numeric_limits<double>::quiet_NaN();
    Result<double> r = cuda::ClassifierForwardBackward(*blas, dx, dw, x, w.w32, targets,
                                                       cls_scratch, N, C, V, grad_scale, w.w16,
                                                       scratch16);
    if (!r.ok()) {
      Keep(r.status());
      return std::numeric_limits<double>::quiet_NaN();
    }
    return *r;
  }
};

}  // namespace

struct CudaModel::Impl {
  ModelConfig config;
  graph::Layout layout;
  int64_t max_batch = 0, max_seq_len = 0;
  std::unique_ptr<Blas> blas;
  cudaStream_t stream = nullptr;
  DeviceActs acts;
  DeviceVec<int32_t> inputs, targets;
  TokenRuns token_runs;                     // the batch's, on the host
  DeviceVec<int32_t> run_order, run_starts;  // and on the device
  DeviceVec<float> attn_scratch, cls_scratch;
  GemmInputs gemm = GemmInputs::kFp32;
  DeviceVec<uint16_t> scratch16;  // kBf16: the largest GEMM's MixedMatmulScratch
  DeviceVec<uint8_t> attn_gemm;   // kBf16 with AttentionKernel::kGemm: AttentionGemmScratchBytes
  DeviceVec<uint8_t> attn_flash;  // kBf16 with AttentionKernel::kFlash: FlashAttentionScratchBytes
  AttentionKernel attention = AttentionKernel::kGemm;
  graph::PackedIndex packed;      // kBf16: Fp32Layout::kPacked's
  std::unique_ptr<OpProfile> prof;  // ProfileOps
  std::unique_ptr<DeviceUlysses> sp;  // null without sequence parallelism

  ~Impl() {
    sp.reset();  // (its buffers before the stream they were used on)
    blas.reset();
    if (stream) cudaStreamDestroy(stream);
  }

  // The batch against the model's sizes: under SP a shard of max_seq_len / P positions.
  Status CheckBatch(const Batch& b) const {
    const int64_t shard = sp ? max_seq_len / sp->geo().P : max_seq_len;
    if (b.batch < 1 || b.batch > max_batch || b.seq_len < 1 || b.seq_len > shard ||
        b.position_offset < 0 || b.position_offset + b.seq_len > max_seq_len) {
      return InvalidArgumentError("batch " + Str(b.batch) + " x " + Str(b.seq_len) + " at " +
                                  Str(b.position_offset) + " does not fit " + Str(max_batch) +
                                  " x " + Str(shard) +
                                  (sp ? " (a shard of " + Str(max_seq_len) + " positions)" : ""));
    }
    const size_t n = static_cast<size_t>(b.batch * b.seq_len);
    if (b.inputs.size() != n || b.targets.size() != n) {
      return InvalidArgumentError("batch tokens: " + Str(static_cast<int64_t>(b.inputs.size())) +
                                  " inputs, " + Str(static_cast<int64_t>(b.targets.size())) +
                                  " targets for " + Str(static_cast<int64_t>(n)));
    }
    for (size_t i = 0; i < n; ++i) {
      if (b.inputs[i] < 0 || b.inputs[i] >= config.vocab || b.targets[i] >= config.vocab) {
        return InvalidArgumentError("token " + Str(static_cast<int64_t>(i)) +
                                    " outside the vocabulary of " + Str(config.vocab));
      }
    }
    return Status::Ok();
  }

  // win: streamed weights (model.h WeightWindows), whose slots lie in the arena `w` (fp32) and
  // `w16` (its bf16 twin at the same offsets); `backward` then says whether to run backward.
  Result<double> Run(const float* w, float* g, const Batch& b, float grad_scale,
                     const BackwardHook* hook, const uint16_t* w16,
                     WeightWindows* win = nullptr, bool backward = false,
                     Fp32Layout fp32 = Fp32Layout::kWhole) {
    // Under SP every rank agrees on the call before any exchange (ulysses.h Agree): a call
    // refused anywhere is refused everywhere.
    Status valid = Status::Ok();
    if ((gemm == GemmInputs::kBf16) != (w16 != nullptr)) {
      valid = InvalidArgumentError(gemm == GemmInputs::kBf16
                                       ? "CUDA model: bf16 GEMMs need the bf16 weights"
                                       : "CUDA model: bf16 weights given to a model of fp32 GEMMs");
    } else if (fp32 == Fp32Layout::kPacked && gemm != GemmInputs::kBf16) {
      valid = InvalidArgumentError("CUDA model: packed fp32 weights need the bf16 GEMMs (the "
                                   "fp32 GEMMs read every matrix in fp32)");
    } else {
      valid = CheckBatch(b);
    }
    if (sp) {
      UCP_RETURN_IF_ERROR(sp->Agree(valid, b, backward || g != nullptr));
    } else {
      UCP_RETURN_IF_ERROR(valid);
    }
    const size_t n = static_cast<size_t>(b.batch * b.seq_len);
    if (cudaMemcpyAsync(inputs.data(), b.inputs.data(), n * 4, cudaMemcpyHostToDevice, stream) !=
            cudaSuccess ||
        cudaMemcpyAsync(targets.data(), b.targets.data(), n * 4, cudaMemcpyHostToDevice,
                        stream) != cudaSuccess) {
      return DeviceError(std::string("batch tokens to the device: ") +
                         cudaGetErrorName(cudaGetLastError()));
    }
    if (backward || g != nullptr) {
      GroupTokens(b.inputs.data(), static_cast<int64_t>(n), token_runs);
      if (cudaMemcpyAsync(run_order.data(), token_runs.order.data(), n * 4,
                          cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaMemcpyAsync(run_starts.data(), token_runs.starts.data(),
                          token_runs.starts.size() * 4, cudaMemcpyHostToDevice,
                          stream) != cudaSuccess) {
        return DeviceError(std::string("batch token runs to the device: ") +
                           cudaGetErrorName(cudaGetLastError()));
      }
    }
    if (prof) prof->Begin();
    CudaOps ops{blas.get(), stream, attn_scratch.data(), cls_scratch.data(), Status::Ok(),
                w, w16, w16 ? scratch16.data() : nullptr,
                w16 && attention == AttentionKernel::kGemm ? attn_gemm.data() : nullptr,
                static_cast<int64_t>(attn_gemm.size()),
                w16 && attention == AttentionKernel::kFlash ? attn_flash.data() : nullptr,
                static_cast<int64_t>(attn_flash.size()),
                run_order.data(), run_starts.data(), token_runs.runs(),
                fp32 == Fp32Layout::kPacked ? &packed : nullptr, prof.get(),
                sp && sp->backend().sp.synchronize ? &sp->backend().sp.synchronize : nullptr};
    Result<double> loss = graph::RunGraph<float>(
        ops, config, layout, acts, win ? nullptr : w, win ? nullptr : g, inputs.data(),
        targets.data(), b.batch, b.seq_len, b.position_offset, grad_scale, sp.get(), hook, win,
        backward);
    ops.Mark(CudaOps::Named("end"));
    // (Over NCCL, the sp group's wait, which reports a peer's failure instead of hanging.)
    Status waited = Status::Ok();
    if (sp && sp->backend().sp.synchronize) {
      waited = sp->backend().sp.synchronize(stream).WithContext("model step");
    } else if (const cudaError_t sync = cudaStreamSynchronize(stream); sync != cudaSuccess) {
      waited = DeviceError(std::string("model step: ") + cudaGetErrorName(sync));
    }
    UCP_RETURN_IF_ERROR(ops.status);
    UCP_RETURN_IF_ERROR(waited);
    if (prof) UCP_RETURN_IF_ERROR(prof->Sum());
    return loss;
  }
};

Result<CudaModel> CudaModel::Create(const ModelConfig& config, int64_t max_batch,
                                    int64_t max_seq_len, GemmInputs gemm,
                                    AttentionKernel attention, SequenceParallel sp,
                                    Recompute recompute) {
  const bool flash = attention == AttentionKernel::kFlash;
  const int P = sp.comm != nullptr ? sp.comm->size() : 1;
  UCP_RETURN_IF_ERROR(ValidateSequenceParallel(config, P, max_seq_len),
                      "CUDA model (max_seq_len: the whole sample's)");
  if (flash && gemm != GemmInputs::kBf16) {
    return InvalidArgumentError("CUDA model: the flash attention kernels are the bf16 GEMMs' "
                                "(GemmInputs::kBf16)");
  }
  if (flash && !FlashAttentionSupports(config.head_dim)) {
    return InvalidArgumentError("CUDA model: the flash attention kernels take head_dim 64, 80, "
                                "96 or 128, not " + Str(config.head_dim));
  }
  if (DeviceCount() == 0) return DeviceError("CUDA model: no CUDA device");
  if (max_batch < 1 || max_seq_len < 1) {
    return InvalidArgumentError("CUDA model: max_batch and max_seq_len must be >= 1");
  }
  if (recompute.layers < 0) {
    return InvalidArgumentError("CUDA model: recompute.layers=" + Str(recompute.layers) + " < 0");
  }
  if (config.family == Family::kGpt && max_seq_len > config.max_positions) {
    return InvalidArgumentError("max_seq_len=" + Str(max_seq_len) + " > max_positions=" +
                                Str(config.max_positions));
  }
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  UCP_ASSIGN_OR_RETURN(impl->layout, graph::BuildLayout(config));
  impl->max_batch = max_batch;
  impl->max_seq_len = max_seq_len;
  if (gemm == GemmInputs::kBf16) {
    UCP_ASSIGN_OR_RETURN(auto ranges, Fp32ReadRanges(config));
    impl->packed = graph::PackedIndex(std::move(ranges));
  }
  if (cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking) != cudaSuccess) {
    return DeviceError("CUDA model: stream");
  }
  UCP_ASSIGN_OR_RETURN(Blas blas, Blas::Create(impl->stream));
  impl->blas = std::make_unique<Blas>(std::move(blas));
  // Under SP this rank's shard of every sequence (model.cc's Model::Create, and what
  // DeviceActivationBytes counts).
  const int64_t rows = max_batch * (max_seq_len / P);
  try {
    int64_t qkv_width = (config.heads + 2 * config.kv_heads) * config.head_dim;
    if (P > 1) {
      DeviceUlyssesBackend be;
      be.stream = impl->stream;
      be.prof = &impl->prof;
      const bool staged = !sp.all_to_all;
      be.sp = std::move(sp);
      impl->sp = std::make_unique<DeviceUlysses>(be.sp.comm, std::move(be), config);
      impl->sp->Allocate(rows, flash);
      qkv_width = impl->sp->qkv_width();
      if (staged) {
        // The largest exchange each way, as the memory plan's host column counts it.
        UCP_ASSIGN_OR_RETURN(const int64_t n,
                             UlyssesExchangeFloats(config, max_batch, max_seq_len, P));
        impl->sp->backend().host_send = std::make_shared<PinnedFloats>(static_cast<size_t>(n));
        impl->sp->backend().host_recv = std::make_shared<PinnedFloats>(static_cast<size_t>(n));
      }
    }
    impl->acts.Allocate(config, rows, max_seq_len, qkv_width, recompute);
    // The scratch as the memory plan counts it (gpu_sizes.h).
    const gpu::ModelScratch sc =
        gpu::CudaModelScratch(config, config.family != Family::kGpt, max_batch, max_seq_len,
                              gemm == GemmInputs::kBf16, flash, P);
    impl->inputs.assign(static_cast<size_t>(rows), 0);
    impl->targets.assign(static_cast<size_t>(rows), 0);
    impl->run_order.assign(static_cast<size_t>(rows), 0);
    impl->run_starts.assign(static_cast<size_t>(rows + 1), 0);
    impl->attn_scratch.assign(static_cast<size_t>(sc.attn_floats), 0.f);
    impl->cls_scratch.assign(static_cast<size_t>(sc.classifier_floats), 0.f);
    impl->gemm = gemm;
    impl->attention = attention;
    if (gemm == GemmInputs::kBf16) {
      impl->scratch16.assign(static_cast<size_t>(sc.gemm16), 0);
      impl->attn_gemm.assign(static_cast<size_t>(sc.attn_gemm_bytes), 0);
      impl->attn_flash.assign(static_cast<size_t>(sc.flash_bytes), 0);
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("CUDA model: activations for " + Str(max_batch) + " x " +
                                  Str(max_seq_len) + " tokens do not fit in device memory");
  }
  // The buffers' zero fills (DeviceVec::assign's cudaMemset) run on the legacy default stream,
  // which the model's non-blocking stream does not wait for: without this, the first batch's
  // tokens, copied on the model's stream, could be zeroed by their buffer's fill still queued.
  if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    cudaGetLastError();
    return DeviceError(std::string("CUDA model: zeroing its buffers: ") + cudaGetErrorString(e));
  }
  return CudaModel(std::move(impl));
}

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::CudaModel(CudaModel&&) noexcept = default;
CudaModel& CudaModel::operator=(CudaModel&&) noexcept = default;
CudaModel::~CudaModel() = default;

const ModelConfig& CudaModel::config() const { return impl_->config; }
const std::vector<ParamInfo>& CudaModel::params() const { return impl_->layout.params; }
int64_t CudaModel::num_params() const { return impl_->layout.total; }

int CudaModel::sp_size() const { return impl_->sp ? static_cast<int>(impl_->sp->geo().P) : 1; }
bool CudaModel::sp_on_device() const {
  return impl_->sp != nullptr && static_cast<bool>(impl_->sp->backend().sp.all_to_all);
}
GemmInputs CudaModel::gemm() const { return impl_->gemm; }
AttentionKernel CudaModel::attention() const { return impl_->attention; }
Recompute CudaModel::recompute() const { return impl_->acts.recompute; }

int64_t CudaModel::packed_fp32_elements() const { return impl_->packed.elements(); }

Result<double> CudaModel::Forward(const float* weights, const Batch& batch,
                                  const uint16_t* weights16, Fp32Layout fp32) {
  return impl_->Run(weights, nullptr, batch, 0.0f, nullptr, weights16, nullptr, false, fp32);
}

Result<double> CudaModel::ForwardBackward(const float* weights, float* grads, const Batch& batch,
                                          float grad_scale, const BackwardHook* hook,
                                          const uint16_t* weights16, Fp32Layout fp32) {
  if (grads == nullptr) return InvalidArgumentError("CUDA model: null gradient buffer");
  return impl_->Run(weights, grads, batch, grad_scale, hook, weights16, nullptr, false, fp32);
}

Result<double> CudaModel::Forward(WeightWindows& windows, const Batch& batch, const float* arena,
                                  const uint16_t* arena16) {
  return impl_->Run(arena, nullptr, batch, 0.0f, nullptr, arena16, &windows, false);
}

Result<double> CudaModel::ForwardBackward(WeightWindows& windows, const Batch& batch,
                                          float grad_scale, const BackwardHook* hook,
                                          const float* arena, const uint16_t* arena16) {
  return impl_->Run(arena, nullptr, batch, grad_scale, hook, arena16, &windows, true);
}

void* CudaModel::stream() const { return impl_->stream; }

void CudaModel::ProfileOps(bool on) {
  if (!on) {
    impl_->prof.reset();
  } else if (!impl_->prof) {
    impl_->prof = std::make_unique<OpProfile>();
  }
}

std::vector<CudaModel::OpTime> CudaModel::TakeOpTimes() {
  std::vector<OpTime> out;
  if (!impl_->prof) return out;
  for (auto& [name, t] : impl_->prof->totals) out.push_back(t);
  impl_->prof->totals.clear();
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace ucp::offload::cuda
