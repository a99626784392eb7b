// Which local network interface or address the Gloo transport binds to (torch-free, so it is unit-tested alone).
#pragma once

#include <string>
#include <vector>

namespace dcp {

/// Where this process's Gloo device listens and connects from.
struct GlooBinding {
  std::vector<std::string> interfaces;  ///< from GLOO_SOCKET_IFNAME (one device each); empty: bind `address`
  std::string address;                  ///< numeric local IP that routes to MASTER_ADDR (when no interface is named)
  std::string reason;                   ///< for the log: why this binding was chosen
};

/// The numeric local IP (v4 or v6) the kernel would send from to reach `host` (a name or numeric address):
/// a UDP socket is connect()ed, which picks the route without sending a packet, and read back with
/// getsockname(). A local `host` gives a loopback address. Throws std::runtime_error naming MASTER_ADDR and
/// `host` when the name does not resolve or no route reaches it.
std::string local_address_towards(const std::string& host);

/// GLOO_SOCKET_IFNAME `socket_ifname` (a comma list, nullptr or empty when unset) names the interfaces; else
/// the address that reaches `master_addr`. Throws std::runtime_error naming GLOO_SOCKET_IFNAME and its value
/// when an interface does not exist on this host (the message lists those that do), or as
/// local_address_towards.
GlooBinding choose_gloo_binding(const std::string& master_addr, const char* socket_ifname);

}  // namespace dcp
