// Builds against an installed pipewright and stages a model through the public API.
#include <cstdio>

#include "pipewright/model.h"

int main() {
  auto graph = pipewright::PresetModel("gpt-tiny", 0);
  if (!graph.ok()) return 1;
  std::printf("%s %d layers %lld params\n", graph->name().c_str(), graph->num_layers(),
              static_cast<long long>(graph->TotalCost().params));
  return graph->num_layers() == 8 ? 0 : 1;
}
