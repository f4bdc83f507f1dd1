// A DeepSpeed / Megatron-DeepSpeed checkpoint folder as an api::CheckpointSource: its ucp layout
// view (deepspeed::DeepSpeedCheckpoint) read through deepspeed::DeepSpeedTensorSource, so every
// operation (extract, convert, verify, diff, RestoreRank) runs on it. CheckpointSource::Open
// routes DeepSpeed folders here.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "ucp/api/checkpoint.h"
#include "ucp/base/result.h"

namespace ucp::api {

/// Opens the DeepSpeed checkpoint at `dir` (a tag folder or its parent with `latest`); `model`
/// is deepspeed::OpenOptions::model (preset, model file, family or ""), rule sets and presets
/// come from `data_dir`. meta(): format kDeepSpeed, layout the view tp=T,pp=P,dp=1,zero=0,
/// framework "deepspeed" or "megatron-deepspeed", source_layout DeepSpeed's own layout, and a
/// client state {"deepspeed": {...}} for the universal manifest.
/// Errors: those of deepspeed::DeepSpeedCheckpoint::Open and DeepSpeedTensorSource::Open.
Result<std::unique_ptr<CheckpointSource>> OpenDeepSpeedSource(const std::filesystem::path& dir,
                                                              const std::filesystem::path& data_dir,
                                                              const std::string& model);

}  // namespace ucp::api
