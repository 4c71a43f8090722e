// Subcommand registry for the `oscar` tool.
//
// Each src/cli/cmd_*.cpp file defines one subcommand and registers it with a
// static `oscar::cli::Registrar`. The files are compiled straight into the
// executable (not a static library), so the registrars are never dropped by the
// linker. main.cpp builds the CLI11 app from whatever registered.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace oscar::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `sub` and returns the action to run when it is chosen.
  // The action returns the process exit code.
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

inline std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}

struct Registrar {
  explicit Registrar(Command c) { registry().push_back(std::move(c)); }
};

}  // namespace oscar::cli
