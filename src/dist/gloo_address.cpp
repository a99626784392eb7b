#include "dist/gloo_address.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace dcp {
namespace {

std::vector<std::string> interface_names() {
  std::vector<std::string> names;
  if (struct if_nameindex* list = if_nameindex()) {
    for (struct if_nameindex* i = list; i->if_index != 0; ++i) names.emplace_back(i->if_name);
    if_freenameindex(list);
  }
  return names;
}

}  // namespace

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0) {  // any port: nothing is sent
    throw std::runtime_error(
        fmt::format("environment variable MASTER_ADDR='{}' does not resolve: {}", host, gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    // connect() on a UDP socket only chooses the route and the source address; no packet leaves.
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    bool ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
              getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (!ok) last_error = std::strerror(errno);
    close(fd);
    if (!ok) continue;
    char text[NI_MAXHOST];
    if (getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof(text), nullptr, 0, NI_NUMERICHOST) != 0) {
      continue;
    }
    freeaddrinfo(found);
    return text;
  }
  freeaddrinfo(found);
  throw std::runtime_error(
      fmt::format("environment variable MASTER_ADDR='{}': no local address routes to it ({})", host, last_error));
}

GlooBinding choose_gloo_binding(const std::string& master_addr, const char* socket_ifname) {
  GlooBinding b;
  if (socket_ifname != nullptr && *socket_ifname != '\0') {
    std::stringstream in(socket_ifname);
    for (std::string name; std::getline(in, name, ',');) {
      if (name.empty() || if_nametoindex(name.c_str()) == 0) {
        throw std::runtime_error(fmt::format(
            "environment variable GLOO_SOCKET_IFNAME='{}': no network interface '{}' on this host (it has: {})",
            socket_ifname, name, fmt::join(interface_names(), ", ")));
      }
      b.interfaces.push_back(name);
    }
    b.reason = fmt::format("GLOO_SOCKET_IFNAME={}", socket_ifname);
    return b;
  }
  b.address = local_address_towards(master_addr);
  b.reason = fmt::format("the local address that routes to MASTER_ADDR={}", master_addr);
  return b;
}

}  // namespace dcp
