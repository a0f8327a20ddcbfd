# libFuzzer targets, built directly with clang++ (the main build may use g++), each with a ctest
# (label fuzz) that runs it for a bounded time: the GGUF reader and model-config fuzzer gguf_fuzz
# (fuzz_gguf) and the HTTP request parser's http_request_fuzz (fuzz_http_request).
find_program(SHADOWKV_CLANGXX NAMES clang++ clang++-14)
if(NOT SHADOWKV_CLANGXX)
  # Still tests, so that the gap shows: skipped (exit 77) with the reason, or failed in CI,
  # where scripts/setup.sh installs clang.
  message(STATUS "shadowkv: clang++ not found; the libFuzzer targets not built, their tests skip (fail in CI)")
  set(why "clang++ not found (scripts/setup.sh installs clang and libclang-rt-dev)")
  foreach(test fuzz_gguf fuzz_http_request)
    add_test(NAME ${test}
             COMMAND bash -c "echo \"$2: $0; the fuzzer was not built\" >&2
                              case \"\${CI:-}\" in ''|0|false|FALSE|no) exit $1;; *) exit 1;; esac"
                     "${why}" ${SHADOWKV_SKIP_RETURN_CODE} ${test})
    set_tests_properties(${test} PROPERTIES LABELS fuzz
                                            SKIP_RETURN_CODE ${SHADOWKV_SKIP_RETURN_CODE})
  endforeach()
  return()
endif()
message(STATUS "shadowkv: building libFuzzer targets with ${SHADOWKV_CLANGXX}")

# shadowkv_add_fuzzer(<target> <test> <seed folder under tests/fuzz> SOURCES ... HEADERS ...)
function(shadowkv_add_fuzzer target test seeds)
  cmake_parse_arguments(FUZZ "" "" "SOURCES;HEADERS" ${ARGN})
  set(binary ${CMAKE_BINARY_DIR}/${target})
  # UB reports abort (no recovery) so that libFuzzer records them as crashes.
  add_custom_command(
    OUTPUT ${binary}
    COMMAND ${SHADOWKV_CLANGXX} -std=c++20 -fsanitize=fuzzer,address,undefined
            -fno-sanitize-recover=all -O1 -g -I${CMAKE_SOURCE_DIR}/src ${FUZZ_SOURCES} -lfmt
            -o ${binary}
    DEPENDS ${FUZZ_SOURCES} ${FUZZ_HEADERS}
    COMMENT "Building the libFuzzer target ${target} with clang++"
    VERBATIM)
  add_custom_target(${target} ALL DEPENDS ${binary})
  # Runs on a copy of the committed seeds, so inputs libFuzzer adds stay in the build tree.
  add_test(NAME ${test}
           COMMAND bash -c "mkdir -p \"$1\" \"$2\" && cp -f \"$3\"/* \"$1\"/ && \"$0\" -max_total_time=30 -rss_limit_mb=2048 -timeout=10 -artifact_prefix=\"$2\"/ \"$1\""
                   ${binary} ${CMAKE_BINARY_DIR}/fuzz/${seeds} ${CMAKE_BINARY_DIR}/fuzz/artifacts
                   ${CMAKE_SOURCE_DIR}/tests/fuzz/${seeds})
  set_tests_properties(${test} PROPERTIES LABELS fuzz TIMEOUT 180)
endfunction()

file(GLOB GGUF_FUZZ_HEADERS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/core/*.h
     ${CMAKE_SOURCE_DIR}/src/format/*.h ${CMAKE_SOURCE_DIR}/src/model/config.h)
shadowkv_add_fuzzer(gguf_fuzz fuzz_gguf gguf_corpus
  SOURCES ${CMAKE_SOURCE_DIR}/src/format/gguf_fuzz.cc ${CMAKE_SOURCE_DIR}/src/format/gguf.cc
          ${CMAKE_SOURCE_DIR}/src/format/quants.cc ${CMAKE_SOURCE_DIR}/src/model/config.cc
          ${CMAKE_SOURCE_DIR}/src/core/status.cc
  HEADERS ${GGUF_FUZZ_HEADERS})
shadowkv_add_fuzzer(http_request_fuzz fuzz_http_request http_request_corpus
  SOURCES ${CMAKE_SOURCE_DIR}/src/server/http/request_parser_fuzz.cc
          ${CMAKE_SOURCE_DIR}/src/server/http/request_parser.cc
  HEADERS ${CMAKE_SOURCE_DIR}/src/server/http/request_parser.h)
