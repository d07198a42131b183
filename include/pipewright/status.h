// Error handling: absl::Status at every fallible boundary, propagated with the PW_ macros.
// PW_CHECK is for internal invariants only (it aborts); user errors are Status values.
#ifndef PIPEWRIGHT_STATUS_H_
#define PIPEWRIGHT_STATUS_H_

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PW_CONCAT_IMPL_(a, b) a##b
#define PW_CONCAT_(a, b) PW_CONCAT_IMPL_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define PW_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status pw_status_ = (expr);      \
    if (!pw_status_.ok()) return pw_status_; \
  } while (0)

// `lhs` = value of the StatusOr `rexpr`, or returns its error from the enclosing function.
#define PW_ASSIGN_OR_RETURN(lhs, rexpr) \
  PW_ASSIGN_OR_RETURN_IMPL_(PW_CONCAT_(pw_statusor_, __LINE__), lhs, rexpr)
#define PW_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                              \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()

// Internal invariant: prints expression and location, then aborts. Never for user input.
#define PW_CHECK(cond)                                                                 \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: PW_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

#endif  // PIPEWRIGHT_STATUS_H_
