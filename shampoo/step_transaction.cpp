#include "shampoo/step_transaction.h"

#include <c10/util/Exception.h>

#include "shampoo/param_updates.h"

namespace shampoo::detail {

void StepTransaction::open(size_t virtual_groups, size_t blocks, bool protect_all, bool agree) {
  TORCH_CHECK(!open_, "DistributedShampoo: a step is already open (begin without finish)");
  open_ = true;
  protect_all_ = protect_all;
  saved_ = false;
  exchange_attempted_ = false;
  agreement_pending_ = agree;
  unjournaled_change_ = false;
  journal_ = StepJournal{};
  journal_.groups.resize(virtual_groups);
  computed_.assign(blocks, false);
}

void StepTransaction::save(const std::vector<std::unique_ptr<VirtualGroup>>& groups,
                           const StepInputs& inputs, const std::vector<ParamEntry>& params,
                           const std::vector<int64_t>& stepped, bool keep_params) {
  TORCH_INTERNAL_ASSERT(open_);
  for (size_t k = 0; k < groups.size(); ++k) {
    groups[k]->save(inputs, journal_.groups[k], !saved_, journal_);
  }
  if (keep_params) {
    for (const int64_t p : stepped) {
      journal_.params.emplace_back(params[p].param, params[p].param.clone());
      journal_.bytes += params[p].param.nbytes();
    }
  }
  saved_ = true;
}

void StepTransaction::restore(const std::vector<std::unique_ptr<VirtualGroup>>& groups) {
  if (!saved_) return;
  for (size_t k = 0; k < groups.size(); ++k) groups[k]->restore(journal_.groups[k], journal_);
  restore_params(journal_.params);
}

void StepTransaction::close() {
  saved_bytes_last_step_ = saved_ ? journal_.bytes : 0;
  journal_ = StepJournal{};
  saved_ = false;
  open_ = false;
}

}  // namespace shampoo::detail
