#pragma once
/// Checkpoint files. torch::save(optimizer, path) / torch::load(optimizer, path) work for
/// DistributedShampoo; load_checkpoint does the same as torch::load, with errors that name the
/// file: LibTorch's reader reports a truncated or damaged file as "PytorchStreamReader failed
/// reading zip archive" without saying which one.

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <string>

namespace shampoo {

/// Reads the torch archive at `path`. A missing file, or one that is not a readable torch archive
/// (truncated, damaged, another format), is a c10::Error naming `path`.
torch::serialize::InputArchive read_checkpoint(const std::string& path);

/// torch::load(optimizer, path) with every error prefixed by `path`.
void load_checkpoint(torch::optim::Optimizer& optimizer, const std::string& path);

}  // namespace shampoo
