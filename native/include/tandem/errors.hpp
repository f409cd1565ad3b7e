// Error types of the native core. The bindings map each to one Python class:
// InvalidArgument -> ValueError, TypeMismatch -> TypeError,
// DeviceMemoryError -> engine.DeviceMemoryError (a MemoryError),
// ClosedError -> engine.ClosedError (a RuntimeError); StaleLease (slot_table.hpp)
// -> engine.slots.StaleLeaseError (a ValueError).
#pragma once

#include <stdexcept>
#include <string>

namespace tandem {

struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct TypeMismatch : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct DeviceMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ClosedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace tandem
