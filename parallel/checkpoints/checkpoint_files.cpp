#include "parallel/checkpoints/checkpoint_files.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <mutex>
#include <sstream>
#include <vector>

namespace shampoo {
namespace fs = std::filesystem;

namespace {

using detail::checkpoint_files::kManifestName;

constexpr int64_t kManifestVersion = 1;
constexpr const char* kManifestMagic = "distributed-shampoo-checkpoint";

std::mutex& hook_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::function<void(const fs::path&)>& write_hook() {
  static std::function<void(const fs::path&)> hook;
  return hook;
}
void run_write_hook(const fs::path& path) {
  std::function<void(const fs::path&)> hook;
  {
    std::lock_guard<std::mutex> lock(hook_mutex());
    hook = write_hook();
  }
  if (hook) hook(path);
}

// 64-bit FNV-1a (Fowler–Noll–Vo), over bytes.
constexpr uint64_t kFnvOffset = 14695981039346656037ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;
uint64_t fnv1a(const char* data, size_t size, uint64_t hash = kFnvOffset) {
  for (size_t i = 0; i < size; ++i) {
    hash ^= static_cast<unsigned char>(data[i]);
    hash *= kFnvPrime;
  }
  return hash;
}

std::string hex(uint64_t value) {
  std::ostringstream out;
  out << std::hex << std::setw(16) << std::setfill('0') << value;
  return out.str();
}

/// Size and checksum of a file as it is on disk.
CheckpointManifest::File describe_file(const fs::path& path, const std::string& name) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "checkpoint: cannot read ", path.string());
  CheckpointManifest::File file{name, 0, kFnvOffset};
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto got = static_cast<size_t>(in.gcount());
    file.checksum = fnv1a(buffer.data(), got, file.checksum);
    file.bytes += static_cast<int64_t>(got);
  }
  return file;
}

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open ", path.string(), ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: cannot flush ", path.string(),
              " to disk: ", std::strerror(saved));
}

}  // namespace

namespace detail::checkpoint_files {

/// Writes `final_path` atomically: `write` fills a temporary file, which is flushed and renamed.
/// Returns the file's size and checksum (`name` relative to the checkpoint directory).
CheckpointManifest::File write_atomically(const fs::path& final_path, const std::string& name,
                                          const std::function<void(const fs::path&)>& write) {
  run_write_hook(final_path);
  fs::path temporary = final_path;
  temporary += ".tmp-" + std::to_string(::getpid());
  write(temporary);
  fsync_path(temporary, /*directory=*/false);
  auto file = describe_file(temporary, name);
  fs::rename(temporary, final_path);
  fsync_path(final_path.parent_path(), /*directory=*/true);
  return file;
}

/// Removes `path` and, for a directory, everything under it. (Not std::filesystem::remove_all:
/// the torch wheel's libtorch.so exports its own copy, which crashes when called from here.)
void remove_tree(const fs::path& path, std::error_code& ec) {
  if (fs::is_directory(fs::symlink_status(path, ec))) {
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      remove_tree(entry.path(), ec);
      if (ec) return;
    }
  }
  fs::remove(path, ec);
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  TORCH_CHECK(out, "checkpoint: cannot write ", path.string());
}

std::string generation_dir(int64_t generation) {
  std::ostringstream name;
  name << "gen-" << std::setw(6) << std::setfill('0') << generation;
  return name.str();
}

std::string rank_file(int rank, int world, const char* extension) {
  std::ostringstream name;
  name << "rank-" << std::setw(5) << std::setfill('0') << rank << "-of-" << std::setw(5)
       << std::setfill('0') << world << extension;
  return name.str();
}

/// The generation number of a "gen-<G>" directory name, or -1.
int64_t parse_generation(const std::string& name) {
  if (name.rfind("gen-", 0) != 0 || name.size() == 4) return -1;
  const auto digits = name.substr(4);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stoll(digits);
}

/// One more than the newest generation in `dir`, committed or not (a save killed part-way leaves
/// its directory behind; the next save does not reuse it).
int64_t next_generation(const fs::path& dir) {
  int64_t newest = 0;
  if (distributed_checkpoint_exists(dir)) newest = read_checkpoint_manifest(dir).generation;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    newest = std::max(newest, parse_generation(entry.path().filename().string()));
  }
  return newest + 1;
}

std::string render_manifest(const CheckpointManifest& manifest) {
  std::ostringstream body;
  body << kManifestMagic << " " << kManifestVersion << "\n"
       << "kind " << manifest.kind << "\n"
       << "generation " << manifest.generation << "\n"
       << "world_size " << manifest.world_size << "\n";
  for (const auto& file : manifest.files) {
    body << "file " << file.name << " " << file.bytes << " " << hex(file.checksum) << "\n";
  }
  const auto text = body.str();
  return text + "checksum " + hex(fnv1a(text.data(), text.size())) + "\n";
}

/// The bytes of a file of the checkpoint, read once and checked against its manifest entry.
std::string read_checked(const fs::path& dir, const CheckpointManifest::File& expected) {
  const auto path = dir / expected.name;
  std::error_code ec;
  TORCH_CHECK(fs::is_regular_file(path, ec), "checkpoint ", dir.string(), ": file ", expected.name,
              " is missing (the MANIFEST lists it); the checkpoint is incomplete");
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(in.good() || in.eof(), "checkpoint ", dir.string(), ": cannot read ", expected.name);
  const auto size = static_cast<int64_t>(bytes.size());
  TORCH_CHECK(size == expected.bytes, "checkpoint ", dir.string(), ": file ", expected.name,
              " has ", size, " bytes, the MANIFEST says ", expected.bytes,
              " (truncated or replaced); the checkpoint is damaged");
  const auto checksum = fnv1a(bytes.data(), bytes.size());
  TORCH_CHECK(checksum == expected.checksum, "checkpoint ", dir.string(), ": file ", expected.name,
              " does not match its checksum in the MANIFEST (", hex(checksum), " against ",
              hex(expected.checksum), "); the checkpoint is damaged");
  return bytes;
}

/// A torch archive of the checkpoint, checked against the manifest first (the file is read once).
torch::serialize::InputArchive load_archive(const fs::path& dir,
                                            const CheckpointManifest::File& file) {
  const auto bytes = read_checked(dir, file);
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    const std::string reason = e.msg().substr(0, e.msg().find_first_of(".\n"));
    TORCH_CHECK(false, "checkpoint ", dir.string(), ": file ", file.name,
                " is not a readable torch archive: ", reason);
  }
  return archive;
}

const CheckpointManifest::File& manifest_file(const CheckpointManifest& manifest,
                                              const fs::path& dir, const std::string& name) {
  for (const auto& file : manifest.files) {
    if (file.name == name) return file;
  }
  TORCH_CHECK(false, "checkpoint ", dir.string(), ": the MANIFEST does not list ", name);
}

/// Every piece's location, from the key files the manifest lists.
std::map<std::string, PieceReader::Location> read_locations(const fs::path& dir,
                                                            const CheckpointManifest& manifest) {
  std::map<std::string, PieceReader::Location> locations;
  const std::string extension = ".keys";
  for (const auto& file : manifest.files) {
    if (file.name.size() < extension.size() ||
        file.name.compare(file.name.size() - extension.size(), extension.size(), extension) != 0) {
      continue;
    }
    std::istringstream in(read_checked(dir, file));
    const auto pieces = file.name.substr(0, file.name.size() - extension.size()) + ".pt";
    manifest_file(manifest, dir, pieces);  // listed too
    std::string key;
    int64_t index = 0;
    while (std::getline(in, key)) {
      const auto [it, inserted] = locations.emplace(key, PieceReader::Location{pieces, index++});
      TORCH_CHECK(inserted, "checkpoint ", dir.string(), ": piece '", key, "' is in both ",
                  it->second.file, " and ", pieces, "; the checkpoint is damaged");
    }
  }
  return locations;
}

}  // namespace detail::checkpoint_files

// ---- manifest ----

bool distributed_checkpoint_exists(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kManifestName, ec);
}

CheckpointManifest read_checkpoint_manifest(const fs::path& dir) {
  const auto path = dir / kManifestName;
  TORCH_CHECK(distributed_checkpoint_exists(dir), "checkpoint ", dir.string(), ": no ",
              kManifestName, " (not a checkpoint directory, or no save into it completed)");
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  const auto damaged = [&](const std::string& why) {
    TORCH_CHECK(false, "checkpoint ", dir.string(), ": ", kManifestName, " is damaged (", why, ")");
  };
  const auto last = text.rfind("checksum ");
  if (last == std::string::npos || (last > 0 && text[last - 1] != '\n')) damaged("no checksum");
  std::istringstream tail(text.substr(last + 9));
  std::string recorded;
  tail >> recorded;
  if (recorded != hex(fnv1a(text.data(), last))) damaged("checksum mismatch");

  CheckpointManifest manifest;
  std::istringstream lines(text.substr(0, last));
  std::string magic;
  int64_t version = 0;
  lines >> magic >> version;
  if (magic != kManifestMagic) damaged("not a checkpoint manifest");
  TORCH_CHECK(version == kManifestVersion, "checkpoint ", dir.string(), ": format version ",
              version, " is not supported (this build reads version ", kManifestVersion, ")");
  std::string field;
  while (lines >> field) {
    if (field == "kind") {
      lines >> manifest.kind;
    } else if (field == "generation") {
      lines >> manifest.generation;
    } else if (field == "world_size") {
      lines >> manifest.world_size;
    } else if (field == "file") {
      CheckpointManifest::File file;
      std::string checksum;
      lines >> file.name >> file.bytes >> checksum;
      file.checksum = std::stoull(checksum, nullptr, 16);
      manifest.files.push_back(file);
    } else {
      damaged("unknown field '" + field + "'");
    }
    if (!lines) damaged("malformed line after '" + field + "'");
  }
  return manifest;
}

namespace detail {

void set_checkpoint_write_hook_for_testing(std::function<void(const fs::path&)> fn) {
  std::lock_guard<std::mutex> lock(hook_mutex());
  write_hook() = std::move(fn);
}

}  // namespace detail

}  // namespace shampoo
