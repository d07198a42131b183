// Strict, bounded JSON reading for the partitioner (json_reader.h).
//
// Note [Hostile documents]. Whatever the text, reading takes time linear in its size and memory
// bounded by the limits of plan.h, and nothing recurses deeper than kMaxJsonDepth:
//  - the nesting is checked by a linear scan (CheckJsonNesting) before the parser sees the text;
//  - the parser is nlohmann's SAX parser feeding our own DOM builder (JsonBuilder), which counts
//    values and the entries of "stages" / "layers" and stops at the first limit, and reports
//    duplicate keys. (nlohmann's callback parser, used before, rescans the enclosing array
//    after every object for a discarded value: quadratic in the stages. And an ordered_json
//    object inserts a key by a linear search: quadratic in its keys. Documents are read into
//    std::map-backed json instead; only writing keeps the member order.)
//  - messages show values, keys and strings through bounded helpers (Describe, Quote, ShownKey),
//    and at most kMaxListedProblems problems are listed.
#include "partitioner/json_reader.h"

#include <exception>

#include "absl/strings/strip.h"
#include "pipewright/input.h"

namespace pipewright::internal {
namespace {

// Longest key or string a message quotes in full.
constexpr size_t kMaxShown = 64;

}  // namespace

// `s` as a JSON string literal (quotes, escapes; invalid UTF-8 replaced), its first kMaxShown
// bytes only when it is longer: "<first bytes>"... (N bytes).
std::string Quote(absl::string_view s) {
  const bool cut = s.size() > kMaxShown;
  std::string q = json(std::string(cut ? s.substr(0, kMaxShown) : s))
                      .dump(-1, ' ', false, json::error_handler_t::replace);
  if (cut) absl::StrAppend(&q, "... (", s.size(), " bytes)");
  return q;
}

// A key as a path shows it: itself when short and plain, else quoted (Quote).
std::string ShownKey(absl::string_view key) {
  bool plain = !key.empty() && key.size() <= kMaxShown;
  for (char c : key)
    plain = plain && static_cast<unsigned char>(c) >= 0x20 && c != '"' && c != '\\';
  return plain ? std::string(key) : Quote(key);
}

namespace {

// Appends `v`'s compact JSON text to `out` but gives up (false) once `out` is longer than
// `limit`: every level appends a bracket first, so the recursion is at most `limit` deep and the
// work at most about `limit` characters, whatever `v` holds.
bool AppendCompact(const json& v, size_t limit, std::string& out) {
  if (out.size() > limit) return false;
  if (v.is_array()) {
    out += '[';
    bool first = true;
    for (const json& e : v) {
      if (!first) out += ',';
      first = false;
      if (!AppendCompact(e, limit, out)) return false;
    }
    out += ']';
  } else if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, e] : v.items()) {
      if (!first) out += ',';
      first = false;
      out += json(key.substr(0, limit + 1)).dump(-1, ' ', false, json::error_handler_t::replace);
      out += ':';
      if (!AppendCompact(e, limit, out)) return false;
    }
    out += '}';
  } else if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    out += json(s.substr(0, limit + 1)).dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    out += v.dump(-1, ' ', false, json::error_handler_t::replace);  // a scalar: short
  }
  return out.size() <= limit;
}

}  // namespace

// A value as messages show it: its compact JSON text, or for a long container just its kind.
// Bounded work and output on any value (AppendCompact).
std::string Describe(const json& v) {
  constexpr size_t kLimit = 40;
  std::string s;
  if (AppendCompact(v, kLimit, s)) return s;
  if (v.is_object()) return "an object";
  if (v.is_array()) return absl::StrCat("an array of ", v.size(), " elements");
  return s.substr(0, kLimit - 3) + "...";
}

std::string Member(const std::string& path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}
std::string Element(const std::string& path, size_t i) { return absl::StrCat(path, "[", i, "]"); }

namespace {

// nlohmann SAX handler that builds the document (Note [Hostile documents]): values into json,
// with the limits checked as they arrive and duplicate keys reported ("a plan whose second
// "layers" wins is a plan nobody reviewed"; nlohmann alone would keep the last silently).
// Returning false from a handler stops the parse.
class JsonBuilder {
 public:
  JsonBuilder(const ListLimit& list, Problems& p) : list_(list), p_(p) {}

  json& root() { return root_; }

  bool null() { return Put(nullptr) != nullptr; }
  bool boolean(bool v) { return Put(v) != nullptr; }
  bool number_integer(json::number_integer_t v) { return Put(v) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) { return Put(v) != nullptr; }
  bool number_float(json::number_float_t v, const json::string_t&) { return Put(v) != nullptr; }
  bool string(json::string_t& v) { return Put(std::move(v)) != nullptr; }
  bool binary(json::binary_t&) { return false; }  // only binary formats have them
  bool start_object(std::size_t) { return Open(json::object()); }
  bool start_array(std::size_t) { return Open(json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(json::string_t& k) {
    Frame& f = frames_.back();
    auto [it, inserted] = f.value->get_ref<json::object_t&>().emplace(k, nullptr);
    if (!inserted) {
      p_.Add(Member(PathOfOpen(), ShownKey(k)), "duplicate key");
      it->second = nullptr;  // the later value replaces the earlier
    }
    f.slot = &it->second;
    f.key = std::move(k);
    return true;
  }

  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, ..." without the bracket tag.
    std::string what = e.what();
    const size_t tag_end = what.find("] ");
    if (what.rfind("[json.exception", 0) == 0 && tag_end != std::string::npos) {
      what = what.substr(tag_end + 2);
    }
    p_.Add(p_.doc(), absl::StrCat("not valid JSON: ", what));
    return false;
  }

 private:
  struct Frame {
    json* value;           // the open array or object
    json* slot = nullptr;  // objects: where the current member's value goes
    std::string key;       // objects: the current member's key
  };

  // Places `v` where the document is at, or reports a limit and returns nullptr.
  json* Put(json&& v) {
    if (++values_ > kMaxJsonValues) {
      p_.Add(p_.doc(), absl::StrCat("more than ", kMaxJsonValues, " JSON values; a ", p_.doc(),
                                    " has at most ", kMaxJsonValues));
      return nullptr;
    }
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& top = frames_.back();
    if (top.value->is_object()) {
      *top.slot = std::move(v);
      return top.slot;
    }
    json::array_t& a = top.value->get_ref<json::array_t&>();
    if (frames_.size() == 2 && frames_[0].value->is_object() && frames_[0].key == list_.key &&
        static_cast<int64_t>(a.size()) >= list_.max) {
      p_.Add(list_.key, absl::StrCat("more than ", list_.max, " entries: ", list_.what, " at most ",
                                     list_.max, " ", list_.key));
      return nullptr;
    }
    // Pointers into `a` stay valid while they are used: nothing is appended to an array while
    // one of its elements is open.
    a.push_back(std::move(v));
    return &a.back();
  }

  bool Open(json&& container) {
    json* v = Put(std::move(container));
    if (v == nullptr) return false;
    frames_.push_back(Frame{v, nullptr, {}});
    return true;
  }

  bool Close() {
    frames_.pop_back();
    return true;
  }

  // The path of the innermost open container, as problems name it ("stages[3].predicted").
  std::string PathOfOpen() const {
    std::string path;
    for (size_t i = 0; i + 1 < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      path =
          f.value->is_array() ? Element(path, f.value->size() - 1) : Member(path, ShownKey(f.key));
    }
    return path;
  }

  const ListLimit list_;
  Problems& p_;
  json root_;
  std::vector<Frame> frames_;
  int64_t values_ = 0;
};

// Parses `text` strictly (no comments, nothing after the value) within the limits of plan.h
// and `list`, reporting duplicate keys (Note [Hostile documents]). `p.doc()` names the whole
// document in messages.
}  // namespace

std::optional<json> Parse(absl::string_view text, const ListLimit& list, Problems& p) {
  if (absl::Status s = CheckJsonNesting(text, p.doc()); !s.ok()) {
    // "plan: JSON nested deeper than 64 levels (at byte 12)"
    p.Add(p.doc(), absl::StripPrefix(s.message(), absl::StrCat(p.doc(), ": ")));
    return std::nullopt;
  }
  JsonBuilder builder(list, p);
  bool ok = false;
  try {
    ok = json::sax_parse(text.begin(), text.end(), &builder);
  } catch (const std::exception& e) {
    p.Add(p.doc(), absl::StrCat("not valid JSON: ", e.what()));
    return std::nullopt;
  } catch (...) {
    p.Add(p.doc(), "not valid JSON: the parser failed");
    return std::nullopt;
  }
  if (!ok) return std::nullopt;
  return std::move(builder.root());
}

}  // namespace pipewright::internal
