// Transport: the HTTP/1.1 server under `shadowkv serve`: one epoll loop reads requests under
// limits and deadlines, two worker pools answer them.
//
// Design. The loop thread owns every connection while a request is being read: non-blocking
// sockets, a RequestParser per connection, a deadline for the whole head and another for the
// whole body (408), caps on open connections in all and per client address. To make room, idle
// keep-alive connections are closed first, then (for the total cap) the head that has been
// arriving longest. A slow client therefore costs a socket and a few bytes, never a thread.
// Only complete requests leave the loop: generation routes go to a pool of `generation_threads`
// workers (a stream holds one; when none is free the request is refused at once with 503 and
// Retry-After), every other route to a small pool of its own so that /health and /metrics
// answer while generation is saturated. A worker writes the response with a send deadline and
// hands the connection back; bytes already read past the request (pipelining) are parsed next,
// so answers leave in order. Refusals made by the loop (limits, deadlines) are sent, then the
// connection is half-closed and drained for a moment so that the client reads the refusal
// instead of a reset.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "server/http/request_parser.h"

namespace shadowkv::server::http {

struct TransportOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port
  RequestLimits limits;
  int generation_threads = 128;
  int light_threads = 2;
  double header_timeout_seconds = 10.0;  // from a request's first byte to the end of its head
  double body_timeout_seconds = 60.0;    // from the end of the head to the end of the body
  double idle_timeout_seconds = 30.0;    // a kept-alive connection waiting for its next request
  double send_timeout_seconds = 30.0;    // for each write of a response to go out
  int max_connections = 1024;
  int max_client_connections = 256;  // per client address
};

// The body of a streamed response, written piece by piece.
class StreamWriter {
 public:
  virtual ~StreamWriter() = default;
  // False once the client is gone or stopped reading for longer than the send timeout.
  virtual bool Write(std::string_view data) = 0;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // When set, the body comes from this once the head is out: chunked for HTTP/1.1, delimited by
  // closing the connection for HTTP/1.0.
  std::function<void(StreamWriter&)> stream;
};

enum class Pool { kLight, kGeneration };
using Handler = std::function<void(const Request&, Response&)>;
// After every response, including the transport's own refusals: the request's path ("" when
// none was parsed) and the status sent.
using ResponseLogger = std::function<void(std::string_view path, int status)>;
// The body of a refusal that the transport makes itself.
using ErrorFormatter =
    std::function<std::string(int status, std::string_view code, std::string_view message)>;

class Transport {
 public:
  explicit Transport(TransportOptions options);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Before Serve(). A GET route answers HEAD too.
  void Handle(std::string method, std::string path, Pool pool, Handler handler);
  void SetLogger(ResponseLogger logger) { logger_ = std::move(logger); }
  void SetErrorFormatter(ErrorFormatter formatter) { error_formatter_ = std::move(formatter); }

  // Listens (no SO_REUSEPORT: a second server on the port fails here); port() is then bound.
  Status Bind();
  int port() const { return port_; }
  // Runs the loop until Stop(); false when Bind() did not succeed.
  bool Serve();
  // Closes the listener and every connection once running responses are written. Any thread.
  void Stop();

 private:
  struct Route;
  struct Connection;
  class WorkerPool;
  class SocketWriter;
  using Clock = std::chrono::steady_clock;

  void AcceptAll();
  void OnReadable(Connection* c);
  // Takes bytes read from the socket; false when the connection left the loop's reading.
  bool Consume(Connection* c, std::string_view data);
  void Dispatch(Connection* c);
  void RunRequest(Connection* c, const Route* route);
  void ReturnToLoop(Connection* c, bool keep_alive);
  void TakeReturned();
  void Sweep(Clock::time_point now);
  // Answers from the loop, best effort, then half-closes and drains the connection.
  void Refuse(Connection* c, int status, std::string_view code, std::string_view message,
              bool retry_after = false);
  // Closes the idle connection (of `peer`, if given) that waited longest; false when none.
  bool EvictIdle(const std::string* peer, const Connection* except);
  // Closes (with 408) the connection whose request head has been arriving longest, if over a
  // second: when the server is full, a slow sender gives way to a new client.
  bool EvictSlowestHead(const Connection* except);
  void Close(Connection* c);
  std::string ErrorText(int status, std::string_view code, std::string_view message) const;
  std::string Allowed(const std::string& path) const;

  TransportOptions options_;
  std::vector<std::unique_ptr<Route>> routes_;
  ResponseLogger logger_;
  ErrorFormatter error_formatter_;
  std::unique_ptr<WorkerPool> light_pool_;
  std::unique_ptr<WorkerPool> generation_pool_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};

  // Loop-thread state (the returned list excepted).
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shadowkv::server::http
