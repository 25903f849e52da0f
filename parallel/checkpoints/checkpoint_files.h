#pragma once
/// The files of a world-size-independent checkpoint (distributed_checkpoint.h): atomic writes
/// (temporary file, fsync, rename), checksums (64-bit FNV-1a), the MANIFEST (render, read,
/// check), generation directories ("gen-<G>") and per-rank file names, and reading a file back
/// checked against its MANIFEST entry. distributed_checkpoint.cpp runs the save and load
/// protocols over these.

#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <system_error>

#include "parallel/checkpoints/distributed_checkpoint.h"

namespace shampoo::detail::checkpoint_files {

inline constexpr const char* kManifestName = "MANIFEST";

/// Writes `final_path` atomically: `write` fills a temporary file, which is flushed and renamed.
/// Returns the file's size and checksum (`name` relative to the checkpoint directory).
CheckpointManifest::File write_atomically(
    const std::filesystem::path& final_path, const std::string& name,
    const std::function<void(const std::filesystem::path&)>& write);

/// Removes `path` and, for a directory, everything under it. (Not std::filesystem::remove_all:
/// the torch wheel's libtorch.so exports its own copy, which crashes when called from here.)
void remove_tree(const std::filesystem::path& path, std::error_code& ec);

void write_text(const std::filesystem::path& path, const std::string& text);

/// "gen-<G>" (six digits) and "rank-<r>-of-<world><extension>" (five digits each).
std::string generation_dir(int64_t generation);
std::string rank_file(int rank, int world, const char* extension);

/// The generation number of a "gen-<G>" directory name, or -1.
int64_t parse_generation(const std::string& name);

/// One more than the newest generation in `dir`, committed or not (a save killed part-way leaves
/// its directory behind; the next save does not reuse it).
int64_t next_generation(const std::filesystem::path& dir);

/// The MANIFEST's text, its own checksum on the last line.
std::string render_manifest(const CheckpointManifest& manifest);

/// The bytes of a file of the checkpoint, read once and checked against its manifest entry.
std::string read_checked(const std::filesystem::path& dir,
                         const CheckpointManifest::File& expected);

/// A torch archive of the checkpoint, checked against the manifest first (the file is read once).
torch::serialize::InputArchive load_archive(const std::filesystem::path& dir,
                                            const CheckpointManifest::File& file);

/// The manifest's entry for `name`; an error when it does not list it.
const CheckpointManifest::File& manifest_file(const CheckpointManifest& manifest,
                                              const std::filesystem::path& dir,
                                              const std::string& name);

/// Every piece's location, from the key files the manifest lists.
std::map<std::string, PieceReader::Location> read_locations(const std::filesystem::path& dir,
                                                            const CheckpointManifest& manifest);

}  // namespace shampoo::detail::checkpoint_files
