// What the host's memory holds: the one place that reads /proc/meminfo.
#pragma once

#include <cstdint>

namespace shadowkv {

// MemAvailable of /proc/meminfo in bytes: what the kernel says can be allocated without
// swapping. 0 where it cannot be read (not Linux, no /proc).
int64_t HostAvailableBytes();

}  // namespace shadowkv
