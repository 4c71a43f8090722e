// `oscar`: calibrate, inspect, evaluate and run 2-bit KV caches.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>

#include "cli/registry.h"

int main(int argc, char** argv) {
  CLI::App app{"oscar: offline spectral covariance-aware rotation for a 2-bit KV cache"};
  app.require_subcommand(1);
  auto& cmds = oscar::cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::map<CLI::App*, std::function<int()>> actions;
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    actions[sub] = c.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (auto& [sub, action] : actions) {
    if (sub->parsed()) {
      try {
        return action();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "oscar %s: error: %s\n", sub->get_name().c_str(), e.what());
        return 1;
      }
    }
  }
  return 2;
}
