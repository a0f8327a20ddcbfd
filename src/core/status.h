// Status and Result<T>: how library code reports recoverable errors to its caller.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace shadowkv {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // bad settings or request fields
  kNotFound,         // missing file, key or tensor
  kUnsupported,      // valid input we do not handle (architecture, quant type)
  kCorrupt,          // malformed file contents
  kOutOfRange,       // e.g. prompt longer than the context
  kResourceExhausted,  // memory budget, queue full
  kIo,               // operating-system I/O failure
  kInternal,
};

const char* ErrorCodeName(ErrorCode code);

// A success or an error code with a message that names the problem.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

template <typename... Args>
Status Error(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  return Status(code, fmt::format(format, std::forward<Args>(args)...));
}

// A value or an error Status (never an ok Status).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status(ErrorCode::kInternal, "Result built from an ok Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace shadowkv

// Returns early from a function returning Status or Result<T> when `expr` is an error.
#define SKV_RETURN_IF_ERROR(expr)                 \
  do {                                            \
    ::shadowkv::Status skv_status_ = (expr);      \
    if (!skv_status_.ok()) return skv_status_;    \
  } while (0)

#define SKV_CONCAT_INNER(a, b) a##b
#define SKV_CONCAT(a, b) SKV_CONCAT_INNER(a, b)
// Declares `lhs` from a Result<T> expression, or returns its error.
#define SKV_ASSIGN_OR_RETURN(lhs, expr) \
  SKV_ASSIGN_OR_RETURN_IMPL(SKV_CONCAT(skv_result_, __LINE__), lhs, expr)
#define SKV_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
