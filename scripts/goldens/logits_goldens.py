#!/usr/bin/env python3
"""Writes reference logits and greedy continuations of the default model, computed by llama.cpp.

Reference implementation: llama.cpp as vendored by llama-cpp-python 0.3.36, reached through
that package's ctypes bindings. See scripts/goldens/README.md for how the library was built and
for the exact output format.

Usage:
  LLAMA_CPP_LIB_PATH=/opt/llamacpp/build/bin /opt/ref/bin/python \
      scripts/goldens/logits_goldens.py prompts   # rewrites the Jargon File prompts
  LLAMA_CPP_LIB_PATH=/opt/llamacpp/build/bin /opt/ref/bin/python \
      scripts/goldens/logits_goldens.py goldens [--model PATH] [--only NAME ...]
      [--positions 0,1,n/4,n/2,n-2,n-1] [--kv-type f16|f32] [--suffix S]
"""
import argparse
import datetime
import gzip
import hashlib
import json
import os
import pathlib
import platform
import sys

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT_DIR = REPO_ROOT / "tests" / "data" / "prompts"
GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "goldens"

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# From the CHANGELOG of llama-cpp-python 0.3.36 ("update llama.cpp to ggml-org/llama.cpp@...").
LLAMA_CPP_COMMIT = "0c1e57098"
LLAMA_CPP_BUILD_FLAGS = ("-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF "
                         "-DGGML_NATIVE=ON")

JARGON_PATH = pathlib.Path("/usr/share/doc/jargon-text/jargon.txt.gz")  # Debian jargon-text 4.4.7

# name -> (prompt file, parse special tokens such as <|im_start|>).
PROMPTS = {
    "short_question": ("short_question.txt", False),
    "jargon_1k": ("jargon_1k.txt", False),
    "code_unicode_1k": ("code_unicode_1k.txt", False),
    "jargon_4k": ("jargon_4k.txt", False),
    "chat_capital": ("chat_capital.txt", True),
}

N_CTX = 8192
N_THREADS = 2
N_BATCH = 512
SEED = 1234
TOP_K = 5
NUM_CONTINUATION_TOKENS = 64


# ---------------------------------------------------------------------------------------------
# Prompt extraction from the Jargon File.

def JargonLines():
    with gzip.open(JARGON_PATH, "rt", encoding="utf-8") as handle:
        return handle.read().split("\n")


def HeadingIndex(lines, heading):
    """Index of the line that is exactly `heading` at column 0 (the table of contents is indented).
    Headings in the file use no-break spaces (U+00A0) after "Chapter" and the number."""
    matches = [i for i, line in enumerate(lines) if line.replace("\u00a0", " ") == heading]
    if len(matches) != 1:
        sys.exit(f"expected one heading {heading!r}, found {len(matches)}")
    return matches[0]


def Paragraphs(lines):
    """Joins hard-wrapped, indented paragraphs into one line each. The excerpts used here hold
    only prose paragraphs and headings, so no layout is lost."""
    paragraphs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def Excerpt(paragraphs, first_words, end_words):
    """Contiguous paragraphs from the one starting with first_words up to (not including) the one
    starting with end_words."""
    def Find(words):
        matches = [i for i, p in enumerate(paragraphs) if p.startswith(words)]
        if len(matches) != 1:
            sys.exit(f"expected one paragraph starting {words!r}, found {len(matches)}")
        return matches[0]
    return paragraphs[Find(first_words):Find(end_words)]


def WritePrompts():
    lines = JargonLines()
    # ~1K tokens: Chapter 1 from its heading through the paragraph ending "slang definitions."
    chapter1 = Paragraphs(lines[HeadingIndex(lines, "Chapter 1. Hacker Slang and Hacker Culture"):
                                HeadingIndex(lines, "Chapter 2. Of Slang, Jargon, and Techspeak")])
    text = "\n\n".join(Excerpt(chapter1, "Chapter", "Though the format is")) + "\n"
    (PROMPT_DIR / "jargon_1k.txt").write_text(text, encoding="utf-8")
    # ~4K tokens: the title of Appendix B, then its prose from the first paragraph after the table
    # of contents up to the paragraph starting "As a result of all the above traits".
    appendix_b = Paragraphs(lines[HeadingIndex(lines, "Appendix B. A Portrait of J. Random Hacker"):
                                  HeadingIndex(lines, "Appendix C. Helping Hacker Culture Grow")])
    body = Excerpt(appendix_b, "This profile reflects", "As a result of all the above traits")
    text = "\n\n".join([appendix_b[0]] + body) + "\n"
    (PROMPT_DIR / "jargon_4k.txt").write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Golden computation.

def Sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def Float32Json(value):
    """Shortest decimal that reads back (as double, then cast to float) to the same float32."""
    return float(str(np.float32(value)))


def TopK(row):
    """Top TOP_K (ids, logits) of one logit row: by logit descending, ties by smaller id."""
    # Everything >= the TOP_K-th largest value, so that ties at the boundary go to the smaller id.
    threshold = np.partition(row, row.size - TOP_K)[row.size - TOP_K]
    candidates = np.flatnonzero(row >= threshold)
    order = sorted(candidates.tolist(), key=lambda token: (-float(row[token]), token))[:TOP_K]
    return order, [Float32Json(row[token]) for token in order]


def LogSumExp(row):
    row64 = row.astype(np.float64)
    peak = row64.max()
    return float(peak + np.log(np.exp(row64 - peak).sum()))


DEFAULT_POSITIONS = "0,1,n/4,n/2,n-2,n-1"
# ggml type ids for the KV cache (enum ggml_type).
KV_TYPES = {"f16": 1, "f32": 0}


def FullLogitPositions(spec, num_tokens):
    """Positions named by spec: comma-separated terms k, n/k or n-k (integer division), with
    n = num_tokens. Out-of-range ones are dropped, duplicates removed, ascending."""
    wanted = []
    for term in spec.split(","):
        term = term.strip()
        if term.startswith("n/"):
            wanted.append(num_tokens // int(term[2:]))
        elif term.startswith("n-"):
            wanted.append(num_tokens - int(term[2:]))
        else:
            wanted.append(int(term))
    return sorted({p for p in wanted if 0 <= p < num_tokens})


def ReferenceInfo(llama_cpp, lib_dir):
    lib_path = pathlib.Path(lib_dir) / "libllama.so"
    return {
        "implementation": "llama.cpp via llama-cpp-python ctypes bindings",
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "llama_cpp_build_flags": LLAMA_CPP_BUILD_FLAGS,
        "libllama_sha256": Sha256(lib_path.resolve()),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "host": platform.machine(),
        "generated_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def ComputeGolden(llm, llama_cpp, name, reference, model_info, options):
    prompt_file, parse_special = PROMPTS[name]
    prompt_bytes = (PROMPT_DIR / prompt_file).read_bytes()
    vocab = llm._model.vocab
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    tokens = llm.tokenize(prompt_bytes, add_bos=add_bos, special=parse_special)
    num_tokens = len(tokens)
    num_vocab = llm.n_vocab()

    llm.reset()
    llm.eval(tokens)
    scores = np.array(llm.scores[:num_tokens, :], dtype=np.float32, copy=True)

    prompt_top_ids, prompt_top_logits, prompt_logsumexp = [], [], []
    for row in scores:
        ids, values = TopK(row)
        prompt_top_ids.append(ids)
        prompt_top_logits.append(values)
        prompt_logsumexp.append(LogSumExp(row))

    positions = FullLogitPositions(options.positions, num_tokens)
    logits_file = f"logits_{name}{options.suffix}.f32"
    scores[positions, :].astype("<f4").tofile(GOLDEN_DIR / logits_file)

    # Greedy continuation: each step takes the argmax (smallest id on ties) of the newest logits
    # and feeds it back through llama_decode one token at a time.
    generated, step_top_ids, step_top_logits = [], [], []
    last_logits = scores[num_tokens - 1]
    for step in range(NUM_CONTINUATION_TOKENS):
        ids, values = TopK(last_logits)
        step_top_ids.append(ids)
        step_top_logits.append(values)
        token = int(np.flatnonzero(last_logits == last_logits.max())[0])
        generated.append(token)
        if step + 1 < NUM_CONTINUATION_TOKENS:
            llm.eval([token])
            last_logits = np.array(llm.scores[llm.n_tokens - 1, :], dtype=np.float32)
    eog_steps = [i for i, token in enumerate(generated) if llama_cpp.llama_vocab_is_eog(vocab, token)]

    return {
        "format_version": 1,
        "name": name,
        "prompt_file": prompt_file,
        "prompt_text": prompt_bytes.decode("utf-8"),
        "model": model_info,
        "reference": reference,
        "settings": {
            "n_ctx": N_CTX, "n_threads": N_THREADS, "n_batch": N_BATCH, "n_ubatch": N_BATCH,
            "logits_all": True, "seed": SEED, "flash_attn": False,
            "kv_cache_type_k": options.kv_type, "kv_cache_type_v": options.kv_type,
            "add_bos": add_bos, "parse_special": parse_special,
        },
        "num_vocab": num_vocab,
        "num_tokens": num_tokens,
        "tokens": [int(t) for t in tokens],
        "full_logits": {
            "file": logits_file,
            "dtype": "float32",
            "byte_order": "little",
            "layout": "row-major [num_positions, num_vocab], row i is the logits at positions[i]",
            "positions": positions,
            "shape": [len(positions), num_vocab],
        },
        "top_k": TOP_K,
        "prompt_top_ids": prompt_top_ids,
        "prompt_top_logits": prompt_top_logits,
        "prompt_logsumexp": [round(v, 5) for v in prompt_logsumexp],
        "continuation": {
            "num_tokens": NUM_CONTINUATION_TOKENS,
            "rule": "argmax of logits (smallest id on ties), no penalties, no stop on EOS",
            "tokens": generated,
            "text": llm.detokenize(generated, prev_tokens=list(tokens), special=True).decode(
                "utf-8", errors="replace"),
            "step_top_ids": step_top_ids,
            "step_top_logits": step_top_logits,
            "eos_token_id": int(llama_cpp.llama_vocab_eos(vocab)),
            "eog_steps": eog_steps,
            "eos_occurred": bool(eog_steps),
        },
    }


def WriteGoldens(options):
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not lib_dir:
        sys.exit("set LLAMA_CPP_LIB_PATH to the directory holding the built libllama.so")
    import llama_cpp  # after the check: the import loads the library named by the variable

    model_path = options.model
    model_sha = Sha256(model_path)
    if model_sha != MODEL_SHA256:
        sys.exit(f"model sha256 {model_sha} != expected {MODEL_SHA256}")
    model_info = {"file": MODEL_FILE, "sha256": model_sha}
    reference = ReferenceInfo(llama_cpp, lib_dir)

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=N_CTX, n_threads=N_THREADS,
                          n_threads_batch=N_THREADS, n_batch=N_BATCH, n_ubatch=N_BATCH,
                          logits_all=True, seed=SEED, use_mmap=False, flash_attn=False,
                          type_k=KV_TYPES[options.kv_type], type_v=KV_TYPES[options.kv_type],
                          verbose=False)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in options.only or PROMPTS:
        golden = ComputeGolden(llm, llama_cpp, name, reference, model_info, options)
        out = GOLDEN_DIR / f"logits_{name}{options.suffix}.json"
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(golden, handle, ensure_ascii=False, separators=(",", ":"))
            handle.write("\n")
        print(f"{name}: {golden['num_tokens']} tokens, eos in continuation: "
              f"{golden['continuation']['eos_occurred']}, -> {out.name}")


def Main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prompts", help="rewrite jargon_1k.txt and jargon_4k.txt from the Jargon File")
    goldens = sub.add_parser("goldens", help="compute tests/data/goldens/logits_*")
    goldens.add_argument("--model", type=pathlib.Path, default=pathlib.Path(
        os.environ.get("SHADOWKV_MODEL", pathlib.Path.home() / ".cache/shadowkv" / MODEL_FILE)))
    goldens.add_argument("--only", nargs="*", choices=list(PROMPTS), default=None)
    goldens.add_argument("--positions", default=DEFAULT_POSITIONS,
                         help="positions whose whole logit vector goes to the .f32 file")
    goldens.add_argument("--kv-type", choices=list(KV_TYPES), default="f16",
                         help="KV cache type; f16 is llama.cpp's default, the committed goldens")
    goldens.add_argument("--suffix", default=None,
                         help="appended to output names (default: '' for f16, '_kv_f32' for f32)")
    args = parser.parse_args()
    if args.command == "prompts":
        WritePrompts()
    else:
        if args.suffix is None:
            args.suffix = "" if args.kv_type == "f16" else f"_kv_{args.kv_type}"
        WriteGoldens(args)


if __name__ == "__main__":
    Main()
