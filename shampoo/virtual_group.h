#pragma once
/// A virtual group: the param groups whose structural options are equal, run as one unit. Its
/// blocks owned by this rank are arranged in stacks of equal shape and dtype; the float
/// hyperparameters of every block are read from its own param group's live options each step.

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "distributor/block_plan.h"
#include "distributor/distributor.h"
#include "preconditioners/preconditioner_list.h"
#include "shampoo/fault_point.h"
#include "shampoo/shampoo_options.h"
#include "update/elementwise_chain.h"
#include "update/elementwise_state.h"

namespace shampoo::detail {

class StepUpdates;

/// The bound on a step's gradient buffers (G' and Ḡ) per chunk of rows: 64 MiB. A step runs its
/// blocks in chunks of rows within it, so the buffers never hold a whole large stack. Tests set
/// it (≤ 0 = the default) to check that the chunks do not change a result.
int64_t step_chunk_bytes();
void set_step_chunk_bytes_for_testing(int64_t bytes);
/// Test seam: whether groups whose family is elementwise take the fused pass (default true);
/// off, they take the three passes with the list's update() and precondition(), as matrix
/// families do (and as CUDA tensors and grafting do). The same formulas; the list's ATen ops
/// round V's update once (addcmul's fused multiply-add) and take MKL's vector sqrt on the CPU,
/// so with a second moment the two agree within float32 rounding, without one bit for bit.
void set_fused_step_for_testing(bool enabled);
/// How many chunks took the fused pass in this process so far (tests).
int64_t fused_chunks_for_testing();

/// The dtype a parameter is stepped in: its own for Float and Double; Float for BFloat16 and
/// Half (their state, the update and W + U are float32; the result is rounded into the
/// parameter), as the reference keeps its factors in float32 (factor_matrix_dtype).
at::ScalarType compute_dtype(at::ScalarType param_dtype);
/// Whether a step works on a copy of `param` (another compute dtype, or a layout that is not
/// contiguous, such as a channels_last conv weight) instead of the parameter itself.
bool needs_work_copy(const at::Tensor& param);
/// What a step reads and updates in place of `param`: the parameter, or a contiguous copy in the
/// compute dtype that write_back() rounds into it.
at::Tensor work_tensor(const at::Tensor& param);
/// Copies a work copy's values into its parameter (in the parameter's dtype and layout); nothing
/// when `work` is the parameter itself.
void write_back(const at::Tensor& param, const at::Tensor& work);

/// A registered parameter.
struct ParamEntry {
  at::Tensor param;
  int64_t group = 0;
  BlockPlan plan;
  int64_t first_block = 0;  ///< index of its first block in the engine's block list
};

/// A registered block.
struct BlockEntry {
  BlockId id;
  int64_t param = 0;  ///< index into the parameter list
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int owner = 0;
  int64_t virtual_group = 0;
};

/// State of one block for checkpoints and rebuilds: name -> tensor.
using BlockState = std::map<std::string, at::Tensor>;

/// What a step changes, saved before it changes, so that a step that throws can be undone.
struct StepJournal {
  /// Per virtual group: what is not per block.
  struct GroupMark {
    AmortizedCounters counters;
    ElementwiseState::Allocated allocated;  // which lazily allocated stacks existed
  };
  std::vector<GroupMark> groups;
  std::map<BlockId, BlockState> states;  ///< blocks about to change: what the step can change
  std::vector<std::pair<at::Tensor, at::Tensor>> params;  ///< (parameter, copy) updated in place
  int64_t bytes = 0;                                      ///< bytes copied
};

/// What a virtual group needs to read during a step.
struct StepInputs {
  const std::vector<ParamEntry>& params;
  const std::vector<BlockEntry>& blocks;
  const std::vector<const ShampooOptions*>& group_options;  ///< per param group, live
  const std::vector<int64_t>& group_steps;                  ///< per param group, this step
  /// Per param group: Σ lr^p of Schedule-Free including this step's term (0 otherwise).
  const std::vector<double>& group_lr_sums;
  /// Per parameter: block views of its gradient (empty when it has no gradient this step).
  const std::vector<std::vector<at::Tensor>>& grad_blocks;
  /// Per parameter: block views of the parameter.
  const std::vector<std::vector<at::Tensor>>& param_blocks;
  /// Per parameter with a gradient this step: max |gradient| (bounds the factor update).
  const std::vector<double>& grad_abs_max;
  Distributor& distributor;
  /// Test seam, called at each FaultPoint (may be empty).
  const StepFaultInjector& fault;
  /// Per engine block: set to true for the blocks this call computed.
  std::vector<bool>& computed;
};

class VirtualGroup {
 public:
  /// `owned`: indices of the blocks of this group that this rank computes (ascending).
  VirtualGroup(const ShampooOptions& structure, std::vector<int64_t> user_groups,
               std::vector<int64_t> owned, const std::vector<BlockEntry>& blocks,
               const std::vector<ParamEntry>& params, FailureInjector inject_failure);

  const ShampooOptions& structural_options() const { return structure_; }
  const std::vector<int64_t>& user_groups() const { return user_groups_; }
  int64_t owned_blocks() const { return static_cast<int64_t>(owned_.size()); }

  /// Computes the step of every owned block with a gradient, in the phases of docs/math.md:
  /// prepare_chunk (rows, per-block scalars, where updates go) → gradient statistics (L2 weight
  /// decay, grafting statistics, filtering) → Kronecker factors and amortized roots → matrix
  /// preconditioning → grafting norms → graft, decoupled weight decay, momentum, × −lr → apply
  /// (in place in a single process, into the distributor's slot when distributed). A family
  /// whose direction is elementwise (diagonal, sign with scale 1) without grafting, on the CPU,
  /// runs all of it as the chain's fused pass: one pass over memory, no step buffers.
  void step(const StepInputs& in);

  /// Whether step(in) could throw after it has started changing state (an amortized computation
  /// at the limit of the failure policy, or a factor update that may overflow). Changes nothing;
  /// throws at once when a factor of a due block is non-finite already.
  bool may_raise(const StepInputs& in) const;
  /// Saves into `journal` the state that step(in) will change: the blocks with a gradient (those
  /// not saved yet) and, once per step, the group's counters and lazily allocated stacks.
  void save(const StepInputs& in, StepJournal::GroupMark& mark, bool first_save,
            StepJournal& journal) const;
  /// Puts back what save() took.
  void restore(const StepJournal::GroupMark& mark, const StepJournal& journal);

  /// Iterate averaging (docs/math.md, "Iterate averaging"): moves the parameters of the owned
  /// blocks from the training sequence y to the evaluation sequence x (`to_eval`), or back:
  /// W ← W + c·(Z − W), c = 1 − 1/μy or 1 − μy. A block whose Z is not set yet (no step) is
  /// unchanged. In place in a single process; distributed, the change (or with
  /// communicate_params the changed block) goes into the Distributor's slot, flagged.
  void switch_sequence(bool to_eval, const std::vector<ParamEntry>& params,
                       const std::vector<BlockEntry>& blocks, Distributor& distributor) const;

  void export_states(std::map<BlockId, BlockState>& out) const;
  /// Restores the states of the owned blocks found in `states` (missing ones keep their fresh
  /// state when `require_all` is false; otherwise an error names the first missing block).
  void import_states(const std::map<BlockId, BlockState>& states, bool require_all);

  AmortizedCounters counters() const;
  int64_t state_bytes() const;
  /// Adds the bytes of state held to `out` by kind.
  void add_memory(MemorySummary& out) const;

 private:
  struct Stack {
    StackSpec spec;
    /// No factor left by the per-parameter rules (factor_choice.h): the grafting update alone.
    bool diagonal = false;
    std::vector<int64_t> blocks;  // engine block indices, one per member (row)
    std::vector<BlockId> ids;     // their ids
  };
  struct StackStep;
  struct ChunkStep;
  /// The rows with a gradient of every stack, in chunks (per chunk, Rows per stack) whose step
  /// buffers (G' and Ḡ rows) stay within step_chunk_bytes(); small stacks share a chunk.
  std::vector<std::vector<Rows>> step_chunks(const StepInputs& in) const;
  /// Whether this step takes the chain's fused pass (see step()).
  bool fused_step() const;
  /// Phase 1: the rows of `chunk` of every stack, their scalars and masks, the step's buffers and
  /// the chain entries (with where each update goes); `fused`: the chain entries only.
  ChunkStep prepare_chunk(const StepInputs& in, const std::vector<Rows>& chunk,
                          StepUpdates& updates, bool fused);
  /// The chain entry of member `row` (the i-th row with a gradient) of stack `s`; `st` null: for
  /// the fused pass (the list's elementwise direction, no step buffers).
  ChainBlockTensors chain_entry(const StepInputs& in, int64_t s, int64_t row, int64_t i,
                                StackStep* st, StepUpdates& updates);
  /// Phase 3: the factor statistics of every stepped row and the amortized computations due.
  void update_statistics(ChunkStep& chunk_step);
  /// Phase 4: the matrix preconditioning of Ḡ of the rows that need it (their chain entries
  /// then point to the result).
  void precondition(ChunkStep& chunk_step);
  /// Places the groups and stacks of `blocks` into stacks_ (constructor).
  void build_stacks(const std::vector<BlockEntry>& blocks, const std::vector<ParamEntry>& params);
  /// Copies of every state tensor of member r of stack s (checkpoints, rebuilds, journals).
  BlockState export_member(int64_t s, int64_t r) const;
  /// Rows (members) of stack `s` whose parameter has a gradient in `in`.
  Rows rows_with_gradients(int64_t s, const StepInputs& in) const;

  ShampooOptions structure_;
  std::vector<int64_t> user_groups_;
  std::vector<int64_t> owned_;
  std::vector<Stack> stacks_;
  std::unique_ptr<PreconditionerList> preconditioner_;
  std::unique_ptr<ElementwiseState> elementwise_;
};

/// The number of dims blocking merges a parameter down to (distributor/block_plan.h): the
/// family's block order (2 for spectral descent, whose blocks must be matrices; else 1).
int64_t block_target_order(const ShampooOptions& options);

}  // namespace shampoo::detail
