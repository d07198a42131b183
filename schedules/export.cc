// Exporters of a simulated schedule: Chrome trace-event JSON and an SVG timeline, both written
// by hand (no JSON or XML library in this pure library).
#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "pipewright/simulator.h"

namespace pipewright {
namespace {

constexpr double kMicrosPerUnit = 1000.0;  // 1 simulated time unit = 1 ms in the trace

std::string JsonEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out;
}

// Finite number text for JSON (NaN/inf are not JSON).
std::string Num(double x) {
  if (!std::isfinite(x)) return "0";
  return absl::StrFormat("%.3f", x);
}

// (src rank, dst rank, direction, micro-batch, receiving stage): the channel of a P2P message.
using MsgKey = std::tuple<int, int, int, int, int>;

bool MessageKey(const Schedule& schedule, const SimEvent& ev, MsgKey* key, bool* is_send) {
  const Action& a = ev.action;
  const int S = schedule.num_stages;
  auto rank_of = [&](int s) {
    return s >= 0 && s < S && s < static_cast<int>(schedule.stage_rank.size())
               ? schedule.stage_rank[s]
               : -1;
  };
  switch (a.kind) {
    case ActionKind::kSendF:
      *is_send = true;
      *key = {ev.rank, rank_of(a.virtual_stage + 1), 0, a.micro_batch, a.virtual_stage + 1};
      return true;
    case ActionKind::kSendB:
      *is_send = true;
      *key = {ev.rank, rank_of(a.virtual_stage - 1), 1, a.micro_batch, a.virtual_stage - 1};
      return true;
    case ActionKind::kRecvF:
      *is_send = false;
      *key = {rank_of(a.virtual_stage - 1), ev.rank, 0, a.micro_batch, a.virtual_stage};
      return true;
    case ActionKind::kRecvB:
      *is_send = false;
      *key = {rank_of(a.virtual_stage + 1), ev.rank, 1, a.micro_batch, a.virtual_stage};
      return true;
    default:
      return false;
  }
}

// Index of each stage among the stages its rank owns (0 = first chunk, 1 = second, ...).
std::vector<int> ChunkOfStage(const Schedule& schedule) {
  std::vector<int> chunk(schedule.stage_rank.size(), 0);
  std::map<int, int> seen;
  for (size_t s = 0; s < schedule.stage_rank.size(); ++s) chunk[s] = seen[schedule.stage_rank[s]]++;
  return chunk;
}

struct Rgb {
  int r, g, b;
};

Rgb BaseColor(ActionKind k) {
  switch (k) {
    case ActionKind::kF:
      return {59, 117, 175};  // blue
    case ActionKind::kB:
      return {58, 146, 58};  // green
    case ActionKind::kI:
      return {44, 160, 120};  // teal green
    case ActionKind::kW:
      return {232, 134, 42};  // orange
    default:
      return {140, 140, 140};  // grey (reduce / optimizer)
  }
}

Rgb Shade(Rgb c, int chunk) {
  if (chunk <= 0) return c;
  const double t = std::min(0.7, 0.45 + 0.1 * (chunk - 1));  // mix with white
  auto mix = [t](int x) { return static_cast<int>(std::lround(x + (255 - x) * t)); };
  return {mix(c.r), mix(c.g), mix(c.b)};
}

std::string Hex(Rgb c) { return absl::StrFormat("#%02x%02x%02x", c.r, c.g, c.b); }

bool IsLight(Rgb c) { return 0.299 * c.r + 0.587 * c.g + 0.114 * c.b > 150; }

double NiceStep(double span, int target_ticks) {
  if (!(span > 0)) return 1;
  const double raw = span / target_ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * mag) return m * mag;
  }
  return 10 * mag;
}

}  // namespace

std::string XmlEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string ToChromeTrace(const Schedule& schedule, const SimResult& result) {
  std::string out = "{\"traceEvents\": [\n";
  bool first = true;
  auto begin_event = [&]() {
    if (!first) out += ",\n";
    first = false;
  };
  int num_ranks = static_cast<int>(std::max(schedule.programs.size(), result.ranks.size()));
  for (const SimEvent& ev : result.timeline) num_ranks = std::max(num_ranks, ev.rank + 1);
  for (int r = 0; r < num_ranks; ++r) {
    begin_event();
    absl::StrAppendFormat(&out,
                          "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, "
                          "\"args\": {\"name\": \"rank %d\"}}",
                          r, r);
    begin_event();
    absl::StrAppendFormat(&out,
                          "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, "
                          "\"tid\": 0, \"args\": {\"sort_index\": %d}}",
                          r, r);
  }
  for (const SimEvent& ev : result.timeline) {
    begin_event();
    absl::StrAppendFormat(
        &out,
        "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": 0, "
        "\"ts\": %s, \"dur\": %s, \"args\": {\"micro_batch\": %d, \"stage\": %d}}",
        JsonEscape(ev.action.ToString()), JsonEscape(ActionKindName(ev.action.kind)), ev.rank,
        Num(ev.start * kMicrosPerUnit), Num((ev.end - ev.start) * kMicrosPerUnit),
        ev.action.micro_batch, ev.action.virtual_stage);
  }
  // Flow arrows: the k-th send on a channel pairs with the k-th receive on it.
  std::map<MsgKey, std::deque<const SimEvent*>> sends, recvs;
  std::vector<MsgKey> order;  // channels in first-seen order, for deterministic ids
  for (const SimEvent& ev : result.timeline) {
    MsgKey key;
    bool is_send = false;
    if (!MessageKey(schedule, ev, &key, &is_send)) continue;
    if (sends.find(key) == sends.end() && recvs.find(key) == recvs.end()) order.push_back(key);
    (is_send ? sends : recvs)[key].push_back(&ev);
  }
  int id = 0;
  for (const MsgKey& key : order) {
    auto& s = sends[key];
    auto& r = recvs[key];
    while (!s.empty() && !r.empty()) {
      const SimEvent* snd = s.front();
      const SimEvent* rcv = r.front();
      s.pop_front();
      r.pop_front();
      const std::string name = JsonEscape(snd->action.ToString());
      begin_event();
      absl::StrAppendFormat(&out,
                            "{\"name\": \"%s\", \"cat\": \"p2p\", \"ph\": \"s\", \"id\": %d, "
                            "\"pid\": %d, \"tid\": 0, \"ts\": %s}",
                            name, id, snd->rank, Num(snd->start * kMicrosPerUnit));
      begin_event();
      absl::StrAppendFormat(&out,
                            "{\"name\": \"%s\", \"cat\": \"p2p\", \"ph\": \"f\", \"bp\": \"e\", "
                            "\"id\": %d, \"pid\": %d, \"tid\": 0, \"ts\": %s}",
                            name, id, rcv->rank, Num(rcv->end * kMicrosPerUnit));
      ++id;
    }
  }
  out += "\n], \"displayTimeUnit\": \"ms\"}";
  return out;
}

std::string ToSvg(const Schedule& schedule, const SimResult& result, const SvgOptions& options) {
  int num_ranks = static_cast<int>(std::max(schedule.programs.size(), result.ranks.size()));
  for (const SimEvent& ev : result.timeline) num_ranks = std::max(num_ranks, ev.rank + 1);
  const std::vector<int> chunk = ChunkOfStage(schedule);
  auto chunk_of = [&](const Action& a) {
    return a.virtual_stage >= 0 && a.virtual_stage < static_cast<int>(chunk.size())
               ? chunk[a.virtual_stage]
               : 0;
  };

  size_t longest_label = 7;
  for (const std::string& l : options.row_labels) longest_label = std::max(longest_label, l.size());
  const double kLeft = std::max(70.0, 14 + 7.0 * static_cast<double>(longest_label));
  constexpr double kRight = 20, kTop = 48, kRowH = 26, kRowGap = 6, kPlotW = 1000;
  const double makespan = result.makespan > 0 ? result.makespan : 1;
  const double scale = kPlotW / makespan;
  const double rows_h = num_ranks * (kRowH + kRowGap);
  const double axis_y = kTop + rows_h + 4;
  const double legend_y = axis_y + 30;
  const double width = kLeft + kPlotW + kRight;
  const double height = legend_y + 30;

  std::string out;
  absl::StrAppendFormat(&out,
                        "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" "
                        "width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                        "font-family=\"Helvetica, Arial, sans-serif\">\n",
                        width, height, width, height);
  absl::StrAppendFormat(&out,
                        "<rect class=\"background\" x=\"0\" y=\"0\" width=\"%.0f\" "
                        "height=\"%.0f\" fill=\"#ffffff\"/>\n",
                        width, height);
  const double unit = options.unit_scale > 0 ? options.unit_scale : 1;
  const std::string unit_suffix = options.time_unit.empty() ? "" : " " + options.time_unit;
  const std::string title = absl::StrFormat(
      "%s  p=%d  m=%d  v=%d  makespan %.4g%s  bubble %.1f%%",
      options.title.empty() ? std::string(ScheduleKindName(schedule.spec.kind)) : options.title,
      schedule.spec.ranks, schedule.spec.micro_batches, schedule.spec.chunks,
      result.makespan * unit, unit_suffix, 100.0 * result.bubble_fraction);
  absl::StrAppendFormat(&out,
                        "<text x=\"%.1f\" y=\"24\" font-size=\"16\" font-weight=\"bold\" "
                        "fill=\"#222222\">%s</text>\n",
                        kLeft, XmlEscape(title));

  // Rank rows and labels.
  for (int r = 0; r < num_ranks; ++r) {
    const double y = kTop + r * (kRowH + kRowGap);
    absl::StrAppendFormat(&out,
                          "<rect class=\"row\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" "
                          "height=\"%.1f\" fill=\"#f3f3f3\"/>\n",
                          kLeft, y, kPlotW, kRowH);
    absl::StrAppendFormat(
        &out,
        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"end\" "
        "dominant-baseline=\"central\" fill=\"#222222\">%s</text>\n",
        kLeft - 8, y + kRowH / 2,
        XmlEscape(r < static_cast<int>(options.row_labels.size()) ? options.row_labels[r]
                                                                  : absl::StrCat("rank ", r)));
  }

  // One box per compute action (and per timed reduce / optimizer step).
  std::set<std::pair<int, int>> used;  // (kind, shaded) seen, for the legend
  for (const SimEvent& ev : result.timeline) {
    const ActionKind k = ev.action.kind;
    const bool compute = IsCompute(k);
    const bool aux =
        (k == ActionKind::kReduceGrads || k == ActionKind::kOptimizerStep) && ev.end > ev.start;
    if (!compute && !aux) continue;
    const int c = compute ? chunk_of(ev.action) : 0;
    const Rgb color = Shade(BaseColor(k), c);
    if (compute) used.insert({static_cast<int>(k), c > 0 ? 1 : 0});
    const double x = kLeft + ev.start * scale;
    const double w = std::max(0.0, (ev.end - ev.start) * scale);
    const double y = kTop + ev.rank * (kRowH + kRowGap);
    absl::StrAppendFormat(&out,
                          "<rect class=\"%s\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" "
                          "height=\"%.1f\" fill=\"%s\" stroke=\"#ffffff\" stroke-width=\"0.5\">"
                          "<title>%s [%.4g, %.4g]%s</title></rect>\n",
                          compute ? "op" : "aux", x, y, w, kRowH, Hex(color),
                          XmlEscape(ev.action.ToString()), ev.start * unit, ev.end * unit,
                          XmlEscape(unit_suffix));
    if (compute && w >= 7) {
      const double font = std::min(12.0, std::max(7.0, w * 0.55));
      absl::StrAppendFormat(&out,
                            "<text x=\"%.2f\" y=\"%.1f\" font-size=\"%.1f\" "
                            "text-anchor=\"middle\" dominant-baseline=\"central\" "
                            "fill=\"%s\">%d</text>\n",
                            x + w / 2, y + kRowH / 2, font, IsLight(color) ? "#1a1a1a" : "#ffffff",
                            ev.action.micro_batch);
    }
  }

  // Time axis.
  absl::StrAppendFormat(&out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                        "stroke=\"#444444\" stroke-width=\"1\"/>\n",
                        kLeft, axis_y, kLeft + kPlotW, axis_y);
  // Ticks at round values of the shown unit.
  const double step = NiceStep(makespan * unit, 10) / unit;
  for (int i = 0; i * step <= makespan * (1 + 1e-9); ++i) {
    const double t = i * step;
    const double x = kLeft + t * scale;
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" "
                          "stroke=\"#444444\" stroke-width=\"1\"/>\n",
                          x, axis_y, x, axis_y + 4);
    absl::StrAppendFormat(&out,
                          "<text x=\"%.2f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"middle\" "
                          "fill=\"#444444\">%.4g</text>\n",
                          x, axis_y + 15, t * unit);
  }
  if (!options.time_unit.empty()) {
    absl::StrAppendFormat(&out,
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\" "
                          "fill=\"#444444\">%s</text>\n",
                          kLeft - 8, axis_y + 15, XmlEscape(options.time_unit));
  }

  // Legend.
  double lx = kLeft;
  auto legend = [&](Rgb color, const std::string& label) {
    absl::StrAppendFormat(&out,
                          "<rect class=\"legend\" x=\"%.1f\" y=\"%.1f\" width=\"14\" "
                          "height=\"14\" fill=\"%s\"/>\n",
                          lx, legend_y - 7, Hex(color));
    absl::StrAppendFormat(&out,
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" "
                          "dominant-baseline=\"central\" fill=\"#222222\">%s</text>\n",
                          lx + 19, legend_y, XmlEscape(label));
    lx += 19 + 7.0 * label.size() + 18;
  };
  const std::pair<ActionKind, const char*> kinds[] = {{ActionKind::kF, "forward (F)"},
                                                      {ActionKind::kB, "backward (B)"},
                                                      {ActionKind::kI, "input grad (I)"},
                                                      {ActionKind::kW, "weight grad (W)"}};
  for (const auto& [k, label] : kinds) {
    const bool plain = used.count({static_cast<int>(k), 0}) > 0;
    const bool shaded = used.count({static_cast<int>(k), 1}) > 0;
    if (plain || (!shaded && k == ActionKind::kF)) legend(BaseColor(k), label);
    if (shaded) legend(Shade(BaseColor(k), 1), absl::StrCat(label, ", later chunk"));
  }
  out += "</svg>\n";
  return out;
}

}  // namespace pipewright
