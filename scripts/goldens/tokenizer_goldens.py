#!/usr/bin/env python3
"""Writes reference token ids for a set of tricky strings, computed by llama.cpp's llama-tokenize.

llama.cpp is an independent tokenizer implementation; nothing here comes from shadowkv. Each
string is written to a file and tokenized with

    llama-tokenize -m MODEL -f FILE --ids --no-escape --log-disable [--no-bos] [--no-parse-special]

and the printed id list is stored with the string in tests/data/goldens/tokenizer_<name>.json.
tests/model/tokenizer_model_test.cc checks that shadowkv's tokenizer gives the same ids.

Vocabularies: the default model (SmolLM2-135M-Instruct, pre-tokenizer "smollm"), and, when
--vocab-dir holds them, llama.cpp's vocabulary-only test files ggml-vocab-llama-bpe.gguf
(Llama 3, "llama-bpe"), ggml-vocab-qwen2.gguf ("qwen2") and ggml-vocab-gpt-2.gguf ("gpt-2").

Usage:
  python3 scripts/goldens/tokenizer_goldens.py \\
      --llama-tokenize /opt/llamacpp/build/bin/llama-tokenize \\
      --model ~/.cache/shadowkv/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --vocab-dir /opt/llamacpp/src/models
"""
import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "goldens"

# Written for this test set: plain English prose of about a thousand tokens.
PARAGRAPH = (
    "The lighthouse on the northern point was built in 1871, after three ships were lost on the "
    "reef within a single winter. Its first keeper, a former schoolteacher named Elias Brandt, "
    "kept a log in a careful, slanting hand: the direction of the wind, the height of the swell, "
    "the number of vessels that passed, and now and then a line about the birds that struck the "
    "lantern glass during the autumn migration. The log survives, and reading it today one is "
    "struck less by the storms than by the routine. Every evening the wick was trimmed, the brass "
    "was polished, and the great lens, nearly two metres tall, was wiped free of salt. Every "
    "morning the curtains were drawn around it so that the sun, focused through the same glass "
    "that threw the light twenty miles out to sea, would not set the lamp room on fire. "
    "Brandt's successors were less diligent writers. His daughter, who took over the station "
    "when he fell ill in 1893, recorded little beyond the weather, though her entries become "
    "longer and stranger in the years before the First World War, when she began to note the "
    "lights of steamers she could not identify and the sound, on still nights, of engines far "
    "offshore. Historians have argued about those entries for decades. Some read them as "
    "evidence of smuggling along the coast; others suspect that a lonely woman, with little "
    "company but the gulls and the supply boat that came once a fortnight, simply let her "
    "imagination fill the dark. The truth is probably duller than either story, and it is "
    "unlikely that we will ever know it. What is clear is that the light itself never failed. "
    "Through gales that tore the roof from the oil store, through a fire in the keeper's "
    "cottage, and through an outbreak of influenza that left the family too weak to climb the "
    "tower more than once a night, the lamp was lit at dusk and put out at dawn. "
    "The technology changed around the keepers faster than their habits did. Paraffin replaced "
    "whale oil, and an incandescent mantle replaced the wick; a clockwork mechanism, wound by "
    "hand every few hours, turned the lens so that the beam swept the water in a pattern that "
    "sailors could recognise: two flashes, a pause, then a third. Later still came electricity, "
    "delivered at first by a diesel generator that the keepers loathed for its noise and its "
    "smell, and then by a cable laid along the causeway. Each change made the work lighter and "
    "the station less dependent on the people who lived there, and each was greeted in the log "
    "with a mixture of relief and suspicion. When the automatic lamp changer was installed in "
    "1962, the last keeper wrote only that it was a clever thing and that he hoped it would "
    "not need him. It did not. The station was automated the following year, and the family "
    "that had tended the light for almost a century moved to a town inland, where, according "
    "to a granddaughter interviewed much later, they found it difficult to sleep without the "
    "slow turning of the beam across the bedroom ceiling. "
    "Today the tower is a small museum. Visitors climb the spiral stair, one hundred and "
    "fourteen steps, to stand beside the old lens, which no longer turns. A modern light, "
    "smaller than a dinner plate and powered by a solar panel, sits on a railing outside and "
    "does the work that once required a family, a boat, and a ton of oil a season. The museum's "
    "guides like to point out that the new light is brighter than the old one, and that it can "
    "be monitored from an office two hundred kilometres away. They also like to point out the "
    "scratches on the lamp room floor, worn by generations of boots walking the same small "
    "circle around the lens, night after night, to check that nothing had gone wrong. "
    "It is tempting to treat a place like this as a monument to obsolete labour, and in a "
    "sense it is. But the log books suggest something else as well. The keepers were not only "
    "operating a machine; they were paying attention. They noticed the fishing boats that "
    "were late coming home, the change in the colour of the sea before a storm, the year the "
    "puffins did not return. Much of what they wrote down was never read by anyone in "
    "authority, and much of it was of no practical use. Yet taken together, the entries form "
    "one of the longest continuous records of weather and wildlife on that stretch of coast, "
    "and researchers studying changes in seabird populations have found them unexpectedly "
    "valuable. The light was meant to keep ships off the rocks. The attention of the people "
    "who kept it turned out to have a value of its own, one that nobody had planned for and "
    "that no automatic system was designed to replace. "
    "Perhaps that is the lesson the museum is trying, quietly, to teach. Machines do what "
    "they are built to do, and they usually do it well. People, left alone with a task and a "
    "great deal of time, tend to do a little more than they are asked, and some of that extra "
    "work, written in a slanting hand in a book that smells of salt and paraffin, outlasts "
    "the task itself."
)

CPP_SNIPPET = """#include <vector>

// Sums the even values.
int SumEven(const std::vector<int>& values) {
  int total = 0;
  for (int value : values) {
    if (value % 2 == 0) {
      total += value;  // keep it
    }
  }
  return total;
}
"""

PYTHON_SNIPPET = """def fib(n: int) -> list[int]:
    \"\"\"First n Fibonacci numbers.\"\"\"
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


if __name__ == "__main__":
\tprint(fib(10))  # tab-indented on purpose
"""

SMOLLM2_CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 12*34?<|im_end|>\n"
                "<|im_start|>assistant\n")

# (name, text, parse_special); every case is tokenized without BOS, and the "with_bos" case
# also with the model's BOS rule (add_special).
CASES = [
    ("hello", "Hello, world!", True),
    ("space_runs", "a  b   c    d     e", True),
    ("leading_trailing_spaces", "   leading and trailing   ", True),
    ("only_spaces", "      ", True),
    ("tabs", "col1\tcol2\t\tcol3\t", True),
    ("newlines", "line1\nline2\n\nline3\r\nline4\r\n\r\n  indented\n\n\n", True),
    ("only_newlines", "\n\n\n\n", True),
    ("digits", "1234567890 and 3.14159, 1,000,000; 2024-11-29 v1.2.3 0x1F 007 42nd", True),
    ("long_number", "31415926535897932384626433832795028841971693993751", True),
    ("contractions", "It's, don't, they're, we've, I'm, you'll, he'd; "
                     "IT'S DON'T THEY'RE We'Ve 'quoted' o'clock", True),
    ("mixed_case", "camelCaseIdentifier snake_case_name SCREAMING_CASE McDonald iPhone "
                   "XMLHttpRequest", True),
    ("punctuation", "Wait... what?!? (yes) [no] {maybe} <tag/> --- *** ### @user #hash $100 "
                    "50% a&b ~/path \\escaped\\ `code` \"quote\" 'single'", True),
    ("accents", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m fa\u00e7ade "
                "jalape\u00f1o Z\u00fcrich", True),
    ("combining_marks", "e\u0301 a\u0308 n\u0303 (decomposed) vs \u00e9 \u00e4 \u00f1; "
                        "Z\u0351\u0352a\u0353l\u0354g\u0355o", True),
    ("cjk", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002"
            "\u4e2d\u6587\u6587\u672c\uff0c\u8fd8\u6709\u6807\u70b9\uff01 "
            "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", True),
    ("cyrillic", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! "
                 "\u0421\u044a\u0435\u0448\u044c \u0436\u0435 \u0435\u0449\u0451 "
                 "\u044d\u0442\u0438\u0445 \u043c\u044f\u0433\u043a\u0438\u0445 "
                 "\u0431\u0443\u043b\u043e\u043a.", True),
    ("arabic_hebrew", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645"
                      "\u060c \u0647\u0630\u0627 \u0646\u0635 \u0639\u0631\u0628\u064a "
                      "\u0661\u0662\u0663. \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
     True),
    ("greek_math", "\u03b1\u03b2\u03b3 \u0394\u0395\u0396 \u2211\u222b\u221a\u221e \u2260 "
                   "\u2264 \u2265 \u00bd \u00be \u00b2 \u00b3 \u2163 x\u00b2+y\u00b2", True),
    ("emoji", "I \u2764\ufe0f emoji \U0001F600\U0001F603 \U0001F44D\U0001F3FD "
              "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 "
              "\U0001F3F3\ufe0f\u200d\U0001F308 \U0001F1EB\U0001F1F7\U0001F1EF\U0001F1F5 "
              "\u2728!", True),
    ("unicode_spaces", "non\u00a0breaking\u3000ideographic\u2009thin\u200bzero\u2028line "
                       "\x0bvt\x0cff", True),
    ("cpp_code", CPP_SNIPPET, True),
    ("python_code", PYTHON_SNIPPET, True),
    ("json", '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n"}, "empty": {}}', True),
    ("url_email", "https://example.com/path?q=1&r=2#frag user.name+tag@example.org", True),
    ("chatml_special", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True),
    ("chatml_not_special", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    ("special_edges", "x<|im_end|><|im_end|>y <|im_start|user <|endoftext|>z", True),
    ("llama3_special", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                       "hi<|eot_id|>", True),
    ("smollm2_chat_prompt", SMOLLM2_CHAT, True),
    ("repeated_letters", "a" * 300, True),
    ("repeated_punctuation", "=" * 100 + "-" * 50 + "." * 20, True),
    ("spaces_then_word", " " * 50 + "x", True),
    ("paragraph", PARAGRAPH, True),
    ("with_bos", "Hello there", True),
]

# (golden name, file name in --vocab-dir or None for --model).
VOCABS = [
    ("smollm2", None),
    ("llama_bpe", "ggml-vocab-llama-bpe.gguf"),
    ("qwen2", "ggml-vocab-qwen2.gguf"),
    ("gpt2", "ggml-vocab-gpt-2.gguf"),
]


def sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenize(tool: str, model: pathlib.Path, text: str, add_special: bool,
             parse_special: bool) -> list:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        command = [tool, "-m", str(model), "-f", path, "--ids", "--no-escape", "--log-disable"]
        if not add_special:
            command.append("--no-bos")
        if not parse_special:
            command.append("--no-parse-special")
        result = subprocess.run(command, capture_output=True, check=True)
    finally:
        os.unlink(path)
    # The id list is the last line: "[1, 2, 3]".
    line = result.stdout.decode("utf-8").strip().splitlines()[-1]
    return json.loads(line)


def to_json(golden: dict) -> str:
    """Indented JSON with each id list kept on one line."""
    text = json.dumps(golden, ensure_ascii=False, indent=1)
    text = re.sub(r'"ids": \[\s*((?:-?\d+,\s*)*-?\d+)\s*\]',
                  lambda m: '"ids": [' + ", ".join(m.group(1).replace(",", " ").split()) + "]",
                  text)
    return text + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-tokenize", default="/opt/llamacpp/build/bin/llama-tokenize")
    parser.add_argument("--model", default=os.path.expanduser(
        "~/.cache/shadowkv/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--vocab-dir", default="/opt/llamacpp/src/models")
    parser.add_argument("--out-dir", default=str(GOLDEN_DIR))
    args = parser.parse_args()

    version = subprocess.run([args.llama_tokenize, "--version"], capture_output=True,
                             text=True).stderr.strip()
    for name, vocab_file in VOCABS:
        model = pathlib.Path(args.model if vocab_file is None
                             else os.path.join(args.vocab_dir, vocab_file))
        if not model.exists():
            print(f"skipping {name}: {model} not found", file=sys.stderr)
            continue
        cases = []
        for case_name, text, parse_special in CASES:
            for add_special in ([False, True] if case_name == "with_bos" else [False]):
                cases.append({
                    "name": case_name + ("_add_special" if add_special else ""),
                    "text": text,
                    "add_special": add_special,
                    "parse_special": parse_special,
                    "ids": tokenize(args.llama_tokenize, model, text, add_special, parse_special),
                })
        golden = {
            "reference": {
                "tool": "llama.cpp llama-tokenize",
                "version": version.replace("\n", "; "),
                "command": "llama-tokenize -m MODEL -f TEXT_FILE --ids --no-escape "
                           "--log-disable [--no-bos unless add_special] "
                           "[--no-parse-special unless parse_special]",
            },
            "model_file": model.name,
            "model_sha256": sha256(model),
            "cases": cases,
        }
        out = pathlib.Path(args.out_dir) / f"tokenizer_{name}.json"
        with open(out, "w", encoding="utf-8") as f:
            f.write(to_json(golden))
        print(f"wrote {out} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
