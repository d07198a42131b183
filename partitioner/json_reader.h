// Strict, bounded reading of the JSON documents the partitioner reads (plans, layer graphs):
// nlohmann's SAX parser feeding a DOM builder of ours, within the limits of plan.h, with
// problems named by their path and values shown in bounded messages (Note [Hostile documents]
// in json_reader.cc). Internal to the partitioner.
#ifndef PIPEWRIGHT_PARTITIONER_JSON_READER_H_
#define PIPEWRIGHT_PARTITIONER_JSON_READER_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "pipewright/plan.h"

namespace pipewright::internal {

// Read documents are std::map-backed (logarithmic key lookup and insertion).
using json = nlohmann::json;

// `s` as a JSON string literal (quotes, escapes; invalid UTF-8 replaced), its first 64 bytes
// only when it is longer: "<first bytes>"... (N bytes).
std::string Quote(absl::string_view s);
// A key as a path shows it: itself when short and plain, else quoted (Quote).
std::string ShownKey(absl::string_view key);
// A value as messages show it: its compact JSON text, or for a long container just its kind.
// Bounded work and output on any value.
std::string Describe(const json& v);
// "path.key" and "path[i]".
std::string Member(const std::string& path, absl::string_view key);
std::string Element(const std::string& path, size_t i);

// "path: message" entries; past kMaxListedProblems only counted, and Finish() adds one
// "<doc>: N more problems" entry for them.
class Problems {
 public:
  explicit Problems(std::string doc) : doc_(std::move(doc)) {}
  void Add(const std::string& path, absl::string_view message) {
    if (list_.size() < kMaxListedProblems) {
      list_.push_back(absl::StrCat(path, ": ", message));
    } else {
      ++unlisted_;
    }
  }
  bool empty() const { return list_.empty(); }
  const std::string& doc() const { return doc_; }
  std::vector<std::string> Finish() && {
    if (unlisted_ > 0) {
      list_.push_back(absl::StrCat(doc_, ": ", unlisted_, " more problem",
                                   unlisted_ == 1 ? "" : "s", " not listed (only the first ",
                                   kMaxListedProblems, " are)"));
    }
    return std::move(list_);
  }
  absl::Status ToStatus() && {
    return absl::InvalidArgumentError(absl::StrJoin(std::move(*this).Finish(), "\n"));
  }

 private:
  std::string doc_;
  std::vector<std::string> list_;
  int64_t unlisted_ = 0;
};

// The document's one long list (a plan's "stages", a layer graph's "layers") and its limit.
struct ListLimit {
  const char* key;
  int64_t max;
  const char* what;  // "a plan has": "stages: more than N entries: a plan has at most N stages"
};

// Parses `text` strictly (no comments, nothing after the value) within the limits of plan.h
// and `list`, reporting duplicate keys (Note [Hostile documents]). `p.doc()` names the whole
// document in messages.
std::optional<json> Parse(absl::string_view text, const ListLimit& list, Problems& p);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_PARTITIONER_JSON_READER_H_
