#pragma once
/// Umbrella header of DistributedShampoo for LibTorch.
///   #include <shampoo/shampoo.h>
///   CMake: find_package(DistributedShampoo) -> DistributedShampoo::shampoo

#include "distributor/gradient_synchronizer.h"
#include "distributor/optimizer_factory.h"
#include "distributor/process_group.h"
#include "distributor/sharded_optimizer.h"
#include "shampoo/checkpoint.h"
#include "shampoo/config.h"
#include "shampoo/distributed_shampoo.h"
#include "shampoo/in_backward.h"
#include "shampoo/shampoo_options.h"
