// defines: the TcpStore wire format, shared by client and server.
//
// A frame is a u32 length and a payload. A request payload is a command byte
// followed by strings (u32 length + bytes); a reply is a status byte followed
// by bytes (for kBadRequest, the reason as text).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace cohort::tcp_store {

// kAuth carries the job's token; a server with a token requires it as a
// client's first request.
enum Command : uint8_t { kSet = 1, kGet, kAdd, kCheck, kWait, kDelete, kAuth };
enum Status : uint8_t { kOk = 0, kNotFound = 1, kBadRequest = 2 };

// The largest frame payload the server accepts: 16 MiB. Rendezvous keys and
// values are addresses and small agreements (well under 1 KiB); the limit
// only stops a header that announces gigabytes from being buffered.
constexpr size_t kMaxFrameBytes = size_t{16} << 20;
// The most strings (keys) one request may carry. The server handles a
// request in one go, and a WAIT indexes its keys one by one: a 16 MiB frame
// of a million short keys would hold its loop, and every other client, for
// seconds. cohort's longest lists name one key per rank (a world's topology,
// the debug checker's rounds); TcpStore splits a longer list into requests
// of this many, so its callers never meet the limit.
constexpr size_t kMaxKeysPerRequest = 65536;
// Before a client has shown the token, its frames may be no larger than this.
constexpr size_t kMaxUnauthenticatedFrameBytes = 1024;

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

// How many strings a request payload carries, counted without building
// them and no further than `limit` + 1 (a malformed tail is not counted:
// decode_request refuses it).
inline size_t count_args(const uint8_t* p, size_t n, size_t limit) {
  size_t count = 0;
  size_t i = 1;
  while (n >= 4 && i <= n - 4 && count <= limit) {
    uint32_t len;
    std::memcpy(&len, p + i, 4);
    i += 4;
    if (n - i < len) break;
    i += len;
    ++count;
  }
  return count;
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
