// The run that the device checks train (offload/train/trainer_device_test.cc on the CPU twin,
// offload/cuda/cuda_train_test.cc on a GPU): one small text and one configuration, so both
// compare a device against the CPU trainer on the same run. Test code.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include "offload/train/trainer.h"

namespace ucp::offload {

/// 80 lines of English in `dir`/text.txt; returns its path.
inline std::filesystem::path WriteDeviceCheckText(const std::filesystem::path& dir) {
  const std::filesystem::path p = dir / "text.txt";
  std::ofstream f(p);
  for (int i = 0; i < 80; ++i) {
    f << "Line " << i << ": the quick brown fox jumps over the lazy dog, again and again.\n";
  }
  return p;
}

/// Eight steps of 4 x 32 tokens at tp=pp=dp=1, zero=1, with the given rates and clip.
inline TrainConfig DeviceCheckConfig(const std::string& model, const std::string& dtype,
                                     const std::filesystem::path& data, double lr, double min_lr,
                                     double clip_grad) {
  TrainConfig c;
  c.model = model;
  c.dtype = dtype;
  c.data = data.string();
  c.seq_len = 32;
  c.global_batch = 4;
  c.micro_batch = 2;
  c.steps = 8;
  c.lr = lr;
  c.min_lr = min_lr;
  c.warmup_samples = 4;
  c.val_samples = 4;
  c.clip_grad = clip_grad;
  c.layout = "tp=1,pp=1,dp=1,zero=1";
  return c;
}

}  // namespace ucp::offload
