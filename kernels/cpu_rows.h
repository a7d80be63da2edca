// A runtime row count turned into a compile-time one, for the CPU kernels' register tiles
// (included by cpu_linear.cpp and cpu_qisa.h): a tile of MT rows keeps MT rows' accumulators in
// registers, so MT must be a template argument, and each kernel calls its tile through this one
// switch.
#pragma once

#include <type_traits>

namespace {

// Calls ``f(std::integral_constant<int, n>{})`` for a runtime n in [1, Max] (1 below, Max above).
template <int Max, int MT = 1, class F>
inline void with_rows(int n, F f) {
  if constexpr (MT < Max) {
    if (n > MT) return with_rows<Max, MT + 1>(n, f);
  }
  f(std::integral_constant<int, MT>{});
}

}  // namespace
