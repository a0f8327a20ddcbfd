// shadowkv: command-line entry point; dispatches to the subcommands.
#include <CLI/CLI.hpp>
#include <exception>
#include <map>
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"shadowkv: long-context LLM inference with the ShadowKV KV cache"};
  app.require_subcommand(1);
  std::map<CLI::App*, shadowkv::app::Command> commands;
  auto add = [&](shadowkv::app::Command (*adder)(CLI::App&)) {
    const size_t before = app.get_subcommands({}).size();
    shadowkv::app::Command command = adder(app);
    commands[app.get_subcommands({})[before]] = std::move(command);
  };
  add(shadowkv::app::AddGenerateCommand);
  add(shadowkv::app::AddBenchCommand);
  add(shadowkv::app::AddFetchModelCommand);
  add(shadowkv::app::AddInspectCommand);
  add(shadowkv::app::AddEvalCommand);
  add(shadowkv::app::AddServeCommand);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;  // usage errors exit 2, --help exits 0
  }
  for (auto& [subcommand, command] : commands) {
    if (!subcommand->parsed()) continue;
    // Errors travel as Status; an exception reaching here is a bug, but it must still end in a
    // message and an error exit rather than an abort.
    try {
      return command();
    } catch (const std::exception& error) {
      return shadowkv::app::Fail(std::string("internal error: ") + error.what());
    } catch (...) {
      return shadowkv::app::Fail("internal error: unknown exception");
    }
  }
  return 2;
}
