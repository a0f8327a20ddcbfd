# libFuzzer targets, built directly with clang++ (the main build may use g++): the GGUF reader
# fuzzer gguf_fuzz, and the ctest fuzz_gguf (label fuzz) that runs it for a bounded time.
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
    ${CMAKE_SOURCE_DIR}/src/core/status.cc)
file(GLOB GGUF_FUZZ_HEADERS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/core/*.h
     ${CMAKE_SOURCE_DIR}/src/format/*.h)
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

# The HTTP request parser's fuzzer http_request_fuzz and its bounded ctest fuzz_http_request.
set(HTTP_FUZZ_SOURCES ${CMAKE_SOURCE_DIR}/src/server/http/request_parser_fuzz.cc
                      ${CMAKE_SOURCE_DIR}/src/server/http/request_parser.cc)
set(HTTP_FUZZ_BINARY ${CMAKE_BINARY_DIR}/http_request_fuzz)
add_custom_command(
  OUTPUT ${HTTP_FUZZ_BINARY}
  COMMAND ${SHADOWKV_CLANGXX} -std=c++20 -fsanitize=fuzzer,address,undefined
          -fno-sanitize-recover=all -O1 -g -I${CMAKE_SOURCE_DIR}/src ${HTTP_FUZZ_SOURCES} -lfmt
          -o ${HTTP_FUZZ_BINARY}
  DEPENDS ${HTTP_FUZZ_SOURCES} ${CMAKE_SOURCE_DIR}/src/server/http/request_parser.h
  COMMENT "Building the HTTP request parser's libFuzzer target with clang++"
  VERBATIM)
add_custom_target(http_request_fuzz ALL DEPENDS ${HTTP_FUZZ_BINARY})
set(HTTP_FUZZ_CORPUS ${CMAKE_BINARY_DIR}/fuzz/http_request_corpus)
add_test(NAME fuzz_http_request
         COMMAND bash -c "mkdir -p \"$1\" \"$2\" && cp -f \"$3\"/* \"$1\"/ && \"$0\" -max_total_time=30 -rss_limit_mb=2048 -timeout=10 -artifact_prefix=\"$2\"/ \"$1\""
                 ${HTTP_FUZZ_BINARY} ${HTTP_FUZZ_CORPUS} ${CMAKE_BINARY_DIR}/fuzz/artifacts
                 ${CMAKE_SOURCE_DIR}/tests/fuzz/http_request_corpus)
set_tests_properties(fuzz_http_request PROPERTIES LABELS fuzz TIMEOUT 180)
