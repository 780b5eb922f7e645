// defines: the TcpStore wire format, shared by client and server.
//
// A frame is a u32 length and a payload. A request payload is a command byte
// followed by strings (u32 length + bytes); a reply is a status byte followed
// by bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace cohort::tcp_store {

enum Command : uint8_t { kSet = 1, kGet, kAdd, kCheck, kWait, kDelete };
enum Status : uint8_t { kOk = 0, kNotFound = 1, kBadRequest = 2 };

inline void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  uint8_t b[4];
  std::memcpy(b, &v, 4);
  out.insert(out.end(), b, b + 4);
}

inline std::vector<uint8_t> encode_request(uint8_t cmd, const std::vector<std::string>& args) {
  std::vector<uint8_t> payload{cmd};
  for (auto& a : args) {
    put_u32(payload, static_cast<uint32_t>(a.size()));
    payload.insert(payload.end(), a.begin(), a.end());
  }
  std::vector<uint8_t> frame;
  put_u32(frame, static_cast<uint32_t>(payload.size()));
  frame.insert(frame.end(), payload.begin(), payload.end());
  return frame;
}

// Returns false on a malformed payload.
inline bool decode_request(const uint8_t* p, size_t n, uint8_t& cmd,
                           std::vector<std::string>& args) {
  if (n < 1) return false;
  cmd = p[0];
  size_t i = 1;
  while (i < n) {
    if (n - i < 4) return false;
    uint32_t len;
    std::memcpy(&len, p + i, 4);
    i += 4;
    if (n - i < len) return false;
    args.emplace_back(reinterpret_cast<const char*>(p + i), len);
    i += len;
  }
  return true;
}

}  // namespace cohort::tcp_store
