#pragma once
// Tiny little-endian encoder/decoder for descriptors, endpoints and frame headers. Decoding is
// bounds-checked: a truncated or garbled input makes ok() false, never reads out of range.

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

namespace wb::transport::wire {

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  void Str(absl::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }  // x86-64: little-endian
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  uint8_t U8() {
    uint8_t v = 0;
    Raw(&v, 1);
    return v;
  }
  uint32_t U32() {
    uint32_t v = 0;
    Raw(&v, 4);
    return v;
  }
  uint64_t U64() {
    uint64_t v = 0;
    Raw(&v, 8);
    return v;
  }
  int64_t I64() {
    int64_t v = 0;
    Raw(&v, 8);
    return v;
  }
  std::string Str(size_t max_len = 1 << 20) {
    uint32_t n = U32();
    if (!ok_ || n > max_len || n > in_.size()) {
      ok_ = false;
      return "";
    }
    std::string s(in_.substr(0, n));
    in_.remove_prefix(n);
    return s;
  }
  void Raw(void* p, size_t n) {
    if (!ok_ || in_.size() < n) {
      ok_ = false;
      return;
    }
    std::memcpy(p, in_.data(), n);
    in_.remove_prefix(n);
  }
  bool ok() const { return ok_; }
  bool done() const { return ok_ && in_.empty(); }

 private:
  absl::string_view in_;
  bool ok_ = true;
};

}  // namespace wb::transport::wire
