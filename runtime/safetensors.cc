// Reading and writing safetensors files (include/pipewright/checkpoint.h).
#include <fcntl.h>
#include <sys/stat.h>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "pipewright/checkpoint.h"
#include "runtime/checkpoint_files.h"
#include "runtime/sha256.h"

namespace pipewright {

namespace {

using namespace internal;  // NOLINT: the shared file helpers
using json = nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;  // 100 MB, as in the reference impl

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

// Reads a JSON integer that must be a non-negative int64.
bool GetNonNegative(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = s;
    return true;
  }
  return false;
}

// Builds the padded header text for `tensors`.
absl::StatusOr<std::string> BuildHeader(const std::string& path, const NamedTensors& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    auto err = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write '", path, "': tensor '", name, "': ", what));
    };
    if (name.empty()) return err("empty tensor name");
    if (name == "__metadata__") return err("reserved tensor name");
    if (!IsValidUtf8(name)) return err("name is not valid UTF-8");
    if (!seen.insert(name).second) return err("duplicate tensor name");
    if (!t.device().is_cpu()) return err("not a host tensor");
    int64_t numel = 1;
    for (int64_t d : t.shape()) {
      if (d < 0) return err("negative dimension");
      numel *= d;
    }
    if (numel != t.numel()) return err("undefined tensor");
    if (t.nbytes() > 0 && t.raw() == nullptr) return err("tensor has no storage");
    json entry = json::object();
    entry["dtype"] = DTypeSafetensorsName(t.dtype());
    entry["shape"] = t.shape();
    entry["data_offsets"] = {offset, offset + t.nbytes()};
    header[name] = std::move(entry);
    offset += t.nbytes();
  }
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot write '", path, "': metadata '", k, "' is not valid UTF-8"));
      }
      meta[k] = v;
    }
    header["__metadata__"] = std::move(meta);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

namespace internal {

absl::Status WriteSafetensorsFile(const std::string& path, const NamedTensors& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  FileDigest* digest) {
  PW_ASSIGN_OR_RETURN(std::string header, BuildHeader(path, tensors, metadata));
  unsigned char len_bytes[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xFF);
  std::vector<std::pair<const void*, size_t>> chunks;
  chunks.reserve(tensors.size() + 2);
  chunks.emplace_back(len_bytes, sizeof(len_bytes));
  chunks.emplace_back(header.data(), header.size());
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() > 0) chunks.emplace_back(t.raw(), t.nbytes());
  }
  if (digest != nullptr) {
    Sha256 h;
    digest->bytes = 0;
    for (const auto& [data, size] : chunks) {
      h.Update(data, size);
      digest->bytes += size;
    }
    digest->sha256 = h.HexDigest();
  }
  return WriteFileSynced(path, chunks);
}

}  // namespace internal

absl::Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata) {
  return WriteSafetensorsFile(path, tensors, metadata, nullptr);
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, Allocator* allocator) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoStatus(errno, "cannot open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    return absl::DataLossError(
        absl::StrCat("'", path, "': truncated safetensors file (", file_size, " bytes)"));
  }
  unsigned char len_bytes[8];
  PW_RETURN_IF_ERROR(PreadAll(fd.get(), len_bytes, 8, 0, path));
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': header length ", header_len,
                                                   " exceeds the limit of ", kMaxHeaderBytes));
  }
  if (header_len > file_size - 8) {
    return absl::DataLossError(absl::StrCat("'", path, "': header length ", header_len,
                                            " exceeds the file size ", file_size));
  }
  std::string header_text(header_len, '\0');
  PW_RETURN_IF_ERROR(PreadAll(fd.get(), header_text.data(), header_len, 8, path));
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;

  json header = json::parse(header_text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': malformed JSON header"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': JSON header is not an object"));
  }

  SafetensorsFile out;
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", path, "': __metadata__ is not an object"));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("'", path, "': metadata '", m.key(), "' is not a string"));
        }
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto err = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("'", path, "': tensor '", name, "': ", what));
    };
    if (name.empty()) return err("empty tensor name");
    if (!v.is_object()) return err("entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return err("missing or non-string 'dtype'");
    if (sh == v.end() || !sh->is_array()) return err("missing or non-array 'shape'");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return err("'data_offsets' must be an array of two integers");
    }
    const std::string dtype_name = dt->get<std::string>();
    // Only the safetensors (upper-case) spellings are accepted from files.
    if (dtype_name != "F32" && dtype_name != "BF16" && dtype_name != "F16" && dtype_name != "I32") {
      return err(absl::StrCat("unsupported dtype '", dtype_name, "'"));
    }
    Entry e;
    e.name = name;
    PW_ASSIGN_OR_RETURN(e.dtype, ParseDType(dtype_name));
    uint64_t numel = 1;
    for (const json& d : *sh) {
      int64_t dim;
      if (!GetNonNegative(d, &dim)) return err("shape entries must be non-negative integers");
      e.shape.push_back(dim);
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel) ||
          numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return err("shape overflows");
      }
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(e.dtype)), &nbytes)) {
      return err("byte size overflows");
    }
    int64_t b, en;
    if (!GetNonNegative((*off)[0], &b) || !GetNonNegative((*off)[1], &en)) {
      return err("'data_offsets' must be non-negative integers");
    }
    e.begin = static_cast<uint64_t>(b);
    e.end = static_cast<uint64_t>(en);
    if (e.begin > e.end) return err("data_offsets begin > end");
    if (e.end > data_size) {
      return absl::DataLossError(absl::StrCat("'", path, "': tensor '", name, "': data_offsets [",
                                              e.begin, ", ", e.end, "] exceed the data size ",
                                              data_size));
    }
    if (e.end - e.begin != nbytes) {
      return err(absl::StrCat("data_offsets span ", e.end - e.begin, " bytes but shape x dtype is ",
                              nbytes, " bytes"));
    }
    entries.push_back(std::move(e));
  }

  // Offsets must tile the data buffer exactly: contiguous, non-overlapping, no gaps.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  for (const Entry& e : entries) {
    if (e.begin != cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
                       "] are not contiguous (expected begin ", cursor, ")"));
    }
    cursor = e.end;
  }
  if (cursor != data_size) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': tensors cover ", cursor,
                                                   " bytes but the data section has ", data_size,
                                                   " bytes"));
  }

  if (allocator != nullptr && !allocator->device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reading '", path, "': ReadSafetensors needs a host allocator"));
  }
  for (Entry& e : entries) {
    Tensor t = Tensor::Empty(std::move(e.shape), e.dtype, allocator);
    if (t.nbytes() > 0) {
      absl::Status s = PreadAll(fd.get(), t.raw(), t.nbytes(), data_start + e.begin, path);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat(s.message(), " (tensor '", e.name, "')"));
      }
    }
    out.tensors.emplace(std::move(e.name), std::move(t));
  }
  return out;
}

}  // namespace pipewright
