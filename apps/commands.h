// The subcommands of the shadowkv binary: each registers its flags and returns an exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace shadowkv::app {

// Adds a subcommand to `app`; the returned function runs it after parsing.
using Command = std::function<int()>;
Command AddGenerateCommand(CLI::App& app);
Command AddBenchCommand(CLI::App& app);
Command AddFetchModelCommand(CLI::App& app);
Command AddInspectCommand(CLI::App& app);
Command AddEvalCommand(CLI::App& app);
Command AddServeCommand(CLI::App& app);

// Prints "shadowkv: <message>" on stderr and returns the exit code for errors.
int Fail(const std::string& message);

// What a --device cuda path says in a build without CUDA.
inline constexpr const char* kBuiltWithoutCuda =
    "this shadowkv was built without CUDA (configure with -DSHADOWKV_CUDA=ON)";

}  // namespace shadowkv::app
