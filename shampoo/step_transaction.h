#pragma once
/// The open step of a DistributedShampoo as a transaction: a step either completes or changes
/// nothing. What a compute call is about to change is saved first when a later phase can still
/// throw (the journal: the state of the blocks it steps, counters, and in a single process the
/// parameters it updates in place); an aborted step puts it back. The engine decides when to
/// open, save, restore and close; this class holds the journal and the step's bookkeeping.

#include <cstdint>
#include <memory>
#include <vector>

#include "shampoo/virtual_group.h"

namespace shampoo::detail {

class StepTransaction {
 public:
  /// Opens a step over `virtual_groups` virtual groups and `blocks` blocks. `protect_all`: every
  /// compute call saves what it changes (a later phase can throw after blocks changed).
  /// `agree`: the ranks agree (Distributor::agree) before the step changes any state.
  void open(size_t virtual_groups, size_t blocks, bool protect_all, bool agree);
  bool is_open() const { return open_; }
  bool protect_all() const { return protect_all_; }
  /// Whether the step still has to agree before it changes state.
  bool agreement_pending() const { return agreement_pending_; }
  void set_agreed() { agreement_pending_ = false; }
  /// A compute call changes state without saving it: an abort can no longer undo the step.
  void note_unjournaled_change() { unjournaled_change_ = true; }
  bool unjournaled_change() const { return unjournaled_change_; }

  /// Saves what a compute call with `inputs` is about to change: the state of the blocks each
  /// virtual group will step and, with `keep_params` (a single process updates in place), the
  /// parameters of `stepped` (indices into `params`).
  void save(const std::vector<std::unique_ptr<VirtualGroup>>& groups, const StepInputs& inputs,
            const std::vector<ParamEntry>& params, const std::vector<int64_t>& stepped,
            bool keep_params);
  /// Puts back everything saved since open (nothing when nothing was saved).
  void restore(const std::vector<std::unique_ptr<VirtualGroup>>& groups);
  /// Closes the step and drops the journal.
  void close();

  /// Per block: computed by this rank in the open step.
  std::vector<bool>& computed() { return computed_; }
  const std::vector<bool>& computed() const { return computed_; }
  /// Whether the open step's AllGather was attempted (an abort then does not join it again).
  bool exchange_attempted() const { return exchange_attempted_; }
  void set_exchange_attempted() { exchange_attempted_ = true; }
  /// Bytes the last closed step saved (0 when it saved nothing).
  int64_t saved_bytes_last_step() const { return saved_bytes_last_step_; }

 private:
  bool open_ = false;
  bool protect_all_ = false;
  bool saved_ = false;
  bool exchange_attempted_ = false;
  bool agreement_pending_ = false;
  bool unjournaled_change_ = false;
  StepJournal journal_;
  std::vector<bool> computed_;
  int64_t saved_bytes_last_step_ = 0;
};

}  // namespace shampoo::detail
