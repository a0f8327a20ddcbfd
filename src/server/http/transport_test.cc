// Transport on a loopback port with test routes: ordering, framing, busy pools, deadlines, Bind.
#include "server/http/transport.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

namespace shadowkv::server::http {
namespace {

std::string Json(std::string_view text) { return "{\"text\":\"" + std::string(text) + "\"}"; }

// A connected loopback socket that gives up reading after 10 s (a hang fails the test).
int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

std::string ReadToEnd(int fd) {
  std::string out;
  char buffer[4096];
  while (true) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

// Sends `bytes`, half-closes, and returns everything the server sent until it closed.
std::string Exchange(int port, const std::string& bytes) {
  const int fd = Connect(port);
  EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
  ::shutdown(fd, SHUT_WR);
  std::string out = ReadToEnd(fd);
  ::close(fd);
  return out;
}

class TransportTest : public ::testing::Test {
 protected:
  void Start(TransportOptions options) {
    options.port = 0;
    transport_ = std::make_unique<Transport>(options);
    transport_->SetErrorFormatter(
        [](int, std::string_view code, std::string_view) { return Json(code); });
    transport_->Handle("GET", "/fast", Pool::kLight,
                       [](const Request& req, Response& res) { res.body = Json(req.target); });
    transport_->Handle("POST", "/echo", Pool::kGeneration,
                       [](const Request& req, Response& res) { res.body = req.body; });
    transport_->Handle("POST", "/hold", Pool::kGeneration, [this](const Request&, Response& res) {
      ++held_;
      while (!release_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      res.body = Json("released");
    });
    transport_->Handle("GET", "/stream", Pool::kGeneration, [](const Request&, Response& res) {
      res.content_type = "text/event-stream";
      res.stream = [](StreamWriter& out) {
        for (const char* piece : {"one ", "two ", "three"}) out.Write(piece);
      };
    });
    ASSERT_TRUE(transport_->Bind().ok());
    serving_ = std::thread([this] { served_ = transport_->Serve(); });
  }

  void TearDown() override {
    release_ = true;
    if (transport_) transport_->Stop();
    if (serving_.joinable()) serving_.join();
    if (transport_) EXPECT_TRUE(served_);
  }

  int port() const { return transport_->port(); }

  std::unique_ptr<Transport> transport_;
  std::thread serving_;
  bool served_ = false;
  std::atomic<int> held_{0};
  std::atomic<bool> release_{false};
};

TEST_F(TransportTest, PipelinedRequestsAreAnsweredInOrder) {
  Start({});
  const std::string reply =
      Exchange(port(),
               "GET /fast?a HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
               "DELETE /fast HTTP/1.1\r\n\r\nGET /fast?b HTTP/1.1\r\n\r\n");
  const size_t a = reply.find(Json("/fast?a"));
  const size_t hello = reply.find("\r\n\r\nhello");
  const size_t not_allowed = reply.find("405 Method Not Allowed");
  const size_t b = reply.find(Json("/fast?b"));
  ASSERT_NE(a, std::string::npos) << reply;
  ASSERT_NE(hello, std::string::npos) << reply;
  ASSERT_NE(not_allowed, std::string::npos) << reply;
  ASSERT_NE(b, std::string::npos) << reply;
  EXPECT_LT(a, hello);
  EXPECT_LT(hello, not_allowed);
  EXPECT_LT(not_allowed, b);
  EXPECT_NE(reply.find("Allow: GET, HEAD\r\n"), std::string::npos) << reply;
}

TEST_F(TransportTest, StreamsAreChunkedForHttp11AndCloseDelimitedForHttp10) {
  Start({});
  const std::string chunked = Exchange(port(), "GET /stream HTTP/1.1\r\n\r\n");
  EXPECT_NE(chunked.find("Transfer-Encoding: chunked\r\n"), std::string::npos) << chunked;
  EXPECT_NE(chunked.find("\r\n\r\n4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n"),
            std::string::npos)
      << chunked;
  const std::string plain = Exchange(port(), "GET /stream HTTP/1.0\r\n\r\n");
  EXPECT_EQ(plain.find("Transfer-Encoding"), std::string::npos) << plain;
  EXPECT_NE(plain.find("Connection: close\r\n"), std::string::npos) << plain;
  EXPECT_EQ(plain.substr(plain.find("\r\n\r\n") + 4), "one two three");
}

TEST_F(TransportTest, BusyGenerationWorkersRefuseAtOnceWhileLightRoutesAnswer) {
  TransportOptions options;
  options.generation_threads = 1;
  Start(options);
  const int holder = Connect(port());
  const std::string hold = "POST /hold HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
  ASSERT_EQ(::send(holder, hold.data(), hold.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(hold.size()));
  while (held_.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const std::string busy = Exchange(port(), "POST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi");
  EXPECT_EQ(busy.rfind("HTTP/1.1 503 ", 0), 0u) << busy;
  EXPECT_NE(busy.find("Retry-After: 1\r\n"), std::string::npos) << busy;
  EXPECT_NE(busy.find(Json("server_busy")), std::string::npos) << busy;
  const std::string fast = Exchange(port(), "GET /fast HTTP/1.1\r\n\r\n");
  EXPECT_EQ(fast.rfind("HTTP/1.1 200 ", 0), 0u) << fast;
  release_ = true;
  ::shutdown(holder, SHUT_WR);
  EXPECT_NE(ReadToEnd(holder).find(Json("released")), std::string::npos);
  ::close(holder);
}

TEST_F(TransportTest, AHeadThatDoesNotArriveInTimeGets408) {
  TransportOptions options;
  options.header_timeout_seconds = 0.2;
  options.body_timeout_seconds = 0.2;
  Start(options);
  for (const std::string partial : {"GET /fast HTTP/1.1\r\nHost: x\r\n",
                                    "POST /echo HTTP/1.1\r\nContent-Length: 9\r\n\r\nab"}) {
    const int fd = Connect(port());
    ASSERT_EQ(::send(fd, partial.data(), partial.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(partial.size()));
    const std::string reply = ReadToEnd(fd);  // the server closes after its 408
    ::close(fd);
    EXPECT_EQ(reply.rfind("HTTP/1.1 408 ", 0), 0u) << reply;
    EXPECT_NE(reply.find(Json("request_timeout")), std::string::npos) << reply;
  }
}

TEST_F(TransportTest, ExpectContinueGetsAnInterimReplyBeforeTheBodyIsSent) {
  Start({});
  const int fd = Connect(port());
  const std::string head =
      "POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n";
  ASSERT_EQ(::send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  std::string interim;
  char c = 0;
  while (interim.find("\r\n\r\n") == std::string::npos && ::recv(fd, &c, 1, 0) == 1) {
    interim += c;
  }
  EXPECT_EQ(interim, "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_EQ(::send(fd, "abc", 3, MSG_NOSIGNAL), 3);
  ::shutdown(fd, SHUT_WR);
  const std::string reply = ReadToEnd(fd);
  ::close(fd);
  EXPECT_EQ(reply.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << reply;
  EXPECT_EQ(reply.substr(reply.find("\r\n\r\n") + 4), "abc");
}

TEST_F(TransportTest, HeadAnswersWithoutABody) {
  Start({});
  const std::string reply = Exchange(port(), "HEAD /fast HTTP/1.1\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 200 ", 0), 0u) << reply;
  EXPECT_NE(reply.find("Content-Length: " + std::to_string(Json("/fast").size())),
            std::string::npos);
  EXPECT_EQ(reply.substr(reply.find("\r\n\r\n") + 4), "");
}

TEST_F(TransportTest, ASecondListenerOnTheSamePortFailsToBind) {
  Start({});
  TransportOptions options;
  options.port = port();
  Transport second(options);
  const Status status = second.Bind();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("address in use"), std::string::npos) << status.ToString();
}

}  // namespace
}  // namespace shadowkv::server::http
