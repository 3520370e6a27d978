// Error messages joined without iostreams: c10::str's ostringstream, built
// into a JIT extension, has crashed against the host's libstdc++.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

namespace groupnorm {

inline std::string message_part(const std::string& s) { return s; }
inline std::string message_part(const char* s) { return s; }
inline std::string message_part(int v) { return std::to_string(v); }
inline std::string message_part(int64_t v) { return std::to_string(v); }
inline std::string message_part(size_t v) { return std::to_string(v); }
inline std::string message_part(double v) { return std::to_string(v); }
inline std::string message_part(c10::ScalarType t) { return c10::toString(t); }
inline std::string message_part(const c10::Device& d) { return d.str(); }
inline std::string message_part(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  ((out += message_part(parts)), ...);
  return out;
}

}  // namespace groupnorm
