// `train --metrics` and `pipewright plot` (metrics.h).
#include "tools/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "pipewright/input.h"
#include "pipewright/simulator.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {

absl::StatusOr<std::unique_ptr<MetricsCsv>> MetricsCsv::Open(const std::string& path,
                                                             double model_flops_per_sample,
                                                             double peak_flops) {
  PW_RETURN_IF_ERROR(CheckOutputPath(path, "--metrics"));
  auto m = std::unique_ptr<MetricsCsv>(new MetricsCsv());
  m->path_ = path;
  m->model_flops_per_sample_ = model_flops_per_sample;
  m->peak_flops_ = peak_flops;
  m->out_.open(path, std::ios::trunc);
  if (!m->out_) {
    return absl::NotFoundError(absl::StrCat("--metrics ", path, ": cannot create the file"));
  }
  m->out_ << kMetricsHeader << "\n" << std::flush;
  return m;
}

void MetricsCsv::Add(const StepResult& r, int64_t tokens_per_sample, int64_t peak_memory_bytes,
                     double eval_loss) {
  if (failed_) return;
  const double model_flops = r.samples_per_s * model_flops_per_sample_;
  out_ << absl::StrFormat("%d,%.17g,%.9g,%.17g,%.9g,%.9g,%.9g,%d,%.9g,%d,%s,%.9g,%s\n", r.step,
                          r.loss, r.lr, r.grad_norm, r.step_time_s, r.samples_per_s,
                          r.samples_per_s * static_cast<double>(tokens_per_sample),
                          peak_memory_bytes, r.loss_scale, r.skipped ? 1 : 0,
                          std::isfinite(eval_loss) ? absl::StrFormat("%.17g", eval_loss) : "",
                          model_flops / 1e12,
                          peak_flops_ > 0 ? absl::StrFormat("%.6g", model_flops / peak_flops_) : "")
       << std::flush;
  if (!out_) {
    failed_ = true;
    std::fprintf(stderr, "warning: --metrics %s: writing failed (disk full?); no more rows\n",
                 path_.c_str());
  }
}

const std::vector<double>* MetricsTable::Column(const std::string& name) const {
  for (size_t i = 0; i < columns.size(); ++i) {
    if (columns[i] == name) return &values[i];
  }
  return nullptr;
}

absl::StatusOr<MetricsTable> ParseMetricsCsv(const std::string& text, const std::string& what) {
  MetricsTable t;
  int64_t line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty()) continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    if (t.columns.empty()) {
      for (absl::string_view f : fields) t.columns.emplace_back(absl::StripAsciiWhitespace(f));
      t.values.resize(t.columns.size());
      continue;
    }
    if (fields.size() != t.columns.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " line ", line_no, ": ", fields.size(),
                                                     " fields where the header has ",
                                                     t.columns.size()));
    }
    for (size_t i = 0; i < fields.size(); ++i) {
      const absl::string_view f = absl::StripAsciiWhitespace(fields[i]);
      double v = std::numeric_limits<double>::quiet_NaN();
      if (!f.empty() && (!absl::SimpleAtod(f, &v) || !std::isfinite(v))) {
        return absl::InvalidArgumentError(absl::StrCat(what, " line ", line_no, ", column ",
                                                       t.columns[i], ": '", f,
                                                       "' is not a finite number"));
      }
      t.values[i].push_back(v);
    }
  }
  if (t.columns.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty"));
  return t;
}

namespace {

// "1.5k", "0.003", "2e-05": a short tick label.
std::string Tick(double v) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  if (a >= 1e4 || a < 1e-3) return absl::StrFormat("%.1e", v);
  return absl::StrFormat("%.4g", v);
}

// One panel: `ys` against `xs` in the box (x0, y0, w, h), with axes, five ticks each and a label.
std::string Panel(const std::vector<double>& xs, const std::vector<double>& ys, double x0,
                  double y0, double w, double h, const std::string& label,
                  const std::string& colour) {
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
    if (!std::isfinite(xs[i]) || !std::isfinite(ys[i])) continue;
    xmin = std::min(xmin, xs[i]);
    xmax = std::max(xmax, xs[i]);
    ymin = std::min(ymin, ys[i]);
    ymax = std::max(ymax, ys[i]);
  }
  if (!std::isfinite(xmin)) return "";
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) {
    ymin -= 0.5 * std::max(1e-12, std::abs(ymin));
    ymax += 0.5 * std::max(1e-12, std::abs(ymax));
  }
  auto px = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * w; };
  auto py = [&](double y) { return y0 + h - (y - ymin) / (ymax - ymin) * h; };
  std::string s = absl::StrFormat(
      "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='none' stroke='#444'/>\n"
      "<text x='%.1f' y='%.1f' font-size='14' font-weight='bold'>%s</text>\n",
      x0, y0, w, h, x0, y0 - 8, label);
  for (int k = 0; k <= 4; ++k) {
    const double fx = xmin + (xmax - xmin) * k / 4, fy = ymin + (ymax - ymin) * k / 4;
    absl::StrAppend(
        &s,
        absl::StrFormat("<line x1='%.1f' y1='%.1f' x2='%.1f' y2='%.1f' stroke='#ddd'/>\n"
                        "<text x='%.1f' y='%.1f' font-size='11' text-anchor='middle'>%s</text>\n"
                        "<text x='%.1f' y='%.1f' font-size='11' text-anchor='end'>%s</text>\n",
                        x0, py(fy), x0 + w, py(fy), px(fx), y0 + h + 14, Tick(fx), x0 - 4,
                        py(fy) + 4, Tick(fy)));
  }
  std::string points;
  for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
    if (!std::isfinite(xs[i]) || !std::isfinite(ys[i])) continue;
    absl::StrAppend(&points, absl::StrFormat("%.1f,%.1f ", px(xs[i]), py(ys[i])));
  }
  absl::StrAppend(&s, "<polyline fill='none' stroke='", colour, "' stroke-width='1.5' points='",
                  points, "'/>\n");
  return s;
}

}  // namespace

std::string PlotMetricsSvg(const MetricsTable& table, const std::string& title) {
  struct Series {
    const char* column;
    const char* label;
    const char* colour;
  };
  const Series series[] = {{"loss", "loss", "#c0392b"},
                           {"eval_loss", "eval loss (held-out data)", "#7d3c98"},
                           {"lr", "learning rate", "#2471a3"},
                           {"samples_per_s", "samples/s", "#1e8449"}};
  std::vector<double> steps;
  if (const std::vector<double>* s = table.Column("step")) {
    steps = *s;
  } else {
    const size_t n = table.values.empty() ? 0 : table.values[0].size();
    for (size_t i = 0; i < n; ++i) steps.push_back(static_cast<double>(i));
  }
  const double w = 800, h = 170, x0 = 80, gap = 60;
  std::string panels;
  int k = 0;
  for (const Series& s : series) {
    const std::vector<double>* ys = table.Column(s.column);
    if (ys == nullptr) continue;
    std::string p = Panel(steps, *ys, x0, 50 + k * (h + gap), w, h, s.label, s.colour);
    if (p.empty()) continue;
    panels += p;
    ++k;
  }
  const double height = 50 + std::max(1, k) * (h + gap);
  return absl::StrFormat(
      "<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' "
      "font-family='sans-serif'>\n<rect width='100%%' height='100%%' fill='white'/>\n"
      "<text x='%.1f' y='24' font-size='16'>%s</text>\n%s<text x='%.1f' y='%.1f' "
      "font-size='12' text-anchor='middle'>step</text>\n</svg>\n",
      x0 + w + 40, height, x0, XmlEscape(title), panels, x0 + w / 2, height - 12);
}

void RegisterPlot(CLI::App& app, int* exit_code) {
  struct PlotFlags {
    std::string input, output;
  };
  auto f = std::make_shared<PlotFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plot", "Draw a `train --metrics` CSV: loss, learning rate and throughput by step (SVG)");
  cmd->add_option("metrics", f->input, "The CSV train --metrics wrote")->required();
  cmd->add_option("-o,--output", f->output, "The SVG to write")->required();
  cmd->callback([f, exit_code] {
    absl::Status s = [&]() -> absl::Status {
      PW_RETURN_IF_ERROR(CheckOutputPath(f->output, "--output"));
      PW_ASSIGN_OR_RETURN(std::string text, ReadFile(f->input, "metrics file"));
      PW_ASSIGN_OR_RETURN(MetricsTable t, ParseMetricsCsv(text, f->input));
      return WriteFile(f->output, PlotMetricsSvg(t, f->input), "--output");
    }();
    *exit_code = s.ok() ? 0 : ReportError(s);
  });
}

}  // namespace pipewright::tools
