// Checkpoints of DistributedShampoo: torch::save(optimizer, path) / torch::load(optimizer, path).
//
// Layout (torch::serialize archive):
//   shampoo/format_version, shampoo/world_size, shampoo/rank
//                                             ints (trainer-group world size and rank); the
//                                             header that marks a DistributedShampoo checkpoint
//   params/num_params, params/shape_<i>       the model the state belongs to
//   groups/num_groups, groups/group_<g>/...   each group's options (every field of
//                                             shampoo/option_fields.cpp), step count, size
//   blocks/<p>_b<b>/<name>                    state of every block this rank owns, keyed by
//                                             block id (so merged and unmerged runs read each
//                                             other's checkpoints)
// Loading validates everything against the optimizer first and swaps the new state in only when
// every block was read: a failed load leaves the optimizer as it was.
// World-size-independent checkpoint directories (parallel/checkpoints/distributed_checkpoint.h) use
// the same entries without blocks/ as their common part, and one piece "block/p<P>_b<B>" per block.
#include "shampoo/checkpoint.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "shampoo/engine_checkpoint.h"
#include "shampoo/option_fields.h"

namespace shampoo {

torch::serialize::InputArchive read_checkpoint(const std::string& path) {
  std::error_code ec;
  TORCH_CHECK(std::filesystem::is_regular_file(path, ec), path,
              ": no such checkpoint file (or not a regular file)");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    // LibTorch's reader says what failed inside the zip ("failed finding central directory"),
    // but not which file; its first sentence is kept.
    const std::string reason = e.msg().substr(0, e.msg().find_first_of(".\n"));
    TORCH_CHECK(
        false, path,
        ": not a readable checkpoint (truncated, damaged, or not a torch archive): ", reason);
  }
  return archive;
}

void load_checkpoint(torch::optim::Optimizer& optimizer, const std::string& path) {
  auto archive = read_checkpoint(path);
  try {
    optimizer.load(archive);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.msg());
  }
}

}  // namespace shampoo

namespace shampoo::detail {
namespace {

// 2: every option field is written (1 lacked the preconditioner and the exponent overrides),
// and the header is under shampoo/.
constexpr int64_t kFormatVersion = 2;

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key,
                 const std::string& where = "") {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value) && value.isInt(), "checkpoint: entry '", where, key,
              "' is missing (the file is damaged or not a DistributedShampoo checkpoint)");
  return value.toInt();
}

/// The checkpoint's header; an error saying what the archive is when it has none.
torch::serialize::InputArchive read_header(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive header;
  const bool found = archive.try_read("shampoo", header);
  c10::IValue old_version;
  TORCH_CHECK(found || !archive.try_read("format_version", old_version),
              "checkpoint: written by an earlier DistributedShampoo (format version ",
              old_version.isInt() ? old_version.toInt() : -1,
              ", without a 'shampoo/' header); this version reads format ", kFormatVersion,
              " only");
  TORCH_CHECK(found,
              "checkpoint: this archive is not a DistributedShampoo checkpoint (it has no "
              "'shampoo/format_version' entry; was it written by another optimizer?)");
  return header;
}

}  // namespace

void EngineCheckpoint::save_common(
    torch::serialize::OutputArchive& archive,
    const std::vector<torch::optim::OptimizerParamGroup>& groups) const {
  auto& e = *engine_;
  torch::serialize::OutputArchive header;
  header.write("format_version", c10::IValue(kFormatVersion));
  header.write("world_size", c10::IValue(static_cast<int64_t>(e.distributor_->world_size())));
  header.write("rank", c10::IValue(static_cast<int64_t>(e.distributor_->rank())));
  header.write("shard_by_parameter",
               c10::IValue(int64_t{e.distributor_->shard_by_parameter() ? 1 : 0}));
  archive.write("shampoo", header);

  torch::serialize::OutputArchive model;
  model.write("num_params", c10::IValue(static_cast<int64_t>(e.front_.registry.params.size())));
  for (size_t p = 0; p < e.front_.registry.params.size(); ++p) {
    model.write("shape_" + std::to_string(p),
                at::tensor(e.front_.registry.params[p].param.sizes().vec(),
                           at::TensorOptions().dtype(at::kLong)),
                /*is_buffer=*/true);
  }
  archive.write("params", model);

  torch::serialize::OutputArchive all_groups;
  all_groups.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive group;
    options_of(groups[g], g).serialize(group);
    group.write("step", c10::IValue(e.front_.group_steps[g]));
    group.write("lr_sum", c10::IValue(e.front_.group_lr_sums[g]));
    group.write("num_params", c10::IValue(e.front_.registry.group_sizes[g]));
    all_groups.write("group_" + std::to_string(g), group);
  }
  all_groups.write("eval_mode", c10::IValue(int64_t{e.eval_mode_ ? 1 : 0}));
  archive.write("groups", all_groups);
}

namespace {

torch::serialize::OutputArchive block_archive(const BlockState& state) {
  torch::serialize::OutputArchive block;
  for (const auto& [name, tensor] : state) block.write(name, tensor, /*is_buffer=*/true);
  return block;
}

BlockState read_block_archive(torch::serialize::InputArchive& block) {
  BlockState state;
  for (const auto& name : block.keys()) {
    at::Tensor tensor;
    if (block.try_read(name, tensor, /*is_buffer=*/true)) state[name] = tensor;
  }
  return state;
}

std::string piece_key(const BlockId& id) { return "block/" + id.key(); }

}  // namespace

void EngineCheckpoint::save(torch::serialize::OutputArchive& archive,
                            const std::vector<torch::optim::OptimizerParamGroup>& groups) const {
  auto& e = *engine_;
  save_common(archive, groups);
  torch::serialize::OutputArchive blocks;
  for (const auto& [id, state] : e.front_.export_states()) {
    auto block = block_archive(state);
    blocks.write(id.key(), block);
  }
  archive.write("blocks", blocks);
}

void EngineCheckpoint::save_pieces(PieceWriter& pieces) const {
  if (writes_pieces()) save_block_pieces(pieces, piece_key);
}

void EngineCheckpoint::save_block_pieces(PieceWriter& pieces, const BlockPieceName& name_of) const {
  auto& e = *engine_;
  for (const auto& [id, state] : e.front_.export_states())
    pieces.add(name_of(id), block_archive(state));
}

namespace {

/// The header's format version; returns the header.
torch::serialize::InputArchive check_version(torch::serialize::InputArchive& archive) {
  auto header = read_header(archive);
  const int64_t version = read_int(header, "format_version", "shampoo/");
  TORCH_CHECK(version == kFormatVersion, "checkpoint: format version ", version,
              " is not supported (expected ", kFormatVersion, ")");
  return header;
}

/// The header of this rank's file: the format and the trainer group that wrote it.
void check_header(torch::serialize::InputArchive& archive, const Distributor& distributor) {
  auto header = check_version(archive);
  const int64_t world_size = read_int(header, "world_size", "shampoo/");
  TORCH_CHECK(world_size == distributor.world_size(),
              "checkpoint: written by a trainer group "
              "of ",
              world_size, " ranks, this run has ", distributor.world_size(),
              "; loading at a different world size is not supported (each rank's file holds "
              "the blocks that rank owned)");
  const int64_t rank = read_int(header, "rank", "shampoo/");
  TORCH_CHECK(rank == distributor.rank(), "checkpoint: written by rank ", rank, ", loaded by rank ",
              distributor.rank(), "; every rank loads its own file");
  // Written since gradient sharding; absent in older files, which owned blocks.
  c10::IValue by_parameter;
  const bool saved_by_parameter =
      header.try_read("shard_by_parameter", by_parameter) && by_parameter.toInt() != 0;
  TORCH_CHECK(saved_by_parameter == distributor.shard_by_parameter(),
              "checkpoint: DistributedOptions.shard_by_parameter was ",
              saved_by_parameter ? "true" : "false", " when it was written and is ",
              distributor.shard_by_parameter() ? "true" : "false",
              " here, so this rank owns other blocks than the rank that wrote the file; use the "
              "same setting, or save_distributed_checkpoint / load_distributed_checkpoint, "
              "which load under any ownership");
}

/// The parameter list: the same number of parameters with the same shapes.
void check_model(torch::serialize::InputArchive& archive, const std::vector<ParamEntry>& params) {
  torch::serialize::InputArchive model;
  TORCH_CHECK(archive.try_read("params", model), "checkpoint: no parameter list");
  const int64_t num_params = read_int(model, "num_params");
  TORCH_CHECK(num_params == static_cast<int64_t>(params.size()),
              "checkpoint: written for a "
              "model with ",
              num_params, " parameters, this optimizer has ", params.size());
  for (size_t p = 0; p < params.size(); ++p) {
    at::Tensor shape;
    TORCH_CHECK(model.try_read("shape_" + std::to_string(p), shape, /*is_buffer=*/true),
                "checkpoint: no shape for parameter ", p);
    const auto expected = params[p].param.sizes().vec();
    // Read on the host: an archive loaded with a CUDA map location holds this on the GPU.
    shape = shape.to(at::kCPU, at::kLong).contiguous();
    const std::vector<int64_t> got(shape.data_ptr<int64_t>(),
                                   shape.data_ptr<int64_t>() + shape.numel());
    TORCH_CHECK(got == expected, "checkpoint: written for a different model: parameter ", p,
                " has shape ", at::IntArrayRef(got), " there and ", at::IntArrayRef(expected),
                " here");
  }
}

/// An entry added after format 2 was fixed (iterate averaging): `fallback` when absent.
c10::IValue read_optional(torch::serialize::InputArchive& archive, const std::string& key,
                          c10::IValue fallback) {
  c10::IValue value;
  return archive.try_read(key, value) ? value : fallback;
}

/// How to load a checkpoint whose structural field `differing` holds the reference's value, the
/// behaviour of before two changes of the defaults (2026-11-28): ShampooOptions() then had the
/// reference's defaults (precondition_frequency, grafting), and every dim was factored
/// (precondition_1d, max_factored_dim did not exist; an archive without them reads as that).
/// Empty for other differences.
const char* former_defaults_hint(const OptionField& differing, const ShampooOptions& saved) {
  if (differing.code(saved) != differing.code(ShampooOptions::reference_defaults())) return "";
  if (differing.name == "precondition_frequency" || differing.name == "grafting kind") {
    return "; a checkpoint of an optimizer built with ShampooOptions() before 2026-11-28, whose "
           "defaults were the reference implementation's, loads into one built with "
           "ShampooOptions::reference_defaults(lr)";
  }
  if (differing.name == "precondition_1d" || differing.name == "max_factored_dim") {
    return "; a checkpoint written before precondition_1d and max_factored_dim existed factors "
           "every dim: it loads with precondition_1d(true) and max_factored_dim(-1), or, for an "
           "optimizer built with the reference's defaults of before 2026-11-28, with "
           "ShampooOptions::reference_defaults(lr)";
  }
  return "";
}

/// The options of param group g as `archive` holds them, checked: valid, and the structural ones
/// equal to this optimizer's `current` (the state loads into either storage layout,
/// use_symmetric_packing).
/// A checkpoint written with other storage options (factor dtype, packing, compact state,
/// factored grafting) loads, its state converted: say so, naming each (the reference's warning
/// when a checkpoint's options differ; structural differences are errors above, and the float
/// options are restored from the checkpoint, as LibTorch's optimizers restore theirs).
void warn_storage_differences(const ShampooOptions& saved, const ShampooOptions& current,
                              size_t g) {
  std::vector<std::string> differences;
  for (const auto& field : option_fields()) {
    if (field.storage_layout && field.code(saved) != field.code(current)) {
      differences.push_back(describe_difference(field, saved, current));
    }
  }
  if (differences.empty()) return;
  TORCH_WARN("checkpoint: param group ", g,
             " was saved with other storage options, converted on load (got the checkpoint's, "
             "expected this optimizer's): ",
             c10::Join("; ", differences));
}

ShampooOptions read_saved_options(torch::serialize::InputArchive& archive, size_t g,
                                  const ShampooOptions& current) {
  ShampooOptions saved = current;
  try {
    saved.serialize(archive);
    saved.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint: param group ", g, ": ", e.msg());
  }
  const auto* differing = structural_difference(saved, current, /*for_checkpoint=*/true);
  TORCH_CHECK(differing == nullptr, "checkpoint: param group ", g, ": ", differing->name, ": got ",
              differing->describe(saved), " in the checkpoint, expected ",
              differing->describe(current),
              " as in this optimizer (a structural option; build the optimizer with the "
              "checkpoint's value",
              former_defaults_hint(*differing, saved), ")");
  warn_storage_differences(saved, current, g);
  return saved;
}

/// The options and step of param group g, checked against its size and structural options here.
void read_group(torch::serialize::InputArchive& all_groups, size_t g, int64_t num_params,
                const ShampooOptions& current, ShampooOptions& saved, int64_t& step,
                double& lr_sum) {
  torch::serialize::InputArchive group;
  TORCH_CHECK(all_groups.try_read("group_" + std::to_string(g), group),
              "checkpoint: no entry for param group ", g);
  const int64_t size = read_int(group, "num_params");
  TORCH_CHECK(size == num_params, "checkpoint: param group ", g, " has ", size,
              " parameters there, ", num_params, " here");
  saved = read_saved_options(group, g, current);
  step = read_int(group, "step");
  const auto sum = read_optional(group, "lr_sum", c10::IValue(0.0));
  TORCH_CHECK(sum.isDouble() && std::isfinite(sum.toDouble()) && sum.toDouble() >= 0.0,
              "checkpoint: param group ", g, ": entry 'lr_sum' is not a finite float >= 0");
  lr_sum = sum.toDouble();
}

}  // namespace

struct EngineCheckpoint::PreparedLoad {
  std::vector<std::unique_ptr<VirtualGroup>> virtual_groups;
  std::vector<ShampooOptions> options;
  std::vector<int64_t> steps;
  std::vector<double> lr_sums;
  bool eval_mode = false;
};

std::shared_ptr<EngineCheckpoint::PreparedLoad> EngineCheckpoint::prepare(
    torch::serialize::InputArchive& archive, const std::function<BlockState(int64_t)>& read_block,
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& e = *engine_;
  check_model(archive, e.front_.registry.params);
  torch::serialize::InputArchive all_groups;
  TORCH_CHECK(archive.try_read("groups", all_groups), "checkpoint: no param groups");
  const int64_t num_groups = read_int(all_groups, "num_groups");
  TORCH_CHECK(num_groups == static_cast<int64_t>(groups.size()), "checkpoint: ", num_groups,
              " param groups there, ", groups.size(), " here");
  auto prepared = std::make_shared<PreparedLoad>();
  prepared->options.resize(groups.size());
  prepared->steps.resize(groups.size());
  prepared->lr_sums.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    read_group(all_groups, g, e.front_.registry.group_sizes[g], options_of(groups[g], g),
               prepared->options[g], prepared->steps[g], prepared->lr_sums[g]);
  }
  const auto eval_mode = read_optional(all_groups, "eval_mode", c10::IValue(int64_t{0}));
  TORCH_CHECK(eval_mode.isInt(), "checkpoint: entry 'groups/eval_mode' is not an int");
  prepared->eval_mode = eval_mode.toInt() != 0;
  read_block_states(*prepared, read_block, groups);
  return prepared;
}

void EngineCheckpoint::read_block_states(
    PreparedLoad& prepared, const std::function<BlockState(int64_t)>& read_block,
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& e = *engine_;
  std::map<BlockId, BlockState> states;
  for (int64_t b = 0; b < static_cast<int64_t>(e.front_.registry.blocks.size()); ++b) {
    if (e.distributor_->owns(b)) states[e.front_.registry.blocks[b].id] = read_block(b);
  }
  // New virtual groups; the current ones stay in place until install().
  prepared.virtual_groups = e.front_.build_virtual_groups(groups);
  for (auto& vg : prepared.virtual_groups) vg->import_states(states, /*require_all=*/true);
}

void EngineCheckpoint::install(ShampooEngine& engine, PreparedLoad& prepared,
                               std::vector<torch::optim::OptimizerParamGroup>& groups) {
  engine.broken_.clear();
  engine.front_.replace_virtual_groups(std::move(prepared.virtual_groups));
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& field : option_fields()) {
      if (field.kind == OptionKind::kFloat) {
        field.copy(prepared.options[g], options_of(groups[g], g));
      }
    }
    engine.front_.group_steps[g] = prepared.steps[g];
    engine.front_.group_lr_sums[g] = prepared.lr_sums[g];
  }
  engine.eval_mode_ = prepared.eval_mode;
}

void EngineCheckpoint::load(torch::serialize::InputArchive& archive,
                            std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& e = *engine_;
  e.front_.register_added(groups);
  e.front_.check(groups);
  check_header(archive, *e.distributor_);
  torch::serialize::InputArchive all_blocks;
  TORCH_CHECK(archive.try_read("blocks", all_blocks), "checkpoint: no block states");
  const auto prepared = prepare(
      archive,
      [&](int64_t b) {
        const auto& id = e.front_.registry.blocks[b].id;
        torch::serialize::InputArchive block;
        TORCH_CHECK(all_blocks.try_read(id.key(), block), "checkpoint: no state for ",
                    id.to_string(), " (written for another model or another rank layout)");
        return read_block_archive(block);
      },
      groups);
  install(e, *prepared, groups);
}

std::function<void()> EngineCheckpoint::prepare_load(
    torch::serialize::InputArchive& common, PieceReader& pieces,
    std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& e = *engine_;
  e.front_.check(groups);  // what the base class appended was registered before (collectively)
  TORCH_CHECK(!e.transaction_.is_open(),
              "checkpoint: cannot load while a step is open (in backward)");
  check_version(common);
  const auto prepared = prepare(
      common,
      [&](int64_t b) {
        auto block = pieces.read(piece_key(e.front_.registry.blocks[b].id));
        return read_block_archive(block);
      },
      groups);
  return [engine = engine_, prepared, &groups] { install(*engine, *prepared, groups); };
}

std::function<void()> EngineCheckpoint::prepare_block_load(
    PieceReader& pieces, const BlockPieceName& name_of, std::vector<int64_t> steps,
    std::vector<double> lr_sums, std::optional<bool> eval_mode,
    std::vector<torch::optim::OptimizerParamGroup>& groups) {
  auto& e = *engine_;
  e.front_.check(groups);
  TORCH_CHECK(!e.transaction_.is_open(),
              "checkpoint: cannot load while a step is open (in backward)");
  TORCH_CHECK(steps.size() == groups.size() && lr_sums.size() == groups.size(),
              "checkpoint: step counts for ", steps.size(), " and lr sums for ", lr_sums.size(),
              " param groups, the optimizer has ", groups.size());
  auto prepared = std::make_shared<PreparedLoad>();
  for (size_t g = 0; g < groups.size(); ++g) prepared->options.push_back(options_of(groups[g], g));
  prepared->steps = std::move(steps);
  prepared->lr_sums = std::move(lr_sums);
  prepared->eval_mode = eval_mode.value_or(e.eval_mode_);
  read_block_states(
      *prepared,
      [&](int64_t b) {
        auto block = pieces.read(name_of(e.front_.registry.blocks[b].id));
        return read_block_archive(block);
      },
      groups);
  return [engine = engine_, prepared, &groups] { install(*engine, *prepared, groups); };
}

std::function<void()> EngineCheckpoint::prepare_saved_options(
    const std::vector<std::shared_ptr<torch::serialize::InputArchive>>& saved,
    std::vector<torch::optim::OptimizerParamGroup>& groups) {
  TORCH_CHECK(saved.size() == groups.size(), "checkpoint: options of ", saved.size(),
              " param groups for ", groups.size());
  auto options = std::make_shared<std::vector<ShampooOptions>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    options->push_back(read_saved_options(*saved[g], g, options_of(groups[g], g)));
  }
  return [options, &groups] {
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const auto& field : option_fields()) {
        if (field.kind == OptionKind::kFloat) field.copy((*options)[g], options_of(groups[g], g));
      }
    }
  };
}

bool EngineCheckpoint::writes_pieces() const {
  auto& e = *engine_;
  // Trainer groups after the first hold copies of the first one's blocks.
  return e.distributor_->global_rank() < e.distributor_->world_size();
}

int ShampooEngine::rank() const { return distributor_->rank(); }

}  // namespace shampoo::detail
