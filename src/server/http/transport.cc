// Transport: the epoll loop (accept, read, deadlines, caps), the worker pools, response writing.
#include "server/http/transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace shadowkv::server::http {

namespace {

constexpr int kListenBacklog = 1024;
constexpr size_t kReadChunk = 64 * 1024;
constexpr int kReadsPerEvent = 16;  // then other connections get a turn
constexpr auto kLinger = std::chrono::seconds(2);
constexpr auto kSweepEvery = std::chrono::milliseconds(50);
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
constexpr size_t kLightQueue = 256;
// A head still arriving after this long may be closed to make room when the server is full.
constexpr auto kSlowHead = std::chrono::seconds(1);

std::chrono::steady_clock::duration Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

const char* Reason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 413:
      return "Content Too Large";
    case 417:
      return "Expectation Failed";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Status";
  }
}

// The status line and header fields. `length` < 0: no Content-Length (a stream).
std::string ResponseHead(const Response& res, int64_t length, bool chunked, bool keep_alive) {
  std::string head = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\n", res.status,
                                 Reason(res.status), res.content_type);
  if (length >= 0) head += fmt::format("Content-Length: {}\r\n", length);
  if (chunked) head += "Transfer-Encoding: chunked\r\n";
  head += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  for (const auto& [name, value] : res.headers) head += fmt::format("{}: {}\r\n", name, value);
  head += "\r\n";
  return head;
}

std::string PeerAddress(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(addr).sin_addr, text, sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr, text, sizeof(text));
  }
  return text;
}

// One non-blocking send of what fits; for the loop, which never waits on a client.
void SendSome(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

struct Transport::Route {
  std::string method;
  std::string path;
  Pool pool;
  Handler handler;
};

struct Transport::Connection {
  enum class Phase { kReading, kDispatched, kDraining };
  Connection(int fd_in, std::string peer_in, const RequestLimits& limits)
      : fd(fd_in), peer(std::move(peer_in)), parser(limits) {}
  int fd;
  std::string peer;
  RequestParser parser;
  std::string pending;  // bytes read past the request being answered
  Phase phase = Phase::kReading;
  bool served = false;  // answered a request before: waiting is keep-alive idling
  bool head_seen = false;
  bool continue_sent = false;
  Clock::time_point ready_at;  // accepted, or handed back after a response
  Clock::time_point head_started;
  Clock::time_point body_started;
  Clock::time_point linger_until;
};

struct Transport::State {
  std::unordered_map<int, std::unique_ptr<Connection>> connections;  // by fd
  std::unordered_map<std::string, int> per_client;
  int dispatched = 0;
  bool accept_paused = false;
  Clock::time_point accept_resume;
  Clock::time_point last_sweep;
  std::mutex returned_mutex;
  std::vector<std::pair<Connection*, bool>> returned;  // (connection, keep alive)
};

// Threads that run jobs; TrySubmit refuses once every thread is busy and the queue is full.
class Transport::WorkerPool {
 public:
  WorkerPool(int threads, size_t max_queued) : threads_(threads), max_queued_(max_queued) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Run(); });
  }
  ~WorkerPool() { Shutdown(); }

  bool TrySubmit(std::function<void()> job) {
    std::lock_guard lock(mutex_);
    if (done_ || busy_ + jobs_.size() >= static_cast<size_t>(threads_) + max_queued_) {
      return false;
    }
    jobs_.push_back(std::move(job));
    ready_.notify_one();
    return true;
  }

  // Runs what is queued, then joins.
  void Shutdown() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      ready_.notify_all();
    }
    for (std::thread& worker : workers_) {
      if (worker.joinable()) worker.join();
    }
  }

 private:
  void Run() {
    std::unique_lock lock(mutex_);
    while (true) {
      ready_.wait(lock, [this] { return done_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      ++busy_;
      lock.unlock();
      job();
      lock.lock();
      --busy_;
    }
  }

  const int threads_;
  const size_t max_queued_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  size_t busy_ = 0;
  bool done_ = false;
  std::vector<std::thread> workers_;
};

// A worker's writes to its connection: each must go out within the send timeout.
class Transport::SocketWriter : public StreamWriter {
 public:
  SocketWriter(int fd, Clock::duration timeout, bool chunked)
      : fd_(fd), timeout_(timeout), chunked_(chunked) {}

  bool Send(std::string_view data) {
    if (failed_) return false;
    const Clock::time_point deadline = Clock::now() + timeout_;
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        data.remove_prefix(static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        pollfd p{fd_, POLLOUT, 0};
        if (left.count() > 0 && ::poll(&p, 1, static_cast<int>(left.count()) + 1) >= 0 &&
            !(p.revents & (POLLERR | POLLHUP | POLLNVAL))) {
          if (Clock::now() < deadline) continue;
        }
      }
      failed_ = true;  // gone (reset, closed) or too slow
      return false;
    }
    return true;
  }

  bool Write(std::string_view data) override {
    if (data.empty()) return !failed_;  // an empty chunk would end the body
    if (!chunked_) return Send(data);
    std::string chunk = fmt::format("{:x}\r\n", data.size());
    chunk.append(data);
    chunk += "\r\n";
    return Send(chunk);
  }

  bool failed() const { return failed_; }

 private:
  int fd_;
  Clock::duration timeout_;
  bool chunked_;
  bool failed_ = false;
};

Transport::Transport(TransportOptions options)
    : options_(std::move(options)), state_(std::make_unique<State>()) {
  light_pool_ = std::make_unique<WorkerPool>(std::max(1, options_.light_threads), kLightQueue);
  generation_pool_ = std::make_unique<WorkerPool>(std::max(1, options_.generation_threads), 0);
}

Transport::~Transport() {
  light_pool_->Shutdown();
  generation_pool_->Shutdown();
  for (auto& [fd, c] : state_->connections) ::close(fd);
  for (int fd : {listen_fd_, epoll_fd_, wake_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

void Transport::Handle(std::string method, std::string path, Pool pool, Handler handler) {
  routes_.push_back(
      std::make_unique<Route>(Route{std::move(method), std::move(path), pool, std::move(handler)}));
}

Status Transport::Bind() {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options_.port);
  if (int rc = ::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return Error(ErrorCode::kIo, "cannot resolve the address {}: {}", options_.host,
                 gai_strerror(rc));
  }
  int last_errno = 0;
  for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    // SO_REUSEADDR lets a restart bind past TIME_WAIT; it does not let two listeners share
    // the port (SO_REUSEPORT would, and is not set).
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, kListenBacklog) != 0) {
      last_errno = errno;
      ::close(fd);
      continue;
    }
    listen_fd_ = fd;
  }
  ::freeaddrinfo(found);
  if (listen_fd_ < 0) {
    if (last_errno == EADDRINUSE) {
      return Error(ErrorCode::kIo,
                   "cannot listen on {}:{}: address in use (is another server running there?)",
                   options_.host, options_.port);
    }
    return Error(ErrorCode::kIo, "cannot listen on {}:{}: {}", options_.host, options_.port,
                 std::strerror(last_errno));
  }
  sockaddr_storage bound = {};
  socklen_t size = sizeof(bound);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &size);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                                            : reinterpret_cast<sockaddr_in&>(bound).sin_port);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    return Error(ErrorCode::kIo, "cannot create the event loop: {}", std::strerror(errno));
  }
  epoll_event listen_event{EPOLLIN, {.fd = listen_fd_}};
  epoll_event wake_event{EPOLLIN, {.fd = wake_fd_}};
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &listen_event);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &wake_event);
  return Status::Ok();
}

void Transport::Stop() {
  stopping_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
}

bool Transport::Serve() {
  if (listen_fd_ < 0 || epoll_fd_ < 0) return false;
  State& s = *state_;
  epoll_event events[256];
  while (!stopping_.load()) {
    const int n = ::epoll_wait(epoll_fd_, events, 256, static_cast<int>(kSweepEvery.count()));
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == listen_fd_) {
        AcceptAll();
      } else if (fd == wake_fd_) {
        uint64_t count = 0;
        [[maybe_unused]] ssize_t r = ::read(wake_fd_, &count, sizeof(count));
      } else if (auto it = s.connections.find(fd); it != s.connections.end()) {
        OnReadable(it->second.get());
      }
    }
    TakeReturned();
    const Clock::time_point now = Clock::now();
    if (now - s.last_sweep >= kSweepEvery) Sweep(now);
  }
  // Stopping: no new connections; responses being written finish (the send timeout bounds
  // them), then every connection closes.
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
  ::close(listen_fd_);
  listen_fd_ = -1;
  std::vector<Connection*> idle;
  for (auto& [fd, c] : s.connections) {
    if (c->phase != Connection::Phase::kDispatched) idle.push_back(c.get());
  }
  for (Connection* c : idle) Close(c);
  while (s.dispatched > 0) {
    ::epoll_wait(epoll_fd_, events, 256, static_cast<int>(kSweepEvery.count()));
    uint64_t count = 0;
    [[maybe_unused]] ssize_t r = ::read(wake_fd_, &count, sizeof(count));
    TakeReturned();
  }
  light_pool_->Shutdown();
  generation_pool_->Shutdown();
  return true;
}

void Transport::AcceptAll() {
  State& s = *state_;
  while (true) {
    sockaddr_storage addr = {};
    socklen_t size = sizeof(addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &size,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (EvictIdle(nullptr, nullptr)) continue;
        // Out of descriptors with nothing idle: stop accepting for a moment instead of
        // spinning on a listener that stays readable.
        epoll_event none{0, {.fd = listen_fd_}};
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &none);
        s.accept_paused = true;
        s.accept_resume = Clock::now() + kAcceptPause;
      }
      return;
    }
    auto owned = std::make_unique<Connection>(fd, PeerAddress(addr), options_.limits);
    Connection* c = owned.get();
    c->ready_at = Clock::now();
    s.connections[fd] = std::move(owned);
    const int on = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
    epoll_event event{EPOLLIN | EPOLLRDHUP, {.fd = fd}};
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
    const int mine = ++s.per_client[c->peer];
    const bool full = static_cast<int>(s.connections.size()) > options_.max_connections;
    if (full && !EvictIdle(nullptr, c) && !EvictSlowestHead(c)) {
      Refuse(c, 503, "too_many_connections",
             fmt::format("the server has its limit of {} connections open; retry later",
                         options_.max_connections),
             /*retry_after=*/true);
    } else if (mine > options_.max_client_connections && !EvictIdle(&c->peer, c)) {
      Refuse(c, 429, "too_many_connections",
             fmt::format("this client address has its limit of {} connections open",
                         options_.max_client_connections),
             /*retry_after=*/true);
    }
  }
}

bool Transport::EvictIdle(const std::string* peer, const Connection* except) {
  State& s = *state_;
  Connection* oldest = nullptr;
  for (auto& [fd, c] : s.connections) {
    const bool idle = c->phase == Connection::Phase::kReading && !c->parser.started() &&
                      c->pending.empty() && c.get() != except;
    if (!idle || (peer != nullptr && c->peer != *peer)) continue;
    // Kept-alive connections first (a fresh one may be about to send), then the oldest.
    if (oldest == nullptr || (c->served && !oldest->served) ||
        (c->served == oldest->served && c->ready_at < oldest->ready_at)) {
      oldest = c.get();
    }
  }
  if (oldest == nullptr) return false;
  Close(oldest);
  return true;
}

bool Transport::EvictSlowestHead(const Connection* except) {
  State& s = *state_;
  const Clock::time_point now = Clock::now();
  Connection* slowest = nullptr;
  for (auto& [fd, c] : s.connections) {
    const bool in_head = c->phase == Connection::Phase::kReading && c->parser.started() &&
                         !c->parser.head_complete() && c.get() != except &&
                         now - c->head_started >= kSlowHead;
    if (in_head && (slowest == nullptr || c->head_started < slowest->head_started)) {
      slowest = c.get();
    }
  }
  if (slowest == nullptr) return false;
  // No lingering here: the point is to free the slot now.
  Response res;
  res.status = 408;
  res.body = ErrorText(408, "request_timeout",
                       "the request head was still arriving while the server had its limit of "
                       "connections open; closed to make room");
  SendSome(slowest->fd,
           ResponseHead(res, static_cast<int64_t>(res.body.size()), false, false) + res.body);
  if (logger_) logger_(slowest->parser.request().path, 408);
  Close(slowest);
  return true;
}

void Transport::Close(Connection* c) {
  State& s = *state_;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  ::close(c->fd);
  if (auto it = s.per_client.find(c->peer); it != s.per_client.end() && --it->second <= 0) {
    s.per_client.erase(it);
  }
  if (s.accept_paused) {  // a descriptor came free
    epoll_event event{EPOLLIN, {.fd = listen_fd_}};
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &event);
    s.accept_paused = false;
  }
  s.connections.erase(c->fd);
}

std::string Transport::ErrorText(int status, std::string_view code,
                                 std::string_view message) const {
  if (error_formatter_) return error_formatter_(status, code, message);
  return std::string(message);
}

void Transport::Refuse(Connection* c, int status, std::string_view code, std::string_view message,
                       bool retry_after) {
  Response res;
  res.status = status;
  res.body = ErrorText(status, code, message);
  if (retry_after) res.headers.emplace_back("Retry-After", "1");
  SendSome(c->fd,
           ResponseHead(res, static_cast<int64_t>(res.body.size()), false, false) + res.body);
  if (logger_) logger_(c->parser.request().path, status);  // "" before a request line
  // Half-close and read what the client still sends: closing with unread bytes would reset
  // the connection, and the client might lose the refusal.
  ::shutdown(c->fd, SHUT_WR);
  c->phase = Connection::Phase::kDraining;
  c->linger_until = Clock::now() + kLinger;
}

void Transport::OnReadable(Connection* c) {
  char buffer[kReadChunk];
  for (int i = 0; i < kReadsPerEvent; ++i) {
    const ssize_t n = ::recv(c->fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      // The client closed (or reset). Half a request gets an answer: it may still read.
      if (n == 0 && c->phase == Connection::Phase::kReading && c->parser.started()) {
        Refuse(c, 400, "incomplete_request",
               "the client closed its side before the request was complete");
        Close(c);
        return;
      }
      Close(c);
      return;
    }
    if (c->phase == Connection::Phase::kDraining) continue;  // discarded
    if (!Consume(c, std::string_view(buffer, static_cast<size_t>(n)))) return;
  }
}

bool Transport::Consume(Connection* c, std::string_view data) {
  RequestParser& parser = c->parser;
  const size_t used = parser.Feed(data);
  const Clock::time_point now = Clock::now();
  if (parser.started() && !c->head_seen) {
    c->head_seen = true;
    c->head_started = now;
  }
  switch (parser.state()) {
    case RequestParser::State::kError:
      Refuse(c, parser.error().status, parser.error().code, parser.error().message);
      return false;
    case RequestParser::State::kComplete:
      c->pending.assign(data.substr(used));
      Dispatch(c);
      return false;
    case RequestParser::State::kBody:
      if (c->body_started < c->head_started) c->body_started = now;
      if (parser.request().expect_continue && !c->continue_sent) {
        c->continue_sent = true;
        SendSome(c->fd, "HTTP/1.1 100 Continue\r\n\r\n");
      }
      return true;
    case RequestParser::State::kHead:
      return true;
  }
  return true;
}

std::string Transport::Allowed(const std::string& path) const {
  std::string allow;
  for (const auto& route : routes_) {
    if (route->path != path) continue;
    if (!allow.empty()) allow += ", ";
    allow += route->method;
    if (route->method == "GET") allow += ", HEAD";
  }
  return allow;
}

void Transport::Dispatch(Connection* c) {
  State& s = *state_;
  const Request& req = c->parser.request();
  const Route* route = nullptr;
  for (const auto& r : routes_) {
    if (r->path == req.path &&
        (r->method == req.method || (req.method == "HEAD" && r->method == "GET"))) {
      route = r.get();
    }
  }
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  c->phase = Connection::Phase::kDispatched;
  ++s.dispatched;
  // Unrouted requests are answered by the light pool too, so that keep-alive carries on.
  WorkerPool& pool = route && route->pool == Pool::kGeneration ? *generation_pool_ : *light_pool_;
  if (pool.TrySubmit([this, c, route] { RunRequest(c, route); })) return;
  --s.dispatched;
  c->phase = Connection::Phase::kReading;
  epoll_event event{EPOLLIN | EPOLLRDHUP, {.fd = c->fd}};
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &event);
  Refuse(c, 503, "server_busy",
         "every worker for this route is busy (each open stream holds one); retry later",
         /*retry_after=*/true);
}

void Transport::RunRequest(Connection* c, const Route* route) {
  const Request& req = c->parser.request();
  Response res;
  if (route == nullptr) {
    const std::string allow = Allowed(req.path);
    if (allow.empty()) {
      res.status = 404;
      res.body = ErrorText(404, "unknown_url", fmt::format("no route {} {}", req.method, req.path));
    } else {
      res.status = 405;
      res.body = ErrorText(
          405, "method_not_allowed",
          fmt::format("{} is not allowed on {}; allowed: {}", req.method, req.path, allow));
      res.headers.emplace_back("Allow", allow);
    }
  } else {
    try {
      route->handler(req, res);
    } catch (const std::exception& error) {
      res = Response();
      res.status = 500;
      res.body = ErrorText(500, "internal_error", fmt::format("internal error: {}", error.what()));
    } catch (...) {
      res = Response();
      res.status = 500;
      res.body = ErrorText(500, "internal_error", "internal error");
    }
  }
  const bool http10 = req.minor_version == 0;
  bool keep_alive = req.keep_alive && !stopping_.load();
  SocketWriter writer(c->fd, Seconds(options_.send_timeout_seconds),
                      /*chunked=*/res.stream && !http10);
  if (res.stream) {
    if (http10) keep_alive = false;  // the body ends where the connection does
    writer.Send(ResponseHead(res, -1, !http10, keep_alive));
    bool finished = false;
    if (!writer.failed()) {
      try {
        res.stream(writer);
        finished = true;
      } catch (...) {  // the head is out: all that is left is to cut the stream short
      }
    }
    if (finished && !http10) writer.Send("0\r\n\r\n");
    if (!finished) keep_alive = false;
  } else {
    std::string out = ResponseHead(res, static_cast<int64_t>(res.body.size()), false, keep_alive);
    if (req.method != "HEAD") out += res.body;
    writer.Send(out);
  }
  if (logger_) logger_(req.path, res.status);
  ReturnToLoop(c, keep_alive && !writer.failed());
}

void Transport::ReturnToLoop(Connection* c, bool keep_alive) {
  {
    std::lock_guard lock(state_->returned_mutex);
    state_->returned.emplace_back(c, keep_alive);
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Transport::TakeReturned() {
  State& s = *state_;
  std::vector<std::pair<Connection*, bool>> returned;
  {
    std::lock_guard lock(s.returned_mutex);
    returned.swap(s.returned);
  }
  for (auto [c, keep_alive] : returned) {
    --s.dispatched;
    if (!keep_alive || stopping_.load()) {
      Close(c);
      continue;
    }
    c->phase = Connection::Phase::kReading;
    c->parser.Reset();
    c->served = true;
    c->head_seen = false;
    c->continue_sent = false;
    c->ready_at = Clock::now();
    epoll_event event{EPOLLIN | EPOLLRDHUP, {.fd = c->fd}};
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &event);
    if (!c->pending.empty()) {
      const std::string pipelined = std::move(c->pending);
      c->pending.clear();
      Consume(c, pipelined);
    }
  }
}

void Transport::Sweep(Clock::time_point now) {
  State& s = *state_;
  s.last_sweep = now;
  if (s.accept_paused && now >= s.accept_resume) {
    epoll_event event{EPOLLIN, {.fd = listen_fd_}};
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &event);
    s.accept_paused = false;
  }
  std::vector<Connection*> expired_quietly;
  std::vector<std::pair<Connection*, bool>> timed_out;  // (connection, in the body)
  for (auto& [fd, owned] : s.connections) {
    Connection* c = owned.get();
    if (c->phase == Connection::Phase::kDraining) {
      if (now >= c->linger_until) expired_quietly.push_back(c);
    } else if (c->phase == Connection::Phase::kReading) {
      const RequestParser& parser = c->parser;
      if (!parser.started()) {
        const double wait =
            c->served ? options_.idle_timeout_seconds : options_.header_timeout_seconds;
        if (now - c->ready_at > Seconds(wait)) expired_quietly.push_back(c);
      } else if (!parser.head_complete()) {
        if (now - c->head_started > Seconds(options_.header_timeout_seconds)) {
          timed_out.emplace_back(c, false);
        }
      } else if (now - c->body_started > Seconds(options_.body_timeout_seconds)) {
        timed_out.emplace_back(c, true);
      }
    }
  }
  for (Connection* c : expired_quietly) Close(c);
  for (auto [c, in_body] : timed_out) {
    Refuse(c, 408, "request_timeout",
           in_body ? fmt::format("the request body did not arrive within {} s",
                                 options_.body_timeout_seconds)
                   : fmt::format("the request head did not arrive within {} s",
                                 options_.header_timeout_seconds));
  }
}

}  // namespace shadowkv::server::http
