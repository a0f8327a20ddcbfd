// HttpServer: routes, request preparation (tokens, limits, KV policy), streamed and whole replies.
#include "server/http_server.h"

#include <ctime>
#include <random>

#include "format/tokenizer.h"
#include "server/api_response.h"
#include "server/chat_page.h"
#include "server/stop_matcher.h"

namespace shadowkv::server {

using engine::Clock;
using engine::EndReason;
using engine::Scheduler;
using engine::SequenceHandle;
using engine::SequenceRequest;
using engine::ServingModel;
using engine::SubmitResult;

using Json = nlohmann::json;

namespace {

constexpr auto kHeartbeat = std::chrono::milliseconds(1000);

std::string Dump(const Json& body) {
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void SendJson(http::Response& res, int status, const Json& body) {
  res.status = status;
  res.content_type = "application/json";
  res.body = Dump(body);
}

void SendError(http::Response& res, const ApiError& error) {
  SendJson(res, error.http_status, ErrorBody(error));
}

std::string EndpointLabel(const std::string& path) {
  for (const char* known :
       {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/"}) {
    if (path == known) return path;
  }
  return "other";
}

const char* FinishReasonText(EndReason reason) {
  return reason == EndReason::kLength ? "length" : "stop";
}

// A request turned into what the scheduler runs.
struct Prepared {
  SequenceRequest sequence;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  ResponseMeta meta;
};

// The error that ends a request which did not finish normally; nullopt when it did.
std::optional<ApiError> EndError(const SequenceHandle& handle, double timeout_seconds) {
  switch (handle.end_reason()) {
    case EndReason::kTimeout:
      return ApiError{
          504, fmt::format("the request ran past the server's timeout of {} s", timeout_seconds),
          "timeout_error", "", "request_timeout"};
    case EndReason::kShutdown:
      return ApiError{503, "the server shut down before the request finished", "server_error", "",
                      "shutting_down"};
    case EndReason::kError:
      return ApiError{500, "generation failed: " + handle.status().ToString(), "server_error", "",
                      "internal_error"};
    default:
      return std::nullopt;
  }
}

// Turns generated tokens into text and applies the stop sequences.
class TextAssembler {
 public:
  TextAssembler(const Tokenizer& tokenizer, std::vector<std::string> stop)
      : decoder_(tokenizer, /*skip_special=*/true), matcher_(std::move(stop)) {}
  // Text to emit for `token`; stopped() once a stop sequence matched.
  std::string Push(int32_t token) {
    ++tokens_;
    return matcher_.Push(decoder_.Push(token));
  }
  std::string Flush() {
    std::string out = matcher_.Push(decoder_.Flush());
    return out + matcher_.Flush();
  }
  bool stopped() const { return matcher_.stopped(); }
  int64_t tokens() const { return tokens_; }

 private:
  StreamingDecoder decoder_;
  StopMatcher matcher_;
  int64_t tokens_ = 0;
};

struct StreamState {
  // However the response ends (even before its head went out), the sequence stops.
  ~StreamState() {
    if (handle) handle->Cancel();
    if (metrics) metrics->AddHandlerTimes(times);
  }
  Prepared prepared;
  std::shared_ptr<SequenceHandle> handle;
  std::unique_ptr<TextAssembler> text;
  double timeout_seconds = 0.0;
  Metrics* metrics = nullptr;
  HandlerTimes times;
  std::vector<Clock::time_point> pushed;  // of the tokens last taken
};

// Takes the tokens the engine has for `s` (waiting up to `timeout`) and turns them into text,
// timing both; returns whether the sequence has ended.
bool TakeText(StreamState& s, std::chrono::milliseconds timeout, std::vector<int32_t>* tokens,
              std::string* text) {
  tokens->clear();
  s.pushed.clear();
  const bool ended = s.handle->Wait(timeout, tokens, &s.pushed);
  const Clock::time_point woke = Clock::now();
  if (tokens->empty()) return ended;
  s.times.handoff_seconds += std::chrono::duration<double>(woke - s.pushed.front()).count();
  ++s.times.handoffs;
  for (int32_t token : *tokens) {
    *text += s.text->Push(token);
    ++s.times.tokens;
    if (s.text->stopped()) break;
  }
  s.times.detokenize_seconds += std::chrono::duration<double>(Clock::now() - woke).count();
  return ended;
}

// Writes the whole SSE stream; false when the client went away (the sequence is cancelled).
bool WriteStream(StreamState& s, http::StreamWriter& sink) {
  const ResponseMeta& meta = s.prepared.meta;
  auto write = [&](const std::string& data) {
    const Clock::time_point start = Clock::now();
    const bool ok = sink.Write(data);
    s.times.write_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    return ok;
  };
  auto gone = [&] {
    s.handle->Cancel();
    return false;
  };
  if (meta.endpoint == Endpoint::kChatCompletions &&
      !write(SseEvent(ChunkObject(meta, "", "", /*role_chunk=*/true)))) {
    return gone();
  }
  std::vector<int32_t> tokens;
  auto last_write = Clock::now();
  std::string finish_reason;
  while (finish_reason.empty()) {
    std::string piece;
    const bool ended = TakeText(s, std::chrono::milliseconds(200), &tokens, &piece);
    if (s.text->stopped()) {
      s.handle->Cancel();  // the rest of the sequence is not wanted
      finish_reason = "stop";
    } else if (ended) {
      piece += s.text->Flush();
      if (auto error = EndError(*s.handle, s.timeout_seconds)) {
        if (!piece.empty()) write(SseEvent(ChunkObject(meta, piece, "")));
        write(SseEvent(ErrorBody(*error)));
        write("data: [DONE]\n\n");
        return true;
      }
      finish_reason = FinishReasonText(s.handle->end_reason());
    }
    if (!piece.empty()) {
      if (!write(SseEvent(ChunkObject(meta, piece, "")))) return gone();
      last_write = Clock::now();
    } else if (Clock::now() - last_write > kHeartbeat) {
      // An SSE comment: clients ignore it; a failed write shows the client is gone.
      if (!write(": keep-alive\n\n")) return gone();
      last_write = Clock::now();
    }
  }
  if (!write(SseEvent(ChunkObject(meta, "", finish_reason)))) return gone();
  if (s.prepared.include_usage) {
    Usage usage{s.handle->prompt_tokens(), s.text->tokens(), s.handle->reused_tokens()};
    if (!write(SseEvent(UsageChunkObject(meta, usage)))) return gone();
  }
  if (!write("data: [DONE]\n\n")) return gone();
  return true;
}

}  // namespace

Result<std::unique_ptr<HttpServer>> HttpServer::Create(ServingModel& model, ServerConfig config) {
  SKV_RETURN_IF_ERROR(config.kv.Validate());
  SKV_ASSIGN_OR_RETURN(auto policy, model.MakePolicy(config.kv));
  if (config.scheduler.max_batch < 1 || config.scheduler.max_queue < 0 ||
      config.scheduler.prefill_chunk < 1 || config.http.generation_threads < 1) {
    return Error(ErrorCode::kInvalidArgument,
                 "batch ({}), prefill chunk ({}) and HTTP threads ({}) must be positive and the "
                 "queue bound ({}) not negative",
                 config.scheduler.max_batch, config.scheduler.prefill_chunk,
                 config.http.generation_threads, config.scheduler.max_queue);
  }
  const http::TransportOptions& t = config.http;
  if (t.max_connections < 1 || t.max_client_connections < 1 || t.limits.max_head_bytes < 1 ||
      t.limits.max_body_bytes < 1 || !(t.header_timeout_seconds > 0) ||
      !(t.body_timeout_seconds > 0) || !(t.idle_timeout_seconds > 0) ||
      !(t.send_timeout_seconds > 0)) {
    return Error(ErrorCode::kInvalidArgument,
                 "HTTP limits (connections, header and body sizes, timeouts) must be positive");
  }
  std::unique_ptr<HttpServer> server(new HttpServer(model, std::move(config)));
  server->policies_[""] = std::move(policy);
  return server;
}

HttpServer::HttpServer(ServingModel& model, ServerConfig config)
    : model_(model),
      config_(std::move(config)),
      chat_template_(DetectChatTemplate(model.file())),
      started_(static_cast<int64_t>(std::time(nullptr))) {
  http_ = std::make_unique<http::Transport>(config_.http);
  scheduler_ = std::make_unique<Scheduler>(model_, config_.scheduler, &metrics_);
  Route();
}

HttpServer::~HttpServer() { Stop(std::chrono::milliseconds(0)); }

Result<std::pair<const kv::KvPolicy*, std::string>> HttpServer::ResolvePolicy(
    const ApiRequest& request) {
  if (!request.kv_policy && !request.kv_budget) {
    std::lock_guard lock(policies_mutex_);
    return std::make_pair(static_cast<const kv::KvPolicy*>(policies_[""].get()), std::string());
  }
  kv::KvPolicyConfig config = config_.kv;
  if (request.kv_policy) config.policy = *request.kv_policy;
  if (request.kv_budget) config.budget_tokens = *request.kv_budget;
  // Overrides that restate the server's settings share its policy (and its held states).
  const bool same =
      config.policy == config_.kv.policy && config.budget_tokens == config_.kv.budget_tokens;
  const std::string key = same ? "" : fmt::format("{}/{}", config.policy, config.budget_tokens);
  std::lock_guard lock(policies_mutex_);
  if (auto it = policies_.find(key); it != policies_.end()) {
    return std::make_pair(static_cast<const kv::KvPolicy*>(it->second.get()), key);
  }
  if (static_cast<int>(policies_.size()) >= config_.max_policies) {
    return Error(ErrorCode::kResourceExhausted,
                 "the server keeps at most {} distinct KV settings; use one of those in use",
                 config_.max_policies);
  }
  SKV_RETURN_IF_ERROR(config.Validate());
  SKV_ASSIGN_OR_RETURN(auto policy, model_.MakePolicy(config));
  const kv::KvPolicy* raw = policy.get();
  policies_[key] = std::move(policy);
  return std::make_pair(raw, key);
}

Status HttpServer::Bind() {
  SKV_RETURN_IF_ERROR(http_->Bind());
  port_ = http_->port();
  return Status::Ok();
}

bool HttpServer::Serve() { return http_->Serve(); }

void HttpServer::Stop(std::chrono::milliseconds grace) {
  if (stopping_.exchange(true)) return;
  scheduler_->Shutdown(grace);
  http_->Stop();
}

void HttpServer::Route() {
  http::Transport& http = *http_;
  http.SetLogger([this](std::string_view path, int status) {
    metrics_.CountRequest(EndpointLabel(std::string(path)), status);
  });
  http.SetErrorFormatter([](int status, std::string_view code, std::string_view message) {
    const char* type = status == 429   ? "rate_limit_error"
                       : status >= 500 ? "server_error"
                                       : "invalid_request_error";
    return Dump(ErrorBody(ApiError{status, std::string(message), type, "", std::string(code)}));
  });

  using http::Pool;
  http.Handle("GET", "/", Pool::kLight, [](const http::Request&, http::Response& res) {
    res.content_type = "text/html; charset=utf-8";
    res.body = std::string(ChatPageHtml());
  });
  http.Handle("GET", "/health", Pool::kLight, [this](const http::Request&, http::Response& res) {
    const EngineGauges g = scheduler_->gauges();
    const bool ok = !stopping_.load();
    SendJson(res, ok ? 200 : 503,
             {{"status", ok ? "ok" : "shutting_down"},
              {"running", g.running_sequences},
              {"queued", g.queue_depth},
              {"held_states", g.held_states}});
  });
  http.Handle("GET", "/metrics", Pool::kLight, [this](const http::Request&, http::Response& res) {
    res.content_type = "text/plain; version=0.0.4";
    res.body.clear();
    if (!config_.weights_label.empty()) {
      res.body = fmt::format(
          "# {}\n# HELP shadowkv_synthetic_weights 1: the weights are random, not a trained "
          "model's.\n# TYPE shadowkv_synthetic_weights gauge\nshadowkv_synthetic_weights 1\n",
          config_.weights_label);
    }
    res.body += metrics_.Render();
  });
  http.Handle("GET", "/v1/models", Pool::kLight, [this](const http::Request&, http::Response& res) {
    Json model = {{"id", config_.model_id},
                  {"object", "model"},
                  {"created", started_},
                  {"owned_by", "shadowkv"},
                  {"vocab_size", model_.config().vocab_size},
                  {"context_length", model_.config().context_length}};
    if (!config_.weights_label.empty()) {
      model["weights"] = "synthetic";
      model["label"] = config_.weights_label;
    }
    SendJson(res, 200, {{"object", "list"}, {"data", Json::array({model})}});
  });

  auto generate = [this](Endpoint endpoint) {
    return [this, endpoint](const http::Request& req, http::Response& res) {
      const Clock::time_point arrival = Clock::now();
      ApiRequest api;
      if (auto error = ParseApiRequest(req.body, endpoint, config_.limits, &api)) {
        return SendError(res, *error);
      }
      const Tokenizer& tokenizer = model_.tokenizer();
      const int64_t context = model_.config().context_length;
      Prepared p;
      SequenceRequest& seq = p.sequence;
      const char* prompt_param = "prompt";
      if (endpoint == Endpoint::kChatCompletions) {
        prompt_param = "messages";
        if (!chat_template_.ok()) {
          return SendError(res, ApiError{400,
                                         "this model has no supported chat template: " +
                                             chat_template_.status().message(),
                                         "invalid_request_error", "messages", "unsupported"});
        }
        seq.prompt = EncodeChat(tokenizer, *chat_template_, api.messages, true);
      } else if (!api.prompt_tokens.empty()) {
        for (int32_t id : api.prompt_tokens) {
          if (id >= model_.config().vocab_size) {
            return SendError(res, ApiError{400,
                                           fmt::format("token id {} is outside the "
                                                       "vocabulary of {}",
                                                       id, model_.config().vocab_size),
                                           "invalid_request_error", "prompt", "invalid_value"});
          }
        }
        seq.prompt = api.prompt_tokens;
      } else {
        seq.prompt = tokenizer.Encode(api.prompt, /*add_special=*/true, /*parse_special=*/false);
      }
      const int64_t prompt_size = static_cast<int64_t>(seq.prompt.size());
      if (prompt_size == 0) {
        // Text that encodes to nothing is not empty to its sender: its bytes have no token in
        // this vocabulary (a vocabulary missing rare bytes still loads).
        const bool had_text = endpoint == Endpoint::kCompletions && !api.prompt.empty();
        return SendError(res, ApiError{400,
                                       had_text ? "the prompt's text has no tokens in this "
                                                  "model's vocabulary (its bytes are not in it)"
                                                : "the prompt is empty",
                                       "invalid_request_error", prompt_param, "empty_prompt"});
      }
      if (prompt_size >= context) {
        return SendError(
            res, ApiError{400,
                          fmt::format("the prompt has {} tokens; the model's "
                                      "context is {} tokens and generation "
                                      "needs at least one more",
                                      prompt_size, context),
                          "invalid_request_error", prompt_param, "context_length_exceeded"});
      }
      if (api.max_tokens && prompt_size + *api.max_tokens > context) {
        return SendError(
            res, ApiError{400,
                          fmt::format("max_tokens {} plus the prompt's {} "
                                      "tokens exceeds the model's context of "
                                      "{} tokens",
                                      *api.max_tokens, prompt_size, context),
                          "invalid_request_error", "max_tokens", "context_length_exceeded"});
      }
      const int64_t fallback =
          endpoint == Endpoint::kChatCompletions ? config_.default_max_tokens : 16;
      seq.max_new_tokens =
          static_cast<int>(api.max_tokens.value_or(std::min(fallback, context - prompt_size)));
      seq.sampling = api.sampling;
      if (!api.seed_given) seq.sampling.seed = std::random_device{}();
      seq.stop_at_end_of_generation = !api.ignore_eos;
      seq.reuse = api.kv_reuse;
      seq.deadline = arrival + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(config_.request_timeout_seconds));
      auto policy = ResolvePolicy(api);
      if (!policy.ok()) {
        return SendError(res, ApiError{400, policy.status().message(), "invalid_request_error",
                                       api.kv_budget ? "kv_budget" : "kv_policy", "invalid_value"});
      }
      seq.policy = policy->first;
      seq.policy_key = policy->second;
      p.stop = api.stop;
      p.stream = api.stream;
      p.include_usage = api.include_usage;
      const uint64_t id = next_id_.fetch_add(1);
      p.meta = ResponseMeta{
          endpoint,
          fmt::format("{}-{}", endpoint == Endpoint::kChatCompletions ? "chatcmpl" : "cmpl", id),
          static_cast<int64_t>(std::time(nullptr)), config_.model_id};

      SubmitResult submitted = scheduler_->Submit(p.sequence);
      switch (submitted.code) {
        case SubmitResult::Code::kOk:
          break;
        case SubmitResult::Code::kQueueFull:
          res.headers.emplace_back("Retry-After", std::to_string(scheduler_->RetryAfterSeconds()));
          return SendError(res,
                           ApiError{429, submitted.message, "rate_limit_error", "", "queue_full"});
        case SubmitResult::Code::kShuttingDown:
          res.headers.emplace_back("Retry-After", "5");
          return SendError(res,
                           ApiError{503, submitted.message, "server_error", "", "shutting_down"});
        case SubmitResult::Code::kTooLarge:
          return SendError(res, ApiError{400, submitted.message, "invalid_request_error",
                                         "max_tokens", "kv_memory_limit"});
        case SubmitResult::Code::kInvalid:
          return SendError(res, ApiError{400, submitted.message, "invalid_request_error",
                                         prompt_param, "context_length_exceeded"});
      }

      auto state = std::make_shared<StreamState>();
      state->handle = submitted.handle;
      state->text = std::make_unique<TextAssembler>(tokenizer, p.stop);
      state->timeout_seconds = config_.request_timeout_seconds;
      state->metrics = &metrics_;
      if (p.stream) {
        state->prepared = std::move(p);
        res.content_type = "text/event-stream";
        res.headers.emplace_back("Cache-Control", "no-cache");
        res.headers.emplace_back("X-Accel-Buffering", "no");
        res.stream = [state](http::StreamWriter& sink) { WriteStream(*state, sink); };
        return;
      }
      // Whole reply: wait for the end (the deadline bounds the wait).
      std::string text;
      std::vector<int32_t> tokens;
      bool ended = false;
      while (!ended && !state->text->stopped()) {
        ended = TakeText(*state, std::chrono::milliseconds(500), &tokens, &text);
      }
      std::string finish_reason = "stop";
      if (state->text->stopped()) {
        state->handle->Cancel();
      } else {
        text += state->text->Flush();
        if (auto error = EndError(*state->handle, config_.request_timeout_seconds)) {
          return SendError(res, *error);
        }
        finish_reason = FinishReasonText(state->handle->end_reason());
      }
      Usage usage{state->handle->prompt_tokens(), state->text->tokens(),
                  state->handle->reused_tokens()};
      SendJson(res, 200, CompletionObject(p.meta, text, finish_reason, usage));
    };
  };
  http.Handle("POST", "/v1/completions", Pool::kGeneration, generate(Endpoint::kCompletions));
  http.Handle("POST", "/v1/chat/completions", Pool::kGeneration,
              generate(Endpoint::kChatCompletions));
}

}  // namespace shadowkv::server
