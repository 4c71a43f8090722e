// How much host memory a load may take, so that a model too large for the
// machine is refused with a message instead of being killed by the kernel's
// OOM killer halfway through dequantization.
#pragma once

#include <cstdint>
#include <string>

namespace oscar {

// Bytes this process may still allocate: the smallest of MemAvailable
// (/proc/meminfo), the cgroup v2 limit minus its current use
// (/sys/fs/cgroup/memory.max, memory.current), and $OSCAR_HOST_MEMORY_LIMIT
// (bytes, or with a K/M/G suffix; a user's cap). UINT64_MAX when none is known.
uint64_t host_memory_available();

// Parses "123", "512M", "2G", "1.5g" (binary units) into bytes; throws oscar::Error.
uint64_t parse_byte_size(const std::string& s);

// "1.23 GiB" / "456.0 MiB" / "12 B".
std::string format_bytes(uint64_t bytes);

}  // namespace oscar
