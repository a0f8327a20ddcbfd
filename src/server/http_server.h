// HttpServer: the OpenAI-compatible HTTP front end over one model and the Scheduler.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/status.h"
#include "engine/scheduler.h"
#include "engine/serving_model.h"
#include "format/chat_template.h"
#include "kv/kv_config.h"
#include "server/api_request.h"
#include "server/http/transport.h"
#include "server/metrics.h"

namespace shadowkv::server {

struct ServerConfig {
  // Listening address, connection caps, request size limits (413, 431), deadlines (408) and
  // worker counts (generation_threads: generation requests at once, each open stream holding
  // one); port 0: any free port (see HttpServer::port).
  http::TransportOptions http;
  std::string model_id;  // the name /v1/models reports
  // Not empty: the weights are not a trained model's (model/synthetic.h's label); /v1/models'
  // entry and /metrics say so.
  std::string weights_label;
  kv::KvPolicyConfig kv;  // server default; "kv_policy"/"kv_budget" override it per request
  engine::SchedulerOptions scheduler;
  ParseLimits limits;
  double request_timeout_seconds = 600.0;  // from arrival to the last token
  int default_max_tokens = 512;            // chat, when max_tokens is absent (completions: 16)
  int max_policies = 64;                   // distinct per-request KV settings kept
};

class HttpServer {
 public:
  // Checks the default KV policy; the scheduler's loop starts here.
  static Result<std::unique_ptr<HttpServer>> Create(engine::ServingModel& model,
                                                    ServerConfig config);
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
  HttpServer(engine::ServingModel& model, ServerConfig config);
  void Route();
  // The KV policy for a request's overrides; kInvalidArgument for impossible settings.
  Result<std::pair<const kv::KvPolicy*, std::string>> ResolvePolicy(const ApiRequest& request);

  engine::ServingModel& model_;
  ServerConfig config_;
  Result<ChatTemplate> chat_template_;
  Metrics metrics_;
  std::unique_ptr<engine::Scheduler> scheduler_;
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
