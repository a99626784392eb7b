// A missing peer at rendezvous: every rank gives up within dist.timeout_s, with an error naming the rendezvous.
// Measured around the ProcessGroups constructor alone, so that process start-up on a busy machine does not count.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>

#include "dcp/dist.h"
#include "unit/error_of.h"

using dcp::test::error_of;

namespace {

struct Attempt {
  double seconds;
  std::string error;
};

Attempt join_alone(int64_t rank, int port, double timeout_s) {
  dcp::DistEnv env;
  env.rank = rank;
  env.world_size = 2;
  env.local_rank = 0;
  env.local_world_size = 1;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  auto start = std::chrono::steady_clock::now();
  std::string error = error_of([&] { dcp::ProcessGroups groups(env, timeout_s); });
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), error};
}

int test_port() { return 30000 + static_cast<int>(getpid() % 20000); }

}  // namespace

// Before the fix rank 0 took 2 x the timeout (TCPStore's wait for workers gave up silently, then Gloo waited again).
TEST(Rendezvous, RankZeroWithoutItsPeerFailsWithinTheTimeout) {
  for (double timeout_s : {2.0, 5.0}) {
    const int port = test_port() + static_cast<int>(timeout_s);
    Attempt a = join_alone(0, port, timeout_s);
    std::cerr << "rank 0 alone, dist.timeout_s " << timeout_s << ": failed after " << a.seconds << " s: " << a.error
              << "\n";
    EXPECT_NE(a.error.find("only 1 of 2 ranks joined"), std::string::npos) << a.error;
    EXPECT_NE(a.error.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << a.error;
    EXPECT_GE(a.seconds, timeout_s * 0.9);
    EXPECT_LT(a.seconds, timeout_s * 1.5);
  }
}

TEST(Rendezvous, OtherRankWithoutRankZeroFailsWithinTheTimeout) {
  for (double timeout_s : {2.0, 5.0}) {
    const int port = test_port() + 10 + static_cast<int>(timeout_s);  // nobody listens there
    Attempt a = join_alone(1, port, timeout_s);
    std::cerr << "rank 1 alone, dist.timeout_s " << timeout_s << ": failed after " << a.seconds << " s: " << a.error
              << "\n";
    EXPECT_NE(a.error.find("rendezvous at 127.0.0.1:" + std::to_string(port)), std::string::npos) << a.error;
    EXPECT_LT(a.seconds, timeout_s * 1.5);
  }
}

TEST(Rendezvous, BadSocketIfnameFailsAtOnceNamingIt) {
  setenv("GLOO_SOCKET_IFNAME", "nosuchif0", 1);
  Attempt a = join_alone(0, test_port() + 20, 5.0);
  unsetenv("GLOO_SOCKET_IFNAME");
  EXPECT_NE(a.error.find("GLOO_SOCKET_IFNAME='nosuchif0'"), std::string::npos) << a.error;
  EXPECT_LT(a.seconds, 1.0);  // before the rendezvous, not after a timeout
}
