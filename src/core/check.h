// SKV_CHECK: invariants that, when broken, are bugs in shadowkv (not bad input). Aborts with file:line.
#pragma once

#include <cstdio>
#include <cstdlib>

#define SKV_CHECK(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                  \
    }                                                                                \
  } while (0)
