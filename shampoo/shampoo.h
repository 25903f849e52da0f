#pragma once
/// Umbrella header of DistributedShampoo for LibTorch.
///   #include <shampoo/shampoo.h>
///   CMake: find_package(DistributedShampoo) -> DistributedShampoo::shampoo

#include "amp/autocast_guard.h"
#include "amp/grad_scaler.h"
#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/clip_grad_norm.h"
#include "parallel/communication/process_group.h"
#include "parallel/data_parallel/gradient_synchronizer.h"
#include "parallel/full_sharding/fully_sharded.h"
#include "parallel/in_backward/in_backward.h"
#include "parallel/optimizers/optimizer_factory.h"
#include "parallel/state_sharding/sharded_optimizer.h"
#include "shampoo/checkpoint.h"
#include "shampoo/config.h"
#include "shampoo/distributed_shampoo.h"
#include "shampoo/lr_schedulers.h"
#include "shampoo/shampoo_options.h"
#include "shampoo/training_checkpoint.h"
#include "shampoo/wrapped_shampoo.h"
