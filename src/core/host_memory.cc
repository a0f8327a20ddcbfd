// HostAvailableBytes: the MemAvailable line of /proc/meminfo.
#include "core/host_memory.h"

#include <fstream>
#include <string>

namespace shadowkv {

int64_t HostAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

}  // namespace shadowkv
