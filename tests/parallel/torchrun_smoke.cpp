// A data-parallel training program launched by torchrun (not a GoogleTest): every rank joins
// through init_process_group_from_env, averages gradients with the GradientSynchronizer, steps
// with DistributedShampoo, and checks that all ranks hold identical parameters. Exit code 0 on
// success. CTest runs: torchrun --no-python --standalone --nproc-per-node 2 torchrun_smoke
//
// With --fail-first-attempt, every rank of the first attempt (TORCHELASTIC_RESTART_COUNT 0)
// joins the group, runs one collective and exits with code 3, as a job whose node died would; run
// with torchrun --max-restarts 1, the agent restarts the workers, which must form a new group
// (the agent's store still holds the failed attempt's keys) and succeed. Rank 0 of the restarted
// attempt joins 3 s late, so that the others look up its address first: in the failed
// attempt's keys they would find the address of a process that is gone.
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

bool first_attempt() {
  const char* count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return count == nullptr || std::string(count) == "0";
}

bool is_rank_zero() {
  const char* rank = std::getenv("RANK");
  return rank != nullptr && std::string(rank) == "0";
}

}  // namespace

int main(int argc, char** argv) {
  const bool fail_first_attempt = argc > 1 && std::string(argv[1]) == "--fail-first-attempt";
  try {
    if (fail_first_attempt && !first_attempt() && is_rank_zero()) {
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    auto group = shampoo::init_process_group_from_env(std::chrono::seconds(120));
    const int rank = group->getRank();
    const int world = group->getSize();
    if (fail_first_attempt && first_attempt()) {
      std::vector<at::Tensor> ones{at::ones({1})};
      group->getBackend(c10::DeviceType::CPU)->allreduce(ones)->wait();
      std::cerr << "rank " << rank << ": failing the first attempt on purpose\n";
      return 3;
    }
    torch::manual_seed(1234 + rank);  // different initial weights: the synchronizer aligns them
    torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                                torch::nn::Linear(16, 4));
    shampoo::GradientSynchronizer sync(model->parameters(), group);
    shampoo::DistributedShampoo optimizer(
        model->parameters(),
        shampoo::ShampooOptions::reference_defaults(0.02).epsilon(1e-6).precondition_frequency(2).grafting(
            shampoo::AdamGraftingConfig{}),
        shampoo::DistributedOptions().process_group(group));

    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const auto inputs = at::randn({64, 8}, gen);
    const auto labels = at::randint(4, {64}, gen, at::TensorOptions().dtype(at::kLong));
    const int64_t shard = 64 / world;
    const auto x = inputs.narrow(0, rank * shard, shard);
    const auto y = labels.narrow(0, rank * shard, shard);
    double first = 0, last = 0;
    for (int step = 0; step < 20; ++step) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      sync.synchronize();
      optimizer.step();
      last = loss.item<double>();
      if (step == 0) first = last;
    }
    // Parameters identical on every rank: gather each rank's parameters and compare bitwise.
    std::vector<at::Tensor> flat;
    for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape(-1));
    auto mine = at::cat(flat);
    auto all = at::empty({world * mine.numel()}, mine.options());
    group->getBackend(c10::DeviceType::CPU)->_allgather_base(all, mine)->wait();
    bool identical = true;
    for (int r = 0; r < world; ++r)
      identical &= at::equal(all.narrow(0, r * mine.numel(), mine.numel()), mine);
    const auto stats = optimizer.stats();
    std::cout << "rank " << rank << "/" << world << ": local loss " << first << " -> " << last
              << ", owned blocks " << stats.owned_blocks << "/" << stats.total_blocks
              << ", collectives per step " << stats.collectives_last_step
              << ", parameters identical on all ranks: " << (identical ? "yes" : "no") << std::endl;
    return identical && stats.collectives_last_step == 1 && last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "torchrun_smoke: " << e.what() << std::endl;
    return 1;
  }
}
