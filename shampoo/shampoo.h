#pragma once
/// Umbrella header of DistributedShampoo for LibTorch.
///   #include <shampoo/shampoo.h>
///   CMake: find_package(DistributedShampoo) -> DistributedShampoo::shampoo

#include "amp/autocast_guard.h"
#include "amp/grad_scaler.h"
#include "parallel/clip_grad_norm.h"
#include "parallel/distributed_checkpoint.h"
#include "parallel/fully_sharded.h"
#include "parallel/gradient_synchronizer.h"
#include "parallel/in_backward.h"
#include "parallel/optimizer_factory.h"
#include "parallel/parameter_owners.h"
#include "parallel/process_group.h"
#include "parallel/sharded_optimizer.h"
#include "shampoo/checkpoint.h"
#include "shampoo/config.h"
#include "shampoo/distributed_shampoo.h"
#include "shampoo/lr_schedulers.h"
#include "shampoo/shampoo_options.h"
#include "shampoo/training_checkpoint.h"
#include "shampoo/wrapped_shampoo.h"
