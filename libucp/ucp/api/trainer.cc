// RankSaver and RestoreRank: DistWriter and the executor fed from and into trainer memory.
#include "ucp/api/trainer.h"

#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "ucp/base/status_macros.h"
#include "ucp/dist/dist_checkpoint.h"

namespace ucp::api {

namespace fs = std::filesystem;
using convert::TensorInfo;
using convert::TensorKind;

Result<std::vector<TensorInfo>> RankTensors(const patterns::ResolvedModel& model,
                                            const layout::Layout& l, int64_t rank,
                                            const convert::PlanOptions& options) {
  UCP_ASSIGN_OR_RETURN(layout::RankCoords c, layout::CoordsOfRank(l, rank));
  UCP_ASSIGN_OR_RETURN(std::vector<TensorInfo> all, convert::DescribeLayout(model, l, options));
  std::vector<TensorInfo> out;
  for (TensorInfo& t : all) {
    bool mine = false;
    if (t.kind == TensorKind::kModelSlice || t.kind == TensorKind::kOptimSlice) {
      mine = t.pp == c.pp && t.tp == c.tp && (t.ep < 0 || t.ep == layout::ExpertRankOfDp(l, c.dp));
    } else {
      mine = t.rank == rank;
    }
    if (mine) out.push_back(std::move(t));
  }
  return out;
}

namespace {

Status CheckView(const TensorInfo& t, DType dtype, const Shape& shape) {
  if (dtype != t.dtype || shape != t.shape) {
    return InvalidArgumentError("tensor \"" + t.name + "\": view is " +
                                std::string(DTypeName(dtype)) + ShapeToString(shape) +
                                ", the layout needs " + std::string(DTypeName(t.dtype)) +
                                ShapeToString(t.shape));
  }
  return Status::Ok();
}

}  // namespace

struct RankSaver::Impl {
  CheckpointMeta meta;
  ProcessGroup* group = nullptr;
  std::unique_ptr<dist::DistWriter> writer;
  std::vector<TensorInfo> all;
  std::set<int64_t> mine;  // the ranks this process saves
  std::mutex mu;
  std::set<std::string> saved;  // "<rank>/<name>" of the writing rank

  ProcessGroup& Group() { return group != nullptr ? *group : SingleProcess(); }
};

RankSaver::RankSaver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankSaver::RankSaver(RankSaver&&) noexcept = default;
RankSaver& RankSaver::operator=(RankSaver&&) noexcept = default;
RankSaver::~RankSaver() = default;

Result<RankSaver> RankSaver::Create(const fs::path& dst, const CheckpointMeta& meta,
                                    const SaveOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->meta = meta;
  impl->group = options.group;
  ProcessGroup& group = impl->Group();
  const int64_t world = layout::WorldSize(meta.layout);
  Status st = [&]() -> Status {
    UCP_RETURN_IF_ERROR(layout::Validate(meta.layout));
    UCP_ASSIGN_OR_RETURN(impl->all,
                         convert::DescribeLayout(meta.model, meta.layout, meta.plan_options()));
    if (group.size() == 1) {
      for (int64_t r = 0; r < world; ++r) impl->mine.insert(r);
    }
    for (int64_t r : group.size() == 1 ? std::vector<int64_t>{} : options.ranks) {
      if (r < 0 || r >= world) {
        return InvalidArgumentError("rank " + std::to_string(r) + " is outside " +
                                    layout::ToString(meta.layout) + " (" + std::to_string(world) +
                                    " ranks)");
      }
      impl->mine.insert(r);
    }
    std::error_code ec;
    if (fs::exists(dst, ec)) {
      return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
    }
    return Status::Ok();
  }();
  UCP_RETURN_IF_ERROR(group.Agree(st));
  std::vector<dist::DistTensorDecl> decls;
  for (const TensorInfo& t : impl->all) decls.push_back({t.rank, t.name, t.dtype, t.shape});
  dist::DistWriteOptions wo;
  if (group.size() > 1) wo.owned_ranks = std::vector<int64_t>(impl->mine.begin(), impl->mine.end());
  fs::path temp;
  if (group.is_root()) {
    Result<dist::DistWriter> w = dist::DistWriter::Create(dst, world, decls, wo);
    st = w.status();
    if (w.ok()) {
      temp = w->temp_dir();
      impl->writer = std::make_unique<dist::DistWriter>(std::move(*w));
    }
  }
  UCP_RETURN_IF_ERROR(group.Agree(st));
  if (group.size() > 1) {
    UCP_ASSIGN_OR_RETURN(std::string t, group.Broadcast(temp.string()));
    if (!group.is_root()) {
      wo.join_temp = t;
      Result<dist::DistWriter> w = dist::DistWriter::Create(dst, world, decls, wo);
      st = w.status();
      if (w.ok()) impl->writer = std::make_unique<dist::DistWriter>(std::move(*w));
    }
    UCP_RETURN_IF_ERROR(group.Agree(st));
  }
  return RankSaver(std::move(impl));
}

Status RankSaver::SaveRank(int64_t rank,
                           std::span<const std::pair<std::string, ConstTensorView>> tensors) {
  if (!impl_->mine.count(rank)) {
    return FailedPreconditionError("rank " + std::to_string(rank) +
                                   " is not one of the ranks this process said it saves");
  }
  UCP_ASSIGN_OR_RETURN(
      std::vector<TensorInfo> mine,
      RankTensors(impl_->meta.model, impl_->meta.layout, rank, impl_->meta.plan_options()));
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : mine) by_name[t.name] = &t;
  for (const auto& [name, view] : tensors) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return NotFoundError("tensor \"" + name + "\" is not held by rank " + std::to_string(rank) +
                           " of " + layout::ToString(impl_->meta.layout));
    }
    UCP_RETURN_IF_ERROR(CheckView(*it->second, view.dtype, view.shape));
    UCP_RETURN_IF_ERROR(ValidateView(view, "tensor \"" + name + "\""));
    if (it->second->rank != rank) continue;  // a dp replica: its holder writes it
    UCP_RETURN_IF_ERROR(impl_->writer->WriteTensor(rank, name, view));
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->saved.insert(std::to_string(rank) + "/" + name);
  }
  return Status::Ok();
}

Status RankSaver::Commit() {
  ProcessGroup& group = impl_->Group();
  Status st;
  for (const TensorInfo& t : impl_->all) {
    if (impl_->mine.count(t.rank) && !impl_->saved.count(std::to_string(t.rank) + "/" + t.name)) {
      st = FailedPreconditionError("tensor \"" + t.name + "\" of rank " + std::to_string(t.rank) +
                                   " was never saved");
      break;
    }
  }
  UCP_RETURN_IF_ERROR(group.Agree(st));
  if (group.size() > 1) {
    std::string part;
    if (!group.is_root()) {
      Result<std::string> p = impl_->writer->LocalPart();
      st = p.status();
      if (p.ok()) part = std::move(*p);
    }
    UCP_RETURN_IF_ERROR(group.Agree(st));
    UCP_ASSIGN_OR_RETURN(std::vector<std::string> parts, group.Gather(part));
    for (size_t r = 1; r < parts.size() && st.ok(); ++r) st = impl_->writer->AddPart(parts[r]);
  }
  if (group.is_root() && st.ok()) {
    const CheckpointMeta& m = impl_->meta;
    dist::DistManifest header;
    header.model = {m.spec.name, m.spec.family, m.spec.dtype, m.spec.hyper};
    header.layout = layout::ToString(m.layout);
    header.step = m.step;
    header.optimizer_kind = m.optimizer_kind;
    header.optimizer_hyper = m.optimizer_hyper;
    header.optimizer_states = m.optimizer_states;
    header.client_state_json = m.client_state_json;  // the trainer's own state
    for (const auto& p : m.model.params) header.params.push_back({p.name, p.shape, p.dtype});
    st = impl_->writer->Commit(header);
  }
  return group.Agree(st);
}

namespace {

// Copies finished targets into the trainer's views.
class ViewSink final : public exec::TensorSink {
 public:
  explicit ViewSink(std::map<std::string, TensorView> views) : views_(std::move(views)) {}
  Status WriteRange(const TensorInfo& t, int64_t begin, int64_t,
                    std::span<const std::byte> data) override {
    auto it = views_.find(t.name);
    if (it == views_.end()) return InternalError("unrequested target " + t.name);
    std::memcpy(it->second.bytes.data() + begin * DTypeSizeBytes(t.dtype), data.data(),
                data.size());
    return Status::Ok();
  }

 private:
  std::map<std::string, TensorView> views_;
};

}  // namespace

Status RestoreRank(const CheckpointSource& src, const layout::Layout& l, int64_t rank,
                   std::span<const std::pair<std::string, TensorView>> tensors,
                   const RunOptions& options) {
  const CheckpointMeta& meta = src.meta();
  UCP_ASSIGN_OR_RETURN(std::vector<TensorInfo> mine,
                       RankTensors(meta.model, l, rank, meta.plan_options()));
  std::map<std::string, TensorView> views;
  for (const auto& [name, view] : tensors) {
    bool found = false;
    for (const TensorInfo& t : mine) {
      if (t.name != name) continue;
      UCP_RETURN_IF_ERROR(CheckView(t, view.dtype, view.shape));
      UCP_RETURN_IF_ERROR(ValidateView(view, "tensor \"" + name + "\""));
      found = true;
    }
    if (!found) {
      return NotFoundError("tensor \"" + name + "\" is not held by rank " + std::to_string(rank) +
                           " of " + layout::ToString(l));
    }
    views[name] = view;
  }
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, l, meta.plan_options()));
  exec::ExecOptions eo;
  eo.memory_limit_bytes = options.memory_limit_bytes;
  eo.progress = options.progress;
  for (int32_t i = 0; i < static_cast<int32_t>(plan.targets.size()); ++i) {
    if (views.count(plan.targets[i].name)) eo.targets.push_back(i);
  }
  if (eo.targets.empty()) return Status::Ok();
  ViewSink sink(std::move(views));
  return exec::ExecutePlan(plan, src, sink, eo).status();
}

}  // namespace ucp::api
