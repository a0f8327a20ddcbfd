// Rewrites the GgufWriter seeds of the GGUF fuzz corpus after a format change:
// build/tests/write_gguf_fuzz_seeds tests/fuzz/gguf_corpus (the unit test then checks them).
#include <cstdio>
#include <fstream>
#include <string>

#include "support/gguf_fuzz_seeds.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR (e.g. tests/fuzz/gguf_corpus)\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  for (const auto& [name, image] : shadowkv::gguf::fuzz_seeds::GgufFuzzSeeds()) {
    const std::string path = dir + "/" + name;
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(image.data()),
              static_cast<std::streamsize>(image.size()));
    out.close();
    // A missing directory or a full disk must not leave a corpus that only looks rewritten.
    if (!out) {
      std::fprintf(stderr, "write_gguf_fuzz_seeds: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("%s: %zu bytes\n", path.c_str(), image.size());
  }
  return 0;
}
