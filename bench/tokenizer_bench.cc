// Encoding speed of the default model's tokenizer on 1 MiB of the tokenizer goldens' texts.
#include <benchmark/benchmark.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "format/gguf.h"
#include "format/tokenizer.h"
#include "model/megabyte_text.h"
#include "model/model_path.h"

namespace shadowkv {
namespace {

// The text the model test round-trips (tests/model/tokenizer_model_test.cc); the default model
// comes from $SHADOWKV_MODEL or the fetch script's cache, as there.
void BM_EncodeMegabyte(benchmark::State& state) {
  auto file = gguf::GgufFile::Open(testing::DefaultModelPath());
  if (!file.ok()) return state.SkipWithError(file.status().ToString().c_str());
  auto tokenizer = Tokenizer::FromGguf(*file.value());
  if (!tokenizer.ok()) return state.SkipWithError(tokenizer.status().ToString().c_str());
  std::ifstream in(testing::DataPath("goldens/tokenizer_smollm2.json"), std::ios::binary);
  std::stringstream golden;
  golden << in.rdbuf();
  const std::string text = testing::GoldenTextsToAMegabyte(golden.str());
  size_t tokens = 0;
  for (auto _ : state) {
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text, false, false);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
}
BENCHMARK(BM_EncodeMegabyte)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace shadowkv
