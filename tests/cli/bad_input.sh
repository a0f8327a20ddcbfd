#!/usr/bin/env bash
# The shadowkv binary given bad input: a clear message naming the problem, exit code 1 or 2,
# never a crash (signals give codes above 128).
set -u
bin=$1
model=${SHADOWKV_MODEL:-$HOME/.cache/shadowkv/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passes=0

# expect_error NAME PATTERN COMMAND...: the command must fail cleanly and print PATTERN on stderr.
expect_error() {
  local name=$1 pattern=$2
  shift 2
  "$@" > "$tmp/out" 2> "$tmp/err"
  local code=$?
  if [ $code -eq 0 ] || [ $code -gt 2 ]; then
    echo "FAIL $name: exit code $code"; cat "$tmp/err"; failures=$((failures + 1)); return
  fi
  if ! grep -qiE "$pattern" "$tmp/err"; then
    echo "FAIL $name: stderr lacks /$pattern/:"; cat "$tmp/err"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $(head -c 160 "$tmp/err" | head -n 1)"
  passes=$((passes + 1))
}

head -c 1000000 "$model" > "$tmp/truncated.gguf"
printf 'NOTAGGUFFILE%.0s' {1..10} > "$tmp/garbage.gguf"
python3 - "$tmp/mamba.gguf" <<'PY'
import struct, sys
def string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b
# GGUF v3: magic, version, tensor count, metadata count, one string key-value.
data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("general.architecture")
data += struct.pack("<I", 8) + string("mamba")
open(sys.argv[1], "wb").write(data)
PY
python3 -c "print('word ' * 20000)" > "$tmp/long.txt"

expect_error missing_model "no such file|cannot open|not found" "$bin" generate -m "$tmp/none.gguf" -p hi
expect_error truncated_model "past the end|truncated|beyond" "$bin" generate -m "$tmp/truncated.gguf" -p hi
expect_error garbage_model "magic|not a gguf" "$bin" generate -m "$tmp/garbage.gguf" -p hi
expect_error unknown_arch "mamba.*not supported.*llama" "$bin" generate -m "$tmp/mamba.gguf" -p hi
expect_error prompt_too_long "exceeds the model's context of 8192" "$bin" generate -m "$model" -f "$tmp/long.txt"
expect_error too_many_tokens "exceeds the model's context" "$bin" generate -m "$model" -p hi -n 9000
expect_error unknown_policy "unknown KV policy 'bogus'" "$bin" generate -m "$model" -p hi --kv bogus
expect_error bad_temperature "temperature" "$bin" generate -m "$model" -p hi --temp -1
expect_error bad_top_p "top_p" "$bin" generate -m "$model" -p hi --top-p 1.5
expect_error zero_chunk "chunk size 0" "$bin" generate -m "$model" -p hi --kv shadowkv --chunk-size 0
expect_error bad_flag "unknown|extra|not expected|The following argument" "$bin" generate --no-such-flag
expect_error no_prompt "no prompt" "$bin" generate -m "$model"
expect_error missing_prompt_file "cannot read prompt file" "$bin" generate -m "$model" -f "$tmp/none.txt"
expect_error bad_bench_context "not a number" "$bin" bench -m "$model" --context 12x
expect_error bad_bench_variant "unknown setting 'colour'" "$bin" bench -m "$model" --kv shadowkv:colour=red
expect_error bad_bench_fp8 "fp8_values must be 0 or 1" "$bin" bench -m "$model" --kv shadowkv:fp8_values=3
expect_error paper_and_rank "paper fixes --rank" "$bin" generate -m "$model" -p hi --kv shadowkv --paper --rank 64
expect_error paper_and_variant "paper=1 fixes 'rank'" "$bin" bench -m "$model" --paper --kv shadowkv:rank=64
expect_error fp8_keys_alone "needs exact_keys=1" "$bin" generate -m "$model" -p hi --kv shadowkv --fp8-keys
# --kv takes one variant in generate and serve as in bench and eval; the accurate setting is
# ShadowKV's and not the published one's.
expect_error generate_bad_variant "unknown setting 'colour'" "$bin" generate -m "$model" -p hi --kv shadowkv:colour=red
expect_error accurate_value "accurate must be 0 or 1" "$bin" generate -m "$model" -p hi --kv shadowkv:accurate=2
expect_error accurate_and_paper "not one with paper=1" "$bin" generate -m "$model" -p hi --kv shadowkv:accurate=1:paper=1
expect_error accurate_quest "accurate=1 is a ShadowKV setting" "$bin" serve -m "$model" --kv quest:accurate=1
# Tensor parallelism is CUDA-only: on the CPU paths it is refused, naming what is missing.
expect_error tp_generate_cpu "needs --device cuda" "$bin" generate -m "$model" -p hi --tensor-parallel 2
expect_error tp_bench_cpu "needs --device cuda" "$bin" bench -m "$model" --tensor-parallel 2
# The CUDA kernels' tuning flags check their ranges while parsing, on every build.
expect_error bad_split_share "split-share.*not in range" "$bin" bench -m "$model" --split-share 95
expect_error bad_rebuild_slots "rebuild-slots.*not in" "$bin" bench -m "$model" --rebuild-slots 48
expect_error bad_attention_splits "attention-splits.*not in range" "$bin" bench -m "$model" --attention-splits 65
expect_error bad_shadowkv_kernels "shadowkv-kernels.*not in" "$bin" bench -m "$model" --shadowkv-kernels 2
expect_error synthetic_bench_cpu "needs --device cuda" "$bin" bench --synthetic llama3-8b --device cpu
# Without --device, --synthetic takes the GPU path: a build without CUDA says so, a CUDA build
# stops at the bad context before touching a GPU.
expect_error synthetic_bench_default "without CUDA|not a positive number" "$bin" bench --synthetic llama3-8b --context 12x
expect_error tp_serve_cpu "needs --device cuda" "$bin" serve -m "$model" --tensor-parallel 2
expect_error serve_pool_cpu "GPU's pool" "$bin" serve -m "$model" --ctx-size 512
# serve --synthetic: GPU only, no model file, a known name; a build without CUDA says so (a CUDA
# build refuses the KV policy first, before any GPU work).
expect_error synthetic_serve_cpu "synthetic needs --device cuda" "$bin" serve --synthetic llama3-8b
expect_error synthetic_serve_model "takes no model file" "$bin" serve --synthetic llama3-8b --device cuda -m "$model"
expect_error synthetic_serve_name "no synthetic model 'gpt-5'.*llama3-8b" "$bin" serve --synthetic gpt-5 --device cuda
expect_error synthetic_serve_build "without CUDA|full or shadowkv" "$bin" serve --synthetic llama3-8b --device cuda --kv snapkv
expect_error serve_prefill_slots_full "prefill-slots sizes ShadowKV" "$bin" serve -m "$model" --device cuda --kv full --prefill-slots 2
# How held ShadowKV sequences take later turns is the GPU's choice, and only ShadowKV's.
expect_error serve_held_turns_cpu "held-turns is the GPU's" "$bin" serve -m "$model" --held-turns exact
expect_error serve_held_turns_full "held-turns chooses" "$bin" serve -m "$model" --device cuda --kv full --held-turns decode
expect_error eval_held_turns_cpu "held-turns chooses the GPU's" "$bin" eval -m "$model" --multi-turn 2 --held-turns decode
expect_error eval_held_turns_alone "requires --multi-turn" "$bin" eval -m "$model" --held-turns decode
for command in generate bench eval serve; do
  expect_error "device_$command" "device: gpu not in \{cpu,cuda\}" "$bin" "$command" -m "$model" \
    --device gpu
done
expect_error tp_zero "tensor-parallel" "$bin" generate -m "$model" -p hi --tensor-parallel 0

echo "$passes passed, $failures failed"
[ $failures -eq 0 ]
