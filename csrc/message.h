// Error messages of the host layer, built without iostream. Torch-free.
//
// TORCH_CHECK(cond, a, b, ...) with more than one argument formats them with an
// std::ostringstream (c10::str) compiled into *this* library. Where g++ links libstdc++
// statically into _C (the first GPU run's toolchain: bench/results/2026-11-27_h200/README.md),
// that private copy's iostream and locale are never set up: an integer written into the
// stream killed the process (SIGSEGV in basic_ostream::_M_insert<long>) or vanished from
// the message ("send.numel() expected " and nothing more). So every message is
// concatenated here from strings and integers (snprintf: no locale, no stream), and
// UK_CHECK hands TORCH_CHECK the finished message as one `const char*`: the one argument
// list that c10's torchCheckMsgImpl passes through untouched to torchCheckFail, which
// libc10 defines (the error object is built and thrown there, with torch's own libstdc++).
//
// message() takes C strings, std::strings and integers only: any other type is a compile
// error, so nothing can fall back to an operator<<. Convert first: c10::toString(dtype),
// device.str(), list_text(sizes).
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace ulysses_kernels {
namespace message_detail {

inline void append(std::string& s, const char* text) { s += text; }
inline void append(std::string& s, const std::string& text) { s += text; }

template <class T,
          std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
void append(std::string& s, T value) {
  char buf[24];  // the longest 64-bit integer has 20 digits and a sign
  if constexpr (std::is_signed_v<T>) {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(value));
  } else {
    std::snprintf(buf, sizeof(buf), "%llu", static_cast<unsigned long long>(value));
  }
  s += buf;
}

}  // namespace message_detail

// The concatenation of `parts` (C strings, std::strings, integers).
template <class... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (message_detail::append(s, parts), ...);
  return s;
}

// "[a, b, c]" of a sequence of integers (sizes, strides, split sizes).
template <class Seq>
std::string list_text(const Seq& values) {
  std::string s = "[";
  bool first = true;
  for (const auto v : values) {
    if (!first) s += ", ";
    message_detail::append(s, v);
    first = false;
  }
  return s + "]";
}

}  // namespace ulysses_kernels

// TORCH_CHECK with a message built by ulysses_kernels::message (a RuntimeError in Python).
// The message is built only when the check fails; the temporary string lives until the
// throw has copied it.
#define UK_CHECK(cond, ...) TORCH_CHECK(cond, ::ulysses_kernels::message(__VA_ARGS__).c_str())
