// SKIP_UNLESS_CI: a gtest skip outside CI, a failure in CI (where setup.sh and test.sh ran).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace shadowkv::testing {

// CI set to anything but empty, 0, false or no (CI runs .ci/run with CI=true).
inline bool InCi() {
  const char* ci = std::getenv("CI");
  if (ci == nullptr) return false;
  const std::string value = ci;
  return !(value.empty() || value == "0" || value == "false" || value == "FALSE" || value == "no");
}

}  // namespace shadowkv::testing

// In place of GTEST_SKIP() << message, in a function returning void.
#define SKIP_UNLESS_CI(message)                          \
  do {                                                   \
    if (::shadowkv::testing::InCi()) {                   \
      FAIL() << "in CI (so not skipped): " << (message); \
    } else {                                             \
      GTEST_SKIP() << (message);                         \
    }                                                    \
  } while (0)
