# libFuzzer targets, built directly with clang++ (the main build may use g++): the GGUF reader
# and model-config fuzzer gguf_fuzz, and the ctest fuzz_gguf (label fuzz) that runs it for a
# bounded time.
find_program(SHADOWKV_CLANGXX NAMES clang++ clang++-14)
if(NOT SHADOWKV_CLANGXX)
  message(STATUS "shadowkv: clang++ not found; not building gguf_fuzz or adding the fuzz_gguf test")
  return()
endif()
message(STATUS "shadowkv: building libFuzzer targets with ${SHADOWKV_CLANGXX}")

set(GGUF_FUZZ_SOURCES
    ${CMAKE_SOURCE_DIR}/src/format/gguf_fuzz.cc
    ${CMAKE_SOURCE_DIR}/src/format/gguf.cc
    ${CMAKE_SOURCE_DIR}/src/format/quants.cc
    ${CMAKE_SOURCE_DIR}/src/model/config.cc
    ${CMAKE_SOURCE_DIR}/src/core/status.cc)
file(GLOB GGUF_FUZZ_HEADERS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/core/*.h
     ${CMAKE_SOURCE_DIR}/src/format/*.h ${CMAKE_SOURCE_DIR}/src/model/config.h
     ${CMAKE_SOURCE_DIR}/src/ops/cpu/rope.h)
set(GGUF_FUZZ_BINARY ${CMAKE_BINARY_DIR}/gguf_fuzz)

# UB reports abort (no recovery) so that libFuzzer records them as crashes.
add_custom_command(
  OUTPUT ${GGUF_FUZZ_BINARY}
  COMMAND ${SHADOWKV_CLANGXX} -std=c++20 -fsanitize=fuzzer,address,undefined
          -fno-sanitize-recover=all -O1 -g -I${CMAKE_SOURCE_DIR}/src ${GGUF_FUZZ_SOURCES} -lfmt
          -o ${GGUF_FUZZ_BINARY}
  DEPENDS ${GGUF_FUZZ_SOURCES} ${GGUF_FUZZ_HEADERS}
  COMMENT "Building the GGUF libFuzzer target with clang++"
  VERBATIM)
add_custom_target(gguf_fuzz ALL DEPENDS ${GGUF_FUZZ_BINARY})

# Runs on a copy of the committed seeds, so inputs libFuzzer adds stay in the build tree.
set(GGUF_FUZZ_CORPUS ${CMAKE_BINARY_DIR}/fuzz/gguf_corpus)
add_test(NAME fuzz_gguf
         COMMAND bash -c "mkdir -p \"$1\" \"$2\" && cp -f \"$3\"/* \"$1\"/ && \"$0\" -max_total_time=30 -rss_limit_mb=2048 -timeout=10 -artifact_prefix=\"$2\"/ \"$1\""
                 ${GGUF_FUZZ_BINARY} ${GGUF_FUZZ_CORPUS} ${CMAKE_BINARY_DIR}/fuzz/artifacts
                 ${CMAKE_SOURCE_DIR}/tests/fuzz/gguf_corpus)
set_tests_properties(fuzz_gguf PROPERTIES LABELS fuzz TIMEOUT 180)
