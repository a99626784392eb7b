// A missing peer at rendezvous: every rank gives up within dist.timeout_s, with an error naming the rendezvous.
// Measured around the ProcessGroups constructor alone, so that process start-up on a busy machine does not count.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <thread>

#include "dcp/dist.h"
#include "dist/c10d_compat.h"
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

// A port free on 127.0.0.1 now (a fixed or pid-derived one may be taken on a shared machine).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("no free port on 127.0.0.1");
  }
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

// First, while this process has no threads yet (it forks): a rank 0 that listens but is stopped (SIGSTOP) must
// not hold rank 1 past the timeout. Before the fix rank 1 blocked in the store's add() for ever.
TEST(Rendezvous, StoppedRankZeroDoesNotHoldTheOthers) {
  const int port = free_port();
  pid_t rank0 = fork();
  ASSERT_GE(rank0, 0);
  if (rank0 == 0) {
    join_alone(0, port, 60.0);
    _exit(0);
  }
  // Until rank 0 listens: then stop it.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  bool listening = false;
  while (!listening && std::chrono::steady_clock::now() < deadline) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    listening = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    if (!listening) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(rank0, SIGSTOP);
  // kill() returns before the threads of rank 0 have stopped; its store could still answer rank 1 meanwhile.
  int status = 0;
  const bool stopped = waitpid(rank0, &status, WUNTRACED) == rank0 && WIFSTOPPED(status);
  Attempt a = listening && stopped ? join_alone(1, port, 2.0) : Attempt{-1, "rank 0 never listened or stopped"};
  kill(rank0, SIGKILL);
  waitpid(rank0, nullptr, 0);
  ASSERT_TRUE(listening && stopped);
  std::cerr << "rank 1 with rank 0 stopped, dist.timeout_s 2: failed after " << a.seconds << " s: " << a.error << "\n";
  EXPECT_NE(a.error.find("rendezvous at 127.0.0.1:" + std::to_string(port)), std::string::npos) << a.error;
  EXPECT_LT(a.seconds, 3.0);
}

// Before the fix rank 0 took 2 x the timeout (TCPStore's wait for workers gave up silently, then Gloo waited again).
TEST(Rendezvous, RankZeroWithoutItsPeerFailsWithinTheTimeout) {
  for (double timeout_s : {2.0, 5.0}) {
    const int port = free_port();
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
    const int port = free_port();  // nobody listens there
    Attempt a = join_alone(1, port, timeout_s);
    std::cerr << "rank 1 alone, dist.timeout_s " << timeout_s << ": failed after " << a.seconds << " s: " << a.error
              << "\n";
    EXPECT_NE(a.error.find("rendezvous at 127.0.0.1:" + std::to_string(port)), std::string::npos) << a.error;
    EXPECT_LT(a.seconds, timeout_s * 1.5);
  }
}

TEST(Rendezvous, BadSocketIfnameFailsAtOnceNamingIt) {
  setenv("GLOO_SOCKET_IFNAME", "nosuchif0", 1);
  Attempt a = join_alone(0, free_port(), 5.0);
  unsetenv("GLOO_SOCKET_IFNAME");
  EXPECT_NE(a.error.find("GLOO_SOCKET_IFNAME='nosuchif0'"), std::string::npos) << a.error;
  EXPECT_LT(a.seconds, 1.0);  // before the rendezvous, not after a timeout
}

// A peer that joins the rendezvous late and then never creates its groups (it died or stopped there): rank 0 gives
// up when dist.timeout_s has passed since the start of the rendezvous, naming the group; before the fix the world
// group's creation waited a whole timeout of its own after the rendezvous (0.6 T + T here).
TEST(Rendezvous, GroupCreationSharesTheRendezvousDeadline) {
  const double timeout_s = 4.0;
  const int port = free_port();
  std::promise<void> done;
  std::thread late_peer([&, ready = done.get_future()]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(timeout_s * 600)));
    dcp::DistEnv env;
    env.rank = 1;
    env.world_size = 2;
    env.master_addr = "127.0.0.1";
    env.master_port = port;
    try {
      dcp::Rendezvous joined = dcp::make_tcp_store(env, 30.0);
      ready.wait();  // holds its connection, creates no group
    } catch (const std::exception& e) {
      std::cerr << "the late peer failed to join: " << e.what() << "\n";
    }
  });
  Attempt a = join_alone(0, port, timeout_s);
  done.set_value();
  late_peer.join();
  std::cerr << "rank 0 with a peer that joined at 0.6 x dist.timeout_s " << timeout_s << " and made no group: failed after "
            << a.seconds << " s: " << a.error << "\n";
  EXPECT_NE(a.error.find("creating process group 'world' (rank 0 of 2) failed: not every member reached it within "
                         "dist.timeout_s 4 s"),
            std::string::npos)
      << a.error;
  EXPECT_GE(a.seconds, timeout_s * 0.9);
  EXPECT_LT(a.seconds, timeout_s * 1.3);
}
