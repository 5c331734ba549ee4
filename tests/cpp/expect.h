// EXPECT for the C++ unit tests: a failed check prints its file, line and condition and is
// counted; each test's main returns non-zero when any failed.
#pragma once
#include <cstdio>

namespace ulysses_kernels_tests {
inline int failures = 0;
}  // namespace ulysses_kernels_tests

#define EXPECT(cond)                                                                 \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: EXPECT(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++ulysses_kernels_tests::failures;                                             \
    }                                                                                \
  } while (0)
