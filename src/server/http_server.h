// HttpServer: the OpenAI-compatible HTTP front end over one model and the Scheduler.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/status.h"
#include "format/chat_template.h"
#include "kv/kv_config.h"
#include "server/api_request.h"
#include "server/http/transport.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/serving_model.h"

namespace shadowkv::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8080;        // 0: any free port (see HttpServer::port)
  std::string model_id;   // the name /v1/models reports
  kv::KvPolicyConfig kv;  // server default; "kv_policy"/"kv_budget" override it per request
  SchedulerOptions scheduler;
  ParseLimits limits;
  size_t max_body_bytes = 1 << 20;         // larger bodies: 413
  double request_timeout_seconds = 600.0;  // from arrival to the last token
  int default_max_tokens = 512;            // chat, when max_tokens is absent (completions: 16)
  int http_threads = 128;                  // generation requests at once (streams hold one each)
  size_t max_header_bytes = 32 * 1024;     // request line and headers: 431
  double header_timeout_seconds = 10.0;    // whole head, from its first byte: 408
  double body_timeout_seconds = 60.0;      // whole body, from the end of the head: 408
  double idle_timeout_seconds = 30.0;      // keep-alive wait for the next request
  double send_timeout_seconds = 30.0;      // each write of a response
  int max_connections = 1024;              // open at once; past it idle ones close, else 503
  int max_client_connections = 256;        // per client address; past it 429
  int max_policies = 64;                   // distinct per-request KV settings kept
};

class HttpServer {
 public:
  // Checks the default KV policy; the scheduler's loop starts here.
  static Result<std::unique_ptr<HttpServer>> Create(ServingModel& model, ServerConfig config);
  ~HttpServer();

  // Binds the listening socket; afterwards port() is the bound port.
  Status Bind();
  int port() const { return port_; }
  // Serves until Stop(); returns false when listening failed.
  bool Serve();
  // Graceful stop: refuse new requests, let running ones finish for up to `grace`, cancel the
  // rest, then close the listener. Safe from any thread, once or more.
  void Stop(std::chrono::milliseconds grace);

  Metrics& metrics() { return metrics_; }

 private:
  HttpServer(ServingModel& model, ServerConfig config);
  void Route();
  // The KV policy for a request's overrides; kInvalidArgument for impossible settings.
  Result<std::pair<const kv::KvPolicy*, std::string>> ResolvePolicy(const ApiRequest& request);

  ServingModel& model_;
  ServerConfig config_;
  Result<ChatTemplate> chat_template_;
  Metrics metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::mutex policies_mutex_;
  std::map<std::string, std::unique_ptr<kv::KvPolicy>> policies_;  // by policy key
  std::atomic<uint64_t> next_id_{1};
  std::atomic<bool> stopping_{false};
  int64_t started_ = 0;  // unix time
  int port_ = 0;
  // Last: its workers call into everything above, so it goes (joining them) first.
  std::unique_ptr<http::Transport> http_;
};

}  // namespace shadowkv::server
