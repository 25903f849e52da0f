// Precompiled header shared by every target of the project: the heavy LibTorch headers that
// nearly every translation unit includes. Keep it narrow (no torch/torch.h).
#pragma once
#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>
