// Which address or interface the Gloo transport binds to (GLOO_SOCKET_IFNAME, else the route to MASTER_ADDR).
#include <gtest/gtest.h>

#include "dist/gloo_address.h"
#include "unit/error_of.h"

using dcp::test::error_of;

TEST(GlooAddress, LocalMasterAddrGivesLoopback) {
  EXPECT_EQ(dcp::local_address_towards("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(dcp::local_address_towards("127.0.0.9"), "127.0.0.1");  // the route to all of 127/8 leaves from lo
  auto b = dcp::choose_gloo_binding("127.0.0.1", nullptr);
  EXPECT_TRUE(b.interfaces.empty());
  EXPECT_EQ(b.address, "127.0.0.1");
  EXPECT_NE(b.reason.find("MASTER_ADDR=127.0.0.1"), std::string::npos) << b.reason;
  EXPECT_EQ(dcp::choose_gloo_binding("127.0.0.1", "").address, "127.0.0.1");  // set but empty = unset
}

TEST(GlooAddress, SocketIfnameNamesTheInterfaces) {
  auto b = dcp::choose_gloo_binding("127.0.0.1", "lo");
  ASSERT_EQ(b.interfaces, std::vector<std::string>{"lo"});
  EXPECT_TRUE(b.address.empty());
  EXPECT_EQ(dcp::choose_gloo_binding("127.0.0.1", "lo,lo").interfaces.size(), 2u);
}

TEST(GlooAddress, ErrorsNameTheVariableAndTheValue) {
  std::string e = error_of([] { dcp::choose_gloo_binding("127.0.0.1", "nosuchif0"); });
  EXPECT_NE(e.find("GLOO_SOCKET_IFNAME='nosuchif0'"), std::string::npos) << e;
  EXPECT_NE(e.find("lo"), std::string::npos) << e;  // the interfaces that exist
  e = error_of([] { dcp::choose_gloo_binding("127.0.0.1", "lo,,lo"); });
  EXPECT_NE(e.find("GLOO_SOCKET_IFNAME='lo,,lo'"), std::string::npos) << e;
  // .invalid never resolves (RFC 6761), with or without a network.
  e = error_of([] { dcp::choose_gloo_binding("no-such-host.invalid", nullptr); });
  EXPECT_NE(e.find("MASTER_ADDR='no-such-host.invalid' does not resolve"), std::string::npos) << e;
}
